"""What the job measures about itself: gradient noise, step times, losses, reductions.

The step contract (``step``) feeds this layer; ``metrics`` holds what was measured and
is checkpointed. Decisions read it; it decides nothing but what to measure next.
"""
