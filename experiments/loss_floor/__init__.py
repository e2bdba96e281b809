"""The loss floor study (#18, item 4's eleventh to thirteenth follow-ups): its tables.

`study` holds the study; its command: ``python -m experiments.loss_floor`` (``--help``).
"""
