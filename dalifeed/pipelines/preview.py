"""A picture of what a training recipe does to the data: N samples of a shard folder, each as stored, as the
DALI training graph augments it, and as torchvision's transforms do for the same AugmentConfig.

    python -m dalifeed.pipelines.preview SHARDS OUT.png --n 8 --auto-augment ta_wide --random-erase 0.25

(`dali-bench --preview N` writes the same next to bench.json.) The two augmented columns are independent
draws of the same recipe, not the same draw: they show that both do the same kind of thing to the image.
"""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

import numpy as np
import torch
from nvidia.dali import fn, pipeline_def, types
from PIL import Image

from dalifeed.format import CLASS_MEMBER, IMAGE_MEMBER, ShardManifest, split_member_name
from dalifeed.shardfolder import open_shard_folder

from .augment import AugmentConfig
from .graphs import train_augment

CELL_GAP = 4


def first_samples(shards: str | Path | ShardManifest, split: str, n: int) -> tuple[list[bytes], list[str]]:
    """The first `n` images of `split` (shard order), as stored, and the caption of each: its label as the
    manifest names it ("index name"; '?' for a sample without a label). The label is read where the shards
    keep it: dalifeed's `cls`, or for adopted shards the member `shard-convert index` was told
    (`--label-member txt`, `json` with `--label-key`)."""
    manifest = open_shard_folder(shards)
    adopted = manifest.options if manifest.kind == "webdataset" else {}
    label_member, label_key = adopted.get("label_member", CLASS_MEMBER), adopted.get("label_key")
    jpegs: dict[str, bytes] = {}
    labels: dict[str, str | int | None] = {}
    for path in manifest.shard_paths(split):
        with tarfile.open(path) as tar:
            for member in tar:
                named = split_member_name(member.name) if member.isreg() else None
                if named is None:
                    continue
                key, extension = named
                if extension == IMAGE_MEMBER and len(jpegs) < n:
                    jpegs[key] = tar.extractfile(member).read()
                elif extension == label_member:
                    labels[key] = label_of(tar.extractfile(member).read(), label_key)
                if len(jpegs) == n and all(k in labels for k in jpegs):
                    break
        if len(jpegs) == n:
            break
    return list(jpegs.values()), [caption_of(labels.get(key), manifest.classes) for key in jpegs]


def label_of(data: bytes, json_key: str | None) -> str | int | None:
    """A label member's text, or with `json_key` that key's value of the JSON document (None: unreadable)."""
    try:
        text = data.decode("utf-8").strip()
        return json.loads(text).get(json_key) if json_key else text
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None


def caption_of(label: str | int | None, classes: list[str]) -> str:
    """'index name' for a class index (a `cls` text, a JSON int) or a class name (a `txt`, a JSON string)."""
    if label is None or label == "":
        return "?"
    if isinstance(label, str) and not label.isdigit():
        return f"{classes.index(label)} {label}" if label in classes else label
    index = int(label)
    return f"{index} {classes[index]}" if 0 <= index < len(classes) else str(index)


def dali_augmented(jpegs: list[bytes], cfg: AugmentConfig, seed: int = 0) -> list[np.ndarray]:
    """The training graph (cpu) on these JPEGs -> uint8 HWC images (normalisation undone for display)."""
    @pipeline_def(batch_size=len(jpegs), num_threads=1, device_id=None, seed=seed,
                  enable_conditionals=cfg.auto_augment is not None)
    def pipe():
        data = fn.external_source(source=lambda: [np.frombuffer(j, dtype=np.uint8) for j in jpegs], batch=True,
                                  dtype=types.UINT8)
        return train_augment(data, cfg, "cpu")

    p = pipe()
    p.build()
    (images,) = p.run()
    return [to_uint8(torch.from_numpy(np.asarray(image)).float(), cfg) for image in images]


