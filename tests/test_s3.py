"""Shard folders in S3-compatible object storage, against a real local S3 server (moto's, a subprocess: see
the `s3_endpoint` fixture; no mocked clients): conversion into s3://, verify, info, export-coco, both loaders
and dali-train reading from it (each compared with the same folder on disk), a conversion killed
mid-upload and resumed, and each failure as one line."""

from __future__ import annotations

import io
import json
import os
import signal
import socket
import subprocess
import sys
import time
from email.utils import parsedate_to_datetime
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from PIL import Image

from dalifeed import s3
from dalifeed.convert import ConvertConfig, convert_imagefolder
from dalifeed.convert.cli import main as convert_cli
from dalifeed.convert.options import default_staging
from dalifeed.convert.remote import MAX_PENDING
from dalifeed.pipelines import AugmentConfig, ShardDataError, make_loader, open_dataset
from dalifeed.shardfolder import cache_dir, open_shard_folder
from dalifeed.train.cli import main as train_cli
from helpers import start_s3_server, stop_s3_server, wait_for, write_coco, write_imagefolder

SPEC = {"train": {"a": 13, "b": 11, "c": 7}, "val": {"a": 3, "b": 4, "c": 2}}
# dali-train settings that learn 45 images in seconds on a CPU (test_train.py's FAST)
FAST = ["--model", "resnet18", "--image-size", "16", "--batch-size", "8", "--optimizer", "adamw", "--lr", "0.032",
        "--warmup-epochs", "1", "--weight-decay", "5e-4", "--crop-scale", "0.5,1", "--workers", "2"]


def convert_to(src: Path, url: str, *args: str):
    return CliRunner().invoke(convert_cli, ["imagefolder", str(src), url, "--quiet", *args])


def bucket_of(url: str):
    return url[len("s3://"):].split("/")[0]


