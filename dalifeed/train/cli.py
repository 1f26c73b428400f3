"""`dali-train`: the command line over `dalifeed.train.trainer.main`."""

from __future__ import annotations

import os
import sys
import traceback
from pathlib import Path

import click
from click.core import ParameterSource

from dalifeed.pipelines.checks import ShardDataError

from . import checkpoint
from .config import ConfigError, TrainConfig
from .trainer import TrainingDiverged, main as train

# Options that may differ from the checkpoint's config when resuming: they do not change the maths.
RESUMABLE_OVERRIDES = {"epochs", "workers", "profile", "compile", "checkpoint_every", "check_shards"}


def parse_crop_scale(ctx, param, value: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected MIN,MAX such as 0.08,1 — got {value!r}") from None
    return lo, hi


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--data", help="Shard folder made by shard-convert (its train split trains, its val split evaluates).")
@click.option("--out", help="Run folder: config.json, metrics.jsonl, last.pt, best.pt, tensorboard/.")
@click.option("--resume", "resume_dir", type=click.Path(path_type=Path),
              help="Continue the run in this folder from its last.pt, with its saved config.")
@click.option("--model", default="resnet50", show_default=True, help="Any torchvision classification model name.")
@click.option("--width", type=int, default=None,
              help="ResNets only: channels of the first stage (torchvision's: 64; the stages are w, 2w, 4w, 8w). "
                   "Small images need less: ResNet-18 at width 32 has a quarter of the weights.")
@click.option("--epochs", type=int, default=90, show_default=True)
@click.option("--batch-size", type=int, default=256, show_default=True,
              help="Per process (per GPU). Global batch = batch size x processes x accum steps.")
@click.option("--lr", type=float, default=0.1, show_default=True,
              help="Learning rate per 256 images of global batch (scaled linearly).")
@click.option("--optimizer", type=click.Choice(["sgd", "adamw"]), default="sgd", show_default=True,
              help="sgd: momentum 0.9, Nesterov. Pass a smaller --lr for adamw (e.g. 0.001).")
@click.option("--momentum", type=float, default=0.9, show_default=True)
@click.option("--no-nesterov", "nesterov", is_flag=True, flag_value=False, default=True)
@click.option("--weight-decay", type=float, default=5e-5, show_default=True,
              help="Not applied to biases and normalisation weights.")
@click.option("--warmup-epochs", type=float, default=5.0, show_default=True,
              help="Linear warm-up, then cosine decay to --min-lr-ratio x lr.")
@click.option("--min-lr-ratio", type=float, default=0.0, show_default=True)
@click.option("--label-smoothing", type=float, default=0.1, show_default=True)
@click.option("--accum-steps", type=int, default=1, show_default=True, help="Gradient accumulation micro-steps.")
@click.option("--clip-grad", type=float, default=None, help="Clip the gradient norm to this value.")
@click.option("--ema", type=float, default=None, help="Keep an EMA of the weights with this decay (e.g. 0.9998).")
@click.option("--amp", type=click.Choice(["auto", "bf16", "fp16", "off"]), default="auto", show_default=True,
              help="auto: bf16 on a GPU that supports it, off on the CPU. fp16 adds a GradScaler.")
@click.option("--channels-last", is_flag=True, help="NHWC model and batches (faster convolutions on tensor cores).")
@click.option("--compile", is_flag=True, help="torch.compile the model.")
@click.option("--image-size", type=int, default=224, show_default=True)
@click.option("--crop-scale", default="0.08,1", show_default=True, callback=parse_crop_scale,
              help="RandomResizedCrop area range MIN,MAX.")
@click.option("--no-flip", "flip", is_flag=True, flag_value=False, default=True,
              help="No random horizontal flip (digits, text: anything a mirror changes).")
@click.option("--pretrained", type=click.Path(path_type=Path), default=None,
              help="Local weights (state_dict or checkpoint). A head of another class count is re-initialised.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--max-bad-steps", type=int, default=5, show_default=True,
              help="Abort after this many non-finite losses or gradients in a row (each is skipped and logged).")
@click.option("--workers", type=int, default=None, help="DALI threads per process (default: available cores).")
@click.option("--profile", type=int, default=0, show_default=True,
              help="Write RUN/profile_trace.json, a torch profiler trace of this many steps.")
@click.option("--checkpoint-every", type=int, default=0, show_default=True, metavar="STEPS",
              help="Also save last.pt every STEPS optimizer steps inside an epoch, with DALI's reader state, so "
                   "a resume continues mid-epoch (0: at epoch ends only).")
@click.option("--device", type=click.Choice(["auto", "cpu", "gpu"]), default="auto", show_default=True)
@click.option("--check-shards", type=click.Choice(["size", "sha256"]), default="size", show_default=True,
              help="Before training, compare every shard with the manifest: size (sizes and DALI indexes, "
                   "instant) or sha256 (also hashes every byte: catches bit flips, costs a full read).")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, resume_dir: Path | None, debug: bool, **options) -> None:
    """Train a torchvision classifier on dalifeed shards with DALI feeding the GPU (or the CPU).

    \b
    One process:       dali-train --data SHARDS --out runs/r50 --model resnet50 --epochs 90
    One 8-GPU node:    torchrun --nproc_per_node=8 -m dalifeed.train.cli --data SHARDS --out runs/r50
    Several nodes:     torchrun --nnodes=4 --nproc_per_node=8 --rdzv-backend=c10d \\
                         --rdzv-endpoint=HOST:29500 -m dalifeed.train.cli --data SHARDS --out runs/r50
    Resume after a crash or kill:  dali-train --resume runs/r50   (same command under torchrun)

    Every epoch: train, evaluate top-1/top-5 on the whole val split, append RUN/metrics.jsonl, save
    RUN/last.pt (and RUN/best.pt on a new best top-1). Resuming continues where the last checkpoint was
    taken (an epoch's end, or mid-epoch with --checkpoint-every) and replays exactly what an uninterrupted
    run would have done. See docs/training.md.

    Exit codes: 0 done; 2 usage (bad option, unusable --out or checkpoint); 1 a runtime failure (a shard
    that does not match its manifest or a sample DALI cannot decode, named in one line with the fix;
    training diverged). The full traceback goes to RUN/error.log (or the terminal with --debug); last.pt
    is left as it was.
    """
    try:
        options["crop_scale"] = tuple(options["crop_scale"])
        if options["pretrained"] is not None:
            options["pretrained"] = str(options["pretrained"])
        if resume_dir is not None:
            cfg, state = resume_config(ctx, resume_dir, options)
        else:
            cfg, state = new_config(options), None
        train(cfg, resume=state)
    except ConfigError as e:
        if debug:
            raise
        raise click.UsageError(str(e)) from None
    except (ShardDataError, TrainingDiverged) as e:
        if debug:
            raise
        what = "training diverged: " if isinstance(e, TrainingDiverged) else ""
        run = options["out"] or resume_dir
        log = write_error_log(Path(run), e) if run else None
        click.echo(f"Error: {rank_prefix()}{what}{e}" + (f" (traceback: {log})" if log else ""), err=True)
        sys.exit(1)


