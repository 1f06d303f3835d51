"""The run's configuration, shared by the commands that read it: main.py trains with it, plan.py and
model_size.py plan and size the run main.py would start (commands never import each other).

Hydra composes gpt2_train_cfg.yaml (or a YAML beside it, `--config-name laptop`) over the typed
schema below, TrainConfig: the original's four groups and the run trackers'. A misspelt key is refused
before anything runs, in one line with the key it may have meant; the result is turned into
dataclasses once, by load_config, and their checks reject out-of-range values naming the key.
"""
import contextlib
import dataclasses
import difflib
import inspect
import io
import os
import sys
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from mingpt.char_dataset import REPO_ROOT, DataConfig
from mingpt.common.errors import MinGPTError, check, command, say_line
from mingpt.common.field_docs import field_docs
from mingpt.distributed.fault_tolerance import FaultToleranceConfig
from mingpt.distributed.process_group import said_by_local_rank_zero
from mingpt.model import GPTConfig
from mingpt.optimizer import OptimizerConfig
from mingpt.reporting.trackers import TrackerConfig
from mingpt.trainer import TrainerConfig


@dataclass
class TrainConfig:
    """The whole config: the original's four groups, the run trackers' and fault tolerance's."""

    data_config: DataConfig = field(default_factory=DataConfig)
    gpt_config: GPTConfig = field(default_factory=GPTConfig)
    trainer_config: TrainerConfig = field(default_factory=TrainerConfig)
    optimizer_config: OptimizerConfig = field(default_factory=OptimizerConfig)
    tracker_config: TrackerConfig = field(default_factory=TrackerConfig)
    fault_tolerance_config: FaultToleranceConfig = field(default_factory=FaultToleranceConfig)

    def __post_init__(self) -> None:
        derived_keys = (("vocab_size", "the data's tokenizer"), ("block_size", "data_config.block_size"))
        for derived, source in derived_keys:
            check(getattr(self.gpt_config, derived) is None, f"gpt_config.{derived}",
                  f"comes from {source}; do not set it")
        self.fault_tolerance_config.check_method(self.trainer_config.distributed_method)


CONFIG_DIR = Path(__file__).resolve().parent
"""gpt2_train_cfg.yaml's folder: Hydra's config path, and the one of laptop.yaml and yours."""
DEFAULT_CONFIG = "gpt2_train_cfg"
ConfigStore.instance().store(name="train_config_schema", node=TrainConfig)
OmegaConf.register_new_resolver("repo_path", lambda relative: str(REPO_ROOT / relative), replace=True)


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
        check_not_moved(f"{prefix}{key}")
        check(key in fields, f"{prefix}{key}", f"is not a key of {schema.__name__}, so nothing would read "
              f"it{did_you_mean(prefix, key, fields)} (a leading + adds a key); `python main.py --cfg job` "
              "prints every key")
        if dataclasses.is_dataclass(fields[key].type):
            check_known_keys(node[key], f"{prefix}{key}.")


MOVED_KEYS = {
    "trainer_config.fault_tolerant": "fault_tolerance_config.enabled",
    **{f"trainer_config.ft_{key}": f"fault_tolerance_config.{key}"
       for key in ("lighthouse", "replica_group", "replica_groups", "min_replica_groups", "timeout_s",
                   "quorum_timeout_s")},
}
"""Keys of earlier releases and where they are now: refused by name, with the new one."""


def check_not_moved(key: str) -> None:
    moved = MOVED_KEYS.get(key.lstrip("+"))
    check(moved is None, key.lstrip("+"), f"moved to {moved}; set that instead")


