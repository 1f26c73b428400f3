"""The GPU path's loader defaults, and the published NVIDIA configurations they are taken from.

NVIDIA publishes the DALI settings of its own ResNet-50 runs: the MLPerf Training submissions set them per
system in `config_<SYSTEM>.sh` (DALI threads per GPU, hardware-decoder share, prefetch queue), and
DeepLearningExamples' PyTorch ConvNets loader passes its `--workers` as DALI's threads. `PUBLISHED` lists the
files read and the values in them; dalifeed's defaults for `mixed` (nvJPEG) decoding follow the most recent
single-node DGX configuration, DGX-H100 (MLPerf Training v3.1): 6 threads per GPU, a hardware-decoder share
of 0.99, a prefetch queue of 5. The thread count stays capped by the rank's share of the node's CPUs
(budget.py), so a small node keeps fewer. gpu-evidence.md ("Defaults from NVIDIA's published configurations")
prints the table and tests/test_budget.py holds it to this module; `make gpu-check`'s `hw-decoder` and
`defaults` steps measure the alternatives on the node at hand and print the best.

CPU decoding (`cpu`, `hybrid`) is not what these configurations run: it keeps DALI's default queue (2) and
its own thread cap (budget.CPU_DECODE_MAX_THREADS).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PublishedConfig:
    """One published DALI configuration of NVIDIA's ResNet-50 (None: the file leaves DALI's default)."""

    system: str
    repo: str
    path: str  # the file the values are read from
    threads: int | None  # DALI threads per GPU (per rank)
    hw_decoder_load: float | None
    prefetch_queue_depth: int | None

    @property
    def source(self) -> str:
        return f"`{self.repo}` `{self.path}`"


MLPERF_RESNET = "NVIDIA/benchmarks/resnet/implementations"
PUBLISHED = (
    # DALI_THREADS, DALI_HW_DECODER_LOAD, DALI_PREFETCH_QUEUE of the MLPerf configurations
    PublishedConfig("DGX-H100, 8 GPUs (MLPerf Training v3.1)", "mlcommons/training_results_v3.1",
                    f"{MLPERF_RESNET}/mxnet/config_DGXH100.sh", 6, 0.99, 5),
    PublishedConfig("DGX-H100, 8 GPUs (MLPerf Training v2.1, preview)", "mlcommons/training_results_v2.1",
                    f"{MLPERF_RESNET}/mxnet-preview/config_DGXH100.sh", 6, 0.99, 5),
    PublishedConfig("DGX-A100, 8 GPUs (MLPerf Training v2.0)", "mlcommons/training_results_v2.0",
                    f"{MLPERF_RESNET}/mxnet/config_DGXA100.sh", 6, 0.0, 5),
    # get_dali_train_loader: workers=5 passed as num_threads; no hw_decoder_load, no prefetch_queue_depth
    PublishedConfig("DeepLearningExamples ConvNets (PyTorch), any GPU", "NVIDIA/DeepLearningExamples",
                    "PyTorch/Classification/ConvNets/image_classification/dataloaders.py", 5, None, None),
)

# DALI 2.4's own defaults where a configuration leaves a value out: the installed schema of the mixed decoders
# (`hw_decoder_load` 0.65) and `Pipeline(prefetch_queue_depth=2)`.
DALI_HW_DECODER_LOAD = 0.65
DALI_PREFETCH_QUEUE_DEPTH = 2

MIXED_DECODE_THREADS = 6  # DALI_THREADS of every DGX configuration above; capped by the CPUs (budget.py)
HW_DECODER_LOAD = 0.99  # DGX-H100's; DGX-A100's v2.0 run used 0 (its CUDA cores decoded): gpu-check measures both
GPU_PREFETCH_QUEUE_DEPTH = 5  # DALI_PREFETCH_QUEUE of every DGX configuration above


def prefetch_queue_depth(device: str) -> int:
    """Batches a pipeline on `device` ('cpu', 'gpu' or 'hybrid') prepares ahead by default: the DGX
    configurations' 5 with `mixed` decoding, DALI's 2 where the CPU decodes."""
    return GPU_PREFETCH_QUEUE_DEPTH if device == "gpu" else DALI_PREFETCH_QUEUE_DEPTH
