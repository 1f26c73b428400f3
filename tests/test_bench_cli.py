"""`dali-bench` as a user runs it: it refuses to measure nothing (a split smaller than a batch, instead of
hanging) or to race loaders on different data unless allowed, and its model timing is said and plotted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds
from click.testing import CliRunner

from dalifeed.bench.cli import main as bench_cli
from dalifeed.bench.report import LOADER_COLOURS, figure
from helpers import jpeg_bytes, write_imagefolder

PY = sys.executable


@pytest.fixture(scope="module")
def bench_data(make_shards) -> tuple[Path, Path]:
    return make_shards({"a": 11, "b": 9}, size=(40, 52), samples_per_shard=8)


def run_bench(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-m", "dalifeed.bench.cli", *args], capture_output=True, text=True, timeout=timeout)


def test_bench_refuses_a_split_smaller_than_a_batch_instead_of_hanging(bench_data, tmp_path):
    src, shards = bench_data
    result = run_bench("--imagefolder", str(src), "--shards", str(shards), "--batch-size", "64", "--out",
                       str(tmp_path / "b"))
    assert result.returncode == 2 and "--batch-size 64 is more than the 20 samples of split 'train'" in result.stderr


def test_bench_refuses_different_data_unless_allowed(bench_data, tmp_path):
    src, shards = bench_data
    other = write_imagefolder(tmp_path / "other", {"a": 11, "b": 9}, size=(80, 96), seed=5)
    result = CliRunner().invoke(bench_cli, ["--imagefolder", str(other), "--shards", str(shards), "--batch-size", "4"])
    assert result.exit_code == 2 and "not the same data" in result.output
    assert "the same number of files, but other names or sizes" in result.output
    allowed = CliRunner().invoke(bench_cli, ["--imagefolder", str(other), "--shards", str(shards), "--batch-size", "4",
                                             "--loaders", "dali-cpu", "--seconds", "0.2", "--repeats", "1",
                                             "--allow-different-data", "--out", str(tmp_path / "b")])
    assert allowed.exit_code == 0, allowed.output


def test_bench_model_timing_says_how_long_and_plots_both_panels(bench_data, tmp_path):
    src, shards = bench_data
    result = CliRunner().invoke(bench_cli, ["--imagefolder", str(src), "--shards", str(shards), "--batch-size", "4",
                                            "--image-size", "32", "--loaders", "dali-cpu", "--seconds", "0.2",
                                            "--repeats", "1", "--model", "resnet18", "--model-steps", "2",
                                            "--out", str(tmp_path / "b")])
    assert result.exit_code == 0, result.output
    assert "resnet18 on synthetic data: 5 steps, about" in result.output and "s a step" in result.output
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    fig = figure(report)
    data, model = fig.axes
    assert data.patches[0].get_facecolor()[:3] == pytest.approx(_rgb(LOADER_COLOURS["dali-cpu"]))
    assert "src (train, 20 images), 32 px" in fig._suptitle.get_text()
    assert "resnet18 training" in model.get_title() and len(model.patches) == 1


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    return tuple(int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5))


def test_bench_of_gpu_loaders_without_a_gpu_is_one_line_exit_2(bench_data, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: dali-gpu runs")
    src, shards = bench_data
    result = run_bench("--imagefolder", str(src), "--shards", str(shards), "--batch-size", "4",
                       "--loaders", "dali-gpu,dali-hybrid", "--out", str(tmp_path / "b"))
    assert result.returncode == 2, result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert errors == ["Error: --loaders dali-gpu,dali-hybrid: none can run here (dali-gpu: skipped (no GPU); "
                      "dali-hybrid: skipped (no GPU)); add one that can, e.g. --loaders dali-cpu"], result.stderr
    assert "unexpected" not in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "b").exists()


def adopted_folder(root: Path) -> Path:
    """Tars webdataset's ShardWriter wrote (no ImageFolder behind them), indexed with `shard-convert index`."""
    root.mkdir(parents=True)
    with wds.ShardWriter(str(root / "train-%06d.tar"), maxcount=6, verbose=0) as sink:
        for i in range(17):
            sink.write({"__key__": f"{i:06d}", "jpg": jpeg_bytes(np.full((24, 20, 3), 40 * (i % 3), np.uint8)),
                        "cls": i % 3})
    indexed = subprocess.run([PY, "-m", "dalifeed.convert.cli", "index", str(root)], capture_output=True, text=True,
                             timeout=120)
    assert indexed.returncode == 0, indexed.stderr
    return root


