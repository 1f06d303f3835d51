"""Clusters, for real: `sbatch slurm/sbatch_run.sh` on a two-node Slurm, and torchrun across two hosts
(network namespaces), each surviving the SIGKILL of a training process; a Slurm job that requeues
itself at its time-limit warning; a fault-tolerant job (REPLICA_GROUPS=1: each node a replica group)
whose group on n2 loses its process and heals from the other; an elastic torchrun that loses a host;
HSDP across the two hosts, resuming FSDP's snapshot and resumed by DDP.

The daemons and namespaces come from tests/cluster.py and are stopped by the fixtures, pass or fail.
Without root or Slurm's packages these tests skip, saying why; .ci/run installs the packages and sets
MINGPT_CLUSTER_TESTS=required, which turns a skip into a failure.
"""
import contextlib
import dataclasses
import os
import re
import signal
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import psutil
import pytest
import torch
from cluster import (
    TERMINAL_JOB_STATES,
    SlurmCluster,
    TwoHosts,
    free_port,
    namespaces_unavailable,
    skip_unless_possible,
    slurm_unavailable,
    wait_for,
)
from helpers import (
    MAIN,
    REPO,
    TORCHRUN,
    WORKER_SCRIPTS,
    assert_ok,
    final_state,
    losses,
    run_main,
    tiny_overrides,
)
from state_equality import assert_same_state

from mingpt.reporting.metrics import default_metrics_path, read_metrics
from mingpt.storage.sharded_store import to_single_file

pytestmark = pytest.mark.slow

SBATCH_RUN = REPO / "slurm" / "sbatch_run.sh"
RESUMED = re.compile(r"Resuming training from snapshot at Epoch (\d+)")
SAVED = re.compile(r"Snapshot saved at epoch (\d+)")
RENDEZVOUS = "Rendezvous complete for workers"  # torchrun's agent, at LOGLEVEL=INFO
# The script's own environment knobs: the tests exercise its defaults, so none may leak in.
SCRIPT_KNOBS = ("NPROC_PER_NODE", "MAX_RESTARTS", "RDZV_PORT", "RDZV_HOST", "TORCHRUN", "MINGPT_REPO",
                "OMP_NUM_THREADS", "LOGLEVEL", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "RANK", "WORLD_SIZE",
                "REPLICA_GROUPS", "MIN_REPLICA_GROUPS", "LIGHTHOUSE_PORT")


def submitting_environment() -> dict:
    """This interpreter's environment as if its venv were activated: its bin/ (torchrun) on PATH."""
    env = {k: v for k, v in os.environ.items() if k not in SCRIPT_KNOBS}
    bin_dir = Path(sys.executable).parent
    env.update(PATH=f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}", VIRTUAL_ENV=str(bin_dir.parent),
               PYTHONUNBUFFERED="1")
    return env


def read(path: Path) -> str:
    return path.read_text() if path.exists() else ""


# -- Slurm --------------------------------------------------------------------------------------

@dataclass
class SlurmJob:
    job_id: str
    fields: dict
    output: str
    snapshot: Path
    killed_pids: list
    env: dict = dataclasses.field(default_factory=dict)


@pytest.fixture(scope="class")
def slurm_cluster(tmp_path_factory):
    """A fresh two-node Slurm (n1, n2) for TestSlurm's jobs, stopped when they are done.

    One CPU per node: the two nodes share this machine's two cores."""
    skip_unless_possible(slurm_unavailable())
    with SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=("n1", "n2"), cpus_per_node=1) as cluster:
        yield cluster


