"""Framework-free core of AdaptDL: every decision of elastic, adaptive training.

Nothing here imports torch or touches a GPU, a socket, a clock or a file except
through the small interfaces handed to it.
"""

from adaptdl.core._conflict import check_no_original as _check_no_original

# Every module of every distribution of ours imports adaptdl.core first.
_check_no_original()
