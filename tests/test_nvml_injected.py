"""A GPU node as NVML shows it to a job: a fake `pynvml` module (the real one's error classes, the NVML calls
dalifeed makes) in sys.modules, torch and DALI seeing GPUs injected through dalifeed's own readers
(`stack.torch_stack`, `stack.dali_stack`), the device files in a folder. Each case: the verdict, `dalifeed
doctor`'s lines, and which GPU the statistics come from (`nvml.find_gpu`, `nvml.nvml_stats`: what `open_gpu` and
`gpu_stats` call with torch's UUID)."""

from __future__ import annotations

import functools
import os
import sys
import types
from dataclasses import dataclass, field, replace
from pathlib import Path

import pynvml as real_nvml
import pytest
from click.testing import CliRunner

import dalifeed.doctor
import dalifeed.stack
from dalifeed.cli import main as dalifeed_cli
from dalifeed.nvml import find_gpu, nvml_stats
from dalifeed.stack import NVML_MISSING, check, choose_device, probe
from dalifeed.train.distributed import GpuAssignmentError, refuse_shared_gpus

GiB = 2**30


@dataclass
class Gpu:
    """One GPU (or MIG instance) of the fake NVML: `denied` refuses its handle as a job's cgroup does, `name_fails`
    its name; `memory_denied` its memory as a MIG instance inside a container does."""

    uuid: str
    bus: int
    util: int = 0
    used_gib: float = 0.0
    process_gib: float | None = None  # this test process's memory on it, None: not listed
    name: str = "NVIDIA H100 80GB HBM3"
    denied: bool = False
    name_fails: bool = False
    memory_denied: bool = False
    util_unsupported: bool = False
    mig: list[Gpu] = field(default_factory=list)


def fake_nvml(gpus: list[Gpu], driver: str = "580.65.06", cuda: int = 13000) -> types.ModuleType:
    """A `pynvml` answering as a driver does (nvmlDeviceGetCount_v2 counts every GPU of the machine, and
    nvmlDeviceGetHandleByIndex_v2 answers NVML_ERROR_NO_PERMISSION for one the process may not open), raising the
    real module's error classes."""
    module = types.ModuleType("pynvml")
    for name in dir(real_nvml):
        if name.startswith(("NVMLError", "NVML_")):
            setattr(module, name, getattr(real_nvml, name))

    def handle(index):
        if gpus[index].denied:
            raise real_nvml.NVMLError_NoPermission()
        return gpus[index]

    def name(gpu):
        if gpu.name_fails:
            raise real_nvml.NVMLError_Unknown()
        return gpu.name

    def mig_mode(gpu):
        if not gpu.mig:
            raise real_nvml.NVMLError_NotSupported()
        return [real_nvml.NVML_DEVICE_MIG_ENABLE, real_nvml.NVML_DEVICE_MIG_ENABLE]

    def mig_instance(gpu, slot):
        if slot >= len(gpu.mig):
            raise real_nvml.NVMLError_NotFound()
        return gpu.mig[slot]

    def memory(gpu):
        if gpu.memory_denied:
            raise real_nvml.NVMLError_NoPermission()
        return types.SimpleNamespace(used=int(gpu.used_gib * GiB))

    def utilization(gpu):
        if gpu.util_unsupported:
            raise real_nvml.NVMLError_NotSupported()
        return types.SimpleNamespace(gpu=gpu.util)

    def processes(gpu):
        return [] if gpu.process_gib is None else [types.SimpleNamespace(pid=os.getpid(),
                                                                         usedGpuMemory=int(gpu.process_gib * GiB))]

    module.__dict__.update(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None, nvmlSystemGetDriverVersion=lambda: driver,
        nvmlSystemGetCudaDriverVersion=lambda: cuda, nvmlDeviceGetCount=lambda: len(gpus),
        nvmlDeviceGetHandleByIndex=handle, nvmlDeviceGetName=name, nvmlDeviceGetUUID=lambda gpu: gpu.uuid,
        nvmlDeviceGetPciInfo=lambda gpu: types.SimpleNamespace(domain=0, bus=gpu.bus, device=0),
        nvmlDeviceGetMigMode=mig_mode, nvmlDeviceGetMaxMigDeviceCount=lambda gpu: 7,
        nvmlDeviceGetMigDeviceHandleByIndex=mig_instance, nvmlDeviceGetMemoryInfo=memory,
        nvmlDeviceGetUtilizationRates=utilization, nvmlDeviceGetComputeRunningProcesses=processes)
    return module


