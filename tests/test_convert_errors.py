"""Bad input is reported and accounted for; interrupted runs (an exception, Ctrl-C, SIGTERM, kill -9, a full
disk) resume to the same bytes, and leave no worker or lock behind; verify catches damage."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import tarfile
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import psutil
import pytest
import webdataset as wds
from click.testing import CliRunner
from PIL import Image

from dalifeed.convert import ConvertConfig, convert_imagefolder, verify_shards
from dalifeed.convert.cli import main as cli
from helpers import (
    assert_same_folder,
    convert,
    hold_lock,
    jpeg_bytes,
    limit_file_size,
    png_bytes,
    random_image,
    shard_convert,
    wait_for,
    write_imagefolder,
)

PY = sys.executable


def run_cli(*args: str):
    return CliRunner().invoke(cli, [str(a) for a in args])


@pytest.fixture
def messy_folder(tmp_path: Path) -> Path:
    """Good JPEGs plus every kind of trouble a scraped dataset has."""
    src = write_imagefolder(tmp_path / "messy", {"a": 5, "b": 4})
    rng = np.random.default_rng(7)
    good = jpeg_bytes(random_image(rng, (40, 30)))
    (src / "a" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (src / "a" / "noise.jpg").write_bytes(rng.integers(0, 256, 3000, dtype=np.uint8).tobytes())
    (src / "a" / "notes.txt").write_text("not an image")
    (src / "a" / "empty.jpg").write_bytes(b"")  # a download that never arrived
    (src / "b" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (src / "b" / "png_named.jpg").write_bytes(png_bytes(Image.fromarray(random_image(rng, (20, 20)))))
    (src / "b" / "jpeg_named.png").write_bytes(good)
    Image.fromarray(random_image(rng, (20, 20))).convert("CMYK").save(src / "b" / "cmyk.jpg", format="JPEG")
    Image.fromarray(random_image(rng, (20, 20))).convert("RGBA").save(src / "b" / "alpha.png")
    Image.fromarray(random_image(rng, (20, 20))).convert("P").save(src / "b" / "palette.gif")
    Image.fromarray(random_image(rng, (20, 20))[:, :, 0]).save(src / "b" / "grey.bmp")
    Image.fromarray(random_image(rng, (20, 20))).save(src / "b" / "photo.webp")
    Image.fromarray(random_image(rng, (20, 20))).save(src / "b" / "scan.tiff")
    (src / "stray.jpg").write_bytes(good)
    return src


def test_every_file_is_converted_or_skipped_with_reason(messy_folder, tmp_path):
    manifest = convert(messy_folder, tmp_path / "out")
    all_files = [p for p in messy_folder.rglob("*") if p.is_file()]
    skipped = {s["path"]: s["reason"] for s in manifest.skipped}
    assert manifest.found == len(all_files) == manifest.num_samples("train") + len(skipped)
    assert set(skipped) == {"a/truncated.jpg", "a/noise.jpg", "a/notes.txt", "a/empty.jpg", "b/.DS_Store",
                            "stray.jpg"}
    assert "truncated" in skipped["a/truncated.jpg"]
    assert skipped["a/notes.txt"].startswith("not an image")
    assert skipped["a/empty.jpg"] == "empty file (0 bytes)"
    assert skipped["stray.jpg"] == "outside any class folder"

    metas = {}
    for s in wds.WebDataset([str(p) for p in manifest.shard_paths("train")], shardshuffle=False):
        meta = json.loads(s["json"])
        metas[meta["path"]] = meta
        img = Image.open(io.BytesIO(s["jpg"]))
        assert img.format == "JPEG" and img.mode in ("RGB", "L")
        if meta["reencoded"] == "":
            assert s["jpg"] == (messy_folder / meta["path"]).read_bytes()
    assert metas["b/jpeg_named.png"]["reencoded"] == ""  # passed through: judged by content, not by name
    assert metas["b/png_named.jpg"]["reencoded"] == "png"
    assert metas["b/cmyk.jpg"]["reencoded"] == "cmyk-jpeg"
    assert {metas[f"b/{n}"]["reencoded"] for n in ("alpha.png", "palette.gif", "grey.bmp", "photo.webp", "scan.tiff")} \
        == {"png", "gif", "bmp", "webp", "tiff"}
    assert manifest.reencoded["count"] == 7
    assert verify_shards(manifest.root, decode=True).ok


def test_alpha_is_composited_on_white(tmp_path):
    src = tmp_path / "src" / "a"
    src.mkdir(parents=True)
    transparent = Image.new("RGBA", (16, 16), (0, 0, 0, 0))
    transparent.save(src / "clear.png")
    manifest = convert(src.parent, tmp_path / "out")
    sample = next(iter(wds.WebDataset([str(manifest.shard_paths("train")[0])], shardshuffle=False).decode("rgb8")))
    assert sample["jpg"].min() > 240


def test_max_side_shrinks_large_images(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 3}, size=(90, 120))
    manifest = convert(src, tmp_path / "out", max_side=60)
    for s in wds.WebDataset([str(p) for p in manifest.shard_paths("train")], shardshuffle=False):
        assert Image.open(io.BytesIO(s["jpg"])).size == (60, 45)
        assert json.loads(s["json"])["reencoded"] == "max_side"


def test_on_error_fail_stops_naming_the_file(messy_folder, tmp_path):
    result = run_cli("imagefolder", messy_folder, tmp_path / "out", "--on-error", "fail", "--workers", "1")
    assert result.exit_code == 1
    assert re.search(r"^Error: (a/(truncated\.jpg|noise\.jpg|notes\.txt|empty\.jpg)|b/\.DS_Store): ", result.output,
                     re.M), result.output
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("layout, message", [
    ("missing", "does not exist"),
    ("no_classes", "no class folders"),
    ("empty_class", "class folder is empty"),
])
def test_bad_source_is_one_line_usage_error(tmp_path, layout, message):
    src = tmp_path / "src"
    if layout != "missing":
        src.mkdir()
        (src / "loose.jpg").write_bytes(b"x")
    if layout == "empty_class":
        write_imagefolder(src, {"a": 2})
        (src / "b").mkdir()
    result = run_cli("imagefolder", src, tmp_path / "out")
    assert result.exit_code == 2
    assert message in result.output
    assert len([line for line in result.output.splitlines() if line.startswith("Error")]) == 1


@pytest.mark.parametrize("args, message", [
    (["--val-fraction", "1.5"], "--val-fraction must be in"),
    (["--jpeg-quality", "0"], "--jpeg-quality must be in"),
    (["--workers", "0"], "--workers must be >= 1"),
    (["--max-shard-bytes", "lots"], "not a size"),
])
def test_bad_options_are_usage_errors(small_imagefolder, tmp_path, args, message):
    result = run_cli("imagefolder", small_imagefolder, tmp_path / "out", *args)
    assert result.exit_code == 2
    assert message in result.output


def test_out_made_with_other_options_is_refused_unless_overwrite(small_imagefolder, tmp_path):
    out = tmp_path / "out"
    assert run_cli("imagefolder", small_imagefolder, out, "--seed", "1").exit_code == 0
    again = run_cli("imagefolder", small_imagefolder, out, "--seed", "1")
    assert again.exit_code == 0 and "nothing to do" in again.output
    refused = run_cli("imagefolder", small_imagefolder, out, "--seed", "2")
    assert refused.exit_code == 2 and "--overwrite" in refused.output
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "keep.txt").write_text("mine")
    assert run_cli("imagefolder", small_imagefolder, tmp_path / "other").exit_code == 2
    assert run_cli("imagefolder", small_imagefolder, out, "--seed", "2", "--overwrite").exit_code == 0
    assert json.loads((out / "manifest.json").read_text())["options"]["seed"] == 2


class Interrupt(Exception):
    pass


def interrupt_after(n: int):
    """A tqdm stand-in hook: raise after n items, as Ctrl-C or a crash would mid-run."""
    count = 0

    def hook(self, k=1):
        nonlocal count
        count += k
        if count > n:
            raise Interrupt()
    return hook


@pytest.mark.parametrize("stop_after", [0, 9, 17, 30])
def test_interrupted_conversion_resumes_to_identical_bytes(small_imagefolder, tmp_path, monkeypatch, stop_after):
    import tqdm

    reference = convert(small_imagefolder, tmp_path / "ref", samples_per_shard=4, workers=1)
    out = tmp_path / "out"
    cfg = ConvertConfig(src=small_imagefolder, out=out, samples_per_shard=4, workers=2, progress=False)
    with monkeypatch.context() as m:
        m.setattr(tqdm.tqdm, "update", interrupt_after(stop_after))
        with pytest.raises(Interrupt):
            convert_imagefolder(cfg)
    assert not (out / "manifest.json").exists()
    finished = {p.name: p.stat().st_mtime_ns for p in out.glob("*.tar")}
    # a shard closes when the first sample of the next one arrives
    assert len(finished) == max(0, (stop_after - 1) // 4)

    resumed = convert_imagefolder(cfg)
    assert resumed.summary.status == "resume"
    for name, mtime in finished.items():
        assert (out / name).stat().st_mtime_ns == mtime, f"{name} was rewritten"
    assert_same_folder(reference.root, out)
    assert not list(out.glob(".*.tmp*")) and not (out / ".dalifeed-progress").exists()


def test_kill_9_mid_conversion_then_rerun_gives_identical_bytes(make_shards, tmp_path):
    src, reference = make_shards({"a": 150, "b": 151}, size=(64, 64), samples_per_shard=5, workers=1)
    out = tmp_path / "out"
    command = [sys.executable, "-m", "dalifeed.convert.cli", "imagefolder", str(src), str(out),
               "--samples-per-shard", "5", "--workers", "2"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while len(list(out.glob("train-*.tar"))) < 3 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    os.killpg(proc.pid, signal.SIGKILL)  # the workers too, as an OOM kill or a node loss would
    proc.wait()
    killed_with = len(list(out.glob("train-*.tar")))
    assert not (out / "manifest.json").exists(), "the run finished before it could be killed"

    rerun = subprocess.run(command, capture_output=True, text=True)
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed" in rerun.stdout
    assert_same_folder(reference, out)
    assert killed_with >= 3


# a run stopped, killed, raced or out of space


@pytest.fixture(scope="module")
def big_source(make_shards) -> tuple[Path, Path]:
    """Enough images that a conversion runs for a while in 2 workers, and its uninterrupted result."""
    return make_shards({"a": 400, "b": 401}, size=(96, 96), samples_per_shard=5, workers=1)


def start_conversion(src: Path, out: Path, **popen) -> subprocess.Popen:
    command = [PY, "-m", "dalifeed.convert.cli", "imagefolder", str(src), str(out), "--samples-per-shard", "5",
               "--workers", "2"]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def workers_of(proc: subprocess.Popen) -> list[psutil.Process]:
    """Every process the conversion started, once its two workers run: the workers (the fork server's
    children), the fork server and multiprocessing's resource tracker."""
    def started() -> list[psutil.Process]:
        return psutil.Process(proc.pid).children(recursive=True)

    wait_for(lambda: sum(p.ppid() != proc.pid for p in started()) >= 2, what="conversion workers")
    return started()