def run(command: list[str], **env) -> tuple[subprocess.CompletedProcess, float]:
    """A dalifeed command in a fresh process (DALI's S3 client reads the environment once per process),
    with `env` changed (None: unset). Returns the process and how long it took."""
    environ = {**os.environ}
    for name, value in env.items():
        environ.pop(name, None) if value is None else environ.__setitem__(name, value)
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", *command], capture_output=True, text=True, env=environ, timeout=300)
    return proc, time.monotonic() - started


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The error a command printed: exactly one 'Error:' line, no traceback."""
    assert "Traceback" not in proc.stderr, proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.fixture(scope="module")
def s3_shards(s3_endpoint, tmp_path_factory) -> tuple[Path, Path, str]:
    """One tree converted to a local folder and into the store: (tree, local shards, s3:// URL). Read-only."""
    tmp = tmp_path_factory.mktemp("s3-shards")
    for i, (split, counts) in enumerate(SPEC.items()):
        write_imagefolder(tmp / "src" / split, counts, seed=i)
    convert_imagefolder(ConvertConfig(src=tmp / "src", out=tmp / "local", samples_per_shard=5, progress=False))
    boto3.client("s3").create_bucket(Bucket="shared-shards")
    url = "s3://shared-shards/imagefolder/v1"
    convert_imagefolder(ConvertConfig(src=tmp / "src", out=url, samples_per_shard=5, progress=False))
    return tmp / "src", tmp / "local", url


@pytest.fixture(scope="module")
def s3_coco(s3_endpoint, tmp_path_factory) -> tuple[Path, Path, str, Path]:
    """tests/helpers.write_coco's data converted by `shard-convert coco` (3 samples a shard) to a local folder
    and into the store, through a given --staging folder: (instances file, local shards, s3:// URL, staging
    folder). Read-only."""
    tmp = tmp_path_factory.mktemp("s3-coco")
    images, annotations = write_coco(tmp / "coco")
    source = ["--images", str(images), "--annotations", str(annotations), "--samples-per-shard", "3", "--quiet"]
    boto3.client("s3").create_bucket(Bucket="shared-coco")
    url = "s3://shared-coco/coco"
    for args in ([str(tmp / "local")], [url, "--staging", str(tmp / "staging")]):
        result = CliRunner().invoke(convert_cli, ["coco", *args, *source])
        assert result.exit_code == 0, result.output
    return annotations, tmp / "local", url, tmp / "staging"


# ----------------------------------------------------------------------------------------------------
# writing and reading


def test_conversion_into_s3_stores_the_bytes_of_a_local_conversion(s3_shards, s3_bucket):
    src, local, _ = s3_shards
    url = f"{s3_bucket}/shards/"  # a trailing slash names the same prefix
    result = convert_to(src, url, "--samples-per-shard", "5")
    assert result.exit_code == 0, result.output
    url = url.rstrip("/")
    assert f"Manifest: {url}/manifest.json" in result.output

    written = {p.name for p in local.iterdir() if p.suffix in (".tar", ".idx")} | {"manifest.json"}
    assert set(s3.list_objects(url)) == written | {"convert.json"}  # and no progress records left
    for name in sorted(written):  # same shards, same indexes, same manifest, byte for byte
        assert s3.get_bytes(f"{url}/{name}") == (local / name).read_bytes(), name
    for shard in json.loads((local / "manifest.json").read_text())["splits"]["train"]["shards"]:
        assert s3.head(f"{url}/{shard['path']}") == s3.ObjectHead(shard["bytes"], shard["sha256"])
    assert not default_staging(url).exists()  # the default staging folder is removed when done

    again = convert_to(src, url, "--samples-per-shard", "5")
    assert again.exit_code == 0 and f"{url}: already converted with these options; nothing to do" in again.output

    verified = CliRunner().invoke(convert_cli, ["verify", url, "--decode"])
    assert verified.exit_code == 0, verified.output
    assert "verify: 9 shards, 40 samples: OK" in verified.output


def test_coco_conversion_into_s3_goes_through_the_same_core(s3_coco):
    _, local, url, staging = s3_coco
    assert s3.get_bytes(f"{url}/manifest.json") == (local / "manifest.json").read_bytes()
    assert not list(staging.glob("*.tar"))  # a given --staging folder is kept, emptied of shards
    verified = CliRunner().invoke(convert_cli, ["verify", url])
    assert verified.exit_code == 0 and verified.output.endswith(": OK\n"), verified.output


def test_info_of_a_folder_in_the_store_is_that_of_the_local_folder(s3_shards, s3_coco):
    """`shard-convert info` reads a store's manifest (and HEADs its indexes) and says what it says of the
    same folder on disk, named by its URL."""
    for local, url in ((s3_shards[1], s3_shards[2]), (s3_coco[1], s3_coco[2])):
        for as_json in ([], ["--json"]):
            on_disk = CliRunner().invoke(convert_cli, ["info", str(local), *as_json])
            in_store = CliRunner().invoke(convert_cli, ["info", url, *as_json])
            assert on_disk.exit_code == 0 and in_store.exit_code == 0, in_store.output
            assert str(local) in on_disk.output
            assert in_store.output == on_disk.output.replace(str(local), url)


def test_export_coco_from_the_store_is_the_local_export(s3_coco, tmp_path):
    from pycocotools.coco import COCO

    annotations, local, url, _ = s3_coco
    for name, shards in (("local", str(local)), ("s3", url)):
        result = CliRunner().invoke(convert_cli, ["export-coco", shards, str(tmp_path / f"{name}.json"), "--split",
                                                  "mini"])
        assert result.exit_code == 0, result.output
    assert (tmp_path / "s3.json").read_bytes() == (tmp_path / "local.json").read_bytes()
    original, back = COCO(str(annotations)), COCO(str(tmp_path / "s3.json"))
    assert set(back.imgs) == set(original.imgs) - {4}  # the record whose file is missing
    assert back.cats == original.cats


def test_the_detection_loader_reads_the_same_batches_from_s3_as_from_disk(s3_coco):
    from dalifeed.pipelines import DetectionConfig, make_detection_loader

    _, local, url, _ = s3_coco
    options = dict(device="cpu", detection=DetectionConfig(size=48), seed=3, initial_fill=8, num_threads=1)
    for train, epochs in ((True, 2), (False, 1)):
        from_s3 = make_detection_loader(open_dataset(url, task="detection", check="sha256"), "mini", 2, train=train,
                                        **options)
        from_disk = make_detection_loader(local, "mini", 2, train=train, **options)
        for epoch in range(epochs):
            s3_batches, disk_batches = list(from_s3), list(from_disk)
            assert len(s3_batches) == len(disk_batches) == len(from_disk) > 0
            for (s3_images, s3_targets), (images, targets) in zip(s3_batches, disk_batches):
                assert [t["image_id"] for t in s3_targets] == [t["image_id"] for t in targets], (train, epoch)
                for s3_image, image in zip(s3_images, images, strict=True):
                    assert torch.equal(s3_image, image), (train, epoch)
                for s3_target, target in zip(s3_targets, targets, strict=True):
                    assert torch.equal(s3_target["boxes"], target["boxes"]), (train, epoch)
                    assert torch.equal(s3_target["labels"], target["labels"]), (train, epoch)


def test_the_loader_reads_the_same_batches_from_s3_as_from_disk(s3_shards):
    _, local, url = s3_shards
    options = dict(device="cpu", augment=AugmentConfig(image_size=32), seed=3, initial_fill=8, num_threads=2)
    for split, epochs in (("train", 2), ("val", 1)):
        from_s3 = make_loader(open_dataset(url, check="sha256"), split, 4, **options)
        from_disk = make_loader(local, split, 4, **options)
        for epoch in range(epochs):
            s3_batches, disk_batches = list(from_s3), list(from_disk)
            assert len(s3_batches) == len(disk_batches) == len(from_disk) > 0
            for (s3_images, s3_labels), (images, labels) in zip(s3_batches, disk_batches):
                assert torch.equal(s3_labels, labels), (split, epoch)
                assert torch.equal(s3_images, images), (split, epoch)

    # the indexes were fetched once, into the cache, under their sha256
    manifest = open_shard_folder(url)
    shards = [s for info in manifest.splits.values() for s in info.shards]
    cached = {p.stem for p in (cache_dir() / "index").iterdir()}
    assert {s.index_sha256 for s in shards} <= cached
    assert all((manifest.root / s.index).read_bytes() == (local / s.index).read_bytes() for s in shards)


@pytest.mark.slow
def test_dali_train_from_s3_trains_as_from_disk(s3_bucket, tmp_path):
    write_imagefolder(tmp_path / "src" / "train", {"red": 17, "green": 15, "blue": 13}, seed=0)
    write_imagefolder(tmp_path / "src" / "val", {"red": 7, "green": 7, "blue": 7}, seed=1)
    convert_imagefolder(ConvertConfig(src=tmp_path / "src", out=tmp_path / "local", samples_per_shard=10,
                                      progress=False))
    url = f"{s3_bucket}/data"
    assert convert_to(tmp_path / "src", url, "--samples-per-shard", "10").exit_code == 0

    metrics = {}
    for name, data in (("disk", str(tmp_path / "local")), ("s3", url)):
        result = CliRunner().invoke(train_cli, ["--data", data, "--out", str(tmp_path / name), "--epochs", "1", *FAST])
        assert result.exit_code == 0, result.output
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        metrics[name] = [{k: r[k] for k in ("epoch", "train_loss", "val_loss", "top1", "val_samples")} for r in records]
    assert metrics["s3"] == metrics["disk"]
    assert [r["val_samples"] for r in metrics["s3"]] == [21]


def test_an_older_manifest_without_index_hashes_is_read_from_s3(s3_shards, s3_bucket):
    """Manifests written before index_sha256 existed (and ones with keys a later version adds) still load;
    their indexes are fetched unverified into that manifest's own cache folder."""
    _, local, _ = s3_shards
    url = f"{s3_bucket}/old"
    doc = json.loads((local / "manifest.json").read_text())
    for info in doc["splits"].values():
        for shard in info["shards"]:
            del shard["index_sha256"]
            shard["added_later"] = True
    for p in local.iterdir():
        if p.suffix in (".tar", ".idx"):
            s3.put_bytes(f"{url}/{p.name}", p.read_bytes())
    s3.put_bytes(f"{url}/manifest.json", json.dumps(doc).encode())
    loader = make_loader(url, "val", 4, augment=AugmentConfig(image_size=32), device="cpu", train=False, num_threads=2)
    assert sum(len(labels) for _, labels in loader) == 9


# ----------------------------------------------------------------------------------------------------
# kill -9 mid-upload, resume


def write_noise_tree(root: Path, per_class: int) -> None:
    """JPEGs of noise (~60 kB each at 256x256): a few of them make shards big enough for multipart uploads."""
    rng = np.random.default_rng(0)
    for name in ("a", "b"):
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            buf = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (256, 256, 3), dtype=np.uint8)).save(buf, "JPEG", quality=90)
            (root / name / f"{i:04d}.jpg").write_bytes(buf.getvalue())


