"""Entry for the fault-tolerance tests: one replica group's main.py (through fault_injection.py, so
that SLOW and FAULT apply), with what the tests look at afterwards or plant:

    FINAL_WEIGHTS=DIR   at the end of training, the model's weights (a rank's shards under hsdp) into
                        DIR/group<g>.rank<r>.pt
    HEAL_DELAY=S        a joining group takes S seconds longer to load the state it heals from
                        (a slow transfer), printing "healing: loading" first, so that a test can kill it
                        in the middle of its healing
"""
import os
import runpy
import time
from pathlib import Path

import torch

from mingpt.distributed import fault_tolerance
from mingpt.distributed.parallel import unwrap
from mingpt.trainer import Trainer

WORKERS = Path(__file__).resolve().parent


def save_final_weights(folder: str) -> None:
    original = Trainer.train

    def train(self):
        original(self)
        state = {name: fault_tolerance.local_shards(tensor).detach().clone()  # under hsdp this rank's shards
                 for name, tensor in unwrap(self.model).state_dict().items()}
        torch.save(state, Path(folder) / f"group{self.replicas.settings.replica_group}.rank{self.env.rank}.pt")

    Trainer.train = train


def slow_healing(seconds: float) -> None:
    original = fault_tolerance.Replicas.keep

    def keep(self, model, optimizer, scaler, progress):
        original(self, model, optimizer, scaler, progress)
        if not self.active:
            return
        heal = self.manager._load_state_dict_fns["training"]  # the callback keep() registered

        def slow_heal(received):
            print("healing: loading", flush=True)
            time.sleep(seconds)
            heal(received)

        self.manager._load_state_dict_fns["training"] = slow_heal

    fault_tolerance.Replicas.keep = keep


if __name__ == "__main__":
    if "FINAL_WEIGHTS" in os.environ:
        save_final_weights(os.environ["FINAL_WEIGHTS"])
    if "HEAL_DELAY" in os.environ:
        slow_healing(float(os.environ["HEAL_DELAY"]))
    runpy.run_path(str(WORKERS / "fault_injection.py"), run_name="__main__")
