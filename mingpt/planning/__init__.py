"""Capacity planning, before anything is allocated: the project's own training step traced on
tensors without memory (step_trace), a rank's peak memory from it (memory: the start-up's
check and plan.py's rows), a step's communication and time (step_time), and the advice plan.py
prints (advice)."""
