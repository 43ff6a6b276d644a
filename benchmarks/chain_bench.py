"""What a batch-1 decode layer pays besides its bytes: kernel boundaries, GEMV ramps, idle HBM windows.

    PYTHONPATH=. python3 benchmarks/chain_bench.py

Every case is a CUDA graph of back-to-back kernels launched with programmatic dependent launch (PDL), as
the engine's decode step runs them, over 8 rotating weight sets (so no case reads its weights from the
60 MB L2 by accident); times are microseconds per repetition (median of 30 replays).

1. Boundary: a chain of 64 one-program kernels (load 1 KB, add, store), each waiting for the previous
   one with ``griddepcontrol.wait`` (PDL) or by polling an arrival counter the previous kernel's
   programs release (fine-grained dependencies, as persistent megakernels use).
2. GEMV: a one-program kernel, then the engine's batch-1 GEMV (``kernels/triton_linear.py``) at the
   Qwen3-30B-A3B and Llama-3.1-8B shapes, with weights from HBM (rotated) and from L2 (the same weights
   every time); the first kernel's time is subtracted.
3. Prefetch: an idle window (one program spinning for a set time, like a layer's small kernels) then the
   o-projection GEMV, with and without extra programs in the window's kernel that prefetch the GEMV's
   weights into L2 (``cp.async.bulk.prefetch.L2``); and a prefetch of the next QKV weights before the MoE
   experts (75 MB) stream through, to see whether they survive in L2.

Needs a CUDA GPU of compute capability 9.0 (the bulk prefetch instruction).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from benchmarks.kernel_bench import time_graph as graph_us  # noqa: E402
from kernels import triton_moe  # noqa: E402
from kernels.triton_linear import _gemv_kernel, linear_config  # noqa: E402

DEV = torch.device("cuda")
BF16 = torch.bfloat16
SETS = 8


@triton.jit
def _tiny_kernel(a_ptr, b_ptr, counters_ptr, idx, target, POLL: tl.constexpr):
    """b = a + 1 over 256 floats; waits for the previous kernel by PDL or by polling its counter."""
    if POLL:
        if idx > 0:
            seen = tl.atomic_add(counters_ptr + idx - 1, 0, sem="acquire", scope="gpu")
            while seen < target:
                seen = tl.atomic_add(counters_ptr + idx - 1, 0, sem="acquire", scope="gpu")
    else:
        tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    offs = tl.arange(0, 256)
    tl.store(b_ptr + offs, tl.load(a_ptr + offs) + 1.0)
    if POLL:
        tl.debug_barrier()  # every thread's store before the release
        tl.atomic_add(counters_ptr + idx, 1, sem="release", scope="gpu")


@triton.jit
def _spin_prefetch_kernel(sink_ptr, pf_ptr, pf_bytes, ns, CHUNK: tl.constexpr, LANES: tl.constexpr):
    """Program 0 spins for ``ns`` nanoseconds; programs 1.. each prefetch LANES x CHUNK bytes of pf."""
    tl.extra.cuda.gdc_wait()
    tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    if pid == 0:
        t0 = tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )
        t = t0
        while t - t0 < ns:
            t = tl.inline_asm_elementwise(
                "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
            )
        tl.store(sink_ptr, t - t0)
    else:
        offs = (pid - 1).to(tl.int64) * CHUNK * LANES + tl.arange(0, LANES).to(tl.int64) * CHUNK
        size = tl.maximum(tl.minimum(pf_bytes - offs, CHUNK), 0).to(tl.int32)
        ptrs = pf_ptr.to(tl.pointer_type(tl.int8)) + tl.where(size > 0, offs, 0)
        done = tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0;\n@p cp.async.bulk.prefetch.L2.global [$1], $2; }\nmov.u32 $0, 0;",
            "=r,l,r", [ptrs, size], dtype=tl.int32, is_pure=False, pack=1,
        )  # fmt: skip
        tl.store(sink_ptr + 1 + tl.arange(0, LANES), done, mask=done != 0)  # never: keeps the asm


def time_graph(fn: Callable[[], object], per: int) -> float:
    """Median microseconds per ``per`` of a CUDA graph of ``fn`` (30 replays)."""
    return graph_us([fn], replays=30)[0] / per


class Chain:
    """Launches kernels in one chain; with ``poll`` each waits on the previous one's arrival counter."""

    def __init__(self, poll: bool) -> None:
        self.poll = poll
        self.counters = torch.zeros(256, device=DEV, dtype=torch.int32)
        self.bufs = [torch.randn(256, device=DEV) for _ in range(2)]
        self.idx = 0

    def start(self) -> None:
        self.counters.zero_()
        self.idx = 0

    def tiny(self) -> None:
        a, b = self.bufs[self.idx % 2], self.bufs[(self.idx + 1) % 2]
        _tiny_kernel[(1,)](a, b, self.counters, self.idx, 1, POLL=self.poll, launch_pdl=True, num_warps=4)
        self.idx += 1


