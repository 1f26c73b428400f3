"""The peers dali-bench races: the loaders a team would pick instead of dalifeed, each fed the split's photos in
its own native format and run the way its own documentation says to run it fast, with the baseline's
augmentation (`loaders.train_transform`), batch size, cores (`workers`) and output (normalised float batches
on the model's device, `loaders.Normalize`).

    spdl       SPDL's thread pipeline over the shard folder's tars (no conversion), FFmpeg decoding
    streaming  Mosaic streaming: MDSWriter shards, StreamingDataset + torch DataLoader
    litdata    LitData: litdata.optimize chunks, StreamingDataset + StreamingDataLoader

Each native copy is written once per split and shard folder content, under OUT/peers/ (OUT: dali-bench's
--out), to a temporary name renamed when complete. The packages are the optional extra `peers`
(`pip install 'dalifeed[peers]'`); a missing one is one line (`missing_package`). FFCV is not among them: it
does not build here (docs/benchmarks.md, "The race").
"""

from __future__ import annotations

import hashlib
import io
import shutil
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import torch

from dalifeed.format import CLASS_MEMBER, IMAGE_MEMBER, ShardManifest
from dalifeed.pipelines.augment import AugmentConfig
from dalifeed.shardfolder import open_shard_folder, read_samples

from ..loaders import train_transform
from ..names import PEERS

MODULES = {"spdl": ("spdl.io", "spdl.pipeline"), "streaming": ("streaming",), "litdata": ("litdata",)}
INSTALL = "pip install 'dalifeed[peers]'"


def missing_package(name: str) -> str | None:
    """Why peer `name` cannot run here (one line naming what to install: the extra, or for SPDL FFmpeg's
    libraries), or None."""
    import importlib

    for module in MODULES[name]:
        try:
            importlib.import_module(module)
        except ImportError as e:  # streaming also fails when a dependency of its own is missing
            return f"--loaders {name} needs {e.name or module}, which is not installed: {INSTALL}"
    if name == "spdl":
        from .spdl_peer import ffmpeg_problem

        return ffmpeg_problem()
    return None


def peer_loader(name: str, *, shards: Path | ShardManifest, split: str, batch_size: int, image_size: int, workers: int,
                device: torch.device, workdir: Path, fp16: bool = False,
                augment: AugmentConfig | None = None) -> Iterable:
    """Peer `name` over the split's photos, yielding (images, labels) as race_loader's loaders do (float16
    with `fp16`); its native copy of the data is written under `workdir` when not there yet."""
    augment = replace(augment or AugmentConfig(), image_size=image_size)
    # each peer's module imports its package: imported here, so that dali-bench runs without the extra
    if name == "spdl":
        from .spdl_peer import SpdlLoader

        return SpdlLoader(shards, split, batch_size, workers, device, augment, fp16)
    if name == "streaming":
        from .mds_peer import streaming_loader, write_mds

        return streaming_loader(write_mds(shards, split, workdir), batch_size, workers, device, augment, fp16)
    if name == "litdata":
        from .litdata_peer import litdata_loader, write_litdata

        return litdata_loader(write_litdata(shards, split, workdir, workers), batch_size, workers, device, augment,
                              fp16)
    raise ValueError(f"unknown peer {name!r} (choose from {', '.join(PEERS)})")


# -- the same augmentation, on what each peer decodes to ----------------------------------------------------

def tensor_transform(augment: AugmentConfig):
    """The baseline's transform (loaders.train_transform) for a decoded uint8 (3, H, W) tensor, what LitData
    decodes to: the same torchvision ops, without the PIL-to-tensor step."""
    import torchvision.transforms as T

    return T.Compose([t for t in train_transform(augment).transforms if not isinstance(t, T.PILToTensor)])


def pil_rgb(data: bytes):
    """JPEG bytes as the baseline's loader opens a file (loaders.upright_rgb): EXIF orientation applied, RGB."""
    from PIL import Image, ImageOps

    return ImageOps.exif_transpose(Image.open(io.BytesIO(data))).convert("RGB")


class PilTransform:
    """JPEG bytes -> the baseline's transform (a class, not a closure: DataLoader workers pickle it)."""

    def __init__(self, augment: AugmentConfig):
        self.transform = train_transform(augment)

    def __call__(self, data: bytes) -> torch.Tensor:
        return self.transform(pil_rgb(data))


# -- the photos, and where each native copy goes ------------------------------------------------------------

def photos(shards: Path, split: str) -> Iterator[tuple[bytes, int]]:
    """(JPEG bytes, class index) of every sample of the split, in shard order: what every writer converts."""
    for sample in read_samples(open_shard_folder(shards), split, {IMAGE_MEMBER, CLASS_MEMBER}):
        yield sample[IMAGE_MEMBER], int(sample[CLASS_MEMBER])


def native_folder(workdir: Path, peer: str, shards: Path, split: str) -> Path:
    """Where peer's copy of the split goes: named by the content of the split's shards (their sha256s), so that
    other shards never reuse a stale copy."""
    manifest = open_shard_folder(shards)
    digest = hashlib.sha256("".join(s.sha256 for s in manifest.split_info(split).shards).encode()).hexdigest()
    return Path(workdir) / "peers" / f"{peer}-{split}-{digest[:16]}"


def write_once(folder: Path, write) -> Path:
    """`write(tmp)` into a temporary folder renamed to `folder` when it returns: a half-written copy (an
    interrupted bench) is never taken for a whole one."""
    if folder.is_dir():
        return folder
    tmp = folder.with_name(folder.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    write(tmp)
    tmp.rename(folder)
    return folder
