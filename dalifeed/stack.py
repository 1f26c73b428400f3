"""Whether this node's NVIDIA driver, torch and DALI fit together, and where `--device auto` runs: one decision.

A CUDA program runs on a driver of its own CUDA major or a newer one (CUDA 12.x needs a driver >= 525, 13.x
>= 580); torch from PyPI is built for CUDA 13.0 from 2.11 on and DALI for the major its package names, so the
wrong pair on an R535-R575 driver leaves `torch.cuda.is_available()` False: before this check, `--device auto`
then trained on the CPU without a word.

- `probe()` reads what this process has: NVML's driver and GPUs, the NVIDIA device files, torch's and DALI's
  versions, CUDA builds and device counts. The only function here that looks at the machine.
- `check(stack)` is the decision, a pure function of a `Stack`: a `StackReport` with the problems (each one
  line naming what does not fit and the command that fixes it) and the warnings.
- `choose_device(requested, report)`: 'auto' -> 'gpu' on a node with NVIDIA GPUs whose stack fits, 'cpu' on a
  node without; on a node with GPUs and a stack that does not fit it raises `StackMismatch` (one line) instead
  of falling back to the CPU.

A GPU node is one whose GPUs this process can use (NVML, or a `/dev/nvidia<N>` it can open); elsewhere `--device
auto` runs on the CPU with a note saying how to be given the GPUs. NVML counts every GPU of the machine and refuses
a handle to those a job's cgroup denies (Slurm's ConstrainDevices): those are another job's, not a missing driver.
A container without NVML (NVIDIA_DRIVER_CAPABILITIES=compute) whose torch and DALI see GPUs is a GPU node too; it
only has no GPU statistics. The loaders, dali-train, dali-bench and gpu-check all ask `choose_device`; `dalifeed
doctor` prints all of it (dalifeed/doctor.py).
"""

from __future__ import annotations

import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

# The oldest Linux driver each CUDA major runs on (NVIDIA's tables, above), and the driver branch it ships in.
DRIVER_FLOOR = {12: "525.60.13", 13: "580.65.06"}
DALI_PACKAGE = {12: "nvidia-dali-cuda120", 13: "nvidia-dali-cuda130"}
# PyTorch's own index for a torch of each CUDA major (pytorch.org/get-started: cu126, cu128 and cu130 builds).
TORCH_INDEX = {12: "https://download.pytorch.org/whl/cu126", 13: "https://download.pytorch.org/whl/cu130"}
# The documented installs, from a source checkout (README.md, docs/gpu.md#the-cuda-stack).
INSTALL = {12: f"pip install -e '.[cuda12]' --extra-index-url {TORCH_INDEX[12]}", 13: "pip install -e '.[cuda13]'"}
DOCTOR = "dalifeed doctor"

_DALI_DIST = re.compile(r"^nvidia-dali(?:-[a-z]+)?-cuda(\d+)$")


class StackMismatch(Exception):
    """This node has NVIDIA GPUs and its torch or DALI cannot use them (or a GPU device was asked for on a node
    without one): one line naming what does not fit and the fix."""


