"""The node's shard cache (dalifeed/pipelines/shardcache.py) against a real local S3 server (moto, its own process with
its own request log, from which GETs are counted): one GET per tar, batches equal to the local folder's,
the limit and eviction, two ranks (processes) sharing one download, a killed download never read, a wrong
cache entry re-fetched, the store lost mid-epoch and a full disk, each failure one line."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import boto3
import pytest
import torch

from dalifeed import s3
from dalifeed.convert import ConvertConfig, convert_imagefolder
from dalifeed.pipelines import AugmentConfig, make_loader, open_dataset
from dalifeed.pipelines.elastic import merge_rank_states
from dalifeed.pipelines.shardcache import CacheConfig, CacheFull, ShardCache, cache_config, rank_shards
from dalifeed.shardfolder import open_shard_folder
from fast_recipe import fast_args
from helpers import start_s3_server, stop_s3_server, write_imagefolder

HERE = Path(__file__).parent
SPEC = {"a": 13, "b": 11, "c": 7}  # 31 samples, 5 a tar: 7 tars
OPTIONS = dict(device="cpu", augment=AugmentConfig(image_size=16), seed=3, initial_fill=8, num_threads=1)


class Store:
    """A moto server of this module's own: its endpoint, request log and the shards converted into it and
    into a local folder."""

    def __init__(self, tmp: Path):
        self.log = tmp / "moto.log"
        self.server, self.endpoint = start_s3_server(self.log)
        self.tmp = tmp

    def gets(self, url: str) -> Counter:
        """GETs of each .tar under `url` so far, from the server's request log: name -> count."""
        bucket, prefix = s3.parse_s3_url(url)
        found = re.findall(rf'"GET /{re.escape(bucket)}/{re.escape(prefix)}/([^ ?/]+\.tar)[ ?]', self.log.read_text())
        return Counter(found)


@pytest.fixture(scope="module")
def store(s3_endpoint, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("s3-cache")
    st = Store(tmp)
    saved = os.environ["AWS_ENDPOINT_URL"]
    os.environ["AWS_ENDPOINT_URL"] = st.endpoint
    try:
        boto3.client("s3").create_bucket(Bucket="cache")
        write_imagefolder(tmp / "src", SPEC, size=(40, 32))
        convert_imagefolder(ConvertConfig(src=tmp / "src", out=tmp / "local", samples_per_shard=5, progress=False))
        st.url = "s3://cache/photos"
        convert_imagefolder(ConvertConfig(src=tmp / "src", out=st.url, samples_per_shard=5, progress=False))
        st.local = tmp / "local"
        yield st
    finally:
        os.environ["AWS_ENDPOINT_URL"] = saved
        stop_s3_server(st.server)


def batches_of(loader, epochs: int) -> list[list]:
    return [list(loader) for _ in range(epochs)]


def assert_same(got: list, want: list) -> None:
    assert len(got) == len(want) > 0
    for (images, labels), (images2, labels2) in zip(got, want):
        assert torch.equal(labels, labels2)
        assert torch.equal(images, images2)


def tar_names(url: str) -> list[str]:
    return sorted(n for n in s3.list_objects(url) if n.endswith(".tar"))


def cached_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in (folder / "shards").glob("*.tar"))


# ----------------------------------------------------------------------------------------------------
# reading through the cache


def test_one_get_per_tar_then_none_and_the_batches_of_the_local_folder(store, tmp_path):
    """Two ranks (in turn, one cache folder) over three epochs: each tar is fetched once for the node, the
    batches are those of the local folder, and a mid-epoch resume from the cache is bit-exact."""
    before = store.gets(store.url)
    for rank in (0, 1):
        from_s3 = make_loader(open_dataset(store.url, cache_dir=tmp_path / "cache"), "train", 4, rank=rank,
                              world_size=2, **OPTIONS)
        from_disk = make_loader(store.local, "train", 4, rank=rank, world_size=2, **OPTIONS)
        for _epoch in range(3):
            assert_same(list(from_s3), list(from_disk))
    fetched = store.gets(store.url) - before
    assert set(fetched) == set(tar_names(store.url)) and set(fetched.values()) == {1}, fetched

    # resume mid-epoch from a state taken over s3://: the rest of the epoch is the uninterrupted one's
    whole = make_loader(store.local, "train", 4, checkpointing=True, **OPTIONS)
    want = list(whole)
    first = make_loader(open_dataset(store.url, cache_dir=tmp_path / "cache"), "train", 4, checkpointing=True,
                        **OPTIONS)
    it = iter(first)
    head = [next(it), next(it)]
    state = first.state_dict()
    del it
    rest = make_loader(open_dataset(store.url, cache_dir=tmp_path / "cache"), "train", 4, checkpointing=True, **OPTIONS)
    rest.load_state_dict(state)
    assert_same(head + list(rest), want)
    assert store.gets(store.url) - before == fetched  # all from the cache


