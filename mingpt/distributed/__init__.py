"""Distributed setup and parallelism: the process group, DDP/FSDP/HSDP, precision, activation
checkpointing, memory estimates, and the decisions every rank takes at the same step."""
