"""dali-bench end to end on tiny real data; the loaders it races agree on what they produce."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dalifeed.bench.cli import main as bench_cli
from dalifeed.bench.convert_rate import measure, render_markdown
from dalifeed.bench.loaders import race_loader
from dalifeed.bench.make_bench import BEGIN, END, update_doc
from dalifeed.bench.run import environment
from dalifeed.bench.sampler import ResourceSampler, gpu_probes
from dalifeed.pipelines.augment import IMAGENET_MEAN, IMAGENET_STD
from dalifeed.runtime import usable_cores
from helpers import write_imagefolder

MEAN_255, STD_255 = (torch.tensor(v).view(1, 3, 1, 1) * 255 for v in (IMAGENET_MEAN, IMAGENET_STD))


def class_colours(labels: torch.Tensor) -> torch.Tensor:
    """The mean RGB colour helpers.random_image gives each class, one row per label."""
    return torch.stack([(labels * 70) % 256, (labels * 130 + 60) % 256, (255 - labels * 50) % 256], 1).float()


@pytest.fixture(scope="module")
def bench_data(make_shards) -> tuple[Path, Path]:
    return make_shards({"a": 21, "b": 19, "c": 17}, size=(40, 52), samples_per_shard=8)


class PausingLoader:
    """Four batches an epoch; the first of each comes after a pause of `pause` s, the others after 0.01 s."""

    def __init__(self, pause: float):
        self.pause = pause

    def __iter__(self):
        for i in range(4):
            time.sleep(self.pause if i == 0 else 0.01)
            yield torch.zeros(2, 3, 4, 4), torch.zeros(2, dtype=torch.long)


def test_the_pause_before_an_epochs_first_batch_is_measured_in_batch_times():
    from dalifeed.bench.measure import time_loader

    timing = time_loader(PausingLoader(0.2), torch.device("cpu"), warmup_batches=1, seconds=None, batches=8,
                         repeats=2, cores=1)
    assert timing.epoch_starts_timed == 4  # 16 batches timed, every fourth the first of an epoch
    assert timing.epoch_start_batch_times > 5  # 0.2 s against 0.01 s: about 20, however slow the machine
    steady = time_loader(PausingLoader(0.01), torch.device("cpu"), warmup_batches=1, seconds=None, batches=8,
                         repeats=2, cores=1)
    assert steady.epoch_start_batch_times < timing.epoch_start_batch_times


@pytest.mark.parametrize("fp16", [False, True])
@pytest.mark.parametrize("name", ["baseline", "webdataset", "dali-cpu"])
def test_every_loader_yields_the_same_kind_of_batch(bench_data, name, fp16):
    src, shards = bench_data
    loader = race_loader(name, imagefolder=src, shards=shards, split="train", batch_size=4, image_size=24, workers=0,
                          device=torch.device("cpu"), fp16=fp16)
    images, labels = next(iter(loader))
    assert images.shape == (4, 3, 24, 24) and images.dtype == (torch.float16 if fp16 else torch.float32)
    assert labels.shape == (4,) and labels.dtype == torch.int64 and int(labels.max()) < 3
    # normalised with ImageNet's statistics: undone, each image's channel means are its class's colour (to
    # within the noise and JPEG: 7 of 255 measured); raw [0, 1] or [0, 255] floats, other statistics or
    # labels of other images are off by tens
    pixels = images.float() * STD_255 + MEAN_255
    assert (pixels.mean((2, 3)) - class_colours(labels)).abs().max() < 12


def test_dali_bench_cli_writes_table_json_and_plot(bench_data, tmp_path):
    src, shards = bench_data
    out = tmp_path / "out"
    result = CliRunner().invoke(bench_cli, [
        "--imagefolder", str(src), "--shards", str(shards), "--loaders", "baseline,dali-cpu,dali-gpu",
        "--batch-size", "8", "--image-size", "32", "--epochs", "1", "--repeats", "2", "--warmup", "2",
        "--model", "resnet18", "--model-steps", "2", "--out", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads((out / "bench.json").read_text())
    by_name = {r["loader"]: r for r in report["results"]}
    assert set(by_name) == {"baseline", "dali-cpu"}  # dali-gpu skipped without a GPU
    assert by_name["baseline"]["speedup_vs_baseline"] == 1.0
    for r in by_name.values():
        assert len(r["images_per_s_runs"]) == 2 and r["images_per_s"] == pytest.approx(sum(r["images_per_s_runs"]) / 2)
        assert r["output"] == "(8, 3, 32, 32) float32 cpu"
        # CPU clocks tick every 10 ms per process, so a window this short can read a little over 100%
        assert 0 < r["cpu_percent"] < 150 and r["peak_rss_mb"] > 50
        # each window is one epoch's batches, so each holds one epoch's first batch
        assert r["epoch_starts_timed"] == 2 and r["epoch_start_batch_times"] > 0
        # the model's rate fed by this loader, against the one on synthetic data recorded beside it
        assert r["train_vs_synthetic"] == r["train_steps_per_s"] / report["synthetic"]["steps_per_s"]
        assert 0 <= r["data_wait_share"] < 1
    assert report["synthetic"]["images_per_s"] == report["synthetic"]["steps_per_s"] * 8  # batches of 8
    assert by_name["dali-cpu"]["speedup_vs_baseline"] == \
        pytest.approx(by_name["dali-cpu"]["images_per_s"] / by_name["baseline"]["images_per_s"])
    assert report["environment"]["cores"] == usable_cores() and report["synthetic"]["model"] == "resnet18"
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((out / "config.json").read_text())["batch_size"] == 8
    assert "| epoch start |" in result.output and "first batch of an epoch:" in result.output
    assert "| baseline |" in result.output and "| dali-cpu |" in result.output


@pytest.mark.parametrize("args, message", [
    (["--loaders", "baseline,turbo"], "unknown turbo"),
    (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--hw-decoder-load", "2"], "--hw-decoder-load must be in [0, 1]"),
])
def test_bad_usage_is_one_line_exit_2(bench_data, args, message):
    src, shards = bench_data
    result = CliRunner().invoke(bench_cli, ["--imagefolder", str(src), "--shards", str(shards), *args])
    assert result.exit_code == 2 and message in result.output


def test_missing_shards_is_usage_error(bench_data, tmp_path):
    src, _ = bench_data
    result = CliRunner().invoke(bench_cli, ["--imagefolder", str(src), "--shards", str(tmp_path / "none")])
    assert result.exit_code == 2 and "no such shard folder" in result.output


def test_environment_counts_the_cores_this_process_may_use(monkeypatch):
    """Not the machine's CPUs (os.cpu_count): one CPU of a Slurm task is one core in every report."""
    monkeypatch.setenv("SLURM_CPUS_PER_TASK", "1")
    assert environment()["cores"] == 1


