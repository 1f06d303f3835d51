"""Training snapshots: what they hold, and writing and reading them safely (local or any fsspec URL).

- Atomic: a snapshot is written to a temporary name beside its target and renamed (copied then
  deleted, on object stores) only once complete, so a crash or a failed upload mid-save leaves the
  previous snapshot intact and never leaves a partial file under a snapshot's name.
- Safe: loaded with weights_only=True, so a snapshot can hold tensors and plain values but cannot
  run code.
- Self-describing: the vocabulary (and a BPE's tokenizer) and the model config travel with the
  weights, so a snapshot alone can rebuild its model and decode its output.
- Exact: the training position (epoch, batch within it, step) and every rank's RNG state, so a
  resumed run continues with the next unseen batch and the same dropout masks.

`trainer_config.snapshot_path` ending in `.pt` names one file, replaced at every save. Any other
path is a folder holding `snapshot_<step>.pt` files, of which the newest `keep_last` are kept;
resuming picks the newest.

This module is the format alone: it knows nothing of parallelism, so a reader such as generate.py
loads a snapshot without the distributed machinery. The stores that gather and shard a training
run's state (store.py, sharded_store.py) build on it.
"""
import io
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from mingpt.common import files
from mingpt.common.errors import SnapshotError, short_reason
from mingpt.model import VOCABULARY_WEIGHTS, padded_vocab_size
from mingpt.optimizer import MUON_GROUP

TRAINING_KEY = "trainer_config.snapshot_path"
"""What the user sets to point at snapshots; error messages name it (a command may name its own)."""
OPTIMIZER_KEY = "optimizer_config.name"
FOLDER_ENTRY = re.compile(r"snapshot_(\d+)\.pt$")
SHARDED_ENTRY = re.compile(r"sharded_(\d+)$")
"""A sharded snapshot's folder in a run folder (sharded_store.py writes them)."""
SHARDED_INFO = "info.pt"
"""Written last into a sharded snapshot's folder: there, the snapshot is complete."""
DIVERGED_INFO = "diverged_info.pt"
"""What a sharded snapshot's info.pt is renamed to when the run diverged after it: no run resumes
from that folder (storage/store.py, SetAside)."""
OLDER_MODEL_CONFIG = {"activation": "gelu", "vocab_multiple": 1}
"""What a snapshot written before a GPTConfig key was built with: filled in when it is read."""


@dataclass
class Progress:
    """Where training stands."""

    finished_epoch: int = 0
    """The last epoch trained to its end."""
    epoch_step: int = 0
    """Optimizer steps of the next epoch already taken (0 at an epoch boundary)."""
    epoch_samples: int = 0
    """Positions of the next epoch's global sample order already trained, over all ranks: where a
    resumed run continues, at any world size (data_loader.py)."""
    step: int = 0
    """Optimizer steps so far."""
    tokens: int = 0
    """Training tokens seen so far, over all ranks."""
    world_size: int = 1
    """Ranks that trained up to here: RNG states are per rank, so they resume at the same count."""
    tracked_runs: dict[str, str] = field(default_factory=dict, compare=False)
    """The run trackers' ids of this training run, by tracker (reporting/trackers.py): a resumed run
    continues them. Known to global rank 0 only, which writes them; not part of the position."""

    def advance(self, samples: int, tokens: int) -> None:
        """Count one optimizer step of samples and tokens over all ranks."""
        self.step += 1
        self.epoch_step += 1
        self.epoch_samples += samples
        self.tokens += tokens

    def finish_epoch(self, epoch: int) -> None:
        self.finished_epoch, self.epoch_step, self.epoch_samples = epoch, 0, 0

    @property
    def epoch(self) -> int:
        """The epoch training is in: the one under way, or at a boundary the one just finished."""
        return self.finished_epoch + 1 if self.epoch_samples else self.finished_epoch