def torchvision_augmented(jpegs: list[bytes], cfg: AugmentConfig, seed: int = 0) -> list[np.ndarray]:
    """torchvision's ClassificationPresetTrain for the same AugmentConfig (RandomResizedCrop, flip, policy,
    normalise, RandomErasing) -> uint8 HWC images."""
    import torchvision.transforms.v2 as v2

    from .augment import torchvision_policy

    steps = [v2.RandomResizedCrop(cfg.image_size, scale=cfg.crop_scale, ratio=cfg.crop_ratio, antialias=True)]
    if cfg.flip:
        steps.append(v2.RandomHorizontalFlip())
    if cfg.auto_augment:
        steps.append(torchvision_policy(cfg))
    steps += [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(cfg.mean, cfg.std)]
    if cfg.random_erase:
        steps.append(v2.RandomErasing(p=cfg.random_erase, value=0))
    transform = v2.Compose(steps)
    torch.manual_seed(seed)
    out = []
    for jpeg in jpegs:
        image = transform(Image.open(io.BytesIO(jpeg)).convert("RGB"))
        out.append(to_uint8(image, cfg))  # (x / 255 - mean) / std: the graph's (x - 255 mean) / (255 std)
    return out


def to_uint8(image: torch.Tensor, cfg: AugmentConfig) -> np.ndarray:
    """A normalised CHW image in the graph's scale -> uint8 HWC."""
    image = image.permute(1, 2, 0)
    mean, std = torch.tensor(cfg.mean) * 255, torch.tensor(cfg.std) * 255
    return (image.float() * std + mean).round().clamp(0, 255).to(torch.uint8).numpy()


COLUMNS = ("stored", "DALI", "torchvision")
TEXT_HEIGHT = 12  # PIL's default bitmap font is 11 px high


def grid(rows: list[list[np.ndarray]], size: int, headers: list[str], captions: list[str]) -> Image.Image:
    """Rows of equal-length lists of images, each shown in a size x size cell, a header above each column and
    each row's caption (its sample's label) under each of its images: a label can be checked against its
    augmented image."""
    from PIL import ImageDraw

    columns = max(len(r) for r in rows)
    row_height = size + TEXT_HEIGHT + CELL_GAP
    canvas = Image.new("RGB", (columns * (size + CELL_GAP) + CELL_GAP, TEXT_HEIGHT + len(rows) * row_height + CELL_GAP),
                       (255, 255, 255))
    draw = ImageDraw.Draw(canvas)
    for j, header in enumerate(headers):
        draw.text((CELL_GAP + j * (size + CELL_GAP), 0), header, fill=(0, 0, 0))
    for i, (row, caption) in enumerate(zip(rows, captions)):
        top = TEXT_HEIGHT + CELL_GAP + i * row_height
        for j, image in enumerate(row):
            cell = Image.fromarray(image)
            cell.thumbnail((size, size))
            left = CELL_GAP + j * (size + CELL_GAP)
            canvas.paste(cell, (left, top))
            draw.text((left, top + size), caption, fill=(0, 0, 0))
    return canvas


def write_preview(shards: str | Path | ShardManifest, out: str | Path, n: int, cfg: AugmentConfig, split: str = "train",
                  seed: int = 0) -> Path:
    """OUT.png: one row per sample: the stored image, DALI's augmentation, torchvision's, each captioned with
    the sample's label, under column headers."""
    jpegs, captions = first_samples(shards, split, n)
    if not jpegs:
        raise ValueError(f"{shards}: split {split!r} holds no images")
    dali = dali_augmented(jpegs, cfg, seed)
    reference = torchvision_augmented(jpegs, cfg, seed)
    originals = [np.asarray(Image.open(io.BytesIO(j)).convert("RGB")) for j in jpegs]
    image = grid([[o, d, t] for o, d, t in zip(originals, dali, reference)], size=cfg.image_size,
                 headers=list(COLUMNS), captions=captions)
    out = Path(out)
    image.save(out)
    return out


def main(argv: list[str] | None = None) -> None:
    import argparse

    from .names import POLICIES

    parser = argparse.ArgumentParser(prog="python -m dalifeed.pipelines.preview", description=__doc__.split("\n\n")[0])
    parser.add_argument("shards")
    parser.add_argument("out")
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--split", default="train")
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--auto-augment", choices=POLICIES, default=None)
    parser.add_argument("--random-erase", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    cfg = AugmentConfig(image_size=args.image_size, auto_augment=args.auto_augment, random_erase=args.random_erase)
    print(f"wrote {write_preview(args.shards, args.out, args.n, cfg, args.split, args.seed)}")


if __name__ == "__main__":
    main()
