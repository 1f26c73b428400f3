"""dali-train under torchrun as a cluster runs it, with real processes on the CPU (gloo): a worker killed with
SIGKILL mid-epoch is restarted by torchrun (`--max-restarts 1`) and the run continues from its mid-epoch
checkpoint; SIGTERM to the torchrun agent (what Slurm sends) stops every rank after its step with a
mid-epoch checkpoint, and the same command continues the run. Either way the final weights equal an
uninterrupted run's, bit for bit. A mid-epoch checkpoint of 2 ranks continues on 1 and on 3 (elastic resume):
the interrupted epoch trains every sample once, and two resumes on 3 ranks end with the same weights."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

from dalifeed.runtime import Stopped
from dalifeed.train.stop import Seen, StepChecks, Stop, agree_to_skip
from helpers import free_port, kill_run, run_ranks

PY = sys.executable
# 405 train samples, batch 4 on each of 2 ranks: 50 steps an epoch, a mid-epoch checkpoint every 3
TRAIN = ["--model", "resnet18", "--width", "8", "--image-size", "32", "--batch-size", "4", "--epochs", "2",
         "--optimizer", "adamw", "--lr", "0.032", "--crop-scale", "0.5,1", "--workers", "1", "--checkpoint-every", "3"]
STEPS = 50


@pytest.fixture(scope="module")
def shards(make_shards) -> Path:
    return make_shards({"train": {"red": 137, "green": 135, "blue": 133}, "val": {"red": 7, "green": 7, "blue": 7}},
                       samples_per_shard=20)[1]


def start_torchrun(shards: Path, out: Path, log: Path) -> subprocess.Popen:
    """`torchrun --nproc-per-node 2 --max-restarts 1 --rdzv-backend c10d ... -m dalifeed.train.cli`, its output
    (the agent's and every rank's) in `log`. The environment is the user's, without the opt-out of torchrun's
    shared store, so the default store is what restarts are tested on."""
    command = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               "-m", "dalifeed.train.cli", "--data", str(shards), "--out", str(out), *TRAIN]
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    with open(log, "w") as f:
        return subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def finish(agent: subprocess.Popen, timeout: float) -> int:
    """The agent's exit code; on a time-out, the agent and its workers are killed and the test fails."""
    try:
        return agent.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_run(agent)
        raise AssertionError(f"torchrun did not finish within {timeout} s") from None


def mid_epoch_checkpoint(run: Path) -> dict | None:
    try:
        saved = torch.load(run / "last.pt", weights_only=False)
    except Exception:  # not written yet
        return None
    return saved if saved.get("midway") else None


def wait_for_mid_epoch_checkpoint(run: Path, agent: subprocess.Popen, timeout: float = 300) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and agent.poll() is None:
        saved = mid_epoch_checkpoint(run)
        if saved is not None:
            return saved
        time.sleep(0.02)
    kill_run(agent)
    raise AssertionError(f"no mid-epoch checkpoint in {run} (torchrun exit code {agent.poll()})")


def workers(agent: subprocess.Popen) -> dict[int, psutil.Process]:
    """The agent's worker processes by rank (read from their environment)."""
    return {int(p.environ()["RANK"]): p for p in psutil.Process(agent.pid).children()
            if "dalifeed.train.cli" in " ".join(p.cmdline())}


def weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "last.pt", weights_only=False)["model"]


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), [k for k in wa if not torch.equal(wa[k], wb[k])][:5]


def epoch_lines(log: Path) -> list[str]:
    """Rank 0's per-epoch lines without the timings (which never repeat); not its progress lines ('epoch 0 step
    3/50: ...', every --progress-every seconds)."""
    lines = [line for line in log.read_text().splitlines() if re.match(r"epoch \d+, ", line)]
    return [re.sub(r", (images_per_s|epoch_seconds|data_wait_share) [^,]+", "", line) for line in lines]