def no_library() -> types.ModuleType:
    """A `pynvml` where libnvidia-ml.so.1 is missing: nvmlInit raises what pynvml._LoadNvmlLibrary raises."""
    module = fake_nvml([])

    def init():
        raise real_nvml.NVMLError_LibraryNotFound()
    module.nvmlInit = init
    return module


def machine(count: int, denied: set[int] = frozenset(), **changes) -> list[Gpu]:
    """`count` GPUs, NVML's index i on PCI bus 0x10 + i, with figures that tell them apart (GPU i: i * 10 % busy,
    i + 1 GiB used, this process holding i + 0.5 GiB); `changes` maps an index to other fields."""
    gpus = [Gpu(uuid=f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}", bus=0x10 + i, util=10 * i, used_gib=i + 1,
                process_gib=i + 0.5, denied=i in denied) for i in range(count)]
    for index, fields in changes.items():
        for key, value in fields.items():
            setattr(gpus[int(index)], key, value)
    return gpus


def torch_uuid(gpu: Gpu) -> str:
    """The UUID as torch gives it (`get_device_properties(i).uuid`): NVML's without its "GPU-"/"MIG-" prefix."""
    return gpu.uuid.split("-", 1)[1]


def device_root(root: Path, count: int, openable: set[int]) -> Path:
    """/dev/nvidia<N> of `count` GPUs, those not in `openable` refused (a directory: open(O_RDWR) fails)."""
    (root / "dev").mkdir(parents=True)
    for i in range(count):
        (root / "dev" / f"nvidia{i}").touch() if i in openable else (root / "dev" / f"nvidia{i}").mkdir()
    return root


@pytest.fixture
def node(monkeypatch, tmp_path):
    """Make this process a GPU node: `node(nvml, gpus_seen, devices, openable, visible)` puts the fake `nvml` where
    `import pynvml` finds it, has torch and DALI (their real versions) see `gpus_seen` GPUs, and points `probe`
    (also doctor's) at `devices` device files of which `openable` open."""
    def make(nvml, gpus_seen: int, devices: int, openable: set[int], visible: str | None = None):
        monkeypatch.setitem(sys.modules, "pynvml", nvml)
        if visible is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        torch_stack, dali_stack = dalifeed.stack.torch_stack, dalifeed.stack.dali_stack
        monkeypatch.setattr(dalifeed.stack, "torch_stack", lambda: (*torch_stack()[:2], gpus_seen))
        monkeypatch.setattr(dalifeed.stack, "dali_stack", lambda: (*dali_stack()[:3], gpus_seen))
        root = device_root(tmp_path / "root", devices, openable)
        monkeypatch.setattr(dalifeed.doctor, "probe", functools.partial(probe, root=root))
        return probe(root=root)
    return make


def doctor_lines() -> tuple[int, list[str]]:
    result = CliRunner().invoke(dalifeed_cli, ["doctor"])
    return result.exit_code, result.output.splitlines()


# -- (a) a Slurm job given one of the node's GPUs -------------------------------------------------------------

