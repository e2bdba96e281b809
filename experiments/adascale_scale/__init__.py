"""AdaScale at scale: the classifier trained to the same progress at scales 1, 4 and 16.

`study` holds the study; its command: ``python -m experiments.adascale_scale`` (``--help``).
"""
