"""`shard-convert index`: WebDataset tars written by webdataset's ShardWriter and an img2dataset-like layout,
adopted in place (tars byte for byte unchanged), read by the real DALI loader, plus every bad case."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from dalifeed.convert.index import IndexConfig, IndexDataError, IndexUsageError, index_folder, split_of
from dalifeed.convert.verify import verify_shards
from dalifeed.format import ShardManifest, file_sha256, split_member_name
from dalifeed.pipelines import AugmentConfig
from helpers import convert, jpeg_bytes, png_bytes, write_imagefolder

VENV_BIN = Path(sys.executable).parent
ENV = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}


def solid(label: int, size=(20, 24)) -> bytes:
    """A JPEG whose mean red level encodes the label (8 classes at most): the DALI output can be checked."""
    return jpeg_bytes(np.full((*size, 3), (label * 30 + 10, 128, 40), np.uint8), quality=95)


def write_shardwriter(root: Path, split: str, n: int, per_shard: int, seed: int = 0, classes: int = 3) -> list[int]:
    """Shards as webdataset's ShardWriter writes them: keys `000123`, members jpg + cls (its int encoder)."""
    root.mkdir(parents=True, exist_ok=True)
    labels = [int(x) for x in np.random.default_rng(seed).integers(0, classes, n)]
    with wds.ShardWriter(str(root / f"{split}-%06d.tar"), maxcount=per_shard, verbose=0) as sink:
        for i, label in enumerate(labels):
            sink.write({"__key__": f"{i:06d}", "jpg": solid(label), "cls": label})
    return labels


