"""Train a GPT on characters (the original's) or BPE tokens, from scratch or from GPT-2's weights.

    python main.py [overrides]                                    one process
    torchrun --standalone --nproc_per_node=4 main.py [overrides]  one process per GPU (or CPU rank)

Hydra composes gpt2_train_cfg.yaml over the typed schema below, so a misspelt key or a value of the
wrong type is refused before anything runs; the result is turned into dataclasses once, here, and
their checks reject out-of-range values with one line naming the key.
"""
import contextlib
import dataclasses
import inspect
import io
import os
import re
import sys
import textwrap
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Iterator, Optional, Sequence

import hydra
import torch
import torch.distributed as dist
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from mingpt.char_dataset import (
    DEFAULT_CORPUS,
    REPO_ROOT,
    CharDataset,
    DataConfig,
    Spread,
    open_corpus,
    prepare_corpus,
    split_dataset,
)
from mingpt.common import files
from mingpt.common.errors import MinGPTError, check, command, say_line, short_reason
from mingpt.common.field_docs import field_docs
from mingpt.common.logger import configure_logging, log, warn_once
from mingpt.distributed.control import INTERRUPT_EXIT_STATUS, RunStopped, record_clean_stop
from mingpt.distributed.process_group import (
    DEFAULT_TIMEOUT_S,
    DistEnv,
    barrier,
    distributed_session,
    launched_by_torchrun,
    record_nccl_collectives,
    said_by_local_rank_zero,
    said_elsewhere,
)
from mingpt.model import GPT, GPTConfig, OptimizerConfig
from mingpt.reporting.trackers import TrackerConfig
from mingpt.storage.gpt2_folder import GPT2Folder, open_folder
from mingpt.storage.snapshot import snapshot_folder
from mingpt.tokens.data_loader import batches_per_rank
from mingpt.trainer import Trainer, TrainerConfig


@dataclass
class TrainConfig:
    """The whole config: the original's four groups, and the run trackers'."""

    data_config: DataConfig = field(default_factory=DataConfig)
    gpt_config: GPTConfig = field(default_factory=GPTConfig)
    trainer_config: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    tracker_config: TrackerConfig = field(default_factory=TrackerConfig)

    def __post_init__(self) -> None:
        derived_keys = (("vocab_size", "the data's tokenizer"), ("block_size", "data_config.block_size"))
        for derived, source in derived_keys:
            check(getattr(self.gpt_config, derived) is None, f"gpt_config.{derived}",
                  f"comes from {source}; do not set it")


CONFIG_DIR = Path(__file__).resolve().parent
"""gpt2_train_cfg.yaml's folder: Hydra's config path, and the one of laptop.yaml and yours."""
ConfigStore.instance().store(name="train_config_schema", node=TrainConfig)
OmegaConf.register_new_resolver("repo_path", lambda relative: str(REPO_ROOT / relative), replace=True)


def load_dataset(config: DataConfig, env: DistEnv) -> tuple[CharDataset, Optional[CharDataset]]:
    """One process per machine makes the token file of each text (path, val_path), or every process
    of the machine shares the files of a set of texts; the others wait, then every process maps those
    files, or the shards. The data of path, and of val_path if set."""
    prepare_corpus(config, local_main=env.is_local_main)
    barrier()
    dataset = open_corpus(config)
    validation = open_corpus(config, validation=True) if config.val_path else None
    if dataset.num_chars < dataset.text_length and Path(config.path) != DEFAULT_CORPUS:
        warn_once(f"data_config.truncate={config.truncate:g} keeps the first {dataset.num_chars:,} of the "
                  f"text's {dataset.text_length:,} {dataset.unit} (the original's setting, made for "
                  "tiny-shakespeare); data_config.truncate=1.0 trains on all of it")
    if dataset.shards is not None:
        log.info(f"Data: {dataset.shards.describe()}, {dataset.num_chars:,} tokens of a vocabulary of "
                 f"{dataset.vocab_size:,}")
    elif dataset.vocabulary.is_char:
        log.info(f"Data has {dataset.num_chars} characters, {dataset.vocab_size} unique.")
    else:
        log.info(f"Data has {dataset.num_chars} tokens, of a BPE vocabulary of {dataset.vocab_size}.")
    return dataset, validation


