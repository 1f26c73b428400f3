"""Multi-label targets (`dali-train --task multilabel`) on real COCO shards: every image's multi-hot vector, for
images with no label, exactly one, several and a repeated one, against pycocotools; and the DALI graph
(`graphs.multi_hot`) called directly on batches of every label count, CPU and GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import webdataset as wds

from helpers import jpeg_bytes, random_image

CATEGORY_IDS = [2, 5, 17, 90]  # sparse, not 0-based: the training index of id c is CATEGORY_IDS.index(c)
# image id -> the category ids of its non-crowd annotations; most COCO images hold one object or a few
OBJECTS = {
    1: [5], 2: [90], 3: [2], 4: [17], 5: [5], 6: [2],  # exactly one
    7: [], 8: [],  # none
    9: [2, 17], 10: [90, 5],  # two
    11: [17, 17, 2],  # three, one category twice: still a single 1
    12: [2, 5, 17, 90],  # every category
}
CROWD = {2: 17, 8: 5}  # image id -> the category of a crowd region on it: not a multi-label target


def write_multilabel_coco(root: Path) -> tuple[Path, Path]:
    """Images of different sizes with the annotations of OBJECTS and CROWD. Returns (images, instances file)."""
    rng = np.random.default_rng(3)
    images_dir = root / "images"
    images_dir.mkdir(parents=True)
    images, annotations = [], []
    for image_id, categories in OBJECTS.items():
        w, h = 40 + 4 * image_id, 60 - 2 * image_id
        name = f"{image_id:012d}.jpg"
        (images_dir / name).write_bytes(jpeg_bytes(random_image(rng, (h, w), label=image_id)))
        images.append({"id": image_id, "file_name": name, "width": w, "height": h})
        crowd = [(CROWD[image_id], 1)] if image_id in CROWD else []
        for k, (category, iscrowd) in enumerate([(c, 0) for c in categories] + crowd):
            x, y = 2 + 3 * k, 1 + 2 * k
            annotations.append({"id": 100 * image_id + k, "image_id": image_id, "category_id": category,
                                "bbox": [x, y, 12, 9], "area": 108.0, "iscrowd": iscrowd,
                                "segmentation": [[x, y, x + 12, y, x + 12, y + 9, x, y + 9]]})
    doc = {"images": images, "annotations": annotations,
           "categories": [{"id": c, "name": f"thing{c}"} for c in reversed(CATEGORY_IDS)]}
    path = root / "instances_val.json"
    path.write_text(json.dumps(doc))
    return images_dir, path


@pytest.fixture(scope="module")
def coco_shards(tmp_path_factory) -> tuple[Path, Path]:
    """The set converted by the CLI, as a user would: (shard folder, instances file)."""
    root = tmp_path_factory.mktemp("multilabel")
    images, instances = write_multilabel_coco(root)
    run = subprocess.run([sys.executable, "-m", "dalifeed.convert.cli", "coco", str(root / "shards"), "--images",
                          str(images), "--annotations", str(instances), "--samples-per-shard", "5", "--workers", "1",
                          "--quiet"], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    return root / "shards", instances


def expected_multi_hot(instances: Path, image_id: int) -> list[float]:
    """From pycocotools: which categories the image's non-crowd annotations hold, in training order."""
    from pycocotools.coco import COCO

    coco = COCO(str(instances))
    held = {coco.anns[i]["category_id"] for i in coco.getAnnIds(imgIds=[image_id], iscrowd=False)}
    training_order = sorted(coco.getCatIds())
    return [float(c in held) for c in training_order]


def image_ids_in_reading_order(shards: Path) -> list[int]:
    manifest = json.loads((shards / "manifest.json").read_text())
    urls = [str(shards / s["path"]) for s in manifest["splits"]["val"]["shards"]]
    return [int(np.frombuffer(s["id.i64"], "<i8")[0]) for s in wds.WebDataset(urls, shardshuffle=False)]


@pytest.mark.parametrize("batch_size", [1, 4])
def test_multilabel_loader_gives_every_images_categories(coco_shards, batch_size):
    """The loader dali-train --task multilabel builds, in file order (train=False): row i is the i-th sample.
    Batch size 1 puts every single-label image in a batch of its own, the case DALI's one_hot took for a
    batch of scalars."""
    from dalifeed.pipelines import AugmentConfig, make_loader, open_dataset

    shards, instances = coco_shards
    assert sorted(CATEGORY_IDS) == CATEGORY_IDS
    order = image_ids_in_reading_order(shards)
    assert sorted(order) == sorted(OBJECTS)
    loader = make_loader(open_dataset(shards, task="multilabel"), "val", batch_size,
                         augment=AugmentConfig(image_size=32), device="cpu", train=False, num_threads=1)
    rows = torch.cat([labels for _, labels in loader])
    assert rows.dtype == torch.float32 and rows.shape == (len(OBJECTS), len(CATEGORY_IDS))
    for image_id, row in zip(order, rows.tolist()):
        assert row == expected_multi_hot(instances, image_id), image_id


def test_multilabel_training_epoch_holds_every_images_categories(coco_shards):
    """The training loader (shuffled, random crops) of batch 1: the epoch's targets are the images' targets."""
    from dalifeed.pipelines import AugmentConfig, make_loader, open_dataset

    shards, instances = coco_shards
    loader = make_loader(open_dataset(shards, task="multilabel"), "val", 1, augment=AugmentConfig(image_size=32),
                         device="cpu", train=True, num_threads=1, initial_fill=4)
    seen = sorted(labels[0].tolist() for _, labels in loader)
    assert seen == sorted(expected_multi_hot(instances, image_id) for image_id in OBJECTS)


BATCHES = {  # label lists per sample: every batch shape DALI's one_hot treats differently
    "one image, one label": [[3]],
    "every image one label": [[3], [0], [3]],
    "one label and none": [[1], []],
    "none at all": [[], []],
    "two and one": [[1, 2], [0]],
    "many, repeated": [[4, 4, 0, 2, 4]],
}


@pytest.mark.parametrize("device", ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("name", list(BATCHES))
def test_multi_hot_graph_for_every_label_count(name, device):
    from nvidia.dali import fn, pipeline_def, types

    from dalifeed.pipelines.graphs import multi_hot

    batch = [np.array(labels, dtype=np.int32) for labels in BATCHES[name]]

    @pipeline_def(batch_size=len(batch), num_threads=1, device_id=0 if device == "gpu" else None)
    def labels_to_multi_hot():
        labels = fn.external_source(source=lambda: batch, batch=True, dtype=types.INT32, ndim=1)
        return multi_hot(labels.gpu() if device == "gpu" else labels, 5)

    pipe = labels_to_multi_hot()
    pipe.build()
    (out,) = pipe.run()
    out = out.as_cpu() if device == "gpu" else out
    got = [np.array(out[i]).tolist() for i in range(len(batch))]
    assert got == [[float(k in labels) for k in range(5)] for labels in BATCHES[name]]