@pytest.mark.slow
def test_a_conversion_killed_mid_upload_resumes_into_the_same_dataset(s3_bucket, tmp_path):
    write_noise_tree(tmp_path / "src", per_class=200)  # 400 images, ~24 MB: shards of 9 MB, 9 MB, 6 MB
    options = ["--max-shard-bytes", "9MB", "--workers", "2"]
    straight = f"{s3_bucket}/straight"
    assert convert_to(tmp_path / "src", straight, *options).exit_code == 0

    killed = f"{s3_bucket}/killed"
    client, bucket = boto3.client("s3"), bucket_of(killed)
    command = [sys.executable, "-m", "dalifeed.convert.cli", "imagefolder", str(tmp_path / "src"), killed, "--quiet",
               "--staging", str(tmp_path / "staging-1"), *options]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    uploading, recorded, staged = [], [], 0
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline:
        uploading = client.list_multipart_uploads(Bucket=bucket, Prefix="killed/").get("Uploads", [])
        recorded = s3.list_objects(f"{killed}/.dalifeed-progress")
        staged = max(staged, len(list((tmp_path / "staging-1").glob("*.tar"))))
        if uploading and "train-000000.json" in recorded:  # one shard in the store, the next one on its way
            os.killpg(proc.pid, signal.SIGKILL)
            break
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the conversion finished before it could be killed mid-upload"
    assert staged <= MAX_PENDING + 1  # the staging folder held a few shards at most
    before = {o["Key"]: o["LastModified"] for o in client.list_objects_v2(Bucket=bucket, Prefix="killed/")["Contents"]}
    assert "killed/train-000000.tar" in before and "killed/manifest.json" not in before
    # LastModified has whole seconds: once the store's clock is a second past the last upload, another shows
    def store_now():
        return parsedate_to_datetime(client.list_objects_v2(Bucket=bucket, MaxKeys=1)["ResponseMetadata"]
                                     ["HTTPHeaders"]["date"])
    wait_for(lambda: (store_now() - max(before.values())).total_seconds() >= 1, what="the store's clock to tick")

    # resume from a fresh staging folder: the state comes from the store
    resumed, _ = run(["dalifeed.convert.cli", "imagefolder", str(tmp_path / "src"), killed, "--quiet",
                      "--staging", str(tmp_path / "staging-2"), *options])
    assert resumed.returncode == 0, resumed.stderr
    assert "(resumed)" in resumed.stdout
    assert s3.get_bytes(f"{killed}/manifest.json") == s3.get_bytes(f"{straight}/manifest.json")
    manifest = open_shard_folder(killed)
    assert [s3.object_sha256(manifest.shard_location(s)) for s in manifest.splits["train"].shards] == \
        [s.sha256 for s in manifest.splits["train"].shards]
    after = {o["Key"]: o["LastModified"] for o in client.list_objects_v2(Bucket=bucket, Prefix="killed/")["Contents"]}
    for name in ("killed/train-000000.tar", "killed/train-000000.idx"):
        assert after[name] == before[name], f"{name} was uploaded again"
    assert not client.list_multipart_uploads(Bucket=bucket, Prefix="killed/").get("Uploads")  # aborted
    assert not any(key.startswith("killed/.dalifeed-progress/") for key in after)
    assert not list((tmp_path / "staging-2").glob("*.tar"))


