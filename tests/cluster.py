"""A real cluster on this machine, for tests/end_to_end/test_cluster.py.

- `SlurmCluster`: munged, slurmctld and two slurmd "nodes" (n1, n2) on this host, from Debian's
  packages, each with its own key, socket, ports and spool directories, so that it touches nothing
  of a Slurm or munge that may already run here.
- `TwoHosts`: two network namespaces joined by a veth pair, each with its own hostname and
  /etc/hosts, so that two torchrun agents see each other as different machines.

Both are context managers: whatever they start is stopped by PID, and the namespaces deleted, on
the way out, whether the test passed or not. What the tests run on them: slurm/README.md's "How this
is tested"; what each step relies on (measured on this machine) is said beside it.
"""
import contextlib
import os
import pwd
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Optional, TypeVar

import psutil
import pytest

T = TypeVar("T")

# Set by .ci/run, where the packages are installed: a missing piece there is a failure, not a skip.
REQUIRED_ENV = "MINGPT_CLUSTER_TESTS"
SLURM_COMMANDS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "sinfo",
                  "scontrol", "scancel")
NAMESPACE_COMMANDS = ("ip", "unshare", "nsenter", "mount")
SLURM_INSTALL = "apt-get install slurmctld slurmd slurm-client munge (.ci/run does)"
TERMINAL_JOB_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
                       "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


def skip_unless_possible(reason: Optional[str]) -> None:
    """Skip with the reason, or fail where the environment promises a cluster (.ci/run)."""
    if reason is None:
        return
    if os.environ.get(REQUIRED_ENV) == "required":
        pytest.fail(f"{REQUIRED_ENV}=required but {reason}")
    pytest.skip(reason)


def slurm_unavailable() -> Optional[str]:
    """Why a Slurm cluster cannot be started here, or None."""
    if os.geteuid() != 0:
        return "a Slurm cluster needs root (slurmd runs jobs as their users; munged runs as the munge user)"
    missing = [c for c in SLURM_COMMANDS if shutil.which(c) is None]
    if missing:
        return f"Slurm packages absent (no {', '.join(missing)}): {SLURM_INSTALL}"
    try:
        pwd.getpwnam("munge")
    except KeyError:
        return f"no munge user: {SLURM_INSTALL}"
    return None


def namespaces_unavailable() -> Optional[str]:
    """Why two network-namespace hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    missing = [c for c in NAMESPACE_COMMANDS if shutil.which(c) is None]
    if missing:
        return f"no {', '.join(missing)} (apt-get install iproute2 util-linux mount)"
    # A container may forbid them even to root: try one.
    probe = f"mingpt-probe-{uuid.uuid4().hex[:8]}"
    result = _run(["ip", "netns", "add", probe], check=False)
    if result.returncode != 0:
        return f"cannot create a network namespace here: {result.stderr.strip()}"
    _run(["ip", "netns", "del", probe], check=False)
    return None


def wait_for(check: Callable[[], T], timeout: float, what: str, interval: float = 0.2) -> T:
    """Poll check() until it returns something truthy; fail naming what did not happen."""
    deadline = time.monotonic() + timeout
    while True:
        result = check()
        if result:
            return result
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what}: not within {timeout:.0f} s")
        time.sleep(interval)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(cmd: list, env: Optional[dict] = None, timeout: float = 30, check: bool = True
         ) -> subprocess.CompletedProcess:
    result = subprocess.run([str(c) for c in cmd], env=env, capture_output=True, text=True, timeout=timeout)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} exited {result.returncode}: "
                           f"{result.stdout.strip()} {result.stderr.strip()}")
    return result


def _stop(process: subprocess.Popen, grace: float = 10) -> None:
    """SIGTERM, then SIGKILL if it lingers; only this process, by its PID."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(grace)


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _pids_with_environment(*entries: str) -> list[int]:
    """PIDs (other than this one) whose environment holds every entry, e.g. 'SLURM_CONF=/tmp/x'."""
    wanted = dict(entry.split("=", 1) for entry in entries)
    found = []
    for process in psutil.process_iter():
        with contextlib.suppress(psutil.Error):  # gone meanwhile, or a kernel thread
            environ = process.environ()
            if process.pid != os.getpid() and all(environ.get(k) == v for k, v in wanted.items()):
                found.append(process.pid)
    return found


def _has_environment(pid: int, name: str) -> bool:
    try:
        return name in psutil.Process(pid).environ()
    except psutil.Error:
        return False


class _StartedAndStopped:
    """A context manager over start() and stop(): a half-finished start is stopped too."""

    def start(self):
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()


