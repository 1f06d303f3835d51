"""What a run tells its user: one-line errors, the one logger (rank 0 speaks), JSON-lines metrics,
live progress and model FLOPs utilisation."""