# ----------------------------------------------------------------------------------------------------
# refusals and failures, one line each


def test_conversion_refusals(s3_shards, s3_bucket, tmp_path):
    src, _, _ = s3_shards
    url = f"{s3_bucket}/x"
    assert convert_to(src, url, "--samples-per-shard", "5").exit_code == 0

    other = convert_to(src, url, "--samples-per-shard", "4")
    assert other.exit_code == 2
    assert f"{url}: output folder made with other input: --samples-per-shard was 5, now 4" in other.output

    s3.put_bytes(f"{s3_bucket}/y/notes.txt", b"someone else's")
    foreign = convert_to(src, f"{s3_bucket}/y")
    assert foreign.exit_code == 2 and f"{s3_bucket}/y: not empty (holds notes.txt)" in foreign.output

    local = convert_to(src, str(tmp_path / "out"), "--staging", str(tmp_path / "staging"))
    assert local.exit_code == 2 and "--staging applies only to an s3://bucket/prefix OUT" in local.output
    jobs = convert_to(src, f"{s3_bucket}/z", "--num-jobs", "2", "--overwrite")
    assert jobs.exit_code == 2 and "--overwrite with --num-jobs would delete other jobs' shards" in jobs.output
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "mine.txt").write_text("x")
    busy = convert_to(src, f"{s3_bucket}/z", "--staging", str(tmp_path / "busy"))
    assert busy.exit_code == 2 and "holds other files (mine.txt)" in busy.output

    replaced = convert_to(src, url, "--samples-per-shard", "20", "--overwrite")
    assert replaced.exit_code == 0, replaced.output
    assert sorted(n for n in s3.list_objects(url) if n.endswith(".tar")) == ["train-000000.tar",
                                                                                 "train-000001.tar",
                                                                                 "val-000000.tar"]


