"""`shard-convert tfrecord`: TFRecord files of tf.train.Examples, written here by code that is not ours
(TensorBoard's TFRecord writer for the framing, protobuf's own encoder for an Example built from the
descriptor of TensorFlow's example.proto), become shards whose JPEG bytes are the records' bytes, whose
classes are the sorted synsets, and which verify, plain webdataset and dali-train read."""

from __future__ import annotations

import gzip
import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from click.testing import CliRunner
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from PIL import Image
from tensorboard.summary.writer.record_writer import RecordWriter

import helpers
from dalifeed.convert.cli import main as shard_convert
from dalifeed.convert.shards import ConversionFailed
from dalifeed.convert.tfrecord import TFRecordConfig, convert_tfrecord, parse_example
from dalifeed.convert.verify import verify_shards
from dalifeed.format import ShardManifest
from dalifeed.runtime import FolderInUse
from fast_recipe import fast_args

# synsets deliberately not in sorted order: their labels below are those of the sorted order, 1-based
SYNSETS = ["n03000134", "n01440764", "n02102040"]
SORTED = sorted(SYNSETS)


def example_class():
    """tf.train.Example, from TensorFlow's feature.proto and example.proto field numbers, through protobuf."""
    f = descriptor_pb2.FileDescriptorProto(name="tfexample_for_tests.proto", package="tfx", syntax="proto3")
    T = descriptor_pb2.FieldDescriptorProto

    def message(name, *fields, nested=()):
        m = f.message_type.add(name=name) if not nested else nested[0].nested_type.add(name=name)
        for number, field_name, kind, label, type_name in fields:
            fld = m.field.add(name=field_name, number=number, type=kind, label=label)
            if type_name:
                fld.type_name = type_name
            if kind in (T.TYPE_FLOAT, T.TYPE_INT64) and label == T.LABEL_REPEATED:
                fld.options.packed = True
        return m

    rep, opt = T.LABEL_REPEATED, T.LABEL_OPTIONAL
    message("BytesList", (1, "value", T.TYPE_BYTES, rep, None))
    message("FloatList", (1, "value", T.TYPE_FLOAT, rep, None))
    message("Int64List", (1, "value", T.TYPE_INT64, rep, None))
    feature = message("Feature", (1, "bytes_list", T.TYPE_MESSAGE, opt, ".tfx.BytesList"),
                      (2, "float_list", T.TYPE_MESSAGE, opt, ".tfx.FloatList"),
                      (3, "int64_list", T.TYPE_MESSAGE, opt, ".tfx.Int64List"))
    feature.oneof_decl.add(name="kind")
    for fld in feature.field:
        fld.oneof_index = 0
    features = message("Features", (1, "feature", T.TYPE_MESSAGE, rep, ".tfx.Features.FeatureEntry"))
    entry = features.nested_type.add(name="FeatureEntry")
    entry.options.map_entry = True
    entry.field.add(name="key", number=1, type=T.TYPE_STRING, label=opt)
    entry.field.add(name="value", number=2, type=T.TYPE_MESSAGE, label=opt, type_name=".tfx.Feature")
    message("Example", (1, "features", T.TYPE_MESSAGE, opt, ".tfx.Features"))
    pool = descriptor_pool.DescriptorPool()
    pool.Add(f)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("tfx.Example"))


Example = example_class()


def example(**features) -> bytes:
    """A serialized Example: bytes/str values as bytes_list, ints as int64_list, floats as float_list."""
    ex = Example()
    for key, value in features.items():
        key = key.replace("__", "/")
        if isinstance(value, (bytes, str)):
            ex.features.feature[key].bytes_list.value.append(value.encode() if isinstance(value, str) else value)
        elif isinstance(value, float):
            ex.features.feature[key].float_list.value.append(value)
        else:
            ex.features.feature[key].int64_list.value.append(value)
    return ex.SerializeToString()


def write_records(path: Path, records: list[bytes], opener=open) -> Path:
    with opener(path, "wb") as f:
        writer = RecordWriter(f)
        for record in records:
            writer.write(record)
    return path


def imagenet_record(rng, synset: str, number: int, png: bool = False) -> tuple[bytes, bytes]:
    label = SORTED.index(synset)
    array = helpers.random_image(rng, (20 + number % 3, 24), label)
    image = helpers.png_bytes(Image.fromarray(array)) if png else helpers.jpeg_bytes(array)
    record = example(image__encoded=image, image__class__label=label + 1, image__class__synset=synset,
                     image__class__text=f"class {synset}", image__format="PNG" if png else "JPEG",
                     image__filename=f"{synset}_{number}.JPEG", image__height=array.shape[0],
                     image__width=array.shape[1])
    return record, image