def gone(processes: list[psutil.Process]) -> bool:
    return all(not p.is_running() or p.status() == psutil.STATUS_ZOMBIE for p in processes)


def test_sigterm_to_the_converter_stops_cleanly_and_a_rerun_resumes(big_source, tmp_path):
    src, reference = big_source
    out = tmp_path / "out"
    proc = start_conversion(src, out)
    workers = workers_of(proc)
    wait_for(lambda: len(list(out.glob("train-*.tar"))) >= 3, what="three shards")
    proc.send_signal(signal.SIGTERM)  # to the main process only, as `kill PID` or a scheduler does
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "stopped by SIGTERM: finished shards" in stderr and "run the same command again to resume" in stderr
    assert "Traceback" not in stderr
    wait_for(lambda: gone(workers), timeout=10, what="the workers to exit")
    assert not (out / "manifest.json").exists()
    rerun = start_conversion(src, out)
    stdout, stderr = rerun.communicate(timeout=120)
    assert rerun.returncode == 0 and "(resumed)" in stdout, stderr
    assert_same_folder(reference, out)


def test_workers_die_with_a_killed_converter(big_source, tmp_path):
    src, _ = big_source
    proc = start_conversion(src, tmp_path / "out")
    workers = workers_of(proc)
    proc.kill()  # SIGKILL to the main process only: the OOM killer, a lost node's agent
    proc.wait()
    # before: both workers stayed alive, blocked on a pipe nobody read
    wait_for(lambda: gone(workers), timeout=10, what="the orphaned workers to die")