def did_you_mean(prefix: str, key: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
    return f" (did you mean {prefix}{close[0]}?)" if close else ""


def check_overrides(overrides: Sequence[str]) -> None:
    """Refuse an override whose key the schema does not have, in one line with the key it may have
    meant, before Hydra does it in eight (`Could not override 'trainer_config.bsz'...`). Hydra's own
    keys, additions (+key) and deletions (~key) are left to Hydra."""
    for override in overrides:
        key = override.split("=", 1)[0]
        check_not_moved(key)
        if "=" not in override or key.startswith(("+", "~", "hydra.")) or key.startswith("-"):
            continue
        node, prefix = TrainConfig, ""
        for part in key.split("."):
            if not dataclasses.is_dataclass(node):
                break
            fields = {f.name: f for f in dataclasses.fields(node)}
            check(part in fields, f"{prefix}{part}", f"is not a key of {node.__name__}"
                  f"{did_you_mean(prefix, part, fields)}; `python main.py --help` lists every key")
            node, prefix = fields[part].type, f"{prefix}{part}."


def compose_config(overrides: Sequence[str] = (), config_name: str = DEFAULT_CONFIG) -> DictConfig:
    """The config Hydra composes for main.py from a YAML beside it and overrides (for the commands that
    read the run's config without running it: plan.py, model_size.py, --help)."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name, overrides=list(overrides))


CONFIG_NAME_HELP = ("a YAML beside gpt2_train_cfg.yaml whose keys the run uses, as main.py's "
                    "--config-name (default: %(default)s)")


def from_command_line(overrides: Sequence[str], command: str, config_name: str = DEFAULT_CONFIG) -> TrainConfig:
    """The typed config main.py would train with, for a command given `--config-name NAME` (a YAML
    beside gpt2_train_cfg.yaml) and key=value overrides besides its own options."""
    for item in overrides:
        check("=" in item, item, f"is neither an option of {command} nor a key=value override (see --help)")
    check(bool(config_name) and (CONFIG_DIR / f"{config_name}.yaml").exists(), "--config-name",
          f"{config_name!r} is no YAML beside {CONFIG_DIR / DEFAULT_CONFIG}.yaml")
    check_overrides(overrides)
    try:
        return load_config(compose_config(overrides, config_name))
    except (HydraException, OmegaConfBaseException) as error:
        raise MinGPTError(str(error).splitlines()[0]) from None


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


def config_reference(markdown: bool = False) -> str:
    """Every key with its default and its docstring: `main.py --help`, or docs/configuration.md."""
    defaults = compose_config()
    parts = [MARKDOWN_HEAD if markdown else HELP_HEAD]
    for group in dataclasses.fields(TrainConfig):
        docs = field_docs(group.type)
        values = OmegaConf.to_container(defaults[group.name], resolve=False)
        values = {key: values[key] for key in own_keys_first(group.type)}
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


def own_keys_first(cls: type) -> list[str]:
    """A config's keys, its own class's first, then each group it takes keys from (its bases)."""
    keys = []
    for owner in [c for c in cls.__mro__ if c is not object]:
        keys += [name for name in vars(owner).get("__annotations__", {}) if name not in keys]
    return keys


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


class HydraSpeech:
    """What Hydra writes before main() runs, held back: under a launcher every process reads the same
    command line, and Hydra refuses a mistake in it (a value of the wrong type, a YAML it cannot
    parse, a --config-name it cannot find) on each of them, in several lines or a whole traceback.
    When Hydra stops the process, local rank 0 says its refusal in one line (hydra_line) and the
    others drop it (having waited for local rank 0 to end: exiting first, they would have the launcher
    stop it); when main() starts (speak_again), whatever Hydra said on the way is written as it was."""

    held: "io.StringIO | None" = None

    @classmethod
    @contextlib.contextmanager
    def held_back(cls) -> Iterator[None]:
        cls.held = sys.stderr = io.StringIO()
        try:
            yield
        except SystemExit as stop:
            if cls.held is not None:  # main() never ran: Hydra (or the key check) refused the command line
                said, cls.held = cls.held.getvalue(), None
                sys.stderr = sys.__stderr__
                if stop.code and said.strip() and not said_by_local_rank_zero():
                    say_line(said.rstrip("\n") if said.startswith("error:") else f"error: {hydra_line(said)}")
            raise
        finally:
            cls.held = None
            sys.stderr = sys.__stderr__

    @classmethod
    def speak_again(cls) -> None:
        """main() runs: the process speaks for itself again (local rank 0 what Hydra said meanwhile)."""
        said = cls.held.getvalue() if cls.held is not None else ""
        cls.held, sys.stderr = None, sys.__stderr__
        if said and os.environ.get("LOCAL_RANK", "0") == "0":
            sys.stderr.write(said)


HYDRA_HINT = "Set the environment variable HYDRA_FULL_ERROR=1"


def hydra_line(said: str) -> str:
    """Hydra's refusal in one line: the message of a traceback's exception (a YAML parser's), or the
    unindented lines of its first paragraph ("Error merging override ...: Value 'abc' of type 'str'
    could not be converted to Integer"); a --config-name it cannot find gets the configs there are."""
    traceback = "Traceback (most recent call last):"
    if traceback in said:
        lines = said.rsplit(traceback, 1)[1].splitlines()
        lines = lines[next(i for i, line in enumerate(lines) if line and not line[0].isspace()):]
        lines[0] = lines[0].split(": ", 1)[-1]  # the message, not the exception's class
    else:
        lines = [line for line in said.strip().split("\n\n")[0].splitlines() if line and not line[0].isspace()]
    line = ""
    for part in (part for part in lines if part.strip() and HYDRA_HINT not in part):
        line += (" " if part[0].isspace() else "; " if line else "") + part.strip()
    if line.startswith("Cannot find primary config"):
        configs = ", ".join(sorted(path.stem for path in CONFIG_DIR.glob("*.yaml")))
        line += f" (the configs beside main.py: {configs})"
    return line


def run_command_line(main: Callable[[], None]) -> None:
    """main.py's command line: this project's help pages (--help, --help=md), else a misspelt key
    refused in one line, then Hydra's main, each said once under a launcher."""
    asked = [HELP_FLAGS[arg] for arg in sys.argv[1:] if arg in HELP_FLAGS]
    if asked:
        command(lambda: print(config_reference(markdown=asked[0])))()  # `| head` ends it quietly
        return
    with HydraSpeech.held_back():
        refuse_misspelt_keys()
        main()


@command
def refuse_misspelt_keys() -> None:
    check_overrides(arg for arg in sys.argv[1:] if not arg.startswith("-"))