def test_a_mid_epoch_state_of_two_ranks_continues_on_three_through_the_cache(store, tmp_path):
    """Elastic resume from s3:// through the node cache: 2 ranks stop after 2 steps, 3 ranks read the rest of the
    epoch (each rank fetching the tars its share of the remaining samples lies in): every sample of the epoch's 5
    global batches of 6 once, as the loaders name them (`last_samples`)."""
    def ranks(world):
        return [make_loader(open_dataset(store.url, cache_dir=tmp_path / "cache"), "train", 6 // world, rank=r,
                            world_size=world, checkpointing=True, **OPTIONS) for r in range(world)]

    two = ranks(2)
    iterators = [iter(loader) for loader in two]
    seen = []
    for _ in range(2):
        for loader, it in zip(two, iterators):
            next(it)
            seen += loader.last_samples
    merged = merge_rank_states([loader.state_dict() for loader in two])
    del iterators
    three = ranks(3)
    for loader in three:
        loader.load_state_dict(merged)
    steps = []
    for loader in three:
        steps.append(0)
        for _ in loader:
            seen += loader.last_samples
            steps[-1] += 1
    assert steps == [3, 3, 3]  # 31 // 6 = 5 steps an epoch, 2 of them taken
    assert len(seen) == len(set(seen)) == 30  # one sample of 31 is left out, as in every epoch of batch 6


