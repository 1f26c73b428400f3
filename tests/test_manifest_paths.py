"""A manifest reads only files inside its folder: a shard or index path that leaves it (`../x.tar`, `/abs/x.tar`,
a symlink out) is refused in one line by the reader every command uses (`verify`, `info`, `dali-train`); a
manifest of `index --index-dir` reads its tars from the folder it names on purpose, and says so."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from dalifeed.convert.cli import main as convert_cli
from dalifeed.convert.index import IndexConfig, index_folder
from dalifeed.format import ManifestError, ShardManifest
from dalifeed.train.cli import main as train_cli
from fast_recipe import fast_args


@pytest.fixture
def folder(make_shards, tmp_path) -> Path:
    """A private copy of small shards (the test rewrites its manifest)."""
    shards = make_shards({"train": {"red": 9, "green": 8}, "val": {"red": 3, "green": 3}}, samples_per_shard=5)[1]
    return Path(shutil.copytree(shards, tmp_path / "shards"))


def aim_first_shard(folder: Path, path: str) -> None:
    doc = json.loads((folder / "manifest.json").read_text())
    doc["splits"]["train"]["shards"][0]["path"] = path
    (folder / "manifest.json").write_text(json.dumps(doc))


def one_error(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("Error:") or "leaves the shard folder" in line
             or "outside" in line]
    assert len(lines) == 1 and "Traceback" not in output, output
    return lines[0]


@pytest.mark.parametrize("path", ["../outside/train-000000.tar", "/abs/train-000000.tar", "a/../../x.tar"])
def test_a_path_that_leaves_the_folder_is_refused_by_every_command(folder, tmp_path, path):
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copy(folder / "train-000000.tar", outside / "train-000000.tar")  # a real tar there: only the path is wrong
    aim_first_shard(folder, path)
    said = f"shard path {path!r} leaves the shard folder (paths must be relative, without '..'): a manifest reads " \
           f"only files inside its folder"
    with pytest.raises(ManifestError, match="leaves the shard folder"):
        ShardManifest.load(folder)

    verify = CliRunner().invoke(convert_cli, ["verify", str(folder)])
    assert verify.exit_code == 1 and said in one_error(verify.output), verify.output
    info = CliRunner().invoke(convert_cli, ["info", str(folder)])
    assert info.exit_code == 2 and said in one_error(info.output), info.output
    train = CliRunner().invoke(train_cli, ["--data", str(folder), "--out", str(tmp_path / "run"),
                                           *fast_args(epochs=1, width=8)])
    assert train.exit_code == 2 and said in one_error(train.output), train.output


def test_a_symlink_out_of_the_folder_is_refused(folder, tmp_path):
    outside = tmp_path / "elsewhere.tar"
    shutil.move(folder / "train-000000.tar", outside)
    (folder / "train-000000.tar").symlink_to(outside)
    with pytest.raises(ManifestError, match=rf"train-000000\.tar is a link to {outside}, outside {folder}"):
        ShardManifest.load(folder)
    (folder / "train-000000.tar").unlink()
    shutil.move(outside, folder / "train-000000.tar")
    (folder / "inside").mkdir()
    shutil.move(folder / "train-000001.tar", folder / "inside" / "t.tar")
    (folder / "train-000001.tar").symlink_to(folder / "inside" / "t.tar")  # a link that stays inside: read
    assert ShardManifest.load(folder).num_samples("train") == 17


def test_an_index_dir_manifest_reads_the_tars_it_names_and_says_so(folder, tmp_path):
    """`index --index-dir` writes the manifest apart from tars in a read-only folder: that folder is its tar
    root by its own word, shown by info, verify and dali-train's first lines."""
    tars = tmp_path / "tars"
    tars.mkdir()
    for tar in folder.glob("*.tar"):
        shutil.copy(tar, tars / tar.name)
    index = tmp_path / "index"
    manifest = index_folder(IndexConfig(tars, index_dir=index))
    assert manifest.tar_root == tars
    info = CliRunner().invoke(convert_cli, ["info", str(index)])
    assert info.exit_code == 0 and f"tars: in {tars}" in info.output, info.output
    verify = CliRunner().invoke(convert_cli, ["verify", str(index)])
    assert verify.exit_code == 0, verify.output
    assert verify.output.splitlines()[0] == (f"{index}: its manifest reads the tars from {tars} "
                                             f"(indexed with --index-dir)")
    train = CliRunner().invoke(train_cli, ["--data", str(index), "--out", str(tmp_path / "run"), "--val-split", "none",
                                           *fast_args(epochs=1, width=8)])
    assert train.exit_code == 0, train.output
    assert train.output.splitlines()[0] == f"--data {index}: its manifest reads the tars from {tars} (a folder " \
                                           f"indexed with shard-convert index --index-dir)", train.output
