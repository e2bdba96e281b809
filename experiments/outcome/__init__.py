"""Issue 8's and 36's outcome: RESULTS.md, summary.json, and items 1-4 in one run.

``python -m experiments.outcome`` (``nox -s outcome``; `run_all`) runs the quick form of
`experiments.gns_accuracy`, `experiments.adascale_scale`,
`experiments.autoscale_vs_fixed` and `experiments.time_to_target`, printing their
tables and writing the plots. RESULTS.md opens with what holds today.
"""
