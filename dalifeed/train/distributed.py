"""DDP set-up from torchrun's environment: NCCL on GPUs, gloo on the CPU, a no-op for one process."""

from __future__ import annotations

import os
import socket
from dataclasses import astuple, dataclass

import torch
import torch.distributed as dist

from dalifeed.pipelines.graphs import uses_gpu
from dalifeed.stack import StackReport, choose_device, stack_report


@dataclass(frozen=True)
class Dist:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


@dataclass(frozen=True)
class Launch:
    """Where the launcher put this process: torchrun's RANK, WORLD_SIZE and LOCAL_RANK (one process without)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def launched(environ=os.environ) -> Launch:
    """torchrun's variables as dali-train reads them (the CLI's messages and `setup` both use them); the loaders
    read theirs in pipelines/ranks.py, and `data.loader_options` refuses a run where the two disagree."""
    return Launch(int(environ.get("RANK", 0)), int(environ.get("WORLD_SIZE", 1)), int(environ.get("LOCAL_RANK", 0)))


def setup(device: str, report: StackReport | None = None) -> Dist:
    """Rank and world size from the launcher (`launched`); one process otherwise. The device is
    `stack.choose_device`'s, as the loaders decide it (`report`: this node's, probed when None): 'auto' on a
    node with GPUs and a stack that does not fit them raises `StackMismatch` before any process group forms;
    'auto' in a container or job given no GPU on a GPU host runs on the CPU and says why in one line. Ranks
    that would share one GPU are refused before NCCL starts (`refuse_shared_gpus`)."""
    rank, world_size, local_rank = astuple(launched())
    use_gpu = False
    if device != "cpu":
        report = stack_report() if report is None else report
        use_gpu = uses_gpu(choose_device(device, report))
        if report.notes:  # on a GPU too: a container without NVML trains, but its metrics lack GPU statistics
            log(f"--device {device}: {report.notes[0]}" + ("" if use_gpu else "; training on the CPU"))
    if use_gpu:
        index = cuda_index(local_rank, torch.cuda.device_count(), os.environ.get("CUDA_VISIBLE_DEVICES"))
        torch.cuda.set_device(index)
        dev = torch.device("cuda", index)
    else:
        dev = torch.device("cpu")
    if world_size > 1 and not dist.is_initialized():
        store = attempt_store(rank, world_size)
        if use_gpu:
            store = store or rendezvous_store(rank, world_size)
            refuse_shared_gpus(exchange(store["store"], "gpu", rank, world_size, gpu_identity(dev)))
        dist.init_process_group(backend="nccl" if use_gpu else "gloo", device_id=dev if use_gpu else None, **store)
    return Dist(rank, world_size, local_rank, dev)


class GpuAssignmentError(ValueError):
    """This rank has no visible GPU of its own; the message is one line naming the launch setting to change."""


def cuda_index(local_rank: int, visible: int, cuda_visible_devices: str | None = None) -> int:
    """The CUDA device (an index among the GPUs CUDA_VISIBLE_DEVICES leaves visible) that rank `local_rank` of
    this node computes on, with `visible` GPUs visible to it.

    torchrun leaves every GPU of the node visible to every rank: rank i takes GPU i. A launcher that gives each
    rank only its own GPU (srun with one task per GPU and `--gpu-bind`, one GPU a Kubernetes pod) leaves one
    visible, CUDA's device 0, while LOCAL_RANK still counts 0..7: `cuda:<local_rank>` would be "invalid
    device ordinal" on every rank but the first. Fewer GPUs than local ranks otherwise means two ranks would
    share one GPU: refused, in one line, rather than silently oversubscribed."""
    if visible == 1:
        return 0
    if 0 <= local_rank < visible:
        return local_rank
    shown = f" (CUDA_VISIBLE_DEVICES={cuda_visible_devices!r})" if cuda_visible_devices is not None else ""
    raise GpuAssignmentError(
        f"LOCAL_RANK={local_rank} but this process sees {visible} GPU(s){shown}: start at most one rank per visible "
        f"GPU on a node (torchrun --nproc-per-node {visible}), or give each rank its own GPU")


def gpu_identity(device: torch.device) -> str:
    """`HOST UUID` of this rank's CUDA device: CUDA's UUID names a GPU, or a MIG instance, whatever index
    CUDA_VISIBLE_DEVICES gives it in this process."""
    return f"{socket.gethostname()} {torch.cuda.get_device_properties(device).uuid}"


def rendezvous_store(rank: int, world_size: int) -> dict:
    """The launcher's store (env://: MASTER_ADDR and MASTER_PORT), as `init_process_group` arguments: made
    here, not by it, so the ranks can compare their GPUs in it first."""
    store, _, _ = next(dist.rendezvous("env://", rank, world_size))
    return {"store": store, "rank": rank, "world_size": world_size}


def exchange(store, key: str, rank: int, world_size: int, value: str) -> list[str]:
    """Every rank's `value`, in rank order, through the launcher's key-value `store` (no process group yet)."""
    store.set(f"dalifeed/{key}/{rank}", value)
    return [store.get(f"dalifeed/{key}/{r}").decode() for r in range(world_size)]


def refuse_shared_gpus(identities: list[str]) -> None:
    """Ranks whose GPUs are one device (`gpu_identity` of each, in rank order) would fail in NCCL ("Duplicate
    GPU detected") or, on gloo-less paths, silently share it: refused in one line. One GPU visible per rank
    is right when each rank's is its own (srun --gpu-bind, a pod per GPU), and such ranks' UUIDs differ."""
    ranks: dict[str, list[int]] = {}
    for rank, identity in enumerate(identities):  # by UUID alone: containers on one host may name it alike
        ranks.setdefault(identity.partition(" ")[2], []).append(rank)
    shared = [(uuid, r) for uuid, r in ranks.items() if len(r) > 1]
    if shared:
        uuid, r = shared[0]
        host = identities[r[0]].partition(" ")[0]
        raise GpuAssignmentError(
            f"ranks {', '.join(map(str, r))} on {host} would share one GPU ({uuid}): give each rank its own GPU "
            f"(torchrun --nproc-per-node at most the GPUs CUDA_VISIBLE_DEVICES shows, or srun --gpus-per-task 1)")


def attempt_store(rank: int, world_size: int) -> dict:
    """`init_process_group` arguments that keep each torchrun attempt's keys apart, or none.

    With the c10d rendezvous, torchrun's agent hosts one TCPStore for the workers (TORCHELASTIC_USE_AGENT_STORE)
    and keeps it across `--max-restarts` restarts, with the keys of the attempt that failed still in it: the
    restarted ranks read the dead ranks' addresses and wait for them (seen here: gloo's set-up waited until killed;
    pytorch/pytorch#135712). Under a prefix per attempt they meet only each other. The restart count agrees
    between the ranks of one node; on several nodes it may not (a node whose workers did not fail restarts
    them without counting), so multi-node jobs export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, which gives every
    attempt a fresh store and turns this off (docs/scaling.md)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store, _, _ = next(dist.rendezvous("env://", rank, world_size))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    return {"store": dist.PrefixStore(f"dalifeed/attempt-{attempt}", store), "rank": rank, "world_size": world_size}


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def gather_objects(obj) -> list:
    """`obj` of every rank, in rank order, on every rank."""
    if not dist.is_initialized():
        return [obj]
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return gathered


def all_reduce_min(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MIN)
    return values


def all_reduce_max(values: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values


def log(message: str) -> None:
    """Print `message` on rank 0 only, flushed (a log file under Slurm or nohup shows it at once). The rank is
    the launcher's (`launched`), as `setup` reads it, so a run can say what it decided before its process group
    exists."""
    if launched().is_main:
        print(message, flush=True)