def add_member(tar, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def tree_sha256(root: Path) -> dict[str, str]:
    return {p.name: file_sha256(p) for p in sorted(root.glob("*.tar"))}


def wds2idx(tar: Path, out: Path) -> str:
    subprocess.run([str(VENV_BIN / "wds2idx"), str(tar), str(out)], check=True, capture_output=True,
                   env={**ENV, "PATH": f"{VENV_BIN}:{os.environ['PATH']}"})
    return out.read_text()


def loader_labels_and_red(root: Path, split: str, batch: int, train: bool = False) -> tuple[list[int], list[int]]:
    from dalifeed.pipelines import make_loader

    loader = make_loader(root, split, batch, augment=AugmentConfig(image_size=16), device="cpu", train=train,
                         num_threads=1, initial_fill=8)
    labels, reds = [], []
    for images, target in loader:
        labels += target.tolist()
        # undo the normalisation of the red channel: mean level of the image
        red = images[:, 0].mean(dim=(1, 2)) * 0.229 * 255 + 0.485 * 255
        reds += [round((float(r) - 10) / 30) for r in red]
    return labels, reds


def test_shardwriter_tars_index_like_wds2idx_and_train_unchanged(tmp_path):
    labels = write_shardwriter(tmp_path / "ds", "train", 23, per_shard=10)
    write_shardwriter(tmp_path / "ds", "val", 7, per_shard=10, seed=1)
    before = tree_sha256(tmp_path / "ds")
    manifest = index_folder(IndexConfig(tmp_path / "ds"))
    assert tree_sha256(tmp_path / "ds") == before  # not a byte of a tar changed
    assert manifest.kind == "webdataset" and manifest.classes == ["0", "1", "2"]
    assert {name: info.samples for name, info in manifest.splits.items()} == {"train": 23, "val": 7}
    assert [s.samples for s in manifest.splits["train"].shards] == [10, 10, 3]
    for tar in sorted((tmp_path / "ds").glob("*.tar")):  # DALI's own tool writes the same index
        assert tar.with_suffix(".idx").read_text() == wds2idx(tar, tmp_path / "ref.idx")
    assert manifest.splits["train"].class_counts == [labels.count(c) for c in range(3)]
    assert manifest.skipped == [] and manifest.found == 30
    assert verify_shards(tmp_path / "ds").problems == []
    got, reds = loader_labels_and_red(tmp_path / "ds", "train", 5)
    assert sorted(got) == sorted(labels) and got == reds  # each label arrives with its own image


def test_img2dataset_layout_json_label_and_bad_samples(tmp_path):
    """`00000.tar` with .jpg/.txt/.json (img2dataset), label under a .json key; every bad case is left out
    with its reason, the rest train."""
    root = tmp_path / "i2d"
    root.mkdir()
    good = {}
    with tarfile.open(root / "00000.tar", "w") as tar:
        for i in range(9):
            key, label = f"{i:09d}", i % 3
            good[key] = label
            add_member(tar, f"{key}.jpg", solid(label))
            add_member(tar, f"{key}.txt", f"a photo number {i}".encode())
            add_member(tar, f"{key}.json", json.dumps({"url": "http://x", "label": label, "key": key}).encode())
        add_member(tar, "000000100.txt", b"no image")  # no image
        add_member(tar, "000000100.json", b'{"label": 1}')
        add_member(tar, "000000101.jpg", solid(1))  # no label key
        add_member(tar, "000000101.json", b'{"caption": "x"}')
        add_member(tar, "000000102.jpg", png_bytes(Image.new("RGB", (8, 8))))  # not a JPEG
        add_member(tar, "000000102.json", b'{"label": 1}')
        cmyk = io.BytesIO()
        Image.new("CMYK", (8, 8)).save(cmyk, "JPEG")
        add_member(tar, "000000103.jpg", cmyk.getvalue())  # CMYK JPEG: not every decoder reads it alike
        add_member(tar, "000000103.json", b'{"label": 1}')
        add_member(tar, "000000000.jpg", solid(0))  # a duplicate key, not consecutive
        add_member(tar, "000000000.json", b'{"label": 0}')
        add_member(tar, "000000105 copy.jpg", solid(2))  # a space in its name: no DALI index can hold it
        add_member(tar, "000000105 copy.json", b'{"label": 2}')
        add_member(tar, "000000104.jpg", solid(2))  # split across tars: first half here
    with tarfile.open(root / "00001.tar", "w") as tar:
        add_member(tar, "000000104.json", b'{"label": 2}')  # ... second half here
        for i in range(200, 205):
            key = f"{i:09d}"
            good[key] = i % 3
            add_member(tar, f"{key}.jpg", solid(i % 3))
            add_member(tar, f"{key}.json", json.dumps({"label": i % 3}).encode())
    del good["000000000"]
    before = tree_sha256(root)
    manifest = index_folder(IndexConfig(root, label_member="json", label_key="label"))
    assert tree_sha256(root) == before
    reasons = {e["path"]: e["reason"].split(":")[0] for e in manifest.skipped}
    assert reasons == {"00000.tar:000000100": "no image", "00000.tar:000000101": "no label",
                       "00000.tar:000000102": "image not a JPEG", "00000.tar:000000103": "image cmyk-jpeg",
                       "00000.tar:000000000": "duplicate key", "00000.tar:000000104": "key split across tars",
                       "00000.tar:000000105 copy": "name with whitespace",
                       "00001.tar:000000104": "key split across tars"}
    assert list(manifest.splits) == ["train"] and manifest.num_samples("train") == len(good)
    assert len(manifest.skipped) == 9  # both samples named 000000000 are left out
    assert manifest.found == len(good) + 9
    assert verify_shards(root).problems == []
    got, reds = loader_labels_and_red(root, "train", 4)
    assert sorted(got) == sorted(good.values()) and got == reds


def test_txt_class_names_with_classes_file_and_cli(tmp_path):
    root = tmp_path / "named"
    root.mkdir()
    names = ["zebra", "ant", "cat"]
    with tarfile.open(root / "train-000000.tar", "w") as tar:
        for i in range(12):
            add_member(tar, f"s{i:04d}.jpg", solid(i % 3))
            add_member(tar, f"s{i:04d}.txt", f"{names[i % 3]}\n".encode())
        add_member(tar, "s9999.jpg", solid(0))
        add_member(tar, "s9999.txt", b"dog")  # not in the classes file
    (tmp_path / "classes.txt").write_text("\n".join(names) + "\n")
    result = subprocess.run([str(VENV_BIN / "shard-convert"), "index", str(root), "--label-member", "txt",
                             "--classes-file", str(tmp_path / "classes.txt")], capture_output=True, text=True,
                            env=ENV)
    assert result.returncode == 0, result.stderr
    assert "Indexed 12 of 13 samples" in result.stdout and "1 label not a class" in result.stdout
    manifest = ShardManifest.load(root)
    assert manifest.classes == names
    got, reds = loader_labels_and_red(root, "train", 4)
    assert sorted(got) == sorted(i % 3 for i in range(12)) and got == reds
    info = subprocess.run([str(VENV_BIN / "shard-convert"), "info", str(root)], capture_output=True, text=True,
                          env=ENV)
    assert "samples found 13: 12 indexed, 1 left out" in info.stdout


def test_cls_with_newline_and_verify_finds_a_changed_tar(tmp_path):
    root = tmp_path / "nl"
    root.mkdir()
    with tarfile.open(root / "data-000000.tar", "w") as tar:
        for i in range(6):
            add_member(tar, f"{i:03d}.jpg", solid(i % 2))
            add_member(tar, f"{i:03d}.cls", f"{i % 2}\n".encode())
        add_member(tar, "009.jpg", solid(1))
        add_member(tar, "009.cls", b"one")
    manifest = index_folder(IndexConfig(root, split="train"))
    assert [e["reason"].split(":")[0] for e in manifest.skipped] == ["label unreadable"]
    got, reds = loader_labels_and_red(root, "train", 3)
    assert sorted(got) == [0, 0, 0, 1, 1, 1] and got == reds
    with open(root / "data-000000.tar", "r+b") as f:  # someone changes the tar after indexing
        f.seek(600)
        f.write(b"\0")
    problems = verify_shards(root).problems
    assert len(problems) == 1 and "sha256 differs from the manifest (changed since it was indexed" in problems[0]


def test_usage_and_data_errors(tmp_path):
    with pytest.raises(IndexUsageError, match="no such folder"):
        IndexConfig(tmp_path / "nope")
    with pytest.raises(IndexUsageError, match="--label-member json needs --label-key"):
        IndexConfig(tmp_path, label_member="json")
    with pytest.raises(IndexUsageError, match="no .tar files"):
        index_folder(IndexConfig(tmp_path))
    (tmp_path / "bad.tar").write_bytes(b"not a tar at all" * 100)
    with pytest.raises(IndexDataError, match="bad.tar: unreadable tar"):
        index_folder(IndexConfig(tmp_path))
    (tmp_path / "bad.tar").unlink()
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "dalifeed-shards", "kind": "imagefolder"}))
    write_shardwriter(tmp_path, "train", 3, per_shard=10)
    with pytest.raises(IndexUsageError, match="already a dalifeed shard folder \\(imagefolder shards"):
        index_folder(IndexConfig(tmp_path))
    result = subprocess.run([str(VENV_BIN / "shard-convert"), "index", str(tmp_path / "nope")], capture_output=True,
                            text=True, env=ENV)
    assert result.returncode == 2 and "no such folder" in result.stderr


