"""The training loop's skeleton: loaders, epochs, batch boundaries and the lifecycle.

Where a decision takes effect: a loader applies the batch size at a boundary, a stop
becomes a checkpoint and an exit code.
"""