def submit_and_wait(cluster: SlurmCluster, text_file: Path, submit_dir: Path, kill_on: str = "",
                    env: Optional[dict] = None, **overrides) -> SlurmJob:
    """`sbatch slurm/sbatch_run.sh <tiny overrides>`, run to its end, with the script's knobs in env;
    with kill_on (a regular expression), SIGKILL the training process on node n2 as soon as the
    job's output matches it.

    Submitted from a directory outside the repository, so the script must find mingpt/main.py
    itself, with the test's interpreter on PATH as an activated venv would put it.
    """
    snapshot = submit_dir / "snap.pt"
    args = ["--cpus-per-task=1", SBATCH_RUN, *tiny_overrides(text_file, snapshot, **overrides)]
    env = {"RDZV_PORT": str(free_port()), **(env or {})}
    job_id = cluster.sbatch(args, cwd=submit_dir, env={**submitting_environment(), **env})
    output = submit_dir / f"slurm-{job_id}.out"  # the script's default --output, in the submit dir
    killed = []
    if kill_on:
        wait_for(lambda: (re.search(kill_on, read(output))
                          or cluster.job(job_id)["JobState"] in TERMINAL_JOB_STATES),
                 240, f"{kill_on!r} in {output}")
        killed = cluster.training_processes(job_id, "n2")
        for pid in killed:
            os.kill(pid, signal.SIGKILL)
    fields = cluster.wait_job(job_id, timeout=300)
    return SlurmJob(job_id, fields, read(output), snapshot, killed, env)


@pytest.fixture(scope="class")
def slurm_job(slurm_cluster, text_file, tmp_path_factory) -> SlurmJob:
    """A tiny model trained for two epochs by `sbatch slurm/sbatch_run.sh`; node n2's training
    process is SIGKILLed after the first epoch's snapshot (the job's plain path is the same run's:
    two nodes, one world, one writer, each torchrun ending well)."""
    return submit_and_wait(slurm_cluster, text_file, tmp_path_factory.mktemp("submit"),
                           kill_on="Snapshot saved at epoch 1", trainer_config__max_epochs=2)


WITH_A_DATA_WORKER = {"trainer_config__log_every": 10, "trainer_config__data_loader_workers": 1}
"""Slurm signals every process of a step, data workers too: each rank runs one."""


@pytest.fixture(scope="class")
def cancelled_job(slurm_cluster, text_file, tmp_path_factory) -> SlurmJob:
    """A plain `scancel` mid-epoch: SIGTERM to every process of the job, then SIGKILL after KillWait."""
    submit_dir = tmp_path_factory.mktemp("submit")
    snapshot = submit_dir / "snap.pt"
    args = ["--cpus-per-task=1", SBATCH_RUN,
            *tiny_overrides(text_file, snapshot, trainer_config__max_epochs=2, **WITH_A_DATA_WORKER)]
    job_id = slurm_cluster.sbatch(args, cwd=submit_dir,
                                  env={**submitting_environment(), "RDZV_PORT": str(free_port())})
    output = submit_dir / f"slurm-{job_id}.out"
    wait_for(lambda: "| Iter 30 |" in read(output), 240, f"training under way in {output}")
    slurm_cluster.command("scancel", job_id)
    fields = slurm_cluster.wait_job(job_id, timeout=120)
    return SlurmJob(job_id, fields, read(output), snapshot, [])


@pytest.fixture(scope="class")
def requeued_job(slurm_cluster, text_file, tmp_path_factory) -> SlurmJob:
    """REQUEUE=1 and the time-limit warning mid-epoch: the job saves, requeues itself, resumes, ends.

    The warning is what `#SBATCH --signal=B:USR1@120` makes Slurm send two minutes before the
    time limit: SIGUSR1 to the batch shell, sent here at once with scancel."""
    submit_dir = tmp_path_factory.mktemp("submit")
    snapshot = submit_dir / "snap.pt"
    args = ["--cpus-per-task=1", SBATCH_RUN, *tiny_overrides(text_file, snapshot, **WITH_A_DATA_WORKER)]
    env = {**submitting_environment(), "RDZV_PORT": str(free_port()), "REQUEUE": "1"}
    job_id = slurm_cluster.sbatch(args, cwd=submit_dir, env=env)
    output = submit_dir / f"slurm-{job_id}.out"
    wait_for(lambda: "| Iter 30 |" in read(output), 240, f"training under way in {output}")
    slurm_cluster.command("scancel", "--signal=USR1", "--batch", job_id)
    wait_for(lambda: "requeued; it resumes" in read(output), 120, f"the requeue in {output}")
    # Slurm holds a requeued job back for minutes (its BeginTime). Once the first run's steps have
    # ended on every node (a node refuses to start a job whose old steps are still there), let it
    # start now.
    wait_for(lambda: (slurm_cluster.job(job_id)["JobState"] == "PENDING"
                      and not slurm_cluster.steps_running(job_id)), 120, "the first run's steps to end")
    slurm_cluster.command("scontrol", "update", f"JobId={job_id}", "StartTime=now")
    fields = slurm_cluster.wait_job(job_id, timeout=300)
    return SlurmJob(job_id, fields, read(output), snapshot, [])


