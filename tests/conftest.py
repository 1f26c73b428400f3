"""Shared fixtures: tiny, real ImageFolder trees written with PIL in tmp_path."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from helpers import start_s3_server, stop_s3_server, write_imagefolder


def has_gpu() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:
        return False


SEED_VARIABLE = "DALIFEED_TEST_SEED"


def training_seed() -> int:
    """The seed of the tests marked `learns`: $DALIFEED_TEST_SEED, 0 when unset. Such a test must pass for
    any seed; `make test-seeds` runs them for seeds 0-4 to show that a result is by design, not by luck."""
    value = os.environ.get(SEED_VARIABLE, "0")
    try:
        return int(value)
    except ValueError:
        raise pytest.UsageError(f"{SEED_VARIABLE} must be an integer, got {value!r}") from None


def pytest_configure(config):
    training_seed()  # a DALIFEED_TEST_SEED that is not a number stops the run before any test


@pytest.fixture
def seed() -> int:
    """The training tests' seed (weights, sample order, augmentations): see `training_seed`."""
    return training_seed()


def pytest_report_header(config):
    """The seed and the SIMD kernels in force, so that a failing run says how to repeat it."""
    import torch

    return (f"dalifeed: {SEED_VARIABLE}={training_seed()}, torch kernels {torch.backends.cpu.get_cpu_capability()}, "
            f"ONEDNN_MAX_CPU_ISA={os.environ.get('ONEDNN_MAX_CPU_ISA', '(all)')}")


def check_training_tests_take_the_seed(items) -> None:
    """A test marked `learns` that ignored the seed would pass `make test-seeds` five times for one seed."""
    for item in items:
        learns, seeded = item.get_closest_marker("learns") is not None, "seed" in getattr(item, "fixturenames", ())
        if learns != seeded:
            raise pytest.UsageError(f"{item.nodeid}: a test marked `learns` takes the `seed` fixture, and only such "
                                    f"a test does (marked: {learns}, seeded: {seeded})")


@pytest.hookimpl(trylast=True)  # after -m and -k have deselected: `items` are the tests that will run
def pytest_collection_modifyitems(config, items):
    check_training_tests_take_the_seed(items)
    if has_gpu():
        return
    gpu = [item for item in items if item.get_closest_marker("gpu")]  # the marker, not a test id like `[gpu]`
    if gpu and len(gpu) == len(items):
        # a run of GPU tests only (make test-gpu, pytest -m gpu) that could run none of them proves nothing
        pytest.exit(f"no CUDA GPU visible to torch, so none of the {len(gpu)} gpu tests can run: {gpu_verdict()}",
                    returncode=3)
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in gpu:
        item.add_marker(skip)


def gpu_verdict() -> str:
    """`dalifeed doctor`'s verdict on this node, and its first problem or note."""
    from dalifeed.doctor import verdict
    from dalifeed.stack import stack_report

    try:
        report = stack_report()
    except Exception as e:  # the line must still be one line
        return f"the stack check failed ({type(e).__name__}: {e}); run dalifeed doctor"
    why = (report.problems or report.notes or [""])[0]
    return verdict(report) + (f" ({why})" if why else "")


@pytest.fixture
def small_imagefolder(tmp_path: Path) -> Path:
    return write_imagefolder(tmp_path / "small", {"a": 13, "b": 11, "c": 7})


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A local S3 server for the session (moto, a subprocess), with the standard AWS variables pointing at it
    set in os.environ until the session ends, then restored. Set for the session, not per test, because
    DALI's S3 client reads them once per process, when the first s3:// pipeline is built; they change
    nothing for tests that do not use s3://. ~/.aws is kept out (AWS_CONFIG_FILE, AWS_SHARED_CREDENTIALS_FILE)
    and dalifeed's cache goes to a session folder. Yields the endpoint URL."""
    pytest.importorskip("moto.server")
    tmp = tmp_path_factory.mktemp("s3")
    server, endpoint = start_s3_server(tmp / "moto.log")
    env = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", "AWS_CONFIG_FILE": os.devnull,
           "AWS_SHARED_CREDENTIALS_FILE": os.devnull, "DALIFEED_CACHE": str(tmp / "cache")}
    cleared = ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_REGION", "AWS_ENDPOINT_URL_S3", "AWS_MAX_ATTEMPTS")
    saved = {name: os.environ.get(name) for name in (*env, *cleared)}
    os.environ.update(env)
    for name in cleared:
        os.environ.pop(name, None)
    try:
        yield endpoint
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        stop_s3_server(server)


@pytest.fixture
def s3_bucket(s3_endpoint, request) -> str:
    """A new, empty bucket for one test: its s3:// URL."""
    import boto3

    name = re.sub(r"[^a-z0-9-]", "-", request.node.name.lower())[:50].strip("-") + f"-{time.monotonic_ns() % 10**6}"
    boto3.client("s3").create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture(scope="session")
def mini_coco_shards(tmp_path_factory) -> Path:
    """tests/helpers.write_coco's set converted by shard-convert coco: one split, 'mini' (8 images). Read only."""
    from dalifeed.convert.coco import CocoConfig, convert_coco
    from helpers import write_coco

    tmp = tmp_path_factory.mktemp("coco")
    images, annotations = write_coco(tmp / "coco")
    convert_coco(CocoConfig(images=[images], annotations=[annotations], out=tmp / "out", progress=False, workers=1))
    return tmp / "out"


@pytest.fixture(scope="session")
def make_shards(tmp_path_factory):
    """Shards from a spec, built once per session: `make_shards({"a": 13, "b": 11}, samples_per_shard=5)`
    writes an ImageFolder tree of generated JPEGs (`write_imagefolder`; `{"train": {...}, "val": {...}}`
    for a tree with both splits) and converts it with the given ConvertConfig options. Returns (tree, shards).
    Tests that only read the shards share one copy; a test that damages them must build its own."""
    from dalifeed.convert import ConvertConfig, convert_imagefolder

    built: dict[str, tuple[Path, Path]] = {}

    def build(spec: dict, *, size=(24, 20), seed: int = 0, **options) -> tuple[Path, Path]:
        key = json.dumps([spec, size, seed, options], sort_keys=True)
        if key not in built:
            tmp = tmp_path_factory.mktemp("shards")
            if set(spec) <= {"train", "val"} and all(isinstance(v, dict) for v in spec.values()):
                for i, (split, counts) in enumerate(spec.items()):
                    write_imagefolder(tmp / "src" / split, counts, seed=seed + i, size=size)
            else:
                write_imagefolder(tmp / "src", spec, seed=seed, size=size)
            convert_imagefolder(ConvertConfig(src=tmp / "src", out=tmp / "shards", progress=False, **options))
            built[key] = (tmp / "src", tmp / "shards")
        return built[key]

    return build