def test_the_limit_evicts_shards_already_read(store, tmp_path):
    """A limit of about one rank's epoch: every epoch still reads the local folder's batches, the cache never
    holds more than the limit, and tars of earlier epochs make room."""
    manifest = open_shard_folder(store.url)
    probe = make_loader(store.local, "train", 4, rank=0, world_size=2, **OPTIONS)
    slices = [rank_shards(probe.plan.epoch_shards(e), probe.plan.shard_range(0)) for e in range(4)]
    limit = max(sum(-(-s.bytes // 4096) * 4096 for s in shards) for shards in slices)
    folder = tmp_path / "cache"
    from_s3 = make_loader(open_dataset(store.url, cache_dir=folder, cache_limit=limit), "train", 4, rank=0,
                          world_size=2, **OPTIONS)
    before = store.gets(store.url)
    for _epoch in range(4):
        assert_same(list(from_s3), list(probe))
        assert cached_bytes(folder) <= limit
    fetched = store.gets(store.url) - before
    split_bytes = sum(s.bytes for s in manifest.split_info("train").shards)
    assert limit < split_bytes and cached_bytes(folder) < split_bytes  # it did not simply keep everything
    assert sum(fetched.values()) <= sum(len(s) for s in slices)  # at most one GET per tar per epoch
    assert max(fetched.values()) > 1  # a tar evicted was fetched again later

    with pytest.raises(CacheFull, match=r"^s3://cache/photos: the shard cache's limit 1.0 KiB \(--cache-limit\) is "
                                        r"below the [0-9.]+ KiB of the \d tars this rank reads in one epoch"):
        list(make_loader(open_dataset(store.url, cache_dir=tmp_path / "tiny", cache_limit="1KiB"), "train", 4,
                         **OPTIONS))


def test_a_wrong_cache_entry_is_fetched_again_and_said_once(store, tmp_path):
    manifest = open_shard_folder(store.url)
    shard = manifest.split_info("train").shards[0]
    lines = []
    cache = ShardCache(manifest, CacheConfig(tmp_path / "cache"), log=lines.append)
    cache.pin(shard)
    cache.close()
    entry = cache.path(shard)
    entry.write_bytes(entry.read_bytes()[:100])  # truncated (a disk error, someone's hands)
    again = ShardCache(manifest, CacheConfig(tmp_path / "cache"), log=lines.append)
    again.pin(shard)
    again.pin(shard)
    assert entry.read_bytes() == (store.local / shard.path).read_bytes()
    assert lines == [f"{entry}: cache entry of {store.url}/{shard.path} is wrong (100 bytes, the manifest says "
                     f"{shard.bytes}): fetching it again"]

    # same size, other bytes: only a sha256 check sees it
    data = bytearray(entry.read_bytes())
    data[-1] ^= 1
    again.close()
    entry.write_bytes(bytes(data))
    hashed = ShardCache(manifest, CacheConfig(tmp_path / "cache", verify_sha256=True), log=lines.append)
    hashed.pin(shard)
    assert entry.read_bytes() == (store.local / shard.path).read_bytes()
    assert lines[1].endswith("is wrong (sha256 differs from the manifest): fetching it again")


def test_cache_limit_and_max_shard_bytes_read_a_size_the_same_way(store, tmp_path):
    """One size grammar (issue 31): SI units as powers of 1000, IEC as powers of 1024, for every flag."""
    from dalifeed.convert.cli import main as convert_cli

    manifest = open_shard_folder(store.url)
    for text, size in [("512MB", 512 * 10**6), ("512MiB", 512 * 2**20), ("1.5KB", 1500), ("4096", 4096)]:
        cache = ShardCache(manifest, cache_config(tmp_path / "cache", text))
        converting = convert_cli.commands["imagefolder"].make_context(
            "imagefolder", [str(store.tmp / "src"), str(tmp_path / "out"), "--max-shard-bytes", text])
        assert cache.limit == converting.params["max_shard_bytes"] == size
        cache.close()


def test_an_ambiguous_size_is_refused(store, tmp_path):
    with pytest.raises(ValueError, match=r"^'500M': write MB \(powers of 1000\) or MiB \(powers of 1024\)$"):
        cache_config(tmp_path / "cache", "500M")


# ----------------------------------------------------------------------------------------------------
# processes: two ranks, a killed download, the store lost, a full disk

RANK = """
import sys, time, torch
from pathlib import Path
from dalifeed.pipelines import AugmentConfig, make_loader, open_dataset
url, folder, out, go = sys.argv[1:5]
loader = make_loader(open_dataset(url, cache_dir=folder), "train", 4, augment=AugmentConfig(image_size=16),
                     device="cpu", seed=3, initial_fill=8, num_threads=1)
Path(out + ".ready").touch()
while not Path(go).exists():
    time.sleep(0.01)
torch.save([list(loader) for _ in range(2)], out)
"""


def start_proxy(upstream: str, delay_ms: float, rate_mb: float | None = None) -> tuple[subprocess.Popen, str]:
    args = [sys.executable, str(HERE / "latency_proxy.py"), "--upstream", upstream.split("//")[1],
            "--delay-ms", str(delay_ms)]
    proxy = subprocess.Popen(args + (["--rate-mb", str(rate_mb)] if rate_mb else []), stdout=subprocess.PIPE,
                             text=True)
    return proxy, proxy.stdout.readline().strip()


def test_two_ranks_of_a_node_fetch_each_tar_once(store, tmp_path):
    """Two processes reading the whole split at once through one cache folder (behind 20 ms of latency, so
    that they do meet): one GET per tar between them, and both read the local folder's batches."""
    proxy, endpoint = start_proxy(store.endpoint, 20)
    before = store.gets(store.url)
    try:
        env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
        ranks = [subprocess.Popen([sys.executable, "-c", RANK, store.url, str(tmp_path / "cache"),
                                   str(tmp_path / f"rank{r}.pt"), str(tmp_path / "go")], env=env) for r in (0, 1)]
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"rank{r}.pt.ready").exists() for r in (0, 1)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in ranks)
            time.sleep(0.05)
        (tmp_path / "go").touch()
        assert [p.wait(300) for p in ranks] == [0, 0]
    finally:
        proxy.kill()
    fetched = store.gets(store.url) - before
    assert set(fetched) == set(tar_names(store.url)) and set(fetched.values()) == {1}, fetched
    want = batches_of(make_loader(store.local, "train", 4, **OPTIONS), 2)
    for r in (0, 1):
        got = torch.load(tmp_path / f"rank{r}.pt")
        for epoch in range(2):
            assert_same(got[epoch], want[epoch])


FETCH_ONE = """
import sys
from pathlib import Path
from dalifeed.pipelines.shardcache import CacheConfig, ShardCache
from dalifeed.shardfolder import open_shard_folder
manifest = open_shard_folder(sys.argv[1])
ShardCache(manifest, CacheConfig(Path(sys.argv[2]))).pin(manifest.split_info("train").shards[0])
"""


def test_a_killed_download_is_never_read(store, tmp_path):
    """A rank killed (SIGKILL) while it downloads a tar leaves a part file, never the tar; the next rank that
    needs it fetches it whole. The answer is slowed to 5 kB/s, so the 30 kB tar's GET takes 6 s at least: the
    download is in flight from the moment its part file appears until then, and the test kills it at once."""
    proxy, endpoint = start_proxy(store.endpoint, 0, rate_mb=0.005)
    folder = tmp_path / "cache"
    manifest = open_shard_folder(store.url)
    shard = manifest.split_info("train").shards[0]
    assert shard.bytes >= 30_000  # the 6 s above
    try:
        child = subprocess.Popen([sys.executable, "-c", FETCH_ONE, store.url, str(folder)],
                                 env={**os.environ, "AWS_ENDPOINT_URL": endpoint})
        deadline = time.monotonic() + 60
        while not list((folder / "shards").glob("*.part")):
            assert time.monotonic() < deadline and child.poll() is None
            time.sleep(0.02)
        child.send_signal(signal.SIGKILL)
        assert child.wait() == -signal.SIGKILL  # killed, not finished
    finally:
        proxy.kill()
    assert not list((folder / "shards").glob("*.tar"))
    [part] = (folder / "shards").glob("*.part")
    assert part.read_bytes() != (store.local / shard.path).read_bytes()  # allocated, the tar not (all) in it

    cache = ShardCache(manifest, CacheConfig(folder))
    cache.pin(shard)
    assert cache.path(shard).read_bytes() == (store.local / shard.path).read_bytes()
    assert not list((folder / "shards").glob("*.part"))


READ_THEN_LOSE_THE_STORE = """
import os, signal, sys
from dalifeed.pipelines import AugmentConfig, make_loader, open_dataset
from dalifeed.pipelines.shardcache import rank_shards
url, local, folder, server = sys.argv[1:5]
def on_disk(shards):
    return sum(-(-s.bytes // 4096) * 4096 for s in shards)
for seed in range(100):  # a seed whose second epoch needs other tars, in no more room than the first's
    options = dict(device="cpu", augment=AugmentConfig(image_size=16), seed=seed, initial_fill=8, num_threads=1,
                   rank=0, world_size=2)
    probe = make_loader(local, "train", 4, **options)
    first, second = (rank_shards(probe.plan.epoch_shards(e), probe.plan.shard_range(0)) for e in (0, 1))
    limit = on_disk(first)  # no room to fetch the next epoch ahead
    if {s.path for s in second} - {s.path for s in first} and on_disk(second) <= limit:
        break
loader = make_loader(open_dataset(url, cache_dir=folder, cache_limit=limit), "train", 4, **options)
batches = iter(loader)
got = [next(batches)]
os.kill(int(server), signal.SIGKILL)
got += list(batches)
print(f"epoch 1: {len(got)} of {len(loader)} batches")
try:
    list(loader)
except Exception as e:
    print(f"{type(e).__name__}: {e}")
"""


def test_the_store_lost_mid_epoch(s3_endpoint, store, tmp_path):
    """The store killed during an epoch: the epoch ends normally (its tars were fetched before it began);
    the next epoch, which needs tars the cache had no room for in advance, retries with back-off and stops
    in one line naming the tar and the endpoint."""
    server, endpoint = start_s3_server(tmp_path / "moto.log")  # its own: this test kills it
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    try:
        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="mid")
        convert = subprocess.run([sys.executable, "-c", "import sys; from dalifeed.convert import ConvertConfig, "
                                  "convert_imagefolder as c; c(ConvertConfig(src=sys.argv[1], out='s3://mid/p', "
                                  "samples_per_shard=5, progress=False))", str(store.tmp / "src")], env=env)
        assert convert.returncode == 0
        started = time.monotonic()
        proc = subprocess.run([sys.executable, "-c", READ_THEN_LOSE_THE_STORE, "s3://mid/p", str(store.local),
                               str(tmp_path / "cache"), str(server.pid)], capture_output=True, text=True,
                              timeout=300, env=env)
        seconds = time.monotonic() - started
    finally:
        stop_s3_server(server)
    lines = proc.stdout.splitlines()
    assert len(lines) == 2, proc.stdout + proc.stderr
    assert lines[0] == "epoch 1: 3 of 3 batches"
    assert re.fullmatch(rf"StorageError: s3://mid/p/train-\d+\.tar: object store {endpoint} unreachable "
                        rf"\(EndpointConnectionError\); check AWS_ENDPOINT_URL and the network \(fetching "
                        rf"train-\d+\.tar into the shard cache: gave up after 5 attempts in \d+ s\)",
                        lines[1]), lines[1]
    assert seconds < 120


