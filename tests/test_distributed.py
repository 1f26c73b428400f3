"""Which GPU a rank computes on, under the launchers that leave it every GPU of the node or only its own."""

from __future__ import annotations

import pytest

from dalifeed.train.distributed import GpuAssignmentError, cuda_index


@pytest.mark.parametrize("local_rank, visible, index", [
    (0, 8, 0), (5, 8, 5), (7, 8, 7),  # torchrun: every rank sees the node's 8 GPUs, rank i takes GPU i
    (0, 2, 0), (1, 2, 1),  # CUDA_VISIBLE_DEVICES=2,3 and torchrun --nproc-per-node 2: cuda:0 and cuda:1
    (0, 1, 0), (5, 1, 0), (7, 1, 0),  # srun --gpus-per-task=1: each rank sees its own GPU as device 0
])
def test_a_rank_computes_on_its_own_visible_gpu(local_rank, visible, index):
    assert cuda_index(local_rank, visible) == index


def test_more_local_ranks_than_visible_gpus_is_refused_in_one_line():
    with pytest.raises(GpuAssignmentError, match=r"^LOCAL_RANK=3 but this process sees 2 GPU\(s\) "
                                                 r"\(CUDA_VISIBLE_DEVICES='0,1'\): start at most one rank per "
                                                 r"visible GPU on a node \(torchrun --nproc-per-node 2\), or give "
                                                 r"each rank its own GPU$"):
        cuda_index(3, 2, "0,1")
