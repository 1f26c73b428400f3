"""Hugging Face `datasets` loads our shards with its own webdataset builder, the way its docs show
(`load_dataset("webdataset", data_files={"train": [tars]}, split="train")`): every image and label of an
ImageFolder tree with re-encoded files (PNG, CMYK, EXIF-rotated among passed-through JPEGs), and COCO
shards whose records and annotations vary in keys and types, checked against the sources (PIL,
torchvision's ImageFolder, pycocotools).

HF's builder names a column after everything that follows the key's first dot, decodes a member by its last
extension (`cls`, `id` -> int(), `json` -> json.loads), infers each column's type from the first 5 samples
of the first tar and casts every later sample to it."""

from __future__ import annotations

import io
import json
import struct
from pathlib import Path

import datasets
import numpy as np
import pytest
import torchvision
import webdataset as wds
from PIL import Image, ImageOps

from dalifeed.format import COCO_META, IMAGEFOLDER_META
from helpers import convert, gradient_image, jpeg_bytes, png_bytes, random_image, write_coco

HF_TYPES = {int: datasets.Value("int64"), str: datasets.Value("string")}
# source file -> why shard-convert re-encodes it ("" = passed through); written at the end of the class
# folders' sorted order, so that the seeded shuffle is free to put them anywhere
SPECIAL = {"pear/zz-drawing.png": "png", "pear/zz-cmyk.jpg": "cmyk-jpeg", "apple/zz-rotated.jpg": "exif-orientation",
           "apple/zz-progressive.jpg": "", "pear/zz-grey.jpg": ""}


def write_source(root: Path) -> Path:
    """Two classes of small JPEGs (sizes vary) and the special files of SPECIAL."""
    rng = np.random.default_rng(7)
    for label, (name, n) in enumerate((("apple", 19), ("pear", 14))):
        (root / name).mkdir(parents=True)
        for i in range(n):
            size = (20 + i % 5, 24 + i % 3)
            (root / name / f"{name}_{i:03d}.jpg").write_bytes(jpeg_bytes(random_image(rng, size, label)))
    picture = gradient_image(30, 26)  # smooth: re-encoded at q95 it stays within a few levels
    (root / "pear/zz-drawing.png").write_bytes(png_bytes(Image.fromarray(picture)))
    cmyk = io.BytesIO()
    Image.fromarray(picture).convert("CMYK").save(cmyk, format="JPEG", quality=95)
    (root / "pear/zz-cmyk.jpg").write_bytes(cmyk.getvalue())
    (root / "pear/zz-grey.jpg").write_bytes(jpeg_bytes(np.ascontiguousarray(picture[..., 0])))
    exif = Image.Exif()
    exif[0x0112] = 6  # shown turned a quarter: stored upright by shard-convert
    (root / "apple/zz-rotated.jpg").write_bytes(jpeg_bytes(gradient_image(22, 34), exif=exif.tobytes()))
    (root / "apple/zz-progressive.jpg").write_bytes(jpeg_bytes(random_image(rng, (25, 21), 0), progressive=True))
    return root


def load_webdataset(tars: list[Path], cache: Path, **options):
    """As HF's docs show, with the cache in the test's folder instead of ~/.cache."""
    return datasets.load_dataset("webdataset", data_files={"train": [str(t) for t in tars]}, split="train",
                                 cache_dir=str(cache), **options)


