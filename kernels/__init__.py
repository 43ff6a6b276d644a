"""Ops the model code calls, each with a plain-PyTorch reference and (on GPUs) a Triton version.

``get_ops(backend)`` returns the op table for ``"torch"`` or ``"triton"``. This package must not import the
engine, mesh or any service.
"""

from kernels.ops import Ops, get_ops

__all__ = ["Ops", "get_ops"]