def train(config: TrainConfig) -> None:
    record_nccl_collectives(trace_folder(config.trainer_config.snapshot_path))
    with distributed_session(config.trainer_config.process_group_timeout_s) as env:
        configure_logging(env.rank)
        build_and_train(config, env)


def trace_folder(snapshot_path: str) -> Path:
    """Where NCCL's flight recorder dumps: beside the snapshots, or in the cache folder when they are
    not on this machine (NCCL writes local files)."""
    folder = snapshot_folder(snapshot_path)
    return files.cache_folder(None) / "nccl_traces" if files.is_remote(folder) else Path(folder)


def build_and_train(config: TrainConfig, env: DistEnv) -> None:
    trainer, summary = build(config, env)
    for line in summary:
        log.info(line)
    trainer.track(config.tracker_config, asdict(config), summary)
    trainer.train()


def build(config: TrainConfig, env: DistEnv) -> tuple[Trainer, list[str]]:
    """The data, the model on the meta device (from a GPT-2 folder: gpt_config.init_from), and the
    Trainer that places them; what is about to run, as startup_summary says it."""
    folder = open_folder(config.gpt_config.init_from) if config.gpt_config.init_from else None
    data_config = tokenized_by(folder, config.data_config)
    dataset, validation = load_dataset(data_config, env)
    train_set, test_set = split_dataset(dataset, data_config, config.trainer_config.seed, validation)
    gpt_config = folder.model_config(config.gpt_config) if folder else config.gpt_config
    gpt_config = replace(gpt_config, vocab_size=dataset.vocab_size, block_size=dataset.block_size)
    with torch.device("meta"):  # shapes only: the Trainer fills in what this rank holds (parallel.py)
        model = GPT(gpt_config, seed=config.trainer_config.seed, weights=folder)
    if folder:
        log.info(f"Initial weights from {folder.path} (GPT-2, {gpt_config.activation}), unless a snapshot "
                 "is resumed")
    trainer = Trainer(config.trainer_config, model, config.optimizer_config,
                      train_set, test_set, dataset.vocabulary, env)
    return trainer, startup_summary(config, dataset, train_set, test_set, trainer)


def tokenized_by(folder: Optional[GPT2Folder], data_config: DataConfig) -> DataConfig:
    """The data config, with a model folder's tokenizer when training starts from one."""
    if folder is None:
        return data_config
    folder.check_data(data_config.tokenizer, data_config.block_size)
    return replace(data_config, tokenizer=folder.tokenizer_path)


def startup_summary(config: TrainConfig, dataset: CharDataset, train_set, test_set,
                    trainer: Trainer) -> list[str]:
    """What is about to run, as the person who started it needs to check it: the Trainer's lines,
    with the data's before the snapshots'."""
    tc, data = config.trainer_config, config.data_config
    evaluation = (f"every {tc.eval_every_steps} steps" if tc.eval_every_steps else "every epoch") + (
        evaluated_batches(trainer, len(test_set)))
    *model_to_batch, snapshots = trainer.summary()
    validation = f"; validation {described(data.val_path, test_set.dataset)}" if data.val_path else ""
    split = "data_config.val_path" if data.val_path else f"{data.split} split"
    data_line = (f"Data: {described(data.path, dataset)}, "
                 f"vocabulary of {dataset.vocab_size}{validation}; "
                 f"{len(train_set):,} train and {len(test_set):,} test samples ({split}); "
                 f"evaluation {evaluation}")
    return [*model_to_batch, data_line, snapshots]


def evaluated_batches(trainer: Trainer, test_samples: int) -> str:
    """How many batches an evaluation takes: " on all 26 batches per process", or how eval_batches
    bounds it."""
    if trainer.test_loader is None:
        return ""
    taken = len(trainer.test_loader)
    whole = batches_per_rank(test_samples, trainer.config.batch_size, trainer.env.world_size)
    if taken == whole:
        return f" on all {whole:,} batches per process"
    which = ("windows spread evenly without overlap" if isinstance(trainer.test_loader.dataset, Spread)
             else "a fixed seeded subset")
    return f" on {taken:,} of {whole:,} batches per process, {which} (trainer_config.eval_batches; 0: all)"


