"""The CPUs a process may use (affinity, cgroup quota, Slurm) and the DALI threads per pipeline they give each
rank: the functions under given cgroup files and environments, and two real torchrun ranks on 2 CPUs."""

from __future__ import annotations

import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dalifeed.budget import CPU_DECODE_MAX_THREADS, MIXED_DECODE_MAX_THREADS, ranks_on_node, thread_budget
from dalifeed.pipelines import AugmentConfig, open_dataset
from dalifeed.runtime import cgroup_cpu_quota, usable_cores
from helpers import kill_run


def cgroup(tmp_path: Path, files: dict[str, str], own: str = "0::/") -> dict:
    """A fake /sys/fs/cgroup under tmp_path holding `files` (path -> content) and a /proc/self/cgroup saying
    this process is in `own`: the keyword arguments usable_cores and cgroup_cpu_quota take."""
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    root.mkdir(exist_ok=True)
    (tmp_path / "proc-cgroup").write_text(own + "\n")
    return {"cgroup_root": root, "proc_cgroup": tmp_path / "proc-cgroup"}


@pytest.mark.parametrize("files, own, cores", [
    ({}, "0::/", 8),  # no cgroup files: the affinity mask
    ({"cpu.max": "max 100000"}, "0::/", 8),  # v2 without a quota
    ({"cpu.max": "150000 100000"}, "0::/", 2),  # docker --cpus 1.5: rounded up
    ({"cpu.max": "20000 100000"}, "0::/", 1),  # a fifth of a CPU: still one
    # v2, the kernel enforces the smallest quota on the way to the root
    ({"cpu.max": "max 100000", "job/cpu.max": "400000 100000", "job/step/cpu.max": "max 100000"},
     "0::/job/step", 4),
    ({"job/cpu.max": "1200000 100000", "job/step/cpu.max": "300000 100000"}, "0::/job/step", 3),
    ({"cpu/cpu.cfs_quota_us": "300000", "cpu/cpu.cfs_period_us": "100000"}, "3:cpu:/", 3),  # v1
    ({"cpu/cpu.cfs_quota_us": "-1", "cpu/cpu.cfs_period_us": "100000"}, "3:cpu:/", 8),  # v1, no quota
    ({"cpu,cpuacct/kube/cpu.cfs_quota_us": "200000", "cpu,cpuacct/kube/cpu.cfs_period_us": "100000"},
     "0::/\n4:cpu,cpuacct:/kube", 2),
])
def test_usable_cores_is_the_smallest_of_affinity_and_cgroup_quota(tmp_path, files, own, cores):
    assert usable_cores(affinity=8, environ={}, **cgroup(tmp_path, files, own)) == cores


@pytest.mark.parametrize("files, own, limit", [
    ({}, "0::/", 64 * 2**30),  # no cgroup files: the machine's memory
    ({"memory.max": "max"}, "0::/", 64 * 2**30),
    ({"memory.max": "max", "pod/memory.max": str(8 * 2**30), "pod/c/memory.max": "max"}, "0::/pod/c", 8 * 2**30),
    ({"memory/memory.limit_in_bytes": str(4 * 2**30)}, "5:memory:/", 4 * 2**30),  # v1
    ({"memory/slurm/memory.limit_in_bytes": str(2 * 2**30)}, "0::/\n5:memory:/slurm", 2 * 2**30),
])
def test_usable_memory_is_the_smallest_of_the_machines_and_the_cgroup_limits(tmp_path, files, own, limit):
    from dalifeed.runtime import usable_memory

    assert usable_memory(physical=64 * 2**30, **cgroup(tmp_path, files, own)) == limit


def test_slurm_cpus_per_task_limits_the_cores_and_nonsense_is_ignored(tmp_path):
    paths = cgroup(tmp_path, {"cpu.max": "300000 100000"})
    assert usable_cores(affinity=64, environ={"SLURM_CPUS_PER_TASK": "8"}, **paths) == 3  # the quota is smaller
    assert usable_cores(affinity=64, environ={"SLURM_CPUS_PER_TASK": "2"}, **paths) == 2
    for nonsense in ("", "0", "two", "-4"):
        assert usable_cores(affinity=64, environ={"SLURM_CPUS_PER_TASK": nonsense}, **paths) == 3