DISK_FULL = """
import resource, signal, sys
from pathlib import Path
from dalifeed.pipelines.shardcache import CacheConfig, ShardCache
from dalifeed.shardfolder import open_shard_folder
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write beyond the limit fails with EFBIG instead
manifest = open_shard_folder(sys.argv[1])
cache = ShardCache(manifest, CacheConfig(Path(sys.argv[2]), limit=2**30))
resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000))  # a "disk" of 1000 bytes per file
try:
    cache.pin(manifest.split_info("train").shards[0])
except Exception as e:
    print(f"{type(e).__name__}: {e}")
"""


def test_a_full_disk_is_one_line_with_the_sizes(store, tmp_path):
    proc = subprocess.run([sys.executable, "-c", DISK_FULL, store.url, str(tmp_path / "cache")], capture_output=True,
                          text=True, timeout=120)
    assert re.fullmatch(r"CacheFull: \S+\.part: the disk of the shard cache is full \([0-9.]+ \w+ free of [0-9.]+ "
                        r"\w+; the cache holds [0-9.]+ \w+, its limit is 1.0 GiB\): lower --cache-limit or free "
                        r"space\n", proc.stdout), proc.stdout + proc.stderr
    assert not list((tmp_path / "cache" / "shards").iterdir())


def test_a_cache_limit_that_is_not_a_size_is_a_usage_error(store, tmp_path):
    from click.testing import CliRunner

    from dalifeed.bench.cli import main as bench_cli
    from dalifeed.train.cli import main as train_cli

    trained = CliRunner().invoke(train_cli, ["--data", store.url, "--out", str(tmp_path / "run"),
                                             "--cache-limit", "lots"])
    assert trained.exit_code == 2
    assert "Invalid value for '--cache-limit': not a size: 'lots' (e.g. 4096, 512MB, 256MiB, 1GiB)" in trained.output
    benched = CliRunner().invoke(bench_cli, ["--shards", store.url, "--imagefolder", str(store.tmp / "src"),
                                             "--out", str(tmp_path / "bench"), "--cache-limit", "lots"])
    assert benched.exit_code == 2
    assert "Invalid value for '--cache-limit': not a size: 'lots' (e.g. 4096, 512MB, 256MiB, 1GiB)" in benched.output


