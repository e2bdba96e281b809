"""Simulated against real: item 4's time-to-target comparison replayed from measured profiles.

`study` holds the study; its command: ``python -m experiments.sim_compare`` (``--help``).
"""