def quotas_on_this_machine() -> list[float]:
    """Every CPU quota (CPUs' worth) set on this process's cgroups and their ancestors, read from the kernel's
    files here and now: cgroup v2's cpu.max ("max" or "QUOTA PERIOD") and v1's cfs_quota_us (-1: none)."""
    root, quotas = Path("/sys/fs/cgroup"), []
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, own = line.split(":", 2)
        if controllers == "":
            folders, names = [root], ("cpu.max",)
        elif "cpu" in controllers.split(","):
            folders, names = [root / "cpu", root / "cpu,cpuacct"], ("cpu.cfs_quota_us", "cpu.cfs_period_us")
        else:
            continue
        for folder in folders:
            path = folder / own.strip("/")
            for level in [path, *path.parents]:
                if len(level.parts) < len(folder.parts):
                    break
                if names == ("cpu.max",) and (level / "cpu.max").exists():
                    quota, period = (level / "cpu.max").read_text().split()
                    quotas += [] if quota == "max" else [int(quota) / int(period)]
                elif names != ("cpu.max",) and (level / names[0]).exists():
                    quota, period = (int((level / name).read_text()) for name in names)
                    quotas += [] if quota == -1 else [quota / period]
    return quotas


def test_this_machines_quota_and_cores_are_what_its_cgroup_files_say():
    quotas = quotas_on_this_machine()
    assert cgroup_cpu_quota() == (min(quotas) if quotas else None)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cores(environ={}) == max(1, min([affinity] + [math.ceil(q) for q in quotas]))


@pytest.mark.parametrize("device, cores, environ, visible, threads, ranks", [
    ("cpu", 2, {"LOCAL_WORLD_SIZE": "2"}, 0, 1, 2),  # the 2-core CI machine under torchrun
    ("cpu", 2, {}, 0, 2, 1),
    ("cpu", 3, {"LOCAL_WORLD_SIZE": "8"}, 0, 1, 8),  # never 0
    ("gpu", 64, {"LOCAL_WORLD_SIZE": "8"}, 8, MIXED_DECODE_MAX_THREADS, 8),  # 8 each: capped
    ("hybrid", 64, {"LOCAL_WORLD_SIZE": "8"}, 8, 8, 8),  # CPU decoding takes its 8
    ("hybrid", 224, {"LOCAL_WORLD_SIZE": "8"}, 8, CPU_DECODE_MAX_THREADS, 8),  # 28 each: capped
    ("gpu", 224, {"LOCAL_WORLD_SIZE": "8"}, 8, MIXED_DECODE_MAX_THREADS, 8),
    ("gpu", 16, {"LOCAL_WORLD_SIZE": "8"}, 8, 2, 8),
    ("gpu", 64, {}, 8, MIXED_DECODE_MAX_THREADS, 1),  # one process on an 8-GPU node uses one GPU
    ("hybrid", 64, {"WORLD_SIZE": "16"}, 8, 8, 8),  # a launcher without LOCAL_WORLD_SIZE: a rank per GPU
    ("hybrid", 64, {"WORLD_SIZE": "2"}, 8, 16, 2),  # ... but not more ranks than the job has
    ("cpu", 64, {"WORLD_SIZE": "16"}, 0, 16, 1),  # CPU ranks: nothing says how many share this node
])
def test_thread_budget_is_the_ranks_share_of_the_cores_capped(device, cores, environ, visible, threads, ranks):
    budget = thread_budget(device, cores=cores, visible_gpus=visible, environ=environ)
    assert (budget.threads, budget.ranks_on_node, budget.cores) == (threads, ranks, cores)
    assert budget.describe().startswith(f"DALI threads per pipeline: {threads} ({cores} CPUs")
    assert ("capped at" in budget.describe()) == (cores // ranks > budget.cap)


def test_the_printed_budget_never_says_0_threads_when_ranks_outnumber_the_cpus():
    budget = thread_budget("cpu", cores=3, visible_gpus=0, environ={"LOCAL_WORLD_SIZE": "8"})
    assert budget.describe() == ("DALI threads per pipeline: 1 (3 CPUs this process may use / 8 rank(s) on this "
                                 "node = less than 1, so at least 1)")


def test_ranks_on_node_prefers_torchruns_local_world_size():
    assert ranks_on_node(True, 8, {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "32"}) == 4
    assert ranks_on_node(True, 8, {"LOCAL_WORLD_SIZE": "x", "WORLD_SIZE": "1"}) == 1


def dali_pool_threads(pid: int) -> int:
    """Threads of DALI pipelines' worker pools in process `pid` (named "[DALI][TP<i>]Exec"; the
    executor's and the reader's threads have other names)."""
    count = 0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            count += (task / "comm").read_text().startswith("[DALI][TP")
        except OSError:  # the thread ended while we looked
            pass
    return count


@pytest.mark.slow  # two dali-train ranks under torchrun: ~30-60 s on 2 cores
def test_two_ranks_on_two_cpus_run_one_dali_thread_each_and_two_pipelines_at_most(make_shards, tmp_path):
    """With 2 ranks on a node whose job may use 2 CPUs (SLURM_CPUS_PER_TASK=2, whatever the machine has), each
    rank's pipelines get 1 DALI thread by default, and a rank holds at most two pipelines at once: an epoch's
    and the next epoch's, started near its end, then the next epoch's (idle) and validation's; never the
    epoch's training pipeline beside validation's. Its DALI worker threads, sampled while it trains and
    evaluates, never exceed 2."""
    _, shards = make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                            samples_per_shard=10)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "dalifeed.train.cli", "--data", str(shards),
               "--out", str(tmp_path / "run"), "--epochs", "3", "--model", "resnet18", "--width", "8",
               "--image-size", "16", "--batch-size", "8", "--optimizer", "adamw", "--lr", "0.032"]
    env = dict(os.environ, SLURM_CPUS_PER_TASK="2", OMP_NUM_THREADS="1")
    log = tmp_path / "log.txt"
    with open(log, "w") as output:
        agent = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    most: dict[int, int] = {}
    seen_one: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while agent.poll() is None and time.monotonic() < deadline:
            for worker in psutil.Process(agent.pid).children(recursive=True):
                threads = dali_pool_threads(worker.pid)
                most[worker.pid] = max(most.get(worker.pid, 0), threads)
                if threads >= 1:
                    seen_one.add(worker.pid)
            time.sleep(0.02)
    finally:
        if agent.poll() is None:
            kill_run(agent)
    output = log.read_text()
    assert agent.wait(timeout=30) == 0, output[-3000:]
    assert all(threads <= 2 for threads in most.values()), most
    assert len(seen_one) == 2, (most, output[-2000:])  # both ranks were seen running their pipeline
    assert "DALI threads per pipeline: 1 (2 CPUs this process may use / 2 rank(s) on this node = 1)" in output