@pytest.fixture(scope="module")
def imagenet(tmp_path_factory):
    """ImageNet as build_imagenet_data.py writes it: two train files, one validation file gzip-compressed,
    one PNG among the JPEGs, one record whose data is corrupted after writing; and what each record holds."""
    root = tmp_path_factory.mktemp("tfr") / "imagenet"
    root.mkdir()
    rng = np.random.default_rng(0)
    expected = {}  # filename -> (image bytes, synset)
    for name, n, opener in [("train-00000-of-00002", 7, open), ("train-00001-of-00002", 6, open),
                            ("validation-00000-of-00001", 5, gzip.open)]:
        records = []
        for i in range(n):
            synset, number = SYNSETS[(i + len(expected)) % 3], len(expected)
            record, image = imagenet_record(rng, synset, number, png=name.startswith("train-00001") and i == 2)
            records.append(record)
            expected[f"{synset}_{number}.JPEG"] = (image, synset)
        write_records(root / name, records, opener)
    # corrupt record 3 of the first train file: one byte of its image, so the data CRC fails
    path = root / "train-00000-of-00002"
    data = bytearray(path.read_bytes())
    offset = 0
    for _ in range(3):
        (length,) = struct.unpack("<Q", data[offset:offset + 8])
        offset += 12 + length + 4
    data[offset + 12 + 40] ^= 0xFF
    path.write_bytes(bytes(data))
    (root / "train-00000-of-00002.idx").write_text("0 100\n")  # DALI's tfrecord2idx output: not a record file
    (root / "README.txt").write_text("how these were made\n")
    return root, expected


def samples_of(out: Path) -> list[dict]:
    return list(wds.WebDataset(sorted(str(p) for p in out.glob("*.tar")), shardshuffle=False, empty_check=False))


def test_imagenet_tfrecords_become_shards_with_the_records_bytes_and_sorted_synsets(imagenet, tmp_path):
    src, expected = imagenet
    out = tmp_path / "shards"
    result = CliRunner().invoke(shard_convert, ["tfrecord", str(src), str(out), "--workers", "2"])
    assert result.exit_code == 0, result.output
    assert "Converted 17 of 19 records into 2 shards" in result.output
    manifest = ShardManifest.load(out)
    assert manifest.kind == "tfrecord" and manifest.classes == SORTED
    assert manifest.splits["train"].samples == 12 and manifest.splits["val"].samples == 5
    assert manifest.extra["tfrecord"]["label_offset"] == -1  # the files' labels are 1-based
    skipped = {s["path"]: s["reason"] for s in manifest.skipped}
    assert skipped["train-00000-of-00002 record 3"] == "data CRC mismatch (corrupt record)"
    assert "not named like a split's file" in skipped["README.txt"]
    assert manifest.found == 7 + 6 + 5 + 1 and len(skipped) == 2
    seen = set()
    for sample in samples_of(out):
        meta = json.loads(sample["json"])
        image, synset = expected[meta["filename"]]
        assert meta["class"] == synset and int(sample["cls"]) == SORTED.index(synset) == meta["label"]
        assert struct.unpack("<q", sample["cls.i64"])[0] == meta["label"]
        if meta["reencoded"]:
            assert meta["reencoded"] == "png" and meta["path"] == "train-00001-of-00002"
            got = np.asarray(Image.open(io.BytesIO(sample["jpg"])), np.float32)
            assert np.abs(got - np.asarray(Image.open(io.BytesIO(image)).convert("RGB"), np.float32)).mean() < 8
        else:
            assert sample["jpg"] == image  # byte for byte
        seen.add((meta["path"], meta["record"]))
    assert len(seen) == 17 and ("train-00000-of-00002", 3) not in seen
    assert ("validation-00000-of-00001", 4) in seen  # read through the gzip stream
    report = verify_shards(out, decode=True)
    assert report.ok, report.problems
    again = tmp_path / "again"
    convert_tfrecord(TFRecordConfig(src=src, out=again, workers=1, progress=False))
    helpers.assert_same_folder(out, again)  # deterministic, whatever the workers
    assert not list(Path(__import__("tempfile").gettempdir(), "dalifeed-inflated").glob("*.tfrecord"))


def test_dali_train_trains_on_converted_tfrecords(imagenet, tmp_path):
    src, _ = imagenet
    out = tmp_path / "shards"
    convert_tfrecord(TFRecordConfig(src=src, out=out, progress=False))
    from dalifeed.train.cli import main as train_cli

    run = tmp_path / "run"
    result = CliRunner().invoke(train_cli, ["--data", str(out), "--out", str(run), "--epochs", "1",
                                            *fast_args(width=16, batch_size=4)])
    assert result.exit_code == 0, result.output
    record = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    from dalifeed.train import checkpoint

    assert record["val_samples"] == 5 and checkpoint.load(run / "last.pt")["classes"] == SORTED


