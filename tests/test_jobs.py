"""`shard-convert ... --num-jobs N --job-index I`: one conversion split across N independent processes (a
Slurm array, a Kubernetes indexed Job), checked with real processes on a real tree against a single-job
conversion of the same tree: byte for byte with `--samples-per-shard`, sample for sample (read back with
plain webdataset) with byte-sized shards; a job killed with SIGKILL mid-way and run again; `merge`
refusing a missing job or a job run with other options; the job index from `DALIFEED_JOB_INDEX`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds
from PIL import Image

from helpers import assert_same_folder, gradient_image, jpeg_bytes, png_bytes, random_image, shard_convert

PY = sys.executable
JOBS = 3


def write_tree(root: Path) -> Path:
    """Four classes of small JPEGs and PNGs (the PNGs are re-encoded), plus what must be accounted for as
    skipped: a truncated JPEG, a text file in a class folder, and a stray file outside any class folder."""
    rng = np.random.default_rng(7)
    for label, (name, n) in enumerate({"ant": 11, "bee": 9, "cat": 8, "dog": 7}.items()):
        folder = root / name
        folder.mkdir(parents=True)
        for i in range(n):
            image = random_image(rng, (28 + i % 5, 24 + label), label)
            data = png_bytes(Image.fromarray(image)) if i % 4 == 3 else jpeg_bytes(image)
            (folder / f"{name}_{i:03d}.{'png' if i % 4 == 3 else 'jpg'}").write_bytes(data)
    (root / "bee" / "bee_broken.jpg").write_bytes((root / "bee" / "bee_000.jpg").read_bytes()[:300])
    (root / "dog" / "notes.txt").write_text("not an image")
    (root / "LICENSE").write_text("a stray file outside any class folder")
    return root


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    return write_tree(tmp_path_factory.mktemp("jobs") / "src")


def source_files(src: Path) -> list[str]:
    return sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())


def convert(src: Path, out: Path, *options: str, job: int | None = None, env: dict | None = None,
            timeout: float = 180) -> subprocess.CompletedProcess:
    """One real `shard-convert imagefolder` process; `job` adds --num-jobs JOBS --job-index job."""
    jobs = ("--num-jobs", JOBS, "--job-index", job) if job is not None else ()
    return shard_convert("imagefolder", src, out, "--workers", "1", *options, *jobs, env=env, timeout=timeout)


def convert_ok(*args, **kwargs) -> subprocess.CompletedProcess:
    result = convert(*args, **kwargs)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def merge(out: Path) -> subprocess.CompletedProcess:
    return shard_convert("merge", out)


def error_line(stderr: str) -> str:
    """The one line a refused command prints (click adds its usage lines around it)."""
    errors = [line for line in stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and "Traceback" not in stderr, stderr
    return errors[0]


def job_records(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted((out / ".dalifeed-jobs").glob("job-*.json"))]


def read_samples(out: Path) -> dict[str, tuple[bytes, int, str]]:
    """Every sample of every split, read with plain webdataset: key -> (image bytes, label, source path)."""
    manifest = json.loads((out / "manifest.json").read_text())
    samples = {}
    for split, info in manifest["splits"].items():
        urls = [str(out / shard["path"]) for shard in info["shards"]]
        for sample in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
            key = f"{split}/{sample['__key__']}"
            assert key not in samples, key
            samples[key] = (sample["jpg"], int(sample["cls"]), json.loads(sample["json"])["path"])
    return samples


def assert_every_file_accounted_once(src: Path, out: Path) -> None:
    manifest = json.loads((out / "manifest.json").read_text())
    converted = [path for _, _, path in read_samples(out).values()]
    skipped = [entry["path"] for entry in manifest["skipped"]]
    assert sorted(converted + skipped) == source_files(src)  # each file once: converted or skipped
    assert manifest["found"] == len(source_files(src))
    assert sorted(skipped) == ["LICENSE", "bee/bee_broken.jpg", "dog/notes.txt"]


@pytest.fixture(scope="module")
def single(tree, tmp_path_factory):
    """The single-job conversion of `tree` with the given options, made once per option set."""
    made: dict[tuple, Path] = {}

    def get(*options: str) -> Path:
        if options not in made:
            out = tmp_path_factory.mktemp("single") / "out"
            convert_ok(tree, out, *options)
            made[options] = out
        return made[options]

    return get


@pytest.mark.parametrize("options", [("--samples-per-shard", "4"),
                                     ("--samples-per-shard", "3", "--val-fraction", "0.25")],
                         ids=["train", "train+val"])
def test_jobs_of_whole_shards_merge_into_the_single_job_folder_byte_for_byte(tree, single, tmp_path, options):
    out = tmp_path / "out"
    runs = [convert_ok(tree, out, *options, job=i) for i in (2, 0, 1)]  # any order: the last one merges
    assert all("the other jobs have not all finished" in r.stdout for r in runs[:2])
    assert "the last of the jobs to finish, merged them" in runs[2].stdout
    assert_same_folder(single(*options), out)
    assert_every_file_accounted_once(tree, out)
    # the skipped files fall into more than one job, so their order in the manifest is what merge decides
    assert sum(1 for record in job_records(out) if record["skipped"]) >= 2
    again = merge(out)  # merging again is harmless
    assert again.returncode == 0 and f"merged {JOBS} jobs" in again.stdout, again.stderr
    assert_same_folder(single(*options), out)


def test_records_of_an_older_version_merge_their_lists_in_job_order(tree, single, tmp_path):
    """Job records without per-split lists (written before they had them) still merge into the single job's
    shards and counts; their skipped files and warnings come whole, job by job."""
    options = ("--samples-per-shard", "4", "--val-fraction", "0.25")
    out = tmp_path / "out"
    for i in range(JOBS):
        convert_ok(tree, out, *options, job=i)
    paths = sorted((out / ".dalifeed-jobs").glob("job-*.json"))
    records = job_records(out)
    for path, record in zip(paths, records):
        del record["job"]["splits"], record["job"]["plan"]
        path.write_text(json.dumps(record))
    (out / "manifest.json").unlink()
    assert merge(out).returncode == 0
    manifest = json.loads((out / "manifest.json").read_text())
    expected = json.loads((single(*options) / "manifest.json").read_text())
    assert manifest["splits"] == expected["splits"] and manifest["reencoded"] == expected["reencoded"]
    assert manifest["skipped"] == [entry for record in records for entry in record["skipped"]]
    assert sorted(map(json.dumps, manifest["skipped"])) == sorted(map(json.dumps, expected["skipped"]))
    assert manifest["skipped"] != expected["skipped"]  # job order is not a single job's: why records list by split


def test_jobs_of_byte_sized_shards_hold_the_single_jobs_samples(tree, single, tmp_path):
    options = ("--max-shard-bytes", "12KB", "--val-fraction", "0.25")
    out = tmp_path / "out"
    for i in range(JOBS):
        convert_ok(tree, out, *options, job=i)
    reference = single(*options)
    assert read_samples(out) == read_samples(reference)  # keys, image bytes, labels, sources
    assert_every_file_accounted_once(tree, out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {name for name, info in manifest["splits"].items() if info["shards"]} == {"train", "val"}
    shards = [s["path"] for info in manifest["splits"].values() for s in info["shards"]]
    assert {s.split("-")[1] for s in shards} == {f"j{i:04d}" for i in range(JOBS)}  # each job named its own
    # the limit, plus the padding of a tar's end to a whole 10 KiB record (as tarfile writes it)
    assert max(s["bytes"] for info in manifest["splits"].values() for s in info["shards"]) <= 12_000 + 10240
    expected = json.loads((reference / "manifest.json").read_text())
    for field in ("classes", "found", "skipped", "reencoded", "options"):
        assert manifest[field] == expected[field], field
    for split, info in expected["splits"].items():
        assert manifest["splits"][split]["class_counts"] == info["class_counts"]
        assert manifest["splits"][split]["samples"] == info["samples"]
    verify = shard_convert("verify", out)
    assert verify.returncode == 0 and verify.stdout.strip().endswith("OK"), verify.stdout


@pytest.fixture(scope="module")
def big_tree(tmp_path_factory) -> Path:
    """Enough work that one job runs for about a second with one worker: 4-megapixel JPEGs that are decoded
    in full and shrunk (--max-side) one by one."""
    root = tmp_path_factory.mktemp("big") / "src"
    base = gradient_image(2000, 2000)
    for label, name in enumerate(("north", "east", "south")):
        (root / name).mkdir(parents=True)
        data = jpeg_bytes(np.ascontiguousarray(np.rot90(base, k=label)))
        for i in range(45 + label):
            (root / name / f"{name}_{i:03d}.jpg").write_bytes(data)
    return root


def test_a_job_killed_mid_run_and_run_again_gives_the_single_job_folder(big_tree, tmp_path):
    options = ("--samples-per-shard", "4", "--max-side", "64")
    reference = tmp_path / "single"
    convert_ok(big_tree, reference, *options)
    out = tmp_path / "out"
    for i in (0, 2):
        convert_ok(big_tree, out, *options, job=i)
    progress = out / ".dalifeed-progress" / "job-0001"
    command = [PY, "-m", "dalifeed.convert.cli", "imagefolder", str(big_tree), str(out), *options, "--workers", "1",
               "--num-jobs", str(JOBS), "--job-index", "1"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while not list(progress.glob("train-*.json")) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)  # the OOM killer, a preempted node: no handler runs
    proc.wait(timeout=30)
    # it landed mid-run: some of job 1's shards were finished, not all, and the job recorded nothing
    finished = sorted(progress.glob("train-*.json"))
    job_shards = len(json.loads((reference / "manifest.json").read_text())["splits"]["train"]["shards"]) // JOBS
    assert proc.returncode == -signal.SIGKILL and 1 <= len(finished) < job_shards, (proc.returncode, finished)
    assert not (out / ".dalifeed-jobs" / f"job-0001-of-{JOBS:04d}.json").exists()
    assert not (out / "manifest.json").exists()
    shards = [out / json.loads(f.read_text())["shard"]["path"] for f in finished]
    kept = {shard.name: shard.stat().st_mtime_ns for shard in shards}

    refused = merge(out)  # the killed job is named, and said to have started
    assert refused.returncode == 2
    assert f"job 1 of {JOBS} has not finished" in error_line(refused.stderr)
    assert "(1 of them started: still running or interrupted)" in refused.stderr

    rerun = convert_ok(big_tree, out, *options, job=1)  # the same command again
    assert "the last of the jobs to finish, merged them" in rerun.stdout
    assert {name: (out / name).stat().st_mtime_ns for name in kept} == kept  # finished shards were kept
    assert_same_folder(reference, out)


def test_merge_names_a_missing_job(tree, tmp_path):
    out = tmp_path / "out"
    for i in (0, 2):
        convert_ok(tree, out, "--samples-per-shard", "4", job=i)
    result = merge(out)
    assert result.returncode == 2
    line = error_line(result.stderr)
    assert f"job 1 of {JOBS} has not finished (no job-0001-of-{JOBS:04d}.json)" in line
    assert "started" not in line  # job 1 never ran: nothing of it is in OUT
    assert not (out / "manifest.json").exists()


def test_jobs_run_with_other_options_are_refused_naming_the_option(tree, tmp_path):
    out = tmp_path / "out"
    for i in (0, 1):
        convert_ok(tree, out, "--samples-per-shard", "4", job=i)
    # a job started after others finished is refused at once
    late = convert(tree, out, "--samples-per-shard", "4", "--seed", "1", job=2)
    assert late.returncode == 2
    assert ("--seed was 0, now 1" in error_line(late.stderr)
            and "every job of a conversion must run the same" in late.stderr)
    other = convert(tree, out, "--samples-per-shard", "4", "--jpeg-quality", "80", "--num-jobs", "2",
                    "--job-index", "1")
    assert other.returncode == 2 and "num_jobs was 3, now 2" in error_line(other.stderr)
    # jobs that ran at the same time saw no record of each other: merge finds the difference. Job 2 ran with
    # other options into another folder; its record is put beside the others, as if it had run here at once.
    elsewhere = tmp_path / "elsewhere"
    convert_ok(tree, elsewhere, "--samples-per-shard", "4", "--seed", "1", job=2)
    record = f"job-0002-of-{JOBS:04d}.json"
    (out / ".dalifeed-jobs" / record).write_bytes((elsewhere / ".dalifeed-jobs" / record).read_bytes())
    result = merge(out)
    assert result.returncode == 2
    assert "job 2 was made with other input than job 0: --seed was 0, now 1" in error_line(result.stderr)
    assert not (out / "manifest.json").exists()


def test_the_job_index_can_come_from_the_environment(tree, single, tmp_path):
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "DALIFEED_JOB_INDEX"}
    for i in range(JOBS):  # what a Kubernetes indexed Job sets up: DALIFEED_JOB_INDEX=$JOB_COMPLETION_INDEX
        command_env = {**env, "DALIFEED_JOB_INDEX": str(i)}
        convert_ok(tree, out, "--samples-per-shard", "4", "--num-jobs", str(JOBS), env=command_env)
    records = job_records(out)
    assert [r["job"]["index"] for r in records] == list(range(JOBS))
    assert_same_folder(single("--samples-per-shard", "4"), out)
    bad = convert(tree, tmp_path / "bad", "--num-jobs", str(JOBS), env={**env, "DALIFEED_JOB_INDEX": "3"})
    assert bad.returncode == 2 and f"--job-index must be in 0..{JOBS - 1}" in error_line(bad.stderr)


def test_the_slurm_array_script_converts_in_jobs(tree, single, tmp_path):
    """examples/slurm/convert.sbatch as each array task runs it (the Slurm variables set by hand)."""
    script = Path(__file__).parent.parent / "examples" / "slurm" / "convert.sbatch"
    out = tmp_path / "out"
    env = {**os.environ, "PATH": f"{Path(PY).parent}:{os.environ['PATH']}", "SRC": str(tree), "OUT": str(out),
           "SLURM_ARRAY_TASK_COUNT": str(JOBS), "SLURM_CPUS_PER_TASK": "1"}
    for i in range(JOBS):
        task = subprocess.run(["bash", str(script)], env={**env, "SLURM_ARRAY_TASK_ID": str(i)}, capture_output=True,
                              text=True, timeout=120)
        assert task.returncode == 0, task.stderr
    assert_same_folder(single("--samples-per-shard", "1000"), out)
