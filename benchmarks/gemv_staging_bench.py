"""Does staging a batch-1 GEMV's weights through shared memory (TMA) beat the engine's register GEMV?

    PYTHONPATH=. python3 benchmarks/gemv_staging_bench.py            # each GEMV alone, back to back
    PYTHONPATH=. python3 benchmarks/gemv_staging_bench.py --with-norm  # each after a one-row RMSNorm

Two kernels here, neither in the engine (docs/gpu.md, "What is left"; docs/performance.md, "Nineteenth
run"), against ``kernels.triton_linear``'s GEMV (what ``linear_triton`` runs for one row):

* **Triton TMA**: the GEMV with its weight tiles read through a tensor descriptor (``TensorDescriptor``,
  ``desc.load``), which Triton's pipeliner turns into TMA copies into a shared-memory ring.
* **Gluon TMA**: the same in Gluon (``triton.experimental.gluon``, Triton 3.6), with the ring, its
  mbarriers and the copies written out, and the first ``NUM_BUF`` weight tiles requested before the PDL
  wait (``pre``), since weights never depend on the previous kernel; or after it (``post``).

Every case is a CUDA graph over rotated weights (no L2 hits), launched with programmatic dependent launch
as the engine's decode step is (``benchmarks/kernel_bench.py``'s ``time_graph``): microseconds per call,
or per (norm + GEMV) pair with ``--with-norm``, where the norm stands for the small, latency-bound kernel
that precedes a projection in a decode layer. Each tile's output is checked against fp32 torch.

Needs an NVIDIA GPU of compute capability 9.0 (TMA) and Triton 3.6's Gluon.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.kernel_bench import DTYPE, rotations, time_graph  # noqa: E402
from kernels.triton_ops import TRITON_OPS  # noqa: E402

# (N, K) of the batch-1 projections of Qwen3-30B-A3B (o-proj, QKV) and Llama-3.1-8B (o-proj, QKV, down).
SHAPES = [(2048, 4096), (5120, 2048), (4096, 4096), (6144, 4096), (4096, 14336)]
COPY_TBPS = 4.25  # for the "bytes at the copy rate" column only; the run's own copy rate is in gpu_bench


@triton.jit
def _gemv_tma_kernel(
    x_ptr, w_desc, out_ptr, N, K, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NUM_STAGES: tl.constexpr
):
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    n0 = tl.program_id(0) * BLOCK_N
    offs_k = tl.arange(0, BLOCK_K)
    lanes = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in tl.range(0, K, BLOCK_K, num_stages=NUM_STAGES):
        w = w_desc.load([n0, k0]).to(tl.float32)
        xk = tl.load(x_ptr + k0 + offs_k, mask=offs_k < K - k0, other=0.0).to(tl.float32)
        lanes += w * xk[None, :]
    offs_n = n0 + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + offs_n, tl.sum(lanes, axis=1).to(out_ptr.dtype.element_ty), mask=offs_n < N)


@functools.cache
def _gluon_kernel() -> Callable:
    """The Gluon GEMV, built on first use (Gluon is experimental and only needed here)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    @gluon.jit
    def gdc(instr: gl.constexpr):
        gl.inline_asm_elementwise(instr, "=r", [], dtype=gl.int32, is_pure=False, pack=1)

    @gluon.jit
    def kernel(x_ptr, w_desc, out_ptr, N, K, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
               NUM_BUF: gl.constexpr, PRE_WAIT: gl.constexpr):  # fmt: skip
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [gl.num_warps(), 1], [1, 0])
        n0 = gl.program_id(0) * BLOCK_N
        smem = gl.allocate_shared_memory(w_desc.dtype, [NUM_BUF, BLOCK_N, BLOCK_K], w_desc.layout)
        bars = gl.allocate_shared_memory(gl.int64, [NUM_BUF, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NUM_BUF):
            mbarrier.init(bars.index(i), count=1)
        num_k = gl.cdiv(K, BLOCK_K)
        if not PRE_WAIT:
            gdc("griddepcontrol.wait; // dummy $0")
            gdc("griddepcontrol.launch_dependents; // dummy $0")
        for i in gl.static_range(NUM_BUF):  # the ring's first tiles (before the wait where PRE_WAIT)
            mbarrier.expect(bars.index(i), w_desc.block_type.nbytes, pred=i < num_k)
            tma.async_copy_global_to_shared(
                w_desc, [n0, i * BLOCK_K], bars.index(i), smem.index(i), pred=i < num_k
            )
        if PRE_WAIT:
            gdc("griddepcontrol.wait; // dummy $0")
            gdc("griddepcontrol.launch_dependents; // dummy $0")
        offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
        acc = gl.zeros([BLOCK_N, BLOCK_K], gl.float32, layout)
        for j in range(num_k):
            buf = j % NUM_BUF
            mbarrier.wait(bars.index(buf), (j // NUM_BUF) & 1)
            w = smem.index(buf).load(layout).to(gl.float32)
            k0 = j * BLOCK_K
            xk = gl.load(x_ptr + k0 + offs_k, mask=offs_k < K - k0, other=0.0).to(gl.float32)
            acc += w * gl.expand_dims(xk, 0)
            gl.thread_barrier()  # every warp has read the buffer before it is refilled
            fence_async_shared()
            nxt = j + NUM_BUF
            mbarrier.expect(bars.index(buf), w_desc.block_type.nbytes, pred=nxt < num_k)
            tma.async_copy_global_to_shared(w_desc, [n0, nxt * BLOCK_K], bars.index(buf), smem.index(buf),
                                            pred=nxt < num_k)  # fmt: skip
        for i in gl.static_range(NUM_BUF):
            mbarrier.invalidate(bars.index(i))
        offs_n = n0 + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, layout))
        gl.store(out_ptr + offs_n, gl.sum(acc, axis=1).to(out_ptr.dtype.element_ty), mask=offs_n < N)

    return kernel


def triton_tma_call(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: tuple) -> Callable[[], None]:
    from triton.tools.tensor_descriptor import TensorDescriptor

    bn, bk, stages, warps = cfg
    desc = TensorDescriptor.from_tensor(w, [bn, bk])
    n, k = w.shape
    grid = (triton.cdiv(n, bn),)
    return lambda: _gemv_tma_kernel[grid](
        x, desc, out, n, k, BLOCK_N=bn, BLOCK_K=bk, NUM_STAGES=stages, num_warps=warps, launch_pdl=True
    )


def gluon_call(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor, cfg: tuple) -> Callable[[], None]:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    bn, bk, bufs, pre = cfg
    layout = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=16, rank=2)
    desc = TensorDescriptor.from_tensor(w, [bn, bk], layout)
    n, k = w.shape
    kernel, grid = _gluon_kernel(), (triton.cdiv(n, bn),)
    return lambda: kernel[grid](
        x, desc, out, n, k, BLOCK_N=bn, BLOCK_K=bk, NUM_BUF=bufs, PRE_WAIT=pre, num_warps=4, launch_pdl=True
    )


