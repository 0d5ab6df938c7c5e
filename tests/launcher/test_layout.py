"""World layout: rank assignment from what the barrier tasks gathered."""
from __future__ import annotations

import pytest

from spark_dl.task.layout import TaskInfo, compute_layout


def flat(layout):
    return sorted((r for ranks in layout.values() for r in ranks), key=lambda r: r.rank)


def test_ranks_on_one_host_are_consecutive_whatever_the_partition_order():
    tasks = [
        TaskInfo(0, "hostB", port=1111),
        TaskInfo(1, "hostA", port=2222),
        TaskInfo(2, "hostB", port=3333),
        TaskInfo(3, "hostA", port=4444),
    ]
    ranks = flat(compute_layout(tasks))
    assert [(r.rank, r.host, r.partition, r.local_rank) for r in ranks] == [
        (0, "hostB", 0, 0), (1, "hostB", 2, 1), (2, "hostA", 1, 0), (3, "hostA", 3, 1),
    ]
    assert {r.local_size for r in ranks} == {2}
    assert [r.cross_rank for r in ranks] == [0, 0, 1, 1] and {r.cross_size for r in ranks} == {2}
    # rank 0's task hosts the store
    assert {(r.master_addr, r.master_port) for r in ranks} == {("hostB", 1111)}


def test_every_task_computes_the_same_layout_from_any_gather_order():
    tasks = [TaskInfo(i, f"h{i % 3}", port=1000 + i) for i in range(7)]
    assert compute_layout(tasks) == compute_layout(list(reversed(tasks)))


def test_one_gpu_per_task_each_rank_sees_the_hosts_gpus_in_local_rank_order():
    tasks = [TaskInfo(0, "h", gpus=("3",)), TaskInfo(1, "h", gpus=("1",))]
    ranks = flat(compute_layout(tasks))
    assert [r.env()["CUDA_VISIBLE_DEVICES"] for r in ranks] == ["3,1", "3,1"]
    # torch.cuda.set_device(local_rank), Horovod's idiom, picks each rank's own GPU
    assert [r.cuda_device for r in ranks] == [r.local_rank for r in ranks] == [0, 1]


def test_several_gpus_per_task_start_one_rank_per_gpu():
    tasks = [TaskInfo(0, "h1", gpus=("0", "1")), TaskInfo(1, "h2", gpus=("0", "1"))]
    layout = compute_layout(tasks, ranks_per_task=2)
    assert [r.rank for r in layout[0]] == [0, 1] and [r.rank for r in layout[1]] == [2, 3]
    ranks = flat(layout)
    assert [r.env()["CUDA_VISIBLE_DEVICES"] for r in ranks] == ["0,1"] * 4
    assert [r.env()["SPARK_DL_CUDA_DEVICE"] for r in ranks] == ["0", "1", "0", "1"]
    assert [r.local_rank for r in ranks] == [0, 1, 0, 1] and {r.world_size for r in ranks} == {4}


def test_shared_gpu_fraction_is_not_listed_twice():
    tasks = [TaskInfo(0, "h", gpus=("0",)), TaskInfo(1, "h", gpus=("0",))]
    assert {r.env()["CUDA_VISIBLE_DEVICES"] for r in flat(compute_layout(tasks))} == {"0"}


def test_no_gpus_leaves_cuda_visible_devices_alone():
    assert "CUDA_VISIBLE_DEVICES" not in flat(compute_layout([TaskInfo(0, "h")]))[0].env()


def test_bad_layout_inputs():
    with pytest.raises(ValueError):
        compute_layout([])
    with pytest.raises(ValueError):
        compute_layout([TaskInfo(0, "h")], ranks_per_task=0)


def test_task_nodes_make_each_task_a_torchrun_node():
    """TorchDistributor's view: two tasks with one GPU each on one host are two "nodes", each with
    LOCAL_RANK 0 and only its own GPU visible (so cuda:0 is its GPU); ranks still consecutive per
    host, OpenMP threads still shared out per host."""
    tasks = [TaskInfo(0, "h", gpus=("3",), port=1), TaskInfo(1, "h", gpus=("1",), port=2),
             TaskInfo(2, "g", gpus=("0",), port=3)]
    ranks = flat(compute_layout(tasks, task_nodes=True))
    assert [(r.rank, r.partition, r.local_rank, r.local_size) for r in ranks] == [
        (0, 0, 0, 1), (1, 1, 0, 1), (2, 2, 0, 1)]
    assert [r.env()["GROUP_RANK"] for r in ranks] == ["0", "1", "2"]
    assert {r.env()["GROUP_WORLD_SIZE"] for r in ranks} == {"3"}
    assert [r.env()["CUDA_VISIBLE_DEVICES"] for r in ranks] == ["3", "1", "0"]
    assert [r.env()["SPARK_DL_CUDA_DEVICE"] for r in ranks] == ["0", "0", "0"]
    assert [r.host_size for r in ranks] == [2, 2, 1]


def test_task_nodes_with_several_gpus_per_task():
    tasks = [TaskInfo(0, "h", gpus=("2", "3")), TaskInfo(1, "h", gpus=("0", "1"))]
    ranks = flat(compute_layout(tasks, ranks_per_task=2, task_nodes=True))
    assert [(r.local_rank, r.local_size, r.cross_rank) for r in ranks] == [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]
    assert [r.env()["CUDA_VISIBLE_DEVICES"] for r in ranks] == ["2,3", "2,3", "0,1", "0,1"]
    assert [r.cuda_device for r in ranks] == [0, 1, 0, 1]
