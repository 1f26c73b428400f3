"""Shards hold only what every decoder reads alike: the JPEG frame header decides what passes through, what
is re-encoded (and why) and what is skipped (saying what it is); every sample of the resulting shards
decodes through DALI's reader and decoder to exactly PIL's pixels. EXIF rotation, the pixel limit, and
importing dalifeed without side effects belong here too."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import imagecodecs
import numpy as np
import pytest
import webdataset as wds
from PIL import Image, ImageOps

from dalifeed.convert import verify_shards
from dalifeed.convert.images import read_jpeg_frame
from dalifeed.convert.verify import check_image
from helpers import DATA, convert, gradient_image, jpeg_bytes, png_bytes

RGB = gradient_image(40, 48)
GREY = np.ascontiguousarray(RGB[..., 0])


def patch_sof(data: bytes, marker: int) -> bytes:
    """The same JPEG with its SOF0 marker replaced: legal for SOF1 (a superset of baseline), a lie for others."""
    i = data.index(b"\xff\xc0")
    return data[:i + 1] + bytes([marker]) + data[i + 2:]


def exif_rotated(array: np.ndarray, orientation: int = 6) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=95, exif=exif)
    return buf.getvalue()


def cmyk_jpeg(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).convert("CMYK").save(buf, format="JPEG", quality=95)  # Adobe APP14, 4 components
    return buf.getvalue()


# name -> (bytes, what shard-convert must do: None = pass through, "reason" = re-encoded, "skip: ..." = skipped)
ENCODINGS = {
    "baseline.jpg": (jpeg_bytes(RGB), None),
    "progressive.jpg": (jpeg_bytes(RGB, progressive=True), None),
    "grey.jpg": (jpeg_bytes(GREY), None),
    "extended-sof1.jpg": (patch_sof(jpeg_bytes(RGB), 0xC1), None),
    "lossless-grey8.jpg": (imagecodecs.jpeg8_encode(GREY, lossless=True), "lossless-jpeg"),
    "lossless-rgb8.jpg": (imagecodecs.jpeg8_encode(RGB, lossless=True), "lossless-jpeg"),
    "arithmetic.jpg": ((DATA / "arithmetic-sof9.jpg").read_bytes(), "arithmetic-jpeg"),
    "cmyk.jpg": (cmyk_jpeg(RGB), "cmyk-jpeg"),
    "ycck.jpg": (imagecodecs.jpeg8_encode(np.asarray(Image.fromarray(RGB).convert("CMYK")), level=90,
                                          colorspace="CMYK", outcolorspace="YCCK"), "ycck-jpeg"),
    "rgb-coded.jpg": (imagecodecs.jpeg8_encode(RGB, level=90, outcolorspace="RGB"), "rgb-jpeg"),
    "rotated.jpg": (exif_rotated(RGB), "exif-orientation"),
    "drawing.png": (png_bytes(Image.fromarray(RGB)), "png"),
    "lossless-grey16.jpg": (imagecodecs.jpeg8_encode(GREY.astype(np.uint16) * 257, lossless=True, bitspersample=16),
                            "skip: unsupported: 16-bit lossless JPEG (SOF3, greyscale)"),
    "twelve-bit.jpg": (imagecodecs.jpeg8_encode(RGB.astype(np.uint16) * 16, level=90, bitspersample=12),
                       "skip: unsupported: 12-bit JPEG (SOF1 extended sequential, colour)"),
    "hierarchical.jpg": (patch_sof(jpeg_bytes(RGB), 0xC5),
                         "skip: unsupported: 8-bit hierarchical sequential JPEG (SOF5, colour)"),
    "truncated.jpg": (jpeg_bytes(RGB)[:300], "skip: corrupt or truncated image"),
    "notes.jpg": (b"these are my notes, not a picture\n" * 4, "skip: not an image"),
}


@pytest.mark.parametrize("name, marker, precision, components", [
    ("baseline.jpg", 0xC0, 8, 3), ("progressive.jpg", 0xC2, 8, 3), ("grey.jpg", 0xC0, 8, 1),
    ("extended-sof1.jpg", 0xC1, 8, 3), ("lossless-grey8.jpg", 0xC3, 8, 1), ("arithmetic.jpg", 0xC9, 8, 3),
    ("cmyk.jpg", 0xC0, 8, 4), ("lossless-grey16.jpg", 0xC3, 16, 1), ("twelve-bit.jpg", 0xC1, 12, 3),
])
def test_the_frame_header_is_read_from_the_bytes(name, marker, precision, components):
    frame = read_jpeg_frame(ENCODINGS[name][0])
    assert (frame.marker, frame.precision, frame.components) == (marker, precision, components)
    assert (frame.width, frame.height) == (48, 40)


def test_not_a_jpeg_has_no_frame():
    assert read_jpeg_frame(ENCODINGS["drawing.png"][0]) is None
    assert read_jpeg_frame(b"\xff\xd8\xff\xe0\x00") is None  # cut inside the first segment


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("encodings")
    folder = tmp / "src" / "things"
    folder.mkdir(parents=True)
    for name, (data, _) in ENCODINGS.items():
        (folder / name).write_bytes(data)
    manifest = convert(tmp / "src", tmp / "shards", workers=2)
    return tmp / "src", manifest


def stored_samples(manifest) -> dict[str, dict]:
    urls = [str(p) for p in manifest.shard_paths("train")]
    return {json.loads(s["json"])["path"].split("/", 1)[1]: s for s in wds.WebDataset(urls, shardshuffle=False)}


def test_pass_through_re_encode_and_skip_follow_the_frame_header(converted):
    src, manifest = converted
    samples = stored_samples(manifest)
    skipped = {entry["path"].split("/", 1)[1]: entry["reason"] for entry in manifest.skipped}
    for name, (data, expected) in ENCODINGS.items():
        if expected is None:
            assert samples[name]["jpg"] == data, f"{name} must pass through byte for byte"
        elif expected.startswith("skip: "):
            assert name not in samples
            assert skipped[name].startswith(expected.removeprefix("skip: ")), (name, skipped[name])
        else:
            assert json.loads(samples[name]["json"])["reencoded"] == expected, name
            frame = read_jpeg_frame(samples[name]["jpg"])
            assert frame.marker == 0xC0 and frame.precision == 8 and frame.components == 3
            assert frame.reencode_reason() is None
    assert manifest.reencoded["by_reason"] == {"arithmetic-jpeg": 1, "cmyk-jpeg": 1, "exif-orientation": 1,
                                               "lossless-jpeg": 2, "png": 1, "rgb-jpeg": 1, "ycck-jpeg": 1}
    assert manifest.found == len(ENCODINGS) == len(samples) + len(skipped)
    assert verify_shards(manifest.root, decode=True).ok


def test_re_encoded_images_keep_their_pixels(converted):
    _, manifest = converted
    samples = stored_samples(manifest)
    reference = np.asarray(Image.fromarray(RGB), dtype=np.float32)
    for name in ("lossless-rgb8.jpg", "arithmetic.jpg", "cmyk.jpg", "rgb-coded.jpg", "drawing.png"):
        pixels = np.asarray(Image.open(io.BytesIO(samples[name]["jpg"])).convert("RGB"), dtype=np.float32)
        assert pixels.shape == reference.shape
        # JPEG q95 of the same picture; a colour-space mix-up (RGB read as YCbCr, inverted CMYK) gives > 50
        assert np.abs(pixels - reference).mean() < 6, name


def test_every_sample_decodes_through_dali_to_exactly_pils_pixels(converted):
    from nvidia.dali import fn, pipeline_def, types

    _, manifest = converted
    n = manifest.num_samples("train")

    @pipeline_def(batch_size=n, num_threads=2, device_id=None)
    def read_and_decode():
        jpegs, meta = fn.readers.webdataset(
            paths=[str(p) for p in manifest.shard_paths("train")],
            index_paths=[str(p) for p in manifest.index_paths("train")], ext=["jpg", "json"],
            dtypes=[types.UINT8, types.UINT8], random_shuffle=False, name="Reader")
        return fn.decoders.image(jpegs, device="cpu", output_type=types.RGB), jpegs, meta

    pipe = read_and_decode()
    pipe.build()
    images, jpegs, metas = pipe.run()
    seen = set()
    for i in range(n):
        decoded = np.array(images[i])
        pil = np.asarray(Image.open(io.BytesIO(np.array(jpegs[i]).tobytes())).convert("RGB"))
        assert decoded.shape == pil.shape and np.array_equal(decoded, pil), json.loads(np.array(metas[i]).tobytes())
        seen.add(json.loads(np.array(metas[i]).tobytes())["path"])
    assert len(seen) == n == len(ENCODINGS) - 5  # the five skipped ones aside


def test_exif_rotated_jpegs_are_stored_upright_as_dali_and_the_bench_baseline_show_them(converted):
    """A phone photo 48 wide and 40 high stored on its side with EXIF orientation 6: PIL alone shows it
    48x40, DALI's decoders (adjust_orientation, on by default) and the bench baseline's loader show it 40
    wide and 48 high. The shard holds the upright pixels with no tag, so every reader agrees."""
    from nvidia.dali import fn, pipeline_def, types

    from dalifeed.bench.loaders import upright_rgb

    src, manifest = converted
    source = ENCODINGS["rotated.jpg"][0]
    stored = stored_samples(manifest)["rotated.jpg"]["jpg"]
    upright = ImageOps.exif_transpose(Image.open(io.BytesIO(source))).convert("RGB")
    assert Image.open(io.BytesIO(source)).size == (48, 40) and upright.size == (40, 48)

    shard_image = Image.open(io.BytesIO(stored))
    assert shard_image.size == (40, 48) and shard_image.getexif().get(0x0112) is None
    diff = np.abs(np.asarray(shard_image.convert("RGB"), np.float32) - np.asarray(upright, np.float32))
    assert diff.mean() < 3  # the same picture, re-encoded at q95, turned the right way

    @pipeline_def(batch_size=2, num_threads=1, device_id=None)
    def decode():
        data = fn.external_source(name="data", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(data, device="cpu", output_type=types.RGB)

    pipe = decode()
    pipe.build()
    pipe.feed_input("data", [np.frombuffer(source, np.uint8), np.frombuffer(stored, np.uint8)])
    (out,) = pipe.run()
    assert np.array(out[0]).shape == np.array(out[1]).shape == (48, 40, 3)
    assert upright_rgb(str(src / "things" / "rotated.jpg")).size == (40, 48)
    problems = check_image("x", source, decode=True, max_pixels=10**9)  # verify on a shard made elsewhere
    assert len(problems) == 1 and "EXIF orientation 6: DALI rotates it" in problems[0]


def test_a_decompression_bomb_is_skipped_and_the_limit_is_an_option(tmp_path):
    folder = tmp_path / "src" / "a"
    folder.mkdir(parents=True)
    buf = io.BytesIO()
    Image.new("1", (20000, 20000)).save(buf, format="PNG")  # 400 Mpx in 50 KB
    (folder / "bomb.png").write_bytes(buf.getvalue())
    (folder / "photo.jpg").write_bytes(jpeg_bytes(RGB))
    manifest = convert(tmp_path / "src", tmp_path / "out")
    assert manifest.skipped == [{"path": "a/bomb.png", "reason": "image larger than --max-pixels 300000000"}]
    assert manifest.num_samples("train") == 1

    small = convert(tmp_path / "src", tmp_path / "small", max_pixels=1000)
    assert {s["reason"] for s in small.skipped} == {"image larger than --max-pixels 1000"}
    assert Image.MAX_IMAGE_PIXELS == 89478485  # Pillow's own guard is back once conversion is done


def test_importing_dalifeed_changes_no_process_wide_state():
    script = """
