"""The fault-tolerant mode's parts in-process (distributed/fault_tolerance.py): its settings and
refusals, the data slots, the missed samples, the optimizer that commits, the gradient average across
replica groups, the run's one voice, a lighthouse that goes away. Real replica groups on loopback:
tests/end_to_end/test_fault_tolerant_runs.py."""
import dataclasses
import os
import signal
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from mingpt.common.errors import ConfigError, MinGPTError
from mingpt.distributed import fault_tolerance
from mingpt.distributed.fault_tolerance import (
    GradientAverage,
    Replicas,
    FaultToleranceConfig,
    average_gradients,
    plain,
)
from mingpt.reporting.metrics import replica_group_metrics_path
from mingpt.run_config import TrainConfig
from mingpt.trainer import TrainerConfig


def on(**keys) -> FaultToleranceConfig:
    return FaultToleranceConfig(enabled=True, lighthouse="http://127.0.0.1:1", **keys)


@pytest.mark.parametrize("keys, line", [
    (dict(replica_group=2, replica_groups=2), "fault_tolerance_config.replica_group: must be 0 to 1 "
                                              "(replica_groups=2), got 2"),
    (dict(replica_groups=2, min_replica_groups=3), "fault_tolerance_config.min_replica_groups: must be 1 to "
                                                   "replica_groups=2, got 3"),
    (dict(timeout_s=0), "fault_tolerance_config.timeout_s: must be positive, got 0"),
])
def test_settings_refused_in_one_line(keys, line):
    with pytest.raises(ConfigError) as refused:
        on(**keys)
    assert str(refused.value).startswith(line) and "\n" not in str(refused.value)


def test_the_run_config_checks_them_and_leaves_them_off_by_default():
    assert not TrainConfig().fault_tolerance_config.enabled
    with pytest.raises(ConfigError, match="^trainer_config.distributed_method: fsdp shards every parameter"):
        TrainConfig(trainer_config=TrainerConfig(distributed_method="fsdp"), fault_tolerance_config=on())
    FaultToleranceConfig(replica_group=5)  # off: the other keys are not judged


def test_without_torchft_the_mode_names_the_extra(monkeypatch):
    monkeypatch.setattr(fault_tolerance, "torchft_installed", lambda: False)
    with pytest.raises(ConfigError) as refused:
        FaultToleranceConfig(enabled=True)
    assert str(refused.value) == ("fault_tolerance_config.enabled: needs torchft, which is not installed: "
                                  "pip install -e '.[ft]' (torchft)")


def test_without_a_lighthouse_address_the_mode_says_where_to_get_one(monkeypatch):
    monkeypatch.delenv(fault_tolerance.LIGHTHOUSE_ENV, raising=False)
    with pytest.raises(ConfigError, match=r"^fault_tolerance_config.lighthouse: needs the lighthouse's address .*"
                                          r"python launch.py --replica-groups N$"):
        FaultToleranceConfig(enabled=True).lighthouse_address()
    monkeypatch.setenv(fault_tolerance.LIGHTHOUSE_ENV, "node1:29510")
    assert FaultToleranceConfig(enabled=True).lighthouse_address() == "http://node1:29510"


def env_of(rank: int, world_size: int) -> SimpleNamespace:
    return SimpleNamespace(rank=rank, world_size=world_size, local_rank=rank, device=torch.device("cpu"))


def replicas_of(group: int, groups: int, rank: int = 0, ranks: int = 1, members=None) -> Replicas:
    """A Replicas as a group of a run sees it, its Manager left out."""
    from mingpt.distributed.process_group import DistEnv

    env = DistEnv(rank, rank, ranks, ranks, torch.device("cpu"), "gloo")
    replicas = Replicas(on(replica_group=group, replica_groups=groups), env)
    replicas.manager = object()
    replicas.members = tuple(members if members is not None else range(groups))
    return replicas