def test_one_run_per_folder_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 5, "b": 4})
    out = tmp_path / "out"
    holder = hold_lock(out)
    refused = CliRunner().invoke(cli, ["imagefolder", str(src), str(out)])
    assert refused.exit_code == 2 and f"in use by pid {holder.pid} (a test holder" in refused.output
    assert not (out / "manifest.json").exists()
    holder.kill()  # kill -9: the kernel drops the lock with the process
    holder.wait()
    assert CliRunner().invoke(cli, ["imagefolder", str(src), str(out)]).exit_code == 0


def test_a_full_disk_is_one_line_and_the_conversion_resumes(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 30, "b": 31}, size=(64, 64))
    reference = convert(src, tmp_path / "ref", samples_per_shard=40, workers=1)
    out = tmp_path / "out"
    command = ["imagefolder", src, out, "--samples-per-shard", "40"]
    full = shard_convert(*command, preexec_fn=limit_file_size(40_000))
    assert full.returncode == 1, full.stderr
    errors = [line for line in full.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in full.stderr
    assert f"{out}/train-000000.tar: File too large" in errors[0]
    assert "need about" in errors[0] and "run the same command again to resume" in errors[0]
    # the write hit a file-size limit (ulimit -f), not a full disk: said so, not "free space"
    assert "raise the file-size limit it hit (ulimit -f; the disk is not full), then run" in errors[0], errors[0]
    assert not list(out.glob(".*.tmp*"))  # nothing half-written is left behind
    rerun = shard_convert(*command)
    assert rerun.returncode == 0, rerun.stderr
    assert_same_folder(reference.root, out)


def test_a_rerun_with_other_options_names_them(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 5, "b": 4})
    out = tmp_path / "out"
    assert CliRunner().invoke(cli, ["imagefolder", str(src), str(out), "--seed", "1"]).exit_code == 0
    refused = CliRunner().invoke(cli, ["imagefolder", str(src), str(out), "--seed", "2", "--jpeg-quality", "80"])
    assert refused.exit_code == 2
    assert "--jpeg-quality was 95, now 80; --seed was 1, now 2" in refused.output


