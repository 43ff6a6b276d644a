"""The interpreter patch (tests/interpreter_patching.py): a kernel's helper calls no longer re-swap the
language modules, and what the kernel computes is unchanged."""

from __future__ import annotations

import inspect
import os

import pytest
import torch
import triton
import triton.language as tl

from tests import interpreter_patching

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="patches the Triton interpreter (CPU runs)"
)


@triton.jit
def _scaled(x, k):
    return x * k


@triton.jit
def _loop_kernel(x_ptr, out_ptr, LOOPS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for i in range(LOOPS):
        acc += _scaled(x, i + 1)  # our helper; tl.zeros and tl.sum are Triton's own jit helpers
    tl.store(out_ptr + offs, acc + tl.sum(x, axis=0))


def test_helper_calls_do_not_rewalk_the_language_modules(monkeypatch: pytest.MonkeyPatch) -> None:
    assert interpreter_patching.install()  # this suite's Triton has the names the patch needs
    walks = []
    real = inspect.getmembers
    monkeypatch.setattr(inspect, "getmembers", lambda *a, **k: walks.append(1) or real(*a, **k))

    def run(loops: int) -> int:
        x = torch.randn(16)
        out = torch.full((16,), float("nan"))
        walks.clear()
        _loop_kernel[(1,)](x, out, LOOPS=loops, BLOCK=16)
        torch.testing.assert_close(out, x * (loops * (loops + 1) / 2) + x.sum())
        return len(walks)

    run(1)
    # Unpatched, every helper call walks the modules again, so the count grows with the loop.
    assert run(2) == run(40) > 0
