"""A model rebuilt to be read, not trained: from a snapshot (whatever form a run wrote it in) or a
Hugging Face GPT-2 folder, with the Vocabulary its text is read and written with.

The commands that run a saved model (generate.py, hellaswag.py) share this: a command never imports
another. Nothing here needs a process group (no FSDP is loaded): a sharded snapshot is read whole in
this process (snapshot_at), and a folder's weights are read as gpt_config.init_from reads
them (gpt2_folder.py), so the model is the one training would have started from.
"""
from typing import Optional

import torch

from mingpt.common.errors import ConfigError, MinGPTError, SnapshotError, short_reason
from mingpt.common.files import is_file
from mingpt.model import GPT, GPTConfig
from mingpt.storage import gpt2_folder
from mingpt.storage.snapshot import Snapshot, newest_snapshot, read_snapshot, sharded_snapshot_at
from mingpt.tokens.tokenizer import Vocabulary, read_tokenizer_file

SNAPSHOT_OPTION = "--snapshot"
"""What the commands call the snapshot they read: error messages name it."""


def snapshot_at(path: str, key: str) -> tuple[Optional[Snapshot], Optional[str]]:
    """For the commands that read a snapshot a user names (key: the option naming it), whatever the
    run wrote: any file, whatever its name; a sharded_<step> folder, or a run folder of those (its
    newest complete one); a folder of snapshot_<step>.pt files (its newest). (None, None): none."""
    if is_file(path):
        return read_snapshot(path, key=key), path
    sharded = sharded_snapshot_at(path, key)
    if sharded is not None:
        from mingpt.storage.sharded_store import read_whole  # DCP: loaded for a sharded snapshot only

        return read_whole(sharded), sharded
    return newest_snapshot(path, key=key)


def find_snapshot(path: str) -> tuple[Snapshot, str]:
    """The snapshot at path (snapshot_at: a file, a run's folder, a sharded snapshot) and where
    it is."""
    try:
        snapshot, found = snapshot_at(path, key=SNAPSHOT_OPTION)
    except MinGPTError:
        raise
    except Exception as e:  # an unknown URL protocol, a missing fsspec backend, no credentials
        raise SnapshotError(f"snapshot {path} cannot be reached ({short_reason(e)}); check --snapshot "
                            "and its credentials") from None
    if snapshot is None:
        raise SnapshotError(f"no snapshot at {path} (a snapshot file, a run's snapshot folder, or a "
                            "sharded_<step> folder); train one first (python mingpt/main.py) or pass "
                            "--snapshot PATH")
    return snapshot, found


def build_model(snapshot: Snapshot, path: str, device: torch.device) -> GPT:
    """The GPT the snapshot was trained as, with its weights, in eval mode on device. Built on the
    meta device and given the snapshot's tensors themselves (assign): no initial weights are drawn
    only to be overwritten, and the model is in memory once."""
    try:
        with torch.device("meta"):
            model = GPT(GPTConfig(**snapshot.model_config))
        model.load_state_dict(snapshot.model_state, assign=True)
    except (TypeError, ValueError, RuntimeError) as e:  # a snapshot of another code version, or damaged
        raise SnapshotError(f"snapshot {path} does not rebuild a model ({short_reason(e)}); "
                            "was it written by another version of minGPT-DDP?") from None
    if len(snapshot.vocab) != model.config.vocab_size:
        raise SnapshotError(f"snapshot {path} has {len(snapshot.vocab)} vocabulary tokens for a model "
                            f"of vocab_size {model.config.vocab_size}; it is damaged")
    return model.to(device).eval()


def snapshot_model(path: str, device: torch.device) -> tuple[GPT, Vocabulary, str]:
    """The model of the snapshot at path, its Vocabulary, and where the snapshot was found."""
    snapshot, found = find_snapshot(path)
    return build_model(snapshot, found, device), Vocabulary.kept(snapshot.vocab, snapshot.tokenizer), found


def folder_model(path: str, device: torch.device, option: str) -> tuple[GPT, Vocabulary]:
    """The model of a GPT-2 folder (all its n_positions as block_size, its activation) and its BPE,
    checked as gpt_config.init_from checks it; its refusals name option instead of that key."""
    try:
        folder = gpt2_folder.open_folder(path)
    except ConfigError as refused:
        raise MinGPTError(f"{option}: {str(refused).removeprefix(refused.key + ': ')}") from None
    config = GPTConfig(**folder.sizes, vocab_size=folder.vocab_size, block_size=folder.n_positions,
                       activation=folder.activation)
    with torch.device("meta"):
        model = GPT(config, weights=folder)
    model.to_empty(device="cpu").init_weights()  # each weight read from the folder (model.initial_value)
    vocabulary = Vocabulary.from_json(read_tokenizer_file(folder.tokenizer_path, key=option).json)
    return model.to(device).eval(), vocabulary
