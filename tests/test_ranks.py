"""Ranks that read their part without being told: README's loop under torchrun and under a gloo group (two real
CPU processes, tests/readme_rank.py), the launchers' variables, and given ranks against the environment and a
process group."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest
import torch.distributed as dist

from dalifeed.pipelines import DetectionConfig, make_detection_loader, make_loader
from dalifeed.pipelines.ranks import Ranks, launcher_ranks
from helpers import kill_run, one_image_classes

N = 37  # prime: 2 ranks of batch 4 read 16 each and leave 5 out
RANK = Path(__file__).parent / "readme_rank.py"
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "SLURM_PROCID", "SLURM_NTASKS",
                      "SLURM_STEP_NUM_TASKS", "TORCHELASTIC_USE_AGENT_STORE")


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return one_image_classes(tmp_path_factory.mktemp("ranks"), N, seed=3, prefix="r", samples_per_shard=5)


@pytest.fixture
def no_launcher(monkeypatch):
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)


def plain_environment() -> dict:
    return {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}


def run_ranks(commands: list[list[str]], out: Path, timeout: float = 120) -> list[dict]:
    """Start `commands` at once (one torchrun, or one process per rank), wait, and read each rank's record."""
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=plain_environment())
             for c in commands]
    try:
        logs = [p.communicate(timeout=timeout)[0] for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            kill_run(p)
        raise AssertionError(f"the ranks did not finish within {timeout} s") from None
    assert all(p.returncode == 0 for p in procs), "\n".join(log[-3000:] for log in logs)
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(2)]