import random, warnings, logging, numpy as np, torch, torchvision, PIL.Image, nvidia.dali, webdataset, click, tqdm
import nvidia.dali.plugin.pytorch
def state():
    return {"pil_max_pixels": PIL.Image.MAX_IMAGE_PIXELS, "warnings": list(warnings.filters),
            "np_err": np.geterr(), "np_print": np.get_printoptions(), "torch_threads": torch.get_num_threads(),
            "torch_dtype": str(torch.get_default_dtype()), "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "deterministic": torch.are_deterministic_algorithms_enabled(), "grad": torch.is_grad_enabled(),
            "logging": (logging.root.level, list(logging.root.handlers)), "random": random.getstate(),
            "np_random": np.random.get_state()[1].tolist(), "torch_rng": torch.get_rng_state().tolist()}
before = state()
import dalifeed, dalifeed.format, dalifeed.convert, dalifeed.convert.cli, dalifeed.convert.images, dalifeed.pipelines
import dalifeed.train, dalifeed.train.cli, dalifeed.bench.cli, dalifeed.bench.loaders, dalifeed.demo
after = state()
changed = sorted(k for k in before if before[k] != after[k])
print("CHANGED:" + ",".join(changed))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.strip().splitlines()[-1] == "CHANGED:", run.stdout