def test_one_gpu_of_four_under_a_cgroup_is_a_gpu_node_with_its_driver_and_its_own_statistics(node):
    """NO_PERMISSION on NVML's GPUs 0, 1 and 3; the job's GPU is NVML's 2, CUDA's 0 (CUDA_VISIBLE_DEVICES=0)."""
    gpus = machine(4, denied={0, 1, 3})
    stack = node(fake_nvml(gpus), gpus_seen=1, devices=4, openable={2}, visible="0")
    assert (stack.driver, stack.driver_cuda, stack.nvml_gpus) == ("580.65.06", "13.0", ("NVIDIA H100 80GB HBM3",))
    assert stack.nvml_closed == tuple(f"GPU {i}: Insufficient Permissions" for i in (0, 1, 3))
    assert stack.device_files == ("/dev/nvidia2",) and stack.closed_device_files == (
        "/dev/nvidia0", "/dev/nvidia1", "/dev/nvidia3")
    report = check(stack)
    assert report.problems == report.notes == [] and report.device == "gpu" and choose_device("auto", report) == "gpu"

    code, lines = doctor_lines()
    assert code == 0, lines
    assert ("verdict: OK: --device auto runs on the GPU (torch sees 1, DALI sees 1; driver 580.65.06, CUDA "
            "13.0)") in lines
    assert "  driver       580.65.06 (runs CUDA up to 13.0)" in lines
    assert (f"{'':15}NVML lists, will not open or name: GPU 0: Insufficient Permissions, GPU 1: Insufficient "
            f"Permissions, GPU 3: Insufficient Permissions") in lines

    nvml = sys.modules["pynvml"]
    handle = find_gpu(nvml, torch_uuid(gpus[2]), (0, 0x12, 0))
    assert handle is gpus[2]
    assert nvml_stats(nvml, handle, os.getpid()) == {"gpu_util_percent": 20, "gpu_memory_used_gb": 3.0,
                                                     "gpu_process_memory_gb": 2.5}


@pytest.mark.parametrize("own, visible", [({5}, "0"), ({2, 3}, "0,1")], ids=["gpus-per-task-1", "gres-gpu-2"])
def test_slurm_constrain_devices_on_an_eight_gpu_node_is_usable(node, own, visible):
    """`srun --gpus-per-task 1` and `--gres=gpu:2` under ConstrainDevices=yes: NVML counts 8, opens the job's.
    The first is what dali-train's refusal of ranks sharing a GPU advises."""
    with pytest.raises(GpuAssignmentError, match=r"srun --gpus-per-task 1\)$"):
        refuse_shared_gpus(["node0 1b1b", "node0 1b1b"])
    gpus = machine(8, denied=set(range(8)) - own)
    report = check(node(fake_nvml(gpus), gpus_seen=len(own), devices=8, openable=own, visible=visible))
    assert report.ok and report.device == "gpu" and report.stack.driver == "580.65.06"
    assert len(report.stack.nvml_gpus) == len(own) and len(report.stack.nvml_closed) == 8 - len(own)
    nvml = sys.modules["pynvml"]
    assert [find_gpu(nvml, torch_uuid(gpus[i])) for i in sorted(own)] == [gpus[i] for i in sorted(own)]


def test_a_job_given_none_of_the_gpus_nvml_lists_runs_on_the_cpu_saying_why(node):
    report = check(node(fake_nvml(machine(4, denied={0, 1, 2, 3})), gpus_seen=0, devices=4, openable=set()))
    assert report.ok and report.device == "cpu" and report.stack.driver == "580.65.06"
    assert report.notes == ["this container or job was given no GPU (/dev/nvidia0, /dev/nvidia1 cannot be opened by "
                            "this process): ask the job for GPUs (Slurm: --gres=gpu:N or --gpus N; a container: "
                            "--gpus all)"]


# -- (b) a container without NVML whose torch and DALI see the GPU --------------------------------------------

def test_without_nvml_a_gpu_torch_and_dali_see_is_usable_and_doctor_says_what_is_missing(node):
    """NVIDIA_DRIVER_CAPABILITIES=compute: no libnvidia-ml.so.1, so pynvml's nvmlInit raises
    NVMLError_LibraryNotFound (pynvml._LoadNvmlLibrary), while CUDA answers."""
    stack = node(no_library(), gpus_seen=1, devices=1, openable={0})
    assert (stack.driver, stack.nvml_gpus, stack.nvml_error) == (None, (), "NVML Shared Library Not Found")
    report = check(stack)
    assert report.problems == [] and report.device == "gpu" and choose_device("auto", report) == "gpu"
    assert report.notes == [NVML_MISSING] == ["NVML not available: no GPU statistics; the container needs "
                                              "NVIDIA_DRIVER_CAPABILITIES=compute,utility for them"]

    code, lines = doctor_lines()
    assert code == 0, lines
    assert ("verdict: OK: --device auto runs on the GPU (torch sees 1, DALI sees 1; no NVML: driver not read, note "
            "below)") in lines
    assert "  driver       not read: NVML does not answer (NVML Shared Library Not Found)" in lines
    assert [line for line in lines if line.startswith("  note: ")] == [f"  note: {NVML_MISSING}"]
    assert not any(line.startswith("  problem: ") for line in lines)