def test_a_damaged_tar_is_one_line_naming_the_tar_and_where(tmp_path):
    """A tar cut inside a member, or with a header overwritten halfway (which tarfile took for the archive's
    end: the samples after it were silently missing from the index), fails the run in one line naming the
    tar and the member."""
    write_shardwriter(tmp_path, "train", 6, per_shard=6)
    tar = tmp_path / "train-000000.tar"
    data = tar.read_bytes()
    offsets = {m.name: (m.offset, m.offset_data) for m in tarfile.open(tar)}
    tar.write_bytes(data[:offsets["000003.jpg"][1] + 100])
    with pytest.raises(IndexDataError, match=rf"^{tar}: unreadable tar \(member '000003.jpg' is cut short: its data "
                                             rf"runs to byte \d+, the file ends at byte \d+\)$"):
        index_folder(IndexConfig(tmp_path))
    header = offsets["000004.cls"][0]  # its pax header
    tar.write_bytes(data[:header] + b"garbage" + data[header + 7:])
    result = subprocess.run([str(VENV_BIN / "shard-convert"), "index", str(tmp_path)], capture_output=True,
                            text=True, env=ENV)
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == (f"Error: {tar}: unreadable tar (not a tar header at byte {header} (after member "
                             f"'000003.jpg') (bad checksum))\n")


def test_workers_read_tars_in_parallel_with_the_same_result_and_errors(tmp_path):
    """--workers N reads N tars at once: the indexes and manifest are those of one worker; a damaged tar
    read by a worker process fails the run with the same one line."""
    labels = write_shardwriter(tmp_path / "ds", "train", 23, per_shard=4)
    one = index_folder(IndexConfig(tmp_path / "ds", workers=1, index_dir=tmp_path / "one"))
    three = index_folder(IndexConfig(tmp_path / "ds", workers=3, index_dir=tmp_path / "three"))
    assert len(one.splits["train"].shards) == 6 and one.splits["train"].class_counts == [labels.count(c)
                                                                                         for c in range(3)]
    for name in [*(p.name for p in (tmp_path / "one").glob("*.idx")), "manifest.json"]:
        text = (tmp_path / "one" / name).read_text()
        assert (tmp_path / "three" / name).read_text() == text.replace(str(tmp_path / "one"),
                                                                         str(tmp_path / "three"))
    assert three.splits["train"].shards == one.splits["train"].shards
    tar = tmp_path / "ds" / "train-000004.tar"
    tar.write_bytes(tar.read_bytes()[:3000])
    with pytest.raises(IndexDataError, match=rf"^{tar}: unreadable tar \(the pax header at byte 2048 \(after "
                                             rf"member '000016.cls'\) is cut short: the file ends at byte 3000\)$"):
        index_folder(IndexConfig(tmp_path / "ds", workers=3))


def compress(tar: Path, suffix: str, tool: list[str]) -> Path:
    """`tar` compressed with `tool` (reading stdin, writing stdout) into TAR-without-.tar + suffix; `tar` removed."""
    out = tar.with_name(tar.name[:-len(".tar")] + suffix)
    with open(tar, "rb") as src, open(out, "wb") as dst:
        subprocess.run(tool, stdin=src, stdout=dst, check=True)
    tar.unlink()
    return out


