"""`TrainConfig`: everything a `dali-train` run depends on; printed at start, saved as RUN/config.json."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from pathlib import Path

from dalifeed.pipelines.augment import AugmentConfig
from dalifeed.pipelines.graphs import DEFAULT_HW_DECODER_LOAD, uses_gpu
from dalifeed.pipelines.names import DEVICES, POLICIES
from dalifeed.pipelines.resolution import ProgressiveResize
from dalifeed.s3 import is_s3_url
from dalifeed.usage import output_folder_problem

NO_SPLIT = ("none", "")  # --val-split values that mean: train without evaluation

# --recipe: torchvision's current ResNet-50 recipe (its published accuracy: docs/training.md), from the command in
# torchvision's classification README: --batch-size 128 (x 8 GPUs) --lr 0.5 --lr-scheduler cosineannealinglr
# --lr-warmup-epochs 5 --auto-augment ta_wide --epochs 600 --random-erase 0.1 --weight-decay 0.00002
# --norm-weight-decay 0.0 --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 --train-crop-size 176
# --model-ema --val-resize-size 232 --ra-sampler --ra-reps 4. Not taken over: the crop sizes (its ResNet-50 trains
# at 176 and evaluates at 224 after a resize to 232: --image-size 176 --val-image-size 224 --val-resize 232 say
# it, but the recipe keeps --image-size for the user) and the repeated-augmentation sampler (dalifeed has none).
#
# --recipe fast-resnet50: FFCV's ResNet-50 recipe, libffcv/ffcv-imagenet rn50_configs/rn50_88_epochs.yaml (its
# published accuracy and time: docs/training.md): epochs 88; resolution min_res 160, max_res 192, start_ramp 65,
# end_ramp 76 (train_imagenet.py get_resolution: --progressive-resize 160:192:65:76); label_smoothing 0.1; sgd,
# momentum 0.9 (torch's SGD: no Nesterov), weight_decay 1e-4, bn_wd 0 (dali-train never decays norm weights);
# lr 1.7 for batch_size 512 x world_size 8 = 4096 images (1.7 * 256 / 4096 = 0.10625 per 256); lr_schedule_type
# cyclic with lr_peak_epoch 2 (train_imagenet.py's default): linear from 1e-4 * lr up to lr at epoch 2, then
# linear down to 0 at the last epoch; validation resolution 256 through CenterCropRGBImageDecoder(ratio=224/256),
# a centre square of 224/256 of the shorter side resized to 256, i.e. a resize to 256 / (224/256) = 292 then a
# 256 centre crop; lr_tta (logits averaged with the flipped image's); use_blurpool 1. FFCV's other rn50 configs
# (16, 24, 32, 40, 56 epochs) differ only in epochs and ramp: --epochs N --progressive-resize 160:192:S:E.
RECIPES = {
    "torchvision-resnet50": {
        "auto_augment": "ta_wide", "random_erase": 0.1, "mixup_alpha": 0.2, "cutmix_alpha": 1.0,
        "label_smoothing": 0.1, "epochs": 600, "optimizer": "sgd", "momentum": 0.9, "nesterov": False,
        "lr": 0.125,  # 0.5 for a global batch of 1024; dali-train's --lr is per 256 images and scaled linearly
        "weight_decay": 2e-5, "warmup_epochs": 5.0, "min_lr_ratio": 0.0,  # cosine to 0 after a linear warm-up
        # torchvision: decay 0.99998 every 32 steps, adjusted to 1 - 2e-5 * 1024 * 32 / 600 = 0.998908 per 32
        # steps of its 1024-image batch, i.e. 0.999966 per step; dali-train updates the EMA every step
        "ema": 0.999966,
    },
    "fast-resnet50": {
        "epochs": 88, "progressive_resize": "160:192:65:76", "val_image_size": 256, "val_resize": 292,
        "label_smoothing": 0.1, "optimizer": "sgd", "momentum": 0.9, "nesterov": False, "weight_decay": 1e-4,
        "lr": 0.10625,  # FFCV's 1.7 for 4096 images; dali-train's --lr is per 256 and scaled linearly
        "warmup_epochs": 2.0, "min_lr_ratio": 0.0,  # FFCV: linear up to epoch 2, then linear (here: cosine) to 0
    },
}

# What a recipe's source does that dali-train cannot: printed with the recipe's options.
RECIPE_GAPS = {
    "torchvision-resnet50": "not taken over: the repeated-augmentation sampler (--ra-sampler --ra-reps 4), and its "
                            "train/val sizes 176/224 after a resize to 232 (--image-size 176 --val-image-size 224 "
                            "--val-resize 232)",
    "fast-resnet50": "not taken over: BlurPool (use_blurpool 1), left-right flip averaging at test time (lr_tta), "
                     "the linear decay after warm-up (cosine here); FFCV's batch is 512 x 8 GPUs",
}


class ConfigError(Exception):
    """A bad option or an unusable run folder/checkpoint: one line for the user, exit 2."""


@dataclass
class TrainConfig:
    """Everything a `dali-train` run depends on, one field per command option; printed at start and saved as
    RUN/config.json.

    Build one with the options you want (the rest keep `dali-train`'s defaults) and pass it to `main`;
    `validate` checks every value and names the bad one. Sizes are in pixels, learning rates per 256 images
    of global batch.

    Example:
        ```python
        from dalifeed.train import TrainConfig, main

        cfg = TrainConfig(data="/data/shards", out="runs/r50", epochs=16, batch_size=128, lr=0.2)
        result = main(cfg)  # a run already in runs/r50 with these options: main(cfg, resume="auto")
        print(result.metrics["top1"])
        ```

    Attributes:
        data: A shard folder (a local path or `s3://bucket/prefix`), or a list of them mixed into every batch.
        out: The run folder: config.json, metrics.jsonl, last.pt, best.pt, tensorboard/.
        task: `"classify"` (one label per image: cross-entropy, top-1/top-5) or `"multilabel"` (COCO shards:
            multi-hot targets, binary cross-entropy, mean average precision). Default `"classify"`.
        train_split: The split that trains. Default `"train"`.
        val_split: The split evaluated after each epoch; None (or `"none"`) trains without evaluation. A split
            the shards lack is refused. Default `"val"`.
        model: A torchvision classification model name, or `resnet10`; a ResNet name + `_cifar` has a 3x3
            stem for small images. Default `"resnet50"`.
        width: ResNets only: the first stage's channels (the stages are w, 2w, 4w, 8w); None keeps
            torchvision's 64. Default None.
        epochs: Epochs to train. Default 90.
        batch_size: Images per process (per GPU) and step; the global batch is
            `batch_size * world_size * accum_steps`. Default 256.
        lr: Learning rate per 256 images of global batch, scaled linearly with it. Default 0.1.
        optimizer: `"sgd"` (with `momentum` and `nesterov`) or `"adamw"` (give a smaller `lr`, e.g. 0.001).
            Default `"sgd"`.
        momentum: SGD's momentum. Default 0.9.
        nesterov: SGD with Nesterov momentum. Default True.
        weight_decay: Weight decay, not applied to biases and normalisation weights. Default 5e-5.
        warmup_epochs: Epochs of linear warm-up before the cosine decay; None: `min(5, epochs / 10)`.
            Default None.
        min_lr_ratio: The cosine decays to `lr * min_lr_ratio`. Default 0.0.
        label_smoothing: Cross-entropy's label smoothing, in [0, 1). Default 0.1.
        accum_steps: Gradient accumulation: micro-batches per optimizer step. Default 1.
        clip_grad: Clip the gradient norm to this value; None: no clipping. Default None.
        ema: Keep an exponential moving average of the weights with this decay per step (e.g. 0.9999), also
            evaluated; None: none. Default None.
        swa_start: Stochastic weight averaging from this epoch (0-based) on: the weights averaged after every
            epoch, the average's BatchNorm statistics recomputed, evaluated and saved as RUN/swa.pt; None:
            off. Default None.
        swa_lr: The learning rate from `swa_start` on, per 256 images like `lr`; None: the schedule's.
            Default None.
        swa_anneal_epochs: Epochs of SWALR's cosine from the schedule's lr to `swa_lr` (0: at once).
            Default 0.0.
        amp: Mixed precision: `"auto"` (bf16 on GPUs with native bf16, sm80 and later; fp16 on older ones;
            off on the CPU), `"bf16"`, `"fp16"` (with a GradScaler) or `"off"`. Default `"auto"`.
        channels_last: Model and batches in NHWC memory format (faster convolutions on tensor cores).
            Default False.
        compile: `torch.compile` the model (minutes of compilation before the first step). Default False.
        image_size: Training's image size (RandomResizedCrop's output), and validation's unless
            `val_image_size`; with `progressive_resize`, only the size the model is built for. Default 224.
        progressive_resize: A size that grows with the epoch, `"START:END:FROM:TO"`: START px up to epoch
            FROM, END px from epoch TO on, in between a straight line rounded to multiples of 32 px;
            `"START:END"` ramps over the whole run. None: `image_size` throughout. Default None.
        val_image_size: Validation's centre crop in px; None: `image_size`. Default None.
        val_resize: Validation's shorter side in px before the centre crop; None: the validation size / 0.875
            (256 for 224). Default None.
        crop_scale: RandomResizedCrop's area range (MIN, MAX), fractions of the image. Default (0.08, 1.0).
        flip: Random horizontal flip in training. Default True.
        pretrained: A local weights file (a state_dict or a checkpoint) to start from; a head of another class
            count is re-initialised. None: random initialisation. Default None.
        seed: Seed of the weights' initialisation, the shuffle and the augmentations. Default 0.
        max_bad_steps: Abort after this many non-finite losses or gradients in a row (each is skipped and
            logged). Default 5.
        workers: DALI threads of each rank's loader (`--dali-threads`); None: the CPUs this process may use
            divided by the ranks on this node, at most 6 with GPU decoding and 16 with CPU decoding.
            Default None.
        lanes: Pipelines of the training loader per rank, sharing `workers`; None: 2 for CPU training with 2
            threads or more and long enough epochs, else 1. Default None.
        profile: Write RUN/profile_trace.json, a torch profiler trace of this many steps (0: off). Default 0.
        checkpoint_every: Also save last.pt every this many optimizer steps inside an epoch, so that a resume
            continues mid-epoch (0: at epoch ends and when a signal stops the run). Default 0.
        device: `"auto"` (the GPU when there is one), `"cpu"`, `"gpu"`, or `"hybrid"` (train on the GPU,
            decode JPEGs on the CPU). Default `"auto"`.
        hw_decoder_load: On the GPU: the share of JPEGs, 0 to 1, given to the hardware JPEG decoder of
            A100/H100-class GPUs (the rest decode on CUDA cores). Default 0.99.
        synthetic: Train on one real batch handed out again and again: the speed of the model and optimiser
            without loading. Default False.
        check_shards: What is compared with the manifest before training: `"size"` (sizes and DALI indexes)
            or `"sha256"` (also every byte's hash: a full read). Default `"size"`.
        cache_dir: `s3://` data: the node's shard cache folder; None: shards/ in `$DALIFEED_CACHE` or
            ~/.cache/dalifeed. Default None.
        cache_limit: `s3://` data: the shard cache's bound in bytes; None: 90% of the free space.
            Default None.
        progress_every: Seconds between progress lines when stdout is not a terminal (0: none). Default 30.0.
        tensorboard_every: Optimizer steps between per-step TensorBoard scalars (0: none). Default 50.
        log_samples: Write RUN/samples/: which samples each rank trained on, batch by batch. Default False.
        allow_data_change: Resume at an epoch's end on shards other than the checkpoint's (recorded in
            metrics.jsonl); refused otherwise. Default False.
        data_weights: With several `data`: each one's share of every batch; None: equal. Default None.
        recipe: The name of a preset (`"torchvision-resnet50"`, `"fast-resnet50"`) the command line applied;
            the values it set are in the fields themselves. Default None.
        auto_augment: An augmentation policy in the DALI graph, torchvision's: `"imagenet"` (AutoAugment),
            `"ra"` (RandAugment), `"ta_wide"` (TrivialAugmentWide); None: none. Default None.
        ra_magnitude: RandAugment's magnitude bin of each operation, 0 to 30. Default 9.
        ra_num_ops: RandAugment's operations per image. Default 2.
        random_erase: The probability of erasing a random rectangle (2-33% of the image) after normalising.
            Default 0.0.
        mixup_alpha: Mixup on each batch with lambda ~ Beta(alpha, alpha) (0: off). Default 0.0.
        cutmix_alpha: CutMix on each batch with lambda ~ Beta(alpha, alpha) (0: off); with `mixup_alpha`
            too, one of the two per batch, each with probability 0.5. Default 0.0.
    """

    data: str | list[str]
    out: str
    task: str = "classify"
    train_split: str = "train"
    val_split: str | None = "val"
    model: str = "resnet50"
    width: int | None = None
    epochs: int = 90
    batch_size: int = 256
    lr: float = 0.1
    optimizer: str = "sgd"
    momentum: float = 0.9
    nesterov: bool = True
    weight_decay: float = 5e-5
    warmup_epochs: float | None = None
    min_lr_ratio: float = 0.0
    label_smoothing: float = 0.1
    accum_steps: int = 1
    clip_grad: float | None = None
    ema: float | None = None
    swa_start: int | None = None
    swa_lr: float | None = None
    swa_anneal_epochs: float = 0.0
    amp: str = "auto"
    channels_last: bool = False
    compile: bool = False
    image_size: int = 224
    progressive_resize: str | None = None
    val_image_size: int | None = None
    val_resize: int | None = None
    crop_scale: tuple[float, float] = (0.08, 1.0)
    flip: bool = True
    pretrained: str | None = None
    seed: int = 0
    max_bad_steps: int = 5
    workers: int | None = None
    lanes: int | None = None
    profile: int = 0
    checkpoint_every: int = 0
    device: str = "auto"
    hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD
    synthetic: bool = False
    check_shards: str = "size"
    cache_dir: str | None = None
    cache_limit: int | None = None
    progress_every: float = 30.0
    tensorboard_every: int = 50
    log_samples: bool = False
    allow_data_change: bool = False
    data_weights: list[float] | None = None
    recipe: str | None = None
    auto_augment: str | None = None
    ra_magnitude: int = 9
    ra_num_ops: int = 2
    random_erase: float = 0.0
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0

    def fill_defaults(self) -> None:
        """The defaults that depend on other options, filled in (nothing checked): what `resume.resolve_run`
        compares with a saved run's config, which had them filled when it was saved."""
        if self.warmup_epochs is None:
            self.warmup_epochs = min(5.0, self.epochs / 10)
        if self.val_split in NO_SPLIT:
            self.val_split = None
        if isinstance(self.data, (list, tuple)):
            self.data = [str(d) for d in self.data] if len(self.data) > 1 else str(self.data[0])
        if self.progressive_resize is not None and self.progressive_resize.count(":") == 1:
            # START:END ramps over the whole run; written out, so that the saved run keeps its schedule
            self.progressive_resize += f":0:{max(self.epochs - 1, 0)}"

    @property
    def validated(self) -> bool:
        """`validate` has passed these very values (a changed option, or a copy, is checked again)."""
        return getattr(self, "_validated", None) == self.to_json()

    def validate(self) -> None:
        """Check every option, naming the bad value; fills in the defaults that depend on others. Once per
        command: an unchanged config already checked is not checked again (checking builds the model on the
        meta device and may probe the GPU stack)."""
        if self.validated:
            return
        self.fill_defaults()
        for ok, message in option_checks(self):
            if not ok:
                raise ConfigError(message)
        self.resize_schedule()  # a schedule that is not one: its one line
        if uses_gpu(self.device):  # the rule every command uses (stack.choose_device), asked before any work
            from dalifeed.stack import StackMismatch, choose_device, stack_report

            try:
                choose_device(self.device, stack_report())
            except StackMismatch as e:
                raise ConfigError(str(e)) from None
        for data in self.data if isinstance(self.data, list) else [self.data]:
            if not is_s3_url(data) and not Path(data).is_dir():
                what = "is a file, not a shard folder" if Path(data).exists() else "no such shard folder"
                raise ConfigError(f"--data {data}: {what}")
        if self.data_weights is not None:
            count = len(self.data) if isinstance(self.data, list) else 1
            if count == 1 or len(self.data_weights) != count:
                raise ConfigError(f"--data-weights {','.join(map(str, self.data_weights))}: one weight per --data "
                                  f"({count} given) and at least two --data")
            if any(not w > 0 for w in self.data_weights):
                raise ConfigError(f"--data-weights must be positive, got {self.data_weights}")
        self.check_batch_memory()
        if self.pretrained and not Path(self.pretrained).is_file():
            raise ConfigError(f"--pretrained {self.pretrained}: no such file")
        problem = output_folder_problem("--out", self.out)
        if problem:
            raise ConfigError(problem)
        self.check_model()
        self._validated = self.to_json()  # not a field: neither saved nor compared

    def check_batch_memory(self) -> None:
        """Every size a batch is decoded, resized or trained at fits in memory at least as 8-bit pixels
        (batch x size² x 3 bytes, the least a batch of them takes) within what this process may use:
        refused up front rather than as DALI's bad_alloc blamed on the data."""
        from dalifeed.runtime import usable_memory

        schedule = self.resize_schedule()
        sizes = {size: f"--progressive-resize {schedule} (size {size})" for size in schedule.sizes(self.epochs)} \
            if schedule is not None else {self.image_size: f"--image-size {self.image_size}"}
        sizes.setdefault(self.val_size, f"--val-image-size {self.val_size}")
        if self.val_resize is not None:
            sizes.setdefault(self.val_resize, f"--val-resize {self.val_resize}")
        largest = max(sizes)
        need, have = self.batch_size * largest**2 * 3, usable_memory()
        if need > have:
            raise ConfigError(f"{sizes[largest]}: a batch of {self.batch_size} images of {largest} x "
                              f"{largest} px takes at least {need / 2**30:,.1f} GiB ({self.batch_size} x {largest}² "
                              f"x 3 bytes), more than the {have / 2**30:,.1f} GiB of memory this process may use: "
                              f"use a smaller size or --batch-size")

    def check_model(self) -> None:
        """The model exists and takes --image-size (and --width) in batches of --batch-size, and, built for
        --image-size, every size --progressive-resize trains at and the validation size: checked on the meta
        device, before any data is read, instead of failing at the first batch of an epoch."""
        from . import models  # torchvision: imported when a run is checked, not by `dali-train --help`

        others = {}
        schedule = self.resize_schedule()
        if schedule is not None:
            for size, epochs in schedule.sizes(self.epochs).items():
                others.setdefault(size, f"--progressive-resize {schedule}'s size of epoch {epochs[0]}")
        others.setdefault(self.val_size, "--val-image-size")
        try:
            models.check_input_size(self.model, self.image_size, self.width, batch_size=self.batch_size)
            models.check_other_sizes(self.model, self.image_size, others, self.width, batch_size=self.batch_size)
        except models.ModelError as e:
            raise ConfigError(str(e)) from None

    def resize_schedule(self) -> ProgressiveResize | None:
        """--progressive-resize as a schedule (None without it); ConfigError naming it if it is not one."""
        if self.progressive_resize is None:
            return None
        try:
            return ProgressiveResize.parse(self.progressive_resize, self.epochs)
        except ValueError as e:
            raise ConfigError(f"--progressive-resize {e}") from None

    @property
    def val_size(self) -> int:
        """The size validation evaluates at: --val-image-size, else --image-size."""
        return self.image_size if self.val_image_size is None else self.val_image_size

    def train_augment(self) -> AugmentConfig:
        """What the training graph does to each image (the loader's dtype and layout aside); with
        --progressive-resize, each epoch's graph has the schedule's size instead of --image-size."""
        return AugmentConfig(image_size=self.image_size, crop_scale=tuple(self.crop_scale), flip=self.flip,
                             auto_augment=self.auto_augment, ra_magnitude=self.ra_magnitude,
                             ra_num_ops=self.ra_num_ops, random_erase=self.random_erase)

    def val_augment(self) -> AugmentConfig:
        """What the validation graph does: resize the shorter side to --val-resize (default: the validation
        size / 0.875), centre crop --val-image-size (default: --image-size), normalise."""
        return AugmentConfig(image_size=self.val_size, val_resize=self.val_resize)

    def to_json(self) -> dict:
        """The fields as a JSON-ready dict, as RUN/config.json holds them."""
        return asdict(self)

    @classmethod
    def from_json(cls, doc: dict) -> TrainConfig:
        """The config a `to_json` dict (RUN/config.json) holds; keys that are not fields are ignored.

        Args:
            doc: The dict, as `to_json` returned it or `json.load` read it.
        """
        known = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in doc.items() if k in known})
        cfg.crop_scale = tuple(cfg.crop_scale)
        return cfg