def test_mixed_datasets_share_one_thread_budget(make_shards):
    """Several --data datasets train through one pipeline each, all at once: their threads add up to the rank's
    one budget, dealt by their shares of the batch (each at least one), not the budget each; evaluation reads
    one dataset at a time with the whole budget."""
    from dalifeed.pipelines import make_loader
    from dalifeed.pipelines.mixing import share_threads

    data = [make_shards({"train": {"red": n, "blue": n}, "val": {"red": 3, "blue": 3}}, seed=n)[1]
            for n in (24, 16, 12)]
    loader = make_loader(open_dataset(data, weights=[2, 1, 1]), "train", 16, augment=AugmentConfig(image_size=16),
                         device="cpu", num_threads=6)
    assert [d.options.batch_size for d in loader.loaders] == [8, 4, 4]
    assert [d.options.num_threads for d in loader.loaders] == [3, 2, 1]  # 6 by 2:1:1, largest remainder first
    images, labels = next(iter(loader))
    assert images.shape[0] == labels.shape[0] == 16
    val = make_loader(data, "val", 4, augment=AugmentConfig(image_size=16), device="cpu", num_threads=6)
    assert [d.loader.options.num_threads for d in val.per_dataset.values()] == [6, 6, 6]
    assert share_threads(6, [192, 64]) == [5, 1] and share_threads(2, [1, 1, 1]) == [1, 1, 1]
    assert share_threads(16, [128, 64, 64]) == [8, 4, 4] and share_threads(7, [10, 1]) == [6, 1]


# ---------------------------------------------------------------------------------------------------------
# docs/development/gpu-evidence.md's memory table: its numbers are these functions', so the page cannot drift

OLD_DEVICE_PADDING, OLD_HOST_PADDING = 211025920, 140544512  # the "before" columns: DALI's earlier paddings


