"""storage/gpt2_folder.py: a GPT-2 folder that transformers wrote gives the project's model the
folder's logits (tied or untied head, one safetensors file or shards, save_pretrained's names or the
hub's older ones), a broken mapping would not, and a folder or config that does not fit is refused
in one line. Training from a folder on 2 ranks, DDP and FSDP: tests/end_to_end/test_tokens_and_gpt2.py."""
import json
import shutil

import pytest
import torch
from helpers import (
    assert_ok,
    gpt2_logits,
    make_gpt2_folder,
    make_text,
    one_error_line,
    run_main_in_process,
    sha256,
    tiny_overrides,
)
from safetensors.torch import load_file, save_file

from mingpt.common.errors import ConfigError
from mingpt.model import GPT, GPTConfig
from mingpt.storage import gpt2_folder
from mingpt.storage.gpt2_folder import GPT2Folder, open_folder
from mingpt.storage.snapshot import read_snapshot

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

BLOCK = 16
IDS = torch.arange(2 * BLOCK).view(2, BLOCK) * 7 % 300


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_gpt2_folder(tmp_path_factory.mktemp("gpt2") / "tiny", make_text(20000))


@pytest.fixture(scope="module")
def expected(folder):
    return gpt2_logits(folder, IDS)


def loaded(path, config: GPTConfig = GPTConfig()) -> GPT:
    """The project's model, its initial values read from the folder (as materialize reads them)."""
    opened = open_folder(str(path))
    config = opened.model_config(config)
    return GPT(GPTConfig(**{**config.__dict__, "vocab_size": opened.vocab_size, "block_size": BLOCK}),
               weights=opened).eval()


def copied(folder, tmp_path, name="copy"):
    return shutil.copytree(folder, tmp_path / name)


def sharded(folder, tmp_path):
    """The weights in two files with an index, as save_pretrained writes a large model."""
    path = copied(folder, tmp_path)
    tensors = load_file(path / "model.safetensors")
    (path / "model.safetensors").unlink()
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in halves.items():
        save_file({name: tensors[name] for name in part}, path / file)
    weight_map = {name: file for file, part in halves.items() for name in part}
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def hub_names(folder, tmp_path):
    """GPT-2's own folder on the hub: no `transformer.` in the names, and the attention masks."""
    path = copied(folder, tmp_path)
    saved = load_file(path / "model.safetensors")
    tensors = {name.removeprefix("transformer."): tensor for name, tensor in saved.items()}
    tensors["h.0.attn.bias"] = torch.ones(1, 1, 64, 64).tril()
    save_file(tensors, path / "model.safetensors")
    return path


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["save_pretrained", "sharded", "hub names"])
def test_the_model_gives_the_folders_logits(folder, expected, tmp_path, layout):
    path = {"save_pretrained": lambda: folder, "sharded": lambda: sharded(folder, tmp_path),
            "hub names": lambda: hub_names(folder, tmp_path)}[layout]()
    model = loaded(path)
    assert model.config.activation == "gelu_tanh" and model.config.n_layer == 2  # not the YAML's 8
    assert torch.equal(model.head.weight, model.tok_emb.weight)  # tied: lm_head is wte
    with torch.no_grad():
        torch.testing.assert_close(model(IDS)[0], expected, rtol=0, atol=1e-5)


def test_an_untied_head_is_read_as_it_is(tmp_path):
    path = make_gpt2_folder(tmp_path / "untied", make_text(20000), tied=False, activation_function="gelu")
    model = loaded(path)
    assert model.config.activation == "gelu" and not torch.equal(model.head.weight, model.tok_emb.weight)
    with torch.no_grad():
        torch.testing.assert_close(model(IDS)[0], gpt2_logits(path, IDS), rtol=0, atol=1e-5)


@pytest.mark.parametrize("broken", ["a square weight left untransposed", "a dropped bias", "the exact GELU"])
def test_a_broken_mapping_gives_other_logits(folder, expected, monkeypatch, broken):
    """The logits comparison above catches a wrong mapping: a square Conv1D weight reads whether
    turned or not, a missing bias would leave zeros, and the two GELUs differ by little."""
    read = GPT2Folder.__call__

    def broken_read(self, name, rows):
        value = read(self, name, rows)
        if broken == "a dropped bias" and name == "blocks.0.mlp.fc.bias":
            return torch.zeros_like(value)
        if broken == "a square weight left untransposed" and name == "blocks.0.attn.proj.weight":
            return value.t()
        return value

    monkeypatch.setattr(GPT2Folder, "__call__", broken_read)
    if broken == "the exact GELU":
        monkeypatch.setattr(gpt2_folder, "FROM_HF_ACTIVATIONS", {"gelu_new": "gelu"})
    with torch.no_grad():
        assert (loaded(folder)(IDS)[0] - expected).abs().max() > 1e-4


def edit_config(**changes):
    def edit(path):
        config = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, **changes}))
    return edit


def without_weight(path):
    tensors = load_file(path / "model.safetensors")
    del tensors["transformer.h.1.mlp.c_fc.bias"]
    save_file(tensors, path / "model.safetensors")


def other_tokenizer(path):
    from mingpt.tokens.tokenizer import train_bpe

    train_bpe(iter([make_text(20000)]), vocab_size=280).save(str(path / "tokenizer.json"))


def character_tokenizer(path):
    """export_hf.py's tokenizer.json of a character model, here of the folder's 300 ids."""
    from mingpt.export_hf import character_tokenizer

    character_tokenizer([chr(0x100 + i) for i in range(300)]).save(str(path / "tokenizer.json"))


