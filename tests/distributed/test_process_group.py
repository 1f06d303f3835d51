"""process_group.py: the backends a rank joins with, its device, and the collective timeout."""
import os

import pytest
import torch
import torch.distributed as dist

from mingpt.common.errors import MinGPTError
from mingpt.distributed import process_group
from mingpt.distributed.parallel import HSDP_MESH_DIMS, hsdp_mesh, sharding_mesh
from mingpt.storage.checkpointer import Checkpointer, SnapshotPolicy


def test_cuda_ranks_get_a_cpu_backend_beside_nccl():
    """FSDP's CPU offload all-reduces CPU tensors (gradient norms for clipping): a plain "nccl"
    group has no backend for them."""
    backends = dict(part.split(":") for part in process_group.backend_for(torch.device("cuda")).split(","))
    assert backends == {"cuda": "nccl", "cpu": "gloo"}
    assert process_group.backend_for(torch.device("cpu")) == "gloo"


def an_accelerator(monkeypatch, kind: str = "cuda", count: int = 1) -> list[int]:
    """torch.accelerator as a machine with `count` accelerators of `kind` shows it; the indices set."""
    chosen = []
    monkeypatch.setattr(torch.accelerator, "is_available", lambda: True)
    monkeypatch.setattr(torch.accelerator, "current_accelerator", lambda *args: torch.device(kind))
    monkeypatch.setattr(torch.accelerator, "device_count", lambda: count)
    monkeypatch.setattr(torch.accelerator, "set_device_index", chosen.append)
    return chosen


def test_the_device_is_torch_accelerator_s_as_upstream_picks_it(monkeypatch):
    """pytorch/examples 698a89e: the local rank's accelerator, set with set_device_index."""
    chosen = an_accelerator(monkeypatch, count=4)
    assert process_group._pick_device(local_rank=2, local_world_size=4) == torch.device("cuda", 2)
    assert chosen == [2]
    an_accelerator(monkeypatch, kind="mps")  # a Mac's: this project's GPU path is CUDA's
    assert process_group._pick_device(local_rank=0, local_world_size=1) == torch.device("cpu")


def test_more_ranks_than_gpus_is_refused_up_front(monkeypatch):
    an_accelerator(monkeypatch)
    with pytest.raises(MinGPTError, match=r"2 processes on this machine but 1 GPU\(s\) visible.*"
                                          r"--nproc_per_node=1"):
        process_group._pick_device(local_rank=1, local_world_size=2)


def test_ranks_may_share_a_gpu_through_gloo_when_asked(monkeypatch):
    """bench/multi_rank_cuda.py's way to run 2 ranks on a machine's one GPU (NCCL would refuse)."""
    an_accelerator(monkeypatch)
    monkeypatch.setenv(process_group.RANKS_SHARE_GPU, "1")
    assert process_group._pick_device(local_rank=1, local_world_size=2) == torch.device("cuda", 0)
    assert process_group.backend_for(torch.device("cuda", 0)) == "gloo"


def test_the_interface_gloo_uses_across_machines_is_named(monkeypatch):
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "ib0")
    assert process_group.gloo_interface() == "ib0 (GLOO_SOCKET_IFNAME)"
    monkeypatch.delenv("GLOO_SOCKET_IFNAME")
    monkeypatch.setattr(process_group.socket, "gethostname", lambda: "localhost")
    assert process_group.gloo_interface() == (
        "lo (127.0.0.1, the address of hostname localhost: other machines cannot reach it, "
        "set GLOO_SOCKET_IFNAME)")


@pytest.mark.parametrize("local_rank, said_by_another", [("0", False), ("1", True)])
def test_a_mistake_on_every_command_line_is_local_rank_zeros_to_say(monkeypatch, local_rank, said_by_another):
    """Local rank 1 leaves it to local rank 0, even once that process is gone (here it never ran):
    a fast local rank 0 says it and exits before a slow local rank 1 looks for it (twice, before)."""
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    monkeypatch.setenv("RANK", local_rank)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert process_group.said_by_local_rank_zero() == said_by_another
    monkeypatch.delenv("RANK")  # a process no launcher started says it itself
    assert not process_group.said_by_local_rank_zero()


def timeout_s(group: dist.ProcessGroup) -> float:
    """A group's collective timeout (through a private attribute: pinned by the test below)."""
    return group._get_backend(torch.device("cpu")).options._timeout.total_seconds()


def test_the_collective_timeout_comes_from_the_caller():
    env = process_group.init_distributed(timeout_s=123)
    try:
        assert timeout_s(dist.distributed_c10d._get_default_group()) == 123
        assert env.world_size == 1 and env.backend == ("nccl" if torch.cuda.is_available() else "gloo")
    finally:
        dist.destroy_process_group()


def test_every_group_the_run_makes_has_its_timeout(tmp_path):
    """Not torch's default of 30 minutes: a user who raises the timeout for a slow snapshot save gets
    it on the stop agreement's group, the background save's, and FSDP's and HSDP's meshes alike."""
    env = process_group.init_distributed(timeout_s=77)
    try:
        policy = SnapshotPolicy(str(tmp_path / "snapshots"), snapshot_format="sharded", async_snapshots=True)
        fsdp, hsdp = sharding_mesh("fsdp", env), hsdp_mesh(env, nodes=1, ranks_per_node=1)
        groups = {
            "side": process_group.side_group(env),
            "background save": Checkpointer(policy, env, vocab=["a"]).store.process_group,
            "fsdp": fsdp.get_group(),
            **{f"hsdp {name}": hsdp.get_group(name) for name in HSDP_MESH_DIMS},
        }
        assert {name: timeout_s(group) for name, group in groups.items()} == dict.fromkeys(groups, 77)
    finally:
        dist.destroy_process_group()


FLIGHT_RECORDER_KEYS = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                        "TORCH_NCCL_DEBUG_INFO_TEMP_FILE", "TORCH_FR_DUMP_TEMP_FILE")


def test_nccls_flight_recorder_is_on_with_gpus_dumping_beside_the_snapshots(tmp_path, monkeypatch):
    """Set before the NCCL group is made (main.train); a user's own value wins; without GPUs (gloo)
    nothing is set. (A dump on a real collective timeout: checked on a lent GPU.)"""
    for key in FLIGHT_RECORDER_KEYS:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    process_group.record_nccl_collectives(str(tmp_path))
    assert not any(key in os.environ for key in FLIGHT_RECORDER_KEYS)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")
    assert process_group.trace_folder(str(tmp_path / "run")) == tmp_path / "run"
    process_group.record_nccl_collectives(str(tmp_path / "run"))
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_FR_DUMP_TEMP_FILE"] == str(tmp_path / "run" / "nccl_trace_rank_")
    assert process_group.trace_folder("s3://bucket/run").name == "nccl_traces"  # NCCL writes local files
