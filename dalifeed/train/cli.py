"""`dali-train`: the command line over `resume.resolve_run` and `trainer.main`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from dalifeed.cliutil import default, run_command, size_option
from dalifeed.pipelines.names import DEVICES, POLICIES
from dalifeed.runtime import DiskFull, FolderInUse
from dalifeed.s3 import StorageError
from dalifeed.stack import StackMismatch

try:
    from dalifeed.pipelines.checks import OpenFileLimit, ShardDataError
    from dalifeed.pipelines.dataset import MixError

    from .config import NO_SPLIT, RECIPE_GAPS, RECIPES, ConfigError, TrainConfig
except ImportError as e:  # `python -m` (torchrun -m) runs this module without the console script's check
    from dalifeed.entry import exit_without_dali
    from dalifeed.stack import is_dali_missing

    if __name__ != "__main__" or not is_dali_missing(e):
        raise
    exit_without_dali(e)

if TYPE_CHECKING:
    from .distributed import Launch

# The modules that import torch (distributed, resume, stop, trainer) are imported where a run starts, not
# here: `dali-train --help` then shows its options without importing torch (tests/test_train_cli.py).


def d(name: str):
    return default(TrainConfig, name)


def parse_val_split(ctx, param, value: str) -> str | None:
    return None if value.strip().lower() in NO_SPLIT else value


def parse_data(value: tuple) -> str | list[str] | None:
    """One --data is a string (as before), several a list."""
    return None if not value else value[0] if len(value) == 1 else list(value)


def parse_weights(value: str | None) -> list[float] | None:
    if value is None:
        return None
    try:
        return [float(v) for v in value.split(",")]
    except ValueError:
        raise click.BadParameter(f"expected numbers separated by commas, such as 3,1 — got {value!r}") from None


def parse_crop_scale(ctx, param, value: str) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value.split(","))
    except ValueError:
        raise click.BadParameter(f"expected MIN,MAX such as 0.08,1 — got {value!r}") from None
    return lo, hi


def parse_progressive_resize(ctx, param, value: str | None) -> str | None:
    """The schedule's syntax and values, checked here (exit 2, one line); kept as text in the config."""
    if value is None:
        return None
    from dalifeed.pipelines.resolution import ProgressiveResize

    try:
        ProgressiveResize.parse(value, epochs=1)  # START:END is filled from --epochs by the config
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    return value


