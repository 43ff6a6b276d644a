"""Set-up for every test module: without a GPU, Triton kernels run in the interpreter.

``TRITON_INTERPRET`` is read when triton is imported, so it is set here: pytest imports this file before
any test module (and so before anything imports triton). The interpreter then gets
``tests.interpreter_patching``, which takes a repeated cost out of its helper calls.
"""

from __future__ import annotations

import importlib.metadata
import os

import pytest
import torch

from tests import interpreter_patching

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":
    interpreter_patching.install()


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to run beside Hugging Face's ``kernels`` package: its import name is this project's
    ``kernels/``, so transformers, finding its metadata, imports ours in its place and the tests that
    build transformers models fail with an ImportError far from the cause (docs/architecture.md,
    "Dependencies")."""
    try:
        found = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        return
    raise pytest.UsageError(
        f"Hugging Face's `kernels` {found} is installed, and its import name is pdmesh's `kernels/`: "
        "transformers would import pdmesh's package in its place. `pip uninstall kernels` (transformers "
        "requires it from 5.25; pdmesh pins transformers below that)."
    )
