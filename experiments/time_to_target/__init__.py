"""Time to a target, adaptive against every size of a fixed sweep, over seeds (item 4).

`study` holds the study; its command: ``python -m experiments.time_to_target`` (``--help``).
"""