def test_a_crashing_worker_surfaces_instead_of_hanging(small_imagefolder, tmp_path):
    from dalifeed.convert.shards import WorkerCrashed, ordered_map

    with pytest.raises(WorkerCrashed, match="worker process died"):
        list(ordered_map(os._exit, [0] * 40, workers=2))
    with pytest.raises(ZeroDivisionError):
        list(ordered_map(_divide_by_zero, range(40), workers=2))


def _divide_by_zero(x):
    return x / 0


HELD = threading.Lock()


def _under_the_held_lock(x):
    with HELD:
        return x


@contextmanager
def alarm(seconds: int):
    """TimeoutError in the main thread after `seconds`: a hang becomes a failure."""
    def ring(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, ring)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_a_lock_held_in_this_process_does_not_reach_the_workers():
    """A child forked from this process copies every lock held there, held forever in the child (a module's
    import lock, held by a loader's thread defining its next epoch, hung such a child at its first import).
    Workers come from a fork server, a process of their own, and take their own locks."""
    from dalifeed.convert.shards import ordered_map

    with HELD, alarm(60):  # a forked worker would wait here until the alarm
        assert list(ordered_map(_under_the_held_lock, range(20), workers=2, chunk=1)) == list(range(20))


def _environment_variable(name):
    return os.environ.get(name)


