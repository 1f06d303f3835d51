"""Muon where FSDP2 shards the matrices it trains (fsdp, hsdp, with or without CPU offload).

Muon orthogonalises each hidden matrix's update whole (optimizer.orthogonalise): the rows a rank
holds are not enough. Under DDP every rank holds every matrix and torch.optim.Muon runs as it is. Under
fsdp and hsdp each rank holds a share of every matrix's rows (parallel.local_rows), so ShardedMuon
splits the step in three, as torchtitan's and Dion's distributed Muon do:

1. momentum, on this rank's rows: Muon's momentum and its Nesterov look-ahead are element-wise, so
   each rank updates its own rows of the momentum buffer (sharded as the parameter is, and so saved
   and resharded by the snapshots as AdamW's moments are);
2. orthogonalisation, whole: each matrix has an owner among the ranks that shard it (a node's ranks
   under hsdp), the matrices dealt out so that every owner has about the same Newton-Schulz work
   (owners); one all_to_all brings each owner the other ranks' rows of its matrices, it
   orthogonalises them, and a second all_to_all sends every rank its rows of the results;
3. the update, on this rank's rows: decoupled weight decay and the step, at the learning rate
   torch.optim.Muon would use for the whole matrix's shape (optimizer.muon_scale).

The rows travel in bf16, the precision Newton-Schulz computes in anyway (its first act is to round
the update to bf16, and its result is bf16), so the update is the one a single process computes from
the same gradient, up to the gradient's own rounding (tests/test_optimizer.py and
tests/distributed/test_muon.py hold it so on 2 and 4 ranks). Each rank sends and receives about
2 x 2 bytes x (hidden parameters) x (S - 1) / S^2 per step for S ranks sharding (hidden_traffic):
for S = 8, a 16th of the bytes one all-gather of those matrices in fp32 moves. Under hsdp each node
does the same work on its own copy, as every DDP rank does all of it.

With CPU offload the shards live in host memory: the rows go to the device the mesh communicates on
(a GPU under NCCL) and are orthogonalised there, and the results come back to the host.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from mingpt.distributed.parallel import is_sharded
from mingpt.optimizer import OptimizerConfig, create_optimizer, muon_scale, orthogonalise

TRANSFER_DTYPE = torch.bfloat16
"""What the rows travel in: Newton-Schulz's own precision (optimizer.orthogonalise)."""


def optimizer_for(model: nn.Module, config: OptimizerConfig) -> torch.optim.Optimizer:
    """The optimizer of a wrapped model: optimizer.create_optimizer's, with ShardedMuon for the
    hidden matrices of a model that fsdp or hsdp sharded."""
    return create_optimizer(model, config, muon=ShardedMuon if is_sharded(model) else torch.optim.Muon)


def ns_cost(shape: torch.Size) -> int:
    """Multiply-adds of one Newton-Schulz iteration of a rows x columns matrix: three products of the
    shorter side's Gram matrix (short^2 x long twice, short^3 once)."""
    short, long = sorted(shape[:2])
    return 2 * short * short * long + short ** 3


def owners(shapes: list[torch.Size], ranks: int) -> list[int]:
    """The rank that orthogonalises each matrix: the costliest first, each to the rank with the least
    work so far (the lowest-numbered of those tied), so that the slowest rank does about 1 / ranks of
    the work; the same on every rank (it depends on the shapes alone)."""
    load, owner = [0] * ranks, [0] * len(shapes)
    for index in sorted(range(len(shapes)), key=lambda i: (-ns_cost(shapes[i]), i)):
        rank = load.index(min(load))
        owner[index] = rank
        load[rank] += ns_cost(shapes[index])
    return owner


def hidden_traffic(hidden: int, shards: int) -> int:
    """Bytes a rank sends per step (and receives) for ShardedMuon over `shards` ranks, for `hidden`
    parameters in the matrices it trains: its rows of the other owners' matrices out in bf16, and
    the other ranks' rows of its own results back. Padding rows aside."""
    return 2 * TRANSFER_DTYPE.itemsize * hidden * (shards - 1) // (shards * shards)


@dataclass(frozen=True)
class _Matrix:
    """One sharded matrix as the exchange sees it: its whole shape, the rows of a chunk (FSDP2's
    ceil(rows / shards)) and the rows this rank holds."""

    shape: torch.Size
    chunk: int
    local_rows: int

    @property
    def chunk_size(self) -> int:
        return self.chunk * self.shape[1]


