"""`resolve_run`'s rules, one table: whether a dali-train command starts a run, continues the one in its run
folder, or is refused in one line. Real checkpoints (torch.save'd payloads holding what a resume reads); no
training."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from dalifeed.train import TrainConfig
from dalifeed.train.config import ConfigError
from dalifeed.train.resume import resolve_run

SAVED = dict(model="resnet18", image_size=16, batch_size=8, epochs=2, workers=2)  # the run in the folder


# a rank's loader state mid-epoch as an older dalifeed saved it (batches per rank, no samples recorded), and as
# today's saves one at a point no samples were consumed yet (what merge_rank_states merges without a pipeline)
OLD_MIDWAY_STATE = {"batches_done": 2}
MIDWAY_STATE = {"epoch": 1, "samples_done": 0, "dali": None}


def save_run(run: Path, data: Path, world_size: int = 1, midway_ranks: int = 0, truncated: bool = False,
             midway_state: dict = OLD_MIDWAY_STATE) -> None:
    """RUN/last.pt of a run of SAVED trained by `world_size` processes, saved mid-epoch by `midway_ranks`."""
    cfg = TrainConfig(data=str(data), out=str(run), **SAVED)
    cfg.validate()  # as saved: the defaults that depend on other options filled in
    payload = {"config": cfg.to_json(), "world_size": world_size, "classes": ["blue", "green", "red"],
               "state": {"epoch": 1, "step": 5, "best_score": 0.5, "bad_streak": 0}}
    if midway_ranks:
        payload["midway"] = {"stats": {}, "loaders": [midway_state] * midway_ranks}
    run.mkdir()
    torch.save(payload, run / "last.pt")
    if truncated:
        (run / "last.pt").write_bytes((run / "last.pt").read_bytes()[:100])


def command(resume: str, data: Path, run: Path, typed: dict) -> tuple[TrainConfig, set[str], Path | None]:
    """What the CLI hands resolve_run: every option's value and the names typed. `resume` auto types --data,
    --out and SAVED's options (the command that made the run) before `typed`; RUN types `typed` alone."""
    given = {"data": str(data), "out": str(run), **SAVED, **typed} if resume == "auto" else typed
    return TrainConfig(**{"data": None, "out": None, **given}), set(given), None if resume == "auto" else run


# (--resume, the run in the folder (save_run's options; None: no last.pt), options typed, processes now, decided:
#  the config's values when it runs (fresh=True: no checkpoint; log: a line rank 0 prints), or the refusal's words)
RULES = [
    pytest.param("auto", None, {}, 1, {"fresh": True, "epochs": 2}, id="fresh folder: a new run"),
    pytest.param("auto", None, {"data": None}, 1, "--data and --out are required (or --resume RUN)",
                 id="auto without --data"),
    pytest.param("auto", {}, {}, 1, {"epochs": 2, "log": "holds this run: continuing it from last.pt"},
                 id="auto, same options: continued"),
    pytest.param("auto", {}, {"workers": 1, "check_shards": "sha256", "progress_every": 5.0}, 1,
                 {"workers": 1, "check_shards": "sha256", "progress_every": 5.0},
                 id="auto, overrides: continued with them"),
    pytest.param("auto", {}, {"epochs": 5, "warmup_epochs": 0.2}, 1, {"epochs": 5, "warmup_epochs": 0.2},
                 id="auto, more epochs, the same warm-up: continued"),
    pytest.param("auto", {}, {"epochs": 5}, 1, "(--warmup-epochs was 0.2, now 0.5)",
                 id="auto, more epochs, the default warm-up that follows them: refused"),
    pytest.param("auto", {}, {"lr": 0.2}, 1, "(--lr was 0.1, now 0.2): continue it as it was with --resume",
                 id="auto, another lr: refused"),
    pytest.param("auto", {}, {"lr": 0.2, "model": "resnet34"}, 1,
                 "--model was 'resnet18', now 'resnet34'; --lr was 0.1, now 0.2", id="auto, two changes: both named"),
    pytest.param("auto", {"world_size": 2}, {"batch_size": 16}, 1, {"batch_size": 16},
                 id="auto, half the processes, same global batch: continued"),
    pytest.param("auto", {"world_size": 2}, {}, 1,
                 {"batch_size": 16, "log": "resuming on 1 processes (trained on 2): --batch-size 8 -> 16 per process "
                                          "keeps the global batch 16"},
                 id="auto, half the processes, the same command: continued at the saved global batch"),
    pytest.param("auto", {"world_size": 2}, {"batch_size": 4}, 1, "--batch-size was 8 on 2 processes, now 4 on 1",
                 id="auto, half the processes, another batch: refused"),
    pytest.param("auto", {}, {"batch_size": 16}, 1, "(--batch-size was 8, now 16)", id="auto, another batch: refused"),
    pytest.param("RUN", {}, {}, 1, {"epochs": 2, "batch_size": 8}, id="--resume RUN: its config"),
    pytest.param("RUN", {}, {"epochs": 5, "profile": 3}, 1, {"epochs": 5, "profile": 3},
                 id="--resume RUN, overrides typed: applied"),
    pytest.param("RUN", {}, {"model": "resnet18", "batch_size": 8, "out": "{run}"}, 1, {"model": "resnet18"},
                 id="--resume RUN, saved values typed again: accepted"),
    pytest.param("RUN", {}, {"model": "resnet34"}, 1,
                 "--model resnet34 differs from the resumed run's 'resnet18'; start a new --out instead",
                 id="--resume RUN, another model: refused"),
    pytest.param("RUN", {}, {"lr": 0.5}, 1, "--lr 0.5 differs from the resumed run's 0.1",
                 id="--resume RUN, another lr: refused"),
    pytest.param("RUN", None, {}, 1, "run/last.pt: no checkpoint to resume from", id="--resume of no run"),
    pytest.param("RUN", {"truncated": True}, {}, 1, "run/last.pt: unreadable checkpoint", id="truncated last.pt"),
    pytest.param("RUN", {"world_size": 2}, {}, 1,
                 {"batch_size": 16, "log": "resuming on 1 processes (trained on 2): --batch-size 8 -> 16 per process "
                                          "keeps the global batch 16"}, id="half the processes: batch doubled"),
    pytest.param("RUN", {"world_size": 2}, {}, 4, {"batch_size": 4}, id="twice the processes: batch halved"),
    pytest.param("RUN", {"world_size": 2}, {}, 3,
                 "trained on 2 processes with global batch 16 (8 each x 1 steps); 3 processes cannot share it evenly",
                 id="processes that cannot share the global batch: refused"),
    pytest.param("RUN", {"world_size": 2, "midway_ranks": 2}, {}, 1,
                 "last.pt was saved mid-epoch by 2 processes and cannot be resumed on 1 (the mid-epoch checkpoint "
                 "does not record which samples were consumed (written by an older dalifeed, or without sample "
                 "tracking)): resume it with as many",
                 id="mid-epoch checkpoint of an older dalifeed on other processes: refused"),
    pytest.param("RUN", {"world_size": 2, "midway_ranks": 2, "midway_state": MIDWAY_STATE}, {}, 1,
                 {"batch_size": 16, "log": "the rest of the epoch it stopped in is its samples not yet trained"},
                 id="mid-epoch checkpoint on other processes: its rest shared by them"),
    pytest.param("RUN", {"world_size": 2, "midway_ranks": 2}, {}, 2, {"batch_size": 8},
                 id="mid-epoch checkpoint on as many processes: continued"),
]


