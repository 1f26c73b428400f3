"""What a user can hand `shard-convert`: unreadable entries in the source (broken symlinks, symlink loops,
FIFOs, sockets, files and folders that cannot be read) are each one skipped entry with its reason; folders
named like splits at the top of SRC are splits, or the conversion is refused saying how to say what was
meant; and every bad command line or input ends in one line and the right exit code, never in "unexpected
... please report it"."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import socket
from pathlib import Path

import pytest
import webdataset as wds
from click.testing import CliRunner

import helpers
from dalifeed.convert.cli import main as cli
from dalifeed.format import ShardManifest
from dalifeed.pipelines import AugmentConfig
from dalifeed.usage import parse_size
from helpers import write_coco, write_imagefolder

CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH, PR_CAPBSET_DROP = 1, 2, 24


def shard_convert(*args, drop_root_file_access: bool = False, timeout: float = 120):
    """The real CLI in a child process (a FIFO read by mistake blocks it, which a timeout then shows).
    `drop_root_file_access`: as root, drop the capabilities that let root read any file, so that file
    permissions apply to the child as they would to any user."""
    preexec = drop_file_capabilities if drop_root_file_access and os.geteuid() == 0 else None
    return helpers.shard_convert(*args, timeout=timeout, preexec_fn=preexec)


def drop_file_capabilities() -> None:
    """In the child, before exec: remove CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding set, so
    root's program gets neither and a chmod 000 file cannot be read."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH):
        if libc.prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) != 0:
            os._exit(99)  # the parent's test skips on this exit code


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("Error:")]


def converted_paths(out: Path, manifest: ShardManifest) -> list[str]:
    """The source path of every sample in every split, from the shards themselves."""
    paths = []
    for split in manifest.splits:
        for sample in wds.WebDataset([str(p) for p in manifest.shard_paths(split)], shardshuffle=False,
                                     empty_check=False):
            doc = json.loads(sample["json"])
            paths.append(doc.get("path") or doc["image"]["file_name"])
    return paths


def every_entry(src: Path) -> set[str]:
    """Every entry under `src` a conversion must account for, one by one, listed without following any
    symlink: files, broken or looping symlinks, FIFOs, sockets, and symlinks to folders."""
    found = set()
    for dirpath, dirnames, filenames in os.walk(src):  # lists a symlinked folder in dirnames, without entering it
        names = filenames + [name for name in dirnames if Path(dirpath, name).is_symlink()]
        found |= {Path(dirpath, name).relative_to(src).as_posix() for name in names}
    return found


def make_tree(root: Path, folders: dict[str, dict[str, int]]) -> Path:
    for i, (folder, classes) in enumerate(folders.items()):
        write_imagefolder(root / folder, classes, seed=i)
    return root


def run_cli(*args, cwd: Path | None = None):
    if cwd is not None:
        old = Path.cwd()
        os.chdir(cwd)
    try:
        return CliRunner().invoke(cli, [str(a) for a in args])
    finally:
        if cwd is not None:
            os.chdir(old)


def manifest_doc(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def split_sizes(doc: dict) -> dict[str, int]:
    return {name: split["samples"] for name, split in doc["splits"].items()}


# ----------------------------------------------------------------------------------------------------
# unreadable entries (issue 18, item 5)


@pytest.fixture
def tree_with_unreadable_entries(tmp_path: Path) -> Path:
    """An ImageFolder tree with, among good JPEGs, every kind of entry no image can be read from."""
    src = write_imagefolder(tmp_path / "src", {"a": 4, "b": 3})
    (src / "a" / "dangling.jpg").symlink_to(tmp_path / "gone" / "x.jpg")
    (src / "a" / "loop.jpg").symlink_to("loop.jpg")
    os.mkfifo(src / "a" / "pipe.jpg")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(src / "b" / "socket.jpg"))
    (src / "b" / "io-error.jpg").symlink_to("/proc/self/mem")  # a regular file whose read fails (EIO)
    (src / "b" / "up").symlink_to("..")  # a folder loop: a walk following it would never end
    (src / "c").symlink_to(tmp_path / "unmounted" / "c")  # a class folder on a disk that is not there
    return src


