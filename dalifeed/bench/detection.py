"""`dali-bench --task detection`: the DALI detection loader against a torchvision DataLoader with
`torchvision.transforms.v2` on the same COCO images, both giving the same output: a list of normalised
float (3, S, S) images and torchvision targets (boxes in pixels, labels) on the model's device, after an
SSD-style IoU crop, a horizontal flip and a resize to S x S."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from dalifeed.convert.coco import SplitPlan, load_instances, plan_split, training_boxes
from dalifeed.decode import DEFAULT_HW_DECODER_LOAD
from dalifeed.format import ShardManifest, listing_digest
from dalifeed.pipelines.augment import IMAGENET_MEAN, IMAGENET_STD
from dalifeed.pipelines.dataset import ShardData

from .loaders import dataloader_options, opened
from .names import DALI_DEVICES, DETECTION_LOADERS


def coco_split(images: Path, annotations: Path, manifest: ShardManifest, split: str) -> SplitPlan:
    """What a conversion of `annotations` into `split` would convert, planned by the converter itself: the
    records whose file exists (with `--skip-empty`, only those with annotations), each with its annotations
    as the shards hold them."""
    index_of = {cid: i for i, cid in enumerate(manifest.extra["coco"]["category_ids"])}
    return plan_split(split, Path(images), load_instances(annotations), index_of,
                      skip_empty=manifest.options.get("skip_empty", False), seed=manifest.options.get("seed", 0))


def same_coco_data_problem(images: Path, annotations: Path, manifest: ShardManifest, split: str) -> str | None:
    """None when the COCO source holds exactly the files `split` of the shards was converted from."""
    if manifest.kind != "coco":
        return f"--shards holds {manifest.kind} shards, not COCO (shard-convert coco)"
    mine = listing_digest(coco_split(images, annotations, manifest, split).entries)
    made_from = manifest.splits[split].listing
    if made_from is not None and mine != made_from:
        return (f"--images/--annotations give {mine['files']} image files ({mine['bytes']} bytes), --shards split "
                f"{split!r} was made from {made_from['files']} ({made_from['bytes']} bytes)")
    return None


class CocoDetection(torch.utils.data.Dataset):
    """COCO records -> (uint8 image tensor, {"boxes": BoundingBoxes xyxy, "labels"}) through transforms.v2:
    what a torchvision reference training script feeds a detector."""

    def __init__(self, images: Path, annotations: Path, manifest: ShardManifest, split: str, size: int):
        from torchvision.transforms import v2

        self.folder = Path(images)
        self.items = coco_split(images, annotations, manifest, split).items
        self.transform = v2.Compose([v2.RandomIoUCrop(), v2.RandomHorizontalFlip(), v2.Resize((size, size)),
                                     v2.SanitizeBoundingBoxes()])

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        from PIL import Image
        from torchvision import tv_tensors
        from torchvision.transforms.v2 import functional as F

        item = self.items[i]
        with Image.open(self.folder / item.file_name) as img:
            image = F.pil_to_tensor(img.convert("RGB"))
        boxes, _, _ = training_boxes(item, [])  # the converter's targets: relative, clipped, non-crowd
        height, width = image.shape[1:]
        pixels = torch.tensor([b for b, _ in boxes], dtype=torch.float32).reshape(-1, 4) * \
            torch.tensor([width, height, width, height], dtype=torch.float32)
        target = {"boxes": tv_tensors.BoundingBoxes(pixels, format="XYXY", canvas_size=(height, width)),
                  "labels": torch.tensor([label for _, label in boxes], dtype=torch.int64),
                  "image_id": item.record["id"]}
        return self.transform(image, target)


def collate_lists(batch):
    return [image for image, _ in batch], [target for _, target in batch]


class NormalizedLists:
    """uint8 images and their targets moved to `device`, images normalised there (as the classification
    baseline does: the copy is 4x smaller than float)."""

    def __init__(self, dataloader, device: torch.device):
        self.dataloader, self.device = dataloader, device
        self.mean = torch.tensor(IMAGENET_MEAN, device=device).view(3, 1, 1) * 255
        self.std = torch.tensor(IMAGENET_STD, device=device).view(3, 1, 1) * 255

    def __iter__(self) -> Iterator:
        for images, targets in self.dataloader:
            images = [(im.to(self.device, non_blocking=True).float() - self.mean) / self.std for im in images]
            targets = [{"boxes": t["boxes"].as_subclass(torch.Tensor).to(self.device),
                        "labels": t["labels"].to(self.device), "image_id": t["image_id"]} for t in targets]
            yield images, targets


def build_detection_loader(name: str, *, images: Path, annotations: Path, shards: Path | ShardData, split: str,
                           batch_size: int, image_size: int, workers: int, device: torch.device,
                           hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD) -> Iterable:
    if name == "baseline":
        dataset = CocoDetection(images, annotations, opened(shards, task="detection").manifest, split, image_size)
        loader = torch.utils.data.DataLoader(dataset, batch_size=batch_size, shuffle=True, drop_last=True,
                                             collate_fn=collate_lists, **dataloader_options(workers, device))
        return NormalizedLists(loader, device)
    if name in DALI_DEVICES:
        from dalifeed.pipelines import DetectionConfig, make_detection_loader

        return make_detection_loader(opened(shards, task="detection"), split, batch_size,
                                     detection=DetectionConfig(size=image_size), train=True, num_threads=workers,
                                     device=DALI_DEVICES[name], hw_decoder_load=hw_decoder_load)
    raise ValueError(f"unknown detection loader {name!r} (choose from {', '.join(DETECTION_LOADERS)})")