def gemv(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
    n, k = w.shape
    cfg = linear_config(n, k, DEV)
    _gemv_kernel[(triton.cdiv(n, cfg.block_n),)](
        x, w, out, n, k, w.stride(0), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, USE_PDL=True,
        launch_pdl=True, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip


def spin(sink: torch.Tensor, us: float, prefetch: torch.Tensor | None = None) -> None:
    chunk, lanes = 1024, 64
    nbytes = 0 if prefetch is None else prefetch.numel() * prefetch.element_size()
    grid = 1 + triton.cdiv(nbytes, chunk * lanes)
    _spin_prefetch_kernel[(grid,)](
        sink, sink if prefetch is None else prefetch, nbytes, int(us * 1000), CHUNK=chunk, LANES=lanes,
        launch_pdl=True, num_warps=4,
    )  # fmt: skip


def gemv_rows(chain: Chain, tiny_alone: float, n: int, k: int) -> list[tuple[str, float, str]]:
    """The GEMV after a one-program kernel, weights from HBM (rotated) and from L2 (the same each time)."""
    mb = n * k * 2 / 1e6
    sets = SETS if mb < 64 else 3
    ws = [torch.randn(n, k, device=DEV, dtype=BF16) for _ in range(sets)]
    x, out = torch.randn(1, k, device=DEV, dtype=BF16), torch.empty(1, n, device=DEV, dtype=BF16)
    rows = []
    for where, rotate in (("HBM", True), ("L2", False)):
        if not rotate and mb > 40:
            continue
        t = time_graph(
            lambda rotate=rotate: [(chain.tiny(), gemv(x, ws[i if rotate else 0], out)) for i in range(sets)],
            per=sets,
        )
        t -= tiny_alone
        rows.append((f"GEMV {n}x{k} ({mb:.1f} MB) from {where}", t, f"{mb / t:.2f} TB/s"))
    return rows


def prefetch_rows(sink: torch.Tensor) -> list[tuple[str, float, str]]:
    """An idle window then the o-projection GEMV, the window's kernel prefetching its weights or not."""
    oproj = [torch.randn(2048, 4096, device=DEV, dtype=BF16) for _ in range(SETS)]
    x, out = torch.randn(1, 4096, device=DEV, dtype=BF16), torch.empty(1, 2048, device=DEV, dtype=BF16)
    rows = []
    for us in (3, 8):
        for pf in (False, True):
            t = time_graph(
                lambda us=us, pf=pf: [
                    (spin(sink, us, oproj[i] if pf else None), gemv(x, oproj[i], out)) for i in range(SETS)
                ],
                per=SETS,
            )
            state = "prefetched" if pf else "cold"
            rows.append((f"prefetch: spin {us} us then o-proj GEMV (16.8 MB), {state}", t, ""))
    return rows


def main() -> None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        sys.exit("chain_bench.py needs a CUDA GPU of compute capability 9.0 or later")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    print(
        f"# {props.name}, L2 {props.L2_cache_size / 2**20:.0f} MiB; torch {torch.__version__}, triton {triton.__version__}"
    )
    rows: list[tuple[str, float, str]] = []

    for poll in (False, True):
        chain = Chain(poll)

        def tiny_chain(chain: Chain = chain) -> None:
            chain.start()
            for _ in range(64):
                chain.tiny()

        rows.append(
            (f"boundary: 64 one-program kernels, {'counter polling' if poll else 'PDL wait'}",
             time_graph(tiny_chain, per=64), "us per kernel")
        )  # fmt: skip

    chain = Chain(False)
    tiny_alone = time_graph(lambda: [chain.tiny() for _ in range(SETS)], per=SETS)
    for n, k in ((5120, 2048), (2048, 4096), (4096, 4096), (28672, 4096)):
        rows += gemv_rows(chain, tiny_alone, n, k)
    sink = torch.zeros(1024, device=DEV, dtype=torch.int64)
    rows += prefetch_rows(sink)

    hidden, inter, experts, top_k = 2048, 768, 128, 8
    qkv = [torch.randn(5120, hidden, device=DEV, dtype=BF16) for _ in range(SETS)]
    w13 = [torch.randn(experts, 2 * inter, hidden, device=DEV, dtype=BF16) for _ in range(SETS)]
    w2 = [torch.randn(experts, hidden, inter, device=DEV, dtype=BF16) for _ in range(SETS)]
    x, out_q = torch.randn(1, hidden, device=DEV, dtype=BF16), torch.empty(1, 5120, device=DEV, dtype=BF16)
    ids = torch.randperm(experts, device=DEV)[:top_k].view(1, top_k)
    weights = torch.softmax(torch.randn(1, top_k, device=DEV), -1).to(BF16)
    cfg = triton_moe.moe_small_config(DEV)

    def layer(i: int, pf: bool) -> None:
        spin(sink, 6, qkv[i] if pf else None)
        triton_moe._fused_moe_small(x, w13[i], w2[i], weights, ids, cfg)
        spin(sink, 2)
        gemv(x, qkv[i], out_q)

    for pf in (False, True):
        t = time_graph(lambda pf=pf: [layer(i, pf) for i in range(SETS)], per=SETS)
        rows.append(
            (
                f"prefetch: QKV weights, then 75 MB of experts, then the QKV GEMV, {'prefetched' if pf else 'cold'}",
                t,
                "",
            )
        )

    print("\n| case | us | note |\n|---|---:|---|")
    for name, us, note in rows:
        print(f"| {name} | {us:.2f} | {note} |")


if __name__ == "__main__":
    main()
