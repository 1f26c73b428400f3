"""dali-bench's options: one dataclass, checked before anything is timed (`validate`: one line, exit 2)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from dalifeed.decode import DEFAULT_HW_DECODER_LOAD
from dalifeed.format import ManifestError
from dalifeed.runtime import usable_cores
from dalifeed.usage import output_folder_problem

from .names import DETECTION_LOADERS, IMAGEFOLDER_LOADERS, LOADERS, PEERS

if TYPE_CHECKING:
    from dalifeed.pipelines.augment import AugmentConfig
    from dalifeed.pipelines.dataset import ShardData

# The modules behind the loaders import torch and DALI: they are imported by the checks that need them, so
# that `dali-bench --help` shows its options without them.


class BenchUsageError(Exception):
    """A bench that would measure nothing or something false: one line, exit 2."""


@dataclass
class BenchConfig:
    imagefolder: Path | None
    shards: Path | str  # a folder, or s3://bucket/prefix
    task: str = "classify"  # classify | detection
    images: Path | None = None  # detection: the COCO source the shards were made from
    annotations: Path | None = None
    out: Path = Path("build/bench")
    loaders: list[str] = field(default_factory=lambda: list(LOADERS))
    split: str = "train"
    batch_size: int = 64
    image_size: int = 224
    seconds: float | None = 10.0
    epochs: int | None = None  # instead of seconds: time whole passes over the split
    repeats: int = 3
    warmup_batches: int = 5
    workers: int = field(default_factory=usable_cores)
    model: str | None = None
    model_steps: int = 20
    amp: bool = True  # bf16 autocast for --model, on a GPU (on the CPU it would be emulated)
    fp16: bool = False  # every loader hands out float16 batches (what an AMP model consumes)
    hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD  # dali-gpu (both tasks): share of JPEGs for the hardware decoder
    allow_different_data: bool = False
    cache_dir: Path | None = None  # s3:// shards: the shard cache (dalifeed/pipelines/shardcache.py)
    cache_limit: int | None = None  # bytes (--cache-limit reads 20GB or 20GiB); None: 90% of the free space
    auto_augment: str | None = None  # a policy for every loader (torchvision's transforms.v2 in the torch ones)
    random_erase: float = 0.0  # RandomErasing's probability, every loader
    preview: int = 0  # also write OUT/preview.png: this many samples, DALI's output beside torchvision's

    def augment(self) -> AugmentConfig | None:
        """The policy and erasing every loader applies (None: the plain RandomResizedCrop + flip)."""
        from dalifeed.pipelines.augment import AugmentConfig

        if not self.auto_augment and not self.random_erase:
            return None
        return AugmentConfig(image_size=self.image_size, auto_augment=self.auto_augment,
                             random_erase=self.random_erase)

    def validate(self) -> ShardData:
        """Check every option and open --shards, once: the dataset every loader of the race reads."""
        if self.task not in ("classify", "detection"):
            raise BenchUsageError(f"--task must be classify or detection, got {self.task!r}")
        if self.task == "detection":
            self.validate_detection_source()
        known = DETECTION_LOADERS if self.task == "detection" else LOADERS + PEERS
        if self.task == "detection" and self.loaders == list(LOADERS):  # the default list: the detection ones
            self.loaders = list(DETECTION_LOADERS)
        if not self.loaders:
            raise BenchUsageError(f"--loaders: none given (choose from {', '.join(known)})")
        unknown = [name for name in self.loaders if name not in known]
        if unknown:
            raise BenchUsageError(f"--loaders: unknown {', '.join(unknown)} for --task {self.task} (choose from "
                                  f"{', '.join(known)})")
        from .peers import missing_package

        missing = [missing_package(name) for name in self.loaders if name in PEERS and not self._skipped(name)]
        if any(missing):
            raise BenchUsageError(next(filter(None, missing)))
        self.check_loaders_run_here()
        if self.task == "classify" and self.reads_imagefolder():
            if self.imagefolder is None:
                raise BenchUsageError(f"--imagefolder is required by the {', '.join(self.reads_imagefolder())} "
                                      f"loader (the ImageFolder tree the shards were made from); without one, race "
                                      f"only the loaders that read the shards: --loaders "
                                      f"{','.join(n for n in LOADERS if n not in IMAGEFOLDER_LOADERS)}")
            if not self.imagefolder.is_dir():
                raise BenchUsageError(f"--imagefolder {self.imagefolder}: no such folder")
        if self.task == "detection" and self.model:
            raise BenchUsageError("--model times classification models; it does not apply to --task detection")
        for name, value in (("--batch-size", self.batch_size), ("--repeats", self.repeats),
                            ("--workers", self.workers), ("--image-size", self.image_size),
                            ("--epochs", 1 if self.epochs is None else self.epochs),
                            ("--model-steps", self.model_steps)):
            if value < 1:
                raise BenchUsageError(f"{name} must be >= 1, got {value}")
        if self.seconds is not None and not self.seconds > 0:
            raise BenchUsageError(f"--seconds must be > 0, got {self.seconds}")
        if self.warmup_batches < 0:
            raise BenchUsageError(f"--warmup must be >= 0, got {self.warmup_batches}")
        problem = output_folder_problem("--out", self.out)
        if problem:
            raise BenchUsageError(problem)
        if self.model:
            self.check_model()
        if not 0 <= self.hw_decoder_load <= 1:
            raise BenchUsageError(f"--hw-decoder-load must be in [0, 1], got {self.hw_decoder_load}")
        if not 0 <= self.random_erase <= 1:
            raise BenchUsageError(f"--random-erase must be in [0, 1], got {self.random_erase}")
        if self.task == "detection" and (self.auto_augment or self.random_erase or self.preview):
            raise BenchUsageError("--auto-augment, --random-erase and --preview apply to --task classify")
        if self.preview < 0:
            raise BenchUsageError(f"--preview must be >= 0, got {self.preview}")
        if self.task == "detection" and self.fp16:
            raise BenchUsageError("--fp16 applies to --task classify (the detection loaders hand out float32 lists)")
        from .detection import same_coco_data_problem
        from .same_data import same_data_problem

        dataset = self.open_shards()
        manifest = dataset.manifest
        if self.task == "detection":
            problem = same_coco_data_problem(self.images, self.annotations, manifest, self.split)
        elif self.reads_imagefolder():
            problem = same_data_problem(self.imagefolder, manifest, self.split)
        else:  # every loader reads the shards: there is nothing to compare them with
            problem = None
        if problem and not self.allow_different_data:
            raise BenchUsageError(f"not the same data, so the race would compare nothing: {problem}; point both at "
                                  f"the same images (or pass --allow-different-data)")
        return dataset

    def open_shards(self) -> ShardData:
        """--shards opened: the kind --task reads, --split present with samples, one --batch-size batch in it
        (every loader of the race drops partial batches: it would never yield one)."""
        from dalifeed.pipelines.dataset import DatasetError, open_dataset

        try:
            dataset = open_dataset(self.shards, task=self.task, cache_dir=self.cache_dir, cache_limit=self.cache_limit)
        except ManifestError as e:
            raise BenchUsageError(f"--shards: {e}") from None
        except DatasetError as e:  # the kind: "S holds COCO shards (...)"
            raise BenchUsageError(f"--shards {e}") from None
        try:
            dataset.require_split(self.split, "--split")
            dataset.check_batch_fits(self.split, self.batch_size, what=f"--batch-size {self.batch_size}")
        except DatasetError as e:
            raise BenchUsageError(str(e)) from None
        return dataset

    def reads_imagefolder(self) -> list[str]:
        """The loaders of this race that read --imagefolder (classify); the others read the shards."""
        return [name for name in self.loaders if name in IMAGEFOLDER_LOADERS and not self._skipped(name)]

    def check_loaders_run_here(self) -> None:
        """A race of loaders none of which can run here (dali-gpu without a GPU) would time nothing."""
        reasons = {name: self._skipped(name) for name in self.loaders}
        if all(reasons.values()):
            raise BenchUsageError(f"--loaders {','.join(self.loaders)}: none can run here ("
                                  f"{'; '.join(f'{n}: {why}' for n, why in reasons.items())}); "
                                  f"add one that can, e.g. --loaders dali-cpu")

    def _skipped(self, name: str) -> str | None:
        import torch

        from .loaders import skip_reason

        return skip_reason(name, self.shards, "cuda" if torch.cuda.is_available() else "cpu")

    def check_model(self) -> None:
        """--model exists and takes --image-size in batches of --batch-size: checked on the meta device before any
        loader is timed."""
        from dalifeed.train.models import ModelError, check_input_size

        try:
            check_input_size(self.model, self.image_size, batch_size=self.batch_size)
        except ModelError as e:
            raise BenchUsageError(str(e)) from None

    def validate_detection_source(self) -> None:
        for name, path in (("--images", self.images), ("--annotations", self.annotations)):
            if path is None:
                raise BenchUsageError(f"--task detection needs {name} (the COCO data the shards were made from)")
            if not path.exists():
                raise BenchUsageError(f"{name} {path}: does not exist")

    def to_json(self) -> dict:
        return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(self).items()}
