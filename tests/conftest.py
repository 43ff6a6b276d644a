"""Set-up for every test module: without a GPU, Triton kernels run in the interpreter.

``TRITON_INTERPRET`` is read when triton is imported, so it is set here: pytest imports this file before
any test module (and so before anything imports triton).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
