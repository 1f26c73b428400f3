"""Which part of a split this process reads: its rank and the world size, from the launcher unless given.

A loader left without `rank` and `world_size` takes them from, in order:

1. an initialized `torch.distributed` process group (`get_rank()`, `get_world_size()`): "process group";
2. torchrun's environment, `RANK` and `WORLD_SIZE` (the global rank; `LOCAL_RANK` is the rank on the node and
   never a loader's rank): "environment (RANK/WORLD_SIZE)";
3. a Slurm job step started by `srun` without torchrun, `SLURM_PROCID` and `SLURM_STEP_NUM_TASKS`:
   "environment (SLURM_PROCID/SLURM_STEP_NUM_TASKS)". Only srun sets the step's task count; a batch script
   run by sbatch has `SLURM_PROCID=0` and the whole allocation's `SLURM_NTASKS`, so a plain `python train.py`
   there would otherwise read a fraction of the split. Under `srun torchrun`, torchrun's `RANK` comes first;
4. otherwise rank 0 of 1: "default".

Given values win over the environment. Given values that disagree with an initialized process group are an
error (one line): a rank the collectives do not share would read another rank's samples or none. A
data-parallel subgroup's ranks are the exception: a `world_size` above 1 that divides the group's size (tensor-
or pipeline-parallel ranks, `dist.new_group`, sharing one part), with a rank below it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch.distributed as dist

FROM_ARGUMENTS = "arguments"
FROM_GROUP = "process group"
FROM_TORCHRUN = "environment (RANK/WORLD_SIZE)"
FROM_SLURM = "environment (SLURM_PROCID/SLURM_STEP_NUM_TASKS)"
FROM_DEFAULT = "default"
RANKS_FROM = (FROM_ARGUMENTS, FROM_GROUP, FROM_TORCHRUN, FROM_SLURM, FROM_DEFAULT)


@dataclass(frozen=True)
class Ranks:
    """This process's `rank` of `world_size`, and where they came from (`source`, one of RANKS_FROM)."""

    rank: int
    world_size: int
    source: str


def group_ranks() -> Ranks | None:
    """The initialized default process group's rank and size; None without one."""
    if dist.is_available() and dist.is_initialized():
        return Ranks(dist.get_rank(), dist.get_world_size(), FROM_GROUP)
    return None


def launcher_ranks(environ: Mapping[str, str] | None = None) -> Ranks:
    """The ranks the module docstring's order gives (`environ`: the process's environment when None)."""
    group = group_ranks()
    if group is not None:
        return group
    environ = os.environ if environ is None else environ
    if "RANK" in environ or "WORLD_SIZE" in environ:
        if "RANK" not in environ or "WORLD_SIZE" not in environ:
            given, missing = ("RANK", "WORLD_SIZE") if "RANK" in environ else ("WORLD_SIZE", "RANK")
            raise ValueError(f"{given} is set but {missing} is not: set both, or pass rank= and world_size=")
        return Ranks(env_int(environ, "RANK"), env_int(environ, "WORLD_SIZE"), FROM_TORCHRUN)
    if "SLURM_PROCID" in environ and "SLURM_STEP_NUM_TASKS" in environ:  # srun's step, not sbatch's script
        return Ranks(env_int(environ, "SLURM_PROCID"), env_int(environ, "SLURM_STEP_NUM_TASKS"), FROM_SLURM)
    return Ranks(0, 1, FROM_DEFAULT)


def env_int(environ: Mapping[str, str], name: str) -> int:
    try:
        return int(environ[name])
    except ValueError:
        raise ValueError(f"{name}={environ[name]!r} is not an integer: pass rank= and world_size=") from None


def check_given(rank: int | None, world_size: int | None) -> None:
    if (rank is None) != (world_size is None):
        raise ValueError(f"give rank and world_size together, or neither (then they are the launcher's); got "
                         f"rank={rank}, world_size={world_size}")


def resolve_ranks(rank: int | None, world_size: int | None, ranks_from: str | None = None,
                  environ: Mapping[str, str] | None = None) -> Ranks:
    """`rank` of `world_size` as given (checked against an initialized process group), or the launcher's
    (`launcher_ranks`) when both are None. `ranks_from` is a record's source kept with its given values while
    the launcher still says the same (a loader's resolved `LoaderOptions` passed on); "arguments" otherwise."""
    check_given(rank, world_size)
    if rank is None:
        return launcher_ranks(environ)
    check_against_group(rank, world_size, group_ranks())
    if ranks_from not in (None, FROM_ARGUMENTS):
        try:
            launcher = launcher_ranks(environ)
        except ValueError:
            launcher = None
        if launcher == Ranks(rank, world_size, ranks_from):
            return launcher
    return Ranks(rank, world_size, FROM_ARGUMENTS)


def check_against_group(rank: int, world_size: int, group: Ranks | None) -> None:
    """Raise ValueError where given ranks disagree with the initialized process group `group` (None: no group),
    unless they can be a data-parallel subgroup's (module docstring)."""
    if group is None or (group.rank, group.world_size) == (rank, world_size):
        return
    if 1 < world_size < group.world_size and group.world_size % world_size == 0:
        return
    raise ValueError(f"rank={rank}, world_size={world_size} disagree with the initialized process group (rank "
                     f"{group.rank} of {group.world_size}): pass the group's, a data-parallel subgroup's (a world_size "
                     f"above 1 dividing {group.world_size}), or leave both out to use it")


def local_gpu(current: int, visible: int, environ: Mapping[str, str] | None = None) -> int:
    """The CUDA device a loader decodes on when not told (`current`: torch's current device, `visible`: the GPUs
    this process sees): torchrun's `LOCAL_RANK` where the process left torch's device at 0 and that GPU is
    visible (rank i of a node on GPU i, as dali-train does), else the current device (a `set_device` of the
    user's, or a launcher that gives each rank one GPU)."""
    environ = os.environ if environ is None else environ
    try:
        local_rank = int(environ.get("LOCAL_RANK", 0))
    except ValueError:
        return current
    return local_rank if current == 0 and visible > 1 and 0 < local_rank < visible else current