def rank_prefix() -> str:
    return f"rank {os.environ['RANK']}: " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""


def write_error_log(run: Path, error: BaseException) -> Path | None:
    """The full traceback (with DALI's own error as the cause) in the run folder, for a bug report."""
    if not run.is_dir():
        return None
    rank = os.environ.get("RANK", "0")
    path = run / ("error.log" if int(os.environ.get("WORLD_SIZE", 1)) == 1 else f"error-rank{rank}.log")
    try:
        path.write_text("".join(traceback.format_exception(error)))
    except OSError:
        return None
    return path


def new_config(options: dict) -> TrainConfig:
    if not options["data"] or not options["out"]:
        raise ConfigError("--data and --out are required (or --resume RUN)")
    if (Path(options["out"]) / checkpoint.LAST).exists():
        raise ConfigError(f"--out {options['out']}: holds a run already; continue it with --resume {options['out']} "
                          f"or choose another --out")
    return TrainConfig(**options)


def resume_config(ctx: click.Context, run: Path, options: dict) -> tuple[TrainConfig, dict]:
    """The saved config, plus the few options that may change on resume; any other explicit option that
    differs from the saved run is an error rather than a silently different experiment."""
    state = checkpoint.load(run / checkpoint.LAST)
    cfg = TrainConfig.from_json(state["config"])
    for name, value in options.items():
        if ctx.get_parameter_source(name) != ParameterSource.COMMANDLINE:
            continue
        if name in RESUMABLE_OVERRIDES or (name == "out" and Path(value) == run):
            setattr(cfg, name, value)
        elif getattr(cfg, name) != value:
            raise ConfigError(f"--{name.replace('_', '-')} {value} differs from the resumed run's "
                              f"{getattr(cfg, name)!r}; start a new --out instead")
    cfg.out = str(run)
    return cfg, state


if __name__ == "__main__":
    main()