@dataclass(frozen=True)
class Stack:
    """What this process has, as `probe` reads it; every field can be given by hand (the tests do)."""

    driver: str | None = None  # NVML's driver version ("535.104.05"); None: NVML did not answer
    driver_cuda: str | None = None  # the newest CUDA the driver runs ("12.2", nvmlSystemGetCudaDriverVersion)
    nvml_gpus: tuple[str, ...] = ()  # the names of the GPUs NVML lists and lets this process open
    nvml_closed: tuple[str, ...] = ()  # "GPU <i>: <NVML error>" for each GPU NVML lists but will not open or name
    nvml_error: str | None = None  # why NVML did not answer or count the GPUs ("NVML Shared Library Not Found")
    device_files: tuple[str, ...] = ()  # /dev/nvidia<N> this process can open: GPUs even where NVML is silent
    closed_device_files: tuple[str, ...] = ()  # /dev/nvidia<N> it may not open (a job's cgroup device rules)
    host_gpus: tuple[str, ...] = ()  # /proc/driver/nvidia/gpus/<bus id>: the host's, seen also by a container without
    cuda_visible_devices: str | None = None  # $CUDA_VISIBLE_DEVICES, None when unset
    torch: str | None = None  # torch.__version__ ("2.14.1+cu130")
    torch_cuda: str | None = None  # torch.version.cuda ("13.0"); None: a CPU-only build
    torch_gpus: int = 0  # torch.cuda.device_count() where torch.cuda.is_available()
    dali: str | None = None  # nvidia.dali.__version__; None: DALI is not installed
    dali_packages: tuple[str, ...] = ()  # the installed nvidia-dali-*cuda<NNN> distributions
    dali_cuda_build: int | None = None  # nvidia.dali.__cuda_version__ (12986 for CUDA 12.9.86)
    dali_gpus: int = 0  # DALI's GetCUDADeviceCount()

    @property
    def driver_major(self) -> int | None:
        return _major(self.driver_cuda)

    @property
    def torch_major(self) -> int | None:
        return _major(self.torch_cuda)

    @property
    def dali_majors(self) -> tuple[int, ...]:
        """The CUDA majors of the installed DALI builds: from the package names (nvidia-dali-cuda130 -> 13; DALI's
        setup.py.in names it nvidia-dali-cuda@CUDA_VERSION_SHORT_DIGIT_ONLY@), else from __cuda_version__
        (int('12.9.86'.replace('.', '')), DALI's __init__.py.in: its first two digits)."""
        majors = sorted({int(m.group(1)) // 10 for m in map(_DALI_DIST.match, self.dali_packages) if m})
        if not majors and self.dali_cuda_build:
            majors = [int(str(self.dali_cuda_build)[:2])]
        return tuple(majors)

    @property
    def gpus_hidden(self) -> bool:
        """CUDA_VISIBLE_DEVICES hides every GPU from CUDA ("" or "-1": how a user asks for the CPU on a GPU node);
        NVML ignores the variable and still lists them."""
        return self.cuda_visible_devices is not None and self.cuda_visible_devices.strip() in ("", "-1")

    @property
    def gpu_count(self) -> int:
        """The GPUs this process can use: those NVML lets it open, else the /dev/nvidia<N> files it can open, else
        the most torch or DALI counts (CUDA without NVML and without device files, as under WSL)."""
        return len(self.nvml_gpus) or len(self.device_files) or max(self.torch_gpus, self.dali_gpus)

    @property
    def gpu_node(self) -> bool:
        """Whether this process is on a node with NVIDIA GPUs it can use and is meant to."""
        return self.gpu_count > 0 and not self.gpus_hidden

    @property
    def given_no_gpu(self) -> bool:
        """A container or job on a GPU host that was given none of its GPUs (module docstring)."""
        return self.gpu_count == 0 and bool(self.host_gpus or self.closed_device_files or self.nvml_closed)

    @property
    def cuda_without_nvml(self) -> bool:
        """NVML does not answer but torch or DALI counts GPUs: CUDA runs on this driver, NVML's library is missing
        (a container started with NVIDIA_DRIVER_CAPABILITIES=compute, without `utility`)."""
        return self.driver is None and bool(self.torch_gpus or self.dali_gpus)


@dataclass
class StackReport:
    stack: Stack
    problems: list[str] = field(default_factory=list)  # each stops --device auto (and gpu) on this node
    warnings: list[str] = field(default_factory=list)  # a stack that would not run on a GPU node, here on the CPU
    notes: list[str] = field(default_factory=list)  # why auto runs on the CPU near GPUs; what a GPU node lacks

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def device(self) -> str:
        """What --device auto becomes here ('gpu' or 'cpu'), or 'refused' where it stops."""
        return "refused" if self.problems else "gpu" if self.stack.gpu_node else "cpu"

    def one_line(self) -> str:
        """The problems as the one line a command stops with."""
        more = f" (and {len(self.problems) - 1} more: run `{DOCTOR}`)" if len(self.problems) > 1 else ""
        return self.problems[0] + more

    def to_json(self) -> dict:
        stack = self.stack
        return {**asdict(stack), "driver_major": stack.driver_major, "torch_major": stack.torch_major,
                "dali_majors": list(stack.dali_majors), "gpu_node": stack.gpu_node, "gpus_hidden": stack.gpus_hidden,
                "given_no_gpu": stack.given_no_gpu, "ok": self.ok, "device_auto": self.device,
                "problems": self.problems, "warnings": self.warnings, "notes": self.notes}


def _major(version: str | None) -> int | None:
    try:
        return int(str(version).split(".")[0]) if version else None
    except ValueError:
        return None


# -- the decision ----------------------------------------------------------------------------------------

def check(stack: Stack) -> StackReport:
    """Whether torch and DALI of `stack` can use its GPUs (see the module docstring); a pure function."""
    report = StackReport(stack)
    report.problems += _dali_installed(stack)
    if not stack.gpu_node:
        if stack.given_no_gpu and not stack.gpus_hidden:
            report.notes.append(not_given_note(stack))
        if stack.torch_major and stack.dali_majors and stack.dali_majors != (stack.torch_major,):
            report.warnings.append(_majors_differ(stack, stack.torch_major) + " (no GPU here, so the CPU runs it)")
        return report
    report.problems += _versions_fit(stack)
    if not report.problems:  # versions that fit; whether each library really sees the GPUs
        report.problems += _libraries_see_gpus(stack)
    if stack.cuda_without_nvml:
        report.notes.append(nvml_missing_note(stack))
    return report


NVML_MISSING = ("NVML not available: no GPU statistics; the container needs "
                "NVIDIA_DRIVER_CAPABILITIES=compute,utility for them")
LIBRARY_NOT_FOUND = "NVML Shared Library Not Found"  # str(pynvml.NVMLError_LibraryNotFound())


def nvml_missing_note(stack: Stack) -> str:
    """The one line for a GPU node whose CUDA answers and whose NVML does not: training runs, without NVML's figures."""
    if stack.nvml_error in (None, LIBRARY_NOT_FOUND):
        return NVML_MISSING
    return f"NVML not available ({stack.nvml_error}): no GPU statistics"


def not_given_note(stack: Stack) -> str:
    """Why a process on a GPU host runs on the CPU: the GPUs it sees but was not given, and how to be given them."""
    if stack.closed_device_files or stack.nvml_closed:
        seen = (f"{', '.join(stack.closed_device_files[:2])} cannot be opened by this process"
                if stack.closed_device_files else f"NVML lists {len(stack.nvml_closed)} GPU(s) this process may not "
                                                  f"open")
        how = ("ask the job for GPUs (Slurm: --gres=gpu:N or --gpus N; a container: --gpus all)")
    else:
        seen = f"the host lists {len(stack.host_gpus)} NVIDIA GPU(s) in /proc/driver/nvidia/gpus"
        how = "run it with --gpus all (Kubernetes: a nvidia.com/gpu limit) to use them"
    return f"this container or job was given no GPU ({seen}): {how}"


def _dali_installed(stack: Stack) -> list[str]:
    if not stack.dali and not stack.dali_packages:
        major = _fitting_major(stack)
        return [f"NVIDIA DALI is not installed (the base install leaves its CUDA build to you): {INSTALL[major]}"]
    if len(stack.dali_packages) > 1:
        major = _fitting_major(stack)
        return [f"{len(stack.dali_packages)} DALI builds are installed over one nvidia/dali folder "
                f"({', '.join(stack.dali_packages)}): keep the one for CUDA {major}: pip uninstall -y "
                f"{' '.join(stack.dali_packages)} && pip install '{DALI_PACKAGE[major]}>=2.0'"]
    return []


def _fitting_major(stack: Stack) -> int:
    """The CUDA major a stack for this node should have: the driver's newest one dalifeed has an install for;
    without a driver, torch's (nothing to fit), else 13 (what PyPI's torch is)."""
    if stack.driver_major is not None:
        return 13 if stack.driver_major >= 13 else 12
    return stack.torch_major if stack.torch_major in INSTALL else 13


def _versions_fit(stack: Stack) -> list[str]:
    """The problems of a GPU node's versions: no driver answering, a driver too old for torch's or DALI's CUDA
    major, a CPU-only torch, torch and DALI of two CUDA majors."""
    gpus = f"{stack.gpu_count} NVIDIA GPU(s)"
    if stack.driver is None and not stack.cuda_without_nvml:
        return [f"this node has {gpus} ({', '.join(stack.device_files[:2])}) but NVML does not answer: load the "
                f"NVIDIA driver (nvidia-smi shows whether it runs); in a container, run it with --gpus all "
                f"(the NVIDIA Container Toolkit mounts the driver)"]
    if stack.driver is None:  # no driver version to compare: a library that counts the GPUs runs on this driver
        if stack.torch_major is None:
            return [f"torch {stack.torch} is a CPU-only build (torch.version.cuda is None) on a node with {gpus}: "
                    f"{_torch_fix(_fitting_major(stack))}"]
        if stack.dali_majors and stack.dali_majors != (stack.torch_major,):
            return [_majors_differ(stack, stack.torch_major)]
        return []
    driver = f"driver {stack.driver} runs CUDA up to {stack.driver_cuda}"
    if stack.driver_major is not None and stack.driver_major < 12:
        return [f"{driver}; torch and DALI need CUDA 12 (driver >= {DRIVER_FLOOR[12]}) or 13 (>= "
                f"{DRIVER_FLOOR[13]}): upgrade the NVIDIA driver"]
    major = _fitting_major(stack)
    problems = []
    if stack.torch_major is None:
        problems.append(f"torch {stack.torch} is a CPU-only build (torch.version.cuda is None) on a node with {gpus}: "
                        f"{_torch_fix(major)}")
    elif stack.driver_major is not None and stack.torch_major > stack.driver_major:
        problems.append(f"{driver} but torch {stack.torch} is built for CUDA {stack.torch_cuda} (needs driver >= "
                        f"{DRIVER_FLOOR.get(stack.torch_major, '?')}): {_torch_fix(major)} (or upgrade the driver)")
    for dali_major in stack.dali_majors:
        if stack.driver_major is not None and dali_major > stack.driver_major:
            problems.append(f"{driver} but DALI {stack.dali} ({_dali_name(stack, dali_major)}) is built for CUDA "
                            f"{dali_major} (needs driver >= {DRIVER_FLOOR.get(dali_major, '?')}): "
                            f"{_dali_fix(stack, major)} (or upgrade the driver)")
    torch_fits = stack.torch_major is not None and stack.torch_major <= (stack.driver_major or 0)
    dali_fits = all(m <= (stack.driver_major or 0) for m in stack.dali_majors)
    if torch_fits and dali_fits and stack.dali_majors and stack.dali_majors != (stack.torch_major,):
        # both run on this driver, but as two CUDA runtimes in one process: one stack has one major
        problems.append(_majors_differ(stack, stack.torch_major))
    return problems


def _majors_differ(stack: Stack, major: int) -> str:
    dali = ", ".join(_dali_name(stack, m) for m in stack.dali_majors)
    return (f"torch {stack.torch} is built for CUDA {stack.torch_cuda} but DALI {stack.dali} ({dali}) for CUDA "
            f"{'/'.join(map(str, stack.dali_majors))}: install DALI for CUDA {major}: {_dali_fix(stack, major)}")


def _libraries_see_gpus(stack: Stack) -> list[str]:
    nvml = (f"NVML lists {len(stack.nvml_gpus)}" if stack.nvml_gpus else f"DALI sees {stack.dali_gpus}"
            if stack.dali_gpus else f"this process can open {', '.join(stack.device_files[:2])}")
    visible = (f", CUDA_VISIBLE_DEVICES={stack.cuda_visible_devices}" if stack.cuda_visible_devices is not None else "")
    if stack.torch_gpus == 0:
        return [f"torch {stack.torch} sees no GPU although {nvml}{visible}: CUDA's own error: python -c "
                f"\"import torch; torch.cuda.init()\""]
    if stack.dali_gpus == 0:
        return [f"DALI {stack.dali} sees no GPU although torch sees {stack.torch_gpus}{visible}: CUDA's own error: "
                f"python -c \"from nvidia.dali.backend import GetCUDADeviceCount; GetCUDADeviceCount()\""]
    return []


def _dali_name(stack: Stack, major: int) -> str:
    names = [p for p in stack.dali_packages if (m := _DALI_DIST.match(p)) and int(m.group(1)) // 10 == major]
    return names[0] if names else f"CUDA {major} build"


def _torch_fix(major: int) -> str:
    """A torch (and torchvision) of CUDA `major`, replacing the installed one: --force-reinstall, since pip keeps
    an installed torch that satisfies the version asked for, whatever its CUDA build."""
    return f"pip install --force-reinstall torch torchvision --index-url {TORCH_INDEX[major]}"


def _dali_fix(stack: Stack, major: int) -> str:
    installed = [p for p in stack.dali_packages if p != DALI_PACKAGE[major]]
    remove = f"pip uninstall -y {' '.join(installed)} && " if installed else ""
    return f"{remove}pip install '{DALI_PACKAGE[major]}>=2.0'"


def choose_device(requested: str, report: StackReport) -> str:
    """`requested` ('auto', 'cpu', 'gpu', 'hybrid'; 'cuda' means 'gpu') as this node can run it: 'auto' -> 'gpu'
    where `report`'s node has NVIDIA GPUs and its stack fits, 'cpu' where it has none. Raises `StackMismatch`
    on a node with GPUs whose stack does not fit (never a silent CPU run there), and for a GPU device asked for
    on a node without one; 'cpu' is taken as asked."""
    device = "gpu" if requested == "cuda" else requested
    if device == "cpu":
        return "cpu"
    if report.problems:
        raise StackMismatch(report.one_line())
    if report.stack.gpu_node:
        return "gpu" if device == "auto" else device
    if device == "auto":
        return "cpu"
    hidden = (f"CUDA_VISIBLE_DEVICES={report.stack.cuda_visible_devices!r} hides its GPUs" if report.stack.gpus_hidden
              else not_given_note(report.stack) if report.stack.given_no_gpu
              else "no NVIDIA driver answers and there is no /dev/nvidia<N>")
    raise StackMismatch(f"--device {requested} needs a CUDA GPU and this node has none ({hidden}): "
                        f"use --device cpu, or auto")


# -- DALI that does not import -------------------------------------------------------------------------

def dali_missing(error: ImportError) -> str:
    """The line for a DALI that does not import: the install `stack.check` names for this node, or, where a DALI
    package is installed but fails to import, how to see why."""
    stack = probe()
    if not stack.dali_packages:
        return check(stack).problems[0]
    return (f"NVIDIA DALI ({', '.join(stack.dali_packages)}) is installed but does not import ({error}): "
            f"python -c \"import nvidia.dali\" shows why")


def dali_import_error() -> ImportError | None:
    """Why DALI does not import here, or None when it does."""
    try:
        import nvidia.dali  # noqa: F401  (the command imports it anyway)
    except ImportError as e:
        return e
    return None


def is_dali_missing(error: ImportError) -> bool:
    """Whether an ImportError is DALI's (nvidia.dali, a module of it, or no `nvidia` package at all, as with a
    CPU-only torch) rather than another package's."""
    name = error.name or ""
    return name == "nvidia" or name.split(".")[:2] == ["nvidia", "dali"] or "nvidia.dali" in str(error)


# -- what this process has -------------------------------------------------------------------------------

def probe(environ=os.environ, root: Path = Path("/")) -> Stack:
    """This process's `Stack`. Never raises: what cannot be read is None or 0 (no driver, no DALI)."""
    nvml = nvml_driver()
    torch_version, torch_cuda, torch_gpus = torch_stack()
    dali, packages, build, dali_gpus = dali_stack()
    devices = nvidia_device_files(root)
    # NVML opening every GPU it lists settles it; else each file is opened, as CUDA would open it
    opened = devices if nvml.gpus and not nvml.closed else tuple(d for d in devices if can_open(root / d.lstrip("/")))
    return Stack(driver=nvml.driver, driver_cuda=nvml.cuda, nvml_gpus=nvml.gpus, nvml_closed=nvml.closed,
                 nvml_error=nvml.error, device_files=opened,
                 closed_device_files=tuple(d for d in devices if d not in opened), host_gpus=host_gpu_entries(root),
                 cuda_visible_devices=environ.get("CUDA_VISIBLE_DEVICES"), torch=torch_version, torch_cuda=torch_cuda,
                 torch_gpus=torch_gpus, dali=dali, dali_packages=packages, dali_cuda_build=build, dali_gpus=dali_gpus)


def stack_report() -> StackReport:
    """`check(probe())`: what every command that can use a GPU asks first."""
    return check(probe())


class NvmlAnswer(NamedTuple):
    """What NVML tells this process: the driver's version and newest CUDA ("12.2"), the names of the GPUs it may
    open, "GPU <i>: <error>" for those it may not, and why NVML did not answer or count the GPUs (None when it did)."""

    driver: str | None = None
    cuda: str | None = None
    gpus: tuple[str, ...] = ()
    closed: tuple[str, ...] = ()
    error: str | None = None


def nvml_driver() -> NvmlAnswer:
    """NVML's answer (`NvmlAnswer`). The driver's figures are kept whenever nvmlInit and the system calls answer; a
    GPU whose handle or name NVML refuses is another job's (NVML_ERROR_NO_PERMISSION under a cgroup), not a
    missing driver. No driver, no libnvidia-ml.so.1 or no nvidia-ml-py: an answer with only `error`."""
    try:
        import pynvml
    except ImportError as e:
        return NvmlAnswer(error=f"nvidia-ml-py is not installed ({e})")
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound in a container without `utility`; DriverNotLoaded
        return NvmlAnswer(error=str(e))
    try:
        try:
            driver = _text(pynvml.nvmlSystemGetDriverVersion())
            cuda = pynvml.nvmlSystemGetCudaDriverVersion()  # 12020 for CUDA 12.2, as cudaDriverGetVersion gives it
        except Exception as e:  # a system call this driver lacks: no version is worth a guess
            return NvmlAnswer(error=str(e))
        cuda = f"{cuda // 1000}.{cuda % 1000 // 10}"
        try:
            count = pynvml.nvmlDeviceGetCount()  # _v2: every GPU of the machine, also those this process may not open
        except Exception as e:
            return NvmlAnswer(driver, cuda, error=f"nvmlDeviceGetCount: {e}")
        names, closed = [], []
        for i in range(count):
            try:
                names.append(_text(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(i))))
            except Exception as e:
                closed.append(f"GPU {i}: {e}")
        return NvmlAnswer(driver, cuda, tuple(names), tuple(closed))
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def nvidia_device_files(root: Path = Path("/")) -> tuple[str, ...]:
    """/dev/nvidia<N>, one per GPU the kernel module made a node for (not the control nodes nvidiactl,
    nvidia-uvm, ...): GPUs even where NVML does not answer (a container started without the driver's
    libraries), if this process can open them (`can_open`)."""
    return tuple(sorted("/" + p.relative_to(root).as_posix() for p in (root / "dev").glob("nvidia*")
                        if re.fullmatch(r"nvidia\d+", p.name)))


def host_gpu_entries(root: Path = Path("/")) -> tuple[str, ...]:
    """/proc/driver/nvidia/gpus/<bus id>: the host's GPUs, also inside a container that was given none."""
    try:
        return tuple(sorted("/" + p.relative_to(root).as_posix() for p in (root / "proc/driver/nvidia/gpus").iterdir()))
    except OSError:
        return ()


def can_open(path: Path) -> bool:
    """Whether this process may open a device file for reading and writing, as CUDA does: a cgroup's device
    rules (Slurm's ConstrainDevices, a container's device list) refuse it with EPERM."""
    try:
        os.close(os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_NONBLOCK))
        return True
    except OSError:
        return False


def dali_distributions(paths: list[str] | None = None) -> tuple[str, ...]:
    """The installed nvidia-dali-*cuda<NNN> distributions, from their dist-info folders on sys.path (a glob:
    importlib.metadata.distributions() reads every package's metadata, and the loaders ask this for every
    'auto' loader)."""
    names = set()
    for entry in sys.path if paths is None else paths:
        for info in Path(entry or ".").glob("nvidia_dali*.dist-info"):
            name = info.name.split("-")[0].replace("_", "-").lower()
            if _DALI_DIST.match(name):
                names.add(name)
    return tuple(sorted(names))


def torch_stack() -> tuple[str | None, str | None, int]:
    try:
        import torch
    except ImportError:
        return None, None, 0
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return torch.__version__, torch.version.cuda, gpus


def dali_stack() -> tuple[str | None, tuple[str, ...], int | None, int]:
    """(DALI's version, the installed nvidia-dali-*cuda<NNN> distributions, its __cuda_version__, the GPUs it
    sees). The count is GetCUDADeviceCount (cudaGetDeviceCount, dali/python/backend_impl.cc); DALI 2.4 has no
    GetCudaDeviceCount, which the loaders called until this module (so 'auto' never chose the GPU)."""
    packages = dali_distributions()
    try:
        import nvidia.dali as dali
        from nvidia.dali.backend import GetCUDADeviceCount
    except ImportError:
        return None, packages, None, 0
    try:
        gpus = GetCUDADeviceCount()
    except Exception:  # CUDA_CALL raises where the driver does not fit DALI's CUDA runtime
        gpus = 0
    return dali.__version__, packages, getattr(dali, "__cuda_version__", None), gpus


# -- what an install brings ------------------------------------------------------------------------------

_TORCH_CUDA_REQUIREMENT = re.compile(r"^(?:nvidia-cuda-runtime-cu(?P<suffix>\d+)\b"
                                     r"|nvidia-cuda-runtime\s*==\s*(?P<pin>\d+)"
                                     r"|cuda-toolkit\b[^=;]*==\s*(?P<toolkit>\d+))")


def torch_build_major(version: str, requires: list[str]) -> int | None:
    """The CUDA major of a torch distribution from its metadata: the local version label of PyTorch's index
    ("2.14.1+cu126" -> 12; "+cpu" -> None), else the CUDA runtime it requires from PyPI (2.10:
    "nvidia-cuda-runtime-cu12==12.8.90"; 2.11 on: "cuda-toolkit[cudart,...]==13.0.2"); None: a CPU-only build."""
    label = version.partition("+")[2]
    if label:
        return int(label[2:]) // 10 if re.fullmatch(r"cu\d{3,}", label) else None
    for requirement in requires:
        match = _TORCH_CUDA_REQUIREMENT.match(requirement.strip())
        if match:
            return int(next(v for v in match.groupdict().values() if v))
    return None


def install_majors(packages: list[tuple[str, str, list[str]]]) -> dict[str, int | None]:
    """{package: CUDA major} of the torch and DALI among `packages` ((name, version, requires_dist) each: the
    `install` entries of `pip install --dry-run --report`, or installed metadata), e.g. {"torch": 13,
    "nvidia-dali-cuda120": 12}: one CUDA major in its values is a stack that fits one driver."""
    majors = {}
    for name, version, requires in packages:
        name = name.lower()
        if name == "torch":
            majors[name] = torch_build_major(version, requires)
        elif match := _DALI_DIST.match(name):
            majors[name] = int(match.group(1)) // 10
    return majors


def pip_report_packages(report: dict) -> list[tuple[str, str, list[str]]]:
    """(name, version, requires_dist) of each package a `pip install --report` JSON would install."""
    return [(item["metadata"]["name"], item["metadata"]["version"], item["metadata"].get("requires_dist") or [])
            for item in report.get("install", [])]


def installed_packages() -> list[tuple[str, str, list[str]]]:
    """(name, version, requires) of torch and the DALI builds installed here (importlib.metadata)."""
    from importlib import metadata

    found = []
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "torch" or _DALI_DIST.match(name):
            found.append((name, dist.version, list(dist.requires or [])))
    return found
