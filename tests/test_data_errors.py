"""Damaged or foreign shards at training time: one line naming the shard file (and the sample where it can be
found), exit 1, last.pt untouched, no DALI traceback on the terminal, no hang. And `verify --decode` finds
with DALI's own decoder what would stop a training run."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import imagecodecs
import numpy as np
import pytest
import torch
import webdataset as wds
from click.testing import CliRunner

from dalifeed.convert.cli import main as convert_cli
from dalifeed.format import file_sha256
from dalifeed.pipelines import AugmentConfig, make_loader
from dalifeed.pipelines.checks import ShardDataError
from dalifeed.train import TrainConfig
from dalifeed.train import main as train
from helpers import gradient_image

TRAIN = dict(model="resnet18", image_size=16, batch_size=8, optimizer="adamw", lr=0.032, warmup_epochs=0.0,
             crop_scale=(0.5, 1.0), workers=2)


@pytest.fixture(scope="module")
def pristine(make_shards, tmp_path_factory) -> tuple[Path, Path]:
    """Shards (45 train in 5 tars, 21 val) and a run that finished epoch 0 on them. Read only: copy_of."""
    _, shards = make_shards({"train": {"red": 17, "green": 15, "blue": 13}, "val": {"red": 7, "green": 7, "blue": 7}},
                            samples_per_shard=10)
    run = tmp_path_factory.mktemp("pristine") / "run"
    train(TrainConfig(data=str(shards), out=str(run), epochs=1, **TRAIN))
    return shards, run


def copy_of(pristine, tmp_path: Path) -> tuple[Path, Path]:
    """Fresh copies of the shards and of the run, the run's checkpoint pointing at the copied shards."""
    shards, run = tmp_path / "shards", tmp_path / "run"
    shutil.copytree(pristine[0], shards)
    shutil.copytree(pristine[1], run)
    ckpt = torch.load(run / "last.pt", weights_only=False)
    ckpt["config"]["data"] = str(shards)
    torch.save(ckpt, run / "last.pt")
    return shards, run


def member(shards: Path, tar: str, sample: int, ext: str = "jpg") -> tuple[int, int, str]:
    """(data offset, size, key) of a member of a sample, from the tar's DALI index."""
    fields = (shards / tar).with_suffix(".idx").read_text().splitlines()[1 + sample].split()
    i = fields.index(ext)
    return int(fields[i + 1]), int(fields[i + 2]), fields[i + 3].split(".")[0]