@pytest.fixture(scope="module")
def imagefolder_shards(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-imagefolder")
    src = write_source(tmp / "src")
    # seed 3 puts 5 passed-through images first, a re-encoded one sixth and two more in later shards
    manifest = convert(src, tmp / "shards", samples_per_shard=8, seed=3, workers=1)
    return src, manifest, load_webdataset(manifest.shard_paths("train"), tmp / "hf-cache")


def shard_members(manifest) -> dict[tuple[str, str], dict]:
    """(tar, key) -> the sample's members, read with webdataset: what the shards hold."""
    urls = [str(p) for p in manifest.shard_paths("train")]
    return {(s["__url__"], s["__key__"]): s for s in wds.WebDataset(urls, shardshuffle=False)}


def test_the_first_samples_hf_infers_from_are_passed_through(imagefolder_shards):
    """The case that broke: HF infers `reencoded` from the first 5 samples of the first tar; a re-encoded
    image after 5 passed-through ones (null then) could not be cast. If the write order changes, choose
    another seed in `imagefolder_shards` that keeps this true."""
    _, _, ds = imagefolder_shards
    reasons = [row["reencoded"] for row in ds["json"]]
    assert reasons[:5] == [""] * 5 and reasons[5] != "" and sum(r != "" for r in reasons[8:]) == 2, reasons


def test_hf_loads_imagefolder_shards_with_every_image_and_label(imagefolder_shards):
    src, manifest, ds = imagefolder_shards
    reference = torchvision.datasets.ImageFolder(str(src))
    expected_label = {Path(path).relative_to(src).as_posix(): label for path, label in reference.samples}
    assert "label" not in ds.column_names  # free for the usual rename
    ds = ds.rename_column("cls", "label")
    assert isinstance(ds.features["jpg"], datasets.Image) and ds.features["label"] == datasets.Value("int64")
    assert ds.features["json"] == {key: HF_TYPES[kind] for key, kind in IMAGEFOLDER_META.items()}
    assert ds.features["cls.i64"] == datasets.Value("binary")
    stored = shard_members(manifest)
    undecoded = ds.cast_column("jpg", datasets.Image(decode=False))
    seen = []
    for row, raw in zip(ds, undecoded):
        meta, path = row["json"], row["json"]["path"]
        assert row["label"] == expected_label[path] == meta["label"] == struct.unpack("<q", row["cls.i64"])[0]
        assert meta["class"] == reference.classes[row["label"]]
        assert meta["reencoded"] == SPECIAL.get(path, "")
        source = (src / path).read_bytes()
        if meta["reencoded"] == "":  # passed through: the source's bytes, PIL's pixels exactly
            assert raw["jpg"]["bytes"] == source
            np.testing.assert_array_equal(np.asarray(row["jpg"]), np.asarray(Image.open(io.BytesIO(source))))
        else:  # re-encoded: the shard's bytes, the source's picture at JPEG q95
            assert raw["jpg"]["bytes"] == stored[(row["__url__"], row["__key__"])]["jpg"]
            upright = ImageOps.exif_transpose(Image.open(io.BytesIO(source))).convert("RGB")
            pixels = np.asarray(row["jpg"].convert("RGB"), np.float32)
            assert pixels.shape == np.asarray(upright).shape, path
            assert np.abs(pixels - np.asarray(upright, np.float32)).mean() < 6, path
        seen.append(path)
    assert sorted(seen) == sorted(expected_label)


def test_hf_streams_imagefolder_shards(imagefolder_shards, tmp_path):
    """`streaming=True`, as the docs of most webdataset datasets on the Hub show: the same samples."""
    src, manifest, ds = imagefolder_shards
    streamed = load_webdataset(manifest.shard_paths("train"), tmp_path / "hf-cache", streaming=True)
    got = [(row["__key__"], row["cls"], row["json"]) for row in streamed]
    assert got == [(row["__key__"], row["cls"], row["json"]) for row in ds.select_columns(["__key__", "cls", "json"])]


@pytest.fixture(scope="module")
def coco_shards(tmp_path_factory):
    """tests/helpers.write_coco: RLE and polygon segmentations, int and float boxes, extra keys on some records
    and annotations, an image without annotations, a PNG."""
    tmp = tmp_path_factory.mktemp("hf-coco")
    images, instances = write_coco(tmp / "coco")
    manifest = convert(images, tmp / "shards", annotations=instances, workers=1, samples_per_shard=3)
    return instances, manifest, load_webdataset(manifest.shard_paths("mini"), tmp / "hf-cache")


def test_hf_loads_coco_shards_with_records_as_pycocotools_reads_them(coco_shards):
    from pycocotools.coco import COCO

    instances, manifest, ds = coco_shards
    coco = COCO(str(instances))
    ann_ids = [a["id"] for a in json.loads(instances.read_text())["annotations"]]
    repeated = {i for i in ann_ids if ann_ids.count(i) > 1}
    assert ds.features["json"] == {key: HF_TYPES[kind] for key, kind in COCO_META.items()}
    assert [ds.features[m] for m in ("boxes.f32", "labels.i32", "crowdboxes.f32", "crowdlabels.i32", "id.i64")] \
        == [datasets.Value("binary")] * 5
    category_ids = manifest.extra["coco"]["category_ids"]
    seen = []
    for row in ds:
        meta = row["json"]
        image_id = meta["image_id"]
        record = coco.imgs[image_id]
        assert struct.unpack("<q", row["id.i64"])[0] == image_id
        assert json.loads(meta["image_json"]) == record  # as given, extra keys too
        assert (meta["file_name"], meta["width"], meta["height"]) == (record["file_name"], record["width"],
                                                                      record["height"])
        assert meta["reencoded"] == ("png" if record["file_name"].endswith(".png") else "")
        annotations = json.loads(meta["annotations_json"])
        assert [a["id"] for a in annotations] == list(dict.fromkeys(coco.getAnnIds(imgIds=[image_id])))
        for a in annotations:
            if a["id"] not in repeated:  # pycocotools keeps the last of a repeated id, shard-convert the first
                assert a == coco.anns[a["id"]]
        boxes = np.frombuffer(row["boxes.f32"], "<f4").reshape(-1, 4)
        labels = np.frombuffer(row["labels.i32"], "<i4")
        assert len(boxes) == len(labels) and ((0 <= boxes) & (boxes <= 1)).all()
        assert {category_ids[i] for i in labels} <= {a["category_id"] for a in annotations}
        assert row["jpg"].size == (record["width"], record["height"])
        seen.append(image_id)
    assert sorted(seen) == sorted(set(coco.getImgIds()) - {4})  # 4: its file is missing


def test_webdataset_default_decoders_leave_the_binary_members_alone(imagefolder_shards, coco_shards):
    """webdataset's `.decode()` int()-parses `cls` and `id` by the last extension: the binary members' last
    extension (`i64`, `f32`, `i32`) is one it passes through as bytes."""
    _, manifest, _ = imagefolder_shards
    for s in wds.WebDataset([str(p) for p in manifest.shard_paths("train")], shardshuffle=False).decode("pil"):
        assert isinstance(s["cls"], int) and struct.unpack("<q", s["cls.i64"])[0] == s["cls"] == s["json"]["label"]
        assert isinstance(s["jpg"], Image.Image)
    _, manifest, _ = coco_shards
    for s in wds.WebDataset([str(p) for p in manifest.shard_paths("mini")], shardshuffle=False).decode("pil"):
        assert struct.unpack("<q", s["id.i64"])[0] == s["json"]["image_id"]
        assert len(s["boxes.f32"]) == 4 * len(s["labels.i32"])  # 16 bytes a box, 4 a label


def test_verify_names_a_json_that_breaks_the_same_keys_and_types_rule():
    """`verify` holds shards made elsewhere (or by format 1) to the rule HF needs, naming the key."""
    from dalifeed.convert.coco import check_coco_sample
    from dalifeed.convert.verify import check_class_labels

    meta = {"path": "a/x.jpg", "class": "a", "label": 1, "reencoded": None}
    members = {"jpg": b"", "cls": b"1", "cls.i64": struct.pack("<q", 1), "json": json.dumps(meta).encode()}
    assert check_class_labels("s", members, 3) == ["s: .json 'reencoded' is NoneType None, not str"]
    members["json"] = json.dumps({**meta, "reencoded": "", "extra": 1}).encode()
    assert check_class_labels("s", members, 3) == ["s: .json has key 'extra', which the format does not have"]
    record = {"id": 5, "file_name": "5.jpg", "width": 10, "height": 10}
    format_1 = {"image": record, "annotations": []}
    members = {"jpg": b"", "json": json.dumps(format_1).encode(), "boxes.f32": b"", "labels.i32": b"",
               "crowdboxes.f32": b"", "crowdlabels.i32": b"", "id.i64": struct.pack("<q", 5)}
    problems = check_coco_sample("s", members, {1: 0})
    assert len(problems) == 1 and "unreadable .json" in problems[0] and "has no key 'image_id'" in problems[0]
