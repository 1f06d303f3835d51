"""How long a training step takes on a cluster, and how much of it is communication (for plan.py).

Communication (the alpha-beta model: each message step costs a latency a, each byte 1 / b):
- Ring all-reduce of S bytes over n ranks: every rank sends and receives 2 (n - 1) / n x S, in
  2 (n - 1) steps: 2 (n - 1) a + 2 (n - 1) / n x S / b.
- Ring all-gather or reduce-scatter of S bytes (the whole, gathered size) over n ranks: half of
  that, (n - 1) a + (n - 1) / n x S / b.
- Over N nodes of G ranks, hierarchically (as NCCL does, one ring per GPU over the network): the
  intra-node part over G ranks at each rank's link bandwidth, and the inter-node part over N nodes
  at the node's network bandwidth, shared by its G ranks: a node sends and receives 2 (N - 1) / N x S
  for an all-reduce, (N - 1) / N x S for an all-gather or reduce-scatter. Both parts add.
What each method moves per step (P parameters, c bytes per parameter in the compute dtype):
- ddp: one all-reduce of the fp32 gradients (4P) over all ranks, per optimizer step (gradient
  accumulation synchronises on the last micro-batch only).
- fsdp: all-gather of the parameters (cP) in the forward pass and again in the backward pass
  (reshard_after_forward; once without it), per micro-batch; reduce-scatter of the fp32 gradients
  (4P) per optimizer step; all over all ranks.
- hsdp: fsdp's collectives within each node, and an all-reduce across nodes of each rank's
  gradient shard (4P / G per rank, 4P per node), per optimizer step.
Overlap: DDP all-reduces buckets while the backward pass computes: what is left exposed is what
outlasts the backward pass, and at least the last bucket's share. FSDP prefetches the next block's
all-gather while the current block computes, and reduce-scatters each block's gradients while the
next one computes: exposed is what outlasts the compute, and at least one block's collectives.
HSDP's all-reduce overlaps with the backward pass as DDP's does. On CPU ranks (gloo) the
reduce-scatter is synchronous and counts whole. However well it overlaps, a step lasts at least
as long as its communication.
Compute: 6 FLOPs per matmul weight per token plus causal attention (GPT.flops_per_token), plus a
second forward pass of every block with activation checkpointing, at a stated share (utilisation)
of the device's peak. CPU offload adds copying the shards between host and device over PCIe and
AdamW's step in host memory.
Muon (distributed/muon.py) adds to each optimizer step, whatever the accumulation: Newton-Schulz,
NS_STEPS iterations of 2 x ns_cost FLOPs per hidden matrix, at the same rate as the passes: every
matrix on every rank under ddp (torch.optim.Muon), the busiest rank's share of them as owners()
deals them out over the ranks that shard (all under fsdp, a node's under hsdp); and under fsdp and
hsdp its exchange, two all_to_alls over those S ranks: hidden_traffic bytes a rank in all, in S - 1
messages a rank each. Both run inside the optimizer's step, after the backward pass: nothing
overlaps them. Not counted: CPU offload's copies of the rows to the device and back, and AdamW's
own step (small beside the passes on a GPU; offload's host-side AdamW is counted above).
"""
import inspect
from dataclasses import dataclass, replace

import torch

from mingpt.distributed.muon import hidden_traffic, ns_cost, owners
from mingpt.planning.memory import FP32, ModelSizes

DDP_BUCKET_BYTES = 25 * 2**20
"""DistributedDataParallel's default bucket_cap_mb."""
PCIE_BYTES_PER_S = 25e9
"""Host-device copies of CPU offload (PCIe 4.0 x16, each way, in practice)."""
HOST_ADAMW_BYTES_PER_S = 20e9
"""AdamW in host memory reads and writes 16 bytes per parameter and its state, at about this rate."""
NS_STEPS = inspect.signature(torch.optim.Muon).parameters["ns_steps"].default
"""Newton-Schulz iterations per step: torch.optim.Muon's default, which optimizer.create_optimizer
keeps (ShardedMuon too: the same arguments)."""


@dataclass(frozen=True)
class Cluster:
    """Where the run would go: its ranks and how fast they compute and talk."""

    nodes: int
    ranks_per_node: int
    memory: int
    """Bytes one rank may use (a GPU's memory, or a CPU rank's share of the host's)."""
    peak_flops: float
    """One rank's peak FLOP/s in the dtype its matmuls run in."""
    utilization: float
    """Share of the peak the step's compute reaches (model FLOPs utilisation)."""
    intra_bandwidth: float
    """Bytes/s each rank sends to the others of its node (and receives), each way."""
    inter_bandwidth: float
    """Bytes/s a node sends to other nodes (and receives), all its network links together."""
    intra_latency: float = 10e-6
    """Seconds per message step within a node."""
    inter_latency: float = 20e-6
    """Seconds per message step across nodes."""
    device_type: str = "cuda"

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node


