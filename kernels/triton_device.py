"""What the Triton launch heuristics read about the GPU (its SM count, cached per device), whether
kernels launch with programmatic dependent launch, and the one device-side preamble that goes with it
(``pdl_wait``).

The host-side part must not read device values, so it is safe while a graph is captured.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (the current one when ``device`` has no index)."""
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Programmatic dependent launch (PDL, compute capability 9.0+): a kernel launched with it may start
# while the previous kernel in the stream is still running; it waits (``griddepcontrol.wait``) before it
# touches anything the previous kernel writes, so launch latency and block scheduling overlap the previous
# kernel's tail. Captured CUDA graphs keep it (programmatic edges). Benchmarks switch it off to compare.
PDL_ENABLED = True


@functools.cache
def _supports_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_kwargs(device: torch.device) -> dict[str, bool]:
    """Launch arguments for a kernel with a ``USE_PDL`` constexpr (which must then call ``pdl_wait``
    before reading its inputs or writing anything): PDL on where the device supports it."""
    if not PDL_ENABLED or device.type != "cuda":
        return {"USE_PDL": False}
    index = device.index if device.index is not None else torch.cuda.current_device()
    if not _supports_pdl(index):
        return {"USE_PDL": False}
    return {"USE_PDL": True, "launch_pdl": True}


def dot_precision(dtype: torch.dtype) -> str:
    """``tl.dot``'s input precision for operands of ``dtype``: exact products for float32 ("ieee"), the
    tensor cores' own for 16-bit types (where "tf32" changes nothing)."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible
    (``griddepcontrol.wait``), then let the next kernel launch (``griddepcontrol.launch_dependents``): the
    next kernel's programs are then scheduled while this one runs, and wait in turn. A no-op without PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