TRITON_TMA_CFGS = [
    (bn, bk, st, 4) for bn in (4, 8, 16, 32) for bk in (128, 256) for st in (3, 4, 6) if bn * bk <= 8192
]
GLUON_CFGS = [(bn, 256, nb, pre) for bn in (8, 16, 32) for nb in (2, 4, 6, 8) for pre in (False, True)
              if bn * 256 * 2 * nb <= 160 * 1024]  # fmt: skip


def timed(calls: list[Callable[[], object]], rows: list[torch.Tensor] | None) -> float:
    """Microseconds per call of ``calls`` in one CUDA graph; with ``rows``, per (RMSNorm of a row, call)."""
    if rows is None:
        return time_graph(calls)[0]
    gain = torch.ones(rows[0].shape[-1], device="cuda", dtype=DTYPE)
    pairs: list[Callable[[], object]] = []
    for call, row in zip(calls, rows, strict=True):
        pairs += [lambda row=row: TRITON_OPS.rms_norm(row, gain, 1e-6), call]
    return 2 * time_graph(pairs)[0]  # time_graph divides by the number of launches


def sweep(
    make: Callable, cfgs: list[tuple], sets: list[tuple], rows: list[torch.Tensor] | None
) -> list[tuple[float, tuple]]:
    """Every config of one kernel on one shape, fastest first; each output checked against fp32 torch."""
    n = sets[0][1].shape[0]
    want = [x.float() @ w.float().t() for x, w in sets]
    results = []
    for cfg in cfgs:
        outs = [torch.empty(1, n, device="cuda", dtype=DTYPE) for _ in sets]
        us = timed([make(x, w, o, cfg) for (x, w), o in zip(sets, outs, strict=True)], rows)
        err = max(float((o.float() - r).abs().max()) for o, r in zip(outs, want, strict=True))
        if err > 0.05:
            raise AssertionError(f"{tuple(sets[0][1].shape)} {cfg}: max error {err}")
        results.append((us, cfg))
    return sorted(results)


def shape_case(n: int, k: int, with_norm: bool) -> str:
    nbytes = n * k * 2
    sets = [
        (
            torch.randn(1, k, device="cuda", dtype=DTYPE),
            torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5,
        )
        for _ in range(rotations(nbytes))
    ]
    rows = [torch.randn(1, k, device="cuda", dtype=DTYPE) for _ in sets] if with_norm else None
    engine = timed([(lambda s=s: TRITON_OPS.linear(*s)) for s in sets], rows)
    tma = sweep(triton_tma_call, TRITON_TMA_CFGS, sets, rows)
    glu = sweep(gluon_call, GLUON_CFGS, sets, rows)
    post = [r for r in glu if not r[1][3]]
    pre = [r for r in glu if r[1][3]]
    return (
        f"{n} x {k} ({nbytes / 1e6:.1f} MB, {nbytes / COPY_TBPS / 1e6:.2f} us at {COPY_TBPS} TB/s): "
        f"engine {engine:.2f}; Triton TMA {tma[0][0]:.2f} {tma[0][1]}; "
        f"Gluon post-wait {post[0][0]:.2f} {post[0][1][:3]}, pre-wait {pre[0][0]:.2f} {pre[0][1][:3]}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--with-norm", action="store_true", help="each GEMV after a one-row RMSNorm kernel")
    args = parser.parse_args()
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("needs an NVIDIA GPU of compute capability 9.0 or newer")
    unit = "us per (norm + GEMV)" if args.with_norm else "us per GEMV"
    print(f"# batch-1 GEMV, weights through registers (engine) or shared memory (TMA); {unit}")
    for n, k in SHAPES:
        print(shape_case(n, k, args.with_norm), flush=True)


if __name__ == "__main__":
    main()