@dataclass(frozen=True)
class Traffic:
    """Bytes one rank moves in a step, within its node and across nodes (its share of its node's),
    and the time they take."""

    intra_bytes: float = 0.0
    inter_bytes: float = 0.0
    seconds: float = 0.0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(self.intra_bytes + other.intra_bytes, self.inter_bytes + other.inter_bytes,
                       self.seconds + other.seconds)

    def times(self, count: int) -> "Traffic":
        return Traffic(count * self.intra_bytes, count * self.inter_bytes, count * self.seconds)


def collective(size: float, cluster: Cluster, ranks_per_node: int, nodes: int, all_reduce: bool,
               messages: int = 1) -> Traffic:
    """Ring collectives of `size` bytes in all, in `messages` calls (FSDP: one per block), over
    `nodes` nodes of `ranks_per_node` ranks each: all-reduces, or all-gathers or reduce-scatters
    (half the traffic)."""
    factor = 2 if all_reduce else 1
    g, n = ranks_per_node, nodes
    intra = factor * (g - 1) / g * size
    across_node = factor * (n - 1) / n * size  # through the node's network links, all ranks together
    seconds = 0.0
    if g > 1:
        seconds += messages * factor * (g - 1) * cluster.intra_latency + intra / cluster.intra_bandwidth
    if n > 1:
        seconds += messages * factor * (n - 1) * cluster.inter_latency + across_node / cluster.inter_bandwidth
    return Traffic(intra, across_node / g, seconds)


@dataclass(frozen=True)
class StepTime:
    compute: float
    """Seconds of computation per optimizer step (all micro-batches)."""
    traffic: Traffic
    exposed: float
    """Seconds of communication left after overlap with computation."""
    offload: float = 0.0
    """Seconds of CPU offload's copies and host-side AdamW."""
    newton_schulz: float = 0.0
    """Seconds of Muon's Newton-Schulz on the busiest rank (its exchange is in traffic and exposed)."""

    @property
    def seconds(self) -> float:
        return self.compute + self.exposed + self.offload + self.newton_schulz

    @property
    def efficiency(self) -> float:
        """Scaling efficiency: this step's tokens/s per rank over one device's doing the same
        computation without communication."""
        return self.compute / self.seconds


@dataclass(frozen=True)
class StepWork:
    """What one optimizer step computes and moves, from the model and the run's settings."""

    sizes: ModelSizes
    flops_per_token: float
    """GPT.flops_per_token(): forward and backward."""
    recompute_flops_per_token: float
    """A second forward pass of the blocks (activation checkpointing), or 0."""
    tokens_per_micro_batch: int
    compute_bytes: int
    """Bytes per parameter in the compute dtype (what FSDP gathers)."""
    grad_accum_steps: int = 1
    optimizer: str = "adamw"
    """adamw, or muon: Newton-Schulz and, sharded, its exchange (muon_step)."""


def step_time(method: str, work: StepWork, cluster: Cluster, reshard_after_forward: bool = True,
              cpu_offload: bool = False) -> StepTime:
    """The step's compute, communication and what of it overlap cannot hide."""
    flops = (work.flops_per_token + work.recompute_flops_per_token) * work.tokens_per_micro_batch
    micro = flops / (cluster.peak_flops * cluster.utilization)
    backward = micro * 2 / 3  # two of the three matmuls per weight (and the recomputed forward)
    compute = micro * work.grad_accum_steps
    if method == "ddp":
        traffic, exposed = _ddp(work, cluster, backward)
    else:
        traffic, exposed = _sharded(method, work, cluster, micro, backward, reshard_after_forward)
    offload = _offload_seconds(work, cluster, method) if cpu_offload else 0.0
    # However well it overlaps, the links cannot carry a step's bytes in less than their time.
    exposed = max(exposed, traffic.seconds - compute)
    if work.optimizer != "muon":
        return StepTime(compute, traffic, exposed, offload)
    muon = muon_step(method, work.sizes, cluster)
    # The exchange runs inside the optimizer's step, after the backward pass: all of it exposed.
    return StepTime(compute, traffic + muon.exchange, exposed + muon.exchange.seconds, offload,
                    muon.newton_schulz)


@dataclass(frozen=True)
class MuonStep:
    """What Muon adds to an optimizer step on the busiest rank, beyond AdamW's."""

    exchange: Traffic
    """ShardedMuon's two all_to_alls (none under ddp)."""
    newton_schulz: float
    """Seconds of Newton-Schulz."""

    @property
    def seconds(self) -> float:
        return self.exchange.seconds + self.newton_schulz


def muon_step(method: str, sizes: ModelSizes, cluster: Cluster) -> MuonStep:
    """Newton-Schulz of the matrices the busiest rank orthogonalises (all of them under ddp) and,
    sharded, the exchange over the ranks that shard: all under fsdp, a node's under hsdp."""
    per_node, nodes = {"ddp": (1, 1), "fsdp": (cluster.ranks_per_node, cluster.nodes),
                       "hsdp": (cluster.ranks_per_node, 1)}[method]
    shards = per_node * nodes
    shapes = [torch.Size(shape) for shape in sizes.block_shapes if shape[1] > 1] * sizes.n_layer
    load = [0] * shards
    for shape, rank in zip(shapes, owners(shapes, shards)):
        load[rank] += ns_cost(shape)
    flops = NS_STEPS * 2 * max(load)  # ns_cost counts multiply-adds
    return MuonStep(_exchange(sizes.hidden, cluster, per_node, nodes),
                    flops / (cluster.peak_flops * cluster.utilization))


