"""Run by tests/distributed/test_muon.py under torchrun: a few steps of Muon (optimizer_config.name=muon)
on a tiny GPT placed by parallelize() for each case, and what came of them.

    torchrun --standalone --nproc_per_node=N tests/workers/muon_probe.py OUT_DIR CASE [CASE ...]

CASE: ddp (torch.optim.Muon on whole matrices: the yardstick of what another world size changes),
fsdp or hsdp, with _offload for CPU offload. hsdp takes two "nodes" of N / 2 ranks on this one
machine (the process group's local world size halved: the mesh is the one a 2-node run builds, and its
groups are real gloo groups). Every rank trains its share of the same global batches (STEPS of them)
through the Trainer's optimizer (distributed.muon.optimizer_for); then rank 0 writes
OUT_DIR/<case>.pt: the full model and optimizer state (parallel.gather_full_state) and the weights
after each step, and every rank
OUT_DIR/<case>_rank<R>.json: the shapes it orthogonalised and the bytes it sent to each rank, step by
step, and whether the exchange gave it, bit for bit, its rows of what orthogonalising each whole
momentum buffer on its own gives (the same input, so the same result, or the exchange is wrong).
"""
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

from mingpt.distributed import muon
from mingpt.distributed.parallel import Parallelism, gather_full_state, local_rows, parallelize
from mingpt.distributed.precision import resolve_precision
from mingpt.distributed.process_group import distributed_session
from mingpt.model import GPT, GPTConfig
from mingpt.optimizer import OptimizerConfig

SEED = 7
# 30 wide, 3 heads: over 4 ranks the matrices' rows (90, 30, 120, 30) split unevenly (23+23+23+21, 8+8+8+6)
TINY = GPTConfig(n_layer=2, n_head=3, n_embd=30, vocab_size=11, block_size=15, embd_pdrop=0.0,
                 resid_pdrop=0.0, attn_pdrop=0.0)
OPTIMIZER = OptimizerConfig(name="muon", learning_rate=3e-3, muon_learning_rate=0.02, weight_decay=0.1)
STEPS = 3
GLOBAL_BATCH = 8


def batches() -> list[torch.Tensor]:
    """The global batches, the same in every process: (GLOBAL_BATCH, block + 1) token windows."""
    generator = torch.Generator().manual_seed(SEED)
    return [torch.randint(TINY.vocab_size, (GLOBAL_BATCH, TINY.block_size + 1), generator=generator)
            for _ in range(STEPS)]


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int, ranks: int,
          after_step=lambda: None) -> None:
    """STEPS steps, each on this rank's rows of the global batch (all of it in one process)."""
    share = GLOBAL_BATCH // ranks
    for window in batches():
        mine = window[rank * share:(rank + 1) * share]
        optimizer.zero_grad(set_to_none=True)
        model(mine[:, :-1], mine[:, 1:])[1].backward()
        optimizer.step()
        after_step()


class Recorder:
    """What ShardedMuon does on this rank: each matrix it orthogonalises, each exchange's bytes sent."""

    def __init__(self):
        self.orthogonalised: list[list[int]] = []
        self.sent: list[list[int]] = []
        self._orthogonalise, self._all_to_all = muon.orthogonalise, muon._all_to_all
        muon.orthogonalise, muon._all_to_all = self.orthogonalise, self.all_to_all

    def orthogonalise(self, update, **settings):
        self.orthogonalised.append(list(update.shape))
        return self._orthogonalise(update, **settings)

    def all_to_all(self, tensor, receive, send, group):
        self.sent.append([count * muon.TRANSFER_DTYPE.itemsize for count in send])
        return self._all_to_all(tensor, receive, send, group)


def exchange_is_exact(optimizer) -> list[bool]:
    """For each hidden matrix of a sharded model: do its rows of the exchange's orthogonalisation of
    the momentum buffers equal, bit for bit, the rows of the whole buffer orthogonalised here?"""
    params = [p for group in optimizer.param_groups if group.get("muon") for p in group["params"]]
    if not params or not isinstance(params[0], DTensor):
        return []
    buffers = [optimizer.state[p]["momentum_buffer"] for p in params]
    rows = muon.exchange_and_orthogonalise(params, [b.to_local() for b in buffers], {})
    return [torch.equal(mine.cpu(), muon.orthogonalise(buffer.full_tensor())[local_rows(param)])
            for mine, buffer, param in zip(rows, buffers, params)]


def run_case(case: str, out: Path, env) -> None:
    method, _, offload = case.partition("_")
    placing_env = env
    if method == "hsdp":  # two nodes of half the ranks each, as torchrun would number them
        placing_env = dataclasses.replace(env, local_world_size=env.world_size // 2)
    with torch.device("meta"):
        model = GPT(TINY, seed=SEED)
    parallelism = Parallelism(method, cpu_offload=offload == "offload", cpu_collectives=True)
    model = parallelize(model, parallelism, resolve_precision(False, "float16", env.device), placing_env)
    optimizer = muon.optimizer_for(model, OPTIMIZER)
    recorder = Recorder()
    steps = []  # the full weights after each step (gathered on rank 0)
    try:
        train(model, optimizer, env.rank, env.world_size,
              after_step=lambda: steps.append(gather_full_state(model, optimizer)[0]))
    finally:
        muon.orthogonalise, muon._all_to_all = recorder._orthogonalise, recorder._all_to_all
    facts = {"orthogonalised": recorder.orthogonalised, "sent": recorder.sent,
             "muon_class": type(optimizer.muon).__name__, "exchange_exact": exchange_is_exact(optimizer)}
    (out / f"{case}_rank{env.rank}.json").write_text(json.dumps(facts))
    model_state, optimizer_state = gather_full_state(model, optimizer)
    if env.is_main:
        torch.save({"model": model_state, "optimizer": optimizer_state, "steps": steps}, out / f"{case}.pt")


if __name__ == "__main__":
    with distributed_session() as env:
        for case in sys.argv[2:]:
            run_case(case, Path(sys.argv[1]), env)