def test_dali_opens_every_tar_when_it_builds_the_pipeline(store, tmp_path):
    """The premise of the cache's design (docs/storage.md): DALI 2.4 maps every tar of `paths` at build, even
    one its reader reaches last, so a rank's tars must all be local before its epoch's pipeline is built. If a
    DALI version opens them lazily, this fails, and the cache could hand tars over while the epoch runs."""
    loader = make_loader(store.local, "train", 4, rank=0, world_size=2, **OPTIONS)
    tars, indexes = loader.plan.epoch_files(loader.plan.epoch_shards(0), 0)
    own = [t for t in tars if Path(t).name in {s.path for s in rank_shards(loader.plan.epoch_shards(0),
                                                                           loader.plan.shard_range(0))}]
    missing = str(tmp_path / "missing.tar")
    loader.plan.epoch_files = lambda shards, epoch: ([missing if t == own[-1] else t for t in tars], indexes)
    pipes, _, _ = loader.definitions.define(0)  # the lane reading the rank's last tar, built alone
    with pytest.raises(RuntimeError, match=rf"File mapping failed: {re.escape(missing)}"):
        pipes[-1].build()


def shifted_labels(tar: bytes) -> bytes:
    """The same tar with every label moved to the next class: same size, other bytes (issue 32's tampering)."""
    import io
    import tarfile

    out = io.BytesIO()
    with tarfile.open(fileobj=io.BytesIO(tar)) as src, tarfile.open(fileobj=out, mode="w", format=src.format) as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if member.name.endswith(".cls"):
                data = str((int(data) + 1) % len(SPEC)).encode()
            dst.addfile(member, io.BytesIO(data))
    return out.getvalue()[:len(tar)].ljust(len(tar), b"\0")


