"""Entry for the HSDP test (tests/end_to_end/test_cluster.py): mingpt/main.py under torchrun, with
instruments.

    ALSO_SHARDED=FOLDER [SHARDS_DIR=DIR] torchrun ... tests/workers/hsdp_main.py [hydra overrides]

- ALSO_SHARDED: every snapshot is also written in the sharded format (DCP) into FOLDER, so that one
  run saves a model both ways: gathered into one file, and shard by shard. At the start the newest
  sharded snapshot there, if any, is loaded first, then the configured snapshot over it (the run
  continues from the latter); with SHARDS_DIR, what each load left on the rank is recorded in
  DIR/restored_<format>_rank<R>.pt, to compare.
- SHARDS_DIR: when training ends, each rank saves what it holds to DIR/rank<R>.pt: its host's name,
  its parameters' local shards, their bytes, and each parameter's mesh shape and placements. HSDP's
  replicas can then be compared across hosts, and its mesh read from the tensors themselves.
"""
import os
import runpy
import socket
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

import mingpt
from mingpt import trainer as trainer_module
from mingpt.distributed.parallel import local_parameter_bytes
from mingpt.storage import (
    checkpointer as checkpointer_module,  # the modules main.py will import, patched below
)
from mingpt.storage.sharded_store import ShardedSnapshotStore

MINGPT = Path(mingpt.__file__).parent  # main.py, run below as `python main.py` would be


def local(tensor):
    """This rank's part of a tensor: a DTensor's local shard, a plain tensor (or value) whole."""
    return tensor.to_local().clone() if hasattr(tensor, "to_local") else tensor


def held_state(model, optimizer) -> dict:
    """What this rank holds of the weights and of AdamW's state, by parameter name."""
    names = {parameter: name for name, parameter in model.named_parameters()}
    return {"model": {name: local(p.detach()) for p, name in names.items()},
            "optimizer": {names[p]: {key: local(value) for key, value in state.items()}
                          for p, state in optimizer.state.items()}}


class AlsoSharded:
    """The configured snapshot store, with a sharded store beside it (see the module's docstring)."""

    def __init__(self, store, sharded_folder: str, record_to: Optional[Path]):
        self.store = store
        self.sharded = ShardedSnapshotStore(sharded_folder, keep_last=1)
        self.record_to = record_to

    def save(self, model, optimizer, info, is_main):
        self.sharded.save(model, optimizer, info, is_main)
        return self.store.save(model, optimizer, info, is_main)

    def restore(self, model, optimizer, *args):
        for name, store in (("sharded", self.sharded), ("single", self.store)):
            restored = store.restore(model, optimizer, *args)
            if restored[0] is not None and self.record_to:
                torch.save(held_state(model, optimizer),
                           self.record_to / f"restored_{name}_rank{dist.get_rank()}.pt")
        return restored

    def __getattr__(self, name):
        return getattr(self.store, name)


def also_sharded(folder: str, record_to: Optional[Path]) -> None:
    open_store = checkpointer_module.open_snapshot_store
    checkpointer_module.open_snapshot_store = lambda policy, env: AlsoSharded(open_store(policy, env), folder,
                                                                              record_to)


def record_shards(folder: Path) -> None:
    train = trainer_module.Trainer.train

    def train_and_record(self):
        train(self)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()  # the root keeps its parameters gathered after the eval pass's forward
        parameters = dict(self.model.named_parameters())
        torch.save({
            "host": socket.gethostname(),
            "shards": held_state(self.model, self.optimizer)["model"],
            "bytes": local_parameter_bytes(self.model),
            "mesh_shapes": {tuple(p.device_mesh.shape) for p in parameters.values()},
            "placements": {str(p.placements) for p in parameters.values()},
        }, folder / f"rank{self.env.rank}.pt")

    trainer_module.Trainer.train = train_and_record


if __name__ == "__main__":
    shards_dir = Path(os.environ["SHARDS_DIR"]) if "SHARDS_DIR" in os.environ else None
    if "ALSO_SHARDED" in os.environ:
        also_sharded(os.environ["ALSO_SHARDED"], shards_dir)
    if shards_dir:
        record_shards(shards_dir)
    # As a script, so that Hydra finds its config beside main.py.
    runpy.run_path(str(MINGPT / "main.py"), run_name="__main__")