def described(path: str, dataset: CharDataset) -> str:
    """A data path and what of it is read: "input.txt, 55,769 characters", or its shards."""
    shards = f" in {dataset.shards.describe()}" if dataset.shards is not None else ""
    return f"{path}, {dataset.kept}{shards}"


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
    try:
        train(load_config(cfg))
    except RunStopped as stop:
        record_clean_stop(stop.exit_status)  # the snapshot is written; the trainer has said so
        return stop.exit_status
    except KeyboardInterrupt:  # Ctrl-C before training, or a second one during it (control.py)
        if int(os.environ.get("RANK", 0)) == 0:
            say_line("Interrupted: quit without a new snapshot (the last complete one is as it was)")
        return INTERRUPT_EXIT_STATUS
    except (dist.DistError, RuntimeError) as error:
        line = peer_trouble(error, cfg)
        if line is None:
            raise
        # Another process died, or stopped answering: say so in one line, not a traceback; nothing
        # when that process has said its own error (the run's one line).
        if not said_elsewhere(error):
            say_line(f"error: [rank {os.environ.get('RANK', 0)}] {line}")
        return 1
    return 0


def load_config(cfg: DictConfig) -> TrainConfig:
    """The typed config. Every rank reads the same command line, so a mistake in it is said by local
    rank 0 alone (no process group yet to agree through)."""
    try:
        check_known_keys(cfg)
        return OmegaConf.to_object(cfg)
    except MinGPTError as error:
        error.said = said_by_local_rank_zero()
        raise


def check_known_keys(node: DictConfig, prefix: str = "") -> None:
    """Every key is one of its dataclass's fields. Hydra refuses a misspelt key, then suggests
    `+key=value`, which adds it to the config, and OmegaConf.to_object drops it without a word:
    the run would train with the key ignored."""
    schema = OmegaConf.get_type(node)
    fields = {f.name: f for f in dataclasses.fields(schema)}
    for key in node:
        check(key in fields, f"{prefix}{key}", f"is not a key of {schema.__name__}, so nothing would read "
              "it (a leading + adds a key); `python main.py --cfg job` prints every key")
        if dataclasses.is_dataclass(fields[key].type):
            check_known_keys(node[key], f"{prefix}{key}.")


def peer_trouble(error: Exception, cfg: DictConfig) -> Optional[str]:
    """What a failed collective says of the other ranks, or None for an error of this rank's own."""
    if collective_timed_out(error):
        timeout = OmegaConf.select(cfg, TIMEOUT_KEY, default=DEFAULT_TIMEOUT_S)
        return (f"a collective timed out: another process stopped answering for {timeout:g} s "
                f"({TIMEOUT_KEY}={timeout:g}): it hung, was stopped or fell far behind; see the other "
                "processes' output and hosts (trainer_config.hang_timeout_s, when shorter, names the "
                f"rank), or raise {TIMEOUT_KEY} if a step can take that long (rank 0 writing a large "
                "snapshot alone, say)")
    if lost_a_peer(error):
        return f"lost contact with another process ({short_reason(error)}); see that process's output"
    return None


TIMEOUT_KEY = "trainer_config.process_group_timeout_s"
COLLECTIVE_TIMEOUTS = re.compile(
    r"Timed out waiting \d+ms for (recv|send) operation"  # gloo
    r"|Watchdog caught collective operation timeout|timed out in blocking wait")  # NCCL's two modes
"""How gloo and NCCL say that a collective waited its whole timeout for another rank."""


def collective_timed_out(error: Exception) -> bool:
    """A collective gave up waiting for another rank: gloo's `Timed out waiting 60000ms for recv
    operation to complete`, NCCL's `Watchdog caught collective operation timeout: ...`."""
    return COLLECTIVE_TIMEOUTS.search(str(error)) is not None


def lost_a_peer(error: Exception) -> bool:
    """A collective failed because another rank went away (NCCL or gloo, whose errors are plain)."""
    signs = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")
    return isinstance(error, dist.DistError) or any(sign in str(error) for sign in signs)


