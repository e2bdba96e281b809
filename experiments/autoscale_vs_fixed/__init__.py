"""Adaptive batch size on real training, against a sweep of fixed batch sizes in the same run.

`study` holds the study; its command: ``python -m experiments.autoscale_vs_fixed`` (``--help``).
"""