def test_each_rank_reads_its_groups_slot_of_the_global_order():
    """Rank r of group g of G groups of R ranks is slot g x R + r of G x R: the order is dealt as to a
    whole run whoever is there."""
    slots = {(g, r): replicas_of(g, 3, r, 2).data_env for g in range(3) for r in range(2)}
    assert {(env.rank, env.world_size) for env in slots.values()} == {(s, 6) for s in range(6)}
    assert slots[(2, 1)].rank == 5
    alone = Replicas(FaultToleranceConfig(), replicas_of(0, 1).env)
    assert alone.data_env is alone.env and alone.comm_hook is None and alone.writes_snapshots()


def test_missed_samples_are_a_missing_groups_share_or_a_whole_step_not_committed():
    replicas = replicas_of(1, 3, ranks=2, members=(1,))  # groups 0 and 2 away
    assert replicas.step_taken(samples_per_slot=32) == 2 * 2 * 32
    replicas.members = (0, 1, 2)
    assert replicas.step_taken(32) == 0
    replicas.committed = False
    assert replicas.step_taken(32) == 3 * 2 * 32
    assert Replicas(FaultToleranceConfig(), replicas.env).step_taken(32) == 0


def test_the_lowest_group_of_the_quorum_writes_the_snapshots():
    assert replicas_of(0, 2).writes_snapshots() and not replicas_of(1, 2).writes_snapshots()
    assert replicas_of(1, 2, members=(1,)).writes_snapshots()  # group 0 is lost: group 1 writes


def test_each_group_keeps_its_own_metrics_file():
    assert replica_group_metrics_path("gpt_snapshot.metrics.jsonl", 1) == "gpt_snapshot.metrics.replica1.jsonl"
    assert replica_group_metrics_path("s3://b/run/metrics.jsonl", 2) == "s3://b/run/metrics.replica2.jsonl"
    second = on(replica_groups=2, replica_group=1)
    assert TrainerConfig().report_settings(second).metrics_path == "gpt_snapshot.metrics.replica1.jsonl"
    assert not TrainerConfig().snapshot_policy(second).leased  # group 0 holds the lease: the groups are one run
    assert TrainerConfig().report_settings(on(replica_groups=2)).metrics_path == "gpt_snapshot.metrics.jsonl"


class Quorum:
    """What CommittingOptimizer asks of Replicas: a step's quorum, then its commit (its Manager is
    torchft's wrapper's, which the committing optimizer does not ask)."""

    manager = None

    def __init__(self, commits: bool = True):
        self.commits, self.calls = commits, []

    def start_step(self):
        self.calls.append("quorum")

    def commit(self):
        self.calls.append("commit")
        return self.commits


@pytest.mark.parametrize("commits", [True, False])
def test_the_optimizer_steps_only_a_committed_update(commits):
    model = nn.Linear(4, 2)
    inner = torch.optim.AdamW(model.parameters(), lr=0.1)
    quorum = Quorum(commits)
    optimizer = fault_tolerance.committing_optimizer(inner, quorum)
    before = model.weight.detach().clone()
    optimizer.zero_grad(set_to_none=True)
    model(torch.ones(3, 4)).sum().backward()
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    assert quorum.calls == ["quorum", "commit"]
    assert torch.equal(model.weight, before) != commits
    assert plain(optimizer) is inner and plain(inner) is inner
    assert optimizer.param_groups is inner.param_groups and optimizer.state_dict() == inner.state_dict()
    import torchft

    assert isinstance(optimizer, torchft.Optimizer)  # torchft's own wrapper, subclassed


def test_an_overflowing_fp16_step_is_skipped_by_a_fused_optimizer_as_without_the_mode():
    """GradScaler hands a fused optimizer the overflow it found as attributes of the optimizer it is
    given, which the fused step reads: through a wrapper that keeps them (torchft's, and this module's
    own before it subclassed torchft's) the update went through, and the weights became NaN. A CPU
    GradScaler and fused AdamW stand for CUDA's."""
    results = {}
    for mode in ("plain", "committing"):
        torch.manual_seed(0)
        model = nn.Linear(4, 2)
        inner = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        optimizer = fault_tolerance.committing_optimizer(inner, Quorum()) if mode == "committing" else inner
        scaler = torch.amp.GradScaler("cpu", init_scale=16.0)
        before = model.weight.detach().clone()
        optimizer.zero_grad()
        scaler.scale(model(torch.ones(3, 4)).sum() * float("inf")).backward()
        scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        results[mode] = (torch.equal(model.weight, before), scaler.get_scale())
        assert not hasattr(inner, "found_inf") and not hasattr(inner, "grad_scale")  # GradScaler's, gone
    assert results["committing"] == results["plain"] == (True, 8.0)