class ShardedMuon(torch.optim.Muon):
    """torch.optim.Muon's update for matrices fsdp or hsdp shards (DTensors, rows split over a mesh
    dimension), with the same arguments, parameter groups and state (one momentum buffer per
    matrix, a DTensor sharded as its parameter): see the module's docstring. A plain tensor (a
    model that is not sharded) is orthogonalised where it is."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params, grads, buffers = [], [], []
            self._init_group(group, params, grads, buffers)
            momentum, lr = group["momentum"], group["lr"]
            updates = []
            for grad, buffer in zip(grads, buffers):
                grad, buffer = _local(grad), _local(buffer)
                buffer.lerp_(grad, 1 - momentum)
                updates.append(grad.lerp(buffer, momentum) if group["nesterov"] else buffer)
            orthogonal = self._orthogonalise(params, updates, group)
            for param, update in zip(params, orthogonal):
                rows = _local(param)
                rows.mul_(1 - lr * group["weight_decay"])
                rows.add_(update.to(rows.device), alpha=-lr * muon_scale(param.shape, group["adjust_lr_fn"]))
        return loss

    def _orthogonalise(self, params: list[torch.Tensor], updates: list[torch.Tensor], group: dict) -> list:
        """Each update (this rank's rows) replaced by its rows of the whole matrix's orthogonalisation."""
        settings = dict(steps=group["ns_steps"], coefficients=group["ns_coefficients"], eps=group["eps"])
        sharded = [index for index, param in enumerate(params) if isinstance(param, DTensor)]
        results = [orthogonalise(update, **settings) if not isinstance(param, DTensor) else None
                   for param, update in zip(params, updates)]
        if sharded:
            done = exchange_and_orthogonalise([params[i] for i in sharded], [updates[i] for i in sharded],
                                              settings)
            for index, rows in zip(sharded, done):
                results[index] = rows
        return results


def shard_dim(param: DTensor) -> int:
    """The mesh dimension FSDP2 splits this parameter's rows over (hsdp's 2-D mesh replicates along
    the other)."""
    dims = [dim for dim, placement in enumerate(param.placements) if placement.is_shard()]
    if len(dims) != 1 or param.placements[dims[0]].dim != 0:
        raise ValueError(f"ShardedMuon needs rows sharded over one mesh dimension, not {param.placements}")
    return dims[0]


def exchange_and_orthogonalise(params: list[DTensor], updates: list[torch.Tensor], settings: dict) -> list:
    """Every rank of the shard group calls this with the same matrices in the same order. Returns this
    rank's rows of each matrix's orthogonalised update (bf16, on the communication device)."""
    mesh, dim = params[0].device_mesh, shard_dim(params[0])
    if any(param.device_mesh != mesh or shard_dim(param) != dim for param in params):
        raise ValueError("ShardedMuon needs every matrix on one mesh")
    group, ranks, me = mesh.get_group(dim), mesh.size(dim), mesh.get_local_rank(dim)
    device = _communication_device(mesh.device_type)
    matrices = [_Matrix(param.shape, -(-param.shape[0] // ranks), update.shape[0])
                for param, update in zip(params, updates)]
    owner = owners([matrix.shape for matrix in matrices], ranks)
    mine = [index for index in range(len(matrices)) if owner[index] == me]
    # To each owner, this rank's rows of its matrices (padded to the chunk), owners in rank order.
    outgoing = [_padded(updates[index], matrices[index]) for rank in range(ranks)
                for index in range(len(matrices)) if owner[index] == rank]
    sizes_out = [sum(m.chunk_size for i, m in enumerate(matrices) if owner[i] == rank) for rank in range(ranks)]
    mine_size = sizes_out[me]
    gathered = _all_to_all(torch.cat(outgoing).to(device) if outgoing else _empty(device),
                           [mine_size] * ranks, sizes_out, group)
    # From each rank, its rows of every matrix this rank owns: whole matrices, chunk after chunk.
    returning = []
    per_rank = gathered.view(ranks, mine_size) if mine_size else gathered.view(ranks, 0)
    offset = 0
    wholes = []
    for index in mine:
        matrix = matrices[index]
        rows = per_rank[:, offset:offset + matrix.chunk_size].reshape(ranks * matrix.chunk, matrix.shape[1])
        offset += matrix.chunk_size
        whole = orthogonalise(rows[:matrix.shape[0]], **settings)
        wholes.append(torch.cat([whole, whole.new_zeros(ranks * matrix.chunk - matrix.shape[0], matrix.shape[1])])
                      .view(ranks, matrix.chunk_size))
    for rank in range(ranks):  # to each rank its chunk of every result, in the order of `mine`
        returning.extend(whole[rank] for whole in wholes)
    scattered = _all_to_all(torch.cat(returning) if returning else _empty(device), sizes_out,
                            [mine_size] * ranks, group)
    # From each owner, this rank's rows of its matrices, in the owners' order.
    offsets = torch.tensor([0, *sizes_out]).cumsum(0).tolist()
    results, taken = [None] * len(matrices), [0] * ranks
    for index, matrix in enumerate(matrices):
        start = offsets[owner[index]] + taken[owner[index]]
        taken[owner[index]] += matrix.chunk_size
        chunk = scattered[start:start + matrix.chunk_size].view(matrix.chunk, matrix.shape[1])
        results[index] = chunk[:matrix.local_rows]
    return results


def _padded(rows: torch.Tensor, matrix: _Matrix) -> torch.Tensor:
    """This rank's rows of a matrix in bf16, padded with zero rows to FSDP2's chunk, flattened."""
    out = rows.new_zeros((matrix.chunk, matrix.shape[1]), dtype=TRANSFER_DTYPE)
    out[:matrix.local_rows] = rows
    return out.view(-1)


def _all_to_all(tensor: torch.Tensor, receive: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """all_to_all_single of bf16 elements, moved as their bytes: they are only carried, and gloo
    refuses bf16 and int16 alike ("Invalid scalar type") where it takes uint8."""
    out = torch.empty(sum(receive), dtype=TRANSFER_DTYPE, device=tensor.device)
    width = TRANSFER_DTYPE.itemsize
    dist.all_to_all_single(out.view(torch.uint8), tensor.contiguous().view(torch.uint8),
                           [count * width for count in receive], [count * width for count in send], group=group)
    return out


def _empty(device: torch.device) -> torch.Tensor:
    return torch.empty(0, dtype=TRANSFER_DTYPE, device=device)


def _communication_device(device_type: str) -> torch.device:
    """Where the mesh's collectives take tensors: this rank's GPU under NCCL, else the CPU (where CPU
    offload keeps the shards, they are copied over and back)."""
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """The rows this rank holds: a DTensor's local tensor (the same storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor
