"""The order of samples: seeds, permutations, per-replica sampling and shard plans.

Pure functions of a seed, an epoch and the replicas; no state of the job. Imports
nothing of core but ``validate``.
"""