class TestSlurm:
    def test_a_cancelled_job_stops_every_rank_with_a_snapshot(self, cancelled_job):
        job = cancelled_job
        assert job.fields["JobState"] == "CANCELLED", f"{job.fields}\n{job.output}"
        assert "1 data worker(s) per process" in job.output, job.output
        stopped = re.findall(r"Stopping on SIGTERM: snapshot saved at step (\d+)", job.output)
        assert len(stopped) == 1, job.output
        assert torch.load(job.snapshot, weights_only=True)["step"] == int(stopped[0])
        assert "killed by signal" not in job.output and "exited unexpectedly" not in job.output, job.output

    def test_a_requeued_job_saves_at_the_warning_and_resumes_at_that_step(self, requeued_job):
        job = requeued_job
        assert job.fields["JobState"] == "COMPLETED", f"{job.fields}\n{job.output}"
        assert "1 data worker(s) per process" in job.output, job.output
        assert job.fields["Restarts"] == "1", job.fields
        stopped = re.findall(r"Stopping on SIGTERM: snapshot saved at step (\d+)", job.output)
        assert len(stopped) == 1, job.output
        assert f"Resuming training from snapshot at Epoch 0 (step {stopped[0]}," in job.output
        assert torch.load(job.snapshot, weights_only=True)["finished_epoch"] == 1

    def test_sbatch_job_completes_on_two_nodes(self, slurm_job):
        job = slurm_job
        assert job.fields["JobState"] == "COMPLETED", f"{job.fields}\n{job.output}"
        assert job.fields["ExitCode"] == "0:0"
        assert job.fields["NodeList"] == "n[1-2]"
        assert f"job {job.job_id}: 2 node(s) (n1 n2), 1 process(es) per node" in job.output
        # Found from outside the repository: this repo's main.py, the venv's torchrun.
        assert f"{MAIN} with {Path(sys.executable).parent / 'torchrun'}" in job.output

    def test_each_node_runs_torchrun_and_ends_well(self, slurm_job):
        out = slurm_job.output
        for node_rank, node in enumerate(("n1", "n2")):
            # Printed on the node itself: SLURMD_NODENAME and SLURM_NODEID come from its slurmd.
            started = rf"\[mingpt-ddp\] node {node} \(.*\): node rank {node_rank} of 2 starting torchrun"
            assert re.search(started, out), out
            assert f"[mingpt-ddp] node {node}: torchrun exited with status 0" in out, out

    def test_sbatch_trains_one_world_of_two_and_writes_each_snapshot_once(self, slurm_job):
        out = slurm_job.output
        assert "on 2 ranks)" in out, out  # the eval loss is a mean over a world of 2
        assert losses(out), "no training progress in the job output"
        assert {rank for rank, *_ in losses(out)} == {0}
        assert SAVED.findall(out) == ["1", "2"], "each epoch's snapshot once, by global rank 0 only"
        assert torch.load(slurm_job.snapshot, weights_only=True)["finished_epoch"] == 2

    def test_sbatch_job_survives_a_killed_process_within_its_restart_budget(self, slurm_job):
        job = slurm_job
        assert len(job.killed_pids) == 1, f"expected one training process on n2 to kill:\n{job.output}"
        assert job.fields["JobState"] == "COMPLETED", f"{job.fields}\n{job.output}"
        assert f"failed (exitcode: -9) local_rank: 0 (pid: {job.killed_pids[0]})" in job.output
        assert RESUMED.findall(job.output) == ["1"], job.output
        resumed_at = job.output.index("Resuming training from snapshot")
        assert resumed_at > job.output.index("Snapshot saved at epoch 1")
        trained_after = sorted({epoch for _, epoch, _, _ in losses(job.output[resumed_at:])})
        assert trained_after == [2], "the restart did not go on with the second epoch alone"


