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


def test_ranks_exchange_their_gpus_through_the_launchers_store():
    """Before any process group: each rank's value, in rank order, through a real c10d store (a TCPStore
    on loopback, as torchrun's env:// makes), from two ranks running at once."""
    import threading

    from torch.distributed import TCPStore

    from dalifeed.train.distributed import exchange

    server = TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    client = TCPStore("127.0.0.1", server.port, 2, is_master=False)
    seen = {}
    threads = [threading.Thread(target=lambda r, s: seen.__setitem__(r, exchange(s, "gpu", r, 2, f"node{r} GPU-{r}")),
                                args=(rank, store)) for rank, store in enumerate((server, client))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert seen == {0: ["node0 GPU-0", "node1 GPU-1"], 1: ["node0 GPU-0", "node1 GPU-1"]}


def test_ranks_sharing_one_gpu_are_refused_by_its_uuid():
    """One GPU visible to each rank is right when it is each rank's own (srun --gpu-bind, a pod per GPU: the
    UUIDs differ) and wrong when it is the same one (an exported CUDA_VISIBLE_DEVICES=0, one MIG instance):
    NCCL would stop with "Duplicate GPU detected"."""
    from dalifeed.train.distributed import refuse_shared_gpus

    refuse_shared_gpus(["node1 GPU-aaaa", "node1 GPU-bbbb", "node2 GPU-cccc", "node2 MIG-dddd"])
    with pytest.raises(GpuAssignmentError, match=r"^ranks 1, 2 on node1 would share one GPU \(GPU-bbbb\): give each "
                                                 r"rank its own GPU"):
        refuse_shared_gpus(["node1 GPU-aaaa", "node1 GPU-bbbb", "node1 GPU-bbbb", "node2 GPU-cccc"])
    with pytest.raises(GpuAssignmentError, match=r"^ranks 0, 1 on pod-a would share one GPU \(GPU-aaaa\)"):
        refuse_shared_gpus(["pod-a GPU-aaaa", "pod-b GPU-aaaa"])  # two pods given one GPU: the UUID decides