def unreadable_reasons(tmp_path: Path) -> dict[str, str]:
    """The skip reason of each unreadable entry of `tree_with_unreadable_entries`."""
    return {
        "a/dangling.jpg": f"unreadable: broken symlink to {tmp_path / 'gone' / 'x.jpg'} (No such file or directory)",
        "a/loop.jpg": "unreadable: symlink loop (links to loop.jpg)",
        "a/pipe.jpg": "not a regular file: a FIFO (named pipe)",
        "b/socket.jpg": "not a regular file: a socket",
        "b/io-error.jpg": "unreadable: Input/output error",
        "b/up": "unreadable: symlink loop (links to .., a folder above it)",
        "c": f"unreadable: broken symlink to {tmp_path / 'unmounted' / 'c'} (No such file or directory)",
    }


def test_unreadable_entries_are_each_one_skipped_entry_with_the_reason(tree_with_unreadable_entries, tmp_path):
    src = tree_with_unreadable_entries
    result = shard_convert("imagefolder", src, tmp_path / "out", "--workers", "2")
    assert result.returncode == 0, result.stderr
    manifest = ShardManifest.load(tmp_path / "out")
    skipped = {entry["path"]: entry["reason"] for entry in manifest.skipped}
    assert skipped == unreadable_reasons(tmp_path)
    converted = converted_paths(tmp_path / "out", manifest)
    assert sorted(converted) == sorted(f"{c}/{c}_{i:04d}.jpg" for c, n in (("a", 4), ("b", 3)) for i in range(n))
    assert set(converted) | set(skipped) == every_entry(src)
    assert manifest.found == len(converted) + len(skipped) == 14
    assert "skipped 7 (2 not a regular file; 5 unreadable)" in result.stdout


def test_on_error_fail_stops_at_an_unreadable_entry_naming_it(tree_with_unreadable_entries, tmp_path):
    result = shard_convert("imagefolder", tree_with_unreadable_entries, tmp_path / "out", "--on-error", "fail")
    assert result.returncode == 1
    assert error_lines(result.stderr) == [line for line in result.stderr.splitlines() if "Error" in line]
    [line] = error_lines(result.stderr)  # the first in write order (shuffled) of those under a class folder
    stops_at = [path for path, reason in unreadable_reasons(tmp_path).items() if path != "c" and
                line.startswith(f"Error: {path}: {reason}")]
    assert len(stops_at) == 1, line
    assert "please report" not in result.stderr
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_files_and_folders_without_read_permission_are_skipped(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 3, "b": 2})
    secret, locked = src / "a" / "a_0000.jpg", src / "b" / "locked"
    write_imagefolder(locked, {"inner": 2})
    splits = make_tree(tmp_path / "splits", {"train": {"a": 2}, "validation": {"a": 1}})
    for path in (secret, locked, splits / "validation"):
        path.chmod(0)
    try:
        result = shard_convert("imagefolder", src, tmp_path / "out", drop_root_file_access=True)
        if result.returncode == 99:
            pytest.skip("cannot drop root's file capabilities here (prctl PR_CAPBSET_DROP refused)")
        refused = shard_convert("imagefolder", src / "b", tmp_path / "out2", drop_root_file_access=True)
        fail = shard_convert("imagefolder", src, tmp_path / "out3", "--on-error", "fail", drop_root_file_access=True)
        split_refused = shard_convert("imagefolder", splits, tmp_path / "out4", drop_root_file_access=True)
    finally:
        secret.chmod(0o644)
        locked.chmod(0o755)
        (splits / "validation").chmod(0o755)
    assert result.returncode == 0, result.stderr
    manifest = ShardManifest.load(tmp_path / "out")
    assert {e["path"]: e["reason"] for e in manifest.skipped} == {
        "a/a_0000.jpg": "unreadable: Permission denied", "b/locked": "unreadable folder: Permission denied"}
    assert manifest.num_samples("train") == 4 and manifest.found == 6
    # a class folder that cannot be read is a class without images: refused, naming it
    assert refused.returncode == 2
    assert error_lines(refused.stderr) == [f"Error: {src / 'b' / 'locked'}: cannot read this class folder "
                                           f"(Permission denied)"]
    assert fail.returncode == 1
    [line] = error_lines(fail.stderr)  # whichever comes first in write order
    assert line.startswith(("Error: a/a_0000.jpg: unreadable: Permission denied (",
                            "Error: b/locked: unreadable folder: Permission denied (")), line
    assert split_refused.returncode == 2
    assert error_lines(split_refused.stderr) == [f"Error: {splits / 'validation'}: cannot read this folder "
                                                 f"(Permission denied)"]


