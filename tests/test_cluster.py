"""Clusters, for real: `sbatch slurm/sbatch_run.sh` on a two-node Slurm, and torchrun across two hosts
(network namespaces) surviving the loss of a worker.

The daemons and namespaces come from tests/cluster.py and are stopped by each fixture, pass or fail.
Without root or Slurm's packages these tests skip, saying why; .ci/run installs the packages and sets
MINGPT_CLUSTER_TESTS=required, which turns a skip into a failure.
"""
import os
import re
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from cluster import (
    SlurmCluster,
    TwoHosts,
    children,
    free_port,
    namespaces_unavailable,
    skip_unless_possible,
    slurm_unavailable,
    wait_for,
)
from helpers import MAIN, REPO, TORCHRUN, losses, tiny_overrides

SBATCH_RUN = REPO / "slurm" / "sbatch_run.sh"
RESUMED = re.compile(r"Resuming training from snapshot at Epoch (\d+)")
SAVED = re.compile(r"Snapshot saved at epoch (\d+)")
# The script's own environment knobs: the tests exercise its defaults, so none may leak in.
SCRIPT_KNOBS = ("NPROC_PER_NODE", "MAX_RESTARTS", "RDZV_PORT", "RDZV_HOST", "TORCHRUN", "MINGPT_REPO",
                "OMP_NUM_THREADS", "LOGLEVEL")


def submitting_environment() -> dict:
    """This interpreter's environment as if activated: its bin/ (torchrun) first on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_KNOBS and k not in ("RANK", "WORLD_SIZE")}
    bin_dir = str(Path(sys.executable).parent)
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}", VIRTUAL_ENV=str(Path(bin_dir).parent),
               PYTHONUNBUFFERED="1")
    return env


# -- Slurm --------------------------------------------------------------------------------------

@dataclass
class SlurmJob:
    job_id: str
    fields: dict
    output: str
    snapshot: Path
    submit_dir: Path


@pytest.fixture(scope="module")
def slurm_job(text_file, tmp_path_factory) -> SlurmJob:
    """`sbatch slurm/sbatch_run.sh <tiny overrides>` on a fresh two-node Slurm, run to its end.

    Submitted from a directory outside the repository, so the script must find mingpt/main.py
    itself, with the test's interpreter on PATH, as an activated venv would put it. The cluster is
    stopped before any assertion runs.
    """
    skip_unless_possible(slurm_unavailable())
    root = tmp_path_factory.mktemp("slurm")
    submit_dir = tmp_path_factory.mktemp("submit")
    snapshot = submit_dir / "snap.pt"
    # One CPU per node: the two nodes share this machine's two cores.
    with SlurmCluster(root, nodes=("n1", "n2"), cpus_per_node=1) as cluster:
        job_id = cluster.sbatch(["--cpus-per-task=1", SBATCH_RUN, *tiny_overrides(text_file, snapshot)],
                                cwd=submit_dir, env={**submitting_environment(), "RDZV_PORT": str(free_port())})
        fields = cluster.wait_job(job_id, timeout=300)
    output_file = submit_dir / f"slurm-{job_id}.out"  # the script's default --output, in the submit dir
    return SlurmJob(job_id, fields, output_file.read_text() if output_file.exists() else "", snapshot, submit_dir)


def test_sbatch_job_completes_on_two_nodes(slurm_job):
    assert slurm_job.fields["JobState"] == "COMPLETED", f"{slurm_job.fields}\n{slurm_job.output}"
    assert slurm_job.fields["ExitCode"] == "0:0"
    assert slurm_job.fields["NodeList"] == "n[1-2]"
    assert f"job {slurm_job.job_id}: 2 node(s) (n1 n2), 1 process(es) per node" in slurm_job.output
    assert f"{MAIN} with {Path(sys.executable).parent / 'torchrun'}" in slurm_job.output


def test_each_node_runs_torchrun_and_ends_well(slurm_job):
    for node_rank, node in enumerate(("n1", "n2")):
        assert f"node {node} " in slurm_job.output and f"node rank {node_rank} of 2 starting torchrun" in slurm_job.output
        assert f"[mingpt-ddp] node {node}: torchrun exited with status 0" in slurm_job.output, slurm_job.output


def test_sbatch_trains_one_world_of_two_and_writes_one_snapshot(slurm_job):
    out = slurm_job.output
    assert "on 2 process(es)" in out and "on 2 ranks)" in out, out
    assert losses(out), "no training progress in the job output"
    assert {rank for rank, *_ in losses(out)} == {0}
    assert SAVED.findall(out) == ["1"], "one snapshot, by global rank 0 only"
    assert torch.load(slurm_job.snapshot, weights_only=True)["finished_epoch"] == 1


# -- two hosts ----------------------------------------------------------------------------------

@dataclass
class TwoHostRun:
    logs: list[str]
    exit_codes: list[int]
    killed_pid: int
    snapshot: Path
    max_epochs: int


def _worker_of(agent: int) -> int:
    """The training process below a torchrun agent."""
    def find():
        for child in children(agent):
            try:
                if str(MAIN).encode() in Path(f"/proc/{child}/cmdline").read_bytes():
                    return child
            except OSError:
                continue
        return None
    return wait_for(find, 60, f"the worker of torchrun agent {agent}")


@pytest.fixture(scope="module")
def two_host_run(text_file, tmp_path_factory) -> TwoHostRun:
    """`torchrun --nnodes=2 --nproc_per_node=1` on node1 and node2; node2's worker is SIGKILLed once
    the first snapshot is written, and torchrun must restart both nodes' workers from it."""
    skip_unless_possible(namespaces_unavailable())
    root = tmp_path_factory.mktemp("hosts")
    snapshot = root / "snap.pt"  # one file system: on real machines, shared storage or s3://
    max_epochs = 3
    # Two restarts at most; the shared rendezvous store breaks restarts (see the notes).
    env = {**submitting_environment(), "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    torchrun = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={TwoHosts.NAMES[0]}:29500", f"--rdzv_id={uuid.uuid4().hex}",
                "--max-restarts=2", MAIN,
                *tiny_overrides(text_file, snapshot, trainer_config__max_epochs=max_epochs)]
    logs = [root / f"{name}.log" for name in TwoHosts.NAMES]
    with TwoHosts(root) as hosts:
        agents = [hosts.popen(i, torchrun, logs[i], env) for i in (0, 1)]
        # Global rank 0 (node1, which hosts the rendezvous and sorts first) logs the snapshot.
        wait_for(lambda: "Snapshot saved at epoch 1" in logs[0].read_text() or any(a.poll() is not None for a in agents),
                 240, "the first snapshot")
        assert all(a.poll() is None for a in agents), "torchrun ended before the kill:\n" + logs[0].read_text()
        victim = _worker_of(agents[1].pid)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: all(a.poll() is not None for a in agents), 300, "both torchrun agents to finish")
        exit_codes = [a.returncode for a in agents]
    return TwoHostRun([log.read_text() for log in logs], exit_codes, victim, snapshot, max_epochs)


