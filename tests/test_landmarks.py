"""The tutorial's way in: each of the original example's 23 names is where a reader of the tutorial looks
(the same name in the same file), or where docs/ARCHITECTURE.md's "Where the original's code went"
says, and that table has a row for each; the original's files say in their docstrings where the rest
went."""
import ast
import importlib
import inspect
import re

import pytest
from helpers import MINGPT, REPO

LANDMARKS = {
    ("main.py", "ddp_setup"): "mingpt.main:ddp_setup",
    ("main.py", "get_train_objs"): "mingpt.main:get_train_objs",
    ("main.py", "main"): "mingpt.main:main",
    ("trainer.py", "TrainerConfig"): "mingpt.trainer:TrainerConfig",
    ("trainer.py", "Snapshot"): "mingpt.trainer:Snapshot",
    ("trainer.py", "upload_to_s3"): "mingpt.storage.snapshot:write_snapshot",
    ("trainer.py", "Trainer"): "mingpt.trainer:Trainer",
    ("trainer.py", "_prepare_dataloader"): "mingpt.trainer:Trainer._prepare_dataloader",
    ("trainer.py", "_load_snapshot"): "mingpt.trainer:Trainer._load_snapshot",
    ("trainer.py", "_run_batch"): "mingpt.trainer:Trainer._run_batch",
    ("trainer.py", "_run_epoch"): "mingpt.trainer:Trainer._run_epoch",
    ("trainer.py", "_save_snapshot"): "mingpt.trainer:Trainer._save_snapshot",
    ("trainer.py", "train"): "mingpt.trainer:Trainer.train",
    ("model.py", "GPTConfig"): "mingpt.model:GPTConfig",
    ("model.py", "OptimizerConfig"): "mingpt.optimizer:OptimizerConfig",
    ("model.py", "MultiheadAttentionLayer"): "mingpt.model:MultiheadAttentionLayer",
    ("model.py", "Block"): "mingpt.model:Block",
    ("model.py", "EmbeddingStem"): "mingpt.model:GPT.forward",
    ("model.py", "GPT"): "mingpt.model:GPT",
    ("model.py", "generate"): "mingpt.model:GPT.generate",
    ("model.py", "create_optimizer"): "mingpt.optimizer:create_optimizer",
    ("char_dataset.py", "DataConfig"): "mingpt.char_dataset:DataConfig",
    ("char_dataset.py", "CharDataset"): "mingpt.char_dataset:CharDataset",
}
"""(the original's file, a name it defines) -> where that is here (module:qualified name)."""
MOVED = {("trainer.py", "upload_to_s3"), ("model.py", "EmbeddingStem")}
"""The two whose concept lives elsewhere under another name (the table says where)."""
MOVED_FILE = {("model.py", "OptimizerConfig"): "optimizer.py", ("model.py", "create_optimizer"): "optimizer.py"}
"""Under their own names, in a file of their own beside the original's (its docstring says so)."""


def resolve(target: str):
    module_name, _, qualified = target.partition(":")
    found = importlib.import_module(module_name)
    for part in qualified.split("."):
        found = getattr(found, part)
    return found


def test_the_original_s_names_are_where_the_tutorial_puts_them():
    assert len(LANDMARKS) == 23
    for (original, name), target in LANDMARKS.items():
        found = resolve(target)
        if (original, name) in MOVED:
            continue
        assert target.rsplit(".", 1)[-1].rsplit(":", 1)[-1] == name, (original, name, target)
        defined_in = inspect.getsourcefile(inspect.unwrap(found))  # ddp_setup is a context manager
        home = MOVED_FILE.get((original, name), original)
        assert defined_in.endswith(f"mingpt/{home}") or name == "Snapshot", (original, name, defined_in)


def test_the_embedding_stem_is_the_first_lines_of_gpt_s_forward():
    source = inspect.getsource(resolve(LANDMARKS["model.py", "EmbeddingStem"]))
    assert "self.tok_emb(idx) + self.pos_emb(positions)" in source


def test_the_architecture_page_has_a_row_for_each_name_and_no_other():
    page = (REPO / "docs" / "ARCHITECTURE.md").read_text()
    section = page.split("## Where the original's code went", 1)[1]
    rows = re.findall(r"^\| `([\w.]+\.py)` \| `(\w+)` \| (.+) \|$", section, re.M)
    assert {(original, name) for original, name, _ in rows} == set(LANDMARKS)
    for original, name, here in rows:
        where = LANDMARKS[original, name].split(":")[1]
        assert where.split(".")[0] in here, (original, name, here)


@pytest.mark.parametrize("original", ["main.py", "trainer.py", "model.py", "char_dataset.py"])
def test_each_original_file_says_where_its_landmarks_are(original):
    docstring = ast.get_docstring(ast.parse((MINGPT / original).read_text()))
    assert "original's" in docstring, f"{original}'s docstring names none of the original's landmarks"
