"""`shard-convert info`: what a shard folder holds, from its manifest alone: splits, classes with their
counts, skipped files by reason, the options it was made with, and any DALI index that is missing."""

from __future__ import annotations

import json

from click.testing import CliRunner

from dalifeed.convert.cli import main as convert_cli
from helpers import convert, write_imagefolder


def test_info_shows_classes_reasons_options_and_indexes(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"cat": 7, "dog": 5})
    (src / "cat" / "notes.txt").write_text("no image")
    out = tmp_path / "out"
    convert(src, out, val_fraction=0.3)
    (out / "val-000000.idx").unlink()
    info = json.loads(CliRunner().invoke(convert_cli, ["info", str(out), "--json"]).output)
    # cat: 8 files, 2 to val, and the non-image drawn into train is skipped; dog: 5 files, round(1.5) = 2 to val
    assert info["splits"]["train"]["class_counts"] == {"cat": 5, "dog": 3}
    assert info["splits"]["val"]["class_counts"] == {"cat": 2, "dog": 2}
    assert info["splits"]["val"]["indexes_missing"] == ["val-000000.idx"] and info["options"]["val_fraction"] == 0.3
    assert info["skipped"] == {"not an image (no known image format, PIL cannot identify it)": 1}
    text = CliRunner().invoke(convert_cli, ["info", str(out)]).output
    assert "train: 8 samples in 1 shards" in text and "cat 5 (62.5%), dog 3 (37.5%)" in text
    assert "DALI indexes 1 MISSING (e.g. val-000000.idx)" in text
