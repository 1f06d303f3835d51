"""A run's start-up, shared by the two commands that start one: main.py, which then trains, and
plan.py --check, which starts chosen ranks of a cluster's run in one process on a fake process group
(planning/check.py) and stops after one step. Both build the data, the model and the Trainer here,
so that the check exercises what the run will (commands never import each other).

The order is the original's (main.py's get_train_objs, then the Trainer): the data, prepared on
each machine and split; the model on the meta device, sized by the data's vocabulary; the step
checked to fit the data and the memory, then the model placed and wrapped for its method with its
optimizer; then the Trainer, which builds the data loaders and the Checkpointer.
"""
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from mingpt.char_dataset import (
    DEFAULT_CORPUS,
    CharDataset,
    DataConfig,
    Spread,
    describe_data,
    open_corpus,
    prepare_corpus,
    split_dataset,
)
from mingpt.common.logger import log, warn_once
from mingpt.distributed import parallel
from mingpt.distributed.fault_tolerance import FaultToleranceConfig, Replicas
from mingpt.distributed.precision import resolve_precision
from mingpt.distributed.process_group import DistEnv, barrier
from mingpt.model import GPT
from mingpt.optimizer import OptimizerConfig
from mingpt.planning.memory import Placement
from mingpt.planning.placement import PlacedModel, place
from mingpt.run_config import TrainConfig
from mingpt.storage.gpt2_folder import open_folder
from mingpt.storage.lease import SnapshotLease
from mingpt.tokens.data_loader import batches_per_rank, check_step_fits
from mingpt.tokens.sample_order import SampleOrder, split_of
from mingpt.trainer import Trainer, TrainerConfig

TrainObjects = tuple[GPT, CharDataset, CharDataset, CharDataset]
"""The model (on the meta device), the whole dataset, and its train and test splits."""


def train_objects(config: TrainConfig, env: DistEnv) -> TrainObjects:
    """main.get_train_objs: the data, split, and the model on the meta device (from a GPT-2 folder:
    gpt_config.init_from)."""
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


def sample_order(config: TrainConfig, dataset: CharDataset) -> SampleOrder:
    """What decides the run's training samples and their order, for its snapshots to keep."""
    data = config.data_config
    return SampleOrder.of(dataset.ids, dataset.block_size, split_of(data.split, data.train_split, data.val_path),
                          dataset.stride != 1, config.trainer_config.seed)


def start_trainer(config: TrainConfig, env: DistEnv, objects: TrainObjects,
                  lease: Optional[SnapshotLease] = None) -> tuple[Trainer, list[str]]:
    """The Trainer of the run (holding its snapshot path's lease, when the run took one), with what it
    says as it starts (its summary: model, world, memory, batch, data and snapshot lines)."""
    model, dataset, train_set, test_set = objects
    tc = config.trainer_config
    replicas = Replicas.open(config.fault_tolerance_config, env)
    check_step_fits(len(train_set), tc.batch_size, tc.grad_accum_steps, replicas.data_env.world_size)
    placed = place_model(tc, config.optimizer_config, model, env, replicas)
    trainer = Trainer(tc, placed, train_set, test_set, dataset.vocabulary, env, sample_order(config, dataset),
                      lease)
    return trainer, run_summary(trainer, describe_data(config.data_config, dataset, train_set, test_set))


def place_model(config: TrainerConfig, optimizer_config: OptimizerConfig, model: GPT, env: DistEnv,
                replicas: Optional[Replicas] = None) -> PlacedModel:
    """The model and optimizer of main.get_train_objs, for this rank: the meta-device model checked
    against its step's memory plan, then placed for trainer_config.distributed_method with its
    optimizer, grad scaler and autocast (planning/placement.py); a run of one replica group unless
    `replicas` says otherwise."""
    precision = resolve_precision(config.use_amp, config.amp_dtype, env.device)
    placement = placement_of(config, env.world_size, env.local_world_size, env.device.type, precision.amp_dtype,
                             optimizer_config.name)
    replicas = replicas or Replicas.open(FaultToleranceConfig(), env)
    return place(model, placement, precision, config, config.batch_size, optimizer_config, env, replicas)


def placement_of(config: TrainerConfig, world_size: int, ranks_per_node: int, device_type: str,
                 compute_dtype: Optional[torch.dtype], optimizer: str = "adamw") -> Placement:
    """How a run spreads its training state over a world: what the start-up checks (place_model)
    and plan.py plans, from the same keys."""
    return Placement(config.distributed_method, world_size, ranks_per_node, device_type, compute_dtype,
                     config.cpu_offload, config.reshard_after_forward, config.grad_accum_steps,
                     config.snapshot_format if config.async_snapshots else None, optimizer)


def run_summary(trainer: Trainer, data: str) -> list[str]:
    """The run as it starts: model, world, memory, batch, data (with how it is evaluated) and
    snapshot lines."""
    tc, env = trainer.config, trainer.env
    tokens_per_step = tc.step_samples(trainer.data_env.world_size) * trainer.block_size
    budget = f"{tc.max_steps:,} steps in all" if tc.max_steps else f"{tc.max_epochs} epochs"
    offload = " with CPU offload" if tc.cpu_offload else ""
    method, within = tc.distributed_method, trainer.placed.parallelism.method
    if within != method:
        method += f" ({within} within each replica group)"
    return [
        f"Model: {parallel.unwrap(trainer.model).describe()}",
        f"Optimizer: {trainer.optimizer_config.describe()}",
        f"World: {env.describe()}; {method}{offload}; {trainer.precision}; "
        f"{parallel.local_parameter_bytes(trainer.model) / 1e6:.1f} MB of parameters per rank",
        f"Memory: {trainer.placed.memory.describe()}",
        f"Batch: {tc.batch_size} per process x {tc.grad_accum_steps} accumulation, "
        f"{tokens_per_step:,} tokens per step, {trainer.steps_per_epoch:,} steps per epoch, "
        f"{budget}, {trainer.train_loader.num_workers} data worker(s) per process",
        f"{data}; evaluation {evaluation_plan(trainer)}",
        f"Snapshots: {trainer.checkpointer.describe(trainer.progress)}; "
        f"{', '.join([*tc.stop_signals, 'Ctrl-C'])} stop with a snapshot",
    ]


def evaluation_plan(trainer: Trainer) -> str:
    """When and on how many batches the run evaluates: "every epoch on all 26 batches per process",
    or how eval_batches bounds it."""
    tc, test_loader = trainer.config, trainer.test_loader
    when = f"every {tc.eval_every_steps} steps" if tc.eval_every_steps else "every epoch"
    if test_loader is None:
        return when
    taken = len(test_loader)
    whole = batches_per_rank(trainer.test_samples, tc.batch_size, trainer.env.world_size)
    if taken == whole:
        return f"{when} on all {whole:,} batches per process"
    which = ("windows spread evenly without overlap" if isinstance(test_loader.dataset, Spread)
             else "a fixed seeded subset")
    return f"{when} on {taken:,} of {whole:,} batches per process, {which} (trainer_config.eval_batches; 0: all)"