def overwrite(path: Path, offset: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[offset:offset + len(data)] = data
    path.write_bytes(bytes(raw))


def break_a_jpeg(shards: Path) -> str:
    offset, _, key = member(shards, "train-000002.tar", 3)
    overwrite(shards / "train-000002.tar", offset, b"\0" * 16)  # same size, the JPEG's header gone
    return f"train-000002.tar: sample {key}: DALI cannot decode its .jpg"


def truncate_a_tar(shards: Path) -> str:
    tar = shards / "train-000001.tar"
    tar.write_bytes(tar.read_bytes()[:5000])
    return "train-000001.tar: 5000 bytes, the manifest says"


def delete_an_index(shards: Path) -> str:
    (shards / "train-000003.idx").unlink()
    return "train-000003.idx: missing"


def miscount_in_the_manifest(shards: Path) -> str:
    doc = json.loads((shards / "manifest.json").read_text())
    doc["splits"]["train"]["shards"][4]["samples"] = 4  # the tar holds 5
    (shards / "manifest.json").write_text(json.dumps(doc))
    return "train-000004.idx: indexes 5 samples, the manifest says 4"


def flip_bits_silently(shards: Path) -> str:
    """Bytes changed inside image data, past every header: libjpeg decodes it to wrong pixels without an
    error, so only the sha256 check (--check-shards sha256) can tell."""
    offset, size, _ = member(shards, "train-000000.tar", 2)
    overwrite(shards / "train-000000.tar", offset + size - 40, b"\x5a" * 8)
    return "train-000000.tar: sha256 differs from the manifest"


@pytest.mark.parametrize("damage, options", [
    (break_a_jpeg, []), (truncate_a_tar, []), (delete_an_index, []), (miscount_in_the_manifest, []),
    (flip_bits_silently, ["--check-shards", "sha256"]),
])
def test_damaged_shards_stop_training_with_one_line(pristine, tmp_path, damage, options):
    shards, run = copy_of(pristine, tmp_path)
    checkpoint_before = (run / "last.pt").read_bytes()
    expected = damage(shards)
    command = [sys.executable, "-m", "dalifeed.train.cli", "--resume", str(run), "--epochs", "2", *options]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 1, result.stderr[-3000:]
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, result.stderr
    assert str(shards / expected.split(":")[0]) in errors[0] and expected in errors[0]
    assert f"shard-convert verify --decode {shards}" in errors[0]
    terminal = result.stdout + result.stderr
    assert "Traceback" not in terminal and "Critical error" not in terminal
    assert (run / "last.pt").read_bytes() == checkpoint_before
    assert "Traceback" in (run / "error.log").read_text()  # the details are kept for a bug report


def test_without_sha256_the_silent_flip_trains_and_verify_still_catches_it(pristine, tmp_path):
    shards, _ = copy_of(pristine, tmp_path)
    flip_bits_silently(shards)
    # sizes and indexes all agree
    loader = make_loader(shards, "train", 8, augment=AugmentConfig(image_size=16), device="cpu")
    assert sum(len(labels) for _, labels in loader) == 40
    result = CliRunner().invoke(convert_cli, ["verify", str(shards)])
    assert result.exit_code == 1 and "train-000000.tar: sha256 differs from the manifest" in result.output


def foreign_shard_with_a_lossless_jpeg(shards: Path) -> str:
    """Rewrite train-000002.tar the way another tool would (webdataset's TarWriter, wds2idx), its fourth
    sample's image replaced by a lossless JPEG that PIL decodes and DALI does not. Returns that key."""
    tar = shards / "train-000002.tar"
    samples = list(wds.WebDataset(str(tar), shardshuffle=False))
    lossless = imagecodecs.jpeg8_encode(np.ascontiguousarray(gradient_image(20, 24)[..., 0]), lossless=True)
    samples[3]["jpg"] = lossless
    with wds.TarWriter(str(tar)) as writer:
        for s in samples:
            writer.write({k: v for k, v in s.items() if k in ("__key__", "jpg", "cls", "cls.i64", "json")})
    wds2idx = Path(sys.executable).parent / "wds2idx"
    subprocess.run([str(wds2idx), str(tar), str(tar.with_suffix(".idx"))], check=True, capture_output=True)
    doc = json.loads((shards / "manifest.json").read_text())
    entry = doc["splits"]["train"]["shards"][2]
    entry["bytes"], entry["sha256"] = tar.stat().st_size, file_sha256(tar)
    (shards / "manifest.json").write_text(json.dumps(doc))
    return samples[3]["__key__"]


def test_verify_decode_uses_dalis_decoder_and_names_shard_key_and_source(pristine, tmp_path):
    shards, _ = copy_of(pristine, tmp_path)
    key = foreign_shard_with_a_lossless_jpeg(shards)
    source = json.loads(next(s for s in wds.WebDataset(str(shards / "train-000002.tar"), shardshuffle=False)
                             if s["__key__"] == key)["json"])["path"]

    plain = CliRunner().invoke(convert_cli, ["verify", str(shards)])
    decoded = CliRunner().invoke(convert_cli, ["verify", str(shards), "--decode"])
    where = f"{shards / 'train-000002.tar'}: sample {key} (source {source})"
    # the frame header already says it: lossless, which not every decoder reads
    assert plain.exit_code == 1 and f"{where}: .jpg is a 8-bit lossless JPEG (SOF3, greyscale)" in plain.output
    assert decoded.exit_code == 1
    assert f"{where}: DALI cannot decode its .jpg" in decoded.output  # and DALI's own decoder proves it
    assert len([line for line in decoded.output.splitlines() if line.startswith(where)]) == 2

    with pytest.raises(ShardDataError, match=rf"train-000002\.tar: sample {key}: DALI cannot decode its \.jpg"):
        for _ in make_loader(shards, "train", 8, augment=AugmentConfig(image_size=16), device="cpu", train=False):
            pass


def test_a_loader_names_the_broken_sample_whichever_batch_it_lands_in(pristine, tmp_path):
    """DALI only says "nvImageCodec failure": the loader re-decodes what it had read to find the sample. Each
    seed shuffles it into another batch; DALI decodes every batch, the dropped last one too."""
    shards, _ = copy_of(pristine, tmp_path)
    expected = break_a_jpeg(shards)
    for seed in (0, 1, 2):
        loader = make_loader(shards, "train", 4, augment=AugmentConfig(image_size=16), device="cpu", seed=seed)
        with pytest.raises(ShardDataError) as raised:
            for _ in loader:
                pass
        assert expected in str(raised.value) and isinstance(raised.value.__cause__, RuntimeError)