def test_labels_without_synsets_a_second_layout_zlib_and_one_split(tmp_path):
    """tfds-style records (`image`, `label`, 0-based, no synsets) in a zlib file of any name: --split names
    the split, --image-feature and --label-feature the features; a label made negative by --label-offset is
    a skipped record, not a crash."""
    rng = np.random.default_rng(1)
    images = [helpers.jpeg_bytes(helpers.random_image(rng, (16, 16), i % 2)) for i in range(6)]
    records = [example(image=img, label=i % 2 + 1, id=float(i)) for i, img in enumerate(images)]
    records.append(example(image=images[0], label=0))
    plain = write_records(tmp_path / "plain.bin", records)
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "mydata.tfrecord.zz").write_bytes(zlib.compress(plain.read_bytes()))
    out = tmp_path / "out"
    result = CliRunner().invoke(shard_convert, ["tfrecord", str(tmp_path / "src"), str(out), "--split", "train",
                                                "--image-feature", "image", "--label-feature", "label",
                                                "--label-offset", "-1", "--workers", "1"])
    assert result.exit_code == 0, result.output
    manifest = ShardManifest.load(out)
    assert manifest.classes == ["0", "1"] and manifest.splits["train"].samples == 6
    assert manifest.skipped == [{"path": "mydata.tfrecord.zz record 6",
                                 "reason": "label 0 + --label-offset -1 is negative"}]
    by_record = {json.loads(s["json"])["record"]: s for s in samples_of(out)}
    assert {r: int(s["cls"]) for r, s in by_record.items()} == {i: i % 2 for i in range(6)}
    assert all(by_record[i]["jpg"] == images[i] for i in range(6))
    assert json.loads(by_record[0]["json"])["filename"] == ""
    assert verify_shards(out).ok


def test_labels_that_disagree_with_the_synsets_order_stop_the_conversion(tmp_path):
    rng = np.random.default_rng(2)
    records = [imagenet_record(rng, s, i)[0] for i, s in enumerate(SORTED)]
    records.append(example(image__encoded=helpers.jpeg_bytes(helpers.random_image(rng)), image__class__label=1,
                           image__class__synset=SORTED[2]))  # 1-based would be 3
    write_records(tmp_path / "train-00000-of-00001", records)
    result = helpers.shard_convert("tfrecord", tmp_path / "train-00000-of-00001", tmp_path / "out")
    assert result.returncode == 1, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "train-00000-of-00001 record 3: image/class/label 1 for synset n03000134" in errors[0]
    assert "Traceback" not in result.stderr and "please report" not in result.stderr


def test_a_broken_length_loses_the_rest_of_its_file_and_says_so(tmp_path):
    rng = np.random.default_rng(3)
    path = write_records(tmp_path / "train-0", [imagenet_record(rng, s, i)[0] for i, s in enumerate(SORTED)])
    data = bytearray(path.read_bytes())
    (first,) = struct.unpack("<Q", data[:8])
    data[12 + first + 4] ^= 0x01  # record 1's length
    path.write_bytes(bytes(data) + b"\0\0")
    out = tmp_path / "out"
    convert_tfrecord(TFRecordConfig(src=path, out=out, workers=1, progress=False))
    manifest = ShardManifest.load(out)
    assert manifest.splits["train"].samples == 1 and manifest.found == 2
    (skip,) = manifest.skipped
    assert skip["path"] == "train-0 record 1" and skip["reason"].startswith("length CRC mismatch at byte")
    assert f"({len(data) + 2 - 12 - first - 4} bytes) cannot be framed" in skip["reason"]


def test_every_gzip_member_is_read_and_what_is_not_is_said(tmp_path):
    """A file of two gzip members (as `cat a.gz b.gz` makes, and `gzip -d` reads whole) gives both members'
    records; bytes after the last stream that start no other one are a skipped entry; a record whose
    float list holds a varint is one skipped record, not a failed run."""
    rng = np.random.default_rng(4)
    records = [imagenet_record(rng, s, i)[0] for i, s in enumerate(SORTED * 2)]
    odd = Example()
    odd.features.feature["image/encoded"].bytes_list.value.append(b"x")
    data = bytearray(odd.SerializeToString())
    bad = bytes(data) + b"\x0a\x0b\x0a\x09\x0a\x01z\x12\x04\x12\x02\x08\x01"  # feature z: float list of varints
    plain = [write_records(tmp_path / f"part{i}", part).read_bytes() for i, part in
             enumerate([records[:4], records[4:] + [bad]])]
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train-0.gz").write_bytes(gzip.compress(plain[0]) + gzip.compress(plain[1]))
    (tmp_path / "src" / "train-1.gz").write_bytes(gzip.compress(plain[0]) + b"not a stream")
    out = tmp_path / "out"
    convert_tfrecord(TFRecordConfig(src=tmp_path / "src", out=out, workers=1, progress=False))
    manifest = ShardManifest.load(out)
    assert manifest.splits["train"].samples == 6 + 4
    skipped = {s["path"]: s["reason"] for s in manifest.skipped}
    assert skipped["train-0.gz record 6"].startswith("not a tf.train.Example: a float list holds a value of wire")
    assert skipped["train-1.gz record 4"] == ("gzip file: 12 bytes after the compressed stream start no other stream: "
                                             "the records after it are lost")


def test_usage_errors_are_one_line(tmp_path):
    (tmp_path / "src").mkdir()
    write_records(tmp_path / "src" / "shard0", [example(image__encoded=b"x", image__class__label=1)])
    result = helpers.shard_convert("tfrecord", tmp_path / "src", tmp_path / "out")
    assert result.returncode == 2 and "give --split NAME" in result.stderr
    bad_split = helpers.shard_convert("tfrecord", tmp_path / "src", tmp_path / "out", "--split", "a/b")
    assert bad_split.returncode == 2 and "--split 'a/b': not a split name" in bad_split.stderr
    missing = helpers.shard_convert("tfrecord", tmp_path / "nope", tmp_path / "out")
    assert missing.returncode == 2 and "source does not exist" in missing.stderr


