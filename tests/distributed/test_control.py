"""control.py: signals and rank 0's snapshot timer, turned into decisions every rank reads alike."""
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from mingpt.common.errors import ConfigError, DataError
from mingpt.distributed import control
from mingpt.distributed.control import (
    INTERRUPT_EXIT_STATUS,
    STOP_EXIT_STATUS,
    Decision,
    RunStopped,
    StepAgreement,
    check_signal_names,
    signal_number,
)


def test_signal_names_in_any_spelling():
    assert signal_number("SIGTERM") == signal_number("term") == signal.SIGTERM
    check_signal_names(["SIGUSR1", "TERM"], "trainer_config.stop_signals")
    with pytest.raises(ConfigError, match="trainer_config.stop_signals: unknown signal 'SIGNOPE'"):
        check_signal_names(["SIGNOPE"], "trainer_config.stop_signals")


def test_a_signal_stops_the_run_at_the_end_of_its_step_and_a_second_changes_nothing(world_of_one):
    before = signal.getsignal(signal.SIGUSR1)
    agreement = StepAgreement(["SIGUSR1"], save_every_minutes=0, env=world_of_one)
    agreement.signals.at_once = lambda: False  # a step under way, not yet saved
    try:
        assert agreement.after_step() == Decision() == agreement.stop_asked()
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGUSR1)  # a second one, say while saving: still one request
        decision = agreement.after_step()  # at the end of the step it came in
        assert decision.stop_signal == signal.SIGUSR1 and decision.stop_signal_name == "SIGUSR1"
        assert agreement.stop_asked() == Decision(stop_signal=signal.SIGUSR1)  # between steps too
    finally:
        agreement.close()
    assert signal.getsignal(signal.SIGUSR1) == before  # the previous handler is back


def test_ctrl_c_asks_for_a_stop_with_a_line_and_a_second_quits_at_once(world_of_one, capfd):
    before = signal.getsignal(signal.SIGINT)
    agreement = StepAgreement([], save_every_minutes=0, env=world_of_one)  # Ctrl-C whatever the stop signals
    agreement.signals.at_once = lambda: False
    agreement.signals.kept = lambda: "the last snapshot (step 7) is kept as it was"
    try:
        assert signal.getsignal(signal.SIGINT) != before  # else the Ctrl-C below would stop pytest itself
        os.kill(os.getpid(), signal.SIGINT)
        said = ""
        for _ in range(100):  # said by CtrlC's thread, as the signal comes
            said += capfd.readouterr().out
            if said:
                break
            time.sleep(0.02)
        assert said == ("\nCtrl-C: stopping at the end of this step with a snapshot; "
                        "press Ctrl-C again to quit at once without one\n")
        assert agreement.after_step().stop_signal == signal.SIGINT
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
        assert agreement.signals.quit_line() == ("Interrupted: quit at once; the last snapshot (step 7) is "
                                                 "kept as it was")
    finally:
        agreement.close()
    assert signal.getsignal(signal.SIGINT) == before
    assert RunStopped(signal.SIGINT).exit_status == INTERRUPT_EXIT_STATUS == 130
    assert RunStopped(signal.SIGTERM).exit_status == STOP_EXIT_STATUS == 75
    assert RunStopped(signal.SIGUSR1).exit_status == STOP_EXIT_STATUS


