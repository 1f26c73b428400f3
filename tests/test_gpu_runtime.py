"""What a run needs from the GPU besides DALI, checked on the CPU as far as a CPU can show it: the random
generators a checkpoint holds and restores per rank, and which NVML device is this process's GPU. The
`gpu`-marked tests prove the rest on the first GPU node (make gpu-check runs them)."""

from __future__ import annotations

import random
import re
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dalifeed.nvml import process_memory
from dalifeed.train import checkpoint

# ----------------------------------------------------------------------------------------------------
# random generators in checkpoints


def draws() -> tuple:
    return random.random(), float(np.random.rand()), float(torch.rand(1))


def test_a_checkpoint_holds_one_gpu_generator_not_one_per_visible_gpu(tmp_path):
    """The layout: "cuda" is the state of this process's own GPU (None on a process without one), so that a
    checkpoint from a node with 8 visible GPUs has nothing that needs 8 GPUs to restore."""
    state = checkpoint.rng_state()
    assert set(state) == {"python", "numpy", "torch", "cuda"}
    assert state["cuda"] is None if not torch.cuda.is_available() else isinstance(state["cuda"], torch.Tensor)
    checkpoint.save(tmp_path / "last.pt", {"rng": state})
    expected = draws()
    checkpoint.restore_rng(checkpoint.load(tmp_path / "last.pt")["rng"])
    assert draws() == expected


def test_an_old_checkpoint_with_a_state_per_gpu_restores_on_a_process_with_fewer(tmp_path):
    """A checkpoint written before, by rank 0 of a node with 8 visible GPUs (`get_rng_state_all()`: a list of
    8), resumes on a process that sees fewer GPUs or none: rank 0's own GPU state (the first) is the one to
    restore, and nothing indexes past the GPUs this process has."""
    old = checkpoint.rng_state()
    old["cuda"] = [torch.tensor([i] * 16, dtype=torch.uint8) for i in range(8)]  # Philox: 16 bytes a GPU
    checkpoint.save(tmp_path / "last.pt", {"rng": old})
    expected = draws()
    checkpoint.restore_rng(checkpoint.load(tmp_path / "last.pt")["rng"])
    assert draws() == expected
    assert torch.equal(checkpoint.own_gpu_state(old["cuda"]), old["cuda"][0])
    assert checkpoint.own_gpu_state([]) is None and checkpoint.own_gpu_state(None) is None
    one = torch.arange(16, dtype=torch.uint8)
    assert checkpoint.own_gpu_state(one) is one


@pytest.mark.gpu
def test_a_checkpoint_restores_this_gpus_generator_even_from_more_gpus(tmp_path):
    saved = checkpoint.rng_state()
    expected = torch.rand(4, device="cuda")
    checkpoint.restore_rng(saved)
    assert torch.equal(torch.rand(4, device="cuda"), expected)
    many = dict(saved, cuda=[saved["cuda"]] + [torch.cuda.get_rng_state()] * (torch.cuda.device_count() + 3))
    checkpoint.restore_rng(many)  # more states than GPUs here: set_rng_state_all raised IndexError
    assert torch.equal(torch.rand(4, device="cuda"), expected)


# ----------------------------------------------------------------------------------------------------
# NVML: this process's figures (which GPU is this process's: tests/test_nvml_injected.py)

def test_process_memory_is_nvmls_figure_for_this_pid_or_none():
    processes = [SimpleNamespace(pid=10, usedGpuMemory=5 * 2**30), SimpleNamespace(pid=42, usedGpuMemory=3 * 2**30),
                 SimpleNamespace(pid=42, usedGpuMemory=2**30), SimpleNamespace(pid=7, usedGpuMemory=None)]
    assert process_memory(processes, 42) == 4 * 2**30  # DALI's pools and torch's tensors, one figure
    assert process_memory(processes, 7) is None  # NVML has no figure (e.g. Windows' WDDM)
    assert process_memory(processes, 99) is None  # a container: NVML lists the host's pids


@pytest.mark.gpu
def test_nvml_opens_the_gpu_torch_computes_on():
    from dalifeed.nvml import gpu_stats, open_gpu

    for index in range(torch.cuda.device_count()):
        pynvml, handle = open_gpu(index)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
        assert uuid.lower() == "gpu-" + str(torch.cuda.get_device_properties(index).uuid).lower()
    keep = torch.ones(2**20, device="cuda")  # noqa: F841  (some memory of this process's own)
    stats = gpu_stats(torch.device("cuda", 0))
    assert stats["gpu_memory_used_gb"] >= stats["gpu_max_memory_gb"] > 0
    if "gpu_process_memory_gb" in stats:  # absent in a container whose pids NVML does not list
        assert stats["gpu_memory_used_gb"] >= stats["gpu_process_memory_gb"] >= stats["gpu_max_memory_gb"]


# ----------------------------------------------------------------------------------------------------
# settings dali-train makes on a GPU


@pytest.mark.gpu
def test_dali_train_turns_on_cudnn_autotuning(make_shards, tmp_path):
    """Batches have one shape: cuDNN's autotuner picks the fastest algorithms in the first steps (gpu-check's
    warm-up epoch assumes it)."""
    from click.testing import CliRunner

    from dalifeed.train.cli import main as train_cli

    shards = make_shards({"a": 20, "b": 20}, size=(64, 64), samples_per_shard=16)[1]
    torch.backends.cudnn.benchmark = False
    try:
        result = CliRunner().invoke(train_cli, ["--data", str(shards), "--out", str(tmp_path / "run"), "--epochs", "1",
                                                "--model", "resnet18", "--batch-size", "8", "--image-size", "32",
                                                "--device", "gpu"])
        assert result.exit_code == 0, result.output
        assert torch.backends.cudnn.benchmark is True
        assert "DALI threads per pipeline:" in result.output
    finally:
        torch.backends.cudnn.benchmark = False


def test_a_gpu_test_run_without_a_gpu_fails_in_one_line():
    """`make test-gpu` (pytest -m gpu) where torch sees no GPU: every gpu test would be skipped and the run
    green; it stops non-zero instead, saying why and what `dalifeed doctor` says of this node."""
    import subprocess
    import sys
    from pathlib import Path

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the gpu tests run")
    tests = Path(__file__).parent
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider",
                          str(tests / "test_gpu.py")], capture_output=True, text=True, timeout=300, cwd=tests.parent)
    assert run.returncode == 3, run.stdout + run.stderr
    said = [line for line in run.stdout.splitlines() if "Exit" in line]
    assert len(said) == 1 and re.fullmatch(r"! _pytest\.outcomes\.Exit: no CUDA GPU visible to torch, so none of the "
                                           r"\d+ gpu tests can run: OK: .*--device auto runs on the CPU.* !",
                                           said[0]), \
        run.stdout
