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
from dataclasses import asdict, replace
from pathlib import Path
from typing import Iterator, Optional

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from mingpt.char_dataset import (
    DEFAULT_CORPUS,
    CharDataset,
    DataConfig,
    describe_data,
    open_corpus,
    prepare_corpus,
    split_dataset,
)
from mingpt.common.errors import command, say_line
from mingpt.common.logger import configure_logging, log, warn_once
from mingpt.distributed.control import INTERRUPT_EXIT_STATUS, RunStopped, record_clean_stop
from mingpt.distributed.process_group import (
    DEFAULT_TIMEOUT_S,
    TIMEOUT_KEY,
    DistEnv,
    barrier,
    distributed_session,
    peer_failure,
    record_nccl_collectives,
    said_elsewhere,
)
from mingpt.model import GPT
from mingpt.run_config import TrainConfig, load_config, run_command_line
from mingpt.storage.gpt2_folder import open_folder
from mingpt.storage.snapshot import snapshot_folder
from mingpt.trainer import Trainer


@contextlib.contextmanager
def ddp_setup(config: TrainConfig) -> Iterator[DistEnv]:
    """The original's ddp_setup: join the process group, one device per rank (torch.accelerator's,
    or the CPU with gloo); here also rank 0's logger, NCCL's flight recorder and a clean exit."""
    record_nccl_collectives(snapshot_folder(config.trainer_config.snapshot_path))
    with distributed_session(config.trainer_config.process_group_timeout_s) as env:
        configure_logging(env.rank)
        yield env


def get_train_objs(config: TrainConfig, env: DistEnv) -> tuple[GPT, CharDataset, CharDataset, CharDataset]:
    """The original's get_train_objs: the data, split, and the model on the meta device (from a GPT-2
    folder: gpt_config.init_from). The optimizer is the Trainer's, built once the model is wrapped
    (the FSDP fork built it before, and FSDP then trained nothing)."""
    folder = open_folder(config.gpt_config.init_from) if config.gpt_config.init_from else None
    data_config = folder.tokenizing(config.data_config) if folder else config.data_config
    dataset, validation = load_dataset(data_config, env)
    train_set, test_set = split_dataset(dataset, data_config, config.trainer_config.seed, validation)
    gpt_config = folder.model_config(config.gpt_config) if folder else config.gpt_config
    gpt_config = replace(gpt_config, vocab_size=dataset.vocab_size, block_size=dataset.block_size)
    with torch.device("meta"):  # shapes only: the Trainer fills in what this rank holds (parallel.py)
        model = GPT(gpt_config, seed=config.trainer_config.seed, weights=folder)
    if folder:
        log.info(f"Initial weights from {folder.path} (GPT-2, {gpt_config.activation}), unless a snapshot "
                 "is resumed")
    return model, dataset, train_set, test_set


def load_dataset(config: DataConfig, env: DistEnv) -> tuple[CharDataset, Optional[CharDataset]]:
    """The data of path, and of val_path if set: every process of the machine prepares them, each kind
    its own way (tokens/sources.py: a text's token file is made by local rank 0 alone), waits for the
    others, then maps what was made, or the shards."""
    prepare_corpus(config, local_main=env.is_local_main)
    barrier()
    dataset = open_corpus(config)
    validation = open_corpus(config, validation=True) if config.val_path else None
    if dataset.num_chars < dataset.text_length and Path(config.path) != DEFAULT_CORPUS:
        warn_once(f"data_config.truncate={config.truncate:g} keeps the first {dataset.num_chars:,} of the "
                  f"text's {dataset.text_length:,} {dataset.unit} (the original's setting, made for "
                  "tiny-shakespeare); data_config.truncate=1.0 trains on all of it")
    if dataset.shards is not None:
        log.info(f"Data: {dataset.shards.describe()}, {dataset.num_chars:,} {dataset.unit} of a vocabulary "
                 f"of {dataset.vocab_size:,}")
    elif dataset.vocabulary.is_char:
        log.info(f"Data has {dataset.num_chars} characters, {dataset.vocab_size} unique.")
    else:
        log.info(f"Data has {dataset.num_chars} tokens, of a BPE vocabulary of {dataset.vocab_size}.")
    return dataset, validation


def train(config: TrainConfig, env: DistEnv) -> None:
    """Build the run, say what is about to run, train."""
    model, dataset, train_set, test_set = get_train_objs(config, env)
    trainer = Trainer(config.trainer_config, model, config.optimizer_config, train_set, test_set,
                      dataset.vocabulary, env)
    summary = trainer.summary(describe_data(config.data_config, dataset, train_set, test_set))
    for line in summary:
        log.info(line)
    trainer.track(config.tracker_config, asdict(config), summary)
    trainer.train()


@hydra.main(version_base=None, config_path=".", config_name="gpt2_train_cfg")
def main(cfg: DictConfig) -> None:
    sys.stderr = sys.__stderr__  # Hydra took the command line: this process speaks again
    status = run(cfg)
    if status:  # returning, not exiting, on success: a sweep (-m) runs its next job in this process
        sys.exit(status)


@command
def run(cfg: DictConfig) -> int:
    """Train; the exit status: 0 when training ends, 75 (130 after Ctrl-C) when a stop signal
    stopped it with its snapshot written, 1 on a user's error or a lost peer (each said in one line)."""
    config = load_config(cfg)
    try:
        with ddp_setup(config) as env:
            train(config, env)
    except RunStopped as stop:
        record_clean_stop(stop.exit_status)  # the snapshot is written; the trainer has said so
        return stop.exit_status
    except KeyboardInterrupt:  # Ctrl-C before training, or a second one during it (control.py)
        if int(os.environ.get("RANK", 0)) == 0:
            say_line("Interrupted: quit without a new snapshot (the last complete one is as it was)")
        return INTERRUPT_EXIT_STATUS
    except RuntimeError as error:  # torch.distributed's errors are RuntimeErrors
        line = peer_failure(error, OmegaConf.select(cfg, TIMEOUT_KEY, default=DEFAULT_TIMEOUT_S))
        if line is None:
            raise
        # Another process died, or stopped answering: one line, not a traceback; nothing when that
        # process has said its own error (the run's one line).
        if not said_elsewhere(error):
            say_line(f"error: [rank {os.environ.get('RANK', 0)}] {line}")
        return 1
    return 0


if __name__ == "__main__":
    run_command_line(main)