class HalvingManager:
    """torchft's Manager as the gradient average sees it, across 2 groups whose other group's gradients
    are all zero: the all-reduce halves every value. errors: the all-reduce fails."""

    def __init__(self, errors: bool = False):
        self.errors, self.reduced = errors, []

    def allreduce(self, tensor):
        self.reduced.append(tensor.numel())
        tensor.div_(2)
        return SimpleNamespace(wait=lambda: None)

    def errored(self):
        return RuntimeError("lost") if self.errors else None


class Blocks(nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x):
        return self.head(torch.relu(self.second(torch.relu(self.first(x)))))


@pytest.mark.parametrize("errors", [False, False, True])
def test_gradients_are_averaged_across_groups_once_per_step_in_parameter_order(world_of_one, errors):
    """One all-reduce of every gradient per step, over several of DDP's buckets (a 1-byte cap: one
    parameter each) and across DDP's rebuild after the first step; a failed one leaves zeros."""
    torch.manual_seed(0)
    model, reference = Blocks(), Blocks()
    reference.load_state_dict(model.state_dict())
    replicas = replicas_of(0, 2)
    replicas.env = world_of_one
    replicas.manager = HalvingManager(errors)
    ddp = DDP(model, bucket_cap_mb=1e-6)
    ddp.register_comm_hook(GradientAverage(replicas, ddp.module), average_gradients)
    parameters = sum(p.numel() for p in model.parameters())
    for step in range(3):
        x = torch.randn(5, 8)
        ddp.zero_grad()
        reference.zero_grad()
        ddp(x).square().sum().backward()
        reference(x).square().sum().backward()
        for param, expected in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(param.grad, torch.zeros_like(param) if errors else expected.grad / 2)
    assert replicas.manager.reduced == [parameters] * 3


def test_launch_refuses_more_groups_needed_than_started(capsys):
    from mingpt import launch

    with pytest.raises(SystemExit) as stop:
        launch.main(["--replica-groups", "2", "--min-replica-groups", "3"])
    assert stop.value.code == 1
    assert capsys.readouterr().err == ("error: --replica-groups must be at least 1, and --min-replica-groups 1 to "
                                       "--replica-groups (see --help)\n")


def test_launch_gives_each_group_its_own_gpus(monkeypatch):
    from mingpt import launch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert launch.group_devices(2) == [["0", "1"], ["2", "3"]]
    with pytest.raises(Exception, match="each group needs a GPU of its own"):
        launch.group_devices(5)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert launch.group_devices(2) == []


def test_under_hsdp_a_group_on_one_machine_shards_over_it_all():
    alone = replicas_of(0, 2)
    assert alone.method_within_group("hsdp") == "fsdp" and alone.method_within_group("ddp") == "ddp"
    two_machines = replicas_of(0, 2, rank=0, ranks=4)
    two_machines.env = dataclasses.replace(two_machines.env, local_world_size=2)
    assert two_machines.method_within_group("hsdp") == "hsdp"
    off = Replicas(FaultToleranceConfig(), two_machines.env)
    assert off.method_within_group("hsdp") == "hsdp"  # without the mode, hsdp is the usual one


def hsdp_gpt(world_of_one, seed: int):
    """A small GPT as a group of one machine holds it under hsdp (each parameter a DTensor shard: a
    world of one here), with its reference copy."""
    from mingpt.distributed.parallel import Parallelism
    from mingpt.distributed.precision import Precision
    from mingpt.model import GPT, GPTConfig

    torch.manual_seed(seed)
    config = GPTConfig(n_layer=2, n_head=1, n_embd=8, vocab_size=5, block_size=4, embd_pdrop=0.0, resid_pdrop=0.0,
                       attn_pdrop=0.0)
    model, reference = GPT(config), GPT(config)
    reference.load_state_dict(model.state_dict())
    return model, reference, Parallelism("fsdp", cpu_collectives=True), Precision("cpu", None)