def test_workers_see_the_environment_of_now_not_the_fork_servers(monkeypatch):
    """The fork server keeps the environment it started with; credentials or an S3 endpoint set since (a
    notebook, a test's fixture) reach the workers all the same, as they did when workers were forks."""
    from dalifeed.convert.shards import ordered_map

    assert list(ordered_map(_environment_variable, ["DALIFEED_TEST_NOW"] * 4, workers=2)) == [None] * 4
    monkeypatch.setenv("DALIFEED_TEST_NOW", "set after the server started")
    assert set(ordered_map(_environment_variable, ["DALIFEED_TEST_NOW"] * 4, workers=2)) == {
        "set after the server started"}


UNGUARDED = """from dalifeed.convert import ConvertConfig, convert_imagefolder
convert_imagefolder(ConvertConfig(src={src!r}, out={out!r}, workers=2, progress=False))
"""


def test_a_script_that_converts_at_its_top_level_is_told_to_guard_it(tmp_path):
    """Fork-server workers run the main script again as they start; unguarded, its conversion starts another
    pool there and the workers die. The error says so, not "re-run the same command"."""
    src = write_imagefolder(tmp_path / "src", {"a": 3, "b": 3})
    script = tmp_path / "convert_it.py"
    script.write_text(UNGUARDED.format(src=str(src), out=str(tmp_path / "out")))
    ran = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 1
    last = ran.stderr.strip().splitlines()[-1]
    assert f"each one runs {script} again first" in last and 'under `if __name__ == "__main__":`' in last, last


def _sleep(seconds):
    time.sleep(seconds)
    return os.getpid()


def test_leaving_the_map_early_kills_a_busy_worker_instead_of_waiting_for_it():
    """What an error in the consumer (`--on-error fail`), Ctrl-C or a test's time-out does: the generator is
    closed with a worker in the middle of an item, and returns now (it waited for the item, forever for a
    stuck one) with no worker left."""
    from dalifeed.convert.shards import ordered_map

    results = ordered_map(_sleep, [0, 600, 600, 600], workers=2, chunk=1)
    with alarm(60):
        worker = psutil.Process(next(results))
        started = time.monotonic()
        results.close()
    assert time.monotonic() - started < 30
    wait_for(lambda: gone([worker]), timeout=10, what="the busy workers to die")


LEAVE_DURING_A_SEND = """import sys
from dalifeed.convert.shards import ordered_map

def result_of(item):
    return b"x" * (64 << 20) if item else b""

if __name__ == "__main__":
    results = ordered_map(result_of, list(range(8)), workers=2, chunk=1)
    next(results), next(results)  # the other worker is now sending 64 MB through the result pipe
    results.close()
    print("closed")
"""