@pytest.fixture(scope="module")
def straight(shards, tmp_path_factory) -> Path:
    """The uninterrupted run: the same command, never signalled."""
    run = tmp_path_factory.mktemp("straight") / "run"
    agent = start_torchrun(shards, run, run.parent / "log.txt")
    assert finish(agent, timeout=600) == 0, (run.parent / "log.txt").read_text()[-3000:]
    return run


@pytest.mark.slow  # each torchrun test runs two or three 2-process trainings: about 40 s on 2 cores
@pytest.mark.parametrize("victim", [0, 1])
def test_a_killed_worker_is_restarted_and_the_run_ends_as_an_uninterrupted_one(shards, straight, tmp_path, victim):
    run, log = tmp_path / "run", tmp_path / "log.txt"
    agent = start_torchrun(shards, run, log)
    saved = wait_for_mid_epoch_checkpoint(run, agent)
    assert saved["state"]["epoch"] == 0
    workers(agent)[victim].send_signal(signal.SIGKILL)  # the OOM killer, a dying GPU: no handler runs
    assert finish(agent, timeout=600) == 0, log.read_text()[-3000:]
    output = log.read_text()
    assert f"failed (exitcode: -9) local_rank: {victim}" in output
    # torchrun restarted both workers once; they continued from the mid-epoch checkpoint, not from scratch
    assert output.count(f"--out {run} holds this run: continuing it from last.pt") == 1
    resumed = re.search(r"starting at epoch (\d+), batch (\d+) of 50", output)
    assert resumed and resumed[1] == "0" and 0 < int(resumed[2]) < STEPS, output[-3000:]
    assert epoch_lines(log) == epoch_lines(straight.parent / "log.txt")
    assert_same_weights(straight, run)


@pytest.mark.slow
def test_sigterm_to_torchrun_stops_every_rank_with_a_checkpoint_and_the_same_command_continues(shards, straight,
                                                                                              tmp_path):
    run, log = tmp_path / "run", tmp_path / "log.txt"
    agent = start_torchrun(shards, run, log)
    wait_for_mid_epoch_checkpoint(run, agent)
    ranks = workers(agent)
    agent.send_signal(signal.SIGTERM)  # to the agent only, as Slurm's --signal or scancel does
    sent = time.monotonic()
    code = finish(agent, timeout=60)
    assert time.monotonic() - sent < 60
    assert code != 0  # torchrun itself reports the signal as a failure (its SignalException), not us
    assert all(not p.is_running() for p in ranks.values())
    output = log.read_text()
    assert "Received 15 death signal, shutting down workers" in output
    assert "forcefully exiting" not in output  # every rank exited by itself inside torchrun's grace period
    assert not re.search(r"^\[rank\d\]:|^Error:", output, re.M), output[-3000:]  # no rank failed
    stopped = re.search(rf"rank 0: stopped by SIGTERM: continue with: dali-train --resume {run} "
                        rf"\(last.pt holds epoch 0, step (\d+) of {STEPS}\)", output)
    assert stopped, output[-3000:]
    saved = mid_epoch_checkpoint(run)
    step = int(stopped[1])
    assert saved is not None and 0 < step < STEPS
    # both ranks finished the same step and their readers were saved there
    # (the position is global: the samples both ranks consumed, 4 a batch on each)
    assert [loader["samples_done"] for loader in saved["midway"]["loaders"]] == [step * 4 * 2] * 2
    assert saved["state"]["step"] == step

    again = start_torchrun(shards, run, tmp_path / "again.txt")  # the job requeued: the same command
    assert finish(again, timeout=600) == 0, (tmp_path / "again.txt").read_text()[-3000:]
    output = (tmp_path / "again.txt").read_text()
    assert f"starting at epoch 0, batch {step} of {STEPS}" in output
    assert epoch_lines(tmp_path / "again.txt") == epoch_lines(straight.parent / "log.txt")
    assert_same_weights(straight, run)