@pytest.mark.parametrize("errors", [False, True])
def test_under_hsdp_each_gradient_shard_is_averaged_across_groups(world_of_one, errors):
    """FSDP's all-reduce hook: every shard of every unit goes through the Manager's all-reduce in the
    backward pass (here across 2 groups whose other is all zeros: halved); a failed one leaves zeros."""
    from mingpt.distributed.parallel import parallelize

    model, reference, method, precision = hsdp_gpt(world_of_one, seed=0)
    replicas = replicas_of(0, 2)
    replicas.env = world_of_one
    replicas.manager = HalvingManager(errors)
    model = parallelize(model, method, precision, world_of_one, comm_hook=replicas.comm_hook)
    x = torch.randint(0, 5, (3, 4))
    model(x, x)[1].backward()
    reference(x, x)[1].backward()
    assert len(replicas.manager.reduced) == 3  # one reduce per FSDP unit: the 2 blocks and the root
    for (name, param), expected in zip(model.named_parameters(), reference.parameters()):
        want = torch.zeros_like(expected) if errors else expected.grad / 2
        torch.testing.assert_close(param.grad.to_local(), want, msg=lambda text: f"{name}: {text}")


def test_under_hsdp_a_joining_group_heals_its_shards_and_optimizer_state(world_of_one):
    """What a live group sends (each DTensor as its local shard) loads into a fresh sharded model and
    an optimizer that has not stepped yet: the same weights, the same AdamW moments."""
    from mingpt.distributed.parallel import parallelize

    live, _, method, precision = hsdp_gpt(world_of_one, seed=0)
    fresh, _, _, _ = hsdp_gpt(world_of_one, seed=1)
    live, fresh = (parallelize(model, method, precision, world_of_one) for model in (live, fresh))
    live_optimizer, fresh_optimizer = (torch.optim.AdamW(model.parameters(), lr=0.1) for model in (live, fresh))
    x = torch.randint(0, 5, (3, 4))
    live(x, x)[1].backward()
    live_optimizer.step()
    sent = {"model": fault_tolerance.local_shards(live.state_dict()),
            "optimizer": fault_tolerance.local_shards(live_optimizer.state_dict())}
    assert not any(hasattr(value, "device_mesh") for value in sent["model"].values())
    fresh.load_state_dict(fault_tolerance.as_sharded(sent["model"], fresh.state_dict()))
    fresh_optimizer.load_state_dict(fault_tolerance.optimizer_state_sharded(sent["optimizer"], fresh_optimizer))
    for (name, mine), theirs in zip(fresh.named_parameters(), live.parameters()):
        assert torch.equal(mine.to_local(), theirs.to_local()), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(fresh_optimizer.state[mine][key].to_local(), live_optimizer.state[theirs][key].to_local())
    fresh(x, x)[1].backward()
    fresh_optimizer.step()  # the healed state is usable as it is


# -- one voice, and a lighthouse that goes away -------------------------------------------------------

