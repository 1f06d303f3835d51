"""A snapshot as a Hugging Face model folder: GPT2LMHeadModel's config.json, its weights in
safetensors, and its tokenizer (the snapshot's BPE, or one of its characters).

    python mingpt/export_hf.py SNAPSHOT OUT_FOLDER

SNAPSHOT is a single-file snapshot, a folder of them (its newest is taken) or a sharded_<step> folder
(read whole in this process, no process group); local or any fsspec URL. OUT_FOLDER (local) must not
exist yet. Then, with transformers installed:

    GPT2LMHeadModel.from_pretrained(OUT_FOLDER), AutoTokenizer.from_pretrained(OUT_FOLDER)

give the project's logits (fp32) and its tokens. The project's model is GPT-2's architecture, so
each weight maps to one of GPT-2's (storage/gpt2_folder.py): a Linear's (out, in) weight becomes a
Conv1D's (in, out) one; the head stays apart from the token embedding (tie_word_embeddings false);
the MLP's GELU is the model's: the exact one ("gelu", the default) or the tanh approximation
("gelu_new", GPT-2's, which a model started from GPT-2's weights keeps). A BPE model's folder
written here is also one gpt_config.init_from starts from; a character model's is refused there
(storage/gpt2_folder.is_characters says why): its snapshot trains on.
"""
import json
import os
import shutil
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import save_file
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from mingpt.common.errors import MinGPTError, OneLineArgumentParser, SnapshotError, command
from mingpt.model import VOCABULARY_WEIGHTS
from mingpt.storage.gpt2_folder import HF_ACTIVATIONS, LAYER_NORM_EPS, gpt2_entry
from mingpt.storage.saved_model import snapshot_at
from mingpt.storage.snapshot import Snapshot
from mingpt.tokens.tokenizer import END_OF_TEXT, Vocabulary


def gpt2_weights(model_state: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """The model's weights under GPT2LMHeadModel's names and shapes (each its own contiguous copy),
    the vocabulary's without their padding."""
    weights = {}
    for name, tensor in model_state.items():
        gpt2_name, turns = gpt2_entry(name)
        if name in VOCABULARY_WEIGHTS:
            tensor = tensor[:vocab_size]
        weights[gpt2_name] = (tensor.t() if turns else tensor).contiguous().clone()
    return weights


def gpt2_config(model_config: dict, end_of_text: Optional[int] = None) -> dict:
    """config.json of the model; end_of_text: a BPE's <|endoftext|> id (GPT-2's 50256 is
    transformers' default, out of range for any other vocabulary: said explicitly, as None too)."""
    return {
        "bos_token_id": end_of_text, "eos_token_id": end_of_text,
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": model_config["vocab_size"], "n_positions": model_config["block_size"],
        "n_embd": model_config["n_embd"], "n_layer": model_config["n_layer"],
        "n_head": model_config["n_head"],
        "n_inner": 4 * model_config["n_embd"],
        "activation_function": HF_ACTIVATIONS[model_config.get("activation", "gelu")],
        "embd_pdrop": model_config["embd_pdrop"], "resid_pdrop": model_config["resid_pdrop"],
        "attn_pdrop": model_config["attn_pdrop"], "layer_norm_epsilon": LAYER_NORM_EPS,
        "tie_word_embeddings": False, "scale_attn_weights": True, "torch_dtype": "float32",
    }


def character_tokenizer(vocab: list[str]) -> Tokenizer:
    """One token per character, the snapshot's ids; decoding joins them back without spaces."""
    tokenizer = Tokenizer(models.WordLevel({ch: i for i, ch in enumerate(vocab)}, unk_token=vocab[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # each character
    tokenizer.decoder = decoders.Fuse()
    return tokenizer


def read_any(path: str) -> Snapshot:
    """The snapshot at path, whatever the run wrote (saved_model.snapshot_at)."""
    snapshot, _ = snapshot_at(path, key="SNAPSHOT")
    if snapshot is None:
        raise SnapshotError(f"no snapshot at {path}: give a snapshot file, a run's snapshot folder or a "
                            "sharded_<step> folder")
    return snapshot


def export(snapshot: Snapshot, out: Path) -> None:
    """Write the folder: into a temporary one beside out, renamed to out once whole (removed if the
    export fails)."""
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # what an interrupted export left
    partial.mkdir(parents=True)
    try:
        _write_folder(snapshot, partial)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(out)


def _write_folder(snapshot: Snapshot, partial: Path) -> None:
    weights = partial / "model.safetensors"
    save_file(gpt2_weights(snapshot.model_state, snapshot.model_config["vocab_size"]), str(weights),
              metadata={"format": "pt"})
    weights.chmod(0o666 & ~current_umask())  # save_file makes it 0600; its siblings get the usual mode
    end_of_text = Vocabulary.kept(snapshot.vocab, snapshot.tokenizer).token_id(END_OF_TEXT)
    config = gpt2_config(snapshot.model_config, end_of_text)
    (partial / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if snapshot.tokenizer:  # a BPE model's own tokenizer.json
        (partial / "tokenizer.json").write_text(snapshot.tokenizer)
    else:
        character_tokenizer(snapshot.vocab).save(str(partial / "tokenizer.json"))
    (partial / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length":
                    snapshot.model_config["block_size"]}, indent=2) + "\n")


def current_umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@command
def main(argv: Optional[list[str]] = None) -> None:
    parser = OneLineArgumentParser(description="Export a snapshot as a Hugging Face GPT-2 model folder.")
    parser.add_argument("snapshot", help="a snapshot file, a folder of them, or a sharded_<step> folder")
    parser.add_argument("out_folder", type=Path, help="the model folder to create (must not exist)")
    args = parser.parse_args(argv)
    out = args.out_folder
    if out.exists():
        raise MinGPTError(f"{out} exists; give a new folder for the export (nothing was overwritten)")
    export(read_any(args.snapshot), out)
    print(f"wrote {out} (config.json, model.safetensors, tokenizer.json)")


if __name__ == "__main__":
    main()
