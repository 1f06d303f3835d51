"""Train a GPT on characters (the original's) or BPE tokens, from scratch or from GPT-2's weights.

    python main.py [overrides]                                    one process
    torchrun --standalone --nproc_per_node=4 main.py [overrides]  one process per GPU (or CPU rank)

The original's main.py, its landmarks where they were: `ddp_setup` joins the process group,
`get_train_objs` builds the data and the model, `main` hands them to the Trainer. The config that
Hydra composes, and its help pages, are run_config.py's (plan.py and model_size.py read it too); the
rest of the original's lines went where docs/ARCHITECTURE.md's "Where the original's code went" says.
"""
import contextlib
import os
import sys
from dataclasses import asdict
from typing import Iterator

import hydra
from omegaconf import DictConfig, OmegaConf

from mingpt.common.errors import command, say_line
from mingpt.common.logger import configure_logging, log
from mingpt.distributed.control import (
    INTERRUPT_EXIT_STATUS,
    RunStopped,
    StopRequested,
    StopSignals,
    exit_status_for,
    record_clean_stop,
)
from mingpt.distributed.fault_tolerance import speak, speaks_at_start
from mingpt.distributed.process_group import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_KEY,
    DistEnv,
    distributed_session,
    peer_failure,
    record_nccl_collectives,
    said_elsewhere,
)
from mingpt.reporting.run_report import stopped_before_training
from mingpt.run_config import HydraSpeech, TrainConfig, load_config, run_command_line
from mingpt.start_up import TrainObjects, start_trainer, train_objects
from mingpt.storage.checkpointer import holding_the_path
from mingpt.storage.snapshot import snapshot_folder


@contextlib.contextmanager
def ddp_setup(config: TrainConfig) -> Iterator[DistEnv]:
    """The original's ddp_setup: join the process group, one device per rank (torch.accelerator's,
    or the CPU with gloo); here also rank 0's logger (under replica groups, the voice's alone),
    NCCL's flight recorder and a clean exit."""
    record_nccl_collectives(snapshot_folder(config.trainer_config.snapshot_path))
    with distributed_session(config.trainer_config.process_group_timeout_s) as env:
        configure_logging(env.rank)
        if config.fault_tolerance_config.enabled:
            speak(speaks_at_start(config.fault_tolerance_config), env)
        yield env


def get_train_objs(config: TrainConfig, env: DistEnv) -> TrainObjects:
    """The original's get_train_objs: the data, split, and the model on the meta device (from a GPT-2
    folder: gpt_config.init_from). The optimizer is the Trainer's, built once the model is wrapped
    (the FSDP fork built it before, and FSDP then trained nothing). Built in start_up.py, which
    plan.py --check shares, so that the check starts a rank as this does."""
    return train_objects(config, env)


def train(config: TrainConfig, env: DistEnv) -> None:
    """Build the run, say what is about to run, train: the snapshot path held from the Trainer's start
    to the run's end, however it ends (one run per path: storage/lease.py)."""
    objects = get_train_objs(config, env)
    policy = config.trainer_config.snapshot_policy(config.fault_tolerance_config)
    with holding_the_path(policy, env) as lease:
        trainer, summary = start_trainer(config, env, objects, lease)
        for line in summary:
            log.info(line)
        trainer.track(config.tracker_config, asdict(config), summary)
        trainer.train()


@hydra.main(version_base=None, config_path=".", config_name="gpt2_train_cfg")
def main(cfg: DictConfig) -> None:
    HydraSpeech.speak_again()  # Hydra took the command line: this process speaks again
    status = run(cfg)
    if status:  # returning, not exiting, on success: a sweep (-m) runs its next job in this process
        sys.exit(status)


@command
def run(cfg: DictConfig) -> int:
    """Train; the exit status: 0 when training ends, 75 (130 after Ctrl-C) when a stop signal
    stopped it with its snapshot written (or before anything was trained), 1 on a user's error or a
    lost peer (each said in one line)."""
    config = load_config(cfg)
    is_main = int(os.environ.get("RANK", 0)) == 0
    signals = StopSignals.open(config.trainer_config.stop_signals, is_main)  # a stop in the start-up too
    try:
        with ddp_setup(config) as env:
            train(config, env)
    except StopRequested as stop:  # in the start-up, before anything was trained
        if is_main:
            say_line(stopped_before_training(str(stop)))
        return stopped_cleanly(exit_status_for(stop.number))
    except RunStopped as stop:  # the snapshot is written; the trainer has said so
        return stopped_cleanly(stop.exit_status)
    except KeyboardInterrupt:  # Ctrl-C twice (control.py)
        if is_main:
            say_line(signals.quit_line())
        return INTERRUPT_EXIT_STATUS
    except RuntimeError as error:  # torch.distributed's errors are RuntimeErrors
        line = peer_failure(error, OmegaConf.select(cfg, TIMEOUT_KEY, default=DEFAULT_TIMEOUT_S))
        if line is None:
            raise
        if signals.requested:  # a peer stopped at once on the same signal (control.py): so does this rank
            return stopped_cleanly(exit_status_for(signals.requested))
        # Another process died, or stopped answering: one line, not a traceback; nothing when that
        # process has said its own error (the run's one line).
        if not said_elsewhere(error):
            say_line(f"error: [rank {os.environ.get('RANK', 0)}] {line}")
        return 1
    finally:
        signals.close()
    return 0


def stopped_cleanly(status: int) -> int:
    """The exit status of a run a signal stopped with nothing lost, told to the launcher too."""
    record_clean_stop(status)
    return status


if __name__ == "__main__":
    run_command_line(main)