def test_leaving_the_map_while_a_worker_sends_its_result_returns(tmp_path):
    """A worker killed halfway through sending its result left half a message that the pool's thread waited
    on forever, and `close`, `shutdown` and Python's exit with it: a SIGTERM'd conversion printed its stop line
    and never exited. In a process of its own, so that a hang fails this test, not the whole suite's exit."""
    script = tmp_path / "leave_early.py"
    script.write_text(LEAVE_DURING_A_SEND)
    ran = subprocess.run([PY, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert ran.returncode == 0 and ran.stdout == "closed\n", ran.stderr


@pytest.fixture
def shards(small_imagefolder, tmp_path) -> Path:
    convert(small_imagefolder, tmp_path / "v", samples_per_shard=8)
    return tmp_path / "v"


def test_verify_passes_a_sound_folder(shards):
    result = run_cli("verify", shards, "--decode")
    assert result.exit_code == 0, result.output


def test_verify_catches_a_truncated_shard(shards):
    tar = shards / "train-000001.tar"
    with tarfile.open(tar) as archive:  # the oracle: which members the first 3000 bytes hold whole
        ends = {m.name: m.offset_data + m.size for m in archive}
    whole = [name for name, end in ends.items() if end <= 3000]
    keys = list(dict.fromkeys(name.partition(".")[0] for name in whole))
    cut = sorted("." + name.partition(".")[2] for name in ends if name.partition(".")[0] == keys[-1]
                 and name not in whole)
    assert 1 <= len(keys) < 8 and cut, (whole, ends)  # the cut falls inside a sample, after a whole one
    size = tar.stat().st_size
    tar.write_bytes(tar.read_bytes()[:3000])
    result = run_cli("verify", shards)
    assert result.exit_code == 1
    lines = [line for line in result.output.splitlines() if "train-000001.tar" in line]
    assert lines == [f"{tar}: 3000 bytes, the manifest says {size} (truncated or replaced)",
                     f"{tar}: sha256 differs from the manifest (modified or corrupt)",
                     f"{tar}: {len(keys)} samples, the manifest says 8",
                     f"{tar}: sample {keys[-1]}: missing {', '.join(cut)}"], result.output


def test_verify_catches_a_tampered_shard_and_index(shards):
    tar = shards / "train-000002.tar"
    data = bytearray(tar.read_bytes())
    data[600] ^= 0xFF  # inside the first image's bytes: same size, different content
    tar.write_bytes(bytes(data))
    idx = shards / "train-000000.idx"
    idx.write_text(idx.read_text().replace(" 512 ", " 1024 ", 1))
    result = run_cli("verify", shards, "--json")
    report = json.loads(result.output)
    assert result.exit_code == 1 and not report["ok"]
    assert any("train-000002.tar: sha256 differs" in p for p in report["problems"])
    assert any("train-000000.idx: does not match" in p for p in report["problems"])


def test_verify_writes_its_report_on_stdout(tmp_path):
    src = write_imagefolder(tmp_path / "src", {"a": 5, "b": 4})
    convert(src, tmp_path / "out")
    tar = tmp_path / "out" / "train-000000.tar"
    tar.write_bytes(tar.read_bytes()[:-2000])
    report = tmp_path / "report.txt"
    with open(report, "w") as f:
        code = subprocess.run([PY, "-m", "dalifeed.convert.cli", "verify", str(tmp_path / "out")], stdout=f,
                              stderr=subprocess.PIPE, timeout=120).returncode
    lines = report.read_text().splitlines()
    assert code == 1 and any("train-000000.tar" in line for line in lines) and "problem(s)" in lines[-1]


def test_verify_missing_folder_is_usage_error(tmp_path):
    result = run_cli("verify", tmp_path / "nope")
    assert result.exit_code == 2 and "no such shard folder" in result.output


def test_a_source_changed_during_conversion_is_an_error_not_a_corrupt_shard(tmp_path):
    from dalifeed.convert.shards import SourceChanged, SourceFile

    path = tmp_path / "x.jpg"
    path.write_bytes(b"12345")
    assert SourceFile(str(path), 5).read() == b"12345"
    with pytest.raises(SourceChanged, match="x.jpg: changed while being converted"):
        SourceFile(str(path), 4).read()
    path.unlink()
    with pytest.raises(SourceChanged, match="x.jpg: vanished"):
        SourceFile(str(path), 5).read()