def _exchange(hidden: int, cluster: Cluster, per_node: int, nodes: int) -> Traffic:
    """Two all_to_alls over `nodes` x `per_node` ranks; each rank sends its bytes evenly to the
    others, so a share (per_node - 1) / (S - 1) stays in its node and the rest goes through the
    node's links, which its per_node ranks share."""
    shards = per_node * nodes
    if shards == 1:
        return Traffic()
    sent = hidden_traffic(hidden, shards)
    intra = sent * (per_node - 1) / (shards - 1)
    inter = sent - intra
    latency = 2 * ((per_node - 1) * cluster.intra_latency + (shards - per_node) * cluster.inter_latency)
    seconds = latency + intra / cluster.intra_bandwidth + per_node * inter / cluster.inter_bandwidth
    return Traffic(intra, inter, seconds)


def _ddp(work: StepWork, cluster: Cluster, backward: float) -> tuple[Traffic, float]:
    gradients = FP32 * work.sizes.total
    traffic = collective(gradients, cluster, cluster.ranks_per_node, cluster.nodes, all_reduce=True)
    if cluster.world_size == 1:
        return Traffic(), 0.0
    last_bucket = traffic.seconds * min(1.0, DDP_BUCKET_BYTES / gradients)
    return traffic, max(traffic.seconds - backward, last_bucket)


def _sharded(method: str, work: StepWork, cluster: Cluster, micro: float, backward: float,
             reshard_after_forward: bool) -> tuple[Traffic, float]:
    """fsdp (all ranks shard) or hsdp (a node's ranks shard; nodes replicate)."""
    nodes = cluster.nodes if method == "fsdp" else 1
    per_node = cluster.ranks_per_node
    if cluster.world_size == 1 or (method == "hsdp" and per_node == 1 and cluster.nodes == 1):
        return Traffic(), 0.0
    parameters, gradients = work.compute_bytes * work.sizes.total, FP32 * work.sizes.total
    units = work.sizes.n_layer + 1  # each block, and the root module
    gather = collective(parameters, cluster, per_node, nodes, all_reduce=False, messages=units)
    scatter = collective(gradients, cluster, per_node, nodes, all_reduce=False, messages=units)
    gathers_per_micro = 2 if reshard_after_forward else 1
    traffic = gather.times(gathers_per_micro * work.grad_accum_steps) + scatter
    one_block = 1 / max(work.sizes.n_layer, 1)
    # Per micro-batch, prefetched gathers overlap the compute; the last micro-batch's reduce-scatters
    # overlap its backward pass (synchronous on CPU ranks: none of it).
    gathers = gather.seconds * gathers_per_micro
    exposed_gathers = max(gathers - micro, gathers * one_block) * work.grad_accum_steps
    scatter_window = 0.0 if cluster.device_type == "cpu" else backward
    exposed = exposed_gathers + max(scatter.seconds - scatter_window, scatter.seconds * one_block)
    if method == "hsdp" and cluster.nodes > 1:
        replicas = collective(gradients / per_node, cluster, 1, cluster.nodes, all_reduce=True)
        # each rank all-reduces its shard across nodes; the node's ranks share its links
        replicas = Traffic(0.0, replicas.inter_bytes, replicas.seconds * per_node)
        traffic = traffic + replicas
        exposed += max(replicas.seconds - backward, replicas.seconds * one_block)
    return traffic, exposed


def _offload_seconds(work: StepWork, cluster: Cluster, method: str) -> float:
    """Shards to the device for each gather, gradients back, and AdamW in host memory."""
    shards = cluster.world_size if method == "fsdp" else cluster.ranks_per_node
    shard_bytes = FP32 * work.sizes.total / shards
    copies = (2 * work.grad_accum_steps + 1) * shard_bytes / PCIE_BYTES_PER_S
    return copies + 4 * shard_bytes / HOST_ADAMW_BYTES_PER_S


def recompute_flops_per_token(flops_per_token: float, head_weights: int) -> float:
    """Activation checkpointing's second forward pass of the blocks: a third of their FLOPs (all
    but the head's matmul)."""
    return (flops_per_token - 6 * head_weights) / 3


def accumulation_for(efficiency: float, method: str, work: StepWork, cluster: Cluster, largest: int = 64,
                     **options) -> int:
    """The fewest micro-batches per step (up to `largest`) whose step reaches `efficiency`; 0 if
    none does (FSDP's per-micro-batch all-gathers do not shrink with accumulation)."""
    for steps in range(1, largest + 1):
        timing = step_time(method, _with_accumulation(work, steps), cluster, **options)
        if timing.efficiency >= efficiency:
            return steps
    return 0


def _with_accumulation(work: StepWork, steps: int) -> StepWork:
    return replace(work, grad_accum_steps=steps)
