"""Trace replay (issue 36, item 4): adaptive batch size against every fixed size on the
Pollux study's real GPU measurements, through core's decisions in the simulator.

* `curves`: the traces' validation curves and the protocol's targets;
* `replay`: times to a target, fixed (measured steps) and adaptive (simulated);
* ``python -m experiments.trace_replay``: the table and the JSON rows.

The protocol is in this folder's README.md.
"""
