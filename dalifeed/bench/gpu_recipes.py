"""gpu-check's recipe steps: every training recipe dalifeed's graphs run, run on the GPU the way users run them.

One step per recipe (`RECIPES`: the three policies, random erasing, mixup/cutmix, dali-train's
`--recipe torchvision-resnet50`, multi-label and detection on COCO shards), each over every output the loader
hands out (float32 and float16, NCHW and NHWC; detection has one, float32 CHW). For each such case:

- **throughput**: a `gpu` loader (nvJPEG decoding) for `--recipe-batches` batches after a first one (the build,
  left out), mixing on the device where the recipe mixes, one synchronisation at the end;
- **checksum against the CPU**: the first batch of a `hybrid` loader (the CPU decoder, every later operator on
  the GPU) against the first batch of a `cpu` loader with the same seed. The two graphs are the same operators
  with the same seeds (tests/test_gpu_graphs.py, check c) and every random draw is a CPU operator in both, so
  the same samples get the same crops, flips, policy operations and erased boxes: labels must be equal and
  the images within MATCH_TOLERANCE (GPU kernels round differently from CPU ones, no more). The `gpu`
  loader's own first batch is also compared and reported, not judged: nvJPEG and libjpeg-turbo decode
  differently (docs/development/gpu-evidence.md, chroma upsampling).

Without a GPU (`--allow-cpu`) every case runs on the CPU and is compared with a second CPU loader of the same
seed (the same batch twice: that the case is reproducible), which is how tests/test_gpu_check.py runs it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dalifeed.atomic import write_json_atomic

from .gpu_node import StepRun, decoder_budget

# Largest mean absolute difference, in normalised units (1/255 of a grey level is 0.017), between the hybrid
# and the cpu loader's first batch for a case to match: the gpu tests hold hybrid validation to 0.01
# (tests/test_gpu.py); training adds warps, rotations and colour operations computed on the GPU.
MATCH_TOLERANCE = 0.02

# (dtype, channels_last): every output make_loader hands out (a bf16 model takes the float32 batches)
OUTPUTS = ((torch.float32, False), (torch.float16, False), (torch.float32, True), (torch.float16, True))
COCO_SPLIT = "train"


@dataclass(frozen=True)
class Recipe:
    """What one step runs: AugmentConfig fields, the batch mixing, the task, and (for dali-train's recipes)
    the --recipe name whose training slice the step also runs."""

    augment: dict = field(default_factory=dict)
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    task: str = "classify"  # classify | multilabel | detection (COCO shards)
    train_recipe: str | None = None
    about: str = ""

    @property
    def outputs(self) -> tuple:
        return ((torch.float32, False),) if self.task == "detection" else OUTPUTS


def _torchvision_resnet50() -> Recipe:
    from dalifeed.train.config import RECIPES as TRAIN_RECIPES

    values = TRAIN_RECIPES["torchvision-resnet50"]
    return Recipe({"auto_augment": values["auto_augment"], "random_erase": values["random_erase"]},
                  values["mixup_alpha"], values["cutmix_alpha"], train_recipe="torchvision-resnet50",
                  about="dali-train --recipe torchvision-resnet50: TrivialAugmentWide, erasing 0.1, mixup 0.2 / "
                        "cutmix 1.0 on the device, and a training slice of that command on the node's ranks")


# --steps NAME -> the recipe; gpu_check.STEPS holds a step for each
RECIPES: dict[str, Recipe | Callable[[], Recipe]] = {
    "recipe-imagenet": Recipe({"auto_augment": "imagenet"}, about="AutoAugment, torchvision's ImageNet policy"),
    "recipe-ra": Recipe({"auto_augment": "ra"}, about="RandAugment (2 operations, magnitude 9)"),
    "recipe-ta_wide": Recipe({"auto_augment": "ta_wide"}, about="TrivialAugmentWide"),
    "recipe-erase": Recipe({"random_erase": 0.5}, about="random erasing p=0.5 (float32, then cast for float16)"),
    "recipe-mixup-cutmix": Recipe(mixup_alpha=0.2, cutmix_alpha=1.0, about="mixup 0.2 / cutmix 1.0 on the device"),
    "recipe-torchvision-resnet50": _torchvision_resnet50,
    "multilabel": Recipe(task="multilabel", about="COCO shards, multi-hot targets built in the graph"),
    "detection": Recipe(task="detection", about="COCO shards, SSD crop + flip, boxes; float32 CHW"),
}


def recipe(name: str) -> Recipe:
    found = RECIPES[name]
    return found() if callable(found) else found


def output_name(dtype: torch.dtype, channels_last: bool) -> str:
    return f"{str(dtype).removeprefix('torch.')} {'NHWC' if channels_last else 'NCHW'}"


# -- the data ------------------------------------------------------------------------------------------

def coco_shards(cfg, log) -> Path:
    """COCO-format photos with boxes (sample_data.make_photos_coco, about 12 x --per-class / 10 images) as
    shards with one split, "train", built once per --per-class and reused."""
    from dalifeed.bench.sample_data import make_photos_coco
    from dalifeed.convert.coco import CocoConfig, convert_coco

    per_class = coco_per_class(cfg.per_class)
    stamp, shards = cfg.workdir / "coco.json", cfg.workdir / "coco-shards"
    wanted = {"per_class": per_class, "seed": 0}
    if stamp.is_file() and json.loads(stamp.read_text()) == wanted:
        return shards
    log(f"building COCO-format photos ({per_class} per source photo) and their shards in {cfg.workdir} ...")
    stamp.unlink(missing_ok=True)
    images, annotations = make_photos_coco(cfg.workdir / "coco", per_class=per_class, seed=0)
    convert_coco(CocoConfig(images=[images], annotations=[annotations], split=[COCO_SPLIT], out=shards, progress=False,
                            workers=cfg.workers, overwrite=True))
    write_json_atomic(stamp, wanted)  # last: an interrupted build is built again
    return shards


def coco_per_class(per_class: int) -> int:
    return max(8, per_class // 10)


# -- one case: a loader of a recipe on a device --------------------------------------------------------

@dataclass(frozen=True)
class Case:
    recipe: Recipe
    dtype: torch.dtype
    channels_last: bool
    batch_size: int
    image_size: int
    threads: int

    def loader(self, data: Path, device: str):
        from dalifeed.pipelines import AugmentConfig, DetectionConfig, make_detection_loader, make_loader, open_dataset

        if self.recipe.task == "detection":
            return make_detection_loader(data, COCO_SPLIT, self.batch_size,
                                         detection=DetectionConfig(size=self.image_size), device=device, train=True,
                                         num_threads=self.threads, seed=0)
        augment = AugmentConfig(image_size=self.image_size, **self.recipe.augment)
        return make_loader(open_dataset(data, task=self.recipe.task), "train", self.batch_size, augment=augment,
                           device=device, train=True, fp16=self.dtype == torch.float16,
                           channels_last=self.channels_last, num_threads=self.threads, seed=0)

    def mixer(self):
        """The batch mixing on the device (train/mixup.py, as dali-train mixes), or None."""
        from dalifeed.train.mixup import BatchMixer

        mixer = BatchMixer(self.recipe.mixup_alpha, self.recipe.cutmix_alpha, seed=0)
        return mixer if mixer.enabled else None


def batches(loader, count: int) -> Iterator:
    """`count` batches of `loader`, epoch after epoch (a small split holds fewer)."""
    while True:
        for batch in loader:
            yield batch
            count -= 1
            if count == 0:
                return


def as_tensors(batch, task: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(images, targets) of a batch as two tensors; detection: its images and boxes flattened and joined."""
    if task != "detection":
        return batch
    images, targets = batch
    return (torch.cat([image.flatten() for image in images]),
            torch.cat([torch.cat([t["boxes"].flatten(), t["labels"].float()]) for t in targets]))


def mixed(case: Case, batch, step: int, num_classes: int):
    images, labels = batch
    mixer = case.mixer()
    return batch if mixer is None else mixer(images, labels, num_classes, epoch=0, step=step)


def timed_rate(loader, count: int, device: str, images_of: Callable[[int, object], int] = lambda step, b: len(b[0])):
    """Images per second over `count` batches of `loader` after the first (which includes the pipeline's build);
    `images_of(step, batch)` does what the step does with a batch and says how many images it held."""
    stream = batches(loader, count + 1)
    next(stream)
    started, images = time.perf_counter(), 0
    for step, batch in enumerate(stream):
        images += images_of(step, batch)
    if device != "cpu":
        torch.cuda.synchronize()  # the one wait: what was queued is done
    return images / (time.perf_counter() - started)


def images_per_s(case: Case, data: Path, device: str, count: int, num_classes: int) -> float:
    """Images per second of the case's loader on `device`, mixing on the device included."""
    return timed_rate(case.loader(data, device), count, device,
                      lambda step, batch: len(mixed(case, batch, step, num_classes)[0]))


def first_batch(case: Case, data: Path, device: str, num_classes: int) -> tuple[torch.Tensor, torch.Tensor]:
    batch = next(batches(case.loader(data, device), 1))
    if case.recipe.task != "detection":
        batch = mixed(case, batch, 0, num_classes)
    return tuple(t.detach().cpu().double() for t in as_tensors(batch, case.recipe.task))


def compare(batch: tuple[torch.Tensor, torch.Tensor], reference: tuple[torch.Tensor, torch.Tensor]) -> dict:
    """A batch against the CPU path's: checksums (float64 sums of the images), whether the targets are equal,
    and the images' mean and largest absolute difference."""
    (images, targets), (ref_images, ref_targets) = batch, reference
    same_shape = images.shape == ref_images.shape and targets.shape == ref_targets.shape
    difference = (images - ref_images).abs() if same_shape else None
    return {"checksum": float(images.sum()), "cpu_checksum": float(ref_images.sum()),
            "targets_equal": same_shape and bool(torch.equal(targets, ref_targets)),
            "mean_abs_difference": float(difference.mean()) if same_shape else None,
            "max_abs_difference": float(difference.max()) if same_shape else None}


def run_case(case: Case, data: Path, has_gpu: bool, count: int, num_classes: int) -> dict:
    """One case: its throughput on the GPU (the CPU without one) and its first batch against the CPU path's."""
    device = "gpu" if has_gpu else "cpu"
    result = {"output": output_name(case.dtype, case.channels_last), "device": device,
              "images_per_s": images_per_s(case, data, device, count, num_classes)}
    reference = first_batch(case, data, "cpu", num_classes)
    # where the maths is the same as the CPU's: the CPU decoder, then the GPU's kernels (module docstring)
    compared = compare(first_batch(case, data, "hybrid" if has_gpu else "cpu", num_classes), reference)
    result.update(compared_device="hybrid" if has_gpu else "cpu", **compared,
                  matches_cpu=compared["targets_equal"] and compared["mean_abs_difference"] is not None
                  and compared["mean_abs_difference"] <= MATCH_TOLERANCE)
    if has_gpu:  # nvJPEG decodes differently: reported, not judged
        result["gpu_vs_cpu"] = compare(first_batch(case, data, "gpu", num_classes), reference)
    return result


def recipe_step(name: str) -> Callable[[StepRun], dict]:
    """The gpu-check step of recipe `name`: every output of it (run_case), and for dali-train's recipes a
    training slice of `dali-train --recipe NAME`."""
    def step(run: StepRun) -> dict:
        cfg, found = run.cfg, recipe(name)
        coco = found.task in ("multilabel", "detection")
        data = run.coco_shards if coco else run.shards
        batch_size = min(cfg.batch_size, cfg.coco_batch_size) if coco else cfg.batch_size
        num_classes = 0 if found.task == "detection" else _num_classes(data)
        threads = rank_threads() if run.has_gpu else cfg.workers  # on a GPU: what one dali-train rank gets
        cases = []
        for dtype, channels_last in found.outputs:
            case = Case(found, dtype, channels_last, batch_size, cfg.image_size, threads)
            run.log(f"{name} {output_name(dtype, channels_last)}:")
            cases.append(run_case(case, data, run.has_gpu, cfg.recipe_batches, num_classes))
        section = {"recipe": found.about, "augment": found.augment, "mixup_alpha": found.mixup_alpha,
                   "cutmix_alpha": found.cutmix_alpha, "task": found.task, "batch_size": batch_size,
                   "batches": cfg.recipe_batches, "cases": cases}
        if found.train_recipe:
            section["train"] = run.train_slice(name, synthetic=False, extra=["--recipe", found.train_recipe])
        return section

    step.__doc__ = f"{name}: {recipe(name).about}"
    return step


def rank_threads() -> int:
    return decoder_budget()["threads"]


def _num_classes(shards: Path) -> int:
    from dalifeed.format import ShardManifest

    return ShardManifest.load(shards).num_classes


def failed_cases(report: dict) -> list[str]:
    """'step output' of every case in `report` whose first batch did not match the CPU path's."""
    return [f"{name} {case['output']}" for name in RECIPES for case in (report.get(name.replace("-", "_")) or {})
            .get("cases", []) if not case["matches_cpu"]]

