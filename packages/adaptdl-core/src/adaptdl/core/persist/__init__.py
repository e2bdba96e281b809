"""What survives a restart: the storage protocol, checkpoints, manifests, the journal.

``storage`` declares what core needs of a file system; ``localfs`` is the one module of
core that touches files (its test checks that). Everything above writes and reads
through those two.
"""
