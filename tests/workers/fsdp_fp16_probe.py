"""Run by test_parallel.py (under torchrun, or alone): fp16 training with a GradScaler on the CPU.

    fsdp_fp16_probe.py METHOD SNAPSHOT_FOLDER

A CPU never chooses fp16 (precision.py), so this forces the CUDA-style choice to exercise that path
here: with fsdp, FSDP's fp16 mixed-precision policy and the sharded scaler (FusedShardedGradScaler);
with ddp, autocast and the plain GradScaler; the fused AdamW with both. It resumes from the snapshot
folder's newest snapshot when there is one, trains 30 steps and saves. Rank 0 prints
`FP16 <scaler> <first loss> <last loss> <scale>`.
"""
import sys

import torch

from mingpt import trainer as trainer_module
from mingpt.char_dataset import CharDataset
from mingpt.distributed.precision import Precision
from mingpt.distributed.process_group import distributed_session
from mingpt.model import GPT, GPTConfig, OptimizerConfig

trainer_module.resolve_precision = lambda use_amp, amp_dtype, device: Precision(device.type, torch.float16)

method, snapshots = sys.argv[1:3]
with distributed_session() as env:
    dataset = CharDataset("".join(chr(97 + (i * 31) % 20) for i in range(5000)), 16)
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=dataset.vocab_size, block_size=16))
    config = trainer_module.TrainerConfig(batch_size=16, data_loader_workers=0, distributed_method=method,
                                          snapshot_path=snapshots)
    trainer = trainer_module.Trainer(config, model, OptimizerConfig(learning_rate=3e-3), dataset, None,
                                     dataset.vocab, env)
    batches = iter(trainer.train_loader)
    losses = [trainer.train_step(*trainer.to_device(next(batches)))[0].item() for _ in range(30)]
    trainer.save_snapshot("the end")
    if env.is_main:
        print(f"FP16 {type(trainer.scaler).__name__} {losses[0]} {losses[-1]} {trainer.scaler.get_scale()}")
    del trainer, model