def test_coco_image_entries_that_cannot_be_read_are_skipped_with_their_annotations(tmp_path):
    images, instances = write_coco(tmp_path / "coco")
    (images / "000000000003.jpg").unlink()
    (images / "000000000003.jpg").symlink_to(tmp_path / "gone.jpg")
    (images / "000000000005.jpg").unlink()
    os.mkfifo(images / "000000000005.jpg")
    (images / "000000000007.jpg").unlink()
    (images / "000000000007.jpg").symlink_to("000000000007.jpg")
    result = shard_convert("coco", tmp_path / "out", "--images", images, "--annotations", instances)
    assert result.returncode == 0, result.stderr
    manifest = ShardManifest.load(tmp_path / "out")
    split = next(iter(manifest.splits))
    skipped = {e["path"]: e["reason"] for e in manifest.skipped}
    doc = json.loads(instances.read_text())
    anns = {r["file_name"]: sum(a["image_id"] == r["id"] for a in doc["annotations"]) for r in doc["images"]}
    assert skipped[f"{split}/000000000003.jpg"] == (f"unreadable: broken symlink to {tmp_path / 'gone.jpg'} (No such "
                                                    f"file or directory) ({anns['000000000003.jpg']} annotations not "
                                                    f"converted)")
    assert skipped[f"{split}/000000000005.jpg"] == (f"not a regular file: a FIFO (named pipe) "
                                                    f"({anns['000000000005.jpg']} annotations not converted)")
    assert skipped[f"{split}/000000000007.jpg"].startswith("unreadable: symlink loop (links to 000000000007.jpg)")
    assert skipped["000000000004.jpg"].startswith("missing: No such file or directory")  # no file at all: as before
    assert manifest.found == len(doc["images"]) == manifest.num_samples(split) + len(manifest.skipped)

    fail = shard_convert("coco", tmp_path / "out2", "--images", images, "--annotations", instances,
                         "--on-error", "fail", "--workers", "1")
    assert fail.returncode == 1
    [line] = error_lines(fail.stderr)
    assert line.startswith(f"Error: {split}/0000000000"), line
    assert "please report" not in fail.stderr


# ----------------------------------------------------------------------------------------------------
# split folders (issue 18, item 7)