def test_a_tampered_tar_in_the_store_is_refused_and_a_restored_one_cached(store, tmp_path):
    manifest = open_shard_folder(store.url)
    shard = manifest.split_info("train").shards[0]
    good = (store.local / shard.path).read_bytes()
    bad = shifted_labels(good)
    assert len(bad) == len(good) and bad != good
    bucket, prefix = s3.parse_s3_url(f"{store.url}/{shard.path}")
    client = boto3.client("s3")
    client.put_object(Bucket=bucket, Key=prefix, Body=bad)
    try:
        cache = ShardCache(manifest, CacheConfig(tmp_path / "cache"))
        with pytest.raises(s3.ObjectProblem, match=rf"^{re.escape(store.url)}/{shard.path}: its sha256 is "
                           rf"[0-9a-f]{{64}}, the manifest says {shard.sha256} .*restore the object or re-run "
                           r"the conversion; nothing was cached$") as refused:
            cache.pin(shard)
        assert "\n" not in str(refused.value)
        assert sorted(p.name for p in (tmp_path / "cache" / "shards").iterdir()) == []
    finally:
        client.put_object(Bucket=bucket, Key=prefix, Body=good)
    cache.pin(shard)
    assert cache.path(shard).read_bytes() == good


def test_a_warm_cache_written_without_hashing_is_not_served(store, tmp_path):
    manifest = open_shard_folder(store.url)
    shard = manifest.split_info("train").shards[0]
    good = (store.local / shard.path).read_bytes()
    folder = tmp_path / "cache"
    # what a dalifeed before cache format 2 could leave: a tampered tar under the good name, no format marker
    (folder / "shards").mkdir(parents=True)
    (folder / "shards" / f"{shard.sha256}.tar").write_bytes(shifted_labels(good))
    cache = ShardCache(manifest, CacheConfig(folder))
    cache.pin(shard)
    assert cache.path(shard).read_bytes() == good
    assert (folder / "format").read_text() == "2\n"
    assert store.gets(store.url)[Path(shard.path).name] >= 1


def test_dali_train_refuses_a_tampered_tar_in_one_line(store, tmp_path):
    manifest = open_shard_folder(store.url)
    shard = manifest.split_info("train").shards[0]
    good = (store.local / shard.path).read_bytes()
    bucket, prefix = s3.parse_s3_url(f"{store.url}/{shard.path}")
    client = boto3.client("s3")
    client.put_object(Bucket=bucket, Key=prefix, Body=shifted_labels(good))
    env = dict(os.environ, PYTHONPATH=str(HERE.parent), AWS_ENDPOINT_URL=store.endpoint)
    try:
        run = subprocess.run([sys.executable, "-m", "dalifeed.train.cli", "--data", store.url, "--epochs", "1",
                              "--val-split", "none", *fast_args(width=8, batch_size=4), "--cache-dir",
                              str(tmp_path / "cache"), "--out", str(tmp_path / "run")],
                             capture_output=True, text=True, env=env, timeout=600)
    finally:
        client.put_object(Bucket=bucket, Key=prefix, Body=good)
    assert run.returncode == 1, run.stderr
    errors = [line for line in run.stderr.splitlines() if "sha256 is" in line]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    assert "restore the object or re-run the conversion" in errors[0]
    cached = {p.name for p in (tmp_path / "cache" / "shards").iterdir()}  # the good tars fetched alongside stay
    assert f"{shard.sha256}.tar" not in cached and f"{shard.sha256}.part" not in cached
