"""What every long-running command needs from the operating system: one run per output folder, signals that
stop work cleanly, child processes that die with their parent, and disk-full errors that say where.

- `folder_lock(folder, command)`: an exclusive `flock` on `<folder>/.dalifeed.lock` for the whole run. The
  kernel releases it when the process ends, however it ends, so a killed run never leaves a stale lock;
  a second run is refused in one line naming the holder's pid.
- `stop_on_signals()`: SIGINT and SIGTERM (what Ctrl-C, `kill PID`, Slurm and Kubernetes send) raise
  `Stopped` in the main thread instead of killing the process mid-write; the command reports where it
  stopped and exits 130 or 143.
- `die_with_parent()`: called in a worker process, it makes the kernel SIGKILL the worker when its parent
  dies (Linux's PR_SET_PDEATHSIG; a watchdog thread elsewhere), so a SIGKILLed or OOM-killed main process
  does not leave workers blocked forever on a pipe nobody reads. A fork server's worker is the server's
  child: the server exits when the process that started it does, and the kernel kills the worker then.
- `usable_cores()`: the CPUs this process may use (affinity, cgroup CPU quota, Slurm's CPUs per task): what
  every worker and thread count starts from, so that a container or a Slurm allocation is respected.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

LOCK_NAME = ".dalifeed.lock"
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # EFBIG: a file-size limit (ulimit -f, RLIMIT_FSIZE)


class FolderInUse(Exception):
    """Another dalifeed process holds the folder's lock."""


