"""What the Triton launch heuristics read about the GPU (its SM count, cached per device), whether
kernels launch with programmatic dependent launch, and the one device-side preamble that goes with it
(``pdl_wait``), and L2 prefetch (``l2_prefetch``).

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


@triton.jit
def pdl_wait(USE_PDL: tl.constexpr):
    """Wait until the previous kernel in the stream has finished and its writes are visible
    (``griddepcontrol.wait``), then let the next kernel launch (``griddepcontrol.launch_dependents``): the
    next kernel's programs are then scheduled while this one runs, and wait in turn. A no-op without PDL."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


# L2 prefetch (compute capability 9.0+): a kernel asks the L2 cache to fetch bytes it or the next kernel
# will read, a hint with no registers and no wait. Weights do not depend on the previous kernel, so a GEMV
# prefetches its tile before its PDL wait, and a kernel that is bound by latency (decode attention)
# prefetches the weights of the projection after it: HBM works while the chain of small kernels waits.
# Modes: 0 off, 1 bulk (``cp.async.bulk.prefetch.L2``, chunks of at least 4 KB), 2 lines
# (``prefetch.global.L2``, one 128-byte line per lane and step). Results do not depend on it.
L2_PREFETCH_MODE = 2


def prefetch_kwargs(device: torch.device, num_warps: int) -> dict[str, int]:
    """Launch arguments for a kernel with ``PREFETCH`` and ``PF_LANES`` constexprs (for ``l2_prefetch``):
    ``L2_PREFETCH_MODE`` where the device supports it, one prefetch lane per thread."""
    mode = L2_PREFETCH_MODE if device.type == "cuda" else 0
    if mode:
        index = device.index if device.index is not None else torch.cuda.current_device()
        mode = mode if _supports_pdl(index) else 0  # the same compute capability, 9.0
    return {"PREFETCH": mode, "PF_LANES": 32 * num_warps}


_BULK_MIN_BYTES = tl.constexpr(4096)


@triton.jit
def l2_prefetch(ptr, numel, PREFETCH: tl.constexpr, PF_LANES: tl.constexpr):
    """Ask L2 to fetch ``numel`` elements from ``ptr`` (mode PREFETCH, see ``L2_PREFETCH_MODE``; PF_LANES:
    the program's threads). Bulk prefetches need 16-byte starts and sizes, so up to 31 bytes of the range
    may be left out: it is a hint. No-op with PREFETCH 0 (the interpreter, older GPUs)."""
    if PREFETCH != 0:
        nbytes = numel.to(tl.int64) * (ptr.dtype.element_ty.primitive_bitwidth // 8)
        base = ptr.to(tl.pointer_type(tl.int8))
        lanes = tl.arange(0, PF_LANES).to(tl.int64)
        if PREFETCH == 1:
            ops = tl.maximum(tl.minimum(tl.cdiv(nbytes, _BULK_MIN_BYTES), PF_LANES), 1)
            chunk = tl.cdiv(tl.cdiv(nbytes, ops), 16) * 16
            size = tl.minimum(tl.maximum(nbytes - lanes * chunk, 0), chunk).to(tl.int32)
            tl.inline_asm_elementwise(
                "{ .reg .pred p; .reg .b64 a; .reg .b32 s; and.b64 a, $1, -16; and.b32 s, $2, -16; "
                "setp.gt.s32 p, s, 0; @p cp.async.bulk.prefetch.L2.global [a], s; mov.u32 $0, 0; }",
                "=r,l,r",
                [base + lanes * chunk, size],
                dtype=tl.int32,
                is_pure=False,
                pack=1,
            )
        else:
            for start in range(0, nbytes, PF_LANES * 128):
                offs = start + lanes * 128
                tl.inline_asm_elementwise(
                    "{ .reg .pred p; setp.ne.b32 p, $2, 0; @p prefetch.global.L2 [$1]; mov.u32 $0, 0; }",
                    "=r,l,r",
                    [base + offs, (offs < nbytes).to(tl.int32)],
                    dtype=tl.int32,
                    is_pure=False,
                    pack=1,
                )