@dataclass
class Snapshot(Progress):
    """Everything a run needs to continue exactly where it stopped (Progress's fields first)."""

    model_state: dict[str, torch.Tensor] = field(default_factory=dict)
    """Full model state dict, unprefixed parameter names."""
    optimizer_state: dict[str, Any] = field(default_factory=dict)
    """Full optimizer state dict, keyed by parameter name."""
    scaler_state: dict[str, Any] = field(default_factory=dict)
    """GradScaler state; empty when no scaler is in use."""
    rng_states: list[dict[str, Optional[torch.Tensor]]] = field(default_factory=list)
    """Per rank: the CPU and (when used) CUDA generator states when the snapshot was taken."""
    vocab: list[str] = field(default_factory=list)
    """The tokens in id order: characters, or a BPE's tokens."""
    model_config: dict[str, Any] = field(default_factory=dict)
    """The GPTConfig fields the model was built with."""
    tokenizer: str = ""
    """A BPE model's tokenizer.json (tokens/tokenizer.py); empty for characters (and in snapshots
    written before BPE)."""
    sample_order: dict[str, Any] = field(default_factory=dict)
    """What decided the training samples and their order (tokens/sample_order.py); empty in snapshots
    written before it was kept, or by a Trainer not given it."""

    @property
    def progress(self) -> Progress:
        return Progress(**{f.name: getattr(self, f.name) for f in fields(Progress)})

    def as_dict(self) -> dict[str, Any]:
        """The fields as a dict holding the same objects: dataclasses.asdict would deep-copy every
        tensor, a second copy of the whole state made during every save."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def check_matches(self, model_config: dict[str, Any], vocab: list[str], path: str, tokenizer: str = ""
                      ) -> None:
        """Refuse a snapshot of another model shape, activation or vocabulary, naming what differs."""
        shape_keys = ("n_layer", "n_head", "n_embd", "vocab_size", "vocab_multiple", "block_size",
                      "activation")
        ours, theirs = ({k: config.get(k) for k in shape_keys}
                        for config in (self.model_config, model_config))
        differ = [f"{k}={ours[k]} (config: {theirs[k]})" for k in shape_keys if ours[k] != theirs[k]]
        if differ:
            raise SnapshotError(f"snapshot {path} is of another model: {', '.join(differ)}; set "
                                "trainer_config.snapshot_path to a new location or match the model config")
        if self.vocab != vocab or self.tokenizer != tokenizer:
            raise SnapshotError(f"snapshot {path} was trained on another vocabulary; set "
                                "trainer_config.snapshot_path to a new location or use the snapshot's data")

    def check_optimizer(self, param_groups: list[dict[str, Any]], path: str) -> None:
        """Refuse a snapshot of another optimizer (optimizer_config.name) than param_groups' (this run's),
        naming both: AdamW's moments and Muon's momentum are not each other's, and loading one into the
        other fails deep inside torch (a KeyError of a parameter's state). Not converted: a run that
        changes optimizer starts afresh (docs/snapshots.md)."""
        groups = self.optimizer_state.get("param_groups")
        if not groups:
            return  # the state of a snapshot without param_groups is judged as it is loaded
        theirs, ours = optimizer_name(groups), optimizer_name(param_groups)
        if theirs != ours:
            raise SnapshotError(f"snapshot {path} was trained with {OPTIMIZER_KEY}={theirs}, and this run's is "
                                f"{ours}; set {OPTIMIZER_KEY}={theirs} to resume it, or set {TRAINING_KEY} to a "
                                f"new location to start afresh with {ours}")


def optimizer_name(param_groups: list[dict[str, Any]]) -> str:
    """The optimizer_config.name whose optimizer has these parameter groups (MuonWithAdamW flags its
    own; a snapshot keeps them as they were)."""
    return "muon" if any(group.get(MUON_GROUP) for group in param_groups) else "adamw"


def write_snapshot(snapshot: Snapshot, path: str) -> None:
    """Write snapshot to path (local or any fsspec URL), replacing the old one only when complete."""
    try:
        files.write_atomically(path, lambda f: torch.save(snapshot.as_dict(), f))
    except Exception as e:  # a full disk, a lost connection, a revoked credential
        raise write_error(path, e) from None


def write_error(path: str, error: BaseException, reason: Callable[[BaseException], str] = short_reason
                ) -> SnapshotError:
    """What a failed snapshot write says, for every store alike."""
    return SnapshotError(f"could not write snapshot {path} ({reason(error)}); "
                         "check trainer_config.snapshot_path, its credentials and free space")


def read_snapshot(path: str, key: str = TRAINING_KEY) -> Optional[Snapshot]:
    """The snapshot at path, None if there is none; SnapshotError if it is not a usable one."""
    advice = f"move it away or set {key} to another location"
    try:
        buffer = io.BytesIO(files.read_bytes(path))  # whole, then parsed: faster than a remote file object
    except FileNotFoundError:
        return None
    except Exception as e:
        raise SnapshotError(f"cannot read snapshot {path} ({short_reason(e)}); check {key} "
                            "and its credentials") from None
    try:
        state = torch.load(buffer, map_location="cpu", weights_only=True)
    except Exception as e:  # corrupt, truncated, or a pickle that would run code: all refused
        raise SnapshotError(f"snapshot {path} cannot be loaded ({short_reason(e)}); {advice}") from None
    expected = {f.name for f in fields(Snapshot)}
    # A snapshot of an earlier version may lack a later field (its default then holds), never have another.
    if not isinstance(state, dict) or not set(state) <= expected or "model_state" not in state:
        found = sorted(state) if isinstance(state, dict) else type(state).__name__
        raise SnapshotError(f"snapshot {path} is not a minGPT-DDP snapshot (holds {found}); {advice}")
    snapshot = Snapshot(**state)
    if snapshot.model_config:
        snapshot.model_config = {**OLDER_MODEL_CONFIG, **snapshot.model_config}
    return snapshot


def repadded(snapshot: Snapshot, model_config: dict[str, Any]) -> Snapshot:
    """The snapshot with its vocabulary's rows (model.VOCABULARY_WEIGHTS', and their optimizer
    state's) padded with zeros or cut to model_config's vocab_multiple. The padding's rows are zero
    and unused, so this is the same model: a snapshot of before padding resumes into a padded model."""
    config, vocab_multiple = snapshot.model_config, model_config.get("vocab_multiple")
    if vocab_multiple in (None, config.get("vocab_multiple")) or "vocab_size" not in config:
        return snapshot  # the same padding, or none to pad to or by (check_matches judges the rest)
    rows = padded_vocab_size(config["vocab_size"], vocab_multiple)

    def fit(name: str, value: Any) -> Any:
        if name not in VOCABULARY_WEIGHTS or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value  # another parameter's, or a scalar (AdamW's step)
        extra = rows - value.shape[0]
        return value[:rows] if extra <= 0 else torch.cat([value, value.new_zeros(extra, *value.shape[1:])])

    model_state = {name: fit(name, tensor) for name, tensor in snapshot.model_state.items()}
    state = {name: {key: fit(name, value) for key, value in values.items()}
             for name, values in snapshot.optimizer_state.get("state", {}).items()}
    return replace(snapshot, model_state=model_state, optimizer_state={**snapshot.optimizer_state,
                                                                       "state": state},
                   model_config={**config, "vocab_multiple": vocab_multiple})


def check_tensors_fit(model: nn.Module, snapshot: Snapshot) -> None:
    """ValueError naming a tensor the snapshot lacks, one the model has not, or one of another shape.
    Loading alone is not enough: it fills a missing weight with the model's fresh one, and it takes
    optimizer state of any shape (on which the first step crashes the process)."""
    shapes = {name: tuple(t.shape) for name, t in model.state_dict().items()}  # full shapes, even sharded
    optimizer_state = snapshot.optimizer_state.get("state", {})
    missing = sorted(shapes.keys() - snapshot.model_state.keys())
    if missing:
        raise ValueError(f"the snapshot lacks {', '.join(missing)}")
    unknown = sorted((snapshot.model_state.keys() | optimizer_state.keys()) - shapes.keys())
    if unknown:
        raise ValueError(f"the model has no {', '.join(unknown)}")
    tensors = [(name, name, tensor) for name, tensor in snapshot.model_state.items()]
    tensors += [(name, f"{name} ({key})", value) for name, state in optimizer_state.items()
                for key, value in state.items() if isinstance(value, torch.Tensor) and value.dim() > 0]
    for name, label, tensor in tensors:
        if tuple(tensor.shape) != shapes[name]:
            raise ValueError(f"the snapshot's {label} is {tuple(tensor.shape)}, the model's {shapes[name]}")


def list_entries(folder_url: str, pattern: re.Pattern = FOLDER_ENTRY,
                 complete: Callable[[str], bool] = lambda url: True, key: str = TRAINING_KEY) -> list[str]:
    """URLs of the folder's complete snapshots whose names match pattern (group 1: the step), oldest
    first; a SnapshotError naming key when the folder cannot be listed."""
    try:
        return files.numbered_entries(folder_url, pattern, complete)
    except Exception as e:
        raise SnapshotError(f"cannot list snapshots in {folder_url} ({short_reason(e)}); check {key} "
                            "and its credentials") from None


def step_of(url: str, pattern: re.Pattern = FOLDER_ENTRY) -> int:
    """The step in a snapshot entry's name (snapshot_<step>.pt, sharded_<step>)."""
    return int(pattern.search(url.rstrip("/")).group(1))


def beside(path: str, kind: str) -> str:
    """A single-file snapshot's sibling: `gpt_snapshot.pt` -> `gpt_snapshot.<kind>.pt`."""
    return f"{path[: -len('.pt')]}.{kind}.pt"


def is_folder(path: str) -> bool:
    """A snapshot path not ending in .pt is a folder of snapshot_<step>.pt files."""
    return not path.endswith(".pt")


def snapshot_folder(path: str) -> str:
    """Where a run's snapshots, and what lives beside them (metrics, reports), go: a folder path
    itself, or the folder of a .pt file."""
    return path.rstrip("/") if is_folder(path) else files.parent_folder(path)


def sharded_snapshot_at(path: str, key: str = TRAINING_KEY) -> Optional[str]:
    """A complete sharded snapshot's folder: path itself, or the newest in a run folder at path."""
    path = path.rstrip("/")
    if files.exists(f"{path}/{SHARDED_INFO}"):
        return path
    entries = sharded_entries(path, key)
    return entries[-1] if entries else None


def sharded_entries(folder: str, key: str = TRAINING_KEY) -> list[str]:
    """The complete sharded snapshots of a run folder (those with their info.pt), oldest first."""
    return list_entries(folder, SHARDED_ENTRY, complete=lambda url: files.exists(f"{url}/{SHARDED_INFO}"),
                        key=key)


def newest_snapshot(path: str, key: str = TRAINING_KEY) -> tuple[Optional[Snapshot], Optional[str]]:
    """The newest snapshot at path (a .pt file, or a folder's newest) and where it is, or (None, None)."""
    found = list_entries(path, key=key)[-1:] if is_folder(path) else [path]
    snapshot = read_snapshot(found[0], key) if found else None
    return (snapshot, found[0]) if snapshot else (None, None)