def test_parse_example_reads_what_protobuf_wrote():
    data = example(a=b"\x00\xff", b=-3, c=1.5, d="n01")
    features = parse_example(data)
    assert features["b"].values == (-3,) and features["c"].values == (1.5,) and features["b"].kind == "int64"
    start, end = features["a"].values[0]
    assert data[start:end] == b"\x00\xff"
    ex = Example()
    ex.features.feature["many"].int64_list.value.extend([1, 2**40, -1])
    assert parse_example(ex.SerializeToString())["many"].values == (1, 2**40, -1)


# --- TensorFlow Datasets folders ------------------------------------------------------------------------------

TFDS_NAMES = ["zebra", "cat", "dog"]  # ClassLabel's names in label order, not sorted


def write_tfds_folder(root: Path, files: dict[str, list[int]], shard_lengths: dict[str, list[int]] | None = None):
    """A folder as TensorFlow Datasets 4.9 writes `test_photos` 1.0.0: records of features `image` (an Image,
    encoded bytes) and `label` (a ClassLabel, int64) in `<dataset>-<split>.tfrecord-NNNNN-of-NNNNN`;
    features.json as FeatureConnector.save_config writes it (the Feature proto through MessageToDict, indent
    4), label.labels.txt as ClassLabel.save_metadata does ("\\n".join(names) + "\\n"), dataset_info.json as
    DatasetInfo.write_to_directory does (MessageToJson, sort_keys, int64 as strings). `files` maps each file
    name to its records' labels; returns {file name: [image bytes]}."""
    root.mkdir(parents=True)
    rng = np.random.default_rng(7)
    images = {}
    for name, labels in files.items():
        images[name] = [helpers.jpeg_bytes(helpers.random_image(rng, (18, 22), label)) for label in labels]
        write_records(root / name, [example(image=img, label=label) for img, label in zip(images[name], labels)])
    features = {"pythonClassName": "tensorflow_datasets.core.features.features_dict.FeaturesDict",
                "featuresDict": {"features": {
                    "image": {"pythonClassName": "tensorflow_datasets.core.features.image_feature.Image",
                              "image": {"shape": {"dimensions": ["-1", "-1", "3"]}, "dtype": "uint8",
                                        "encodingFormat": "jpeg"}},
                    "label": {"pythonClassName": "tensorflow_datasets.core.features.class_label_feature.ClassLabel",
                              "classLabel": {"numClasses": str(len(TFDS_NAMES))}}}}}
    (root / "features.json").write_text(json.dumps(features, indent=4))
    (root / "label.labels.txt").write_text("\n".join(TFDS_NAMES) + "\n")
    if shard_lengths is None:
        shard_lengths = {}
        for name, labels in sorted(files.items()):
            shard_lengths.setdefault(name.split("-")[1].split(".")[0], []).append(len(labels))
    splits = [{"filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}", "name": split,
               "numBytes": "1000", "shardLengths": [str(n) for n in lengths]}
              for split, lengths in shard_lengths.items()]
    info = {"citation": "", "description": "Photos for tests.", "fileFormat": "tfrecord",
            "moduleName": "test_photos.test_photos_dataset_builder", "name": "test_photos",
            "releaseNotes": {"1.0.0": "Initial release."}, "splits": splits, "version": "1.0.0"}
    (root / "dataset_info.json").write_text(json.dumps(info, indent=2, sort_keys=True))
    return images


TFDS_FILES = {"test_photos-train.tfrecord-00000-of-00002": [0, 1, 2, 1, 0],
              "test_photos-train.tfrecord-00001-of-00002": [2, 2, 1, 0],
              "test_photos-test.tfrecord-00000-of-00001": [1, 0, 2]}