@pytest.mark.parametrize("folders, splits", [
    (("train", "validation"), {"train": "train", "val": "validation"}),
    (("train", "test"), {"train": "train", "test": "test"}),
    (("train", "val", "test"), {"train": "train", "val": "val", "test": "test"}),
    (("Train", "Valid", "Testing"), {"train": "Train", "val": "Valid", "test": "Testing"}),
    (("training", "eval"), {"train": "training", "val": "eval"}),
    (("train",), {"train": "train"}),
])
def test_split_folders_become_splits_and_the_manifest_says_from_which_folder(tmp_path, folders, splits):
    sizes = [{"a": 5, "b": 4}, {"a": 2, "b": 3}, {"a": 1, "b": 2}]
    src = make_tree(tmp_path / "src", dict(zip(folders, sizes)))
    result = run_cli("imagefolder", src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    doc = manifest_doc(tmp_path / "out")
    assert doc["classes"] == ["a", "b"]
    assert doc["split_folders"] == splits
    assert list(doc["splits"]) == list(splits)
    assert split_sizes(doc) == {split: sum(size.values()) for split, size in zip(splits, sizes)}
    for split, folder in splits.items():  # each sample is the file of its split's folder, under its class
        manifest = ShardManifest.load(tmp_path / "out")
        for sample in wds.WebDataset([str(p) for p in manifest.shard_paths(split)], shardshuffle=False):
            meta = json.loads(sample["json"])
            assert meta["path"].startswith(f"{folder}/{meta['class']}/") and meta["label"] == "ab".index(meta["class"])
            assert sample["jpg"] == (src / meta["path"]).read_bytes()


def test_dali_train_default_val_split_finds_a_validation_folder(tmp_path):
    from dalifeed.cliutil import default
    from dalifeed.pipelines import make_loader
    from dalifeed.train.config import TrainConfig

    src = make_tree(tmp_path / "src", {"train": {"a": 6, "b": 5}, "validation": {"a": 3, "b": 2}})
    assert run_cli("imagefolder", src, tmp_path / "out").exit_code == 0
    val_split = default(TrainConfig, "val_split")  # what dali-train evaluates on unless told otherwise
    labels = [int(y) for _, batch in zip(range(3), make_loader(tmp_path / "out", val_split, 5,
                                                               augment=AugmentConfig(image_size=16), device="cpu",
                                                               train=False)) for y in batch[1]]
    assert sorted(labels) == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("folders, message", [
    (("train", "cat", "dog"), "split folders (train/) beside other folders (cat/, dog/): add --top-level splits"),
    (("train", "val", "extra"), "split folders (train/, val/) beside other folders (extra/)"),
    (("val", "validation"), "val/ and validation/ would both be split 'val'"),
])
def test_a_top_level_mixing_split_and_other_names_is_refused_in_one_line(tmp_path, folders, message):
    src = make_tree(tmp_path / "src", {name: {"a": 2, "b": 2} for name in folders})
    result = run_cli("imagefolder", src, tmp_path / "out")
    assert result.exit_code == 2
    [line] = error_lines(result.stderr)
    assert line.startswith(f"Error: {src}: ") and message in line, line
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_top_level_option_says_what_the_folders_are(tmp_path):
    src = make_tree(tmp_path / "src", {"train": {"a": 3, "b": 2}, "cat": {"x": 2}, "dog": {"y": 1}})
    as_classes = run_cli("imagefolder", src, tmp_path / "classes", "--top-level", "classes")
    assert as_classes.exit_code == 0, as_classes.output
    doc = manifest_doc(tmp_path / "classes")
    assert doc["classes"] == ["cat", "dog", "train"] and doc["split_folders"] == {"train": "."}
    assert split_sizes(doc) == {"train": 8}

    as_splits = run_cli("imagefolder", src, tmp_path / "splits", "--top-level", "splits")
    assert as_splits.exit_code == 0, as_splits.output
    doc = manifest_doc(tmp_path / "splits")
    assert doc["classes"] == ["a", "b"] and doc["split_folders"] == {"train": "train"}
    assert split_sizes(doc) == {"train": 5}
    assert {e["path"]: e["reason"] for e in doc["skipped"]} == {
        "cat/x/x_0000.jpg": "outside any class folder", "cat/x/x_0001.jpg": "outside any class folder",
        "dog/y/y_0000.jpg": "outside any class folder"}
    assert doc["found"] == 8

    no_splits = run_cli("imagefolder", tmp_path / "src" / "cat", tmp_path / "none", "--top-level", "splits")
    assert no_splits.exit_code == 2 and "no folder at its top is named like a split" in no_splits.stderr


def test_val_fraction_with_split_folders_holds_val_out_of_train(tmp_path):
    src = make_tree(tmp_path / "src", {"train": {"a": 10, "b": 10}, "test": {"a": 3, "b": 3}})
    result = run_cli("imagefolder", src, tmp_path / "out", "--val-fraction", "0.2")
    assert result.exit_code == 0, result.output
    doc = manifest_doc(tmp_path / "out")
    assert doc["split_folders"] == {"train": "train", "val": "train", "test": "test"}
    assert split_sizes(doc) == {"train": 16, "val": 4, "test": 6}
    assert doc["splits"]["val"]["class_counts"] == [2, 2]
    manifest = ShardManifest.load(tmp_path / "out")
    paths = {split: {json.loads(s["json"])["path"] for s in wds.WebDataset(
        [str(p) for p in manifest.shard_paths(split)], shardshuffle=False)} for split in manifest.splits}
    assert not paths["train"] & paths["val"] and all(p.startswith("train/") for p in paths["train"] | paths["val"])
    assert doc["source_listing"]["files"] == 20  # dali-bench --imagefolder SRC/train matches train + val

    refused = run_cli("imagefolder", make_tree(tmp_path / "src2", {"train": {"a": 3}, "validation": {"a": 2}}),
                      tmp_path / "out2", "--val-fraction", "0.2")
    assert refused.exit_code == 2
    assert error_lines(refused.stderr) == [f"Error: {tmp_path / 'src2'}: has a validation folder already "
                                           f"(validation/, split 'val'); drop --val-fraction"]


def test_an_unlabelled_split_folder_is_refused(tmp_path):
    src = make_tree(tmp_path / "src", {"train": {"a": 3, "b": 2}})
    (src / "test").mkdir()
    (src / "test" / "0001.jpg").write_bytes((src / "train" / "a" / "a_0000.jpg").read_bytes())
    result = run_cli("imagefolder", src, tmp_path / "out")
    assert result.exit_code == 2
    [line] = error_lines(result.stderr)
    assert line.startswith(f"Error: {src / 'test'}: no class folders") and "unlabelled split" in line


# ----------------------------------------------------------------------------------------------------
# every plain command ends in one line and the right exit code


def test_sizes_mean_what_their_units_say():
    assert parse_size("512MB") == 512 * 10**6 and parse_size("256MiB") == 256 * 2**20
    assert parse_size("1.5KB") == 1500 and parse_size("1KiB") == 1024 and parse_size("4096") == 4096
    for bad, why in (("64Kb", "'b' is a bit"), ("64K", "write KB"), ("twelve", "not a size"), ("5XB", "unknown unit")):
        with pytest.raises(ValueError, match=why):
            parse_size(bad)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """Inputs and outputs the table below refers to by relative path."""
    ws = tmp_path_factory.mktemp("inputs")
    write_imagefolder(ws / "src", {"a": 3, "b": 2})
    (ws / "afile").write_text("not a folder")
    (ws / "empty").mkdir()
    write_imagefolder(ws / "noimages", {"a": 0})
    (ws / "noimages" / "a" / "readme.txt").write_text("no image here")
    (ws / "noimages" / "a" / "broken.jpg").symlink_to(ws / "gone.jpg")
    images, instances = write_coco(ws / "coco")
    (ws / "notjson.json").write_text("{images: []")
    (ws / "list.json").write_text("[1, 2]")
    (ws / "nococo.json").write_text('{"images": []}')
    runner = CliRunner()
    assert runner.invoke(cli, ["imagefolder", str(ws / "src"), str(ws / "shards")]).exit_code == 0
    assert runner.invoke(cli, ["coco", str(ws / "cocoshards"), "--images", str(images),
                               "--annotations", str(instances)]).exit_code == 0
    (ws / "badjob" / ".dalifeed-jobs").mkdir(parents=True)
    (ws / "badjob" / ".dalifeed-jobs" / "job-0000-of-0002.json").write_text('{"job": ')
    (ws / "evilsplit" / ".dalifeed-jobs").mkdir(parents=True)
    (ws / "evilsplit" / ".dalifeed-jobs" / "job-0000-of-0001.json").write_text(
        '{"job": {"index": 0, "count": 1}, "splits": {"../evil": {"shards": []}}}')
    return ws


COCO_IN = ("--images", "coco/images", "--annotations", "coco/instances_mini.json")

CASES = [
    # (command line, exit code, what the one line says)
    (["imagefolder", "src", "afile"], 2, "afile: output exists and is not a folder"),
    (["imagefolder", "src", "afile/out"], 2, "afile/out: cannot create the output folder (Not a directory)"),
    (["imagefolder", "src", "src/out"], 2, "src/out: output folder must not be inside the source folder src"),
    (["imagefolder", "src", "src"], 2, "src: output folder must not be inside the source folder src"),
    (["imagefolder", "afile", "out"], 2, "afile: source is not a folder"),
    (["imagefolder", "missing", "out"], 2, "missing: source folder does not exist"),
    (["imagefolder", "empty", "out"], 2, "empty: no class folders"),
    (["imagefolder", "noimages", "out"], 1, "noimages: no image could be converted: 2 of 2 skipped (1 not an image"),
    (["imagefolder", "src", "out", "--max-shard-bytes", "0"], 2, "--max-shard-bytes must be >= 4096, got 0"),
    (["imagefolder", "src", "out", "--max-shard-bytes", "-5"], 2, "not a size: '-5'"),
    (["imagefolder", "src", "out", "--samples-per-shard", "-1"], 2, "--samples-per-shard must be >= 1, got -1"),
    (["imagefolder", "src", "out", "--num-jobs", "2", "--job-index", "5"], 2, "--job-index must be in 0..1"),
    (["imagefolder", "src", "out", "--num-jobs", "0"], 2, "--num-jobs must be >= 1, got 0"),
    (["imagefolder", "src", "out", "--job-index", "-1"], 2, "--job-index must be in 0..0"),
    (["imagefolder", "src", "out", "--max-side", "0"], 2, "--max-side must be >= 8, got 0"),
    (["imagefolder", "src", "out", "--max-pixels", "-1"], 2, "--max-pixels must be >= 1, got -1"),
    (["imagefolder", "src", "out", "--jpeg-quality", "101"], 2, "--jpeg-quality must be in 1..100, got 101"),
    (["imagefolder", "src", "out", "--val-fraction", "-0.1"], 2, "--val-fraction must be in [0, 1), got -0.1"),
    (["imagefolder", "src", "out", "--val-fraction", "0.1"], 2,  # 3 and 2 images a class: none held out
     "--val-fraction 0.1 holds out no image: round(n x 0.1) is 0 for every class (the largest has 3): raise it above "
     "0.17, or drop it for no val split"),
    (["imagefolder", "src", "out", "--top-level", "maybe"], 2, "'maybe' is not one of 'auto', 'splits', 'classes'"),
    (["imagefolder", "src", "out", "--staging", "stage"], 2, "--staging applies only to an s3://bucket/prefix OUT"),
    (["coco", "out", "--images", "coco/images"], 2, "Missing option '--annotations'"),
    (["coco", "out", "--images", "coco/images", "--annotations", "notjson.json"], 2, "notjson.json: not a JSON file"),
    (["coco", "out", "--images", "coco/images", "--annotations", "list.json"], 2,
     "list.json: top level must be a JSON object"),
    (["coco", "out", "--images", "coco/images", "--annotations", "nococo.json"], 2,
     "nococo.json: missing key 'annotations'"),
    (["coco", "out", "--images", "coco/images", "--annotations", "coco"], 2,
     "coco: --annotations is a folder, not an instances file"),
    (["coco", "out", "--images", "coco/images", "--annotations", "missing.json"], 2,
     "missing.json: instances file does not exist"),
    (["coco", "out", "--images", "afile", "--annotations", "coco/instances_mini.json"], 2,
     "afile: --images is not a folder"),
    (["coco", "coco/images/out", *COCO_IN], 2, "coco/images/out: output folder must not be inside the image folder"),
    (["coco", "afile", *COCO_IN], 2, "afile: output exists and is not a folder"),
    (["verify", "afile"], 2, "afile: no such shard folder"),
    (["verify", "missing"], 2, "missing: no such shard folder"),
    (["verify", "empty"], 1, "empty/manifest.json: missing (not a dalifeed shard folder"),
    (["info", "afile"], 2, "afile: no such shard folder"),
    (["info", "empty"], 2, "empty/manifest.json: missing"),
    (["info", "src"], 2, "src/manifest.json: missing"),
    (["export-coco", "cocoshards", "nofolder/instances.json"], 2, "nofolder: no such folder"),
    (["export-coco", "cocoshards", "empty"], 2, "empty: is a folder; give the instances file to write"),
    (["export-coco", "cocoshards", "afile/instances.json"], 2, "afile: is not a folder"),
    (["export-coco", "shards", "x.json"], 2, "shards: made from imagefolder, not COCO"),
    (["export-coco", "empty", "x.json"], 2, "empty/manifest.json: missing"),
    (["export-coco", "cocoshards", "x.json", "--split", "nope"], 2, "no split 'nope'"),
    # a folder that takes no new file: named as DEST, not as the temporary name beside it
    (["export-coco", "cocoshards", "/proc/x.json"], 2, "/proc/x.json: cannot write a file in /proc"),
    (["merge", "empty"], 2, "empty: no job records"),
    (["merge", "badjob"], 2, "job-0000-of-0002.json: unreadable job record"),
    # a split name becomes part of file names: one rule (format.check_split_name) wherever one is given
    (["merge", "evilsplit"], 2, "job-0000-of-0001.json: unreadable job record ('../evil': not a split name"),
    (["coco", "out", *COCO_IN, "--split", "../evil"], 2, "split '../evil': not a split name: it becomes part of file"),
    (["coco", "out", *COCO_IN, "--split", ".hidden"], 2, "split '.hidden': not a split name"),
    (["coco", "out", *COCO_IN, "--split", "a b"], 2, "split 'a b': not a split name"),
    (["index", "src", "--split", "../evil"], 2, "--split '../evil': not a split name: it becomes part of file names"),
    (["index", "src", "--split", "a/b"], 2, "--split 'a/b': not a split name"),
    (["index", "src", "--split", "x..y"], 2, "--split 'x..y': not a split name"),
    (["index", "src", "--split", ""], 2, "--split '': a split name cannot be empty"),
    (["index", "src", "--label-member", "png"], 2, "--label-member png: an image's extension; the label member is"),
    (["index", "src", "--index-dir", "afile"], 2, "--index-dir afile: not a folder"),
    (["index", "s3://bucket/tars", "--index-dir", "idx"], 2, "--index-dir works with a local SRC and a local folder"),
]


@pytest.mark.parametrize("args, code, says", CASES, ids=[" ".join(c[0]) for c in CASES])
def test_a_plain_command_ends_in_one_line_and_its_exit_code(workspace, args, code, says):
    result = run_cli(*args, cwd=workspace)
    assert result.exit_code == code, result.output
    assert "please report" not in result.output and "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.startswith("Error:") or says in line]
    assert len(lines) == 1 and says in lines[0], result.output
    shutil.rmtree(workspace / "out", ignore_errors=True)  # what a refused conversion left (a lock, an error log)
