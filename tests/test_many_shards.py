"""Any number of shards (dalifeed/pipelines/lanes.py, `lane_files` and `mapping_budget`): DALI's webdataset reader
keeps every tar it is given mapped, without a descriptor, up to a process-wide budget of half `vm.max_map_count`
tars, and opens each tar beyond it for the pipeline's life. Each lane is given only the tars holding its samples,
so a rank's readers hold its epoch's tars once; an open-file limit met anyway is said as the limit, not the shards.
The limits are set in a child process (`resource.setrlimit`), the way `ulimit -n` sets them for a run."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from dalifeed.pipelines import AugmentConfig, make_loader
from dalifeed.pipelines.lanes import lane_files, lane_range, lane_sizes, mapping_budget
from dalifeed.pipelines.loader import OWN_TARS
from helpers import convert, one_image_classes, write_imagefolder

SEED_SAMPLES = 3


def many_shards(root: Path, n: int) -> Path:
    """A shard folder of `n` one-sample tars, made in seconds: three tars converted, then hard-linked `n` times
    (tar and index) under the names a conversion gives, in a manifest listing them all."""
    write_imagefolder(root / "src" / "train", {"a": 2, "b": 1}, size=(8, 8))
    convert(root / "src", root / "seed", samples_per_shard=1)
    doc = json.loads((root / "seed" / "manifest.json").read_text())
    seeds = doc["splits"]["train"]["shards"]
    assert len(seeds) == SEED_SAMPLES
    out = root / "shards"
    out.mkdir()
    shards = []
    for i in range(n):
        seed = seeds[i % SEED_SAMPLES]
        tar, idx = f"train-{i:06d}.tar", f"train-{i:06d}.idx"
        os.link(root / "seed" / seed["path"], out / tar)
        os.link(root / "seed" / seed["index"], out / idx)
        shards.append({**seed, "path": tar, "index": idx})
    split = doc["splits"]["train"]
    split.update(shards=shards, samples=n, bytes=sum(s["bytes"] for s in shards),
                 class_counts=[n - n // SEED_SAMPLES, n // SEED_SAMPLES])
    (out / "manifest.json").write_text(json.dumps(doc))
    return out


def run_limited(code: str, open_files: int, timeout: float = 300) -> dict:
    """`code` in a child Python whose soft open-file limit is `open_files`; it prints one JSON line."""
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE,
                                                                                 (open_files, hard)))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("counts, start, end, expected", [
    ([5, 5, 5, 5, 5, 5, 5, 2], 0, 18, [(0, 0, 5), (1, 0, 5), (2, 0, 5), (3, 0, 3)]),
    ([5, 5, 5, 5, 5, 5, 5, 2], 18, 37, [(3, 3, 2), (4, 0, 5), (5, 0, 5), (6, 0, 5), (7, 0, 2)]),
    ([1] * 7, 3, 4, [(3, 0, 1)]),
    ([10], 2, 5, [(0, 2, 3)]),
    ([4, 4], 4, 4, []),
])
def test_a_lane_is_given_the_files_holding_its_samples_cut_at_its_ends(counts, start, end, expected):
    assert lane_files(counts, start, end) == expected


@pytest.mark.parametrize("total, world, lanes", [(37, 1, 2), (37, 3, 2), (1007, 8, 3), (20000, 1, 2)])
def test_lanes_files_cover_the_ranks_samples_once(total, world, lanes):
    counts = [7] * (total // 7) + ([total % 7] if total % 7 else [])
    for rank in range(world):
        sizes = lane_sizes(total, rank, world, lanes)
        for lane in range(lanes):
            start, end = lane_range(total, rank, world, lanes, lane)
            assert end - start == sizes[lane]
            parts = lane_files(counts, start, end)
            assert sum(samples for _, _, samples in parts) == end - start
            assert len(parts) <= (end - start) // 7 + 2  # whole files, and at most one cut at each end


def test_the_mapping_budget_is_half_the_kernels_map_count():
    assert mapping_budget() == int(Path("/proc/sys/vm/max_map_count").read_text()) // 2


@pytest.mark.slow
def test_twenty_thousand_shards_train_in_two_lanes_under_a_limit_of_5000_open_files(tmp_path):
    """The CPU loader's default lanes (two) read an epoch of 20,000 one-sample tars, and begin the next, holding
    a few descriptors: each lane's reader maps its own 10,000 tars (the two lanes of the next epoch are built once
    this epoch's are freed, where both would not fit DALI's mapping budget)."""
    shards = many_shards(tmp_path, 20_000)
    got = run_limited(f"""
        import json, os
        from dalifeed.pipelines import AugmentConfig, make_loader
        fds = lambda: len(os.listdir("/proc/self/fd"))
        loader = make_loader({str(shards)!r}, "train", 64, device="cpu", num_threads=2, seed=1, initial_fill=64,
                             augment=AugmentConfig(image_size=8))
        before, most, labels = fds(), 0, []
        for images, y in loader:
            labels += y.tolist()
            most = max(most, fds())
        ahead = loader._next is not None
        first = next(iter(loader))[1].tolist()
        most = max(most, fds())
        print(json.dumps(dict(lanes=loader.options.lanes, batches=len(loader), labels=labels, before=before,
                              most=most, first=len(first), ahead=ahead)))
        """, open_files=5000)
    assert got["lanes"] == 2
    assert len(got["labels"]) == got["batches"] * 64 == 20_000 // 64 * 64
    assert got["first"] == 64
    # the next epoch's lanes start before this one ends only where both epochs' tars keep mapped
    assert got["ahead"] == (2 * 20_000 <= mapping_budget())
    # labels follow i % 3 (a, a, b): an epoch of whole batches holds nearly a third of b
    assert abs(got["labels"].count(1) - len(got["labels"]) / 3) < 64
    assert got["most"] - got["before"] < 50, got


HOG = """
    import gc, json, os, resource
    from nvidia.dali import fn, pipeline_def
    from dalifeed.pipelines import AugmentConfig, make_loader
    from dalifeed.pipelines.lanes import mapping_budget

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def hog(tar, n):
        return fn.readers.webdataset(paths=[tar] * n, index_paths=[tar[:-4] + ".idx"] * n, ext=["jpg"])

    # one tar given many times takes (nearly) all of DALI's mapping budget, mapped once
    shards = {shards!r}
    held = hog(os.path.join(shards, "train-000000.tar"), mapping_budget() - 2)
    held.build()
    fds = lambda: len(os.listdir("/proc/self/fd"))
    loader = lambda: make_loader(shards, "train", 4, device="cpu", num_threads=1, seed=0, initial_fill=8,
                                 augment=AugmentConfig(image_size=8))
    first, before = loader(), fds()
    samples, most = 0, 0
    for _, y in first:
        samples, most = samples + len(y), max(most, fds())
    del first
    gc.collect()
    second, soft = loader(), fds() + 3
    resource.setrlimit(resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    try:
        list(second)
        error = None
    except Exception as e:
        error = dict(type=type(e).__name__, message=str(e))
    print(json.dumps(dict(samples=samples, held=most - before, error=error, soft=soft)))
    """


def test_past_the_mapping_budget_a_reader_holds_a_descriptor_per_tar_and_the_limit_is_named(tmp_path):
    """Past DALI's mapping budget its reader opens each tar: the split's 8 tars are 8 descriptors for the epoch
    and 8 for the next one's pipeline, started before the epoch ends. Under a limit that leaves fewer free, the
    loader's error is the limit's, with how to raise it, and names no shard."""
    shards = one_image_classes(tmp_path, 37, seed=4, prefix="m", samples_per_shard=5)
    got = run_limited(HOG.format(shards=str(shards)), open_files=4096)
    assert got["samples"] == 37 // 4 * 4
    assert 2 * 8 <= got["held"] < 2 * 8 + 4, got
    error = got["error"]
    assert error["type"] == "OpenFileLimit", got
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    assert f"may open {got['soft']} files (hard limit {hard}). Raise the limit before the run (ulimit -n {hard})" \
        in error["message"] and "vm.max_map_count" in error["message"]
    assert "shard-convert verify" not in error["message"] and ".tar" not in error["message"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return one_image_classes(tmp_path_factory.mktemp("small"), 37, seed=4, prefix="s", samples_per_shard=5)


@pytest.mark.parametrize("world, lanes", [(1, 2), (2, 1)])
def test_a_state_saved_when_readers_were_given_every_tar_resumes_exactly(small, world, lanes):
    """A mid-epoch state of a dalifeed whose lane readers were given every tar (its DALI checkpoints fit only such
    readers, and carry no `own_tars` mark) resumes into such readers: the rest of the epoch is the uninterrupted
    run's."""
    options = dict(device="cpu", augment=AugmentConfig(image_size=16), seed=3, initial_fill=8, num_threads=2,
                   lanes=lanes, checkpointing=True, rank=0, world_size=world)
    before = make_loader(small, "train", 4, **options)
    before.plan.lane_files = lambda *args: None  # every tar to every lane, as before lanes were given their own
    it = iter(before)
    for _ in range(3):
        next(it)
    state = before.state_dict()
    rest = [y.tolist() for _, y in it]
    assert state.pop(OWN_TARS) is True and len(rest) == len(before) - 3
    after = make_loader(small, "train", 4, **options)
    after.load_state_dict(state)
    assert [y.tolist() for _, y in after] == rest
    ours = make_loader(small, "train", 4, **options)  # and a state of readers given their own tars, into such
    it = iter(ours)
    for _ in range(3):
        next(it)
    state = ours.state_dict()
    assert state[OWN_TARS] is True
    resumed = make_loader(small, "train", 4, **options)
    resumed.load_state_dict(state)
    assert [y.tolist() for _, y in resumed] == [y.tolist() for _, y in it] == rest
