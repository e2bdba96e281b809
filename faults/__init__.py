"""Fault injection for AdaptDL: randomised trials of real torchrun jobs (see run.py)."""
