"""Decisions made from the measurements: the batch size and the scheduler's hints."""