@pytest.fixture(scope="class")
def fault_tolerant_job(slurm_cluster, text_file, tmp_path_factory) -> SlurmJob:
    """REPLICA_GROUPS=1: n1 and n2 each a replica group of one rank, meeting at the lighthouse the
    script starts; once both train in one quorum, group 1's training process (on n2) is SIGKILLed:
    group 0 goes on alone, torchrun restarts group 1's worker, which heals from group 0.

    Steps slowed to about 0.1 s (tests/workers/fault_injection.py's SLOW, run as the script's
    main.py through MINGPT_REPO): group 0 must still be training when group 1's restart, slow on
    this loaded machine, comes back. A sleep, not a longer run: it leaves the CPU to that restart."""
    repo = tmp_path_factory.mktemp("repo")
    (repo / "mingpt").mkdir()
    (repo / "mingpt" / "main.py").symlink_to(WORKER_SCRIPTS / "fault_injection.py")
    env = {"REPLICA_GROUPS": "1", "LIGHTHOUSE_PORT": str(free_port()), "MINGPT_REPO": str(repo),
           "SLOW": "compute:0.05:1", "SLOW_RANK": "all"}
    both_training = r"\(2 of 2\)[\s\S]*\[replica 0\] \[RANK0\] Epoch \d+ \| Iter [1-9]\d* \|"  # group 0 speaks
    return submit_and_wait(slurm_cluster, text_file, tmp_path_factory.mktemp("submit"), kill_on=both_training,
                           env=env, trainer_config__max_epochs=100, trainer_config__max_steps=700,
                           fault_tolerance_config__timeout_s=5, trainer_config__eval_batches=2)


class TestSlurmFaultTolerant:
    def test_each_node_a_replica_group_that_outlives_the_loss_of_the_other(self, fault_tolerant_job):
        job = fault_tolerant_job
        out = job.output
        assert job.fields["JobState"] == "COMPLETED", f"{job.fields}\n{out}"
        assert job.fields["ExitCode"] == "0:0", job.fields
        # The lighthouse on the head node's cluster address (the rendezvous line's), and how to restart it.
        head = re.escape(re.search(r"rendezvous \S+ at (\S+):\d+", out).group(1))
        port = job.env["LIGHTHOUSE_PORT"]
        lighthouse = re.search(
            rf"\[mingpt-ddp\] Lighthouse: http://{head}:{port} \(pid (\d+)\); if it dies, start it again "
            rf"on n1 with: \S+/torchft_lighthouse --bind {head}:{port} --min_replicas 1, then restart the "
            r"replica groups", out)
        assert lighthouse, out
        # The kill cost group 1 its worker, which torchrun restarted and which healed from group 0.
        assert len(job.killed_pids) == 1, f"expected one training process on n2 to kill:\n{out}"
        assert re.search(r"\[replica 1\] .*failed \(exitcode: -9\) local_rank: 0", out), out
        # What the survivor says depends on timing (the group leaving, a step not committed, or nothing
        # when the restart came back within the lighthouse's 5 s heartbeat timeout between two steps):
        # tests/end_to_end/test_fault_tolerant_runs.py asserts those lines under controlled timing.
        assert re.search(r"\[replica 1\] Healed from replica group 0 at step \d+", out), out
        # Group 0 went on: never back to a snapshot.
        assert "[replica 0] Resuming training from snapshot" not in out, out
        assert "[replica 0] Finished: epoch" in out and "[replica 1] Finished" not in out, out  # one voice
        for group, node in enumerate(("n1", "n2")):
            assert f"[mingpt-ddp] replica group {group} ({node}): torchrun exited with status 0" in out, out
        # The lighthouse ended with the job.
        pid = int(lighthouse.group(1))
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


# -- two hosts ----------------------------------------------------------------------------------

@dataclass
class TwoHostRun:
    logs: list[str]
    exit_codes: list[int]
    killed_pid: int
    snapshot: Path
    max_epochs: int


def worker_of(agent: int) -> int:
    """The training process below a torchrun agent."""
    def find():
        for child in psutil.Process(agent).children():
            with contextlib.suppress(psutil.NoSuchProcess):
                if str(MAIN) in child.cmdline():
                    return child.pid
        return None
    return wait_for(find, 60, f"the worker of torchrun agent {agent}")


