"""Gradient-noise accuracy: the job's |G|^2 and tr(Sigma) against closed-form truth.

`study` holds the study; its command: ``python -m experiments.gns_accuracy`` (``--help``).
"""