@pytest.fixture
def clock(monkeypatch) -> list[float]:
    """control.py's monotonic clock, set by the test: no timing depends on the machine's load."""
    now = [1000.0]
    monkeypatch.setattr(control, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def test_the_timer_asks_for_one_snapshot_per_interval(world_of_one, clock):
    agreement = StepAgreement([], save_every_minutes=1, env=world_of_one)
    try:
        clock[0] += 59
        assert agreement.after_step() == Decision()  # the timer has not run out
        clock[0] += 1
        assert agreement.after_step().save  # it has
        agreement.saved()
        assert agreement.after_step() == Decision()  # no second snapshot for the same interval
        assert agreement.after_step() == Decision()
    finally:
        agreement.close()


def test_only_rank_zero_keeps_the_time(world_of_one, clock):
    agreement = StepAgreement([], save_every_minutes=1, env=replace(world_of_one, rank=1))
    try:
        clock[0] += 120
        assert [agreement.after_step() for _ in range(3)] == [Decision()] * 3
    finally:
        agreement.close()


def test_a_failed_background_save_is_carried_to_every_rank(world_of_one):
    agreement = StepAgreement([], save_every_minutes=0, env=replace(world_of_one, rank=1))
    try:
        assert agreement.after_step(save_failed=True) == Decision(save_failed=True)
        assert agreement.after_step() == Decision()
    finally:
        agreement.close()


def test_a_stop_record_cut_short_is_no_clean_stop(tmp_path):
    """launch.py reads each rank's record; one a killed rank left empty or garbled is not a clean
    stop (it raised ValueError with a traceback)."""
    (tmp_path / "rank0").write_text("75")
    (tmp_path / "rank1").write_text("")
    (tmp_path / "rank2").write_text("7\x00")
    assert control.clean_stops(tmp_path) == {0: 75}


STUCK_IN_CPP = """
import os, sys, torch.distributed as dist
from datetime import timedelta
from mingpt.distributed.control import StepAgreement
from mingpt.distributed.process_group import init_distributed
agreement = StepAgreement([], save_every_minutes=0, env=init_distributed())
print("training", flush=True)
# A call of C++ that does not return for a minute and runs no Python meanwhile, as a long backward
# pass or a collective waiting for a peer: a store waiting for a second worker that never comes.
dist.TCPStore("127.0.0.1", 0, world_size=2, is_master=True, wait_for_workers=True,
              timeout=timedelta(seconds=60))
"""


@pytest.mark.slow
def test_ctrl_c_is_said_at_once_and_a_second_quits_even_inside_a_long_call_of_cpp():
    """Python's handler would wait for the call to return: the first Ctrl-C's line comes at once, and
    after a second the process ends within QUIT_WAIT_S and a little, status 130, with its line."""
    process = subprocess.Popen([sys.executable, "-c", STUCK_IN_CPP], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    try:
        assert process.stdout.readline() == "training\n"
        time.sleep(0.5)  # inside the call
        process.send_signal(signal.SIGINT)
        assert process.stdout.readline() == "\n" and process.stdout.readline().startswith("Ctrl-C: stopping")
        process.send_signal(signal.SIGINT)
        pressed = time.monotonic()
        assert process.wait(timeout=30) == INTERRUPT_EXIT_STATUS
        assert time.monotonic() - pressed < control.QUIT_WAIT_S + 3
        assert process.stderr.read() == "Interrupted: quit at once; the last complete snapshot is as it was\n"
    finally:
        process.kill()
        process.wait()


def test_the_agreement_closes_while_a_forked_worker_lives(world_of_one):
    """DataLoader workers are forked after the agreement opens, and hold what it opened: closing must
    not wait for them (it waited for ever for the end of a pipe they held)."""
    import multiprocessing

    agreement = StepAgreement([], save_every_minutes=0, env=world_of_one)
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(30,))
    worker.start()
    try:
        started = time.monotonic()
        agreement.close()
        assert time.monotonic() - started < 5
    finally:
        worker.kill()
        worker.join()


def test_a_stop_that_loses_nothing_stops_at_once_wherever_it_lands(world_of_one):
    """Before any step, or with nothing trained since the last snapshot, the handler itself raises:
    no step end or evaluation batch to wait for. Only the first signal does."""
    agreement = StepAgreement(["SIGTERM"], save_every_minutes=0, env=world_of_one)
    try:
        with pytest.raises(control.StopRequested) as stopped:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler interrupts whatever runs
        assert stopped.value.number == signal.SIGTERM and str(stopped.value) == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)  # a second one, during the stop itself: noted already
        assert agreement.after_step().stop_signal == signal.SIGTERM
    finally:
        agreement.close()


def test_once_the_stops_snapshot_is_written_a_second_ctrl_c_changes_nothing(world_of_one):
    agreement = StepAgreement([], save_every_minutes=0, env=world_of_one)
    agreement.signals.at_once = lambda: False
    try:
        os.kill(os.getpid(), signal.SIGINT)
        agreement.signals.settled = True  # the stop's snapshot is written: it is ending by itself
        os.kill(os.getpid(), signal.SIGINT)  # no KeyboardInterrupt
        time.sleep(control.QUIT_WAIT_S + 0.5)  # and CtrlC's thread did not end the process
    finally:
        agreement.close()


def test_the_process_keeps_one_set_of_handlers_that_main_opens_before_the_start_up(world_of_one):
    """main.run opens the stop signals before the start-up; the Trainer's agreement shares them (its
    close gives nothing back), and the last to close restores the previous handlers."""
    before = signal.getsignal(signal.SIGTERM)
    signals = control.StopSignals.open(["SIGTERM"], is_main=True)
    agreement = StepAgreement(["SIGTERM"], save_every_minutes=0, env=world_of_one)
    assert agreement.signals is signals
    agreement.close()
    assert signal.getsignal(signal.SIGTERM) == signals._on_signal
    signals.close()
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_signal_while_the_process_ends_on_an_error_leaves_the_error_its_own():
    """torchrun SIGTERMs the other ranks once one failed: a rank already on its way out with the same
    mistake in the data says that one line, not a StopRequested traceback raised inside its cleanup
    (CI: a torn validation shard, the signal landing in main.run's `finally`)."""
    signals = control.StopSignals.open(["SIGTERM"], is_main=True)
    try:
        with pytest.raises(DataError, match="truncated"):
            try:
                raise DataError("data_config.val_path: val.bin is truncated; fetch it again")
            finally:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.05)  # the handler runs here, the error on its way out
        assert signals.requested == signal.SIGTERM  # noted all the same
    finally:
        signals.close()
    signals = control.StopSignals.open(["SIGTERM"], is_main=True)
    try:
        with pytest.raises(control.StopRequested):  # with no error under way, it stops at once as before
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
    finally:
        signals.close()
