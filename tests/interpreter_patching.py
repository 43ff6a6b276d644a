"""Takes a repeated cost out of the Triton interpreter, which the CPU suite's kernel tests run in.

The interpreter (``TRITON_INTERPRET=1``) swaps ``triton.language``'s builtins for interpreted ones when a
kernel launches (``GridExecutor.__call__``) and again at **every call of a ``@triton.jit`` helper inside
the kernel** (``InterpretedFunction.__call__``), each time walking the language modules with
``inspect.getmembers``; the helper's swap is never undone. Our kernels call helpers (``pdl_wait``,
``tl.sum``, ``tl.zeros``, ...) in every program, so in Triton 3.9 about a third of an interpreted engine
step went to re-swapping what was already swapped.

``install`` makes a helper's swap a no-op when the kernel that runs it has already swapped every language
module the helper sees (``tl``, ``tl.core``); a helper that sees one not yet swapped swaps it as before.
What each kernel computes is unchanged: every kernel test compares against its PyTorch reference with
this in place. Where Triton's interpreter no longer has these names, nothing is patched.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

_state = threading.local()  # per thread: the language modules each running launch has swapped


def install() -> bool:
    """Patch the interpreter in this process. Returns whether it was patched."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    if not all(hasattr(interpreter, n) for n in ("_patch_lang", "_LangPatchScope", "GridExecutor")):
        return False
    if getattr(interpreter, "_pdmesh_patched", False):
        return True
    swap_for: Callable[[Any], Any] = interpreter._patch_lang
    launch: Callable[..., Any] = interpreter.GridExecutor.__call__

    def languages(fn: Any) -> frozenset[int]:
        return frozenset(id(v) for v in fn.__globals__.values() if v is tl or v is tl.core)

    def patch_lang(fn: Any) -> Any:
        launches = getattr(_state, "launches", None)
        if not launches:  # not inside a launch: as Triton does
            return swap_for(fn)
        needed = languages(fn)
        swapped = launches[-1]
        if needed <= swapped:
            return interpreter._LangPatchScope()  # nothing to swap, nothing to undo
        launches[-1] = swapped | needed
        return swap_for(fn)

    def grid_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        launches = _state.__dict__.setdefault("launches", [])
        launches.append(frozenset())
        try:
            return launch(self, *args, **kwargs)
        finally:
            launches.pop()

    interpreter._patch_lang = patch_lang
    interpreter.GridExecutor.__call__ = grid_call
    interpreter._pdmesh_patched = True
    return True