def test_a_tensorflow_datasets_folder_converts_to_its_splits_with_its_class_names(tmp_path):
    """A dataset whose name starts with a split word (`test_photos`): the split is the part after it; no
    --image-feature or --label-feature needed; TFDS's metadata files are neither records nor skipped."""
    src = tmp_path / "test_photos" / "1.0.0"
    images = write_tfds_folder(src, TFDS_FILES)
    out = tmp_path / "out"
    result = CliRunner().invoke(shard_convert, ["tfrecord", str(src), str(out), "--workers", "1"])
    assert result.exit_code == 0, result.output
    manifest = ShardManifest.load(out)
    assert manifest.splits["train"].samples == 9 and manifest.splits["test"].samples == 3
    assert manifest.classes == TFDS_NAMES and manifest.skipped == [] and manifest.found == 12
    assert manifest.warnings == []
    assert manifest.extra["tfrecord"]["classes_from"] == "label.labels.txt"
    assert manifest.extra["tfrecord"]["tfds_metadata"] == ["features.json", "dataset_info.json", "label.labels.txt"]
    for sample in samples_of(out):
        meta = json.loads(sample["json"])
        label = TFDS_FILES[meta["path"]][meta["record"]]
        assert int(sample["cls"]) == meta["label"] == label and meta["class"] == TFDS_NAMES[label]
        assert sample["jpg"] == images[meta["path"]][meta["record"]]
        assert meta["path"].startswith(f"test_photos-{Path(sample['__url__']).name.split('-')[0]}.tfrecord-")
    assert "Features read: image and label (TensorFlow Datasets' features.json)" in result.stdout
    info = CliRunner().invoke(shard_convert, ["info", str(out)]).stdout
    assert "image-feature image, label-feature label," in info and "image/encoded" not in info
    as_json = json.loads(CliRunner().invoke(shard_convert, ["info", str(out), "--json"]).stdout)
    assert (as_json["options"]["image_feature"], as_json["options"]["label_feature"]) == ("image", "label")

    merged = helpers.shard_convert("tfrecord", src, tmp_path / "merged", "--split", "train")
    assert merged.returncode == 2 and not (tmp_path / "merged" / "manifest.json").exists()
    (line,) = [x for x in merged.stderr.splitlines() if x.startswith("Error")]
    assert ("--split train would merge the files of 2 splits (test_photos-test.tfrecord-00000-of-00001 is test, "
            "test_photos-train.tfrecord-00000-of-00002 is train)") in line

    info = json.loads((src / "dataset_info.json").read_text())
    info["splits"][0]["shardLengths"] = ["4"]  # test's one file: 3 records written
    (src / "dataset_info.json").write_text(json.dumps(info, indent=2, sort_keys=True))
    (src / "test_photos-train.tfrecord-00001-of-00002").unlink()
    convert_tfrecord(TFRecordConfig(src=src, out=tmp_path / "counted", workers=1, progress=False))
    assert ShardManifest.load(tmp_path / "counted").warnings == [
        "test_photos-test.tfrecord-00000-of-00001: 3 records, dataset_info.json says 4",
        "split train: 1 of its 2 files are not here (shards 1; 4 records per dataset_info.json)"]


def test_two_splits_of_one_meaning_are_refused_not_merged(tmp_path):
    """TFDS's `validation` and `dev` (or ImageNet-style `train-*` and `training-*`) are both one split here:
    the run stops naming the two files, with or without --split; each converts from a folder of its own."""
    src = tmp_path / "test_photos" / "1.0.0"
    files = {"test_photos-train.tfrecord-00000-of-00001": [0, 1, 2],
             "test_photos-validation.tfrecord-00000-of-00001": [2, 1],
             "test_photos-dev.tfrecord-00000-of-00001": [0, 2, 1]}
    write_tfds_folder(src, files)

    def stderr_of(*args):
        result = CliRunner().invoke(shard_convert, ["tfrecord", str(src), str(tmp_path / "out"), "--quiet", *args])
        assert result.exit_code == 2 and not (tmp_path / "out" / "manifest.json").exists(), result.output
        (line,) = [x for x in result.stderr.splitlines() if x.startswith("Error")]
        return line

    assert stderr_of().startswith(
        "Error: test_photos-dev.tfrecord-00000-of-00001 is split dev and test_photos-validation.tfrecord-00000-of-"
        "00001 is split validation, both val here: their records would be merged; keep one of the two splits' files "
        "in SRC, or convert each into its own OUT")
    assert ("--split val would merge the files of 3 splits (test_photos-dev.tfrecord-00000-of-00001 is dev, "
            "test_photos-train.tfrecord-00000-of-00001 is train, test_photos-validation.tfrecord-00000-of-00001 is "
            "validation)") in stderr_of("--split", "val")
    (src / "test_photos-train.tfrecord-00000-of-00001").unlink()
    assert "would merge the files of 2 splits" in stderr_of("--split", "val")

    dev = tmp_path / "dev"
    dev.mkdir()
    for name in ("test_photos-dev.tfrecord-00000-of-00001", "features.json", "label.labels.txt", "dataset_info.json"):
        (src / name).rename(dev / name)
    manifest = convert_tfrecord(TFRecordConfig(src=dev, out=tmp_path / "dev-out", workers=1, progress=False))
    assert {name: s.samples for name, s in manifest.splits.items()} == {"val": 3} and manifest.warnings == []

    imagenet = tmp_path / "imagenet"
    imagenet.mkdir()
    for name in ("train-00000-of-00001", "training-00000-of-00001"):
        write_records(imagenet / name, [example(image__encoded=b"x", image__class__label=1)])
    result = CliRunner().invoke(shard_convert, ["tfrecord", str(imagenet), str(tmp_path / "out"), "--quiet"])
    assert result.exit_code == 2 and ("Error: train-00000-of-00001 is split train and training-00000-of-00001 is "
                                      "split training, both train here") in result.stderr

    (imagenet / "training-00000-of-00001").unlink()
    (imagenet / "train_labels.txt").write_text("n01440764\n")  # a note beside the records names no split's records
    result = CliRunner().invoke(shard_convert, ["tfrecord", str(imagenet), str(tmp_path / "out2"), "--quiet"])
    assert "both train here" not in result.stderr and "would be merged" not in result.stderr


@pytest.fixture
def own_tmpdir(tmp_path, monkeypatch) -> Path:
    """$TMPDIR for this test alone: where compressed input is inflated."""
    tmp = tmp_path / "tmpdir"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(__import__("tempfile"), "tempdir", str(tmp))
    return tmp