BUSY_WORK = bytes(1 << 20)


def test_resource_sampler_reads_its_probes_until_the_block_ends():
    readings = iter([None, 1.0, 3.0] + [5.0] * 10_000)  # None: no reading this time
    threads_before = set(threading.enumerate())
    with ResourceSampler({"probe": lambda: next(readings)}, period=0.01) as sampler:
        start, started = time.process_time(), time.perf_counter()
        while time.process_time() - start < 0.2:  # CPU time, whatever else the machine runs
            # hashing a large buffer releases the GIL, as a loader's C++ work does; a pure-Python busy loop
            # would hand the sampler the GIL only every 5 ms, and psutil's scan of /proc needs it per process
            hashlib.sha256(BUSY_WORK).digest()
        busy = time.perf_counter() - started
    values = sampler.samples["probe"]
    assert values[:2] == [1.0, 3.0] and sampler.mean("probe") == pytest.approx(sum(values) / len(values))
    # 0.18: the kernel counts user and system time apart, each in 10 ms ticks
    assert sampler.cpu_seconds >= 0.18 and sampler.wall_seconds >= busy
    assert sampler.peak("rss_bytes") > 50 * 2**20  # this process, torch loaded
    assert sampler.mean("gpu_util_percent") is None  # no such probe given
    # the sampling thread ended with the block (joined, not left running to add samples later)
    assert set(threading.enumerate()) - threads_before == set()
    assert len(sampler.samples["probe"]) == len(values)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_no_gpu_probes_without_a_gpu():
    assert gpu_probes() == {}


def test_convert_rate_measures_both_rates(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 30, "b": 25})
    result = measure(src, tmp_path / "work", repeats=2, workers=2)
    assert result["images"] == 55
    assert result["megabytes"] == sum(p.stat().st_size for p in src.rglob("*.jpg")) / 1e6
    for rate in ("decode_images_per_s", "convert_images_per_s"):
        low, high = result[f"{rate}_min_max"]
        assert 0 < low <= result[rate] <= high
    # MB/s and images/s of the same runs differ by the mean file size
    assert result["convert_mb_per_s"] == pytest.approx(result["convert_images_per_s"] * result["megabytes"] / 55)
    # the median of each run's convert/decode ratio lies within what the runs' extremes allow
    (decode_low, decode_high), (convert_low, convert_high) = (result["decode_images_per_s_min_max"],
                                                              result["convert_images_per_s_min_max"])
    assert convert_low / decode_high <= result["convert_over_decode"] <= convert_high / decode_low
    assert f"**{result['convert_over_decode']:.2f}x** the pure decode rate" in render_markdown(result)


def test_stage_rates_fall_as_stages_are_added(bench_data):
    from dalifeed.bench.stages import STAGES, render_markdown, stage_rates

    _, shards = bench_data
    # the best of three: windows of a few milliseconds on a shared machine lose a time slice now and then
    runs = [stage_rates(shards, batch_size=8, threads=2, image_size=32, batches=8) for _ in range(3)]
    assert all(list(rates) == list(STAGES) for rates in runs)
    best = {stage: max(rates[stage] for rates in runs) for stage in STAGES}
    assert best["read"] > best["decode (ROI)"] > 0  # reading bytes is always cheaper than decoding them
    table = render_markdown(best, baseline=best["read"])
    for stage, rate in best.items():
        assert f"| {stage} | {rate:.0f} | {rate / best['read']:.2f} |" in table


def test_update_doc_replaces_only_the_generated_section(tmp_path):
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# Benchmarks\n\nhand-written intro\n\n{BEGIN}\nold numbers\n{END}\n\nhand-written notes\n")
    update_doc(doc, f"{BEGIN}\nnew numbers\n{END}")
    text = doc.read_text()
    assert "old numbers" not in text and "new numbers" in text
    assert "hand-written intro" in text and "hand-written notes" in text