# Elastic resume: a global batch of 12, which 1, 2 and 3 processes share; 240 train samples, 20 steps an epoch
# that train every sample once
ELASTIC = ["--model", "resnet18", "--width", "8", "--image-size", "32", "--batch-size", "6", "--epochs", "2",
           "--optimizer", "adamw", "--lr", "0.032", "--crop-scale", "0.5,1", "--workers", "1",
           "--checkpoint-every", "3", "--log-samples"]
ELASTIC_STEPS = 20


@pytest.fixture(scope="module")
def elastic_shards(make_shards) -> Path:
    return make_shards({"train": {"red": 80, "green": 80, "blue": 80}, "val": {"red": 4, "green": 4, "blue": 4}},
                       samples_per_shard=17)[1]


def torchrun(args: list[str], processes: int, log: Path) -> subprocess.Popen:
    """`torchrun --nproc-per-node PROCESSES -m dalifeed.train.cli ARGS`, its output in `log`."""
    command = [PY, "-m", "torch.distributed.run", "--nproc-per-node", str(processes), "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "dalifeed.train.cli", *args]
    with open(log, "w") as f:
        return subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)


def logged_samples(run: Path, epoch: int) -> list[str]:
    """Every sample the run's ranks trained on in `epoch`, as --log-samples logged them (all attempts)."""
    return [sample for path in sorted((run / "samples").glob("*.jsonl")) for line in path.read_text().splitlines()
            if json.loads(line)["epoch"] == epoch for sample in json.loads(line)["samples"]]


@pytest.mark.slow  # four trainings under torchrun: about 2 minutes on 2 cores
def test_a_mid_epoch_checkpoint_of_two_ranks_continues_on_one_and_on_three(elastic_shards, tmp_path):
    run, log = tmp_path / "run", tmp_path / "log.txt"
    agent = torchrun(["--data", str(elastic_shards), "--out", str(run), *ELASTIC], 2, log)
    wait_for_mid_epoch_checkpoint(run, agent)
    agent.send_signal(signal.SIGTERM)  # a preempting scheduler; the job comes back on another number of GPUs
    finish(agent, timeout=60)
    saved = mid_epoch_checkpoint(run)
    assert saved is not None and saved["state"]["epoch"] == 0, log.read_text()[-3000:]
    step = saved["state"]["step"]
    assert 0 < step < ELASTIC_STEPS
    assert len(logged_samples(run, 0)) == step * 12  # what the two ranks trained before they stopped

    copies = {}
    for name, processes in (("one", 1), ("three", 3), ("three-again", 3)):
        copies[name] = copy = tmp_path / name
        shutil.copytree(run, copy)
        log = tmp_path / f"{name}.txt"
        assert finish(torchrun(["--resume", str(copy)], processes, log), timeout=600) == 0, log.read_text()[-3000:]
        output = log.read_text()
        assert (f"the rest of epoch 0: its samples not trained by the 2 processes that saved it ({step * 12} were), "
                f"shared by {processes}") in output, output[-3000:]
        assert f"starting at epoch 0, batch {step} of {ELASTIC_STEPS}" in output  # --batch-size 12 / processes
        last = torch.load(copy / "last.pt", weights_only=False)
        # the schedule went on at the step it stopped at: the two epochs' steps in all, then both epochs' metrics
        assert last["state"]["step"] == 2 * ELASTIC_STEPS and last["world_size"] == processes
        assert [json.loads(line)["epoch"] for line in (copy / "metrics.jsonl").read_text().splitlines()] == [0, 1]
        for epoch in (0, 1):  # the interrupted epoch and the next, on the new processes: each sample once
            samples = logged_samples(copy, epoch)
            assert len(samples) == len(set(samples)) == 240, (epoch, len(samples), len(set(samples)))
    assert_same_weights(copies["three"], copies["three-again"])  # a function of the checkpoint and the processes


