"""Framework-free core of AdaptDL: every decision of elastic, adaptive training.

Nothing here imports torch or touches a GPU, a socket, a clock or a file except
through the small interfaces handed to it.
"""
