"""distributed/guard.py: the RunGuard the Trainer holds, in one process: where the step is (each
forward pass of a step its next micro-batch), a stop asked only while training and the signal let go
after it, and a step's divergence verdict reaching the decision a step later. The parts behind it:
test_watchdog.py, test_divergence.py, test_control.py."""
import os
import signal

import torch

from mingpt.distributed.control import Decision, StopRequested
from mingpt.distributed.guard import RunGuard, WatchKeys
from mingpt.distributed.watchdog import Position


def guard_of(env, tmp_path, stop_signals: tuple[str, ...] = ()) -> RunGuard:
    return RunGuard(WatchKeys(hang_timeout_s=60, stop_signals=list(stop_signals)), env, str(tmp_path),
                    kept=lambda: "no snapshot", compiled=False, scaled=False, save_every_minutes=0)


def test_each_forward_pass_of_a_step_is_its_next_micro_batch_and_its_backward_pass_the_same(world_of_one,
                                                                                            tmp_path):
    """Gradient accumulation: two micro-batches in step 7; the watchdog sees a long step move."""
    guard = guard_of(world_of_one, tmp_path)
    seen = []
    for phase in ("data", "forward", "backward", "data", "forward", "backward", "optimizer"):
        guard.at(phase, 7)
        seen.append((phase, guard.watch.position.item))
    assert seen == [("data", 0), ("forward", 0), ("backward", 0),
                    ("data", 0), ("forward", 1), ("backward", 1), ("optimizer", 0)]
    guard.at("forward", 8)
    assert guard.watch.position == Position(8, "forward", 0)  # a new step starts its count again
    guard.at("evaluation", 8, item=12)  # an evaluation's batch, counted by the Trainer
    assert guard.watch.position == Position(8, "evaluation", 12)


def test_a_stop_is_asked_only_while_training_and_its_signal_is_let_go_after(world_of_one, tmp_path):
    before = signal.getsignal(signal.SIGUSR1)
    guard = guard_of(world_of_one, tmp_path, ("SIGUSR1",))
    assert guard.stop_asked() == Decision()  # an evaluation outside training: no agreement to ask
    guard.saved()  # nor a timer to start again
    with guard:
        guard.stop_at_once_when(lambda: False, lambda: "the last snapshot is kept")  # a step under way
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.stop_asked() == Decision(stop_signal=signal.SIGUSR1)
    assert guard.agreement is None and guard.stop_asked() == Decision()
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_signal_stops_at_once_only_while_nothing_would_be_lost(world_of_one, tmp_path):
    with guard_of(world_of_one, tmp_path, ("SIGUSR1",)) as guard:
        guard.stop_at_once_when(lambda: True, lambda: "the last snapshot is kept")  # nothing trained since
        guard.stopping()  # the stop is being carried out: a signal now is only noted
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.stop_asked().stop_signal == signal.SIGUSR1
    with guard_of(world_of_one, tmp_path, ("SIGUSR1",)) as guard:
        guard.stop_at_once_when(lambda: True, lambda: "the last snapshot is kept")
        try:
            os.kill(os.getpid(), signal.SIGUSR1)
        except StopRequested:
            pass
        else:
            raise AssertionError("a stop that loses nothing did not stop at once")


def test_a_collective_failed_by_a_peer_that_stopped_at_once_is_this_ranks_stop_too(world_of_one, tmp_path):
    """Both ranks signalled: the peer had nothing under way and left at once; this rank, a step under
    way, meets its next collective failing. The stop explains it, and only a peer's failure, only after
    a signal (CI: launch.py said every worker stopped cleanly, but rank 0 never said its stop line)."""
    lost_peer = RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")
    with guard_of(world_of_one, tmp_path, ("SIGUSR1",)) as guard:
        guard.stop_at_once_when(lambda: False, lambda: "the last snapshot is kept")  # a step under way
        assert guard.stop_signal_of(lost_peer) == 0  # no signal yet: the peer's failure is the run's
        os.kill(os.getpid(), signal.SIGUSR1)
        assert guard.stop_signal_of(lost_peer) == signal.SIGUSR1
        assert guard.stop_signal_of(RuntimeError("mat1 and mat2 shapes cannot be multiplied")) == 0
        assert guard.stop_signal_of(StopRequested(signal.SIGTERM)) == signal.SIGTERM  # a stop at once: its own


def test_a_step_that_is_not_finite_is_the_decision_a_step_later(world_of_one, tmp_path):
    def step(guard, number: int, loss: float, save_failed: bool = False) -> Decision:
        return guard.step_taken(number, torch.tensor(loss), torch.tensor(1.0), save_failed=save_failed)

    with guard_of(world_of_one, tmp_path) as guard:
        assert step(guard, 1, 2.5) == Decision()
        assert step(guard, 2, float("nan")) == Decision()  # judged on the host at the next step
        assert step(guard, 3, 2.4).diverged_since == 2
        assert guard.health().last_unhealthy == 2
        assert step(guard, 4, 2.4, save_failed=True).save_failed