def size(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:.0f} MiB" if n_bytes < 2**30 else f"{n_bytes / 2**30:.1f} GiB"


def memory_table_rows(gpus: int = 8, nodes_cores=(64, 224)) -> list[str]:
    """docs/development/gpu-evidence.md's rows for `gpus` ranks on nodes of `nodes_cores` CPUs at the shipped
    default (--device gpu, no --dali-threads): now one mixed decoder per rank at a time at thread_budget's
    threads; before, one per pipeline (training and validation, both held) at one thread per CPU with the old
    paddings."""
    from dalifeed.decode import decoder_memory

    rows = []
    for cores in nodes_cores:
        budget = thread_budget("gpu", cores=cores, visible_gpus=gpus, environ={"LOCAL_WORLD_SIZE": str(gpus)})
        now = decoder_memory(budget.threads)
        before_gpu, before_pinned = 2 * cores * OLD_DEVICE_PADDING, 2 * cores * 2 * OLD_HOST_PADDING
        rows.append(f"| {cores} CPUs | {budget.threads} | {size(now.device_bytes)} | {size(now.pinned_bytes)} | "
                    f"{size(gpus * now.pinned_bytes)} | 2 x {cores} | {size(before_gpu)} | {size(before_pinned)} | "
                    f"{size(gpus * before_pinned)} |")
    return rows


def test_docs_memory_table_is_what_the_budget_and_decoder_memory_give():
    doc = (Path(__file__).parents[1] / "docs" / "development" / "gpu-evidence.md").read_text()
    for row in memory_table_rows():
        assert row in doc, f"docs/development/gpu-evidence.md's memory table lacks (or has other numbers than): {row}"


def defaults_table(defaults) -> list[list[str]]:
    """docs/development/gpu-evidence.md's table of `defaults` (dalifeed.defaults), default | value | source file."""
    h100, a100 = defaults.PUBLISHED[0], defaults.PUBLISHED[2]
    return [
        ["DALI threads per rank (`mixed` decoding)",
         f"{defaults.MIXED_DECODE_THREADS}, at most the rank's share of the CPUs",
         f'{h100.source}: `DALI_THREADS="{h100.threads}"` (DGX-A100, {a100.source}: the same)'],
        ["`hw_decoder_load`", f"{defaults.HW_DECODER_LOAD:g}",
         f'{h100.source}: `DALI_HW_DECODER_LOAD="{h100.hw_decoder_load:g}"` '
         f'(DGX-A100: "{a100.hw_decoder_load:g}")'],
        ["prefetch queue depth (`mixed` decoding)", f"{defaults.GPU_PREFETCH_QUEUE_DEPTH}",
         f'{h100.source}: `DALI_PREFETCH_QUEUE="{h100.prefetch_queue_depth}"` (DGX-A100: the same)'],
        ["prefetch queue depth (`cpu`, `hybrid`)", f"{defaults.DALI_PREFETCH_QUEUE_DEPTH}",
         "DALI 2.4's `Pipeline(prefetch_queue_depth=2)` default"],
    ]


def test_docs_defaults_table_is_defaults_py():
    """docs/development/gpu-evidence.md's table of the GPU path's defaults and their published sources is what the
    code uses."""
    from dalifeed import defaults
    from dalifeed.decode import DEFAULT_HW_DECODER_LOAD

    doc = (Path(__file__).parents[1] / "docs" / "development" / "gpu-evidence.md").read_text()
    for row in defaults_table(defaults):
        assert "| " + " | ".join(row) + " |" in doc, f"docs/development/gpu-evidence.md's defaults table lacks: {row}"
    assert MIXED_DECODE_MAX_THREADS == defaults.MIXED_DECODE_THREADS == 6
    assert DEFAULT_HW_DECODER_LOAD == defaults.HW_DECODER_LOAD == 0.99
    assert [defaults.prefetch_queue_depth(d) for d in ("gpu", "hybrid", "cpu")] == [5, 2, 2]
    h100 = defaults.PUBLISHED[0]
    assert (h100.threads, h100.hw_decoder_load, h100.prefetch_queue_depth) == (6, 0.99, 5)


if __name__ == "__main__":  # print the rows for docs/development/gpu-evidence.md
    print("\n".join(memory_table_rows()))