@pytest.fixture(scope="class")
def two_host_run(text_file, tmp_path_factory) -> TwoHostRun:
    """`torchrun --nnodes=1:2 --nproc_per_node=1` on node1 and node2, one epoch, a snapshot every 20
    steps. Once the first is written, node2's worker is SIGKILLed: torchrun restarts both nodes'
    workers from it. Once the restarted world has written one of its own, node2 is removed whole
    (its agent and worker SIGKILLed): node1 carries on alone from that snapshot."""
    skip_unless_possible(namespaces_unavailable())
    root = tmp_path_factory.mktemp("hosts")
    snapshot = root / "snap.pt"  # one file system: on real machines, shared storage or s3://
    # Workers with their own TCP store: with the rendezvous's shared one, restarts often fail to
    # connect (see slurm/README.md). LOGLEVEL=INFO: each agent logs its rendezvous results.
    env = {**submitting_environment(), "OMP_NUM_THREADS": "1", "LOGLEVEL": "INFO",
           "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    # A short last call: once node2 is gone, node1 need not wait long for more nodes to join.
    torchrun = [*TORCHRUN, "--nnodes=1:2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={TwoHosts.NAMES[0]}:29500", f"--rdzv_id={uuid.uuid4().hex}",
                "--rdzv_conf=last_call_timeout=3", "--max-restarts=3", MAIN,
                *tiny_overrides(text_file, snapshot, trainer_config__save_every_steps=20,
                                trainer_config__log_every=10)]
    logs = [root / f"{name}.log" for name in TwoHosts.NAMES]
    with TwoHosts(root) as hosts:
        # node2 goes first and waits for node1's rendezvous store: had node1 started first, a slow
        # node2 could miss its last call, and node1 would train alone before the two-node world.
        # (Ranks follow the sorted host names, so node1 is still global rank 0.)
        agents = [None, hosts.popen(1, torchrun, logs[1], env)]
        wait_for(lambda: "Starting elastic_operator" in read(logs[1]), 60, "node2's agent")
        agents[0] = hosts.popen(0, torchrun, logs[0], env)

        def saved_after(marker: str) -> bool:
            text = read(logs[0])
            return (marker in text and "Snapshot saved at step" in text.split(marker, 1)[1]
                    or any(a.poll() is not None for a in agents))

        wait_for(lambda: saved_after("Snapshot not found"), 240, "the first snapshot")
        assert all(a.poll() is None for a in agents), f"torchrun ended before the kill:\n{read(logs[0])}"
        victim = worker_of(agents[1].pid)
        os.kill(victim, signal.SIGKILL)
        wait_for(lambda: saved_after("Resuming training from snapshot"), 240, "a snapshot after the restart")
        assert all(a.poll() is None for a in agents), f"torchrun ended before the removal:\n{read(logs[0])}"
        hosts.remove_host(1)
        wait_for(lambda: agents[0].poll() is not None, 300, "node1's torchrun to finish alone")
        exit_codes = [a.wait() for a in agents]
    return TwoHostRun([read(log) for log in logs], exit_codes, victim, snapshot, max_epochs=1)


RESUMED_AT_STEP = re.compile(
    r"Resuming training from snapshot at Epoch 0 \(step (\d+), sample ([\d,]+) of epoch 1\)")


class TestTwoHosts:
    def test_torchrun_across_two_hosts_trains_as_one_world(self, two_host_run):
        node1, node2 = two_host_run.logs
        assert "World: 2 process(es) on 2 node(s)" in node1, node1
        assert losses(node1) and not losses(node2), "global rank 0 on node1 logs progress, node2 does not"
        # Each agent's rendezvous result: node2 joined node1's rendezvous as node rank 1 of 2.
        assert "group_rank=0" in node1 and "group_rank=1" in node2
        assert "group_world_size=2" in node1 and "group_world_size=2" in node2
        assert "master_addr=node1" in node2, "node2's worker did not meet at node1's address"
        # Start-up names the link the gloo groups use between the hosts (each has its veth0 only).
        address = TwoHosts.ADDRESSES[0]
        assert f"gloo on cpu, across nodes on veth0 ({address}, the address of hostname node1)" in node1

    def test_killed_worker_on_second_host_restarts_both_and_resumes(self, two_host_run):
        node1, node2 = two_host_run.logs
        assert two_host_run.exit_codes[0] == 0, f"node1:\n{node1}\nnode2:\n{node2}"
        # node2's agent saw its worker die of the SIGKILL and spent one restart of its budget;
        # node1's, seeing node2 back at the rendezvous, restarted its own worker with it (and once
        # more, alone, when node2 was gone).
        assert f"failed (exitcode: -9) local_rank: 0 (pid: {two_host_run.killed_pid})" in node2, node2
        assert "restart_count=1" in node2
        assert node2.count(RENDEZVOUS) == 2 and node1.count(RENDEZVOUS) == 3, node1
        # The first start trained from scratch; the restart resumed from its step snapshot, both
        # ranks where it left off.
        assert node1.count("Snapshot not found. Training model from scratch") == 1
        restarted = node1.split("group_world_size=2")[2].split("group_world_size=1")[0]  # the 2nd world of 2
        step, sample = RESUMED_AT_STEP.search(restarted).groups()
        assert int(step) >= 20 and int(sample.replace(",", "")) == int(step) * 32 * 2, restarted
        assert {epoch for _, epoch, _, _ in losses(restarted)} == {1}

    def test_a_lost_host_leaves_the_other_training_alone_from_the_exact_sample(self, two_host_run):
        node1, _ = two_host_run.logs
        after = node1.split("group_world_size=1", 1)[1]  # the world node1 was left alone in
        match = re.search(r"resumed by 1: epoch 1 continues at sample ([\d,]+)", after)
        assert match, after
        step = int(RESUMED_AT_STEP.search(after).group(1))
        assert step >= 40 and int(match.group(1).replace(",", "")) == step * 32 * 2
        assert SAVED.findall(after)[-1] == "1"
        finished = torch.load(two_host_run.snapshot, weights_only=True)["finished_epoch"]
        assert finished == two_host_run.max_epochs


class TestHangAcrossHosts:
    def test_a_rank_stuck_on_the_other_host_is_named_with_that_host(self, text_file, tmp_path):
        """The hang watchdog across two hosts (distributed/watchdog.py): node2's rank blocks in its
        data loading at step 25; node1's rank names it with node2's host name within the timeout,
        both exit 1, and the snapshot of step 20 is kept."""
        skip_unless_possible(namespaces_unavailable())
        snapshot = tmp_path / "snap.pt"
        env = {**submitting_environment(), "OMP_NUM_THREADS": "1", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
               "LOGLEVEL": "INFO", "SLOW": "data:600:25"}  # INFO: the agent says when it has started
        torchrun = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d",
                    f"--rdzv_endpoint={TwoHosts.NAMES[0]}:29500", f"--rdzv_id={uuid.uuid4().hex}",
                    WORKER_SCRIPTS / "fault_injection.py",
                    *tiny_overrides(text_file, snapshot, trainer_config__save_every_steps=10,
                                    trainer_config__hang_timeout_s=4)]
        logs = [tmp_path / f"{name}.log" for name in TwoHosts.NAMES]
        with TwoHosts(tmp_path) as hosts:
            agents = [hosts.popen(1, torchrun, logs[1], env)]
            wait_for(lambda: "Starting elastic_operator" in read(logs[1]), 60, "node2's agent")
            agents.insert(0, hosts.popen(0, torchrun, logs[0], env))
            wait_for(lambda: all(a.poll() is not None for a in agents), 120, "both agents to end")
        node1, node2 = (read(log) for log in logs)
        said = [line for line in (node1 + node2).splitlines() if line.startswith("error: rank 1")]
        assert len(said) == 1, f"node1:\n{node1}\nnode2:\n{node2}"
        assert re.match(r"error: rank 1 \(host node2, pid \d+\) has not moved for \d+ s; it was in step 25's "
                        r"data loading; rank\(s\) 0 are waiting for it in step 25's backward pass", said[0])
        assert "the last snapshot (step 20) is kept as it was" in said[0]
        assert [a.returncode for a in agents] == [1, 1]


