"""_release: a collective's tensors are let go before adaptdl returns, and exit waits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch.distributed as dist

import torch
from adaptdl.torch import _context, _release


def test_holders_count_the_reference_torch_holds_until_released() -> None:
    _context.init_process_group("gloo")  # one replica: gloo still runs a worker thread
    out, source = [torch.empty(4)], torch.ones(4)
    tensors = [*out, source]
    before = _release.holders(tensors)
    work = dist.all_gather(out, source, async_op=True)
    assert work is not None
    work.wait()
    # The Work still holds the tensors: their counts are one higher.
    assert [a - b for a, b in zip(_release.holders(tensors), before, strict=True)] == [1, 1]
    del work
    _release.wait_released(tensors, before)
    assert _release.holders(tensors) == before
    assert torch.equal(out[0], source)


def test_the_exit_settle_runs_once_at_exit() -> None:
    program = textwrap.dedent(
        """
        import types
        from adaptdl.torch import _release
        _release.time = types.SimpleNamespace(sleep=lambda s: print("settle", s))
        _release.register_settle_at_exit()
        _release.register_settle_at_exit()
        print("exiting")
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", program], capture_output=True, text=True, timeout=120, check=True
    )
    assert done.stdout.splitlines() == ["exiting", f"settle {_release.SETTLE_SECONDS}"]