def option_checks(cfg: TrainConfig) -> list[tuple[bool, str]]:
    """Each option's rule as (holds, the line that names the bad value): `TrainConfig.validate` raises the first
    that does not hold."""
    return [
        (cfg.task in ("classify", "multilabel"), f"--task must be classify or multilabel, got {cfg.task!r}"),
        (cfg.epochs >= 1, f"--epochs must be >= 1, got {cfg.epochs}"),
        (cfg.batch_size >= 1, f"--batch-size must be >= 1, got {cfg.batch_size}"),
        (cfg.lr > 0, f"--lr must be > 0, got {cfg.lr}"),
        (0 <= cfg.momentum < 1, f"--momentum must be in [0, 1), got {cfg.momentum}"),
        (cfg.weight_decay >= 0, f"--weight-decay must be >= 0, got {cfg.weight_decay}"),
        (0 <= cfg.min_lr_ratio <= 1, f"--min-lr-ratio must be in [0, 1], got {cfg.min_lr_ratio}"),
        (cfg.optimizer in ("sgd", "adamw"), f"--optimizer must be sgd or adamw, got {cfg.optimizer!r}"),
        (cfg.amp in ("auto", "bf16", "fp16", "off"), f"--amp must be auto, bf16, fp16 or off, got {cfg.amp!r}"),
        (cfg.accum_steps >= 1, f"--accum-steps must be >= 1, got {cfg.accum_steps}"),
        (cfg.warmup_epochs >= 0, f"--warmup-epochs must be >= 0, got {cfg.warmup_epochs}"),
        (0 <= cfg.label_smoothing < 1, f"--label-smoothing must be in [0, 1), got {cfg.label_smoothing}"),
        (cfg.clip_grad is None or cfg.clip_grad > 0, f"--clip-grad must be > 0, got {cfg.clip_grad}"),
        (cfg.ema is None or 0 < cfg.ema < 1, f"--ema must be in (0, 1), got {cfg.ema}"),
        (cfg.swa_start is None or 0 <= cfg.swa_start < cfg.epochs,
         f"--swa-start must be an epoch of the run, 0 to {cfg.epochs - 1} (--epochs {cfg.epochs}), "
         f"got {cfg.swa_start}"),
        (cfg.swa_lr is None or cfg.swa_lr > 0, f"--swa-lr must be > 0, got {cfg.swa_lr}"),
        (cfg.swa_start is not None or (cfg.swa_lr is None and not cfg.swa_anneal_epochs),
         "--swa-lr and --swa-anneal-epochs set SWA's learning rate: give --swa-start too"),
        (cfg.swa_lr is not None or not cfg.swa_anneal_epochs,
         "--swa-anneal-epochs anneals the learning rate to --swa-lr: give --swa-lr too"),
        (cfg.swa_anneal_epochs >= 0, f"--swa-anneal-epochs must be >= 0, got {cfg.swa_anneal_epochs}"),
        (0 < cfg.crop_scale[0] <= cfg.crop_scale[1] <= 1,
         f"--crop-scale must be MIN,MAX with 0 < MIN <= MAX <= 1, got {cfg.crop_scale}"),
        (cfg.image_size >= 8, f"--image-size must be >= 8, got {cfg.image_size}"),
        (cfg.val_image_size is None or cfg.val_image_size >= 8,
         f"--val-image-size must be >= 8, got {cfg.val_image_size}"),
        (cfg.val_resize is None or cfg.val_resize >= cfg.val_size,
         f"--val-resize {cfg.val_resize} must be >= the validation size {cfg.val_size} (--val-image-size, "
         f"else --image-size): the centre crop is taken from the resized image"),
        (cfg.width is None or cfg.width >= 4, f"--width must be >= 4, got {cfg.width}"),
        (cfg.max_bad_steps >= 1, f"--max-bad-steps must be >= 1, got {cfg.max_bad_steps}"),
        (cfg.device in ("auto", *DEVICES),
         f"--device must be auto, cpu, gpu or hybrid, got {cfg.device!r}"),
        (0 <= cfg.hw_decoder_load <= 1, f"--hw-decoder-load must be in [0, 1], got {cfg.hw_decoder_load}"),
        (cfg.profile >= 0, f"--profile must be >= 0, got {cfg.profile}"),
        (cfg.workers is None or cfg.workers >= 1,
         f"--dali-threads / --workers must be >= 1 (DALI threads), got {cfg.workers}"),
        (cfg.lanes is None or cfg.lanes >= 1, f"--lanes must be >= 1, got {cfg.lanes}"),
        (cfg.checkpoint_every >= 0, f"--checkpoint-every must be >= 0, got {cfg.checkpoint_every}"),
        (cfg.check_shards in ("size", "sha256"),
         f"--check-shards must be size or sha256, got {cfg.check_shards!r}"),
        (cfg.progress_every >= 0, f"--progress-every must be >= 0 seconds, got {cfg.progress_every}"),
        (cfg.tensorboard_every >= 0, f"--tensorboard-every must be >= 0 steps, got {cfg.tensorboard_every}"),
        (cfg.auto_augment in (None, *POLICIES),
         f"--auto-augment must be one of {', '.join(POLICIES)}, got {cfg.auto_augment!r}"),
        (0 <= cfg.ra_magnitude <= 30, f"--ra-magnitude must be in [0, 30], got {cfg.ra_magnitude}"),
        (cfg.ra_num_ops >= 1, f"--ra-num-ops must be >= 1, got {cfg.ra_num_ops}"),
        (0 <= cfg.random_erase <= 1, f"--random-erase must be in [0, 1], got {cfg.random_erase}"),
        (cfg.mixup_alpha >= 0, f"--mixup-alpha must be >= 0, got {cfg.mixup_alpha}"),
        (cfg.cutmix_alpha >= 0, f"--cutmix-alpha must be >= 0, got {cfg.cutmix_alpha}"),
        (cfg.task == "classify" or cfg.mixup_alpha == cfg.cutmix_alpha == 0,
         "--mixup-alpha / --cutmix-alpha mix one-label targets: --task classify only"),
    ]
