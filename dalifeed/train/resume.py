"""`resolve_run`: whether a dali-train command starts a run, continues the one in its folder, or is refused."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import fields
from pathlib import Path

from dalifeed.pipelines.elastic import ElasticError, merge_rank_states

from . import checkpoint
from .config import ConfigError, TrainConfig
from .distributed import log

# Options that may differ from the checkpoint's config when resuming: they do not change the maths.
RESUMABLE_OVERRIDES = {"epochs", "workers", "profile", "compile", "checkpoint_every", "check_shards", "progress_every",
                       "tensorboard_every", "cache_dir", "cache_limit", "log_samples", "allow_data_change"}


def resolve_run(asked: TrainConfig, typed: Collection[str] = (), resume: Path | None = None,
                world_size: int = 1) -> tuple[TrainConfig, dict | None]:
    """The config to run and the checkpoint it continues from (None: a fresh run), or ConfigError in one line.

    `asked` holds every option's value, `typed` names those typed on the command line; `world_size` is the
    number of processes that will train.
    - `resume` RUN (--resume RUN): RUN/last.pt's run, with RUN as its --out. An option typed may repeat the
      saved value; one of RESUMABLE_OVERRIDES replaces it; any other value is refused.
    - `resume` None (--resume auto): --data and --out are needed. --out without last.pt: a fresh run of
      `asked`. With one: that run (in --out, wherever it was saved), if every option but RESUMABLE_OVERRIDES
      (which replace the saved ones) is the same, and the batch the same per process (the command run again,
      on any number of processes) or the same global batch; refused otherwise, naming each option that
      differs.
    - Either way, on another number of processes than the checkpoint's: the saved global batch, and so the
      learning rate and schedule, is kept by changing the per-process batch (refused when the processes
      cannot share it evenly); a mid-epoch checkpoint continues its epoch with the samples not yet trained
      (dalifeed/pipelines/elastic.py), refused only when it does not record them (an older dalifeed's).
    """
    if resume is not None:
        saved = checkpoint.load(resume / checkpoint.LAST)
        cfg = saved_config_with_typed_options(resume, saved, asked, typed)
    else:
        if not asked.data or not asked.out:
            raise ConfigError("--data and --out are required (or --resume RUN)")
        last = Path(asked.out) / checkpoint.LAST
        if not last.exists():
            return asked, None
        saved = checkpoint.load(last)
        cfg = saved_config_if_same_options(saved, asked, world_size)
        log(f"--out {asked.out} holds this run: continuing it from last.pt")
    check_world_size(cfg, saved, world_size)
    return cfg, saved


def saved_config_with_typed_options(run: Path, saved: dict, asked: TrainConfig, typed: Collection[str]) -> TrainConfig:
    """--resume RUN: the saved config, plus the few options that may change on resume; any other typed option
    that differs from the saved run is an error rather than a silently different experiment."""
    cfg = TrainConfig.from_json(saved["config"])
    cfg.allow_data_change = False  # for the resume it is typed with, not for every later one
    for name in typed:
        value = getattr(asked, name)
        if name in RESUMABLE_OVERRIDES or (name == "out" and Path(value) == run):
            setattr(cfg, name, value)
        elif getattr(cfg, name) != value:
            raise ConfigError(f"--{name.replace('_', '-')} {value} differs from the resumed run's "
                              f"{getattr(cfg, name)!r}; start a new --out instead")
    cfg.out = str(run)
    return cfg


def saved_config_if_same_options(saved: dict, asked: TrainConfig, world_size: int) -> TrainConfig:
    """--resume auto on a folder holding a run: the saved config, with RESUMABLE_OVERRIDES as asked, when the
    other options are the ones it was made with."""
    cfg = TrainConfig.from_json(saved["config"])
    # the defaults that depend on other options, as they were filled when saved; only the config that runs is
    # validated, once, by trainer.main (an option that differs from the saved run is refused here either way)
    asked.fill_defaults()
    # --out is where last.pt was found: a run folder moved elsewhere is that run
    changes = [f"--{f.name.replace('_', '-')} was {getattr(cfg, f.name)!r}, now {getattr(asked, f.name)!r}"
               for f in fields(TrainConfig) if f.name not in RESUMABLE_OVERRIDES | {"batch_size", "out"}
               and getattr(cfg, f.name) != getattr(asked, f.name)]
    saved_world = saved.get("world_size", world_size)
    # the same command on another number of processes keeps the saved global batch (check_world_size)
    same_batch = asked.batch_size == cfg.batch_size or asked.batch_size * world_size == cfg.batch_size * saved_world
    if not same_batch:
        changes.append(f"--batch-size was {cfg.batch_size}, now {asked.batch_size}" if saved_world == world_size else
                       f"--batch-size was {cfg.batch_size} on {saved_world} processes, now {asked.batch_size} on "
                       f"{world_size}")
    if changes:
        raise ConfigError(f"--out {asked.out} holds a run made with other options ({'; '.join(changes)}): continue it "
                          f"as it was with --resume {asked.out}, or choose another --out")
    for name in RESUMABLE_OVERRIDES:
        setattr(cfg, name, getattr(asked, name))
    cfg.out = asked.out
    return cfg


def check_world_size(cfg: TrainConfig, saved: dict, world_size: int) -> None:
    """A checkpoint saved by another number of processes: `cfg`'s per-process batch becomes the saved global
    batch shared by `world_size`, or refused if it cannot be; mid-epoch, refused too when the ranks' loader
    states cannot be merged (`elastic.merge_rank_states`)."""
    saved_world = saved.get("world_size", world_size)
    midway = saved.get("midway")
    if midway is not None and len(midway["loaders"]) != world_size:
        try:  # the epoch's consumed samples, shared out anew by Run.start_epoch: refused here if it cannot be
            merge_rank_states(midway["loaders"])
        except ElasticError as e:
            raise ConfigError(f"{cfg.out}: last.pt was saved mid-epoch by {len(midway['loaders'])} processes and "
                              f"cannot be resumed on {world_size} ({e}): resume it with as many") from None
    if saved_world == world_size:
        return
    global_batch = cfg.batch_size * saved_world
    if global_batch % world_size:
        raise ConfigError(f"{cfg.out}: trained on {saved_world} processes with global batch {global_batch} "
                          f"({cfg.batch_size} each x {cfg.accum_steps} steps); {world_size} processes cannot "
                          f"share it evenly: resume on a number of processes that divides {global_batch}")
    old, cfg.batch_size = cfg.batch_size, global_batch // world_size
    log(f"resuming on {world_size} processes (trained on {saved_world}): --batch-size {old} -> "
        f"{cfg.batch_size} per process keeps the global batch {global_batch * cfg.accum_steps}, the "
        f"learning rate and the schedule; the order of samples differs from an uninterrupted run"
        + ("; the rest of the epoch it stopped in is its samples not yet trained, shared by the processes"
           if midway is not None else ""))


def data_changes(saved: list[dict], now: list[dict]) -> list[str]:
    """How the shards a run holds now (`ShardData.contents`) differ from those its checkpoint recorded: one
    phrase per split of each dataset that differs, naming it, the shard counts and the first shard that
    differs (its tar, or its index alone: indexed again, positions moved)."""
    changes = []
    for before, after in zip(saved, now):
        for split, shards in before["splits"].items():
            current = after["splits"].get(split, [])
            if [list(s) for s in shards] == [list(s) for s in current]:
                continue
            then = {s[0]: list(s[1:]) for s in shards}
            present = {s[0]: list(s[1:]) for s in current}
            differ = [path for path in then if present.get(path) != then[path]]
            added = [path for path in present if path not in then]
            where = f"split {split!r} of {after['location']}: {len(shards)} shards then, {len(current)} now"
            if not differ and not added:
                changes.append(f"{where}, the same shards in another order")
                continue
            if differ:
                path = differ[0]
                old, new = then[path], present.get(path)
                first = f"{path} gone" if new is None else f"{path} sha256 {old[0][:12]}... now {new[0][:12]}..." \
                    if old[0] != new[0] else f"{path} indexed again (its index differs)"
            else:
                first = f"{added[0]} added"
            changes.append(f"{where}, {len(differ)} changed or gone, {len(added)} added (e.g. {first})")
    return changes


def check_same_data(cfg: TrainConfig, saved: dict, contents: list[dict]) -> str | None:
    """Whether a checkpoint (`saved`) may continue on the shards --data holds now (`contents`): the same shards,
    or, at an epoch's end with --allow-data-change, others (returns the change, for metrics.jsonl). A mid-epoch
    checkpoint names positions in the tars it read, so it never continues on other ones. ConfigError in one
    line otherwise; a checkpoint of an older dalifeed, which does not record its shards, gets a warning."""
    if saved.get("data") is None:
        log(f"warning: {cfg.out}/last.pt does not record the shards it trained on (an older dalifeed wrote it): "
            f"resuming without checking that --data still holds them")
        return None
    changes = data_changes(saved["data"], contents)
    if not changes:
        return None
    what = f"{cfg.out}/last.pt was trained on other shards than --data holds now ({changes[0]}" + \
        (f"; and {len(changes) - 1} more)" if len(changes) > 1 else ")")
    if saved.get("midway") is not None:
        raise ConfigError(f"{what}: it was saved mid-epoch and names positions in the tars it read, so it cannot "
                          f"continue on these; restore the shards it trained on, or start a new --out")
    if not cfg.allow_data_change:
        raise ConfigError(f"{what}: continue on them with --allow-data-change (recorded in metrics.jsonl), or "
                          f"restore the shards it trained on")
    log(f"warning: {what}: continuing on them (--allow-data-change)")
    return "; ".join(changes)
