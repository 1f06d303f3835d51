"""A GPT-2 style language model. It knows nothing about parallelism, nor about its optimizer.

The original's model.py, its landmarks where they were: GPTConfig, MultiheadAttentionLayer (causal
here), Block, GPT with GPT.generate. Its EmbeddingStem's token and position embeddings are GPT's own
tok_emb and pos_emb (first lines of GPT.forward), named as GPT-2 checkpoints and snapshots name them.
Its OptimizerConfig and create_optimizer moved to optimizer.py, beside the learning-rate schedule and
Muon. The CPU dropout, causal attention and next-token sampling it calls are common/tensor_ops.py's.

Shapes in comments: B batch, T time (block), C embedding, nh heads, hs head size (C // nh), V vocab.
"""
import functools
import hashlib
import math
from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from mingpt.common.errors import check, check_choice, check_positive
from mingpt.common.tensor_ops import Dropout, causal_attention, check_sampling_args, next_token

# (n_layer, n_head, n_embd) of the named models minGPT knows.
PRESETS: dict[str, tuple[int, int, int]] = {
    "openai-gpt": (12, 12, 768),  # 117M
    "gpt2": (12, 12, 768),  # 124M
    "gpt2-medium": (24, 16, 1024),  # 350M
    "gpt2-large": (36, 20, 1280),  # 774M
    "gpt2-xl": (48, 25, 1600),  # 1558M
    "gopher-44m": (8, 16, 512),
    "gpt-mini": (6, 6, 192),
    "gpt-micro": (4, 4, 128),
    "gpt-nano": (3, 3, 48),
}


ACTIVATIONS = ("gelu", "gelu_tanh")
DEFAULT_SIZES = {"n_layer": 8, "n_head": 8, "n_embd": 512}
"""The original's sizes (gpt2_train_cfg.yaml's): with init_from, they stand for "not chosen"."""


@dataclass
class GPTConfig:
    """Model shape: either a `model_type` preset or all of n_layer, n_head, n_embd (or, with
    init_from, the model folder's)."""

    model_type: Optional[str] = None
    """A named preset (see PRESETS); give it alone, with the three sizes set to null."""
    n_layer: Optional[int] = DEFAULT_SIZES["n_layer"]
    """Transformer blocks."""
    n_head: Optional[int] = DEFAULT_SIZES["n_head"]
    """Attention heads per block; n_embd must be a multiple of it."""
    n_embd: Optional[int] = DEFAULT_SIZES["n_embd"]
    """Width of the embeddings and of every block."""
    vocab_size: Optional[int] = None
    """Set from the data, not by the user."""
    vocab_multiple: int = 64
    """The embedding's and the output layer's rows are the vocabulary rounded up to a multiple of
    this (GPT-2's 50,257 to 50,304): matmuls in whole tiles are faster (bench/bench_vocab_padding.py).
    The extra rows are zero and their logits -inf, so the model computes what it would unpadded; 1
    turns padding off. A single-file snapshot of another padding resumes (its rows are re-padded)."""
    block_size: Optional[int] = None
    """Set from data_config.block_size, not by the user."""
    embd_pdrop: float = 0.1
    """Dropout on the token + position embeddings."""
    resid_pdrop: float = 0.1
    """Dropout on each block's attention and MLP outputs."""
    attn_pdrop: float = 0.1
    """Dropout on the attention weights."""
    activation: str = "gelu"
    """The MLP's GELU: gelu, the exact one (the original's), or gelu_tanh, the tanh approximation
    GPT-2 was trained with (Hugging Face's gelu_new); init_from takes the folder's."""
    init_from: Optional[str] = None
    """A Hugging Face GPT-2 model folder (config.json, model.safetensors, tokenizer.json, as
    save_pretrained writes them) to start training from, with its tokenizer: its shape and
    activation replace the sizes above, which may stay at their defaults (8, 8, 512), be null, or
    equal the folder's; anything else is refused. A snapshot at trainer_config.snapshot_path is
    resumed instead. See storage/gpt2_folder.py."""

    def __post_init__(self) -> None:
        sizes = (self.n_layer, self.n_head, self.n_embd)
        if self.model_type is not None:
            check(self.model_type in PRESETS, "gpt_config.model_type",
                  f"unknown preset {self.model_type!r}; choose one of {', '.join(PRESETS)}")
            preset = PRESETS[self.model_type]
            check(all(s is None or s == p for s, p in zip(sizes, preset)), "gpt_config.model_type",
                  f"preset {self.model_type!r} given together with explicit sizes; use the preset alone "
                  "(gpt_config.n_layer=null gpt_config.n_head=null gpt_config.n_embd=null) "
                  "or drop gpt_config.model_type")
            self.n_layer, self.n_head, self.n_embd = preset
        for name, value in zip(("n_layer", "n_head", "n_embd"), sizes):
            check(self.model_type is not None or value is not None or self.init_from is not None,
                  f"gpt_config.{name}", "missing; set n_layer, n_head and n_embd, or a gpt_config.model_type "
                  "preset")
        given = [name for name in ("n_layer", "n_head", "n_embd") if getattr(self, name) is not None]
        check_positive(self, "gpt_config", *given)  # with init_from, the folder fills in the others
        if len(given) == 3:
            check(self.n_embd % self.n_head == 0, "gpt_config.n_embd",
                  f"{self.n_embd} is not divisible by gpt_config.n_head={self.n_head}")
        for name in ("vocab_size", "block_size"):
            value = getattr(self, name)
            check(value is None or value > 0, f"gpt_config.{name}", f"must be positive, got {value}")
        check_positive(self, "gpt_config", "vocab_multiple")
        for name in ("embd_pdrop", "resid_pdrop", "attn_pdrop"):
            value = getattr(self, name)
            check(0.0 <= value < 1.0, f"gpt_config.{name}", f"must be in [0, 1), got {value}")
        check_choice(self, "gpt_config", "activation", ACTIVATIONS)
        check(self.init_from is None or bool(self.init_from), "gpt_config.init_from",
              "must not be empty; give a model folder or null")

    @property
    def padded_vocab_size(self) -> int:
        """The rows of the embedding and the output layer."""
        return padded_vocab_size(self.vocab_size, self.vocab_multiple)