@pytest.mark.skipif(shutil.which("zstd") is None, reason="needs the zstd command (Debian package zstd)")
def test_compressed_tars_are_named_with_their_command_and_fail_the_run(tmp_path):
    """A .tar.gz beside a .tar is counted, named with the command that decompresses it, and the run exits 1
    after indexing the .tar; running that command and index again adopts both."""
    root = tmp_path / "ds"
    write_shardwriter(root, "train", 12, per_shard=5)  # train-000000..2.tar: 5 + 5 + 2
    compress(root / "train-000001.tar", ".tar.gz", ["gzip", "-c"])
    compress(root / "train-000002.tar", ".tar.zst", ["zstd", "-q", "-c"])
    result = subprocess.run([str(VENV_BIN / "shard-convert"), "index", str(root)], capture_output=True, text=True,
                            env=ENV)
    assert result.returncode == 1
    assert "Indexed 5 of 5 samples in 1 tars" in result.stdout
    assert "2 compressed tar(s) not indexed (train-000001.tar.gz, train-000002.tar.zst)" in result.stderr
    assert f"gunzip -k {root / 'train-000001.tar.gz'}" in result.stderr
    assert f"zstd -d {root / 'train-000002.tar.zst'} -o {root / 'train-000002.tar'}" in result.stderr
    manifest = ShardManifest.load(root)
    compressed = {e["path"]: e["reason"] for e in manifest.skipped}
    assert list(compressed) == ["train-000001.tar.gz", "train-000002.tar.zst"]
    assert compressed["train-000001.tar.gz"].startswith("compressed tar: DALI reads only uncompressed tars")
    assert manifest.found == 5 + 2 and manifest.num_samples("train") == 5
    for command in (f"gunzip -k {root / 'train-000001.tar.gz'}",  # what the message says, as written
                    f"zstd -d {root / 'train-000002.tar.zst'} -o {root / 'train-000002.tar'}"):
        subprocess.run(command.split(), check=True)
    again = subprocess.run([str(VENV_BIN / "shard-convert"), "index", str(root)], capture_output=True, text=True,
                           env=ENV)
    assert again.returncode == 0, again.stderr
    assert "Indexed 12 of 12 samples in 3 tars" in again.stdout
    assert "Note: train-000001.tar.gz: not read; taken as the compressed copy of train-000001.tar" in again.stdout
    manifest = ShardManifest.load(root)
    assert manifest.skipped == [] and manifest.found == 12 and len(manifest.warnings) == 2


def test_only_compressed_tars_is_an_error_naming_the_command(tmp_path):
    write_shardwriter(tmp_path, "train", 3, per_shard=5)
    compress(tmp_path / "train-000000.tar", ".tgz", ["gzip", "-c"])
    (tmp_path / "notes.txt").write_text("not a tar")
    with pytest.raises(IndexDataError, match=r"nothing to index: 1 compressed tar\(s\) \(train-000000.tgz\) and "
                                             r"no .tar; DALI reads only uncompressed tars: .* gunzip -k .*tgz$"):
        index_folder(IndexConfig(tmp_path))
    assert not (tmp_path / "manifest.json").exists()
    result = subprocess.run([str(VENV_BIN / "shard-convert"), "index", str(tmp_path)], capture_output=True,
                            text=True, env=ENV)
    assert result.returncode == 1 and "nothing to index" in result.stderr


def test_compressed_tars_in_object_storage(tmp_path, s3_bucket):
    from dalifeed import s3

    write_shardwriter(tmp_path / "ds", "train", 8, per_shard=5)
    packed = compress(tmp_path / "ds" / "train-000001.tar", ".tar.xz", ["xz", "-c"])
    url = f"{s3_bucket}/mixed"
    for path in sorted((tmp_path / "ds").iterdir()):
        s3.upload_file(path, f"{url}/{path.name}", file_sha256(path))
    manifest = index_folder(IndexConfig(url))
    assert manifest.num_samples("train") == 5 and manifest.found == 5 + 1
    assert manifest.skipped == [{"path": packed.name, "reason": (
        f"compressed tar: DALI reads only uncompressed tars; decompress it (aws s3 cp {url}/train-000001.tar.xz - "
        f"| xz -dc | aws s3 cp - {url}/train-000001.tar) and index again")}]
    assert manifest.summary.compressed_error().startswith("1 compressed tar(s) not indexed (train-000001.tar.xz)")
    s3.delete(url, ["train-000000.tar", "train-000000.idx", "manifest.json"])
    with pytest.raises(IndexDataError, match="nothing to index: 1 compressed tar"):
        index_folder(IndexConfig(url))


def test_dotted_keys_are_explained_with_an_example_and_the_fix(tmp_path):
    """80 images named `img.N.v2.jpg` / `pic.N.v2.jpg` group into 2 samples (key `img`, `pic`): as webdataset
    and DALI group them. The error says so, names an example and the rename; beside good samples, the summary
    does."""
    root = tmp_path / "dots"
    root.mkdir()
    with tarfile.open(root / "train-000000.tar", "w") as tar:
        for prefix in ("img", "pic"):
            for i in range(40):
                add_member(tar, f"{prefix}.{i}.v2.jpg", solid(i % 3))
                add_member(tar, f"{prefix}.{i}.v2.cls", str(i % 3).encode())
    example = ("train-000000.tar:img: dotted key: 40 image(s) such as 'img.0.v2.jpg' have key 'img' and extension "
               "'0.v2.jpg': webdataset and DALI take the text before the first dot of a file name as its sample's "
               "key, so they became one sample; rename the files so the key has no dots, e.g. 'img_0_v2.jpg'")
    with pytest.raises(IndexDataError) as error:
        index_folder(IndexConfig(root))
    assert str(error.value) == f"{root}: no sample can be trained on: 2 found, all left out (2 dotted key). {example}"
    with tarfile.open(root / "train-000001.tar", "w") as tar:
        for i in range(3):
            add_member(tar, f"ok{i}.jpg", solid(1))
            add_member(tar, f"ok{i}.cls", b"1")
    result = subprocess.run([str(VENV_BIN / "shard-convert"), "index", str(root)], capture_output=True, text=True,
                            env=ENV)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].startswith("Indexed 3 of 5 samples in 1 tars (train 3)")
    assert "left out 2 (2 dotted key)" in result.stdout and result.stdout.splitlines()[1] == example


