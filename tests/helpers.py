"""Builders of small, real test data (images, ImageFolder trees), the conversion as the tests run it (through
the library or the real CLI in a child process), real processes to race against (a lock holder), and a
local S3 server; imported by the tests."""

from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np
import psutil
from PIL import Image

DATA = Path(__file__).parent / "data"


def jpeg_bytes(array: np.ndarray, quality: int = 90, **options) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=quality, **options)
    return buf.getvalue()


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def random_image(rng: np.random.Generator, size=(24, 20), label: int = 0) -> np.ndarray:
    """A smooth image whose mean colour depends on the label, so a model can learn it and a reader can be
    checked against it."""
    h, w = size
    base = np.array([(label * 70) % 256, (label * 130 + 60) % 256, (255 - label * 50) % 256], np.float32)
    noise = rng.normal(0, 12, (h, w, 3))
    return (base + noise).clip(0, 255).astype(np.uint8)


def gradient_image(h: int = 40, w: int = 48) -> np.ndarray:
    """A smooth colour gradient: every decoder agrees on it closely, and any flip or rotation shows."""
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([x * 255 // max(1, w - 1), y * 255 // max(1, h - 1), (x + y) * 255 // max(1, w + h - 2)],
                    -1).astype(np.uint8)


def write_imagefolder(root: Path, counts: dict[str, int], seed: int = 0, size=(24, 20)) -> Path:
    """`root/<class>/<class>_<i>.jpg` with `counts[class]` JPEGs each."""
    rng = np.random.default_rng(seed)
    for label, (name, n) in enumerate(sorted(counts.items())):
        folder = root / name
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(n):
            (folder / f"{name}_{i:04d}.jpg").write_bytes(jpeg_bytes(random_image(rng, size, label)))
    return root


def one_image_classes(root: Path, n: int, seed: int, prefix: str, samples_per_shard: int) -> Path:
    """Shards of `n` classes of one random 20x20 JPEG each (`{prefix}00`, `{prefix}01`, ...): every label names
    its sample, so a test can see exactly which samples a loader gave."""
    from dalifeed.convert import ConvertConfig, convert_imagefolder

    rng = np.random.default_rng(seed)
    for i in range(n):
        folder = root / "src" / f"{prefix}{i:02d}"
        folder.mkdir(parents=True)
        Image.fromarray(rng.integers(0, 256, (20, 20, 3), dtype=np.uint8)).save(folder / "x.jpg")
    convert_imagefolder(ConvertConfig(src=root / "src", out=root / "shards", samples_per_shard=samples_per_shard,
                                      progress=False))
    return root / "shards"


def convert(src: Path, out: Path | str, **options):
    """Convert through the library, without a progress bar: the ImageFolder tree `src` (ConvertConfig
    options), or with `annotations=` that COCO instances file over the images in `src` (CocoConfig options).
    Returns the manifest. For shards a test only reads, the `make_shards` fixture builds them once."""
    from dalifeed.convert import CocoConfig, ConvertConfig, convert_coco, convert_imagefolder

    if "annotations" in options:
        annotations = options.pop("annotations")
        return convert_coco(CocoConfig(images=[src], annotations=[annotations], out=out, progress=False, **options))
    return convert_imagefolder(ConvertConfig(src=src, out=out, progress=False, **options))


def shard_convert(*args, timeout: float = 120, **run) -> subprocess.CompletedProcess:
    """`shard-convert ARGS` as a real child process (signals, exit codes, stdout and stderr as a user sees
    them), its output captured as text; `run`: more subprocess.run arguments (env, preexec_fn, ...)."""
    return subprocess.run([sys.executable, "-m", "dalifeed.convert.cli", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, **run)


def assert_same_folder(expected: Path, got: Path) -> None:
    """Every shard, index and the manifest, byte for byte; no other shard file on either side."""
    names = sorted(p.name for p in expected.iterdir() if p.suffix in (".tar", ".idx"))
    assert names == sorted(p.name for p in got.iterdir() if p.suffix in (".tar", ".idx"))
    for name in names + ["manifest.json"]:
        assert (expected / name).read_bytes() == (got / name).read_bytes(), name


def wait_for(condition, timeout: float = 60, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def hold_lock(folder: Path) -> subprocess.Popen:
    """Another real process holding the folder's lock, as a running conversion or training would."""
    code = ("import sys, time; from dalifeed.runtime import folder_lock\n"
            f"with folder_lock({str(folder)!r}, 'a test holder'):\n    print('locked', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "locked"
    return holder


def limit_file_size(limit: int):
    """A `preexec_fn` that makes the child's writes beyond `limit` bytes fail as a full disk would (EFBIG)."""
    import resource

    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


def write_coco(root: Path, seed: int = 0) -> tuple[Path, Path]:
    """A small COCO-format dataset with the cases a converter must account for: categories with sparse ids
    including 0 (listed out of order), crowd annotations with RLE, polygons, an image without annotations,
    a record whose file is missing, an annotation of a missing image record, a repeated annotation id, boxes
    partly and wholly outside their image and one of no area, a PNG, extra keys everywhere, odd counts.
    Returns (images folder, instances file)."""
    rng = np.random.default_rng(seed)
    images_dir = root / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    sizes = {1: (64, 48), 2: (40, 50), 3: (56, 56), 4: (30, 30), 5: (80, 60), 6: (48, 64), 7: (72, 40),
             8: (50, 36), 9: (44, 52)}
    images = []
    for image_id, (w, h) in sizes.items():
        name = f"{image_id:012d}.png" if image_id == 2 else f"{image_id:012d}.jpg"
        record = {"id": image_id, "file_name": name, "width": w, "height": h}
        if image_id == 6:
            record |= {"license": 3, "coco_url": "http://example.invalid/6.jpg", "date_captured": "2013-11-14"}
        images.append(record)
        if image_id == 4:  # its file is missing
            continue
        pixels = random_image(rng, (h, w), label=image_id)
        if name.endswith(".png"):
            (images_dir / name).write_bytes(png_bytes(Image.fromarray(pixels)))
        else:
            (images_dir / name).write_bytes(jpeg_bytes(pixels))

    def ann(ann_id, image_id, category_id, bbox, **more):
        x, y, w, h = bbox
        doc = {"id": ann_id, "image_id": image_id, "category_id": category_id, "bbox": bbox, "iscrowd": 0,
               "area": float(w * h), "segmentation": [[x, y, x + w, y, x + w, y + h, x, y + h]]}
        return doc | more

    annotations = [
        ann(101, 1, 3, [4.0, 5.0, 20.0, 15.0]),
        ann(102, 1, 0, [30.5, 10.25, 25.0, 30.0]),
        # a crowd region with uncompressed RLE, as COCO stores crowds; the counts cover all 48 x 64 pixels (short
        # counts leave pycocotools decoding the rest of the mask from uninitialised memory: a flaky test)
        {"id": 103, "image_id": 1, "category_id": 7, "bbox": [0, 0, 10, 8], "iscrowd": 1, "area": 80.0,
         "segmentation": {"counts": [0, 8, 40, 8, 40, 8, 40, 8, 40, 8, 40, 8, 40, 8, 40, 8, 40, 8, 40, 8,
                                     48 * 64 - 8 * 10 - 40 * 9], "size": [48, 64]}},
        ann(201, 2, 90, [2, 3, 30, 40]),
        ann(401, 4, 3, [1, 1, 10, 10]),  # its image file is missing
        ann(501, 5, 7, [70, 50, 20, 20]),  # partly outside the 80x60 image: clipped
        ann(502, 5, 7, [100, 10, 10, 10]),  # wholly outside: no training target
        ann(503, 5, 0, [10, 10, 0, 5]),  # no area
        ann(504, 5, 3, [5, 6, 30, 20], attributes={"occluded": True}),
        ann(601, 6, 90, [1, 2, 40, 50]),
        ann(701, 7, 0, [0, 0, 72, 40]),
        ann(702, 7, 3, [10, 5, 20, 10]),
        ann(703, 7, 7, [40, 20, 12, 12]),
        ann(703, 7, 7, [41, 21, 12, 12]),  # a repeated id
        ann(801, 8, 90, [5, 5, 10, 10]),
        ann(901, 9, 3, [3, 4, 30, 30]),
        ann(999, 12345, 3, [1, 1, 5, 5]),  # an image record that does not exist
    ]
    categories = [{"id": 7, "name": "car", "supercategory": "vehicle"}, {"id": 0, "name": "background-thing",
                  "supercategory": "misc"}, {"id": 90, "name": "toothbrush", "supercategory": "indoor"},
                  {"id": 3, "name": "bird", "supercategory": "animal"}]
    doc = {"info": {"description": "dalifeed test set", "year": 2026}, "licenses": [{"id": 3, "name": "CC"}],
           "images": images, "annotations": annotations, "categories": categories}
    path = root / "instances_mini.json"
    path.write_text(json.dumps(doc))
    return images_dir, path


SHAPE_COLOURS = [(220, 40, 40), (40, 200, 60), (50, 80, 230), (230, 210, 40)]  # one per category


def write_shapes_coco(root: Path, n_images: int, seed: int = 0, label_counts=(0, 2, 3, 4)) -> tuple[Path, Path]:
    """A COCO dataset a multi-label model can learn: 40x40 noisy grey JPEGs, each holding a label set drawn from
    the subsets of 4 categories (ids 5, 11, 23, 42) of the sizes in `label_counts`; category k is a 12-px
    square of colour SHAPE_COLOURS[k] in quadrant k (squares never overlap), its box the annotation.
    Returns (images folder, instances file)."""
    from itertools import combinations

    rng = np.random.default_rng(seed)
    category_ids = [5, 11, 23, 42]
    label_sets = [s for n in label_counts for s in combinations(range(4), n)]
    images_dir = root / "images"
    images_dir.mkdir(parents=True, exist_ok=True)
    images, annotations = [], []
    for image_id in range(1, n_images + 1):
        pixels = rng.normal(128, 20, (40, 40, 3))
        for k in label_sets[rng.integers(len(label_sets))]:
            x = 20 * (k % 2) + int(rng.integers(0, 9))
            y = 20 * (k // 2) + int(rng.integers(0, 9))
            pixels[y:y + 12, x:x + 12] = SHAPE_COLOURS[k] + rng.normal(0, 8, (12, 12, 3))
            annotations.append({"id": len(annotations) + 1, "image_id": image_id, "category_id": category_ids[k],
                                "bbox": [x, y, 12, 12], "area": 144.0, "iscrowd": 0})
        name = f"{image_id:06d}.jpg"
        (images_dir / name).write_bytes(jpeg_bytes(pixels.clip(0, 255).astype(np.uint8)))
        images.append({"id": image_id, "file_name": name, "width": 40, "height": 40})
    categories = [{"id": c, "name": f"shape{k}"} for k, c in enumerate(category_ids)]
    path = root / "instances.json"
    path.write_text(json.dumps({"images": images, "annotations": annotations, "categories": categories}))
    return images_dir, path


def free_port() -> int:
    """A loopback TCP port nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(target, *args, world_size: int = 2, timeout: float = 300) -> None:
    """`target(rank, port, *args)` in `world_size` spawned processes that meet on `port`; every one must exit 0
    within `timeout` seconds. Once one fails, or the time is up, the others are killed: a rank waiting in a
    collective for a peer that died would wait for ever, beside the tests after this one."""
    import torch.multiprocessing as mp

    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=target, args=(rank, port, *args)) for rank in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    try:
        while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    assert [p.exitcode for p in procs] == [0] * world_size, f"exit codes of ranks 0..{world_size - 1}"


def start_s3_server(log: Path, **env) -> tuple[subprocess.Popen, str]:
    """moto's standalone S3 server as a subprocess on a free loopback port; returns it and its endpoint
    once it answers. `env`: extra variables for the server (e.g. INITIAL_NO_AUTH_ACTION_COUNT)."""
    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"  # an IP: DALI's AWS SDK then addresses buckets path-style
    with open(log, "wb") as out:
        server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                                  stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **env})
    deadline = time.monotonic() + 60
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"moto server exited with {server.returncode}: {log.read_text()[-500:]}")
        try:
            urllib.request.urlopen(endpoint + "/", timeout=1).read()
            return server, endpoint
        except OSError:
            if time.monotonic() > deadline:
                server.kill()
                raise
            time.sleep(0.05)


def stop_s3_server(server: subprocess.Popen) -> None:
    server.terminate()
    try:
        server.wait(10)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def kill_run(agent: subprocess.Popen) -> None:
    """SIGKILL to a torchrun agent and its workers, which torchrun starts in sessions of their own (killing the
    agent's process group leaves them training on, and the tests after this one would share the cores with
    them)."""
    try:
        run = [psutil.Process(agent.pid), *psutil.Process(agent.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        run = []
    for process in run:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    agent.wait()