@pytest.mark.parametrize("torch_gpus, dali_gpus, problem", [
    (1, 0, "DALI 2.4.0 sees no GPU although torch sees 1: CUDA's own error"),
    (0, 1, "torch 2.14.1+cu130 sees no GPU although DALI sees 1: CUDA's own error")])
def test_without_nvml_a_library_that_cannot_use_the_gpu_is_still_refused(node, torch_gpus, dali_gpus, problem):
    stack = node(no_library(), gpus_seen=1, devices=1, openable={0})
    report = check(dalifeed.stack.Stack(**{**stack.__dict__, "torch_gpus": torch_gpus, "dali_gpus": dali_gpus,
                                           "torch": "2.14.1+cu130", "dali": "2.4.0"}))
    assert report.device == "refused" and report.problems[0].startswith(problem), report.problems
    assert report.notes == [NVML_MISSING]


# -- (c) NVML answering the system calls and failing one GPU's name -------------------------------------------

def test_a_gpu_whose_name_nvml_cannot_read_does_not_discard_the_driver_or_the_statistics(node):
    gpus = machine(4, **{"3": dict(name_fails=True)})
    stack = node(fake_nvml(gpus), gpus_seen=4, devices=4, openable={0, 1, 2, 3})
    assert stack.driver == "580.65.06" and len(stack.nvml_gpus) == 3 and stack.nvml_closed == ("GPU 3: Unknown Error",)
    report = check(stack)
    assert report.problems == report.notes == [] and report.device == "gpu"

    code, lines = doctor_lines()
    assert code == 0, lines
    assert ("verdict: OK: --device auto runs on the GPU (torch sees 4, DALI sees 4; driver 580.65.06, CUDA "
            "13.0)") in lines
    assert f"{'':15}NVML lists, will not open or name: GPU 3: Unknown Error" in lines

    nvml = sys.modules["pynvml"]
    for index in (1, 3):  # CUDA's order is NVML's here (no CUDA_VISIBLE_DEVICES); GPU 3's UUID still reads
        assert nvml_stats(nvml, find_gpu(nvml, torch_uuid(gpus[index])), os.getpid()) == {
            "gpu_util_percent": 10 * index, "gpu_memory_used_gb": index + 1.0, "gpu_process_memory_gb": index + 0.5}


def test_nvml_that_cannot_count_the_gpus_keeps_the_driver_and_lists_no_gpu_it_did_not_see(node):
    """nvmlInit and the system calls answer, nvmlDeviceGetCount fails: the driver's versions stay, the job's device
    file decides, and neither doctor nor the CPU note counts the failure as a GPU."""
    nvml = fake_nvml(machine(2))

    def count():
        raise real_nvml.NVMLError_Unknown()
    nvml.nvmlDeviceGetCount = count
    stack = node(nvml, gpus_seen=1, devices=2, openable={1})
    assert (stack.driver, stack.driver_cuda, stack.nvml_gpus, stack.nvml_closed) == ("580.65.06", "13.0", (), ())
    assert stack.nvml_error == "nvmlDeviceGetCount: Unknown Error" and stack.device_files == ("/dev/nvidia1",)
    report = check(stack)
    assert report.problems == report.notes == [] and report.device == "gpu"
    code, lines = doctor_lines()
    assert code == 0, lines
    assert ("  GPUs         NVML: not counted (nvmlDeviceGetCount: Unknown Error); device files: /dev/nvidia1"
            in lines), lines
    assert not any("NVML lists" in line for line in lines), lines

    none_given = check(replace(stack, device_files=(), closed_device_files=(), torch_gpus=0, dali_gpus=0))
    assert none_given.device == "cpu" and none_given.notes == [], none_given.notes