class Stopped(BaseException):
    """SIGINT or SIGTERM arrived; `exit_code` is 130 or 143 (128 + the signal number)."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name


class DiskFull(Exception):
    """A write failed for lack of space (or a file-size limit); the message names the file."""


@contextmanager
def folder_lock(folder: str | os.PathLike, command: str, name: str = LOCK_NAME) -> Iterator[Path]:
    """Hold `<folder>/<name>` (default `.dalifeed.lock`) exclusively for the duration; raise FolderInUse if
    another process holds it. The folder is created if needed."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 200).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise FolderInUse(f"{folder}: in use by {holder}; wait for it to finish or choose another folder") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} ({command}, since {time.strftime('%Y-%m-%d %H:%M:%S')})\n".encode())
    try:
        yield path
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with a waiting run)


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within the block, SIGINT and SIGTERM raise `Stopped` in the main thread (once: a second signal of
    either kind while stopping gets the default behaviour, so a stuck stop can still be forced)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL if sig == signal.SIGTERM else signal.default_int_handler)
        raise Stopped(signum)

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def die_with_parent(parent_pid: int) -> None:
    """In a child process: be killed when `parent_pid`, the process that started the pool, exits. Call first
    thing in a worker. The worker's own parent is `parent_pid` (fork) or a fork server, which exits with it."""
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            PR_SET_PDEATHSIG = 1
            if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
                if not pid_alive(parent_pid):  # it died before prctl took effect
                    os._exit(1)
                return
        except (OSError, AttributeError):
            pass
    threading.Thread(target=_watch_parent, args=(parent_pid,), daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while pid_alive(parent_pid):
        time.sleep(0.5)
    os._exit(1)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (in this PID namespace), whoever owns it."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        pass
    return True


def is_disk_full(error: BaseException) -> bool:
    return isinstance(error, OSError) and error.errno in DISK_FULL


def hit_file_size_limit(error: BaseException | None) -> bool:
    """Whether a failed write (or what it was raised from) hit a file-size limit (EFBIG: `ulimit -f`,
    RLIMIT_FSIZE, or a file system's largest file) rather than a full disk."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, OSError) and error.errno == errno.EFBIG:
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def write_remedy(error: BaseException) -> str:
    """What lets a refused write through: space freed, or the file-size limit it hit raised."""
    if hit_file_size_limit(error):
        return "raise the file-size limit it hit (ulimit -f; the disk is not full)"
    return "free space"


def free_bytes(folder: str | os.PathLike) -> int | None:
    try:
        return os.statvfs(folder).f_bavail * os.statvfs(folder).f_frsize
    except OSError:
        return None


def mib(n: int | float | None) -> str:
    return "?" if n is None else f"{n / 2**20:,.1f} MiB"


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def usable_cores(*, affinity: int | None = None, cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP,
                 environ: Mapping[str, str] = os.environ) -> int:
    """The CPUs this process may keep busy, at least 1: the fewest of its affinity mask (`taskset`, Slurm's
    and cpusets' binding), its cgroup's CPU quota rounded up (`docker run --cpus`, Kubernetes CPU limits: a
    quota the affinity mask does not show) and SLURM_CPUS_PER_TASK when set. `os.cpu_count()` is none of
    these: it counts the machine's CPUs, so inside an allocation it starts one worker per CPU of the host."""
    limits = [affinity if affinity is not None else len(os.sched_getaffinity(0))]
    quota = cgroup_cpu_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        limits.append(math.ceil(quota))
    slurm = environ.get("SLURM_CPUS_PER_TASK", "")
    if slurm.isdigit() and int(slurm) > 0:
        limits.append(int(slurm))
    return max(1, min(limits))


def usable_memory(*, physical: int | None = None, cgroup_root: Path = CGROUP_ROOT,
                  proc_cgroup: Path = PROC_CGROUP) -> int:
    """Bytes of memory this process may use: the machine's physical memory, or less where its cgroup's limit
    says so (`docker run --memory`, Kubernetes memory limits, Slurm's --mem under ConstrainRAMSpace): cgroup v2
    `memory.max`, v1 `memory/memory.limit_in_bytes`, the smallest along its path to the root."""
    if physical is None:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    v2_path, v1_path = _own_cgroups(proc_cgroup, "memory")
    limits = [physical]
    for folder in _up_to(cgroup_root, v2_path):
        limits.append(_memory_limit(folder / "memory.max"))
    for folder in _up_to(cgroup_root / "memory", v1_path):
        limits.append(_memory_limit(folder / "memory.limit_in_bytes"))
    return min(limit for limit in limits if limit is not None)


def _memory_limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def cgroup_cpu_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """CPUs' worth of time per period this process's cgroup may use (quota / period), the smallest along its
    path to the root as the kernel enforces it; None when there is no quota. cgroup v2 (`cpu.max`: "max
    100000" or "200000 100000") and v1 (`cpu/cpu.cfs_quota_us`, -1 for none, and `cpu.cfs_period_us`)."""
    v2_path, v1_path = _own_cgroups(proc_cgroup)
    quotas = []
    for folder in _up_to(cgroup_root, v2_path):
        quotas.append(_quota_v2(folder / "cpu.max"))
    for mount in ("cpu", "cpu,cpuacct"):
        for folder in _up_to(cgroup_root / mount, v1_path):
            quotas.append(_quota_v1(folder / "cpu.cfs_quota_us", folder / "cpu.cfs_period_us"))
    found = [q for q in quotas if q is not None]
    return min(found) if found else None


def _own_cgroups(proc_cgroup: Path, controller: str = "cpu") -> tuple[str, str]:
    """This process's cgroup paths ("/" inside a container's own namespace): the v2 one ("0::<path>") and
    the v1 one of `controller` ("<n>:cpu,cpuacct:<path>")."""
    v2 = v1 = "/"
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return v2, v1
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            v2 = path or "/"
        elif controller in controllers.split(","):
            v1 = path or "/"
    return v2, v1


def _up_to(mount: Path, path: str) -> list[Path]:
    """`mount/path` and each of its parents up to `mount` itself."""
    parts = [p for p in path.strip("/").split("/") if p and p != ".."]
    return [mount.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _quota_v2(cpu_max: Path) -> float | None:
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        return None


def _quota_v1(quota_file: Path, period_file: Path) -> float | None:
    try:
        quota, period = int(quota_file.read_text()), int(period_file.read_text())
    except (OSError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None