def padded_vocab_size(vocab_size: int, vocab_multiple: int) -> int:
    """vocab_size rounded up to a multiple of vocab_multiple."""
    return -(-vocab_size // vocab_multiple) * vocab_multiple


class MultiheadAttentionLayer(nn.Module):
    """The original's attention layer: multi-head self-attention, here causal (position t attends to
    positions <= t only; the original's float mask let every position see the future)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.attn_pdrop = config.attn_pdrop
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.proj = nn.Linear(config.n_embd, config.n_embd)
        self.resid_drop = Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor, cache: Optional["LayerCache"] = None) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        # (B, T, C) -> (B, nh, T, hs)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        if cache is not None:
            k, v = cache.extend(k, v)  # the earlier positions' keys and values, then these
        if k.size(2) == T:  # no earlier positions: each attends to those before it
            y = causal_attention(q, k, v, dropout_p=self.attn_pdrop if self.training else 0.0)
        else:  # one new position (generation, cached) attends to every position so far
            y = F.scaled_dot_product_attention(q, k, v)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class LayerCache:
    """One block's keys and values of the positions a generation has seen, (B, nh, T, hs) each."""

    def __init__(self) -> None:
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def extend(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """These positions' keys and values kept after the earlier ones; all of them."""
        if self.keys is not None:
            keys, values = torch.cat([self.keys, keys], dim=2), torch.cat([self.values, values], dim=2)
        self.keys, self.values = keys, values
        return keys, values

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.size(2)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd)
        self.gelu = nn.GELU(approximate="tanh" if config.activation == "gelu_tanh" else "none")
        self.proj = nn.Linear(4 * config.n_embd, config.n_embd)
        self.drop = Dropout(config.resid_pdrop)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.proj(self.gelu(self.fc(x))))