BAD_FOLDERS = [  # (what is wrong, how to make it of a good copy, what the line says after the path)
    ("missing", lambda path: shutil.rmtree(path), "does not exist"),
    ("no config.json", lambda path: (path / "config.json").unlink(),
     "has no config.json (a partial download?)"),
    ("another architecture", edit_config(model_type="llama"), "holds a llama model, not GPT-2"),
    ("no weights", lambda path: (path / "model.safetensors").unlink(), "has no model.safetensors"),
    ("truncated weights", lambda path: (path / "model.safetensors").write_bytes(
        (path / "model.safetensors").read_bytes()[:5000]), "has an unreadable model.safetensors"),
    ("a missing weight", without_weight, "lacks the weight transformer.h.1.mlp.c_fc.bias"),
    ("a config of another shape", edit_config(n_embd=64),
     "has transformer.wte.weight of shape (300, 32) where its config.json makes it (300, 64)"),
    ("no tokenizer", lambda path: (path / "tokenizer.json").unlink(), "has no tokenizer.json"),
    ("a tokenizer of another size", other_tokenizer,
     "has a tokenizer.json of 280 tokens for a model of vocab_size 300"),
    ("a wider MLP", edit_config(n_inner=64), "has an MLP of n_inner=64"),
    ("a character model's export", character_tokenizer,
     "holds a character model (export_hf.py's tokenizer.json of one token per character); init_from "
     "tokenizes the data with a folder's byte-level BPE only; to train the character model on, resume "
     "the snapshot it was exported from"),
]


@pytest.mark.parametrize("case, make, said", BAD_FOLDERS, ids=[case for case, _, _ in BAD_FOLDERS])
def test_a_folder_that_does_not_fit_is_refused_in_one_line(folder, tmp_path, case, make, said):
    path = copied(folder, tmp_path)
    make(path)
    with pytest.raises(ConfigError) as error:
        open_folder(str(path))
    assert str(error.value).startswith(f"gpt_config.init_from: {path} {said}")
    assert "\n" not in str(error.value)


@pytest.mark.parametrize("given, said", [
    ({}, None), ({"n_layer": None, "n_head": None, "n_embd": None}, None), ({"n_layer": 2}, None),
    ({"n_layer": 24},
     "gpt_config.n_layer: 24, but gpt_config.init_from={path} has n_layer=2; drop gpt_config.n_layer"),
    ({"model_type": "gpt-nano", "n_layer": None, "n_head": None, "n_embd": None},
     "gpt_config.model_type: gpt-nano is n_layer=3, n_head=3, n_embd=48, but gpt_config.init_from={path} is "
     "n_layer=2, n_head=2, n_embd=32"),
])
def test_the_folder_gives_the_shape_and_other_sizes_are_refused(folder, given, said):
    opened = open_folder(str(folder))
    config = GPTConfig(**given, init_from=str(folder))
    if said is None:
        config = opened.model_config(config)
        assert (config.n_layer, config.n_head, config.n_embd, config.activation) == (2, 2, 32, "gelu_tanh")
        return
    with pytest.raises(ConfigError) as error:
        opened.model_config(config)
    assert str(error.value).startswith(said.format(path=folder))


def test_the_data_takes_the_folders_tokenizer_and_at_most_its_positions(folder):
    opened = open_folder(str(folder))
    opened.check_data("char", 64)
    opened.check_data(opened.tokenizer_path, 16)
    with pytest.raises(ConfigError, match="^data_config.block_size: 65 is more than the 64 positions"):
        opened.check_data("char", 65)
    with pytest.raises(ConfigError, match="^data_config.tokenizer: bpe, but gpt_config.init_from tokenizes"):
        opened.check_data("bpe", 16)


@pytest.mark.slow
def test_training_starts_from_the_folder_and_a_snapshot_comes_first(folder, tmp_path, capsys):
    """One process: the folder's shape, activation and tokenizer go into the snapshot; run again,
    the snapshot is resumed (the folder only names the shape); a size against the folder's is one
    line and exit 1."""
    text = tmp_path / "input.txt"
    text.write_text(make_text(6000, seed=5))
    overrides = tiny_overrides(text, tmp_path / "snap.pt", gpt_config__init_from=folder,
                               gpt_config__n_layer=8, gpt_config__n_head=8, gpt_config__n_embd=512,
                               trainer_config__max_steps=3)
    first = run_main_in_process(overrides, capsys)
    assert_ok(first)
    assert f"Initial weights from {folder} (GPT-2, gelu_tanh)" in first.stdout
    assert "of a BPE vocabulary of 300." in first.stdout
    snapshot = read_snapshot(str(tmp_path / "snap.pt"))
    assert snapshot.model_config["n_layer"] == 2 and snapshot.model_config["activation"] == "gelu_tanh"
    assert snapshot.tokenizer == (folder / "tokenizer.json").read_text()

    again = run_main_in_process([*overrides, "trainer_config.max_steps=4"], capsys)
    assert_ok(again)
    assert "Resuming training from snapshot" in again.stdout

    before = sha256(tmp_path / "snap.pt")
    refused = run_main_in_process([*overrides, "gpt_config.n_layer=24"], capsys)
    assert one_error_line(refused).startswith("error: gpt_config.n_layer: 24, but gpt_config.init_from=")
    assert sha256(tmp_path / "snap.pt") == before
