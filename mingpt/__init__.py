"""minGPT-DDP: train a GPT with DDP, FSDP or HSDP, from one CPU to a Slurm cluster of GPUs.

At this level: the original's files (main.py, trainer.py, model.py, char_dataset.py,
gpt2_train_cfg.yaml) and the commands a user runs (launch.py, generate.py, model_size.py,
plot_metrics.py, prepare_data.py, convert_snapshot.py). Support code lives in four packages:

    distributed/  who each process is, how the model is spread over the ranks, decisions all ranks share
    storage/      files anywhere (fsspec), snapshots: their format, stores, background saves, the Checkpointer
    reporting/    errors said in one line, the one logger, metrics, progress, FLOPs
    tokens/       the token file every rank maps, its global sample order, the batches of each rank

docs/ARCHITECTURE.md draws the whole.
"""
import atexit
import gc

# At exit, Python's finalisation collects garbage over every object the process still holds: with
# torch imported, about 0.7 s of every process's end (every rank, every restart, every command).
# Frozen first, those objects are not scanned; the system takes the memory back with the process.
# Registered at the first import of the package, this handler runs after every other one.
atexit.register(gc.freeze)
