"""The experiments' harness: what every study shares, and nothing a study decides.

* `launch`: torchrun workers (``launch``, ``worker_config``, ``write_result``), data
  helpers;
* `problems`, `regression`, `classifier`: the problems (shapes, Dyck, the held-out
  character LM; the closed-form regression; the MLP classifier and its worker);
* `trainer`: the training loop every torchrun worker runs, and its worker;
* `variants`: the one declared choice of what a run changes from core's path;
  `noisematch`: the noise-matching mechanism; `estimators`: estimators declared
  through core's factory;
* `runs`: the time-to-target problems' calibrations, configs, launches and targets;
* `summaries`: medians, pairs by seed, bootstrap intervals, tables.

A leaf: the harness imports no study (`tests/outcome/test_layout.py` checks it).
"""