CONVERT = ["dalifeed.convert.cli", "imagefolder", "{src}", "{url}/new", "--staging", "{tmp}/staging"]
VERIFY = ["dalifeed.convert.cli", "verify", "{url}"]
INFO = ["dalifeed.convert.cli", "info", "{url}"]
TRAIN = ["dalifeed.train.cli", "--data", "{url}", "--out", "{tmp}/run", "--epochs", "1", *FAST]


def command(template: list[str], src: Path, url: str, tmp: Path) -> list[str]:
    return [part.format(src=src, url=url, tmp=tmp) for part in template]


@pytest.mark.parametrize("template", [CONVERT, VERIFY, INFO, TRAIN], ids=["convert", "verify", "info", "train"])
def test_no_credentials(s3_shards, template, tmp_path):
    src, _, url = s3_shards
    proc, _ = run(command(template, src / "train", url, tmp_path), AWS_ACCESS_KEY_ID=None, AWS_SECRET_ACCESS_KEY=None)
    assert proc.returncode == 1
    assert "no AWS credentials found: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in one_line_error(proc)


@pytest.mark.parametrize("template", [CONVERT, VERIFY, INFO, TRAIN], ids=["convert", "verify", "info", "train"])
def test_missing_bucket(s3_shards, template, tmp_path):
    src, _, _ = s3_shards
    proc, _ = run(command(template, src / "train", "s3://no-such-bucket/x", tmp_path))
    assert proc.returncode == 1
    assert "bucket 'no-such-bucket' does not exist at http://127.0.0.1:" in one_line_error(proc)


@pytest.mark.parametrize("template", [CONVERT, VERIFY, TRAIN], ids=["convert", "verify", "train"])
def test_unreachable_endpoint_fails_in_seconds(s3_shards, template, tmp_path):
    src, _, url = s3_shards
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    proc, seconds = run(command(template, src / "train", url, tmp_path), AWS_ENDPOINT_URL=closed)
    assert proc.returncode == 1
    assert f"object store {closed} unreachable (EndpointConnectionError)" in one_line_error(proc)
    assert seconds < 30  # 3 attempts with back-off, plus the start of Python, torch and DALI