@pytest.fixture
def voice(monkeypatch):
    """The project's logger as a rank 0's (INFO), given back as it was."""
    from mingpt.common.logger import configure_logging, log

    monkeypatch.delenv(fault_tolerance.RESTART_ENV, raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    configure_logging(rank=0)
    yield log
    configure_logging(rank=0)


def test_one_group_speaks_for_the_run_the_lowest_of_the_quorum(voice, capsys):
    """Group 0 speaks from the start; group 1 says only what concerns it alone, until it is the lowest
    group of the quorum (group 0 lost) and until group 0 is back. A membership change is said by the
    voice before it and the one after it."""
    first, second = replicas_of(0, 2), replicas_of(1, 2)
    assert fault_tolerance.speaks_at_start(first.settings) and not fault_tolerance.speaks_at_start(second.settings)
    fault_tolerance.speak(False, second.env)
    voice.info("the run's line")
    second._say("Healed from replica group 0 at step 7", always=True)
    assert capsys.readouterr().out == "Healed from replica group 0 at step 7\n"
    second._first_quorum = False
    second.members = (1,)  # group 0 lost: group 1 is the voice
    fault_tolerance.speak(second.speaks, second.env)
    second._say_membership(before=(0, 1))
    voice.info("[RANK0] Epoch 1 | Iter 40 | Train Loss 3.1")
    said = capsys.readouterr().out
    assert said.startswith("Replica group(s) 0 left at step 1: going on with 1 (1 of 2)") and "Iter 40" in said
    second.members = (0, 1)  # group 0 back: it speaks again, group 1 says it joined, then is quiet
    fault_tolerance.speak(second.speaks, second.env)
    second._say_membership(before=(1,))
    voice.info("the run's line")
    assert capsys.readouterr().out.startswith("Replica group(s) 0 joined at step 1, healed from a live group")


def test_a_group_started_again_is_quiet_until_its_first_quorum(voice, monkeypatch):
    """Its start-up (the snapshot it found, or "Training model from scratch") is not said before it heals."""
    monkeypatch.setenv(fault_tolerance.RESTART_ENV, "1")
    first = replicas_of(0, 2).settings
    assert not fault_tolerance.speaks_at_start(first)
    monkeypatch.delenv(fault_tolerance.RESTART_ENV)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")  # torchrun's restart (sbatch_run.sh's groups)
    assert not fault_tolerance.speaks_at_start(first)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    assert fault_tolerance.speaks_at_start(first)


def closed_port() -> str:
    """A loopback address where nothing listens: connections are refused, as at a lighthouse that died."""
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_a_quorum_wait_ends_within_a_second_when_the_lighthouse_is_gone_not_after_the_quorum_timeout():
    """torchft's wait for a quorum whose lighthouse died lasts fault_tolerance_config.quorum_timeout_s (a request in flight
    is never answered); the watched wait gives the lighthouse up once its port refuses twice."""
    import concurrent.futures
    import socket
    import threading

    replicas = replicas_of(0, 2)
    replicas.lighthouse = closed_port()
    ended = []

    def wait() -> None:
        try:
            replicas.wait_for_quorum(concurrent.futures.Future())  # a request never answered
        except fault_tolerance.LighthouseGone as gone:
            ended.append(gone.how)

    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    waiting.join(timeout=3 * replicas.WATCH_S * replicas.REFUSALS)
    assert ended == ["its port refuses connections"]
    # A lighthouse that answers: the wait lasts as long as the quorum does, and gives its result.
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        replicas.lighthouse = f"http://127.0.0.1:{listening.getsockname()[1]}"
        quorum = concurrent.futures.Future()
        threading.Timer(3 * replicas.WATCH_S, quorum.set_result, args=(None,)).start()
        replicas.wait_for_quorum(quorum)
        assert quorum.done()
    failed = concurrent.futures.Future()
    failed.set_exception(TimeoutError("no quorum"))
    with pytest.raises(TimeoutError, match="no quorum"):
        replicas.wait_for_quorum(failed)  # torchft's own error, said by _no_quorum


class LostManager:
    """A Manager whose quorum finds the lighthouse gone."""

    def __init__(self):
        self.errors, self.commits_asked = [], 0

    def start_quorum(self):
        raise fault_tolerance.LighthouseGone("refused")

    def report_error(self, error):
        self.errors.append(error)

    def should_commit(self):
        self.commits_asked += 1
        return True


def test_a_group_whose_lighthouse_is_gone_stops_with_a_snapshot_as_on_a_stop_signal(voice, capsys, monkeypatch):
    """The step under way is not committed (no quorum to agree with, its collectives skipped) and the
    process asks itself to stop through its stop signal's own handler, which takes a snapshot: a
    lighthouse's loss costs no training. No further quorum is asked for (torchft would wait on the one in
    flight): a run that did not stop ends in one line."""
    signalled = []
    monkeypatch.setattr(fault_tolerance, "handled_stop_signal", lambda: signal.SIGTERM)
    monkeypatch.setattr(fault_tolerance.os, "kill", lambda pid, number: signalled.append((pid, number)))
    replicas = replicas_of(0, 2)
    replicas.lighthouse = "http://127.0.0.1:29510"
    replicas.manager = LostManager()
    replicas._first_quorum = False
    replicas._quorum()
    assert signalled == [(os.getpid(), signal.SIGTERM)]
    assert len(replicas.manager.errors) == 1  # torchft's all-reduce skips an errored step
    assert not replicas.commit() and replicas.manager.commits_asked == 0
    assert replicas.step_taken(samples_per_slot=4) == 2 * 4  # the whole step missed
    said = capsys.readouterr().out
    assert said.startswith("The lighthouse at http://127.0.0.1:29510 is gone (its port refuses connections, step 1): "
                           "no quorum forms without it, so every replica group stops with a snapshot (as on SIGTERM)")
    with pytest.raises(MinGPTError, match=r"^cannot reach the lighthouse at http://127.0.0.1:29510 \(step 1\)"):
        replicas._quorum()


def test_without_a_stop_signal_to_take_a_gone_lighthouse_ends_the_group_in_one_line(monkeypatch):
    monkeypatch.setattr(fault_tolerance, "handled_stop_signal", lambda: None)  # trainer_config.stop_signals=[]
    replicas = replicas_of(1, 2)
    replicas.lighthouse = "http://node1:29510"
    replicas.manager = LostManager()
    with pytest.raises(MinGPTError, match=r"^cannot reach the lighthouse at http://node1:29510 \(step 1\); start it "
                                          r"again .* they resume from the newest snapshot \(LighthouseGone\)$"):
        replicas._quorum()


def test_a_stop_signal_is_one_the_training_handles(monkeypatch):
    handlers = {signal.SIGTERM: signal.SIG_DFL, signal.SIGUSR1: lambda *args: None, signal.SIGHUP: signal.SIG_IGN}
    monkeypatch.setattr(fault_tolerance.signal, "getsignal", lambda number: handlers[number])
    assert fault_tolerance.handled_stop_signal() == signal.SIGUSR1
    handlers[signal.SIGUSR1] = signal.SIG_DFL
    assert fault_tolerance.handled_stop_signal() is None


def test_the_lighthouse_answers_refuses_or_is_silent(monkeypatch):
    import socket

    assert fault_tolerance.lighthouse_answer(closed_port()) == "refused"
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        assert fault_tolerance.lighthouse_answer(f"http://127.0.0.1:{listening.getsockname()[1]}") == "up"

    def no_answer(address, timeout):
        raise TimeoutError("timed out")  # a machine gone: the connection never comes

    monkeypatch.setattr(fault_tolerance.socket, "create_connection", no_answer)
    assert fault_tolerance.lighthouse_answer("http://node1:29510") == "silent"


def test_a_group_whose_lighthouse_does_not_answer_at_its_start_says_so_within_ft_timeout_s():
    import time

    replicas = Replicas(on(timeout_s=1.0), replicas_of(0, 2).env)
    replicas.lighthouse = closed_port()
    started = time.monotonic()
    with pytest.raises(MinGPTError, match=rf"^cannot reach the lighthouse at {replicas.lighthouse} \(start\); "):
        replicas._await_lighthouse()
    assert 1.0 <= time.monotonic() - started < 1.0 + 2 * replicas.WATCH_S + 1


# -- torchft's internals, against the installed torchft -----------------------------------------------

@pytest.fixture
def group_one_of_two(voice, monkeypatch):
    """Replica group 1 of 2 (one rank) as Replicas.open makes it: a real Manager of the installed
    torchft, joined to a lighthouse in this process (quick to start: the tests of a lost lighthouse,
    which must be killed, start one of their own)."""
    monkeypatch.setenv("RUST_LOG", "error")  # torchft's Rust core reads it when torchft is first imported
    from torchft.coordination import LighthouseServer

    from mingpt.distributed.process_group import DistEnv

    lighthouse = LighthouseServer(bind="127.0.0.1:0", min_replicas=1)
    env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
    settings = FaultToleranceConfig(enabled=True, lighthouse=lighthouse.address(), replica_group=1,
                                    replica_groups=2, timeout_s=30, quorum_timeout_s=30)
    replicas = Replicas.open(settings, env)
    yield replicas
    replicas.manager.shutdown(wait=False)
    lighthouse.shutdown()


def test_the_installed_torchft_has_what_the_mode_reaches_into(group_one_of_two, capfd, monkeypatch):
    """Each coupling to torchft's internals, as a quorum and a healing request use it: the Manager waits
    for its quorum through the watched wait, on its own future; configure's global ranks name the
    groups of the quorum (here group 1, alone); the checkpoint server answers without an access line.
    The start-up check found nothing to say."""
    import http.client
    import urllib.parse

    replicas = group_one_of_two
    assert all(fault_tolerance._holds(coupling, replicas.manager) for coupling in fault_tolerance.COUPLINGS)
    waited = []
    watch = replicas.wait_for_quorum
    monkeypatch.setattr(replicas, "wait_for_quorum", lambda quorum: (waited.append(quorum), watch(quorum)))
    replicas._quorum(say=False)
    assert waited and waited[0] is replicas.manager._quorum_future, "torchft waits elsewhere than wait_quorum"
    assert replicas.process_group.members == (1,), "configure's global ranks did not name the quorum's groups"
    server = urllib.parse.urlparse(replicas.manager._checkpoint_transport.metadata())
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    connection.request("POST", "/checkpoint/0/full")  # http.server answers 501, and would log the request
    assert connection.getresponse().status == 501
    connection.close()
    said = capfd.readouterr()
    assert "POST" not in said.err, "the checkpoint server's access lines are not quieted"
    assert "is not torchft" not in said.out  # no coupling warned of


def configure_without_global_ranks(self, store_addr, replica_id, rank, world_size, quorum_id=None):
    """configure as an older torchft took it."""


@pytest.mark.parametrize("breaks, named", [
    (lambda manager, patch: patch.delattr(manager, "_quorum_future"), "Manager._quorum_future"),
    (lambda manager, patch: patch.setattr("torchft.process_group.ProcessGroupGloo.configure",
                                          configure_without_global_ranks), "configure's parameters"),
    (lambda manager, patch: patch.delattr("torchft.manager.MANAGER_ADDR_KEY"), "MANAGER_ADDR_KEY"),
])
def test_a_torchft_that_moved_what_the_mode_needs_is_refused_in_one_line(group_one_of_two, monkeypatch,
                                                                         breaks, named):
    """An upgrade that renames an internal the mode reaches into (an attribute, a constant, a method's
    parameters) is refused at the group's start, naming the torchft the mode needs, before a quorum
    would use it; its Manager is shut down."""
    manager = group_one_of_two.manager
    breaks(manager, monkeypatch)
    monkeypatch.setattr(fault_tolerance.importlib.metadata, "version", lambda name: "0.3.0")
    stopped = []
    monkeypatch.setattr(manager, "shutdown", lambda wait=True: stopped.append(wait))
    with pytest.raises(ConfigError) as refused:
        fault_tolerance.check_torchft(manager)
    line = str(refused.value)
    assert line.startswith("fault_tolerance_config.enabled: needs torchft 0.2.0, and torchft 0.3.0 is "
                           "installed, whose ") and "\n" not in line, line
    assert named in line and line.endswith("changed: pip install torchft==0.2.0 (the ft extra pins it)"), line
    assert stopped == [False]


def test_a_torchft_that_only_moved_the_checkpoint_servers_handler_is_warned_of(group_one_of_two, monkeypatch,
                                                                               capsys):
    """The access lines' quiet is the one coupling the mode runs without: a warning, then training."""
    manager = group_one_of_two.manager
    monkeypatch.setattr(fault_tolerance, "_checkpoint_handler", lambda manager: object())
    monkeypatch.setattr(fault_tolerance.importlib.metadata, "version", lambda name: "0.3.0")
    fault_tolerance.check_torchft(manager)
    assert capsys.readouterr().out == (
        "warning: torchft 0.3.0 is not torchft 0.2.0: it lacks Manager._checkpoint_transport._server."
        "RequestHandlerClass.log_message, so the run goes on without a healing group's transfers said in one "
        "line, without http.server's access lines\n")


def test_a_torchft_whose_manager_takes_other_arguments_is_refused_not_taken_for_a_lost_lighthouse(voice,
                                                                                                  monkeypatch):
    """The Manager's own arguments are torchft's public API, but a release may rename one: its TypeError
    is refused naming the torchft the mode needs, not said as a lighthouse that cannot be reached."""
    import socket

    from mingpt.distributed.process_group import DistEnv

    class OlderManager:  # takes no connect_timeout
        def __init__(self, *, pg, load_state_dict, state_dict, min_replica_size, use_async_quorum, init_sync,
                     replica_id, timeout, quorum_timeout, store_addr, store_port, rank, world_size,
                     lighthouse_addr, hostname):
            pass

    monkeypatch.setattr(fault_tolerance, "watched_manager", lambda replicas: OlderManager)
    monkeypatch.setattr(fault_tolerance.importlib.metadata, "version", lambda name: "0.3.0")
    with socket.socket() as lighthouse:  # a port that answers, as the lighthouse's does
        lighthouse.bind(("127.0.0.1", 0))
        lighthouse.listen()
        settings = FaultToleranceConfig(enabled=True, lighthouse=f"127.0.0.1:{lighthouse.getsockname()[1]}")
        with pytest.raises(ConfigError) as refused:
            Replicas.open(settings, DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo"))
    line = str(refused.value)
    assert line.startswith("fault_tolerance_config.enabled: needs torchft 0.2.0, and torchft 0.3.0 is installed, "
                           "whose Manager's arguments (") and "connect_timeout" in line, line
    assert line.endswith("changed: pip install torchft==0.2.0 (the ft extra pins it)") and "\n" not in line


def test_the_torchft_named_in_the_refusal_is_the_one_the_ft_extra_pins():
    """The refusal's pip command installs what pyproject.toml's ft extra pins, and the suite runs on it."""
    from helpers import REPO

    assert f'"torchft=={fault_tolerance.TORCHFT_VERSION}"' in (REPO / "pyproject.toml").read_text()
    assert fault_tolerance.torchft_version() == fault_tolerance.TORCHFT_VERSION


@pytest.mark.slow
def test_a_lighthouse_killed_during_a_quorum_is_given_up_at_once_and_its_request_ended(voice, monkeypatch):
    """The two couplings a lost lighthouse goes through, against the installed torchft and a real
    lighthouse, killed: the quorum in flight is given up within seconds (the watched wait; torchft's
    own lasts quorum_timeout_s, a minute here), and the request torchft's quorum thread still waits on
    ends once the group leaves (its connections to the manager server, found through the Manager's
    store, shut down), not a minute later."""
    import concurrent.futures
    import subprocess
    import sys
    import time
    from pathlib import Path

    from helpers import kill_tree

    from mingpt.distributed.process_group import DistEnv

    address = closed_port()
    port = int(address.rsplit(":", 1)[1])
    lighthouse = subprocess.Popen([str(Path(sys.executable).with_name("torchft_lighthouse")), "--bind",
                                   f"127.0.0.1:{port}", "--min_replicas", "1"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "error"})
    try:
        monkeypatch.setattr(fault_tolerance, "handled_stop_signal", lambda: None)  # the line, not a signal
        env = DistEnv(0, 0, 1, 1, torch.device("cpu"), "gloo")
        replicas = Replicas.open(FaultToleranceConfig(enabled=True, lighthouse=address, timeout_s=30,
                                                      quorum_timeout_s=60), env)
        with replicas:  # the first quorum, with the lighthouse there
            kill_tree(lighthouse)
            started = time.monotonic()
            with pytest.raises(MinGPTError, match=rf"^cannot reach the lighthouse at {address} \(step 1\)"):
                replicas._quorum()
            assert time.monotonic() - started < 15, "the quorum was not given up through the watched wait"
            request = replicas.manager._quorum_future
            assert not request.done()  # torchft's thread still waits on the lighthouse that died
        ended = concurrent.futures.wait([request], timeout=15)
        assert ended.done, "the quorum request in flight was not ended when the group left"
    finally:
        kill_tree(lighthouse)
