"""Entry for the HSDP test (tests/test_cluster.py): mingpt/main.py under torchrun, with two instruments.

    ALSO_SHARDED=FOLDER SHARDS_DIR=DIR torchrun ... tests/hsdp_main.py [hydra overrides]

- ALSO_SHARDED: every snapshot is also written in the sharded format (DCP) into FOLDER, so that one
  run shows both ways of saving a model on a 2-D mesh: gathered into one file, and shard by shard.
- SHARDS_DIR: when training ends, each rank saves what it holds to DIR/rank<R>.pt: its host's name,
  its parameters' local shards, their bytes, and each parameter's mesh shape and placements. HSDP's
  replicas can then be compared across hosts, and its mesh read from the tensors themselves.
"""
import os
import runpy
import socket
import sys
from pathlib import Path

import torch
from torch.distributed.fsdp import FSDPModule

MINGPT = Path(__file__).resolve().parent.parent / "mingpt"
sys.path.insert(0, str(MINGPT))

import trainer as trainer_module  # noqa: E402  (the module main.py will import, patched below)
from parallel import local_parameter_bytes  # noqa: E402
from sharded_snapshot import ShardedSnapshotStore  # noqa: E402


class AlsoSharded:
    """The configured snapshot store, with a sharded store saving beside it; restores from the former."""

    def __init__(self, store, sharded_folder: str):
        self.store = store
        self.sharded = ShardedSnapshotStore(sharded_folder, keep_last=1)

    def save(self, model, optimizer, info, is_main):
        self.sharded.save(model, optimizer, info, is_main)
        return self.store.save(model, optimizer, info, is_main)

    def __getattr__(self, name):
        return getattr(self.store, name)


def also_sharded(folder: str) -> None:
    open_store = trainer_module.open_snapshot_store
    trainer_module.open_snapshot_store = lambda config: AlsoSharded(open_store(config), folder)


def record_shards(folder: str) -> None:
    train = trainer_module.Trainer.train

    def train_and_record(self):
        train(self)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()  # the root keeps its parameters gathered after the eval pass's forward
        parameters = dict(self.model.named_parameters())
        torch.save({
            "host": socket.gethostname(),
            "shards": {name: p.detach().to_local().clone() for name, p in parameters.items()},
            "bytes": local_parameter_bytes(self.model),
            "mesh_shapes": {tuple(p.device_mesh.shape) for p in parameters.values()},
            "placements": {str(p.placements) for p in parameters.values()},
        }, Path(folder) / f"rank{self.env.rank}.pt")

    trainer_module.Trainer.train = train_and_record


if __name__ == "__main__":
    if "ALSO_SHARDED" in os.environ:
        also_sharded(os.environ["ALSO_SHARDED"])
    if "SHARDS_DIR" in os.environ:
        record_shards(os.environ["SHARDS_DIR"])
    # As a script, so that Hydra finds its config beside main.py.
    runpy.run_path(str(MINGPT / "main.py"), run_name="__main__")
