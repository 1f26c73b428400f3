"""gpu-check's `defaults` step: the GPU path's published defaults (dalifeed/defaults.py) against their
neighbours, on this node, so that a user can confirm them (or pick better ones) in minutes.

dali-train's training graph (RandomResizedCrop + flip + normalise, float32, channels-last as the training
slice runs it) on the `gpu` device, at DALI threads per rank of 4, 6 and 8 (those the rank's share of the CPUs
allows: one rank per visible GPU) and prefetch queue depths of 2 (DALI's) and 5 (the DGX configurations'),
at the default hw_decoder_load; the `hw-decoder` step measures the loads. The section records every rate,
the best setting, and what dalifeed would use here by default.
"""

from __future__ import annotations

from dalifeed import defaults
from dalifeed.decode import DEFAULT_HW_DECODER_LOAD

from .gpu_node import StepRun, decoder_budget
from .gpu_recipes import timed_rate

THREADS = (4, defaults.MIXED_DECODE_THREADS, 8)
PREFETCH_DEPTHS = (defaults.DALI_PREFETCH_QUEUE_DEPTH, defaults.GPU_PREFETCH_QUEUE_DEPTH)


def thread_choices(cores_per_rank: int) -> list[int]:
    """THREADS a rank can run without oversubscribing its share of the CPUs (at least the smallest)."""
    return [t for t in THREADS if t <= cores_per_rank] or [min(cores_per_rank, THREADS[0])]


def defaults_step(run: StepRun) -> dict:
    from dalifeed.pipelines import AugmentConfig, make_loader

    cfg, device = run.cfg, run.device
    budget = decoder_budget()  # what dali-train gives one rank per visible GPU
    cores_per_rank = max(1, budget["cores"] // budget["ranks_on_node"])
    runs = []
    for threads in thread_choices(cores_per_rank):
        for depth in PREFETCH_DEPTHS:
            run.log(f"defaults: {threads} DALI threads, prefetch queue {depth}:")
            loader = make_loader(run.shards, "train", cfg.batch_size, augment=AugmentConfig(image_size=cfg.image_size),
                                 device=device, train=True, seed=0, channels_last=True, num_threads=threads,
                                 prefetch_queue_depth=depth)
            runs.append({"threads": threads, "prefetch_queue_depth": depth,
                         "images_per_s": timed_rate(loader, cfg.recipe_batches, device)})
    best = max(runs, key=lambda r: r["images_per_s"])
    return {"device": device, "batches": cfg.recipe_batches, "hw_decoder_load": DEFAULT_HW_DECODER_LOAD,
            "cores_per_rank": cores_per_rank, "runs": runs, "best": best,
            "default": {"threads": budget["threads"], "prefetch_queue_depth": defaults.prefetch_queue_depth(device)}}