@pytest.mark.slow
def test_an_endpoint_that_never_answers_times_out(s3_shards, tmp_path):
    with socket.socket() as silent:  # accepts connections (the kernel does), never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(16)
        endpoint = f"http://127.0.0.1:{silent.getsockname()[1]}"
        proc, seconds = run(command(VERIFY, tmp_path, s3_shards[2], tmp_path), AWS_ENDPOINT_URL=endpoint,
                            AWS_MAX_ATTEMPTS="1")
    assert proc.returncode == 1
    assert f"object store {endpoint} unreachable (ReadTimeoutError)" in one_line_error(proc)
    assert s3.READ_TIMEOUT_S <= seconds < s3.READ_TIMEOUT_S + 15


@pytest.fixture
def locked_bucket(tmp_path):
    """A second S3 server that checks credentials (moto's IAM emulation, after its first few requests), with
    a bucket and a user who has no permission on it: (endpoint, the user's key id, secret)."""
    server, endpoint = start_s3_server(tmp_path / "moto-iam.log", INITIAL_NO_AUTH_ACTION_COUNT="10")
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="locked")
        iam = boto3.client("iam", endpoint_url=endpoint)
        iam.create_user(UserName="nobody")
        key = iam.create_access_key(UserName="nobody")["AccessKey"]
        nobody = boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=key["AccessKeyId"],
                              aws_secret_access_key=key["SecretAccessKey"])
        for _ in range(10):  # use up the requests moto lets through unchecked
            try:
                nobody.list_objects_v2(Bucket="locked")
            except nobody.exceptions.ClientError:
                break
        else:
            pytest.fail("moto never began to check credentials")
        yield endpoint, key["AccessKeyId"], key["SecretAccessKey"]
    finally:
        stop_s3_server(server)


@pytest.mark.parametrize("template", [CONVERT, VERIFY], ids=["convert", "verify"])
def test_access_denied(s3_shards, locked_bucket, template, tmp_path):
    endpoint, key_id, secret = locked_bucket
    src = s3_shards[0]
    proc, _ = run(command(template, src / "train", "s3://locked/x", tmp_path), AWS_ENDPOINT_URL=endpoint,
                  AWS_ACCESS_KEY_ID=key_id, AWS_SECRET_ACCESS_KEY=secret)
    assert proc.returncode == 1
    assert "access denied (the credentials in use may not read or write bucket 'locked')" in one_line_error(proc)
    unknown, _ = run(command(template, src / "train", "s3://locked/x", tmp_path), AWS_ENDPOINT_URL=endpoint)
    assert "the store rejected the credentials (InvalidAccessKeyId)" in one_line_error(unknown)


# the store failing mid-epoch: tests/test_s3_cache.py (make_loader reads a store's tars through the shard cache)


def test_a_shard_missing_in_the_store(s3_shards, s3_bucket, tmp_path):
    src, local, _ = s3_shards
    url = f"{s3_bucket}/damaged"
    assert convert_to(src, url, "--samples-per-shard", "5").exit_code == 0
    s3.delete(url, ["train-000003.tar", "train-000003.idx"])
    hint = f"check the shards with: shard-convert verify --decode {url}"

    with pytest.raises(ShardDataError, match=f"^{url}/train-000003.tar: missing in the store; {hint}$"):
        make_loader(url, "train", 4, device="cpu")

    proc, _ = run(command(TRAIN, src, url, tmp_path))
    assert proc.returncode == 1
    assert f"Error: {url}/train-000003.tar: missing in the store; {hint}" in one_line_error(proc)

    verified = CliRunner().invoke(convert_cli, ["verify", url])
    assert verified.exit_code == 1
    assert f"{url}/train-000003.tar: missing in the store\n" in verified.output

    info = CliRunner().invoke(convert_cli, ["info", url])
    assert info.exit_code == 0, info.output
    assert "; DALI indexes 1 MISSING (e.g. train-000003.idx)" in info.output  # a HEAD per index
    assert "; DALI indexes all present" in info.output  # val's
