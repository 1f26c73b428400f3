"""One rank of tests/test_ranks.py: README's loop as written (taken from README.md, with its path, epoch count
and batch size swapped in), a validation epoch and a detection epoch, none told its rank; what this rank read
goes to OUT/rank-<rank>.json.

    torchrun --nproc-per-node 2 tests/readme_rank.py OUT SHARDS COCO               # ranks from the environment
    python tests/readme_rank.py OUT SHARDS COCO --group STORE_FILE RANK WORLD      # a gloo group, no RANK variables
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"
# What the test swaps into README's loop: the shards, two epochs, a batch that fits 37 samples on 2 ranks, and
# the body that records each batch's labels (one class per sample: a label names its sample).
README_SWAPS = (('"/data/imagenet-shards"', "SHARDS"), ("range(90)", "range(2)"), ("batch_size=256", "batch_size=4"),
                ("...  # forward, backward, step", "seen.append([epoch, labels.tolist()])"))


def readme_loop(shards: str) -> str:
    """README's own-loop block with README_SWAPS made; each swapped text must be in it as written."""
    text = README.read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", text, re.DOTALL) if "make_loader(" in b)
    for old, new in README_SWAPS:
        if old not in block:
            raise AssertionError(f"README's loop no longer holds {old!r}")
        block = block.replace(old, repr(shards) if new == "SHARDS" else new)
    return block


def main(out: Path, shards: str, coco: str, group: list[str]) -> None:
    import torch.distributed as dist

    if group:
        store_file, rank, world = group[0], int(group[1]), int(group[2])
        dist.init_process_group("gloo", store=dist.FileStore(store_file, world), rank=rank, world_size=world)
    from dalifeed.pipelines import DetectionConfig, make_detection_loader, make_loader

    scope: dict = {"seen": []}
    exec(compile(readme_loop(shards), "README.md", "exec"), scope)
    loader = scope["loader"]
    o = loader.options
    val = make_loader(shards, "train", 5, train=False)
    detection = make_detection_loader(coco, "mini", 3, train=False, detection=DetectionConfig(size=32))
    record = {"ranks": [o.rank, o.world_size, o.ranks_from], "batches": len(loader), "train": scope["seen"],
              "val": [label for _, labels in val for label in labels.tolist()],
              "detection_ranks": [detection.options.rank, detection.options.world_size, detection.options.ranks_from],
              "detection": [t["image_id"] for _, targets in detection for t in targets]}
    if group:
        try:
            make_loader(shards, "train", 4, rank=0, world_size=1)
        except ValueError as e:
            record["disagree"] = str(e)
        dist.barrier()
        dist.destroy_process_group()
    (out / f"rank-{o.rank}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    args = sys.argv[1:]
    main(Path(args[0]), args[1], args[2], args[4:7] if len(args) > 3 and args[3] == "--group" else [])
