"""DALI's image decoder as every dalifeed graph configures it, and the decoder `shard-convert verify --decode`
and the loaders' error messages run over given images. A floor below both `convert/` and `pipelines/`:
verify decodes with the decoder training uses without `convert/` importing `pipelines/`.

- `decoder_device`, `decoder_hints` (with `decoder_memory`): the device string and the arguments of every
  `mixed` decoder (`pipelines/graphs.py` and `pipelines/detection.py` build their decoders with them);
- `DaliDecoder`: DALI's own decoder run over encoded images handed in from Python, bisecting a failing batch
  down to the samples it rejects, each with `summarize_dali_error`'s one line, and on request a batch that made
  libjpeg warn (damaged data it decodes anyway) down to the samples that did;
- `dali_sees_gpu`: whether DALI can use a GPU here.

Importing this module does not import DALI (the base install has none: docs/gpu.md, "The CUDA stack");
`DaliDecoder.pipeline` does, when a decoder is first built.
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from . import defaults
from .budget import thread_budget
from .stack import dali_stack

# Share of JPEGs `mixed` decoding gives the hardware JPEG decoder of A100/H100-class GPUs (the rest decode on
# CUDA cores): 0.99, NVIDIA's published DGX-H100 ResNet-50 configuration (defaults.py; DALI's own default is
# 0.65, DGX-A100's MLPerf v2.0 run used 0). The best value depends on the GPU and on the threads feeding it:
# make gpu-check measures 0, 0.65 and 0.99 at one rank's threads and prints the best.
DEFAULT_HW_DECODER_LOAD = defaults.HW_DECODER_LOAD

# What the `mixed` decoder reserves. In DALI 2.4 every fn.decoders.* is the nvImageCodec-based ImageDecoder
# (dali/operators/imgcodec/image_decoder.h): when built, it allocates for each of its threads (the pipeline's
# num_threads) one device buffer of `device_memory_padding` bytes and two pinned host buffers of
# `host_memory_padding` bytes and returns them to DALI's memory pools, which keep them; nvJPEG then adds the same
# paddings to every buffer it grows (nvjpegSetDeviceMemoryPadding / nvjpegSetPinnedMemoryPadding). The values
# DALI's ResNet-50 example used to pass (sized for ImageNet's largest image) reserve hundreds of MiB per thread,
# tens of GB for a rank with many threads (gpu-evidence.md, "Memory per rank"). Its current version passes no
# paddings (DALI's defaults). We size them for an image of
# DECODER_SIZED_FOR_SIDE^2 pixels at the bytes per pixel DALI's numbers imply, at most 64 MiB each: a larger
# image makes nvJPEG grow that thread's buffer once, which is all a padding saves (docs/development/gpu-evidence.md). No
# preallocate_width/height_hint: with them the hardware decoder preallocates a whole batch of images that size
# (nvjpegDecodeBatchedPreAllocate, an amount nvJPEG does not document); without them nvImageCodec still
# preallocates its pool, which is what its source credits with ">20% for 8GPU training".
DEVICE_BYTES_PER_PIXEL = 211025920 / (5980 * 6430)  # 5.5
HOST_BYTES_PER_PIXEL = 140544512 / (5980 * 6430)  # 3.7
DECODER_SIZED_FOR_SIDE = 2048  # 4 Mpx: COCO (<= 640 px) and nearly all of ImageNet (typically <= 500 px) fit
# (fixed on purpose, not from --image-size or the batch: the buffers hold the source image a thread decodes)
MAX_DECODER_PADDING = 64 * 2**20


def decoder_device(device: str) -> str:
    return "mixed" if device == "gpu" else "cpu"


@dataclass(frozen=True)
class DecoderMemory:
    """What one `mixed` decoder holds from the moment it is built: per thread, one device buffer of
    `device_padding` and two pinned host buffers of `host_padding` bytes (DALI 2.4, image_decoder.h)."""

    threads: int
    device_padding: int
    host_padding: int

    @property
    def device_bytes(self) -> int:
        return self.threads * self.device_padding

    @property
    def pinned_bytes(self) -> int:
        return self.threads * 2 * self.host_padding


def decoder_memory(threads: int, max_image_side: int = DECODER_SIZED_FOR_SIDE) -> DecoderMemory:
    """The paddings for images up to `max_image_side` squared (whole MiB, at most MAX_DECODER_PADDING each)
    and what a decoder with `threads` threads reserves with them."""
    def padding(bytes_per_pixel: float) -> int:
        mib = -(-int(bytes_per_pixel * max_image_side**2) // 2**20)
        return min(MAX_DECODER_PADDING, mib * 2**20)

    return DecoderMemory(threads, padding(DEVICE_BYTES_PER_PIXEL), padding(HOST_BYTES_PER_PIXEL))


def decoder_hints(device: str, hw_decoder_load: float = DEFAULT_HW_DECODER_LOAD, *, roi: bool) -> dict:
    """The arguments every `mixed` decoder gets and the CPU decoder does not need (each applies only to
    `mixed`, per DALI's schema; tests/test_gpu_graphs.py holds the graphs to this list). `roi`: the decoder
    decodes a region (image_random_crop, image_slice)."""
    if decoder_device(device) != "mixed":
        return {}
    memory = decoder_memory(threads=1)  # the paddings are per thread
    # libjpeg-turbo, the CPU decoder, always interpolates chroma ("fancy upsampling": nvImageCodec's
    # libjpeg_turbo_decoder defaults to it and DALI 2.4 never turns it off); DALI's mixed default is nvJPEG's
    # simpler upsampling, so colours at chroma edges differ from the CPU path. Asking nvJPEG for fancy
    # upsampling is safe for whole images, but nvImageCodec 0.9 (what DALI 2.4 loads) with nvJPEG < 13.2 (all
    # of CUDA 12) then refuses region decodes of 4:2:0 and 4:2:2 JPEGs ("ROI decode with fancy upsampling may
    # produce wrong results ... set enable_roi_fancy_upsampling=1", an option DALI cannot pass) and hands
    # them to libjpeg-turbo on the CPU: the region decoders keep nvJPEG's upsampling (docs/development/gpu-evidence.md).
    return dict(hw_decoder_load=hw_decoder_load, device_memory_padding=memory.device_padding,
                host_memory_padding=memory.host_padding, jpeg_fancy_upsampling=not roi)


# nvImageCodec's status codes (nvimgcodecStatus_t), as DALI prints them: "nvImageCodec failure: '#4'"
NVIMGCODEC_STATUS = {3: "bad code stream", 4: "code stream unsupported", 5: "allocator failure",
                     6: "execution failed", 8: "internal error", 9: "implementation unsupported"}


def dali_sees_gpu() -> bool:
    """Whether DALI can use a CUDA device here (without importing torch)."""
    return dali_stack()[3] > 0


def summarize_dali_error(error: BaseException) -> str:
    """The line of a DALI error that says what happened, without its pipeline traceback and boilerplate."""
    text = str(error)
    if "encountered:" in text:
        text = text.rsplit("encountered:", 1)[1]
    lines = [line.strip() for line in text.splitlines()]
    keep = [line for line in lines if line and not line.startswith(("Current pipeline object", "C++ context",
                                                                     "Critical error", "File \""))]
    summary = keep[0] if keep else lines[0] if lines else type(error).__name__
    summary = re.sub(r'^Assert on ".*?" failed: ', "", summary).rstrip(" :")
    code = re.search(r"nvImageCodec failure: '#(\d+)'", summary)
    if code and int(code.group(1)) in NVIMGCODEC_STATUS:
        summary += f" ({NVIMGCODEC_STATUS[int(code.group(1))]})"
    return summary


class DaliDecoder:
    """DALI's image decoder (`mixed`, i.e. nvJPEG, on a GPU; libjpeg-turbo on the CPU) over encoded images
    handed in from Python, reporting the ones it rejects. The same decoder the training graphs use."""

    def __init__(self, device: str = "cpu", device_id: int | None = None, batch_size: int = 32,
                 num_threads: int | None = None):
        self.device, self.device_id, self.batch_size = device, device_id, batch_size
        self.num_threads = num_threads or thread_budget(device).threads
        self._pipe = None

    def pipeline(self):
        """The decoding pipeline, defined but not built (tests/test_gpu_graphs.py checks its GPU graph)."""
        from nvidia.dali import fn, pipeline_def, types  # here: the base install has no DALI (docs/gpu.md)

        # the executor the loaders run (definitions.py): DALI's legacy one, which exec_async=False picks,
        # crashed once in its Shutdown of a pipeline whose run had failed, while the failed loader's lived
        @pipeline_def(batch_size=self.batch_size, num_threads=self.num_threads, device_id=self.device_id,
                      prefetch_queue_depth=1, exec_dynamic=True)
        def decode():
            encoded = fn.external_source(name="encoded", dtype=types.UINT8, ndim=1)
            return fn.decoders.image(encoded, device=decoder_device(self.device), output_type=types.RGB,
                                     **decoder_hints(self.device, roi=False))

        return decode()

    def _build(self):
        pipe = self.pipeline()
        pipe.build()
        return pipe

    def _decode(self, items: list[bytes]) -> None:
        if self._pipe is None:
            self._pipe = self._build()
        self._pipe.feed_input("encoded", [np.frombuffer(item, np.uint8) for item in items])
        self._pipe.run()

    def failures(self, items: list[bytes], warnings: list[tuple[int, str]] | None = None) -> list[tuple[int, str]]:
        """(index into `items`, DALI's reason) for every item DALI cannot decode, in index order. With a
        `warnings` list, what the decoder writes to stderr meanwhile (libjpeg's "Corrupt JPEG data: ..." for
        damaged data it decodes anyway) is caught instead and added to it as (index, its first line)."""
        found = [(i, "empty member") for i, item in enumerate(items) if not item]  # never handed to DALI
        positions = [i for i, item in enumerate(items) if item]
        for start in range(0, len(positions), self.batch_size):
            chunk = positions[start:start + self.batch_size]
            failed, warned = self._bisect([items[i] for i in chunk], catch=warnings is not None)
            found += [(chunk[j], why) for j, why in failed]
            if warnings is not None:
                warnings += [(chunk[j], said) for j, said in warned]
        if warnings is not None:
            warnings.sort()
        return sorted(found)

    def _bisect(self, items: list[bytes], catch: bool) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
        """(failures, warnings) of `items`, by index into them: a batch that fails or warns is halved until the
        samples that do are found."""
        try:
            with stderr_caught(catch) as caught:
                self._decode(items)
            said = libjpeg_warnings("".join(caught))
            if not said:
                return [], []
            if len(items) == 1:
                return [], [(0, said[0])]
        except RuntimeError as e:
            self._pipe = None  # a pipeline that raised is rebuilt, not trusted
            if len(items) == 1:
                return [(0, summarize_dali_error(e))], []
        mid = len(items) // 2
        (failed_a, warned_a), (failed_b, warned_b) = self._bisect(items[:mid], catch), self._bisect(items[mid:], catch)
        return (failed_a + [(mid + i, why) for i, why in failed_b],
                warned_a + [(mid + i, said) for i, said in warned_b])


# libjpeg's warnings (jerror.h): "Corrupt JPEG data: ...", "Premature end of JPEG file", "Invalid SOS parameters
# for sequential JPEG", "Unsupported marker type", ...
LIBJPEG_WARNING = re.compile(r"\b(JPEG|JFIF|Huffman|marker|SOS|progression)\b", re.IGNORECASE)


def libjpeg_warnings(text: str) -> list[str]:
    """The lines of `text` that are libjpeg's warnings; the others go on to stderr, where they were going."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    other = [line for line in lines if not LIBJPEG_WARNING.search(line)]
    if other:
        print("\n".join(other), file=sys.stderr, flush=True)
    return [line for line in lines if LIBJPEG_WARNING.search(line)]


@contextmanager
def stderr_caught(catch: bool = True):
    """Catch what is written to file descriptor 2 in the block (by C code too: libjpeg's warnings from DALI's
    threads) instead of letting it reach the terminal without a sample's name: the list it yields holds the
    text once the block has ended. Without `catch`, nothing is caught."""
    caught: list[str] = []
    if not catch:
        yield caught
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as file:
        os.dup2(file.fileno(), 2)
        try:
            yield caught
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            file.seek(0)
            caught.append(file.read().decode("utf-8", "replace"))