def check_parts(records: list[dict], shards: Path, coco_ids: list[int], source: str) -> None:
    """Each rank was told nothing and read its own part: training disjoint and the same as `rank=r,
    world_size=2` given; validation and detection every sample once across the ranks."""
    assert [r["ranks"] for r in records] == [[0, 2, source], [1, 2, source]]
    assert [r["detection_ranks"] for r in records] == [[0, 2, source], [1, 2, source]]
    batches = (N // 2) // 4
    parts = [[[label for e, labels in r["train"] if e == epoch for label in labels] for r in records]
             for epoch in range(2)]
    for epoch_parts in parts:
        assert [len(p) for p in epoch_parts] == [batches * 4] * 2 and [r["batches"] for r in records] == [batches] * 2
        assert len(set(epoch_parts[0] + epoch_parts[1])) == 2 * batches * 4  # disjoint, no sample twice
    for rank in range(2):
        told = make_loader(shards, "train", 4, rank=rank, world_size=2, device="cpu", num_threads=1)
        for epoch in range(2):
            told.set_epoch(epoch)
            assert parts[epoch][rank] == [label for _, labels in told for label in labels.tolist()]
    assert sorted(records[0]["val"] + records[1]["val"]) == list(range(N))
    assert set(records[0]["val"]).isdisjoint(records[1]["val"])
    assert sorted(records[0]["detection"] + records[1]["detection"]) == coco_ids


@pytest.fixture(scope="module")
def coco_ids(mini_coco_shards) -> list[int]:
    """Every image id of the COCO shards' split, read by one rank told it is the only one."""
    whole = make_detection_loader(mini_coco_shards, "mini", 8, train=False, rank=0, world_size=1, device="cpu",
                                  detection=DetectionConfig(size=32))
    return sorted(t["image_id"] for _, targets in whole for t in targets)


def test_the_readmes_loop_under_torchrun_reads_half_the_epoch_per_rank(shards, mini_coco_shards, coco_ids, tmp_path):
    """`torchrun --nproc_per_node=2` and README's loop as written: ranks from torchrun's RANK/WORLD_SIZE."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(RANK),
               str(tmp_path), str(shards), str(mini_coco_shards)]
    check_parts(run_ranks([command], tmp_path), shards, coco_ids, "environment (RANK/WORLD_SIZE)")


def test_the_readmes_loop_in_a_gloo_group_reads_half_the_epoch_per_rank(shards, mini_coco_shards, coco_ids, tmp_path):
    """Two processes that formed a gloo group themselves, with no launcher's variables: the group's ranks; given
    ranks that disagree with it are one line."""
    store = tmp_path / "store"
    commands = [[sys.executable, str(RANK), str(tmp_path), str(shards), str(mini_coco_shards), "--group", str(store),
                 str(r), "2"] for r in range(2)]
    records = run_ranks(commands, tmp_path)
    check_parts(records, shards, coco_ids, "process group")
    assert records[1]["disagree"] == ("rank=0, world_size=1 disagree with the initialized process group (rank 1 of "
                                      "2): pass the group's, a data-parallel subgroup's (a world_size above 1 "
                                      "dividing 2), or leave both out to use it")


@pytest.mark.parametrize("environ, expected", [
    ({}, Ranks(0, 1, "default")),
    ({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"},
     Ranks(3, 8, "environment (RANK/WORLD_SIZE)")),  # torchrun on a second node: the global rank, not LOCAL_RANK
    ({"LOCAL_RANK": "1"}, Ranks(0, 1, "default")),
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_STEP_ID": "0"},
     Ranks(5, 8, "environment (SLURM_PROCID/SLURM_STEP_NUM_TASKS)")),  # srun -n 8 python train.py
    ({"SLURM_PROCID": "0", "SLURM_NTASKS": "8"}, Ranks(0, 1, "default")),  # sbatch's script itself: not a step
    ({"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "RANK": "9", "WORLD_SIZE": "16"},
     Ranks(9, 16, "environment (RANK/WORLD_SIZE)")),  # srun torchrun: torchrun's ranks
])
def test_the_launchers_variables_give_the_global_rank(environ, expected):
    assert launcher_ranks(environ) == expected


@pytest.mark.parametrize("environ, message", [
    ({"RANK": "1"}, "^RANK is set but WORLD_SIZE is not: set both, or pass rank= and world_size=$"),
    ({"RANK": "1", "WORLD_SIZE": "two"}, "^WORLD_SIZE='two' is not an integer: pass rank= and world_size=$"),
])
def test_a_half_set_environment_is_one_line(environ, message):
    with pytest.raises(ValueError, match=message):
        launcher_ranks(environ)


def test_given_ranks_win_over_the_environment(shards, monkeypatch, no_launcher):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    told = make_loader(shards, "train", 4, rank=0, world_size=1, device="cpu", num_threads=1)
    assert (told.options.rank, told.options.world_size, told.options.ranks_from) == (0, 1, "arguments")
    untold = make_loader(shards, "train", 4, device="cpu", num_threads=1)
    assert (untold.options.rank, untold.options.world_size) == (1, 2)
    assert untold.options.ranks_from == "environment (RANK/WORLD_SIZE)"
    with pytest.raises(ValueError, match=r"^give rank and world_size together, or neither \(then they are the "
                                         r"launcher's\); got rank=1, world_size=None$"):
        make_loader(shards, "train", 4, rank=1, device="cpu")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match=r"^rank must be in \[0, world_size\), got rank=2, world_size=2 \(from "
                                         r"environment \(RANK/WORLD_SIZE\)\)$"):
        make_loader(shards, "train", 4, device="cpu")


def test_given_ranks_that_disagree_with_the_process_group_are_one_line(shards, mini_coco_shards, tmp_path, no_launcher):
    """A one-rank gloo group in this process: the loaders' ranks are its; 1 of 2 given is refused, for both
    loaders; a resolved record passed back keeps its source."""
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        loader = make_loader(shards, "train", 4, device="cpu", num_threads=1)
        assert (loader.options.rank, loader.options.world_size, loader.options.ranks_from) == (0, 1, "process group")
        message = (r"^rank=1, world_size=2 disagree with the initialized process group \(rank 0 of 1\): pass the "
                   r"group's, a data-parallel subgroup's \(a world_size above 1 dividing 1\), or leave both out to "
                   r"use it$")
        with pytest.raises(ValueError, match=message):
            make_loader(shards, "train", 4, rank=1, world_size=2, device="cpu")
        with pytest.raises(ValueError, match=message):
            make_detection_loader(mini_coco_shards, "mini", 2, rank=1, world_size=2, device="cpu")
        again = make_loader(shards, **{**asdict(loader.options), "lanes": None})
        assert again.options.ranks_from == "process group"
    finally:
        dist.destroy_process_group()
    assert make_loader(shards, **{**asdict(loader.options), "lanes": None}).options.ranks_from == "arguments"


def test_dali_train_records_where_its_ranks_came_from_and_refuses_srun_without_torchrun(monkeypatch, no_launcher):
    """dali-train's ranks are torchrun's: its loaders' options say the source (printed and saved with the run);
    `srun -n 2 dali-train` without torchrun would train two unsynchronised copies: one line instead."""
    import torch

    from dalifeed.train.config import ConfigError, TrainConfig
    from dalifeed.train.data import loader_options
    from dalifeed.train.distributed import Dist, launched

    cfg, one = TrainConfig(data=".", out="."), Dist(0, 1, 0, torch.device("cpu"))
    assert [o.ranks_from for o in loader_options(cfg, one, threads=1)] == ["default", "default"]
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert loader_options(cfg, one, threads=1)[0].ranks_from == "environment (RANK/WORLD_SIZE)"
    monkeypatch.delenv("RANK")
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.setenv("SLURM_PROCID", "1")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    assert launched().world_size == 1
    with pytest.raises(ConfigError, match=r"^this process is rank 1 of 2 \(environment \(SLURM_PROCID/"
                                          r"SLURM_STEP_NUM_TASKS\)\) but dali-train's ranks are torchrun's "
                                          r"RANK/WORLD_SIZE \(rank 0 of 1\): start it with torchrun"):
        loader_options(cfg, one, threads=1)


@pytest.mark.parametrize("rank, world_size, allowed", [
    (5, 8, True),    # the group's own
    (1, 4, True),    # a data-parallel subgroup of 4 in 8 ranks (tensor parallel 2): given values win
    (3, 4, True),
    (3, 8, False),   # the group's size, another rank: LOCAL_RANK passed as rank on a second node
    (0, 1, False),   # every rank reading the whole split: a forgotten rank=0, world_size=1
    (1, 3, False),   # not a subgroup's size
    (1, 16, False),  # more ranks than the group
])
def test_given_ranks_against_the_process_group(rank, world_size, allowed):
    """Rank 5 of an 8-rank default group; a Megatron-style data-parallel subgroup's ranks are not refused."""
    from dalifeed.pipelines.ranks import check_against_group

    group = Ranks(5, 8, "process group")
    if allowed:
        check_against_group(rank, world_size, group)
    else:
        with pytest.raises(ValueError, match=rf"^rank={rank}, world_size={world_size} disagree with the initialized "
                                             rf"process group \(rank 5 of 8\): pass the group's, a data-parallel "
                                             rf"subgroup's \(a world_size above 1 dividing 8\), or leave both out"):
            check_against_group(rank, world_size, group)
    check_against_group(rank, world_size, None)  # no group: the arguments as given


@pytest.mark.parametrize("current, visible, environ, expected", [
    (0, 8, {"LOCAL_RANK": "3"}, 3),    # torchrun, no set_device: rank 3 of the node decodes on GPU 3
    (3, 8, {"LOCAL_RANK": "3"}, 3),    # the user's set_device(local_rank)
    (5, 8, {"LOCAL_RANK": "3"}, 5),    # a set_device of the user's own wins
    (0, 1, {"LOCAL_RANK": "3"}, 0),    # one GPU a rank (srun --gpu-bind, a pod): its device 0
    (0, 2, {"LOCAL_RANK": "3"}, 0),    # fewer GPUs than local ranks: left to the current device
    (0, 8, {}, 0),                     # no launcher
    (0, 8, {"LOCAL_RANK": "x"}, 0),
])
def test_a_gpu_loader_left_without_device_id_takes_torchruns_local_rank(current, visible, environ, expected):
    from dalifeed.pipelines.ranks import local_gpu

    assert local_gpu(current, visible, environ) == expected