class SlurmCluster(_StartedAndStopped):
    """munged + slurmctld + one slurmd per node, all on this host, in a private directory."""

    def __init__(self, root: Path, nodes: tuple[str, ...] = ("n1", "n2"), cpus_per_node: int = 2):
        self.root = root
        self.nodes = nodes
        self.cpus_per_node = cpus_per_node
        self.conf = root / "slurm.conf"
        self.daemons: dict[str, subprocess.Popen] = {}
        # munged, running as the munge user, must reach its directory: pytest's are root-only.
        self.munge_dir = Path(tempfile.mkdtemp(prefix="mingpt-munge-"))
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))

    # -- start -----------------------------------------------------------------------------------
    def start(self) -> "SlurmCluster":
        self._start_munge()
        self._write_conf()
        self._daemon("slurmctld", ["slurmctld", "-D", "-i", "-f", self.conf])
        for node in self.nodes:
            self._daemon(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", self.conf])
        wait_for(self._nodes_idle, 60, f"Slurm nodes {', '.join(self.nodes)} idle ({self._logs_hint()})")
        return self

    def _daemon(self, name: str, cmd: list, **popen) -> None:
        with open(self.root / f"{name}.out", "ab") as log:
            self.daemons[name] = subprocess.Popen([str(c) for c in cmd], stdout=log, stderr=subprocess.STDOUT,
                                                  stdin=subprocess.DEVNULL, env=self.env, **popen)

    def _start_munge(self) -> None:
        munge = pwd.getpwnam("munge")
        os.chmod(self.munge_dir, 0o755)
        os.chown(self.munge_dir, munge.pw_uid, munge.pw_gid)
        key = self.munge_dir / "munge.key"
        as_munge = {"user": munge.pw_uid, "group": munge.pw_gid, "extra_groups": []}
        subprocess.run(["mungekey", "--create", f"--keyfile={key}"], check=True, capture_output=True,
                       **as_munge)
        self.munge_socket = self.munge_dir / "munge.socket"
        d = self.munge_dir
        self._daemon("munged", ["munged", "--foreground", f"--socket={self.munge_socket}",
                                f"--key-file={key}", f"--log-file={d / 'munged.log'}",
                                f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}"],
                     **as_munge)
        wait_for(self.munge_socket.exists, 15, f"munged socket ({self._logs_hint()})", interval=0.05)

    def _write_conf(self) -> None:
        r = self.root
        for sub in ("state", "spool"):
            (r / sub).mkdir()
        node_lines = "\n".join(
            f"NodeName={node} NodeHostname=localhost NodeAddr=127.0.0.1 Port={free_port()} "
            f"CPUs={self.cpus_per_node} RealMemory=1000 State=UNKNOWN" for node in self.nodes)
        self.conf.write_text(f"""\
ClusterName=mingpt-test
SlurmctldHost=localhost
SlurmctldPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# Refuse at submission what these nodes cannot run, instead of leaving it PENDING forever.
EnforcePartLimits=ALL
# Finished jobs stay visible to scontrol (there is no accounting database to ask).
MinJobAge=600
KillWait=5
StateSaveLocation={r / 'state'}
SlurmdSpoolDir={r / 'spool'}/%n
SlurmctldPidFile={r / 'slurmctld.pid'}
SlurmdPidFile={r / 'slurmd-%n.pid'}
SlurmctldLogFile={r / 'slurmctld.log'}
SlurmdLogFile={r / 'slurmd-%n.log'}
{node_lines}
PartitionName=debug Nodes={','.join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        for node in self.nodes:
            (r / "spool" / node).mkdir()

    def _nodes_idle(self) -> bool:
        for name, daemon in self.daemons.items():
            if daemon.poll() is not None:
                raise RuntimeError(f"{name} exited with status {daemon.returncode} ({self._logs_hint()})")
        result = _run(["sinfo", "--noheader", "--Node", "--format=%N %t"], env=self.env, check=False)
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return result.returncode == 0 and all(states.get(node) == "idle" for node in self.nodes)

    def _logs_hint(self) -> str:
        return f"logs in {self.root} and {self.munge_dir}"

    # -- use -------------------------------------------------------------------------------------
    def sbatch(self, args: list, cwd: Path, env: Optional[dict] = None) -> str:
        """Submit; return the job id."""
        result = subprocess.run(["sbatch", "--parsable", *map(str, args)], cwd=cwd,
                                env={**self.env, **(env or {})}, capture_output=True, text=True, timeout=30)
        assert result.returncode == 0, f"sbatch failed: {result.stdout}{result.stderr}"
        return result.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """scontrol's fields of a job (JobState, NodeList, ExitCode, ...)."""
        out = _run(["scontrol", "--oneliner", "show", "job", job_id], env=self.env).stdout
        return dict(re.findall(r"(\w+)=(\S*)", out))

    def wait_job(self, job_id: str, timeout: float) -> dict[str, str]:
        """Poll until the job reaches a final state (faster than sbatch --wait); return its fields."""
        return wait_for(lambda: (job := self.job(job_id))["JobState"] in TERMINAL_JOB_STATES and job,
                        timeout, f"Slurm job {job_id} to finish ({self._logs_hint()})", interval=0.5)

    def command(self, *args: str) -> str:
        """Run a Slurm command (scancel, scontrol, ...) against this cluster; its output."""
        return _run(list(args), env=self.env).stdout

    def steps_running(self, job_id: str) -> bool:
        """Whether any slurmstepd of the job (its batch script or a step) is still on a node."""
        marker = f"slurmstepd: [{job_id}."
        # slurmstepd writes that title over its arguments; psutil splits it at its spaces
        return any(" ".join(process.info["cmdline"] or []).startswith(marker)
                   for process in psutil.process_iter(["cmdline"]))

    def training_processes(self, job_id: str, node: str) -> list[int]:
        """PIDs of a job's torchrun workers on a node (workers have RANK set; their agent has not)."""
        return [pid for pid in _pids_with_environment(f"SLURM_CONF={self.conf}", f"SLURM_JOB_ID={job_id}",
                                                      f"SLURMD_NODENAME={node}")
                if _has_environment(pid, "RANK")]

    # -- stop ------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Cancel jobs, stop the daemons, kill any process of ours they left, remove munge's directory."""
        try:
            if self.daemons.get("slurmctld") and self.daemons["slurmctld"].poll() is None:
                _run(["scancel", "--full", "--partition=debug"], env=self.env, check=False)
                try:
                    # An error from squeue reads as "no jobs": stopping must go on regardless.
                    wait_for(lambda: not _run(["squeue", "--noheader"], env=self.env, check=False)
                             .stdout.strip(), 30, "cancelled jobs to end")
                except TimeoutError:
                    pass  # the daemons go anyway; their leftovers are killed below
        finally:
            for name in reversed(list(self.daemons)):  # slurmds, then slurmctld, then munged
                _stop(self.daemons[name])
            # Job steps (slurmstepd and what it ran) outlive slurmd; every one carries our SLURM_CONF.
            for pid in _pids_with_environment(f"SLURM_CONF={self.conf}"):
                _kill(pid)
            shutil.rmtree(self.munge_dir, ignore_errors=True)


class TwoHosts(_StartedAndStopped):
    """node1 and node2: network namespaces on a private veth link, with their own names."""

    NAMES = ("node1", "node2")
    ADDRESSES = ("10.200.0.1", "10.200.0.2")

    def __init__(self, root: Path):
        self.root = root
        tag = uuid.uuid4().hex[:8]  # unique, so that concurrent test runs do not meet
        self.netns = [f"mingpt-{tag}-{i}" for i in (1, 2)]
        self.created: list[str] = []
        self.processes: list[subprocess.Popen] = []
        self.hosts_file = root / "hosts"

    def start(self) -> "TwoHosts":
        for ns in self.netns:
            _run(["ip", "netns", "add", ns])
            self.created.append(ns)
        # Created straight inside the namespaces: no interface name in this host's namespace to clash.
        _run(["ip", "link", "add", "veth0", "netns", self.netns[0], "type", "veth",
              "peer", "name", "veth0", "netns", self.netns[1]])
        for ns, address in zip(self.netns, self.ADDRESSES):
            for cmd in (["addr", "add", f"{address}/24", "dev", "veth0"], ["link", "set", "veth0", "up"],
                        ["link", "set", "lo", "up"]):
                _run(["ip", "-netns", ns, *cmd])
        # Each host resolves both names to their veth addresses (torchrun's workers meet at the
        # hostname of the rank-0 agent).
        self.hosts_file.write_text("127.0.0.1 localhost\n" + "".join(
            f"{address} {name}\n" for name, address in zip(self.NAMES, self.ADDRESSES)))
        return self

    def popen(self, host: int, cmd: list, log: Path, env: dict) -> subprocess.Popen:
        """Start cmd on host 0 or 1, output to log.

        A private mount and UTS namespace per process gives it the host's /etc/hosts and hostname
        (`ip netns exec` would remount /sys, which is not needed here).
        """
        ns, name = self.netns[host], self.NAMES[host]
        become_host = 'mount --bind "$0" /etc/hosts && hostname "$1" && shift && exec "$@"'
        wrapper = ["unshare", "--mount", "--uts", "--propagation", "private",
                   "nsenter", f"--net=/run/netns/{ns}", "bash", "-c", become_host, self.hosts_file, name]
        with open(log, "ab") as out:
            process = subprocess.Popen([str(c) for c in wrapper + cmd], stdout=out, stderr=subprocess.STDOUT,
                                       stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        self.processes.append(process)
        return process

    def remove_host(self, host: int) -> None:
        """The host goes away at once: SIGKILL to every process in its namespace (torchrun's
        workers run in sessions of their own, so a process group would miss them)."""
        for pid in _run(["ip", "netns", "pids", self.netns[host]], check=False).stdout.split():
            _kill(int(pid))

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)  # its own session: the agent and its workers
                process.wait(10)
        for ns in self.created:
            # Anything still inside (a worker that left its session) goes before the namespace.
            pids = _run(["ip", "netns", "pids", ns], check=False).stdout.split()
            for pid in pids:
                _kill(int(pid))
            _run(["ip", "netns", "del", ns], check=False)
