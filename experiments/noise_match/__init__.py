"""Whether a large batch reaches the target early because its steps are less noisy.

`study` holds the study; its command: ``python -m experiments.noise_match`` (``--help``).
"""