def test_bench_of_an_adopted_folder_needs_no_imagefolder_for_shard_loaders(tmp_path):
    shards = adopted_folder(tmp_path / "ds")
    result = run_bench("--shards", str(shards), "--batch-size", "4", "--loaders", "dali-cpu,webdataset",
                       "--seconds", "0.2", "--repeats", "1", "--warmup", "1", "--out", str(tmp_path / "b"))
    assert result.returncode == 0, result.stderr
    report = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert [r["loader"] for r in report["results"]] == ["dali-cpu", "webdataset"]

    # the baseline reads an ImageFolder: that, and only that, asks for one
    baseline = run_bench("--shards", str(shards), "--batch-size", "4", "--out", str(tmp_path / "c"))
    assert baseline.returncode == 2
    assert [line for line in baseline.stderr.splitlines() if line.startswith("Error:")] == [
        "Error: --imagefolder is required by the baseline loader (the ImageFolder tree the shards were made from); "
        "without one, race only the loaders that read the shards: --loaders webdataset,dali-cpu,dali-hybrid,dali-gpu"]


def test_bench_races_at_each_size_given(bench_data, tmp_path):
    """--image-size 16,24 (a progressive schedule's sizes): one race per size, each its own report, and the
    sizes side by side in sizes.json."""
    _, shards = bench_data
    out = tmp_path / "sizes"
    result = run_bench("--shards", str(shards), "--batch-size", "4", "--loaders", "dali-cpu", "--image-size", "16,24",
                       "--seconds", "0.2", "--repeats", "1", "--warmup", "1", "--out", str(out))
    assert result.returncode == 0, result.stderr
    for size in (16, 24):
        report = json.loads((out / f"{size}px" / "bench.json").read_text())
        assert report["config"]["image_size"] == size
        assert report["results"][0]["output"] == f"(4, 3, {size}, {size}) float32 cpu"
    summary = json.loads((out / "sizes.json").read_text())
    assert summary["image_sizes"] == [16, 24] and summary["vs_first_size"]["16"] == {"dali-cpu": 1.0}
    assert summary["images_per_s"]["24"]["dali-cpu"] > 0
    bad = run_bench("--shards", str(shards), "--image-size", "16,x", "--out", str(tmp_path / "bad"))
    assert bad.returncode == 2 and "'16,x': one size in pixels, or several separated by commas" in bad.stderr


def test_help_shows_the_options_without_importing_torch_or_dali():
    """`dali-bench --help` without the loaders' imports (torch, DALI): the names its checks need are in
    bench/names.py and pipelines/names.py, the loaders imported where a race starts."""
    probe = ("import sys; from click.testing import CliRunner; from dalifeed.bench.cli import main; "
             "result = CliRunner().invoke(main, ['--help']); "
             "print(result.exit_code, '--auto-augment' in result.output, 'ta_wide' in result.output, "
             "sorted(m for m in ('torch', 'nvidia.dali', 'dalifeed.bench.run') if m in sys.modules))")
    out = subprocess.run([PY, "-c", probe], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["0", "True", "True", "[]"]


def test_a_race_leaves_nothing_in_tmpdir(bench_data, tmp_path):
    """The race's temporary files (DataLoader workers' pymp-*, torch's inductor cache, the peers' chunks and
    locks) go to a folder of its own, removed at the end: $TMPDIR is as it was."""
    import os
    import shutil
    import tempfile

    src, shards = bench_data
    tmp = Path(tempfile.mkdtemp(prefix="tmpdir"))  # short, as a TMPDIR is: the workers' sockets go below it
    result = subprocess.run([PY, "-m", "dalifeed.bench.cli", "--imagefolder", str(src), "--shards", str(shards),
                             "--batch-size", "4", "--image-size", "32", "--loaders", "baseline,webdataset,dali-cpu",
                             "--seconds", "0.2", "--repeats", "1", "--model", "resnet18", "--model-steps", "2",
                             "--out", str(tmp_path / "b")], capture_output=True, text=True, timeout=300,
                            env={**os.environ, "TMPDIR": str(tmp)})
    left = sorted(p.name for p in tmp.iterdir())
    shutil.rmtree(tmp)
    assert result.returncode == 0, result.stderr[-2000:]
    assert left == []