def test_a_classes_file_shorter_than_the_labels_is_refused(tmp_path):
    """3 class names for labels 0..9 would leave 75 of 100 samples out: a usage error (exit 2), nothing written."""
    labels = write_shardwriter(tmp_path / "ds", "train", 100, per_shard=60, classes=10)
    (tmp_path / "classes.txt").write_text("cat\ndog\nbird\n")
    beyond = sum(label >= 3 for label in labels)
    assert max(labels) == 9 and beyond == 75  # the seed's draw
    with pytest.raises(IndexUsageError, match=rf"^--classes-file {tmp_path / 'classes.txt'} names 3 classes \(0..2\) "
                                              rf"but the labels go up to 9: 75 of 100 samples would be left out; "):
        index_folder(IndexConfig(tmp_path / "ds", classes_file=tmp_path / "classes.txt"))
    result = subprocess.run([str(VENV_BIN / "shard-convert"), "index", str(tmp_path / "ds"), "--classes-file",
                             str(tmp_path / "classes.txt")], capture_output=True, text=True, env=ENV)
    assert result.returncode == 2 and "names 3 classes (0..2) but the labels go up to 9" in result.stderr
    assert sorted(p.name for p in (tmp_path / "ds").iterdir()) == ["train-000000.tar", "train-000001.tar"]


def test_a_folder_that_takes_no_file_is_refused_before_reading_naming_index_dir():
    """/proc takes no new file, as a read-only dataset folder: one line, exit 2, before any tar is read."""
    with pytest.raises(IndexUsageError, match=r"^/proc: cannot write the indexes and the manifest there \(.*\): "
                                              r"give --index-dir DIR to write them elsewhere"):
        index_folder(IndexConfig("/proc"))
    result = subprocess.run([str(VENV_BIN / "shard-convert"), "index", "/proc"], capture_output=True, text=True,
                            env=ENV)
    assert result.returncode == 2 and "give --index-dir DIR" in result.stderr


def test_index_dir_keeps_indexes_and_manifest_apart_from_read_only_tars(tmp_path):
    """--index-dir: the tars' folder gets no file; the manifest records where the tars are, and the loader,
    verify, info and dali-bench's webdataset loader read them from there."""
    import torch

    from dalifeed.bench.loaders import webdataset_loader
    from dalifeed.pipelines import AugmentConfig

    tars = tmp_path / "readonly"
    labels = write_shardwriter(tars, "train", 13, per_shard=5)
    write_shardwriter(tars, "val", 4, per_shard=5, seed=1)
    listing = sorted(p.name for p in tars.iterdir())
    before = tree_sha256(tars)
    tars.chmod(0o555)  # read-only (root writes anyway: the listing below is what proves nothing was written)
    try:
        result = subprocess.run([str(VENV_BIN / "shard-convert"), "index", str(tars), "--index-dir",
                                 str(tmp_path / "idx")], capture_output=True, text=True, env=ENV)
        assert result.returncode == 0, result.stderr
        assert sorted(p.name for p in tars.iterdir()) == listing and tree_sha256(tars) == before
    finally:
        tars.chmod(0o755)
    out = tmp_path / "idx"
    assert sorted(p.name for p in out.iterdir()) == sorted(["manifest.json", "train-000000.idx", "train-000001.idx",
                                                            "train-000002.idx", "val-000000.idx"])
    manifest = ShardManifest.load(out)
    assert json.loads((out / "manifest.json").read_text())["tars"] == str(tars.resolve())
    assert manifest.shard_location(manifest.splits["train"].shards[0]) == str(tars.resolve() / "train-000000.tar")
    for tar in sorted(tars.glob("*.tar")):  # DALI's own tool writes the same index
        assert (out / tar.with_suffix(".idx").name).read_text() == wds2idx(tar, tmp_path / "ref.idx")
    assert verify_shards(out).problems == []
    info = subprocess.run([str(VENV_BIN / "shard-convert"), "info", str(out)], capture_output=True, text=True, env=ENV)
    assert f"  tars: in {tars.resolve()} (the indexes and manifest here)" in info.stdout
    assert "train: 13 samples in 3 shards" in info.stdout and "DALI indexes all present" in info.stdout
    got, reds = loader_labels_and_red(out, "train", 4)
    assert sorted(got) == sorted(labels) and got == reds
    bench = webdataset_loader(out, "train", 4, 0, torch.device("cpu"), AugmentConfig(image_size=16))
    assert sum(len(batch_labels) for _, batch_labels in bench) == 12  # 13 samples, whole batches of 4
    assert manifest.index_command() == f"shard-convert index --index-dir {out} {tars.resolve()}"
    (tars / "train-000001.tar").write_bytes((tars / "train-000001.tar").read_bytes()[:-4096])  # damaged later
    assert any("train-000001.tar: " in p and "(changed since it was indexed: index it again: shard-convert index "
               f"--index-dir {out} {tars.resolve()})" in p for p in verify_shards(out).problems)
    other = tmp_path / "other"
    write_shardwriter(other, "train", 3, per_shard=5)
    with pytest.raises(IndexUsageError,
                       match=rf"--index-dir {out}: holds the index of other tars \({tars.resolve()}\)"):
        index_folder(IndexConfig(other, index_dir=out))


