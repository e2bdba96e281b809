"""Outcome experiments: adaptive training is statistically sound, in numbers (issue 8).

* `gns_accuracy`: the gradient-noise estimates against closed-form truth;
* `adascale_scale`: AdaScale (and linear scaling) at scales 1, 4 and 16;
* `autoscale_vs_fixed`: adaptive batch size against a sweep of fixed ones;
* `run_all`: all three, printing the tables and writing the plots.

Every training run is a real ``torchrun`` job through ``adaptdl.torch``; the data
is synthetic, generated from a seeded numpy Generator, so nothing is downloaded.
"""
