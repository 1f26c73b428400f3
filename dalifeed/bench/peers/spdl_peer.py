"""SPDL: its thread pipeline (spdl.pipeline) over the shard folder's tars, decoding with spdl.io."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import spdl.io
import torch
import torchvision.transforms as T
from spdl.pipeline import PipelineBuilder

from dalifeed.format import CLASS_MEMBER, IMAGE_MEMBER, split_member_name
from dalifeed.pipelines.augment import AugmentConfig
from dalifeed.shardfolder import open_shard_folder

from ..loaders import Normalize, train_transform


class SpdlLoader:
    """SPDL's pipeline, built per epoch over the shards in a new order: tars read two at a time, each one's
    samples shuffled (as webdataset's buffer shuffles), decoded and transformed by `workers` threads, batched,
    normalised in the consumer as the torch loaders are. The transform is the baseline's (loaders.train_transform),
    its crop and flip run by FFmpeg while decoding."""

    def __init__(self, shards: Path, split: str, batch_size: int, workers: int, device: torch.device,
                 augment: AugmentConfig, fp16: bool = False):
        manifest = open_shard_folder(shards)
        self.tars = [manifest.shard_location(s) for s in manifest.split_info(split).shards]
        self.batch_size, self.threads = batch_size, max(1, workers)
        steps = train_transform(augment).transforms
        self.crop = next(t for t in steps if isinstance(t, T.RandomResizedCrop))
        self.flip = augment.flip
        moved = (T.RandomResizedCrop, T.RandomHorizontalFlip, T.PILToTensor)  # to FFmpeg, or not needed
        self.rest = T.Compose([t for t in steps if not isinstance(t, moved)])
        self.normalize = Normalize(device, augment, fp16)
        self.rng = random.Random(0)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self.rng.sample(self.tars, len(self.tars))
        pipeline = (
            PipelineBuilder()
            .add_source(order)
            .pipe(self.read_tar, concurrency=min(2, self.threads))
            .disaggregate()
            .pipe(self.decode, concurrency=self.threads)
            .aggregate(self.batch_size, drop_last=True)
            .pipe(collate)
            .add_sink(3)
            .build(num_threads=self.threads)
        )
        with pipeline.auto_stop():
            for images, labels in pipeline:
                yield self.normalize(images, labels)

    def read_tar(self, path: str) -> list[tuple[bytes, int]]:
        with open(path, "rb") as f:
            data = f.read()
        samples: dict[str, dict[str, bytes]] = {}
        for member, content in spdl.io.iter_tarfile(data):
            named = split_member_name(member)  # webdataset's rule for <key>.<ext>, as read_samples groups
            if named is not None:
                samples.setdefault(named[0], {})[named[1]] = bytes(content)
        pairs = [(s[IMAGE_MEMBER], int(s[CLASS_MEMBER])) for s in samples.values()]
        self.rng.shuffle(pairs)
        return pairs

    def decode(self, sample: tuple[bytes, int]) -> tuple[torch.Tensor, int]:
        """Decode, crop, resize and flip in one FFmpeg filter graph (how SPDL's examples resize: `filter_desc`),
        outside the GIL; then the policy and erasing, if any, as torchvision ops on the tensor."""
        data, label = sample
        packets = spdl.io.demux_image(data)
        frames = spdl.io.decode_packets(packets, filter_desc=self.crop_filter(packets.height, packets.width))
        image = spdl.io.to_torch(spdl.io.convert_frames(frames)).permute(2, 0, 1)  # HWC rgb24 -> CHW
        return self.rest(image), label

    def crop_filter(self, height: int, width: int) -> str:
        """RandomResizedCrop (torchvision's own draw of the box) + flip as an FFmpeg filter: bilinear scaling,
        which swscale widens when it shrinks, as the baseline's antialiased resize does."""
        top, left, h, w = self.crop.get_params(torch.empty(1, height, width), self.crop.scale, self.crop.ratio)
        size = self.crop.size[0]
        flip = ",hflip" if self.flip and torch.rand(1).item() < 0.5 else ""
        return f"crop={w}:{h}:{left}:{top},scale={size}:{size}:flags=bilinear{flip},format=pix_fmts=rgb24"


def ffmpeg_problem() -> str | None:
    """spdl.io imports without FFmpeg and fails at the first decode: decode a tiny JPEG to find out first."""
    import io

    from PIL import Image

    jpeg = io.BytesIO()
    Image.new("RGB", (8, 8)).save(jpeg, format="JPEG")
    try:
        spdl.io.load_image(jpeg.getvalue())
    except RuntimeError:
        return ("--loaders spdl: spdl.io finds no FFmpeg 4-8 shared libraries (libavutil, libavcodec, libavformat, "
                "libavfilter, libavdevice); install them, e.g. on Debian 12: apt-get install libavformat59 "
                "libavfilter8 libavdevice59")
    return None


def collate(samples: list[tuple[torch.Tensor, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    images, labels = zip(*samples)
    return torch.stack(images), torch.tensor(labels, dtype=torch.int64)