@pytest.mark.parametrize("resume, saved, typed, world_size, decided", RULES)
def test_resolve_run(tmp_path, capsys, resume, saved, typed, world_size, decided):
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()  # validate() wants a folder; nothing reads it
    if saved is not None:
        save_run(run, data, **saved)
    typed = {name: value.format(run=run) if isinstance(value, str) else value for name, value in typed.items()}
    asked, names, folder = command(resume, data, run, typed)
    if isinstance(decided, str):
        with pytest.raises(ConfigError, match=re.escape(decided)) as refused:
            resolve_run(asked, names, folder, world_size)
        assert "\n" not in str(refused.value)
        return
    cfg, checkpoint = resolve_run(asked, names, folder, world_size)
    assert (checkpoint is None) == decided.get("fresh", False)
    assert cfg.out == str(run) and cfg.data == str(data)
    values = {name: value for name, value in decided.items() if name not in ("fresh", "log")}
    assert {name: getattr(cfg, name) for name in values} == values
    if "log" in decided:
        assert decided["log"] in capsys.readouterr().out


def test_a_run_folder_moved_elsewhere_continues_under_its_new_out(tmp_path, capsys):
    """The folder holding last.pt is the run, wherever it was saved: the same command with the new --out
    continues it there, as --resume NEW does."""
    data, run, moved = tmp_path / "data", tmp_path / "run", tmp_path / "elsewhere" / "run"
    data.mkdir()
    save_run(run, data)
    moved.parent.mkdir()
    run.rename(moved)
    asked, names, _ = command("auto", data, moved, {})
    cfg, saved = resolve_run(asked, names, None, 1)
    assert saved is not None and cfg.out == str(moved) and "holds this run: continuing it" in capsys.readouterr().out
    cfg, saved = resolve_run(*command("RUN", data, moved, {})[:2], moved, 1)
    assert saved is not None and cfg.out == str(moved)


def test_a_resumed_command_validates_only_the_config_it_runs(tmp_path):
    """TrainConfig.validate builds the model on the meta device (and may probe the GPU stack). --resume auto
    compares the command's options with the saved run's with only the defaults that follow other options
    filled in, so the one validation of a command is trainer.main's, of the config that runs. Validating an
    unchanged config again does nothing; a changed one is checked again."""
    data, run = tmp_path / "data", tmp_path / "run"
    data.mkdir()
    save_run(run, data)
    asked, names, _ = command("auto", data, run, {})
    cfg, saved = resolve_run(asked, names)
    assert saved is not None and asked.warmup_epochs == 0.2  # filled as when saved: min(5, epochs / 10)
    assert not asked.validated and not cfg.validated
    cfg.validate()  # trainer.main's first line
    assert cfg.validated
    cfg.lr = -1.0
    assert not cfg.validated
    with pytest.raises(ConfigError, match=r"--lr must be > 0, got -1.0"):
        cfg.validate()
