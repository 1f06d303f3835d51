"""minGPT-DDP: train a GPT with DDP, FSDP or HSDP, from one CPU to a Slurm cluster of GPUs.

docs/ARCHITECTURE.md draws the packages, their layers and how a step and a snapshot flow through them.
"""