# -- statistics: MIG, and the PCI bus id where the UUID is not listed -----------------------------------------

def test_a_mig_instance_is_found_by_its_own_uuid_and_keeps_the_figures_nvml_gives():
    """torch's UUID of a MIG instance is the instance's (NVML: "MIG-..." on nvmlDeviceGetMigDeviceHandleByIndex's
    handle), not the parent GPU's; inside a container its memory answers NO_PERMISSION and its utilisation
    NOT_SUPPORTED: the process figure stays."""
    instances = [Gpu(uuid=f"MIG-{i}{i}{i}{i}{i}{i}{i}{i}-1111-2222-3333-444444444444", bus=0x10, util=99, used_gib=9,
                     process_gib=1.25 * i, memory_denied=True, util_unsupported=True) for i in (1, 2)]
    gpus = machine(2, denied={0}, **{"1": dict(mig=instances)})
    nvml = fake_nvml(gpus)
    handle = find_gpu(nvml, torch_uuid(instances[1]))
    assert handle is instances[1]
    assert nvml_stats(nvml, handle, os.getpid()) == {"gpu_process_memory_gb": 2.5}


def test_the_pci_bus_id_finds_a_gpu_whose_uuid_nvml_does_not_list_and_nothing_is_guessed():
    gpus = machine(3, denied={0})
    nvml = fake_nvml(gpus)
    unknown = "0badc0de-0000-0000-0000-000000000000"
    assert find_gpu(nvml, unknown, (0, 0x12, 0)) is gpus[2]
    assert find_gpu(nvml, unknown, (0, 0x10, 0)) is None  # GPU 0 is another job's
    assert find_gpu(nvml, unknown) is None


def test_the_uuid_finds_the_gpu_whatever_its_visible_index_case_or_type():
    """CUDA_VISIBLE_DEVICES=2,3: torch's cuda:0 and cuda:1 are NVML's GPUs 2 and 3 (torch gives the UUID without
    NVML's "GPU-" prefix); the raw index 0 would be another job's GPU."""
    gpus = machine(4)
    nvml = fake_nvml(gpus)
    assert [find_gpu(nvml, torch_uuid(gpus[i])) for i in (2, 3)] == [gpus[2], gpus[3]]
    assert find_gpu(nvml, gpus[1].uuid.upper()) is gpus[1]  # any case, with the prefix
    gpus[3].uuid = gpus[3].uuid.encode()  # older nvidia-ml-py returns bytes
    assert find_gpu(nvml, "00000003-aaaa-bbbb-cccc-000000000003") is gpus[3]
    assert find_gpu(nvml, "4e4e4e4e-4444-4444-4444-444444444444") is None  # not listed


def test_a_mig_instance_whose_uuid_is_not_listed_is_not_given_its_parent_gpus_figures():
    """A MIG instance's PCI bus id is its parent GPU's: the bus id must not hand out the whole GPU's figures (every
    tenant's memory) for an instance NVML does not list by UUID (an older driver's MIG-GPU-<uuid>/<gi>/<ci> form)."""
    instance = Gpu(uuid="MIG-11111111-1111-2222-3333-444444444444", bus=0x11)
    gpus = machine(2, **{"1": dict(mig=[instance])})
    nvml = fake_nvml(gpus)
    assert find_gpu(nvml, "99999999-1111-2222-3333-444444444444", (0, 0x11, 0)) is None
    assert find_gpu(nvml, "99999999-1111-2222-3333-444444444444", (0, 0x10, 0)) is gpus[0]
    assert find_gpu(nvml, torch_uuid(instance), (0, 0x11, 0)) is instance

    def slots(gpu):
        raise real_nvml.NVMLError_NoPermission()
    nvml.nvmlDeviceGetMaxMigDeviceCount = slots  # in MIG mode, its instances unreadable: still not a PCI match
    assert find_gpu(nvml, torch_uuid(instance), (0, 0x11, 0)) is None
