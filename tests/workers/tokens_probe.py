"""Run by the tests under torchrun: what subword tokens and GPT-2 weights need of several ranks, in
one launch (main.py's own get_train_objs and train, in this process group):
- bpe: a text tokenized by a BPE trained on it (local rank 0 makes the token file while the other
  waits), 6 steps with a snapshot every 3 into OUT_DIR/bpe_a; then the step-3 snapshot alone, in
  OUT_DIR/bpe_b, resumed up to step 6 (the test holds the two step-6 snapshots bit for bit);
- ddp, fsdp: a run starting from the GPT-2 folder: the logits of the ids in IDS_FILE before any step
  (eval mode; rank 0 writes OUT_DIR/<method>_logits.pt), then 2 steps, snapshots in OUT_DIR/<method>.

    torchrun --standalone --nproc_per_node=2 tests/workers/tokens_probe.py TEXT_FILE FOLDER IDS_FILE OUT_DIR
"""
import shutil
import sys
from pathlib import Path

import torch

from mingpt.char_dataset import DataConfig
from mingpt.common.logger import configure_logging
from mingpt.distributed.process_group import barrier, distributed_session
from mingpt.main import get_train_objs, train
from mingpt.model import GPTConfig
from mingpt.optimizer import OptimizerConfig
from mingpt.run_config import TrainConfig
from mingpt.start_up import place_model
from mingpt.trainer import Trainer, TrainerConfig

TINY = GPTConfig(n_layer=2, n_head=2, n_embd=32)


def config(data: DataConfig, snapshots: Path, gpt: GPTConfig = TINY, **trainer) -> TrainConfig:
    settings = dict(batch_size=8, data_loader_workers=0, use_amp=False, snapshot_path=str(snapshots),
                    log_every=1, max_steps=6, save_every_steps=3)
    trainer_config = TrainerConfig(**{**settings, **trainer})
    return TrainConfig(data, gpt, trainer_config, OptimizerConfig(learning_rate=3e-3))


def bpe_and_resume(text: str, out: Path, env) -> None:
    data = DataConfig(path=text, block_size=16, tokenizer="bpe", bpe_vocab_size=300)
    train(config(data, out / "bpe_a"), env)
    if env.is_main:
        (out / "bpe_b").mkdir()
        shutil.copy(out / "bpe_a" / "snapshot_000000003.pt", out / "bpe_b")
    barrier()
    train(config(data, out / "bpe_b"), env)


def from_gpt2(method: str, text: str, folder: str, ids: torch.Tensor, out: Path, env) -> None:
    run = config(DataConfig(path=text, block_size=16), out / method, GPTConfig(init_from=folder),
                 max_steps=2, distributed_method=method)
    model, dataset, train_set, test_set = get_train_objs(run, env)
    placed = place_model(run.trainer_config, run.optimizer_config, model, env)
    trainer = Trainer(run.trainer_config, placed, train_set, test_set, dataset.vocabulary, env)
    trainer.model.eval()
    with torch.no_grad():
        logits = trainer.model(ids.to(env.device))[0]
    trainer.model.train()
    if env.is_main:
        torch.save(logits, out / f"{method}_logits.pt")
    trainer.train()


def main(text: str, folder: str, ids_file: str, out_dir: str) -> None:
    out = Path(out_dir)
    with distributed_session() as env:
        configure_logging(env.rank)
        bpe_and_resume(text, out, env)
        for method in ("ddp", "fsdp"):
            from_gpt2(method, text, folder, torch.load(ids_file), out, env)


if __name__ == "__main__":
    main(*sys.argv[1:5])