def test_dali_train_on_indexed_shardwriter_tars(tmp_path):
    """Done means: ShardWriter tars, `shard-convert index`, then dali-train trains and evaluates on them."""
    write_shardwriter(tmp_path / "ds", "train", 24, per_shard=10)
    write_shardwriter(tmp_path / "ds", "val", 9, per_shard=10, seed=1)
    before = tree_sha256(tmp_path / "ds")
    indexed = subprocess.run([str(VENV_BIN / "shard-convert"), "index", str(tmp_path / "ds")], capture_output=True,
                             text=True, env=ENV)
    assert indexed.returncode == 0, indexed.stderr
    run = subprocess.run([str(VENV_BIN / "dali-train"), "--data", str(tmp_path / "ds"), "--out", str(tmp_path / "run"),
                          "--epochs", "1", "--model", "resnet18", "--image-size", "16", "--batch-size", "8",
                          "--device", "cpu", "--dali-threads", "1", "--progress-every", "0"],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["epoch"] == 0 and records[-1]["val_samples"] == 9
    assert tree_sha256(tmp_path / "ds") == before


def test_verify_decode_finds_a_kept_image_dali_cannot_decode(tmp_path):
    """The header rule keeps a JPEG cut short after its headers; `verify --decode` decodes it with DALI and
    names it, before a training run would meet it."""
    root = tmp_path / "cut"
    root.mkdir()
    with tarfile.open(root / "train-000000.tar", "w") as tar:
        for i in range(4):
            add_member(tar, f"{i:03d}.jpg", solid(i % 2))
            add_member(tar, f"{i:03d}.cls", str(i % 2).encode())
        whole = solid(1, size=(64, 64))
        add_member(tar, "009.jpg", whole[:whole.index(b"\xff\xda") + 20])  # headers, then 20 bytes of the scan
        add_member(tar, "009.cls", b"1")
    manifest = index_folder(IndexConfig(root))
    assert manifest.num_samples("train") == 5 and manifest.skipped == []
    assert verify_shards(root).problems == []
    problems = verify_shards(root, decode=True).problems
    assert len(problems) == 1 and "sample 009: DALI cannot decode its image" in problems[0]


def damaged_photo(seed: int) -> bytes:
    """A 300 x 200 photo (scikit-learn's) with 2,000 random bytes written into its entropy-coded data: seed 0
    gives one PIL refuses ("broken data stream") and DALI's libjpeg decodes with a warning; seed 1 one both
    decode, libjpeg warning."""
    from dalifeed.bench.sample_data import sklearn_sample_images
    from helpers import jpeg_bytes

    good = jpeg_bytes(next(iter(sklearn_sample_images().values()))[:200, :300], quality=90)
    start = good.index(b"\xff\xda") + 400
    damaged = bytearray(good)
    damaged[start:start + 2000] = np.random.default_rng(seed).integers(0, 256, 2000, dtype=np.uint8).tobytes()
    return bytes(damaged)


def test_verify_decode_names_a_jpeg_pil_cannot_decode_and_one_libjpeg_warns_of(tmp_path):
    """Indexed without --decode, a JPEG with garbage in its scan is kept: DALI decodes it (into garbage),
    PIL does not; `verify --decode` decodes with both, names each such sample (exit 1), and libjpeg's own
    warnings, which DALI's threads write to stderr, are caught and named by sample instead of reaching the
    terminal bare."""
    from dalifeed.convert.images import ImageError, decode_check

    root = tmp_path / "damaged"
    root.mkdir()
    with pytest.raises(ImageError, match="broken data stream"):
        decode_check(damaged_photo(0))
    decode_check(damaged_photo(1))
    with tarfile.open(root / "train-000000.tar", "w") as tar:
        for i in range(4):
            add_member(tar, f"{i:03d}.jpg", solid(i % 2))
            add_member(tar, f"{i:03d}.cls", str(i % 2).encode())
        for key, seed in (("pil", 0), ("warn", 1)):
            add_member(tar, f"{key}.jpg", damaged_photo(seed))
            add_member(tar, f"{key}.cls", b"1")
    assert index_folder(IndexConfig(root)).num_samples("train") == 6
    result = subprocess.run([str(VENV_BIN / "shard-convert"), "verify", "--decode", str(root)], capture_output=True,
                            text=True, timeout=300, env=ENV)
    assert result.returncode == 1, result.stdout + result.stderr
    tar = root / "train-000000.tar"
    assert result.stdout.splitlines() == [
        f"{tar}: sample pil: PIL cannot decode its image (corrupt or truncated image: broken data stream when reading "
        f"image file) and DALI's libjpeg warns 'Corrupt JPEG data: premature end of data segment'; DALI decodes it, "
        f"so training would read what it makes of it: leave it out with: shard-convert index --decode {root}",
        f"{tar}: sample warn: DALI's libjpeg warns 'Corrupt JPEG data: premature end of data segment': its image data "
        f"are damaged, and training would read what libjpeg makes of them",
        "verify: 1 shards, 6 samples: 2 problem(s)"]
    assert "Corrupt JPEG" not in result.stderr


def test_index_decode_leaves_a_truncated_jpeg_out_and_training_finishes_the_epoch(tmp_path):
    """A JPEG cut in half passes the header rule: without --decode the loader stops at it and names the command
    that repairs the index; `index --decode` leaves it out with its reason (the tar untouched), and then
    the loader reads every other sample and dali-train finishes its epoch."""
    root = tmp_path / "cut"
    root.mkdir()
    labels = {}
    with tarfile.open(root / "train-000000.tar", "w") as tar:
        for i in range(15):
            key, label = f"{i:03d}", i % 3
            whole = solid(label, size=(64, 64))
            data = whole[:len(whole) // 2] if key == "006" else whole  # its scan cut off halfway
            add_member(tar, f"{key}.jpg", data)
            add_member(tar, f"{key}.cls", str(label).encode())
            labels[key] = label
    write_shardwriter(root, "val", 4, per_shard=10, seed=1)
    before = tree_sha256(root)
    manifest = index_folder(IndexConfig(root))
    assert manifest.num_samples("train") == 15 and manifest.skipped == []  # headers only: it is kept
    from dalifeed.pipelines import ShardDataError

    with pytest.raises(ShardDataError, match=rf"train-000000.tar: sample 006: DALI cannot decode its .jpg .*; leave "
                                             rf"the samples that do not decode out of the index \(the tars are not "
                                             rf"changed\): shard-convert index --decode {root}$"):
        loader_labels_and_red(root, "train", 5)
    result = subprocess.run([str(VENV_BIN / "shard-convert"), "index", "--decode", "--workers", "2", str(root)],
                            capture_output=True, text=True, env=ENV)
    assert result.returncode == 0, result.stderr
    assert "Indexed 18 of 19 samples" in result.stdout and "left out 1 (1 image undecodable)" in result.stdout
    manifest = ShardManifest.load(root)
    assert [e["path"] for e in manifest.skipped] == ["train-000000.tar:006"]
    assert manifest.skipped[0]["reason"].startswith("image undecodable: corrupt or truncated image: ")
    assert manifest.options["decode"] is True and manifest.num_samples("train") == 14
    assert tree_sha256(root) == before
    assert verify_shards(root).problems == []  # the same index, --decode's verdict taken from the manifest
    del labels["006"]
    got, reds = loader_labels_and_red(root, "train", 5)
    assert sorted(got) == sorted(labels.values()) and got == reds
    run = subprocess.run([str(VENV_BIN / "dali-train"), "--data", str(root), "--out", str(tmp_path / "run"),
                          "--epochs", "1", "--model", "resnet18", "--image-size", "16", "--batch-size", "7",
                          "--device", "cpu", "--dali-threads", "1", "--progress-every", "0"],
                         capture_output=True, text=True, env=ENV, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["epoch"] == 0 and records[-1]["val_samples"] == 4


def test_index_tars_in_object_storage_in_place(tmp_path, s3_bucket):
    """`shard-convert index s3://...`: each tar streamed once, indexes and manifest written beside them in the
    store, the tar objects unchanged; the loader reads them from the store (DALI's S3 client)."""
    from dalifeed import s3

    labels = write_shardwriter(tmp_path / "ds", "train", 17, per_shard=8)
    url = f"{s3_bucket}/adopted"
    for tar in sorted((tmp_path / "ds").glob("*.tar")):
        s3.upload_file(tar, f"{url}/{tar.name}", file_sha256(tar))
    before = {name: s3.object_sha256(f"{url}/{name}") for name in s3.list_objects(url)}
    manifest = index_folder(IndexConfig(url))
    assert manifest.url == url and manifest.num_samples("train") == 17
    assert {name: s3.object_sha256(f"{url}/{name}") for name in before} == before
    assert sorted(s3.list_objects(url)) == sorted([*before, "manifest.json", *(n[:-4] + ".idx" for n in before)])
    for name in before:  # the same index as for the local copy, which is DALI's wds2idx's
        assert s3.get_bytes(f"{url}/{name[:-4]}.idx").decode() == wds2idx(tmp_path / "ds" / name, tmp_path / "r.idx")
    assert [s.sha256 for s in manifest.splits["train"].shards] == list(before.values())
    assert verify_shards(url).problems == []
    got, reds = loader_labels_and_red(url, "train", 4)
    assert sorted(got) == sorted(labels) and got == reds


@pytest.mark.parametrize("name", ["000123.jpg", "000123.cls.i64", "dir/a.b.c", "dir.v1/img.0.v2.jpg",
                                  "a/b/c.tar.gz", "x/.hidden.jpg", ".hidden", "noext", "dir/noext"])
def test_one_member_name_rule_matches_webdataset_and_wds2idx(name):
    """format.split_member_name against the two tools it follows: webdataset's base_plus_ext (which skips a
    name without a dot) and DALI's wds2idx (which skips a hidden file)."""
    from wds2idx import IndexCreator
    from webdataset.tariterators import base_plus_ext

    got = split_member_name(name)
    hidden = name.rsplit("/", 1)[-1].startswith(".")
    theirs = base_plus_ext(name)
    if hidden:  # wds2idx leaves it out (its key ends in '/' or is empty); webdataset reads `x/.hidden.jpg` as key `x/`
        assert got is None and IndexCreator.split_name(name)[0] in ("", name[:name.rfind("/") + 1])
    elif theirs == (None, None):  # no dot: webdataset leaves it out (wds2idx would cut off its last letter)
        assert got is None
    else:
        assert got == theirs == IndexCreator.split_name(name)


def test_one_index_writer_dalifeed_shards_and_index_write_the_same_bytes(tmp_path):
    """The index ShardWriter writes while converting, the one `index` writes for the same tar, and DALI's
    wds2idx's are the same bytes (format.index_text writes all of dalifeed's)."""
    tree = write_imagefolder(tmp_path / "src", {"a": 7, "b": 6})
    convert(tree, tmp_path / "shards", samples_per_shard=5, workers=1)
    adopted = tmp_path / "adopted"
    adopted.mkdir()
    tars = sorted((tmp_path / "shards").glob("*.tar"))
    assert len(tars) == 3
    for tar in tars:
        shutil.copy(tar, adopted / tar.name)
    manifest = index_folder(IndexConfig(adopted))
    assert manifest.num_samples("train") == 13 and manifest.skipped == []
    for tar in tars:
        written = tar.with_suffix(".idx").read_bytes()
        assert (adopted / tar.with_suffix(".idx").name).read_bytes() == written
        assert wds2idx(tar, tmp_path / "ref.idx").encode() == written


def test_split_names_from_file_names():
    names = {"train-000000.tar": "train", "validation_00001.tar": "val", "00000.tar": "train",
             "imagenet-val-000003.tar": "val", "laion_train_12.tar": "train", "shard-000001.tar": "shard",
             "Test-000000.tar": "test"}
    assert {name: split_of(name, None) for name in names} == names
    assert split_of("shard-000001.tar", "holdout") == "holdout"


def test_index_explains_a_tar_in_directory_order_a_class_name_in_cls_and_an_lfs_pointer(tmp_path):
    """The first-hour cases: `tar cf DIR` stores a folder's files in directory order, so a key's .jpg and .cls
    are apart and webdataset sees each key twice; a .cls holding a class name; a Git LFS pointer where the
    tar should be. Each is named for what it is, with the way out."""
    apart = tmp_path / "apart"
    apart.mkdir()
    with tarfile.open(apart / "train-000000.tar", "w") as tar:
        for i in range(3):
            add_member(tar, f"{i:03d}.jpg", solid(i % 2))
        for i in range(3):
            add_member(tar, f"{i:03d}.cls", str(i % 2).encode())
    with pytest.raises(IndexDataError) as refused:
        index_folder(IndexConfig(apart))
    assert str(refused.value).startswith(f"{apart}: no sample can be trained on: 6 found, all left out (6 members "
                                         f"not adjacent).")
    assert ("train-000000.tar:000: members not adjacent: 000's files (000.jpg, 000.cls) are apart in "
            "train-000000.tar, which webdataset reads as 2 samples: the tar was written in directory order (a plain "
            "`tar cf DIR`); write it again with the files of each key together: tar --sort=name -cf TAR -C DIR ."
            ) in str(refused.value)

    named = tmp_path / "named"
    named.mkdir()
    with tarfile.open(named / "train-000000.tar", "w") as tar:
        for i in range(3):
            add_member(tar, f"{i:03d}.jpg", solid(i % 2))
            add_member(tar, f"{i:03d}.cls", b"dog" if i == 1 else b"0")
    manifest = index_folder(IndexConfig(named))
    assert manifest.skipped == [{"path": "train-000000.tar:001", "reason": (
        "label unreadable: .cls is 'dog', not a decimal integer (webdataset's convention): a class name? .cls holds "
        "a class index; names go in a member such as .txt, indexed with --label-member txt")}]

    lfs = tmp_path / "lfs"
    lfs.mkdir()
    (lfs / "train-000000.tar").write_text("version https://git-lfs.github.com/spec/v1\noid sha256:" + "0" * 64 +
                                          "\nsize 123456789\n")
    with pytest.raises(IndexDataError, match=r"train-000000\.tar: unreadable tar \(a Git LFS pointer, not the tar: "
                                             r"fetch the file itself \(git lfs pull\)\)"):
        index_folder(IndexConfig(lfs))
