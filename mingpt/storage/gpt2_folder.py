"""Hugging Face GPT-2 model folders: the names GPT-2 gives the model's weights, and reading a folder
to start training from it (gpt_config.init_from). export_hf.py writes such folders.

A folder is what `GPT2LMHeadModel.save_pretrained` (with its tokenizer's) writes: config.json,
model.safetensors (or model.safetensors.index.json and its shards) and tokenizer.json. The project's
model is GPT-2's architecture, so each weight is one of GPT-2's: a Linear's (out, in) weight is a
Conv1D's (in, out) one, transposed. What differs is taken care of here:
- the head: GPT-2 ties lm_head to the token embedding (wte); the project's head is a weight of its
  own, so it starts as a copy of wte and trains apart from it (an untied folder's lm_head is read);
- the positions: GPT-2 has n_positions (1024) of them; data_config.block_size must be at most that,
  and the model keeps the first block_size;
- the activation: GPT-2's GELU is the tanh approximation (gelu_new), the project's default the exact
  one: the model takes the folder's (gpt_config.activation), so its logits are the folder's.

Nothing is read before it is needed: opening a folder reads config.json, the safetensors headers and
the tokenizer; each rank then reads only the rows of each weight it holds (materialize asks for
them), from the memory-mapped safetensors files (get_slice).
"""
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tokenizers import Tokenizer

from mingpt.common import files
from mingpt.common.errors import ConfigError, check
from mingpt.model import DEFAULT_SIZES, GPT, PRESETS, GPTConfig
from mingpt.tokens.tokenizer import CHAR, read_tokenizer_file, token_list

KEY = "gpt_config.init_from"
GPT2_NAMES = {  # the project's name within a block -> GPT-2's, and whether the weight turns (Conv1D)
    "ln_1": ("ln_1", False), "ln_2": ("ln_2", False),
    "attn.qkv": ("attn.c_attn", True), "attn.proj": ("attn.c_proj", True),
    "mlp.fc": ("mlp.c_fc", True), "mlp.proj": ("mlp.c_proj", True),
}
TOP_NAMES = {"tok_emb.weight": "transformer.wte.weight", "pos_emb.weight": "transformer.wpe.weight",
             "ln_f.weight": "transformer.ln_f.weight", "ln_f.bias": "transformer.ln_f.bias",
             "head.weight": "lm_head.weight"}
HF_ACTIVATIONS = {"gelu": "gelu", "gelu_tanh": "gelu_new"}
"""The project's activation -> the activation_function export_hf writes."""
FROM_HF_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                       "gelu_fast": "gelu_tanh"}
LAYER_NORM_EPS = 1e-5  # torch's LayerNorm default, which the model uses
UNSUPPORTED = {  # config.json options the project's model does not have, with the value it has
    "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "add_cross_attention": False,
    "layer_norm_epsilon": LAYER_NORM_EPS,
}
WEIGHTS, INDEX, TOKENIZER = "model.safetensors", "model.safetensors.index.json", "tokenizer.json"
ADVICE = ("give a Hugging Face GPT-2 model folder (config.json, model.safetensors, tokenizer.json, "
          "as save_pretrained writes them; docs/data.md says how to fetch GPT-2's)")


def gpt2_entry(name: str) -> tuple[str, bool]:
    """GPT-2's name for a parameter, and whether its weight turns (a Linear's, held as a Conv1D)."""
    if name in TOP_NAMES:
        return TOP_NAMES[name], False
    _, layer, rest = name.split(".", 2)  # blocks.<i>.<module>.<weight|bias>
    module, kind = rest.rsplit(".", 1)
    gpt2_module, conv1d = GPT2_NAMES[module]
    return f"transformer.h.{layer}.{gpt2_module}.{kind}", conv1d and kind == "weight"


def refused(path: Path, problem: str, advice: str = ADVICE) -> ConfigError:
    return ConfigError(KEY, f"{path} {problem}; {advice}")