# -- HSDP across the two hosts ------------------------------------------------------------------

HSDP_MAIN = WORKER_SCRIPTS / "hsdp_main.py"
FSDP_STEPS = 10  # the first hop's step budget
DDP_STEPS = 5  # the last hop's steps after the HSDP snapshot


@dataclass
class HsdpChain:
    fsdp: str  # the output of each hop: the first and last on one host, HSDP's on each host
    hsdp: list[str]
    ddp: str
    hsdp_exit_codes: list[int]
    hsdp_step: int  # where the HSDP run's snapshot stands
    snapshot: Path  # the single-file snapshot of the first two hops
    sharded: Path  # the sharded snapshots: HSDP's, then DDP's
    recorded: Path  # what each HSDP rank held after each load and at the end (tests/workers/hsdp_main.py)

    @property
    def shards(self) -> list[dict]:
        """What each HSDP rank held at the end, by global rank."""
        files = [self.recorded / f"rank{rank}.pt" for rank in range(4)]
        return [torch.load(file, weights_only=True) for file in files if file.exists()]


@pytest.fixture(scope="class")
def hsdp_chain(text_file, tmp_path_factory) -> HsdpChain:
    """fsdp -> hsdp -> ddp, each resuming the snapshot of the one before, every snapshot written both
    as a single file and sharded (tests/workers/hsdp_main.py).

    fsdp: 2 ranks on this host, 10 steps. hsdp: node1 and node2 with 2 ranks each, a 2 x 2 mesh,
    loading FSDP's sharded snapshot and then its single file (recording what each left on every
    rank), finishing the epoch with bf16, CPU offload and 2-micro-batch accumulation (FSDP's paths,
    on a 2-D mesh), and recording each rank's shards at the end. ddp: one process on this host
    (`python main.py`: the 4 ranks' shards resharded onto 1), resuming HSDP's sharded snapshot for
    5 more steps."""
    skip_unless_possible(namespaces_unavailable())
    root = tmp_path_factory.mktemp("hsdp")
    snapshot, sharded, shards = root / "chain.pt", root / "sharded", root / "shards"
    shards.mkdir()
    half = root / "half.txt"  # an epoch of 21 steps on 4 ranks: 11 of them on the 2 x 2 mesh
    half.write_text(text_file.read_text()[:3000])
    text_file = half
    fsdp = run_main(tiny_overrides(text_file, snapshot, trainer_config__distributed_method="fsdp",
                                   trainer_config__max_steps=FSDP_STEPS),
                    nproc=2, script=HSDP_MAIN, env={"ALSO_SHARDED": str(sharded)})
    assert_ok(fsdp)
    env = {**submitting_environment(), "OMP_NUM_THREADS": "1", "ALSO_SHARDED": str(sharded),
           "SHARDS_DIR": str(shards)}
    torchrun = [*TORCHRUN, "--nnodes=2", "--nproc_per_node=2", "--rdzv_backend=c10d",
                f"--rdzv_endpoint={TwoHosts.NAMES[0]}:29500", f"--rdzv_id={uuid.uuid4().hex}", HSDP_MAIN,
                *tiny_overrides(text_file, snapshot, trainer_config__distributed_method="hsdp",
                                trainer_config__batch_size=16, trainer_config__grad_accum_steps=2,
                                trainer_config__use_amp=True, trainer_config__cpu_offload=True,
                                trainer_config__log_every=10)]
    logs = [root / f"{name}.log" for name in TwoHosts.NAMES]
    with TwoHosts(root) as hosts:
        agents = [hosts.popen(i, torchrun, logs[i], env) for i in (0, 1)]
        wait_for(lambda: all(a.poll() is not None for a in agents), 300, "both torchrun agents to finish")
    hsdp_step = torch.load(snapshot, weights_only=True)["step"]
    ddp = run_main(tiny_overrides(text_file, sharded, trainer_config__distributed_method="ddp",
                                  trainer_config__snapshot_format="sharded",
                                  trainer_config__max_steps=hsdp_step + DDP_STEPS))
    return HsdpChain(fsdp.stdout + fsdp.stderr, [read(log) for log in logs], ddp.stdout + ddp.stderr,
                     [a.returncode for a in agents], hsdp_step, snapshot, sharded, shards)