@click.command(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.option("--data", multiple=True, callback=lambda ctx, param, value: parse_data(value),
              help="Shard folder made by shard-convert or adopted by shard-convert index (its train split trains, "
                   "its val split evaluates), or s3://bucket/prefix (each tar is fetched whole into the shard "
                   "cache, --cache-dir, and DALI reads it there; docs/storage.md). Repeat it to mix datasets: "
                   "every batch draws from each in the --data-weights proportions, the classes are the union of "
                   "theirs, and each is evaluated and reported apart (NAME/top1 ...).")
@click.option("--data-weights", default=None, callback=lambda ctx, param, value: parse_weights(value),
              metavar="W1,W2,...", help="With several --data: each one's share of every batch, e.g. 3,1 "
                                        "(default: equal).")
@click.option("--out", help="Run folder: config.json, metrics.jsonl, last.pt, best.pt, tensorboard/. If it holds a "
                            "run made with the same options, that run continues (what a restarted job wants).")
@click.option("--resume", default="auto", show_default=True, metavar="RUN|auto",
              help="RUN: continue the run in this folder from its last.pt with its saved config (options given "
                   "must agree with it, except --epochs, --dali-threads, --profile, --compile, --checkpoint-every, "
                   "--check-shards, --progress-every, --tensorboard-every, --allow-data-change). auto: continue "
                   "--out's run if it has one and the options are the same.")
@click.option("--task", type=click.Choice(["classify", "multilabel"]), default=d("task"), show_default=True,
              help="classify: one class per image (cross-entropy; top-1/top-5). multilabel: COCO shards, predict "
                   "which categories an image holds (multi-hot targets built in the DALI graph from .labels.i32, "
                   "binary cross-entropy; mean average precision reported as `map`).")
@click.option("--train-split", default=d("train_split"), show_default=True,
              help="The split that trains (COCO shards: e.g. train2017).")
@click.option("--val-split", default=d("val_split"), show_default=True, callback=parse_val_split,
              help="The split that evaluates after each epoch (COCO shards: e.g. val2017). none: train without "
                   "evaluation (best.pt then keeps the lowest train loss). A split the shards lack is an error.")
@click.option("--model", default=d("model"), show_default=True,
              help="Any torchvision classification model name, or resnet10 (ResNet-18 with one block a stage), built "
                   "for --image-size (ViT: a multiple of its patch size); a size the model cannot take is refused "
                   "before any data is read. A ResNet name + _cifar (resnet18_cifar): a 3x3 stride-1 stem and no "
                   "max-pool, for images of 8-32 px.")
@click.option("--width", type=int, default=d("width"),
              help="ResNets only: channels of the first stage (torchvision's: 64; the stages are w, 2w, 4w, 8w). "
                   "Small images need less: ResNet-18 at width 32 has a quarter of the weights.")
@click.option("--epochs", type=int, default=d("epochs"), show_default=True)
@click.option("--batch-size", type=int, default=d("batch_size"), show_default=True,
              help="Per process (per GPU). Global batch = batch size x processes x accum steps.")
@click.option("--lr", type=float, default=d("lr"), show_default=True,
              help="Learning rate per 256 images of global batch (scaled linearly).")
@click.option("--optimizer", type=click.Choice(["sgd", "adamw"]), default=d("optimizer"), show_default=True,
              help="sgd: momentum 0.9, Nesterov. Pass a smaller --lr for adamw (e.g. 0.001).")
@click.option("--momentum", type=float, default=d("momentum"), show_default=True)
@click.option("--no-nesterov", "nesterov", is_flag=True, flag_value=False, default=d("nesterov"))
@click.option("--weight-decay", type=float, default=d("weight_decay"), show_default=True,
              help="Not applied to biases and normalisation weights.")
@click.option("--warmup-epochs", type=float, default=d("warmup_epochs"),
              help="Linear warm-up, then cosine decay to --min-lr-ratio x lr. Default: min(5, epochs / 10).")
@click.option("--min-lr-ratio", type=float, default=d("min_lr_ratio"), show_default=True)
@click.option("--label-smoothing", type=float, default=d("label_smoothing"), show_default=True)
@click.option("--accum-steps", type=int, default=d("accum_steps"), show_default=True,
              help="Gradient accumulation micro-steps.")
@click.option("--clip-grad", type=float, default=d("clip_grad"), help="Clip the gradient norm to this value.")
@click.option("--ema", type=float, default=d("ema"), help="Keep an EMA of the weights with this decay (e.g. 0.9998).")
@click.option("--swa-start", type=int, default=d("swa_start"),
              help="Stochastic weight averaging: from this epoch (0-based) on, average the weights after every epoch; "
                   "after the last, recompute the average's BatchNorm statistics over the training data, evaluate it "
                   "(swa_top1) and save it as RUN/swa.pt. The paper's setting: the last 25%% of the epochs.")
@click.option("--swa-lr", type=float, default=d("swa_lr"),
              help="The learning rate from --swa-start on (per 256 images, scaled like --lr), constant after "
                   "--swa-anneal-epochs. Default: the schedule goes on as without SWA.")
@click.option("--swa-anneal-epochs", type=float, default=d("swa_anneal_epochs"), show_default=True,
              help="Anneal from the schedule's lr to --swa-lr over this many epochs (SWALR's cosine); 0: at once.")
@click.option("--amp", type=click.Choice(["auto", "bf16", "fp16", "off"]), default=d("amp"), show_default=True,
              help="auto: bf16 on a GPU with native bf16 (sm80+: A100, H100, L4), fp16 on older ones (V100, "
                   "T4), off on the CPU. fp16 adds a GradScaler (and is slow on a CPU: a warning says so).")
@click.option("--channels-last", is_flag=True, help="NHWC model and batches (faster convolutions on tensor cores).")
@click.option("--compile/--no-compile", default=d("compile"), show_default=True,
              help="torch.compile the model (minutes of compilation before the first step; docs/gpu.md). May "
                   "change on resume: --no-compile turns off what the run was started with.")
@click.option("--image-size", type=int, default=d("image_size"), show_default=True,
              help="Training's image size (RandomResizedCrop output), and validation's unless --val-image-size. "
                   "With --progressive-resize: only the size the model is built for (ViT) and validation's default.")
@click.option("--progressive-resize", default=d("progressive_resize"), callback=parse_progressive_resize,
              metavar="START:END[:FROM:TO]",
              help="Train at a size that grows with the epoch (FFCV's schedule; epochs count from 0): START up to "
                   "epoch FROM, END from epoch TO on, in between the straight line rounded to multiples of 32 px "
                   "(e.g. 160:192:65:76 of 88 epochs, FFCV's ResNet-50). START:END ramps from the first epoch to "
                   "the last. Each epoch's size is printed at start; a resume trains at the epoch's size.")
@click.option("--val-image-size", type=int, default=d("val_image_size"), metavar="PX",
              help="Evaluate at this size (the centre crop) instead of --image-size: testing above the training "
                   "size gains accuracy (Touvron et al. 2019; FFCV trains at 160-192 and tests at 256).")
@click.option("--val-resize", type=int, default=d("val_resize"), metavar="PX",
              help="Validation resizes the shorter side to PX before the centre crop [default: the validation "
                   "size / 0.875, torchvision's 256 for 224].")
@click.option("--crop-scale", default=",".join(f"{v:g}" for v in d("crop_scale")), show_default=True,
              callback=parse_crop_scale, help="RandomResizedCrop area range MIN,MAX.")
@click.option("--no-flip", "flip", is_flag=True, flag_value=False, default=d("flip"),
              help="No random horizontal flip (digits, text: anything a mirror changes).")
@click.option("--pretrained", type=click.Path(path_type=Path), default=d("pretrained"),
              help="Local weights (state_dict or checkpoint). A head of another class count is re-initialised.")
@click.option("--seed", type=int, default=d("seed"), show_default=True)
@click.option("--max-bad-steps", type=int, default=d("max_bad_steps"), show_default=True,
              help="Abort after this many non-finite losses or gradients in a row (each is skipped and logged).")
@click.option("--dali-threads", "--workers", "workers", type=int, default=d("workers"), metavar="N",
              help="DALI threads of each rank's loader (shared by its lanes, see --lanes). Default: the CPUs this "
                   "process may use divided by the ranks on this node (LOCAL_WORLD_SIZE), at most 6 with GPU "
                   "decoding and 16 with CPU decoding; printed at start. --workers is its old name.")
@click.option("--lanes", type=int, default=d("lanes"), metavar="N",
              help="Pipelines of the training loader per rank, each with its share of --dali-threads, reading its "
                   "part of the rank's shard and handing out whole batches in turn (docs/pipelines.md). Default: 2 "
                   "for CPU training with 2 threads or more and epochs of 24 batches or more (they keep the cores "
                   "busy that one pipeline leaves idle, for 0.4-0.6 GB more memory per rank), else 1; the run's first "
                   "lines say when there are more than 1. GPU training defaults to 1: each lane holds its own decoder "
                   "memory on the GPU (docs/gpu.md).")
@click.option("--profile", type=int, default=d("profile"), show_default=True,
              help="Write RUN/profile_trace.json, a torch profiler trace of this many steps.")
@click.option("--checkpoint-every", type=int, default=d("checkpoint_every"), show_default=True, metavar="STEPS",
              help="Also save last.pt every STEPS optimizer steps inside an epoch, with DALI's reader state, so "
                   "a resume continues mid-epoch (0: at epoch ends, and when a signal stops the run).")
@click.option("--device", type=click.Choice(["auto", *DEVICES]), default=d("device"), show_default=True,
              help="auto: the GPU when there is one (on a node whose GPUs the installed torch or DALI cannot use, a "
                   "one-line refusal naming the fix, never the CPU: `dalifeed doctor`). hybrid: train on the GPU but "
                   "decode JPEGs on the CPU (crop, resize and normalise stay on the GPU): for when the GPU's JPEG "
                   "decoder is the bottleneck.")
@click.option("--hw-decoder-load", type=float, default=d("hw_decoder_load"), show_default=True,
              help="On the GPU: share of the JPEGs given to the hardware JPEG decoder of A100/H100-class GPUs "
                   "(the rest decode on CUDA cores). make gpu-check measures which value is best.")
@click.option("--synthetic", is_flag=True,
              help="Train on one real batch handed out again and again (no loading): the speed of the model "
                   "and optimiser alone. Compare images/s with a run without it to see what loading costs.")
@click.option("--check-shards", type=click.Choice(["size", "sha256"]), default=d("check_shards"), show_default=True,
              help="Before training, compare every shard with the manifest: size (sizes and DALI indexes, "
                   "instant) or sha256 (also hashes every byte: catches bit flips, costs a full read).")
@click.option("--cache-dir", default=None, metavar="DIR",
              help="s3:// data: the node's shard cache, shared by its ranks, where each tar is fetched whole "
                   "(one GET) before DALI reads it [default: shards/ in $DALIFEED_CACHE or ~/.cache/dalifeed].")
@click.option("--cache-limit", default=None, metavar="SIZE", callback=size_option,
              help="s3:// data: bound of the shard cache (e.g. 200GB = 200*10^9 bytes, 200GiB = 200*2^30; tars read "
                   "earliest are evicted first); must hold what the node's ranks read in one epoch [default: 90% of "
                   "the free space].")
@click.option("--progress-every", type=float, default=d("progress_every"), show_default=True, metavar="SECONDS",
              help="When stdout is not a terminal (Slurm, nohup, > log): a progress line every SECONDS with the "
                   "step, images/s, mean loss, data-wait share and the time left (0: none). A terminal gets a bar.")
@click.option("--tensorboard-every", type=int, default=d("tensorboard_every"), show_default=True, metavar="STEPS",
              help="Per-step TensorBoard scalars (step/train_loss, step/lr, step/images_per_s, "
                   "step/data_wait_share) every STEPS optimizer steps, in RUN/tensorboard/steps (0: none).")
@click.option("--allow-data-change", is_flag=True,
              help="Resume at an epoch's end although the shards differ from those the checkpoint trained on "
                   "(re-converted, re-indexed, shards added): recorded in metrics.jsonl as data_changed. Without "
                   "it such a resume is refused; a mid-epoch checkpoint on changed shards is always refused, since "
                   "it names positions in the tars it read.")
@click.option("--log-samples", is_flag=True,
              help="Write RUN/samples/rank<R>-of-<W>.jsonl: for every batch this rank trains on, the epoch, the "
                   "batch's index in it and its samples (SHARD:POSITION in the shard's index). To check what a "
                   "run trained on, e.g. that a resumed epoch trained each sample once.")
@click.option("--auto-augment", type=click.Choice(POLICIES), default=d("auto_augment"),
              help="Augmentation policy in the DALI graph, torchvision's: imagenet (AutoAugment), ra (RandAugment), "
                   "ta_wide (TrivialAugmentWide).")
@click.option("--ra-magnitude", type=int, default=d("ra_magnitude"), show_default=True,
              help="RandAugment: magnitude bin of each operation (0-30).")
@click.option("--ra-num-ops", type=int, default=d("ra_num_ops"), show_default=True,
              help="RandAugment: operations per image.")
@click.option("--random-erase", type=float, default=d("random_erase"), show_default=True, metavar="P",
              help="Erase a random rectangle (2-33% of the image) to 0 after normalising, with probability P.")
@click.option("--mixup-alpha", type=float, default=d("mixup_alpha"), show_default=True, metavar="A",
              help="Mixup on each batch, lambda ~ Beta(A, A); the loss takes the soft targets.")
@click.option("--cutmix-alpha", type=float, default=d("cutmix_alpha"), show_default=True, metavar="A",
              help="CutMix on each batch, lambda ~ Beta(A, A). With --mixup-alpha: one of the two per batch.")
@click.option("--recipe", type=click.Choice(sorted(RECIPES)), default=None,
              help="torchvision-resnet50: torchvision's current ResNet-50 recipe (TrivialAugmentWide, random erase "
                   "0.1, mixup 0.2, cutmix 1.0, label smoothing 0.1, EMA, cosine, 600 epochs, ...). fast-resnet50: "
                   "FFCV's 88-epoch ResNet-50 (progressive resize 160 to 192 px, evaluation at 256 after a resize "
                   "to 292, label smoothing 0.1, 2 warm-up epochs). Printed at start with what it cannot take "
                   "over; options given explicitly override it.")
@click.option("--debug", is_flag=True, help="Show full tracebacks instead of one-line errors.")
@click.pass_context
def main(ctx: click.Context, resume: str, debug: bool, **options) -> None:
    """Train a torchvision classifier on dalifeed shards with DALI feeding the GPU (or the CPU).

    \b
    One process:       dali-train --data SHARDS --out runs/r50 --model resnet50 --epochs 90
    One 8-GPU node:    torchrun --nproc_per_node=8 -m dalifeed.train.cli --data SHARDS --out runs/r50
    Several nodes:     torchrun --nnodes=4 --nproc_per_node=8 --rdzv-backend=c10d \\
                         --rdzv-endpoint=HOST:29500 -m dalifeed.train.cli --data SHARDS --out runs/r50
    After a crash, a kill or a requeue: the same command continues the run in --out (or: --resume RUN)

    Every epoch: train, evaluate top-1/top-5 on the whole val split (unless --val-split none), append
    RUN/metrics.jsonl, save RUN/last.pt (and RUN/best.pt on a new best top-1). In between: a bar on a
    terminal, a progress line every --progress-every seconds in a log. Resuming continues where the last
    checkpoint was taken (an epoch's end, mid-epoch with --checkpoint-every, or where Ctrl-C / SIGTERM
    stopped it: within about 2 s every rank stops after the same step and a checkpoint is saved) and replays
    exactly what an uninterrupted run would have done. One run at a time per --out. See docs/training.md.

    Exit codes: 0 done; 2 usage (bad option, unusable --out or checkpoint, --out in use, a node whose NVIDIA
    GPUs the installed torch or DALI cannot use: the line names the fix, `dalifeed doctor` all of it); 1 a runtime
    failure (a shard that does not match its manifest or a sample DALI cannot decode, named in one line
    with the fix; a full disk; training diverged); 130 / 143 stopped by SIGINT / SIGTERM. Tracebacks go
    to RUN/error.log (or the terminal with --debug); last.pt is left as it was.
    """
    options["crop_scale"] = tuple(options["crop_scale"])
    apply_recipe(ctx, options)
    if options["pretrained"] is not None:
        options["pretrained"] = str(options["pretrained"])
    asked = TrainConfig(**options)
    typed = {name for name in options if ctx.get_parameter_source(name) == ParameterSource.COMMANDLINE}
    resume_from = None if resume == "auto" else Path(resume)
    run_folder = resume_from or (Path(asked.out) if asked.out else None)  # where a traceback goes
    from .distributed import GpuAssignmentError, launched
    from .resume import resolve_run
    from .stop import TrainingStopped
    from .trainer import TrainingDiverged
    from .trainer import main as train

    launch = launched()

    def run() -> None:
        cfg, saved = resolve_run(asked, typed, resume_from, world_size=launch.world_size)
        train(cfg, resume=saved)

    run_command(run, debug=debug, usage_errors=(ConfigError, FolderInUse, MixError, StackMismatch, GpuAssignmentError),
                runtime_errors=(ShardDataError, OpenFileLimit, TrainingDiverged, DiskFull, StorageError),
                prefix=rank_prefix(launch),
                log=lambda: error_log(run_folder, launch) if run_folder else None,
                stopped=lambda e: (e.detail if isinstance(e, TrainingStopped) else
                                   "stopped before training began; run the same command again")
                                  if launch.is_main else None)


def apply_recipe(ctx: click.Context, options: dict) -> None:
    """--recipe NAME: its values for every option not given on the command line (printed, and saved in
    config.json as the options themselves)."""
    from .distributed import launched

    name = options.get("recipe")
    if not name:
        return
    taken = {k: v for k, v in RECIPES[name].items() if ctx.get_parameter_source(k) != ParameterSource.COMMANDLINE}
    options.update(taken)
    if launched().is_main:
        kept = sorted(set(RECIPES[name]) - set(taken))
        print(f"--recipe {name}: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in taken.items())
              + (f" (given explicitly, kept: {', '.join('--' + k.replace('_', '-') for k in kept)})" if kept else "")
              + (f"; {RECIPE_GAPS[name]}" if name in RECIPE_GAPS else ""), flush=True)


def rank_prefix(launch: Launch) -> str:
    return f"rank {launch.rank}: " if launch.world_size > 1 else ""


def error_log(run: Path, launch: Launch) -> Path:
    """Where the traceback of a failure goes: RUN/error.log, one per rank under torchrun."""
    return run / ("error.log" if launch.world_size == 1 else f"error-rank{launch.rank}.log")


if __name__ == "__main__":
    main()