@dataclass(frozen=True)
class GPT2Folder:
    """An opened GPT-2 model folder: its shape, tokenizer, and where each of its weights lies."""

    path: Path
    sizes: dict[str, int]
    """n_layer, n_head, n_embd."""
    n_positions: int
    vocab_size: int
    activation: str
    tied: bool
    tensors: dict[str, tuple[str, str]]
    """GPT-2's name of each weight (transformer.h.0.ln_1.weight, lm_head.weight) -> (file, key)."""

    @property
    def tokenizer_path(self) -> str:
        return str(self.path / TOKENIZER)

    def model_config(self, config: GPTConfig) -> GPTConfig:
        """config with the folder's shape and activation; a size, preset or activation chosen
        otherwise is refused (the sizes' defaults and null mean "the folder's")."""
        if config.model_type is not None:
            preset = dict(zip(DEFAULT_SIZES, PRESETS[config.model_type]))
            check(preset == self.sizes, "gpt_config.model_type",
                  f"{config.model_type} is {describe(preset)}, but {KEY}={self.path} is "
                  f"{describe(self.sizes)}; "
                  "drop gpt_config.model_type (the folder gives the shape)")
        for key, value in self.sizes.items():
            given = getattr(config, key)
            check(given in (None, DEFAULT_SIZES[key], value), f"gpt_config.{key}",
                  f"{given}, but {KEY}={self.path} has {key}={value}; drop gpt_config.{key} "
                  "(the folder gives the shape)")
        check(config.activation in ("gelu", self.activation), "gpt_config.activation",
              f"{config.activation}, but {KEY}={self.path} was trained with {self.activation}; drop "
              "gpt_config.activation (the folder gives it)")
        return replace(config, **self.sizes, activation=self.activation)

    def tokenizing(self, data_config: Any) -> Any:
        """The data config (char_dataset.DataConfig), its text tokenized with the folder's tokenizer."""
        self.check_data(data_config.tokenizer, data_config.block_size)
        return replace(data_config, tokenizer=self.tokenizer_path)

    def check_data(self, tokenizer: str, block_size: int) -> None:
        """The data is tokenized with the folder's tokenizer, in at most n_positions tokens."""
        check(tokenizer in (CHAR, self.tokenizer_path), "data_config.tokenizer",
              f"{tokenizer}, but {KEY} tokenizes the text with {self.tokenizer_path}; leave "
              "data_config.tokenizer at char (its default)")
        check(block_size <= self.n_positions, "data_config.block_size",
              f"{block_size} is more than the {self.n_positions} positions of {KEY}={self.path}; use "
              f"at most {self.n_positions} (the model keeps the first block_size)")

    def __call__(self, name: str, rows: slice) -> torch.Tensor:
        """The rows of the project's parameter `name` (model.InitialValues): a Conv1D weight's
        columns, read and turned."""
        gpt2_name, turns = gpt2_entry(name)
        if gpt2_name == "lm_head.weight" and self.tied:
            gpt2_name = "transformer.wte.weight"
        file, key = self.tensors[gpt2_name]
        with safe_open(file, framework="pt") as f:
            weights = f.get_slice(key)
            return weights[:, rows].t() if turns else weights[rows]


def describe(sizes: dict[str, int]) -> str:
    return ", ".join(f"{key}={value}" for key, value in sizes.items())


def open_folder(folder: str) -> GPT2Folder:
    """The GPT-2 model folder at path, checked whole before anything is trained: its config, its
    tokenizer, and every weight the model needs, present and of its shape."""
    path = Path(files.local_path(folder))
    if files.is_remote(folder) or not path.is_dir():
        raise refused(path, "is not a local folder" if files.is_remote(folder) else "does not exist")
    config = read_config(path)
    n_embd, vocab_size = config["n_embd"], config["vocab_size"]
    for option, value in UNSUPPORTED.items():
        if config.get(option, value) != value:
            raise refused(path, f"has {option}={config[option]} in config.json, which this model does not "
                          f"support ({value})", "give a GPT-2 model of the original architecture")
    if config.get("n_inner") not in (None, 4 * n_embd):
        raise refused(path, f"has an MLP of n_inner={config['n_inner']}, this model's is 4 x n_embd "
                      f"({4 * n_embd})", "give a GPT-2 model of the original architecture")
    activation = FROM_HF_ACTIVATIONS.get(config.get("activation_function", "gelu_new"))
    if activation is None:
        raise refused(path, f"uses activation_function {config['activation_function']}; this model has "
                      f"{', '.join(FROM_HF_ACTIVATIONS)}", "give a GPT-2 model of the original architecture")
    tokens = len(token_list(read_tokenizer(path)))
    if tokens != vocab_size:
        raise refused(path, f"has a tokenizer.json of {tokens} tokens for a model of vocab_size {vocab_size}",
                      "give the tokenizer the model was trained with")
    opened = GPT2Folder(path, {k: config[k] for k in DEFAULT_SIZES}, config["n_positions"], vocab_size,
                        activation, config.get("tie_word_embeddings", True), weight_locations(path))
    check_weights(opened)
    return opened


