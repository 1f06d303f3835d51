"""Run by the tests under torchrun: for each method, one training step, an eval pass and a
snapshot, with what each rank saw written to OUT_DIR/<method>_rank{N}.json. METHODS is a
comma-separated list of ddp and fsdp, probed one after the other in one process group.

    torchrun --standalone --nproc_per_node=2 tests/workers/probe.py METHODS TEXT_FILE OUT_DIR
"""
import gc
import hashlib
import json
import sys
from pathlib import Path

import torch

from mingpt.char_dataset import CharDataset, DataConfig, split_dataset
from mingpt.common import files
from mingpt.common.logger import configure_logging
from mingpt.distributed.parallel import gather_full_state, is_sharded, local_parameter_bytes, unwrap
from mingpt.distributed.process_group import distributed_session
from mingpt.model import GPT, GPTConfig
from mingpt.optimizer import OptimizerConfig
from mingpt.start_up import place_model
from mingpt.trainer import Trainer, TrainerConfig

SNAPSHOTS = "memory://probe"  # each process has its own in-memory filesystem


def digest(trainer: Trainer) -> str:
    """Hash of this rank's full view of the parameters (gathered first when sharded)."""
    if is_sharded(trainer.model):
        state, _ = gather_full_state(trainer.model, trainer.optimizer)
    else:
        state = unwrap(trainer.model).state_dict()
    h = hashlib.sha256()
    for tensor in state.values():
        h.update(bytes(tensor.detach().contiguous().view(torch.uint8).flatten().tolist()))
    return h.hexdigest()


@torch.no_grad()
def local_test_loss(trainer: Trainer) -> tuple[float, int]:
    """This rank's summed test loss and sample count, computed apart from Trainer.evaluate."""
    trainer.model.eval()
    total, count = 0.0, 0
    for windows in trainer.test_loader:
        inputs, targets = trainer.to_device(windows)
        total += trainer.model(inputs, targets)[1].item() * len(inputs)
        count += len(inputs)
    trainer.model.train()
    return total, count


def probe(method: str, text_path: str, env) -> dict:
    """What this rank sees of one step, an eval pass and a snapshot under method."""
    data_config = DataConfig(path=text_path, block_size=16)
    dataset = CharDataset(Path(text_path).read_text(), data_config.block_size)
    train_set, test_set = split_dataset(dataset, data_config, seed=0)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=dataset.vocab_size, block_size=16))
    snapshot = f"{SNAPSHOTS}/{method}/snap.pt"
    config = TrainerConfig(batch_size=16, data_loader_workers=0, use_amp=False, snapshot_path=snapshot,
                           distributed_method=method)
    trainer = Trainer(config, place_model(config, OptimizerConfig(), model, env), train_set, test_set,
                      dataset.vocab, env)

    trainer.train_loader.sampler.set_epoch(1)
    epoch_samples = [start for batch in trainer.train_loader.sampler
                     for start in train_set.starts(batch).tolist()]
    inputs, targets = trainer.to_device(next(iter(trainer.train_loader)))
    before = digest(trainer)
    trainer._run_batch(inputs, targets)
    after = digest(trainer)

    modes = []
    hook = unwrap(trainer.model).register_forward_pre_hook(lambda m, args: modes.append(m.training))
    eval_loss = trainer.evaluate(epoch=1)
    hook.remove()
    local_sum, local_count = local_test_loss(trainer)

    trainer._save_snapshot("epoch 1")
    return {
        "rank": env.rank,
        "world_size": env.world_size,
        "parameter_bytes": sum(p.numel() * p.element_size() for p in trainer.model.parameters()),
        "local_parameter_bytes": local_parameter_bytes(trainer.model),
        "digest_before": before,
        "digest_after": after,
        "first_batch": epoch_samples[: config.batch_size],
        "epoch_samples": epoch_samples,
        "train_size": len(train_set),
        "eval_modes": modes,
        "training_after_eval": unwrap(trainer.model).training,
        "eval_loss": eval_loss,
        "local_loss_sum": local_sum,
        "local_count": local_count,
        "wrote_snapshot": files.exists(snapshot),
    }


def record(methods: list[str], text_path: str, out_dir: Path, env) -> None:
    for method in methods:
        facts = probe(method, text_path, env)
        Path(out_dir, f"{method}_rank{env.rank}.json").write_text(json.dumps(facts))
        gc.collect()  # this method's model and trainer, freed before the next is built


if __name__ == "__main__":
    with distributed_session() as env:
        configure_logging(env.rank)
        record(sys.argv[1].split(","), sys.argv[2], Path(sys.argv[3]), env)