HELP_HEAD = """Train a GPT with DDP, FSDP or HSDP. Every key below is a Hydra override, key=value.

  python main.py [key=value ...]                                 one process (a CPU, or one GPU)
  torchrun --standalone --nproc_per_node=4 main.py [key=value]   one process per GPU (or CPU rank)
  python launch.py [--nproc N] [key=value ...]                   one per GPU here; N CPU processes
  sbatch slurm/sbatch_run.sh [key=value ...]                     a Slurm job over several nodes
  python main.py --config-name laptop [key=value ...]            keys kept in a YAML beside this one
  python main.py --cfg job                                       print the composed config

Other commands, each with --help: generate.py, plan.py, model_size.py, plot_metrics.py,
prepare_data.py, convert_snapshot.py, export_hf.py. Hydra's own help: --hydra-help.
"""
MARKDOWN_HEAD = """# Configuration

Every key of a training run (`python mingpt/main.py`, torchrun, `launch.py`, `sbatch`), with its default
in `mingpt/gpt2_train_cfg.yaml` and what it does. Override any on the command line (`key=value`), or keep
them in a YAML beside the default one (`mingpt/laptop.yaml` is an example: `--config-name laptop`).
Generated from the config dataclasses' docstrings by `python mingpt/main.py --help=md >
docs/configuration.md`; a test fails when this page and the code differ.
"""


def compose_config(overrides: Sequence[str] = (), config_name: str = "gpt2_train_cfg") -> DictConfig:
    """The config Hydra composes for main.py from its YAML and overrides (for the commands that read
    the run's config without running it: plan.py, --help)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name, overrides=list(overrides))


def config_reference(markdown: bool = False) -> str:
    """Every key with its default and its docstring: `main.py --help`, or docs/configuration.md."""
    defaults = compose_config()
    parts = [MARKDOWN_HEAD if markdown else HELP_HEAD]
    for group in dataclasses.fields(TrainConfig):
        docs = field_docs(group.type)
        values = OmegaConf.to_container(defaults[group.name], resolve=False)
        source = Path(inspect.getsourcefile(group.type)).relative_to(REPO_ROOT)
        if markdown:
            parts += [f"## {group.name}", "", f"`{group.type.__name__}`, in `{source}`.", "",
                      "| key | default | what it does |", "|---|---|---|"]
            parts += [f"| `{group.name}.{key}` | `{shown(value)}` | {docs[key].replace('|', '&#124;')} |"
                      for key, value in values.items()]
            parts.append("")
        else:
            parts.append(f"{group.name} ({group.type.__name__}, {source})")
            for key, value in values.items():
                parts.append(f"  {group.name}.{key}={shown(value)}")
                parts += textwrap.wrap(docs[key], width=100, initial_indent=" " * 6,
                                       subsequent_indent=" " * 6)
            parts.append("")
    return "\n".join(parts)


def shown(value: Any) -> str:
    """A default as a user writes it on the command line."""
    if isinstance(value, str) and value.startswith("${repo_path:"):
        return value[len("${repo_path:"):-1] + " (in the repository)"
    if value is None:
        return "null"
    if isinstance(value, list):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


HELP_FLAGS = {"--help": False, "-h": False, "--help=md": True}
"""Our help instead of Hydra's generic page (--hydra-help keeps Hydra's): True for markdown."""


@contextlib.contextmanager
def hydra_refusals_said_once() -> Iterator[None]:
    """Under a launcher every process reads the same command line, and Hydra refuses a mistake in it
    (a misspelt key, a wrong type) on each of them, before main() runs. Local rank 0 says it; the
    others hold what they would write until main() starts, and drop it if Hydra stopped them first
    (having waited for local rank 0 to end: exiting first, they would have the launcher stop it)."""
    if not launched_by_torchrun() or os.environ.get("LOCAL_RANK", "0") == "0":
        yield
        return
    sys.stderr = io.StringIO()
    try:
        yield
    except SystemExit:
        if sys.stderr is not sys.__stderr__:
            sys.stderr = sys.__stderr__
            said_by_local_rank_zero()
        raise
    finally:
        sys.stderr = sys.__stderr__


if __name__ == "__main__":
    asked = [HELP_FLAGS[arg] for arg in sys.argv[1:] if arg in HELP_FLAGS]
    if asked:
        print(config_reference(markdown=asked[0]))
    else:
        with hydra_refusals_said_once():
            main()