def test_a_failed_conversion_leaves_no_inflated_copy_and_a_stopped_one_says_where_it_is(tmp_path, own_tmpdir,
                                                                                           monkeypatch):
    rng = np.random.default_rng(8)
    records = [imagenet_record(rng, s, i)[0] for i, s in enumerate(SORTED)]
    records.append(example(image__encoded=b"x", image__class__label=1, image__class__synset=SORTED[2]))
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "train-00000-of-00001").write_bytes(gzip.compress(write_records(tmp_path / "p", records)
                                                                          .read_bytes()))
    result = helpers.shard_convert("tfrecord", tmp_path / "src", tmp_path / "out", env={**__import__("os").environ,
                                                                                        "TMPDIR": str(own_tmpdir)})
    assert result.returncode == 1 and "one synset, two labels" in result.stderr
    assert list(own_tmpdir.rglob("*")) == []

    from dalifeed.convert import tfrecord
    from dalifeed.runtime import Stopped

    write_records(tmp_path / "src" / "train-00000-of-00001", records[:3], gzip.open)
    holder = helpers.hold_lock(tmp_path / "out")  # the same command, running: the copies are the ones it reads
    try:
        with pytest.raises(FolderInUse):
            convert_tfrecord(TFRecordConfig(src=tmp_path / "src", out=tmp_path / "out", workers=1, progress=False))
    finally:
        holder.kill()
        holder.wait()
    (copy,) = own_tmpdir.glob("dalifeed-inflated/*.tfrecord")

    def stopped(plan, cfg, command):  # as a SIGTERM finds it: a worker killed while inflating another file
        (copy.parent / f".{copy.name}.12345.tmp").write_bytes(b"half")
        raise Stopped(__import__("signal").SIGTERM)

    monkeypatch.setattr(tfrecord, "convert", stopped)
    with pytest.raises(Stopped) as info:
        convert_tfrecord(TFRecordConfig(src=tmp_path / "src", out=tmp_path / "out", workers=1, progress=False))
    (kept,) = own_tmpdir.glob("dalifeed-inflated/*.tfrecord")
    assert sorted(p.name for p in kept.parent.iterdir()) == [kept.name]  # no half-written copy
    assert info.value.__notes__ == [f"the inflated copies of its 1 compressed files are kept for the resume: "
                                    f"{kept.stat().st_size / 2**20:.1f} MiB in {kept.parent} (removed when the "
                                    f"conversion finishes)"]


def imagenet_subset(root: Path, synsets: list[str], damaged_synset: str | None = None) -> Path:
    """ImageNet's layout (1-based labels of all three SORTED synsets) with records of `synsets` only, and
    one damaged record (its image's bytes, after writing: a data CRC mismatch) of `damaged_synset`."""
    rng = np.random.default_rng(9)
    records = [imagenet_record(rng, s, i)[0] for i, s in enumerate(synsets * 2)]
    image = b""
    if damaged_synset:
        record, image = imagenet_record(rng, damaged_synset, 99)
        records.append(record)
    path = write_records(root / "train-00000-of-00001", records)
    if damaged_synset:
        data = bytearray(path.read_bytes())
        data[data.rfind(image) + len(image) // 2] ^= 0xFF
        path.write_bytes(bytes(data))
    return path


def test_a_missing_class_is_named_with_the_damaged_records_that_carried_it(tmp_path):
    src = imagenet_subset(tmp_path, [SORTED[0], SORTED[2]], damaged_synset=SORTED[1])
    with pytest.raises(ConversionFailed, match=(
            r"^classes missing: no record has image/class/label 2 \(the labels go 1..3 over 2 synsets\); damaged "
            rf"records carried them: train-00000-of-00001 record 4 \({SORTED[1]}: data CRC mismatch \(corrupt "
            r"record\)\); .* give --synsets-file FILE .* or --synset-feature '' --label-offset -1 ")):
        convert_tfrecord(TFRecordConfig(src=src, out=tmp_path / "out", workers=1, progress=False))
    synsets = tmp_path / "LOC_synset_mapping.txt"
    synsets.write_text("".join(f"{s} class {s}\n" for s in SORTED))
    out = tmp_path / "all"
    convert_tfrecord(TFRecordConfig(src=src, out=out, synsets_file=synsets, workers=1, progress=False))
    manifest = ShardManifest.load(out)
    assert manifest.classes == SORTED and manifest.extra["tfrecord"]["label_offset"] == -1
    assert {json.loads(s["json"])["class"]: int(s["cls"]) for s in samples_of(out)} == {SORTED[0]: 0, SORTED[2]: 2}
    assert manifest.warnings == [f"1 of the 3 synsets of {synsets} have no record: {SORTED[1]}; damaged records "
                                 f"carried them: train-00000-of-00001 record 4 ({SORTED[1]}: data CRC mismatch "
                                 f"(corrupt record))"]


def test_a_missing_first_class_never_shifts_every_label(tmp_path):
    src = imagenet_subset(tmp_path, SORTED[1:])
    result = helpers.shard_convert("tfrecord", src, tmp_path / "out", "--quiet")
    assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"Error: classes missing: the first sorted synset, {SORTED[1]}, has "
                                    f"image/class/label 2, so no record has a label below it; ")
    assert "--label-offset -2 to number them from 0 anyway" in result.stderr
    convert_tfrecord(TFRecordConfig(src=src, out=tmp_path / "out", label_offset=-2, workers=1, progress=False))
    assert ShardManifest.load(tmp_path / "out").classes == SORTED[1:]