def test_a_repeated_sigterm_is_the_same_request_and_a_second_ctrl_c_stops_at_once():
    """Under Slurm a rank gets SIGTERM twice (from Slurm, which signals every process of the step, and from
    torchrun); the second must not cut the stop short before its checkpoint. Ctrl-C twice still does."""
    stop = Stop()
    with stop.listening():
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)  # Python runs signal handlers between bytecodes
        assert stop.requested == signal.SIGTERM
        with pytest.raises(Stopped) as stopped:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)
        assert stopped.value.signum == signal.SIGINT


# what each of two ranks brings to three optimizer steps: (its step was finite, the signal it got)
VOTES = [[(1.0, 0), (1.0, 0)],  # all well: every rank steps
         [(1.0, 0), (0.0, 0)],  # rank 1 saw a NaN: every rank skips
         [(1.0, signal.SIGTERM), (1.0, 0)]]  # rank 0 got SIGTERM: every rank stops at the next check


def _agree_on_rank(rank: int, port: int, results: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    stop, checks, skipped = Stop(), StepChecks(torch.device("cpu")), []
    for step in VOTES:
        finite, stop.requested = step[rank]
        skipped.append(agree_to_skip(torch.tensor(finite)))
        checks.count(skipped[-1])
    agreed_before = stop.agreed  # a signal is agreed on at a check, not after every step
    seen = checks.read(stop, step=len(VOTES))
    torch.save(([float(s) for s in skipped], agreed_before, seen, stop.agreed), results / f"rank{rank}.pt")
    dist.destroy_process_group()


def test_the_ranks_agree_on_a_non_finite_step_and_on_a_stop_any_of_them_saw(tmp_path):
    run_ranks(_agree_on_rank, tmp_path, timeout=120)
    expected = ([0.0, 1.0, 0.0], 0, Seen(steps=3, skipped=1, streak=0, worst=1), signal.SIGTERM)
    assert [torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2)] == [expected, expected]


SBATCH = Path(__file__).parent.parent / "examples" / "slurm" / "train.sbatch"
FAKE_SRUN = """#!/bin/bash
echo "$*" > "$FAKE_LOG/srun-args"
trap 'echo TERM >> "$FAKE_LOG/srun-signals"; sleep 0.5; exit 143' TERM
touch "$FAKE_LOG/srun-started"
sleep 60 >/dev/null 2>&1 & wait
"""
FAKE_SCONTROL = """#!/bin/bash
case "$1 $2" in
  "show hostnames") printf 'node7\\nnode8\\n' ;;
  *) echo "$*" >> "$FAKE_LOG/scontrol" ;;
esac
"""


@pytest.mark.parametrize("sig, requeued", [(signal.SIGUSR1, True), (signal.SIGTERM, False)],
                         ids=["time-limit", "scancel"])
def test_the_slurm_script_passes_a_stop_to_every_rank_and_requeues_only_at_the_time_limit(tmp_path, sig, requeued):
    """examples/slurm/train.sbatch's signal handling, with stand-ins for srun and scontrol (no Slurm here)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "FAKE_LOG": str(tmp_path),
           "SLURM_JOB_NODELIST": "node[7-8]", "SLURM_NNODES": "2", "SLURM_JOB_ID": "4242"}
    script = subprocess.Popen(["bash", str(SBATCH)], env=env, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "srun-started").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert script.poll() is None, script.communicate()[1]
    script.send_signal(sig)  # what Slurm's --signal=B:USR1@120 or scancel sends to the batch shell
    _, stderr = script.communicate(timeout=30)
    assert script.returncode == 143, stderr  # srun's status: the ranks' "stopped by SIGTERM"
    assert (tmp_path / "srun-signals").read_text() == "TERM\n"
    args = (tmp_path / "srun-args").read_text()
    assert "torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint node7:29500" in args
    assert "--max-restarts 3" in args and "-m dalifeed.train.cli" in args and "--checkpoint-every" in args
    assert ((tmp_path / "scontrol").exists() and (tmp_path / "scontrol").read_text()) == \
        ("requeue 4242\n" if requeued else False)
