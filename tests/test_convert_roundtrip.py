"""Shards read back exactly through plain webdataset and DALI's reader; indexes equal wds2idx's."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torchvision
import webdataset as wds
from click.testing import CliRunner

from dalifeed.convert import ShardManifest
from dalifeed.convert.cli import main as cli
from helpers import convert, write_imagefolder


def source_bytes(src: Path, meta: bytes) -> bytes:
    return (src / json.loads(meta)["path"]).read_bytes()


THREE_CLASSES = {"cat": 401, "dog": 333, "emu": 273}  # 1007 images: odd counts catch shard arithmetic off-by-ones


@pytest.fixture(scope="module")
def converted(make_shards) -> tuple[Path, ShardManifest]:
    src, shards = make_shards(THREE_CLASSES, samples_per_shard=100, workers=2)
    return src, ShardManifest.load(shards)


def test_manifest_counts_and_shard_arithmetic(converted):
    src, manifest = converted
    assert manifest.classes == ["cat", "dog", "emu"]
    assert manifest.num_samples("train") == 1007 == manifest.found
    shards = manifest.splits["train"].shards
    assert [s.samples for s in shards] == [100] * 10 + [7]
    assert [s.path for s in shards][:2] == ["train-000000.tar", "train-000001.tar"]
    assert all((manifest.root / s.path).stat().st_size == s.bytes for s in shards)
    reloaded = ShardManifest.load(manifest.root)
    assert reloaded.shard_paths("train") == manifest.shard_paths("train")
    assert reloaded.skipped == []


def test_plain_webdataset_reads_bytes_and_labels_exactly(converted):
    src, manifest = converted
    reference = torchvision.datasets.ImageFolder(str(src))
    expected_label = {Path(path).relative_to(src).as_posix(): label for path, label in reference.samples}
    assert reference.classes == manifest.classes

    urls = [str(p) for p in manifest.shard_paths("train")]
    seen = []
    for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
        meta = json.loads(sample["json"])
        assert sample["jpg"] == (src / meta["path"]).read_bytes()
        assert int(sample["cls"]) == expected_label[meta["path"]] == meta["label"]
        assert struct.unpack("<q", sample["cls.i64"])[0] == meta["label"]
        seen.append(meta["path"])
    assert sorted(seen) == sorted(expected_label)
    # written globally shuffled, not class by class
    first_hundred = [expected_label[p] for p in seen[:100]]
    assert len(set(first_hundred)) == 3


def test_webdataset_default_decoder_gives_int_class(converted):
    _, manifest = converted
    dataset = wds.WebDataset([str(manifest.shard_paths("train")[0])], shardshuffle=False).decode("pil")
    sample = next(iter(dataset))
    assert isinstance(sample["cls"], int)
    assert sample["jpg"].mode == "RGB"


def test_dali_reader_reads_bytes_and_labels_exactly(converted):
    from nvidia.dali import fn, pipeline_def, types

    src, manifest = converted
    batch = 53  # 1007 = 19 * 53

    @pipeline_def(batch_size=batch, num_threads=2, device_id=None)
    def read_all():
        jpg, label, meta = fn.readers.webdataset(
            paths=[str(p) for p in manifest.shard_paths("train")],
            index_paths=[str(p) for p in manifest.index_paths("train")],
            ext=["jpg", "cls.i64", "json"], dtypes=[types.UINT8, types.INT64, types.UINT8],
            name="Reader", random_shuffle=False,
        )
        return jpg, label, meta

    pipe = read_all()
    pipe.build()
    assert pipe.epoch_size("Reader") == 1007
    seen = set()
    for _ in range(1007 // batch):
        jpgs, labels, metas = pipe.run()
        for i in range(batch):
            meta = np.array(metas[i]).tobytes()
            assert np.array(jpgs[i]).tobytes() == source_bytes(src, meta)
            label = np.array(labels[i])
            assert label.dtype == np.int64 and label.shape == (1,)
            assert int(label[0]) == json.loads(meta)["label"]
            seen.add(json.loads(meta)["path"])
    assert len(seen) == 1007


def test_index_files_equal_wds2idx(converted, tmp_path):
    _, manifest = converted
    wds2idx = shutil.which("wds2idx") or str(Path(sys.executable).parent / "wds2idx")
    for tar, idx in list(zip(manifest.shard_paths("train"), manifest.index_paths("train")))[::5]:
        theirs = tmp_path / (tar.stem + ".theirs.idx")
        subprocess.run([wds2idx, str(tar), str(theirs)], check=True, capture_output=True)
        assert idx.read_bytes() == theirs.read_bytes()


def test_output_is_byte_identical_for_any_worker_count(small_imagefolder, tmp_path):
    one = convert(small_imagefolder, tmp_path / "w1", samples_per_shard=4, workers=1)
    two = convert(small_imagefolder, tmp_path / "w2", samples_per_shard=4, workers=2)
    names = sorted(p.name for p in one.root.iterdir() if p.suffix in (".tar", ".idx")) + ["manifest.json"]
    assert len(names) == 2 * 8 + 1  # 31 samples / 4 per shard
    for name in names:
        assert (one.root / name).read_bytes() == (two.root / name).read_bytes(), name


def test_different_seed_gives_different_order(small_imagefolder, tmp_path):
    def order(seed):
        m = convert(small_imagefolder, tmp_path / f"s{seed}", seed=seed)
        return [json.loads(s["json"])["path"] for s in wds.WebDataset([str(p) for p in m.shard_paths("train")],
                                                                       shardshuffle=False)]
    assert order(0) != order(1)
    assert sorted(order(0)) == sorted(order(1))


def test_train_and_val_folders_become_splits_with_train_class_indices(make_shards):
    _, shards = make_shards({"train": {"a": 5, "b": 6, "c": 4}, "val": {"a": 2, "c": 3}})  # val lacks class b
    manifest = ShardManifest.load(shards)
    assert manifest.num_samples("train") == 15 and manifest.num_samples("val") == 5
    labels = {}
    for s in wds.WebDataset([str(p) for p in manifest.shard_paths("val")], shardshuffle=False):
        meta = json.loads(s["json"])
        labels[meta["path"].split("/")[1]] = int(s["cls"])
    assert labels == {"a": 0, "c": 2}


def test_val_fraction_is_stratified_and_disjoint(small_imagefolder, tmp_path):
    manifest = convert(small_imagefolder, tmp_path / "out", val_fraction=0.3, seed=3)

    def paths(split):
        return [json.loads(s["json"])["path"] for s in
                wds.WebDataset([str(p) for p in manifest.shard_paths(split)], shardshuffle=False)]

    train, val = paths("train"), paths("val")
    assert not set(train) & set(val)
    assert len(train) + len(val) == 31
    per_class = {c: sum(p.startswith(c + "/") for p in val) for c in "abc"}
    assert per_class == {"a": round(13 * 0.3), "b": round(11 * 0.3), "c": round(7 * 0.3)}


def test_max_shard_bytes_bounds_every_shard(make_shards):
    limit = 64 * 1024
    manifest = ShardManifest.load(make_shards(THREE_CLASSES, max_shard_bytes=limit)[1])
    sizes = [s.bytes for s in manifest.splits["train"].shards]
    assert len(sizes) > 5
    # tar pads its end to a 10 KiB record, the only overshoot allowed
    assert max(sizes) <= limit + 10240
    assert sum(s.samples for s in manifest.splits["train"].shards) == 1007


def test_both_shard_limits_hold_and_an_oversized_sample_is_reported(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 20, "b": 21}, size=(64, 64))
    manifest = convert(src, tmp_path / "both", samples_per_shard=8, max_shard_bytes=12_000)
    shards = manifest.splits["train"].shards
    assert max(s.samples for s in shards) <= 8 and max(s.bytes for s in shards) <= 12_000 + 10240
    assert min(s.samples for s in shards) < 8  # the byte limit, not only the count, ended some shards
    tiny = convert(src, tmp_path / "tiny", max_shard_bytes=4096)
    assert (len(tiny.warnings) == 41 and "alone is" in tiny.warnings[0]
            and "over --max-shard-bytes 4096" in tiny.warnings[0])
    result = CliRunner().invoke(cli, ["info", str(tmp_path / "tiny")])
    assert "warning: train-000000.tar: sample" in result.output


def test_a_folder_of_format_1_is_refused_in_one_line_and_not_resumed(small_imagefolder, tmp_path):
    """Shards written before the members were renamed (`.label`, `.id`, ...): every reader says which folder and
    what to do, and a conversion into it neither resumes it nor calls it done."""
    from click.testing import CliRunner

    from dalifeed.convert import ManifestError
    from dalifeed.convert.cli import main as cli
    from dalifeed.pipelines import make_loader

    out = tmp_path / "old"
    convert(small_imagefolder, out)
    doc = json.loads((out / "manifest.json").read_text())
    doc["version"] = 1
    del doc["fingerprint"]["format_version"]  # as format 1 wrote it
    (out / "manifest.json").write_text(json.dumps(doc))
    message = f"{out}: shards of dalifeed format 1 (members .label/.id/.boxes ...), this dalifeed reads format 2: " \
              f"convert the source again with shard-convert (--overwrite to replace them)"
    with pytest.raises(ManifestError) as caught:
        ShardManifest.load(out)
    assert str(caught.value) == message
    with pytest.raises(ManifestError, match="format 1"):
        make_loader(out, "train", 4, device="cpu")
    verify = CliRunner().invoke(cli, ["verify", str(out)])
    assert verify.exit_code == 1 and verify.output.splitlines()[0] == message
    again = CliRunner().invoke(cli, ["imagefolder", str(small_imagefolder), str(out), "--quiet"])
    assert again.exit_code == 2
    assert "made with other input: shard format 1, this dalifeed writes 2; use --overwrite" in again.output
    assert convert(small_imagefolder, out, overwrite=True).num_samples("train") == 31
    assert json.loads((out / "manifest.json").read_text())["version"] == 2