def read_config(path: Path) -> dict:
    """config.json, of a GPT-2 (model_type gpt2) with the sizes this model needs."""
    try:
        config = json.loads((path / "config.json").read_text())
    except FileNotFoundError:
        raise refused(path, "has no config.json (a partial download?)") from None
    except (OSError, ValueError) as e:
        raise refused(path, f"has an unreadable config.json ({e.__class__.__name__})") from None
    if not isinstance(config, dict) or config.get("model_type") != "gpt2":
        kind = config.get("model_type") if isinstance(config, dict) else None
        raise refused(path, f"holds a {kind or 'model of unknown type'} model, not GPT-2 (model_type gpt2)",
                      "only GPT-2 model folders can be loaded")
    missing = [k for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size")
               if not isinstance(config.get(k), int) or config[k] <= 0]
    if missing:
        raise refused(path, f"has a config.json without {', '.join(missing)}")
    return config


def read_tokenizer(path: Path) -> Tokenizer:
    """The folder's tokenizer.json, a byte-level BPE: the data is tokenized with it (GPT2Folder.tokenizing)."""
    if not (path / TOKENIZER).exists():
        raise refused(path, "has no tokenizer.json (a partial download?)",
                      "save the model's tokenizer with it (tokenizer.save_pretrained(folder))")
    if is_characters(path / TOKENIZER):
        raise refused(path, "holds a character model (export_hf.py's tokenizer.json of one token per "
                      "character); init_from tokenizes the data with a folder's byte-level BPE only",
                      "to train the character model on, resume the snapshot it was exported from "
                      "(trainer_config.snapshot_path=that snapshot, with its text), or give a BPE "
                      "model's folder")
    return Tokenizer.from_str(read_tokenizer_file(str(path / TOKENIZER), key=KEY).json)


def is_characters(tokenizer_json: Path) -> bool:
    """Whether a tokenizer.json is a character model's (export_hf.character_tokenizer's: a WordLevel
    of single characters). The data cannot take its ids: a text's character vocabulary is the sorted
    characters of the share of it kept, so one character more or less in the text would shift every
    id under the model's embeddings (a snapshot's resume checks the characters match; a folder has
    no run to check against)."""
    try:
        model = json.loads(tokenizer_json.read_text()).get("model")
    except (OSError, ValueError, AttributeError):
        return False  # not JSON or not an object: read_tokenizer_file says what is wrong with it
    if not isinstance(model, dict) or model.get("type") != "WordLevel":
        return False
    vocab = model.get("vocab")
    return isinstance(vocab, dict) and all(len(token) == 1 for token in vocab)


def weight_locations(path: Path) -> dict[str, tuple[str, str]]:
    """GPT-2's name of each tensor of the folder's safetensors files -> (file, its key there).
    Older folders (GPT-2's own on the hub) name them without `transformer.`."""
    if (path / INDEX).exists():
        try:
            weight_map = json.loads((path / INDEX).read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError):
            raise refused(path, f"has an unreadable {INDEX}") from None
        shards = sorted(set(weight_map.values()))
    elif (path / WEIGHTS).exists():
        shards = [WEIGHTS]
    else:
        raise refused(path, f"has no {WEIGHTS} (pytorch_model.bin alone is not read: it is a pickle)",
                      "save the model with save_pretrained, which writes safetensors")
    locations = {}
    for shard in shards:
        try:
            with safe_open(str(path / shard), framework="pt") as f:
                keys = list(f.keys())
        except Exception as e:  # missing, truncated or not safetensors
            problem = f"has an unreadable {shard} ({e.__class__.__name__}; a partial download?)"
            raise refused(path, problem) from None
        for key in keys:
            gpt2_name = key if key.startswith(("transformer.", "lm_head.")) else f"transformer.{key}"
            locations[gpt2_name] = (str(path / shard), key)
    return locations


def expected_shapes(folder: GPT2Folder) -> dict[str, tuple[int, ...]]:
    """GPT-2's name and shape of each weight the model reads (wpe: all n_positions rows; the
    vocabulary's weights unpadded: model.initial_value pads them)."""
    config = GPTConfig(**folder.sizes, vocab_size=folder.vocab_size, block_size=folder.n_positions,
                       vocab_multiple=1)
    with torch.device("meta"):
        model = GPT(config)
    shapes = {}
    for name, param in model.named_parameters():
        gpt2_name, turns = gpt2_entry(name)
        if gpt2_name != "lm_head.weight" or not folder.tied:
            shapes[gpt2_name] = tuple(reversed(param.shape)) if turns else tuple(param.shape)
    return shapes


def check_weights(folder: GPT2Folder) -> None:
    """Every weight the model reads is in the folder, of its shape."""
    for name, shape in expected_shapes(folder).items():
        if name not in folder.tensors:
            raise refused(folder.path, f"lacks the weight {name} (a partial download?)")
        file, key = folder.tensors[name]
        with safe_open(file, framework="pt") as f:
            found = tuple(f.get_slice(key).get_shape())
        if found != shape:
            raise refused(folder.path, f"has {name} of shape {found} where its config.json makes it {shape}",
                          "the folder is damaged, or not GPT-2's layout")