def test_torchrun_across_two_hosts_trains_as_one_world(two_host_run):
    node1, node2 = two_host_run.logs
    assert "on 2 process(es)" in node1 and "on 2 ranks)" in node1, node1
    assert losses(node1) and not losses(node2), "global rank 0 on node1 logs progress, node2 does not"
    # Each agent's rendezvous result: node2 joined node1's rendezvous as node rank 1 of 2.
    assert "group_rank=0" in node1 and "group_rank=1" in node2
    assert "group_world_size=2" in node1 and "group_world_size=2" in node2
    assert "master_addr=node1" in node2, "node2's worker did not meet at node1's address"


def test_killed_worker_on_second_host_restarts_both_and_resumes_from_the_snapshot(two_host_run):
    node1, node2 = two_host_run.logs
    assert two_host_run.exit_codes == [0, 0], f"node1:\n{node1}\nnode2:\n{node2}"
    # node2's agent saw its worker die of the SIGKILL; both agents then met again (restart 1).
    assert f"failed (exitcode: -9) local_rank: 0 (pid: {two_host_run.killed_pid})" in node2, node2
    # node2's agent spent one restart of its budget; node1's, seeing node2 come back to the
    # rendezvous, restarted its own worker with it: a second round of rendezvous on both.
    assert "restart_count=1" in node2
    assert node1.count("Rendezvous complete for workers") == node2.count("Rendezvous complete for workers") == 2
    # The first start trained from scratch; the restart resumed from a snapshot of the first run.
    assert node1.count("Snapshot not found. Training model from scratch") == 1
    resumed = [int(epoch) for epoch in RESUMED.findall(node1)]
    assert len(resumed) == 1 and 1 <= resumed[0] < two_host_run.max_epochs, node1
    after_resume = node1.split("Resuming training from snapshot")[1]
    trained_after = sorted({epoch for _, epoch, _, _ in losses(after_resume)})
    assert trained_after == list(range(resumed[0] + 1, two_host_run.max_epochs + 1)), after_resume
    assert SAVED.findall(after_resume)[-1] == str(two_host_run.max_epochs)
    assert torch.load(two_host_run.snapshot, weights_only=True)["finished_epoch"] == two_host_run.max_epochs