class TestHsdp:
    def test_hsdp_runs_on_a_2x2_mesh_holding_half_the_model_per_rank(self, hsdp_chain):
        node1, node2 = hsdp_chain.hsdp
        assert hsdp_chain.hsdp_exit_codes == [0, 0], f"node1:\n{node1}\nnode2:\n{node2}"
        assert "World: 4 process(es) on 2 node(s), gloo on cpu, across nodes on veth0 (" in node1, node1
        assert "; hsdp with CPU offload;" in node1, node1
        assert [rank["host"] for rank in hsdp_chain.shards] == ["node1", "node1", "node2", "node2"]
        model_bytes = sum(t.numel() * t.element_size()
                          for t in torch.load(hsdp_chain.snapshot, weights_only=True)["model_state"].values())
        for rank in hsdp_chain.shards:
            assert rank["mesh_shapes"] == {(2, 2)} and rank["placements"] == {"(Replicate(), Shard(dim=0))"}
            assert rank["bytes"] == pytest.approx(model_bytes / 2, rel=0.05)  # 1/ranks per node
        assert hsdp_chain.shards[0]["bytes"] + hsdp_chain.shards[1]["bytes"] == model_bytes

    def test_hsdp_replicates_across_hosts(self, hsdp_chain):
        """Local rank r of node1 and of node2 hold the same shard, equal to the last bit after training:
        the gradients were all-reduced across the hosts."""
        ranks = hsdp_chain.shards
        assert len(ranks) == 4, f"not every rank recorded its shards:\n{hsdp_chain.hsdp[0]}"
        for local_rank in (0, 1):
            node1, node2 = ranks[local_rank]["shards"], ranks[local_rank + 2]["shards"]
            assert_same_state(node2, node1, f"local rank {local_rank}'s shards")
        assert any(not torch.equal(ranks[0]["shards"][name], ranks[1]["shards"][name])
                   for name in ranks[0]["shards"]), "both ranks of a node hold the same: not sharded"

    def test_hsdp_resumes_fsdp_and_trains_and_ddp_resumes_hsdp(self, hsdp_chain):
        assert f"Snapshot saved at step {FSDP_STEPS} (the last)" in hsdp_chain.fsdp, hsdp_chain.fsdp
        node1 = hsdp_chain.hsdp[0]
        assert (f"Resuming training from snapshot at Epoch 0 (step {FSDP_STEPS}, sample 640 of epoch 1)"
                in node1), node1
        assert "Snapshot saved at epoch 1" in node1 and "on 4 ranks)" in node1, node1  # eval over 4 ranks
        ddp = hsdp_chain.ddp
        assert "Resuming training from snapshot at Epoch 1" in ddp, ddp
        assert f"Snapshot saved at step {hsdp_chain.hsdp_step + DDP_STEPS} (the last)" in ddp, ddp
        # Steps 1-10 by FSDP, the rest of the epoch by HSDP; then DDP's in the sharded folder.
        chain = read_metrics(default_metrics_path(str(hsdp_chain.snapshot)), "train")
        assert [line["step"] for line in chain] == list(range(1, hsdp_chain.hsdp_step + 1))
        hsdp_start, hsdp_end = chain[FSDP_STEPS - 1]["loss"], chain[-1]["loss"]
        assert hsdp_end < hsdp_start - 0.5, "HSDP did not train"
        ddp_losses = [line["loss"] for line in read_metrics(f"{hsdp_chain.sharded}/metrics.jsonl", "train")]
        assert len(ddp_losses) == DDP_STEPS
        assert max(ddp_losses) < hsdp_start - 0.5, "DDP did not resume from HSDP's weights"

    def test_hsdp_loads_fsdps_sharded_snapshot_as_it_loads_the_single_file(self, hsdp_chain):
        """DCP reshards FSDP's 1-D shards onto the 2 x 2 mesh: every rank, on either host, holds what
        the full-state restore of the same step gives it, weights and AdamW state, to the bit."""
        for rank in range(4):
            from_sharded, from_single = (torch.load(hsdp_chain.recorded / f"restored_{kind}_rank{rank}.pt",
                                                    weights_only=True) for kind in ("sharded", "single"))
            assert from_single["optimizer"], "the single file restored no optimizer state"
            assert_same_state(from_sharded, from_single, f"rank {rank}")

    def test_hsdp_sharded_snapshot_holds_what_its_single_file_holds(self, hsdp_chain, tmp_path):
        """The same state, saved by DCP shard by shard from the 2-D mesh and gathered into one file."""
        converted = tmp_path / "converted.pt"
        to_single_file(str(hsdp_chain.sharded / f"sharded_{hsdp_chain.hsdp_step:09d}"), str(converted))
        assert_same_state(final_state(converted), final_state(hsdp_chain.snapshot))
