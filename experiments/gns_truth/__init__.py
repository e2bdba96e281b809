"""The shapes CNN's noise statistics, estimated and exact, along one training run.

`study` holds the study; its command: ``python -m experiments.gns_truth`` (``--help``).
"""
