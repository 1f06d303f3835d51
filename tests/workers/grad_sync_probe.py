"""Run by test_parallel.py under torchrun: does gradient accumulation communicate only once a step?

    torchrun --standalone --nproc_per_node=2 tests/workers/grad_sync_probe.py OUT_DIR

For ddp and then fsdp, one optimizer step of Trainer._run_batch over a batch of 32 samples per
rank, taken whole (grad_accum_steps=1) and as 2 micro-batches of 16 (grad_accum_steps=2), from the
same initial weights, without dropout. Each backward pass counts the gradient collectives it
issued: DDP's all-reduces through a comm hook, FSDP's reduce-scatters (and any all-reduce) by
counting calls of torch.distributed's functions and, on the CPU, of the all_to_all reduce-scatter
FSDP is given there (cpu_collectives.AllToAllReduceScatter). Writes OUT_DIR/syncs_rank{N}.json (per method and
accumulation: the collectives of each micro-batch's backward pass) and, from rank 0,
OUT_DIR/{method}_accum{n}.pt (the full model and optimizer state after the step).

Then, for activation checkpointing, the accumulated step again with dropout on, without and with
activation_checkpointing=full: OUT_DIR/{method}_dropout_{mode}.pt, and in
OUT_DIR/activations_rank{N}.json the bytes each micro-batch's forward pass saved for backward.
Last, FSDP's accumulated step with dropout once more, its gathered parameters kept from the forward
to the backward pass (reshard_after_forward=False): OUT_DIR/fsdp_dropout_kept_after_forward.pt.
"""
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from mingpt.char_dataset import CharDataset
from mingpt.distributed import cpu_collectives
from mingpt.distributed.activation_checkpointing import saved_activations
from mingpt.distributed.parallel import gather_full_state
from mingpt.distributed.process_group import distributed_session
from mingpt.model import GPT, GPTConfig
from mingpt.optimizer import OptimizerConfig
from mingpt.reporting import run_report
from mingpt.start_up import place_model
from mingpt.trainer import Trainer, TrainerConfig

BATCH = 32
REDUCING = ("all_reduce", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single")


class CollectiveCount:
    """Gradient collectives issued so far on this rank."""

    def __init__(self):
        self.count = 0

    def ddp_hook(self, state, bucket):
        self.count += 1
        return default_hooks.allreduce_hook(None, bucket)

    def patch_torch_distributed(self) -> None:
        """FSDP calls torch.distributed's functions through the module: count every reducing one,
        and the reduce-scatter cpu_collectives.py gives FSDP on the CPU (an all_to_all, which FSDP's
        all-gathers use too, so all_to_all itself is not counted)."""
        for name in REDUCING:
            if hasattr(dist, name):
                setattr(dist, name, self._counting(getattr(dist, name)))
        reduce_scatter = cpu_collectives.AllToAllReduceScatter
        reduce_scatter.__call__ = self._counting(reduce_scatter.__call__)

    def _counting(self, function):
        def counted(*args, **kwargs):
            self.count += 1
            return function(*args, **kwargs)
        return counted


def one_step(method: str, accum: int, dataset: CharDataset, inputs, targets, env, counter, saved_as: Path,
             dropout: float = 0.0, **settings) -> tuple[list[int], list[int]]:
    """One _run_batch, its end state saved (rank 0) as saved_as; returns the collectives each
    micro-batch's backward pass issued, and the bytes each forward pass saved for backward.
    settings: more TrainerConfig fields."""
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=dataset.vocab_size, block_size=16,
                          embd_pdrop=dropout, resid_pdrop=dropout, attn_pdrop=dropout))
    config = TrainerConfig(batch_size=BATCH // accum, grad_accum_steps=accum, data_loader_workers=0,
                           use_amp=False, distributed_method=method, **settings,
                           snapshot_path=f"memory://grad_sync/{saved_as.stem}/")
    placed = place_model(config, OptimizerConfig(learning_rate=3e-3), model, env)
    trainer = Trainer(config, placed, dataset, None, dataset.vocab, env)
    if method == "ddp":
        trainer.model.register_comm_hook(None, counter.ddp_hook)
    per_backward, saved = [], []
    backward, compute_loss = trainer.backward, trainer.compute_loss

    def counted_backward(loss):
        before = counter.count
        backward(loss)
        per_backward.append(counter.count - before)

    def measured_loss(inputs, targets):
        with saved_activations() as activations:
            loss = compute_loss(inputs, targets)
        saved.append(activations.bytes)
        return loss

    trainer.backward, trainer.compute_loss = counted_backward, measured_loss
    torch.manual_seed(1 + env.rank)  # dropout masks of this rank's own
    trainer._run_batch(inputs, targets)
    model_state, optimizer_state = gather_full_state(trainer.model, trainer.optimizer)
    if env.is_main:
        state = {"model": model_state, "optimizer": optimizer_state}
        torch.save(state, saved_as)
    return per_backward, saved


def record(out_dir: Path, env) -> None:
    """Every step above, written to out_dir. It counts collectives by patching torch.distributed's
    functions for the rest of the process: a process that probes more runs this last."""
    run_report.peak_flops = lambda device, dtype: None  # no MFU here: skip timing matmuls (2 s)
    counter = CollectiveCount()
    counter.patch_torch_distributed()
    dataset = CharDataset("".join(chr(97 + (i * 31) % 20) for i in range(2000)), 16)
    own_batch = torch.Generator().manual_seed(env.rank)  # each rank its own samples
    ids = torch.randint(dataset.vocab_size, (BATCH, 17), generator=own_batch)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    syncs = {method: {accum: one_step(method, accum, dataset, inputs, targets, env, counter,
                                      out_dir / f"{method}_accum{accum}.pt")[0]
                      for accum in (1, 2)}
             for method in ("ddp", "fsdp")}
    (out_dir / f"syncs_rank{env.rank}.json").write_text(json.dumps(syncs))
    activations = {method: {mode: one_step(method, 2, dataset, inputs, targets, env, counter,
                                           out_dir / f"{method}_dropout_{mode}.pt", dropout=0.1,
                                           activation_checkpointing=mode)[1]
                            for mode in ("none", "full")}
                   for method in ("ddp", "fsdp")}
    (out_dir / f"activations_rank{env.rank}.json").write_text(json.dumps(activations))
    one_step("fsdp", 2, dataset, inputs, targets, env, counter,
             out_dir / "fsdp_dropout_kept_after_forward.pt", dropout=0.1, reshard_after_forward=False)


if __name__ == "__main__":
    with distributed_session() as env:
        record(Path(sys.argv[1]), env)
