"""`--num-jobs` with an s3:// OUT, and the lease that keeps a second writer out, against the real local S3
server (the `s3_endpoint` fixture; real processes where a kill matters): jobs and `merge s3://` give the bytes
of a single-job local conversion; a conversion to a URL another live run holds is refused in one line naming
the holder; a lease whose holder was killed, or that was not renewed, is taken over; a holder whose lease was
taken over stops."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from email.utils import parsedate_to_datetime
from pathlib import Path

import boto3
import pytest
from click.testing import CliRunner

from dalifeed import s3
from dalifeed.convert import ConvertConfig, convert_imagefolder
from dalifeed.convert.cli import main as convert_cli
from dalifeed.convert.lease import Lease, LeaseHeld, LeaseLost, lease_name
from helpers import wait_for, write_imagefolder

SPEC = {"train": {"a": 9, "b": 8, "c": 6}, "val": {"a": 3, "b": 3}}
OPTIONS = ["--samples-per-shard", "4", "--workers", "1", "--quiet"]


@pytest.fixture(scope="module")
def tree_and_single(tmp_path_factory) -> tuple[Path, Path]:
    """A small tree and its single-job local conversion (what N jobs must add up to, byte for byte)."""
    tmp = tmp_path_factory.mktemp("s3-jobs")
    for i, (split, counts) in enumerate(SPEC.items()):
        write_imagefolder(tmp / "src" / split, counts, seed=i)
    convert_imagefolder(ConvertConfig(src=tmp / "src", out=tmp / "single", samples_per_shard=4, progress=False))
    return tmp / "src", tmp / "single"


def cli(*args) -> object:
    return CliRunner().invoke(convert_cli, [str(a) for a in args])


def job(src: Path, url: str, index: int, *extra) -> object:
    return cli("imagefolder", src, url, *OPTIONS, "--num-jobs", 2, "--job-index", index, *extra)


def assert_store_holds(url: str, single: Path) -> None:
    """The store holds the single job's shards, indexes and manifest byte for byte, no other shard, no
    progress record and no lease."""
    names = sorted(p.name for p in single.iterdir() if p.suffix in (".tar", ".idx"))
    objects = s3.list_objects(url)
    assert sorted(n for n in objects if n.endswith((".tar", ".idx"))) == names
    for name in names + ["manifest.json"]:
        assert s3.get_bytes(f"{url}/{name}") == (single / name).read_bytes(), name
    assert not [n for n in objects if n.startswith((".dalifeed-progress/", ".dalifeed-leases/"))], objects


def test_jobs_into_s3_merge_into_the_single_job_bytes(tree_and_single, s3_bucket):
    src, single = tree_and_single
    url = f"{s3_bucket}/jobs"
    # an upload of job 0's first shard left unfinished (job 0 killed mid-upload, or still uploading)
    client, bucket = boto3.client("s3"), s3_bucket[len("s3://"):]
    client.create_multipart_upload(Bucket=bucket, Key="jobs/train-000000.tar")
    uploads = lambda: [u["Key"] for u in client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])]  # noqa: E731
    first = job(src, url, 1)
    assert first.exit_code == 0, first.output
    assert uploads() == ["jobs/train-000000.tar"]  # another job's upload is left alone
    assert "the other jobs have not all finished" in first.output and f"shard-convert merge {url}" in first.output
    assert "manifest.json" not in s3.list_objects(url)  # not a dataset until every job is in
    early = cli("merge", url)
    assert early.exit_code == 2 and f"{url}: job 0 of 2 has not finished" in early.output, early.output

    last = job(src, url, 0)
    assert last.exit_code == 0, last.output
    assert "the last of the jobs to finish, merged them" in last.output and f"{url}/manifest.json" in last.output
    assert_store_holds(url, single)
    assert uploads() == []  # job 0 aborted what a run of it left
    assert sorted(n for n in s3.list_objects(url) if n.startswith(".dalifeed-jobs/")) == \
        [".dalifeed-jobs/job-0000-of-0002.json", ".dalifeed-jobs/job-0001-of-0002.json"]

    again = cli("merge", url + "/")  # merging again is harmless
    assert again.exit_code == 0 and f"{url}: merged 2 jobs into {url}/manifest.json" in again.output, again.output
    assert_store_holds(url, single)
    done = job(src, url, 1)
    assert done.exit_code == 0 and "already converted with these options; nothing to do" in done.output


def write_lease(url: str, host: str, pid: int, index: int = 0, count: int = 1) -> None:
    s3.put_bytes(f"{url}/{lease_name(index, count)}",
                 json.dumps({"host": host, "pid": pid, "started": time.time(), "renewed": time.time()}).encode())


def lease_age(url: str) -> float:
    """Seconds since the lease object was written, by the store's clock (its Date header minus Last-Modified,
    whole seconds both), as a run deciding staleness sees it."""
    bucket, key = s3.parse_s3_url(url)
    head = boto3.client("s3").head_object(Bucket=bucket, Key=key)
    now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
    return (now - head["LastModified"]).total_seconds()


def test_a_lease_not_renewed_is_taken_over_after_the_staleness_limit(tree_and_single, s3_bucket, tmp_path):
    src, single = tree_and_single
    url = f"{s3_bucket}/stale"
    write_lease(url, "other-machine", 4242)  # a run on another machine, its pid unknowable from here
    refused = cli("imagefolder", src, url, *OPTIONS)
    assert refused.exit_code == 2, refused.output
    errors = [line for line in refused.output.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and f"{url}: another conversion is writing here: held by other-machine pid 4242" \
        in errors[0], refused.output
    assert "taken over once not renewed for 60 s" in errors[0]

    wait_for(lambda: lease_age(f"{url}/{lease_name(0, 1)}") >= 2, what="the lease to be 2 s old by the store's clock")
    manifest = convert_imagefolder(ConvertConfig(src=src, out=url, samples_per_shard=4, workers=1, progress=False,
                                                 lease_stale_s=2))
    assert manifest.summary.status == "fresh"
    assert_store_holds(url, single)


def test_a_holder_whose_lease_was_taken_over_stops(s3_bucket):
    url = f"{s3_bucket}/lost"
    holder = Lease(url, 0, 1, stale_s=0.4)  # renews every 0.1 s
    holder.acquire()
    try:
        with pytest.raises(LeaseHeld, match="held by .* pid"):
            Lease(url, 0, 1, stale_s=30).acquire()  # alive, on this host, renewed: not taken
        taker = Lease(url, 0, 1, stale_s=0)  # anything is stale to it: takes over at once
        taker.acquire()
        wait_for(lambda: holder.lost is not None, timeout=30, what="the holder's next renewal to find the lease taken")
        with pytest.raises(LeaseLost, match=f"{url}: another conversion took this run's lease over"):
            holder.check()
        taker.release()
    finally:
        holder.release()
    assert not s3.list_objects(url)  # the taker's release deleted its lease; the holder's left it alone


def test_a_second_writer_is_refused_and_a_killed_jobs_lease_is_taken_over(tree_and_single, s3_bucket, tmp_path):
    src, single = tree_and_single
    url = f"{s3_bucket}/killed"
    command = [sys.executable, "-m", "dalifeed.convert.cli", "imagefolder", str(src), url, *OPTIONS,
               "--num-jobs", "2", "--job-index", "0", "--staging", str(tmp_path / "staging-a")]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    lease = ".dalifeed-leases/job-0000-of-0002"
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            objects = s3.list_objects(url)
            if lease in objects and any(n.startswith(".dalifeed-progress/job-0000/train-") for n in objects):
                os.killpg(proc.pid, signal.SIGSTOP)  # alive, holding the lease, one shard in the store
                break
            time.sleep(0.01)
        assert proc.poll() is None, "the job finished before it could be stopped mid-run"
        # a second machine (its own staging folder) converting the same job into the same URL
        second = job(src, url, 0, "--staging", tmp_path / "staging-b")
        assert second.exit_code == 2, second.output
        errors = [line for line in second.output.splitlines() if line.startswith("Error:")]
        assert len(errors) == 1 and f"{url} (job 0 of 2): another conversion is writing here: held by " \
            f"{os.uname().nodename} pid {proc.pid}" in errors[0], second.output
        assert not list((tmp_path / "staging-b").glob("*.tar"))
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = s3.list_objects(url)
    assert lease in before and ".dalifeed-jobs/job-0000-of-0002.json" not in before  # killed mid-run

    again = job(src, url, 0)  # its holder is dead: taken over at once, resumed from the store
    assert again.exit_code == 0, again.output
    other = job(src, url, 1)
    assert other.exit_code == 0 and "merged them" in other.output, other.output
    assert_store_holds(url, single)  # no shard twice, no stray shard, the single job's manifest