class Block(nn.Module):
    """A pre-LayerNorm transformer block; the unit FSDP shards."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = MultiheadAttentionLayer(config)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, cache: Optional[LayerCache] = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


def parameter_seed(seed: int, name: str) -> int:
    """The seed of one parameter's generator: from the run's seed and the parameter's name, the
    same in every process and on every machine (a digest, unlike Python's per-process hash())."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


InitialValues = Callable[[str, slice], torch.Tensor]
"""The initial value of a parameter (by name), of the rows (dim 0) of a slice with start and stop."""

VOCABULARY_WEIGHTS = ("tok_emb.weight", "head.weight")
"""The parameters with a row per token, padded to GPTConfig.padded_vocab_size rows."""


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, seed: int = 0, weights: Optional[InitialValues] = None):
        """seed decides the initial weights (see initial_value), unless weights gives them (a
        pretrained model: storage/gpt2_folder.py). Built on the meta device (`with
        torch.device("meta")`) the model has shapes only, and whoever places it on a device fills it
        in from initial_value, a part at a time if it likes (parallel.py does)."""
        super().__init__()
        if config.vocab_size is None or config.block_size is None:
            raise ValueError("GPTConfig.vocab_size and block_size must be set from the data")
        self.config = config
        self.seed = seed
        self.weights = weights
        self.tok_emb = nn.Embedding(config.padded_vocab_size, config.n_embd)
        self.pos_emb = nn.Embedding(config.block_size, config.n_embd)
        self.drop = Dropout(config.embd_pdrop)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.head = nn.Linear(config.n_embd, config.padded_vocab_size, bias=False)
        if not self.head.weight.is_meta:
            self.init_weights()

    def initial_value(self, name: str, rows: slice = slice(None)) -> torch.Tensor:
        """The initial value of parameter `name` (of its rows: a rank's shard), on the CPU.

        From the weights given, if any; otherwise GPT-2's scheme: N(0, 0.02) for Linear and
        Embedding weights, except the projections that feed the residual stream (attn.proj,
        mlp.proj: one pair per block), N(0, 0.02 / sqrt(2 n_layer)); zero biases; LayerNorm
        weights 1. Each weight is drawn from a generator of its own, seeded by (seed, name), so its
        value depends on neither the device, the distributed method, the world size nor the order
        in which parameters are made: each one can be made alone, when it is needed.

        The padding rows of VOCABULARY_WEIGHTS are zero, and the others are drawn as for an
        unpadded model: the padding changes no weight.
        """
        param = self.get_parameter(name)  # its shape and dtype (the full ones, even if sharded)
        start, stop, _ = rows.indices(param.shape[0])
        real_rows = self.config.vocab_size if name in VOCABULARY_WEIGHTS else param.shape[0]
        shape = (real_rows, *param.shape[1:])
        value = self._unpadded_value(name, shape, param.dtype,
                                     slice(min(start, real_rows), min(stop, real_rows)))
        if stop <= real_rows:
            return value
        return torch.cat([value, torch.zeros((stop - max(start, real_rows), *shape[1:]), dtype=param.dtype)])

    def _unpadded_value(self, name: str, shape: tuple[int, ...], dtype: torch.dtype, rows: slice
                        ) -> torch.Tensor:
        """initial_value of the rows of a parameter of this shape."""
        if self.weights is not None:
            return self.weights(name, rows).to(dtype)
        module_name, _, kind = name.rpartition(".")
        module = self.get_submodule(module_name)
        if kind == "bias":
            return torch.zeros(shape, dtype=dtype)[rows]
        if isinstance(module, nn.LayerNorm):
            return torch.ones(shape, dtype=dtype)[rows]
        if not isinstance(module, (nn.Linear, nn.Embedding)):
            raise TypeError(f"no initial value for {name} of a {type(module).__name__}")
        residual = name.endswith(("attn.proj.weight", "mlp.proj.weight"))
        std = 0.02 / math.sqrt(2 * self.config.n_layer) if residual else 0.02
        generator = torch.Generator().manual_seed(parameter_seed(self.seed, name))
        return torch.empty(shape, dtype=dtype).normal_(0.0, std, generator=generator)[rows]

    @torch.no_grad()
    def init_weights(self) -> None:
        """Every parameter to its initial value, wherever it lives."""
        for name, param in self.named_parameters():
            param.copy_(self.initial_value(name))

    def forward(
        self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None,
        cache: Optional[list[LayerCache]] = None,
    ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """idx, targets: (B, T) token ids. Returns logits (B, T, V) and the mean loss if targets
        (the padding's logits, -inf, are cut off the logits returned). With a cache (a LayerCache
        per block, GPT.generate's), idx are the positions after those the cache holds."""
        past = cache[0].length if cache else 0
        T = idx.size(1)
        if past + T > self.config.block_size:
            raise ValueError(f"sequence of {past + T} tokens is longer than block_size {self.config.block_size}")
        positions = torch.arange(past, past + T, device=idx.device)
        # The original's EmbeddingStem: token and position embeddings, then dropout.
        x = self.drop(self.tok_emb(idx) + self.pos_emb(positions))  # (B, T, C)
        for index, block in enumerate(self.blocks):
            x = block(x, cache[index]) if cache else block(x)
        logits = self.head(self.ln_f(x))  # (B, T, padded V)
        vocab_size = self.config.vocab_size
        padded = logits.size(-1) > vocab_size
        if padded:
            # -inf takes the padding out of the softmax. In place, and unseen by autograd: a copy of the
            # logits would take as much memory again, and autograd would copy their gradient to zero
            # the padding's part, which is zero already (the softmax's gradient where it is 0). The
            # matmul keeps its inputs for the backward pass, not the logits, so they may change.
            with torch.no_grad():
                logits[..., vocab_size:] = float("-inf")
        loss = None if targets is None else F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        return (logits[..., :vocab_size] if padded else logits), loss

    def describe(self) -> str:
        cfg = self.config
        params = self.num_parameters()
        return (f"GPT {params / 1e6:.2f}M parameters ({cfg.n_layer} layers, {cfg.n_head} heads, "
                f"{cfg.n_embd} wide, block {cfg.block_size})")

    def num_parameters(self) -> int:
        """The model's parameters, global counts (sharded or not), without the vocabulary's padding
        (GPT-2 is 124M whatever its padding): what the model is, not what it holds."""
        padding_rows = self.head.out_features - self.config.vocab_size
        padding = padding_rows * self.config.n_embd * len(VOCABULARY_WEIGHTS)
        return sum(p.numel() for p in self.parameters()) - padding

    def input_parameters(self) -> list[nn.Parameter]:
        """The embeddings: the forward pass uses them first, so backward computes their gradients
        last (a rank's arrival at the gradient synchronisation: distributed/stragglers.py)."""
        return [self.tok_emb.weight, self.pos_emb.weight]

    def flops_per_token(self) -> int:
        """Training FLOPs per token: 6 per matmul weight, plus causal attention.

        Attention scores and weighted values cost 2 * 2 * T * C multiply-adds per token and layer
        forward, times 3 with the backward pass; causal attention computes half of them.
        """
        cfg = self.config
        return 6 * self.matmul_weights() + 6 * cfg.n_layer * cfg.block_size * cfg.n_embd

    def matmul_weights(self) -> int:
        """Weights of the Linear layers: 2 FLOPs each per token forward, 4 backward."""
        return sum(m.weight.numel() for m in self.modules() if isinstance(m, nn.Linear))

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0,
                 top_k: Optional[int] = None, generator: Optional[torch.Generator] = None,
                 use_cache: bool = True) -> torch.Tensor:
        """The original's GPT.generate: idx (B, T) followed by max_new_tokens sampled ids, (B, T +
        max_new_tokens). Each step feeds the last block_size tokens to the model and draws the next
        token from the last position's logits. temperature=0 is greedy decoding (argmax, the
        original's do_sample=False; ties go to the lowest id), as top_k=1 is by the ordinary route.

        With use_cache, each block keeps the keys and values of the positions seen (a LayerCache):
        the prompt is computed once, then each new token is one position, not the whole context again,
        and the logits are those of the uncached path (to float rounding). Past block_size the window
        slides: every position moves, so nothing computed before holds, and each token is computed
        from the window afresh, as without a cache.

        The model runs in eval mode (no dropout) and is put back in the mode it was in. The generator
        must live on idx's device; the same generator state gives the same tokens.
        """
        check_sampling_args(max_new_tokens, temperature, top_k)
        if idx.dim() != 2 or idx.size(1) == 0:
            raise ValueError(f"idx must be (B, T) with T >= 1 token to continue from, "
                             f"got shape {tuple(idx.shape)}")
        block_size = self.config.block_size
        was_training = self.training
        self.eval()
        cache = [LayerCache() for _ in range(self.config.n_layer)] if use_cache else None
        try:
            for _ in range(max_new_tokens):
                if cache is not None and idx.size(1) <= block_size:
                    logits, _ = self(idx[:, cache[0].length:], cache=cache)  # the positions not cached yet
                else:
                    logits, _ = self(idx[:, -block_size:])  # the model has positions for block_size tokens
                idx = torch.cat([idx, next_token(logits[:, -1, :], temperature, top_k, generator)], dim=1)
        finally:
            self.train(was_training)
        return idx


def meta_model(config: GPTConfig) -> GPT:
    """The GPT of a config's sizes on the meta device, for its parameter counts, state and FLOPs
    without any memory; built once per size (a large one takes seconds even there)."""
    return _meta_model(config.n_layer, config.n_head, config.n_embd, config.vocab_size, config.block_size,
                       config.vocab_multiple)


@functools.lru_cache(maxsize=64)
def _meta_model(n_layer: int, n_head: int, n_embd: int, vocab_size: int, block_size: int,
                vocab_multiple: int) -> GPT:
    with torch.device("meta"):
        return GPT(GPTConfig(n_layer=n_layer, n_head=n_head, n_embd=n_embd, vocab_size=vocab_size,
                             block_size=block_size, vocab_multiple=vocab_multiple))