def test_a_0_based_file_whose_first_class_was_lost_to_damage_is_warned_of(tmp_path):
    """0-based labels with the first synset's one record damaged read as ImageNet's 1-based labels (offset 1):
    the damaged record, carrying label 0, is the one sign; the manifest says it, and --synsets-file corrects it."""
    rng = np.random.default_rng(11)
    images = [helpers.jpeg_bytes(helpers.random_image(rng, (19, 23), i)) for i in range(5)]
    synsets = [SORTED[1], SORTED[2], SORTED[1], SORTED[2], SORTED[0]]
    path = write_records(tmp_path / "train-00000-of-00001", [
        example(image__encoded=img, image__class__label=SORTED.index(s), image__class__synset=s)
        for img, s in zip(images, synsets)])
    data = bytearray(path.read_bytes())
    data[data.rfind(images[4]) + len(images[4]) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    manifest = convert_tfrecord(TFRecordConfig(src=path, out=tmp_path / "out", workers=1, progress=False))
    assert manifest.classes == SORTED[1:] and manifest.extra["tfrecord"]["label_offset"] == -1
    assert manifest.warnings == [
        f"train-00000-of-00001 record 4 ({SORTED[0]}: data CRC mismatch (corrupt record)), damaged, carries a class "
        f"before {SORTED[1]} (the first synset with a record, image/class/label 1): if the labels are 0-based, that "
        f"class was lost to damage and every class index here is one below the file's label; then give "
        f"--synsets-file FILE (every synset, one a line) or --synset-feature '' --label-offset 0"]
    listed = tmp_path / "synsets.txt"
    listed.write_text("\n".join(SORTED) + "\n")
    fixed = convert_tfrecord(TFRecordConfig(src=path, out=tmp_path / "fixed", synsets_file=listed, workers=1,
                                            progress=False))
    assert fixed.classes == SORTED and fixed.extra["tfrecord"]["label_offset"] == 0
    assert {json.loads(s["json"])["class"]: int(s["cls"]) for s in samples_of(tmp_path / "fixed")} == {
        SORTED[1]: 1, SORTED[2]: 2}


def test_the_small_edges_each_have_their_line(tmp_path):
    """A 0-byte file beside a good one, a text file whose first two bytes ("x^") are a zlib header, an Example
    whose image is empty: each a skipped entry saying what it is; --quiet leaves stderr empty."""
    rng = np.random.default_rng(10)
    (tmp_path / "src").mkdir()
    good = [imagenet_record(rng, s, i)[0] for i, s in enumerate(SORTED)]
    write_records(tmp_path / "src" / "train-00000-of-00003", [*good, example(image__encoded=b"",
                                                                              image__class__label=1,
                                                                              image__class__synset=SORTED[0])])
    (tmp_path / "src" / "train-00001-of-00003").write_bytes(b"")
    (tmp_path / "src" / "train-00002-of-00003").write_text("x^2 + y^2 = z^2\n")
    result = CliRunner().invoke(shard_convert, ["tfrecord", str(tmp_path / "src"), str(tmp_path / "out"),
                                                "--workers", "1", "--quiet"])
    assert result.exit_code == 0 and result.stderr == "", result.output
    skipped = {s["path"]: s["reason"] for s in ShardManifest.load(tmp_path / "out").skipped}
    assert skipped == {
        "train-00000-of-00003 record 3": "empty image feature (image/encoded holds 0 bytes)",
        "train-00001-of-00003": "empty file (0 bytes)",
        "train-00002-of-00003 record 0": "not a TFRecord file (its first bytes frame no record and start no gzip "
                                         "or zlib stream)"}


def test_several_image_and_class_label_features_are_told_apart_by_supervised_keys(tmp_path):
    """cifar100's label and coarse_label, oxford_iiit_pet's image and segmentation_mask: dataset_info.json's
    supervisedKeys (TFDS 4.9's tuple form, or the older input/output) says which; without it the run is
    refused naming both, as is a feature features.json does not have. The older features.json form
    ({"type", "content"}) is read too."""
    from dalifeed.convert.options import UsageError

    src = tmp_path / "pets" / "1.0.0"
    src.mkdir(parents=True)
    rng = np.random.default_rng(11)
    images = [helpers.jpeg_bytes(helpers.random_image(rng, (14, 18), i % 3)) for i in range(5)]
    write_records(src / "pets-train.tfrecord-00000-of-00001",
                  [example(image=img, mask=helpers.png_bytes(Image.new("L", (18, 14), i)), label=i % 3,
                           species=i % 2, file_name=f"{i}.jpg") for i, img in enumerate(images)])
    tfds_cls = "tensorflow_datasets.core.features."
    image = {"pythonClassName": f"{tfds_cls}image_feature.Image", "image": {"dtype": "uint8"}}

    def label(n):
        return {"pythonClassName": f"{tfds_cls}class_label_feature.ClassLabel", "classLabel": {"numClasses": str(n)}}

    features = {"pythonClassName": f"{tfds_cls}features_dict.FeaturesDict", "featuresDict": {"features": {
        "file_name": {"pythonClassName": f"{tfds_cls}text_feature.Text", "text": {}}, "image": image,
        "label": label(3), "mask": image, "species": label(2)}}}
    (src / "features.json").write_text(json.dumps(features, indent=4, sort_keys=True))
    (src / "label.labels.txt").write_text("abyssinian\nbengal\nbirman\n")
    (src / "species.labels.txt").write_text("cat\ndog\n")
    (src / "LICENSE").write_text("CC BY-SA 4.0\n")
    info = {"fileFormat": "tfrecord", "name": "pets", "version": "1.0.0", "splits": [
        {"filepathTemplate": "{DATASET}-{SPLIT}.{FILEFORMAT}-{SHARD_X_OF_Y}", "name": "train", "numBytes": "900",
         "shardLengths": ["5"]}]}
    (src / "dataset_info.json").write_text(json.dumps(info, indent=2, sort_keys=True))
    with pytest.raises(UsageError, match=r"features.json: 2 Image features \(image, mask\) and dataset_info.json's "
                                         r"supervisedKeys names none: give --image-feature NAME$"):
        convert_tfrecord(TFRecordConfig(src=src, out=tmp_path / "refused", workers=1, progress=False))
    with pytest.raises(UsageError, match=r"^--label-feature lable: .*features.json has no such feature \(its "
                                         r"features: file_name, image, label, mask, species\)$"):
        convert_tfrecord(TFRecordConfig(src=src, out=tmp_path / "refused", image_feature="image",
                                        label_feature="lable", workers=1, progress=False))

    for keys in ({"tuple": {"items": [{"featureKey": "image"}, {"featureKey": "label"}]}},
                 {"input": "image", "output": "label"}):
        (src / "dataset_info.json").write_text(json.dumps({**info, "supervisedKeys": keys}, indent=2))
        out = tmp_path / f"out{len(keys)}"
        convert_tfrecord(TFRecordConfig(src=src, out=out, workers=1, progress=False))
        manifest = ShardManifest.load(out)
        assert manifest.classes == ["abyssinian", "bengal", "birman"] and manifest.skipped == []
        assert manifest.extra["tfrecord"]["tfds_metadata"] == ["features.json", "dataset_info.json",
                                                               "label.labels.txt", "species.labels.txt", "LICENSE"]
        assert sorted(s["jpg"] for s in samples_of(out)) == sorted(images)

    legacy = {"type": f"{tfds_cls}features_dict.FeaturesDict", "content": {
        "image": {"type": f"{tfds_cls}image_feature.Image", "content": {"shape": [None, None, 3], "dtype": "uint8"}},
        "mask": {"type": f"{tfds_cls}image_feature.Image", "content": {"shape": [None, None, 1], "dtype": "uint8"}},
        "species": {"type": f"{tfds_cls}class_label_feature.ClassLabel", "content": {"num_classes": 2}}}}
    (src / "features.json").write_text(json.dumps(legacy, indent=4))
    out = tmp_path / "legacy"
    convert_tfrecord(TFRecordConfig(src=src, out=out, label_feature="species", workers=1, progress=False))
    assert ShardManifest.load(out).classes == ["cat", "dog"]
    assert {json.loads(s["json"])["class"] for s in samples_of(out)} == {"cat", "dog"}


def test_a_tensorflow_datasets_folder_of_array_records_is_refused_saying_so(tmp_path):
    from dalifeed.convert.options import UsageError

    (tmp_path / "pets-train.array_record-00000-of-00001").write_bytes(b"\x00" * 40)
    info = {"fileFormat": "array_record", "name": "pets", "splits": [{"name": "train", "shardLengths": ["1"]}]}
    (tmp_path / "dataset_info.json").write_text(json.dumps(info, indent=2, sort_keys=True))
    for split in (None, "train"):
        with pytest.raises(UsageError, match=r"dataset_info.json: the records are array_record files, not "
                                             r"TFRecord: prepare the dataset with download_and_prepare\(file_format="
                                             r"'tfrecord'\)$"):
            convert_tfrecord(TFRecordConfig(src=tmp_path, out=tmp_path.parent / "out", split=split, workers=1,
                                            progress=False))
    info["alternativeFileFormats"] = ["tfrecord"]  # both were written: the TFRecord files are converted
    (tmp_path / "dataset_info.json").write_text(json.dumps(info))
    write_records(tmp_path / "pets-train.tfrecord-00000-of-00001", [example(image=b"x", label=0)])
    out = tmp_path.parent / "both"
    convert_tfrecord(TFRecordConfig(src=tmp_path, out=out, image_feature="image", label_feature="label", workers=1,
                                    progress=False))
    assert sorted(s["path"] for s in ShardManifest.load(out).skipped) == [
        "pets-train.array_record-00000-of-00001", "pets-train.tfrecord-00000-of-00001 record 0"]  # b"x": no image
