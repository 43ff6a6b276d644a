"""Kernel benchmark: each Triton op at real shapes against its PyTorch reference and the HBM roofline.

    PYTHONPATH=. python3 benchmarks/kernel_bench.py [--sweep] [--quick]

Measures the device-to-device copy bandwidth first (bytes read + bytes written per second), then times
each case: the Triton op by replaying a CUDA graph of several calls (it never synchronises with the host,
so it can be captured; this is how the engine's decode step runs it), the PyTorch reference with
``triton.testing.do_bench`` (median; the references call ``.tolist()`` and cannot be captured). Inputs
rotate among several sets so that small cases are not served from the 60 MB L2. "bytes" is the least
traffic the op must make (each input read once, each output written once); GB/s = bytes / Triton time,
and "% copy" compares that with the measured copy bandwidth. ``--sweep`` also times tile-config variants
of decode attention, extend attention, the MoE GEMM and the MoE small path. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from benchmarks.common import copy_gbps  # noqa: E402
from kernels import triton_attention, triton_device, triton_linear, triton_moe  # noqa: E402
from kernels.fp8_weight import Fp8Weight  # noqa: E402
from kernels.ops import TORCH_OPS  # noqa: E402
from kernels.triton_ops import TRITON_OPS  # noqa: E402

DTYPE = torch.bfloat16
ROTATION_BYTES = 512 << 20  # rotate inputs until one graph touches at least this much memory
MAX_ROTATIONS = 32


@dataclass
class Row:
    kernel: str
    shape: str
    triton_us: float
    torch_us: float | None
    bytes_moved: float
    flops: float = 0.0
    spread: float = 0.0
    note: str = ""


def time_graph(calls: list[Callable[[], object]], replays: int = 15) -> tuple[float, float]:
    """Median microseconds per call of a CUDA graph that runs every call once; and the relative spread."""
    for call in calls:  # compile and warm up outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for call in calls:
            call()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    med = statistics.median(times)
    return med, (max(times) - min(times)) / med


def time_eager(fn: Callable[[], object]) -> float:
    return triton.testing.do_bench(fn, warmup=20, rep=150, return_mode="median") * 1e3


def rotations(bytes_per_call: float) -> int:
    return max(1, min(MAX_ROTATIONS, int(ROTATION_BYTES // max(1.0, bytes_per_call))))


# ---------------------------------------------------------------------------------------------------------
# Cases


def decode_attention_case(batch: int, context: int, reference: bool = True) -> Row:
    """Llama-3-8B layout: 32 query heads, 8 KV heads, head_dim 128, block 16; every sequence at `context`."""
    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    blocks_per_seq = triton.cdiv(context, block)
    kv_bytes = batch * context * kv_heads * head_dim * 2 * 2  # K and V, bf16
    qo_bytes = 2 * batch * heads * head_dim * 2
    rot = rotations(kv_bytes)
    pool = torch.randn(
        rot * batch * blocks_per_seq, 2, 2, block, kv_heads, head_dim, device="cuda", dtype=DTYPE
    )
    perm = torch.randperm(pool.shape[0], device="cuda").to(torch.int32)
    tables = [
        perm[i * batch * blocks_per_seq : (i + 1) * batch * blocks_per_seq].view(batch, -1)
        for i in range(rot)
    ]
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, heads, head_dim, device="cuda", dtype=DTYPE) for _ in range(rot)]
    scale = head_dim**-0.5

    def call(i: int) -> Callable[[], object]:
        return lambda: TRITON_OPS.paged_attention(
            qs[i], pool, 1, tables[i], seq_lens, qsl, scale, max_seq_len=context
        )

    t, spread = time_graph([call(i) for i in range(rot)])
    ref = (
        time_eager(lambda: TORCH_OPS.paged_attention(qs[0], pool, 1, tables[0], seq_lens, qsl, scale))
        if reference
        else None
    )
    splits = triton_attention.num_kv_splits(batch, kv_heads, context, qs[0].device)
    return Row(
        "decode attention",
        f"bs {batch}, ctx {context}",
        t,
        ref,
        kv_bytes + qo_bytes,
        spread=spread,
        note=f"{splits} splits",
    )


def extend_attention_case(num_seqs: int, q_len: int, prefix: int) -> Row:
    heads, kv_heads, head_dim, block = 32, 8, 128, 16
    ctx = prefix + q_len
    blocks_per_seq = triton.cdiv(ctx, block)
    pool = torch.randn(num_seqs * blocks_per_seq, 2, 2, block, kv_heads, head_dim, device="cuda", dtype=DTYPE)
    table = torch.randperm(pool.shape[0], device="cuda").to(torch.int32).view(num_seqs, -1)
    seq_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(num_seqs + 1, dtype=torch.int32, device="cuda") * q_len
    q = torch.randn(num_seqs * q_len, heads, head_dim, device="cuda", dtype=DTYPE)
    scale = head_dim**-0.5
    # Causal FLOPs: QK^T and PV, 2 FLOPs per multiply-add, over the keys each query sees.
    keys_seen = num_seqs * (q_len * prefix + q_len * (q_len + 1) / 2)
    flops = 4 * heads * head_dim * keys_seen
    moved = num_seqs * ctx * kv_heads * head_dim * 4 + 2 * q.numel() * 2
    t, spread = time_graph([lambda: TRITON_OPS.paged_attention(q, pool, 1, table, seq_lens, qsl, scale)])
    ref = time_eager(lambda: TORCH_OPS.paged_attention(q, pool, 1, table, seq_lens, qsl, scale))
    return Row(
        "extend attention", f"{num_seqs} x {q_len} new on {prefix} cached", t, ref, moved, flops, spread
    )


def moe_case(tokens: int, reference: bool = True, path: str = "auto") -> Row:
    """Qwen3-30B-A3B: hidden 2048, expert intermediate 768, 128 experts, top-8.

    ``path``: "auto" (what ``fused_moe_triton`` picks), or "small" / "grouped" forced, to compare the two.
    """
    hidden, inter, experts, top_k = 2048, 768, 128, 8
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=DTYPE) * hidden**-0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=DTYPE) * inter**-0.5
    expert_bytes = 3 * hidden * inter * 2
    per_call_guess = min(experts, tokens * top_k) * expert_bytes
    rot = min(8, rotations(per_call_guess))
    xs = [torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) for _ in range(rot)]
    ids = [torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices for _ in range(rot)]
    weights = [torch.rand(tokens, top_k, device="cuda").softmax(-1) for _ in range(rot)]
    touched = statistics.mean(len(torch.unique(i)) for i in ids)
    moved = touched * expert_bytes + 2 * tokens * hidden * 2 + tokens * top_k * 12

    def call(i: int) -> Callable[[], object]:
        return lambda: TRITON_OPS.fused_moe(xs[i], w13, w2, weights[i], ids[i])

    small = triton_moe.use_small_path(tokens * top_k, experts) if path == "auto" else path == "small"
    chooser = triton_moe.use_small_path
    triton_moe.use_small_path = lambda *_a: small  # the path is chosen on the host, at capture
    try:
        t, spread = time_graph([call(i) for i in range(rot)])
    finally:
        triton_moe.use_small_path = chooser
    ref = time_eager(lambda: TORCH_OPS.fused_moe(xs[0], w13, w2, weights[0], ids[0])) if reference else None
    flops = 2 * tokens * top_k * 3 * hidden * inter
    if small:
        sc = triton_moe.moe_small_config(xs[0].device)
        note = f"small, BN {sc.gate_up_block_n}/{sc.down_block_n}, BK {sc.gate_up_block_k}/{sc.down_block_k}"
    else:
        note = f"grouped, BM {triton_moe.moe_tile_config(tokens * top_k, experts, xs[0].device).block_m}"
    return Row(
        "fused MoE",
        f"{tokens} tokens" + ("" if path == "auto" else f", {path}"),
        t,
        ref,
        moved,
        flops,
        spread,
        note=f"{touched:.0f} experts, {note}",
    )


# Where the single-program alignment gives way to the multi-program one (ALIGN_KERNEL_MAX_PAIRS): decode
# batches up to long prompts, at top-8 (128 to 32768 pairs).
ALIGN_TOKENS = (16, 32, 64, 128, 512, 1024, 2048, 4096)


def moe_align_case(tokens: int) -> list[Row]:
    """The alignment step alone at top-8 of 128 experts, 64-row tiles: the single-program kernel and the
    multi-program kernels, each against the torch reference (all three replayed from CUDA graphs)."""
    experts, top_k, block_m = 128, 8, 64
    ids = torch.rand(tokens, experts, device="cuda").topk(top_k, dim=-1).indices
    pairs = tokens * top_k
    max_rows = triton_moe.align_max_rows(pairs, experts, block_m)
    ref, _ = time_graph([lambda: triton_moe._moe_align_torch(ids, block_m, experts, max_rows)])
    in_use = "single" if pairs <= triton_moe.ALIGN_KERNEL_MAX_PAIRS else "multi"
    rows = []
    for name, align in (("single", triton_moe._moe_align_triton), ("multi", triton_moe._moe_align_chunked)):
        t, spread = time_graph([lambda align=align: align(ids, block_m, experts, max_rows)])
        note = f"{name}-program" + (" (in use)" if name == in_use else "")
        rows.append(
            Row("MoE align", f"{tokens} tokens, {name}", t, ref, pairs * 12, spread=spread, note=note)
        )
    return rows


def moe_align_compare() -> None:
    """The three alignments side by side per size, to place ALIGN_KERNEL_MAX_PAIRS."""
    print(
        f"## MoE align, us (top-8 of 128 experts, block_m 64; single program up to "
        f"{triton_moe.ALIGN_KERNEL_MAX_PAIRS} pairs)"
    )
    print("| tokens | pairs | single | multi | torch | faster Triton path |")
    print("|---|---|---|---|---|---|")
    for tokens in ALIGN_TOKENS:
        single, multi = moe_align_case(tokens)
        best = "single" if single.triton_us <= multi.triton_us else "multi"
        print(
            f"| {tokens} | {tokens * 8} | {single.triton_us:.1f} | {multi.triton_us:.1f} | "
            f"{single.torch_us:.1f} | {best} |",
            flush=True,
        )


def rotated_case(
    kernel: str,
    shape: str,
    bytes_moved: float,
    make: Callable[[], tuple],
    triton_fn: Callable,
    torch_fn: Callable,
    torch_in_graph: bool = True,
) -> Row:
    """Both versions as CUDA-graph replays over rotated inputs (the reference eagerly if it syncs)."""
    rot = rotations(bytes_moved)
    sets = [make() for _ in range(rot)]
    t, spread = time_graph([(lambda s=s: triton_fn(*s)) for s in sets])
    if torch_in_graph:
        ref, _ = time_graph([(lambda s=s: torch_fn(*s)) for s in sets])
    else:
        ref = time_eager(lambda: torch_fn(*sets[0]))
    return Row(kernel, shape, t, ref, bytes_moved, spread=spread)


def rms_norm_cases(tokens: int, hidden: int = 4096) -> list[Row]:
    n = tokens * hidden * 2
    w = torch.randn(hidden, device="cuda", dtype=DTYPE)

    def make() -> tuple:
        return tuple(torch.randn(tokens, hidden, device="cuda", dtype=DTYPE) for _ in range(2))

    return [
        rotated_case(
            "RMSNorm",
            f"{tokens} x {hidden}",
            2 * n,
            make,
            lambda x, _r: TRITON_OPS.rms_norm(x, w, 1e-5),
            lambda x, _r: TORCH_OPS.rms_norm(x, w, 1e-5),
        ),
        rotated_case(
            "add + RMSNorm",
            f"{tokens} x {hidden}",
            4 * n,
            make,
            lambda x, r: TRITON_OPS.fused_add_rms_norm(x, r, w, 1e-5),
            lambda x, r: TORCH_OPS.fused_add_rms_norm(x, r, w, 1e-5),
        ),
    ]


def write_kv_case(tokens: int) -> Row:
    kv_heads, head_dim, block = 8, 128, 16
    num_blocks = max(64, 4 * triton.cdiv(tokens, block))
    pool = torch.randn(num_blocks, 2, 2, block, kv_heads, head_dim, device="cuda", dtype=DTYPE)

    def make() -> tuple:
        k = torch.randn(tokens, kv_heads, head_dim, device="cuda", dtype=DTYPE)
        slots = torch.randperm(num_blocks * block, device="cuda")[:tokens]
        return k, torch.randn_like(k), slots

    moved = 4 * tokens * kv_heads * head_dim * 2 + tokens * 8
    return rotated_case(
        "KV write",
        f"{tokens} tokens",
        moved,
        make,
        lambda k, v, s: TRITON_OPS.write_kv(pool, 1, k, v, s),
        lambda k, v, s: TORCH_OPS.write_kv(pool, 1, k, v, s),
        torch_in_graph=False,  # write_kv_torch checks for padding slots on the host
    )


def rope_case(tokens: int) -> Row:
    cache = torch.randn(8192, 128, device="cuda")

    def make() -> tuple:
        q = torch.randn(tokens, 32, 128, device="cuda", dtype=DTYPE)
        return (
            q,
            torch.randn(tokens, 8, 128, device="cuda", dtype=DTYPE),
            torch.randint(0, 8192, (tokens,), device="cuda"),
        )

    moved = 2 * tokens * 40 * 128 * 2 + tokens * 128 * 4
    return rotated_case(
        "RoPE",
        f"{tokens} tok, 32/8 heads",
        moved,
        make,
        lambda q, k, p: TRITON_OPS.apply_rope(q, k, p, cache),
        lambda q, k, p: TORCH_OPS.apply_rope(q, k, p, cache),
    )


def qkv_prologue_case(tokens: int, qk_norm: bool) -> Row:
    """The fused attention prologue; Llama-3.1-8B heads (32/8, no q/k norm) or Qwen3-30B-A3B (32/4, norm)."""
    hq, hk, d, block = 32, 4 if qk_norm else 8, 128, 16
    num_blocks = max(64, 4 * triton.cdiv(tokens, block))
    pool = torch.randn(num_blocks, 2, 2, block, hk, d, device="cuda", dtype=DTYPE)
    cache = torch.randn(8192, d, device="cuda")
    q_norm = torch.randn(d, device="cuda", dtype=DTYPE) if qk_norm else None
    k_norm = torch.randn(d, device="cuda", dtype=DTYPE) if qk_norm else None

    def make() -> tuple:
        qkv = torch.randn(tokens, (hq + 2 * hk) * d, device="cuda", dtype=DTYPE)
        slots = torch.randperm(num_blocks * block, device="cuda")[:tokens]
        return qkv, torch.randint(0, 8192, (tokens,), device="cuda"), slots

    def run(ops: Any, qkv: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
        return ops.qkv_prologue(qkv, hq, hk, d, q_norm, k_norm, 1e-6, pos, cache, pool, 1, slots)

    moved = tokens * (hq + 2 * hk) * d * 2 * 2 + tokens * d * 4
    row = rotated_case(
        "QKV prologue",
        f"{tokens} tok, {hq}/{hk} heads{', q/k norm' if qk_norm else ''}",
        moved,
        make,
        lambda *a: run(TRITON_OPS, *a),
        lambda *a: run(TORCH_OPS, *a),
        torch_in_graph=False,  # the reference's KV write checks for padding slots on the host
    )
    row.note = "one launch (norm + RoPE + KV write)"
    return row


def moe_route_case(tokens: int, experts: int = 128, top_k: int = 8) -> Row:
    l2p = torch.arange(experts, device="cuda").unsqueeze(1)
    replicas = torch.ones(experts, dtype=torch.int64, device="cuda")
    counts = torch.zeros(experts, dtype=torch.int64, device="cuda")

    def make() -> tuple:
        return (torch.randn(tokens, experts, device="cuda", dtype=DTYPE),)

    def run(ops: Any, logits: torch.Tensor) -> tuple:
        return ops.moe_route(logits, top_k, True, l2p, replicas, counts, DTYPE)

    row = rotated_case(
        "MoE routing",
        f"{tokens} tokens, {experts} experts, top-{top_k}",
        tokens * experts * 2 + tokens * top_k * 10,
        make,
        lambda x: run(TRITON_OPS, x),
        lambda x: run(TORCH_OPS, x),
    )
    row.note = "one launch (softmax, top-k, renormalise, replica, counters)"
    return row


def silu_case(tokens: int, inter: int = 14336) -> Row:
    def make() -> tuple:
        return (torch.randn(tokens, 2 * inter, device="cuda", dtype=DTYPE),)

    return rotated_case(
        "SiLU-and-mul",
        f"{tokens} x {inter}",
        3 * tokens * inter * 2,
        make,
        TRITON_OPS.silu_and_mul,
        TORCH_OPS.silu_and_mul,
    )


# (N, K) of decode projections: Qwen3-30B-A3B QKV, o-proj, router, LM head; Llama-3.1-8B QKV, o-proj,
# gate-up, down, LM head.
LINEAR_SHAPES = [
    (5120, 2048),
    (2048, 4096),
    (128, 2048),
    (151936, 2048),
    (6144, 4096),
    (4096, 4096),
    (28672, 4096),
    (4096, 14336),
    (128256, 4096),
]


def linear_case(n: int, k: int) -> Row:
    """The GEMV (what the Triton ``linear`` runs for one row) against cuBLAS ``x @ w.t()``, both in CUDA
    graphs over rotated weights (so that L2 holds none); the note gives the GEMV's tiles."""

    def make() -> tuple:
        w = torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5
        return torch.randn(1, k, device="cuda", dtype=DTYPE), w

    row = rotated_case("linear (GEMV)", f"1 x {k} -> {n}", (n * k + n + k) * 2, make, TRITON_OPS.linear,
                       TORCH_OPS.linear)  # fmt: skip
    row.flops = 2 * n * k
    cfg = triton_linear.linear_config(n, k, torch.device("cuda"))
    row.note = f"BN {cfg.block_n}, BK {cfg.block_k}, {triton.cdiv(n, cfg.block_n)} programs"
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    if rotations(row.bytes_moved) * row.bytes_moved < 2 * l2_bytes:  # the rotated copies fit in L2
        row.note += "; L2-resident (not an HBM figure)"
    return row


def skinny_compare(copy_bw: float) -> None:
    """The Triton ``linear`` at 2 to 17 rows (decode batches: the skinny kernel up to SKINNY_MAX_M rows,
    cuBLAS above) against cuBLAS ``x @ w.t()`` and the copy-rate roofline of its bytes, per projection shape
    of the two benchmark models (the LM heads left out), in CUDA graphs over rotated weights."""
    print("\n## linear at a few rows: roofline / cuBLAS / Triton linear (us per call)")
    print("| weight (N x K) | rows | roofline us | cuBLAS us | Triton us | kernel |")
    print("|---|---:|---:|---:|---:|---|")
    dev = torch.device("cuda")
    for n, k in LINEAR_SHAPES:
        if n > 100_000:
            continue
        ws = [torch.randn(n, k, device=dev, dtype=DTYPE) * k**-0.5 for _ in range(rotations(n * k * 2))]
        for m in (2, 4, 8, 16, 17):
            x = torch.randn(m, k, device=dev, dtype=DTYPE)
            err = (TRITON_OPS.linear(x, ws[0]).float() - x.float() @ ws[0].float().t()).abs().max().item()
            assert err < 0.05, (n, k, m, err)
            roof = (n * k + m * k + m * n) * 2 / copy_bw * 1e6
            cublas, _ = time_graph([lambda w=w, x=x: x @ w.t() for w in ws])
            ours, _ = time_graph([lambda w=w, x=x: TRITON_OPS.linear(x, w) for w in ws])
            if not triton_linear.use_skinny(m, n, k):
                kernel = "cuBLAS"
            elif triton_linear.use_skinny_rows(n, dev):
                kernel = "one weight row per program"
            else:
                cfg = triton_linear.skinny_config(n, k, dev)
                kernel = f"BN {cfg.block_n}, BK {cfg.block_k}, {cfg.num_warps} warps"
                kernel += f", K in {cfg.split_k} parts" if cfg.split_k > 1 else ""
            print(f"| {n} x {k} | {m} | {roof:.2f} | {cublas:.2f} | {ours:.2f} | {kernel} |", flush=True)
        del ws


def sweep_skinny() -> None:
    """Every projection shape of 1024 weight rows or more (the LM heads left out) at 2 and 16 rows against a
    grid of skinny tiles with and without split K (BLOCK_N, BLOCK_K, warps, stages, split), best first, each
    output checked against cuBLAS; in CUDA graphs over rotated weights."""
    print("\n## sweep: skinny tiles per shape (BLOCK_N/BLOCK_K/warps/stages/split K), us per call, best 5")
    base = triton_linear.skinny_config
    grid = [
        triton_linear.LinearConfig(bn, bk, w, st, sk)
        for bn, bk, w in ((16, 512, 2), (16, 256, 4), (32, 256, 4), (64, 128, 4), (64, 256, 4))
        for st in (4,)
        for sk in (1, 2, 4, 8)
    ]
    dev = torch.device("cuda")
    for n, k in LINEAR_SHAPES:
        if n > 100_000 or triton_linear.use_skinny_rows(n, dev):
            continue
        ws = [torch.randn(n, k, device=dev, dtype=DTYPE) * k**-0.5 for _ in range(rotations(n * k * 2))]
        for m in (2, 16):
            x = torch.randn(m, k, device=dev, dtype=DTYPE)
            ref = x.float() @ ws[0].float().t()
            timed = []
            for cfg in grid:
                triton_linear.skinny_config = lambda *_a, cfg=cfg: cfg
                try:
                    err = (TRITON_OPS.linear(x, ws[0]).float() - ref).abs().max().item()
                    assert err < 0.05, (n, k, m, cfg, err)
                    us, _ = time_graph([lambda w=w, x=x: TRITON_OPS.linear(x, w) for w in ws])
                    timed.append((us, cfg))
                except Exception as exc:  # a tile that does not compile (registers, shared memory)
                    print(f"  {n} x {k} {cfg}: {type(exc).__name__}: {str(exc)[:120]}")
            triton_linear.skinny_config = base
            timed.sort(key=lambda t: t[0])
            now = next((us for us, c in timed if c == base(n, k, dev)), float("nan"))
            best = ", ".join(
                f"{us:.2f} {c.block_n}/{c.block_k}/{c.num_warps}/{c.num_stages}/{c.split_k}"
                for us, c in timed[:5]
            )
            print(f"| {n} x {k} | {m} | now {now:.2f} | {best} |", flush=True)
        del ws


# ---------------------------------------------------------------------------------------------------------
# Output


def print_table(rows: list[Row], copy_bw: float) -> None:
    header = (
        f"| {'kernel':<17} | {'shape':<28} | {'triton us':>9} | {'torch us':>9} | {'speedup':>7} | "
        f"{'MB moved':>8} | {'GB/s':>6} | {'% copy':>6} | {'TFLOP/s':>7} | {'spread':>6} | note"
    )
    print(header)
    print("|" + "---|" * header.count("|"))
    for r in rows:
        gbs = r.bytes_moved / (r.triton_us * 1e-6) / 1e9
        ref = f"{r.torch_us:9.1f}" if r.torch_us is not None else f"{'-':>9}"
        speed = f"{r.torch_us / r.triton_us:6.1f}x" if r.torch_us is not None else f"{'-':>7}"
        tflops = f"{r.flops / (r.triton_us * 1e-6) / 1e12:7.1f}" if r.flops else f"{'-':>7}"
        print(
            f"| {r.kernel:<17} | {r.shape:<28} | {r.triton_us:9.1f} | {ref} | {speed} | "
            f"{r.bytes_moved / 1e6:8.1f} | {gbs:6.0f} | {100 * gbs * 1e9 / copy_bw:5.1f}% | {tflops} | "
            f"{100 * r.spread:5.1f}% | {r.note}"
        )
    sys.stdout.flush()


def sweep() -> None:
    print("\n## sweep: decode attention (DecodeConfig)")
    base_d = triton_attention.DECODE_CONFIG
    variants = [
        dataclasses.replace(base_d, block_n=bn, num_warps=w, num_stages=s)
        for bn, w, s in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 3)]
    ]
    variants += [dataclasses.replace(base_d, min_tokens_per_split=m) for m in (128, 512)]
    for cfg in variants:
        triton_attention.DECODE_CONFIG = cfg
        rows = [decode_attention_case(b, c, reference=False) for b, c in ((1, 4096), (64, 4096), (256, 512))]
        print(
            cfg,
            " | ".join(
                f"{r.shape}: {r.triton_us:.1f} us {r.bytes_moved / r.triton_us / 1e3:.0f} GB/s ({r.note})"
                for r in rows
            ),
        )
        sys.stdout.flush()
    triton_attention.DECODE_CONFIG = base_d

    print("\n## sweep: extend attention (ExtendConfig)")
    base_e = triton_attention.EXTEND_CONFIG
    for bm, bn, w, s in [(64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 2), (128, 64, 8, 3), (128, 32, 4, 2)]:
        cfg = dataclasses.replace(base_e, block_m=bm, block_n=bn, num_warps=w, num_stages=s)
        triton_attention.EXTEND_CONFIG = cfg
        r = extend_attention_case(4, 2048, 2048)
        print(cfg, f"{r.triton_us:.1f} us {r.flops / r.triton_us / 1e6:.1f} TFLOP/s")
        sys.stdout.flush()
    triton_attention.EXTEND_CONFIG = base_e

    print("\n## sweep: MoE grouped GEMM (MoeTileConfig)")
    base_m = triton_moe.moe_tile_config
    configs = [
        triton_moe.MoeTileConfig(16, 64, 128, 1, 4, 4),
        triton_moe.MoeTileConfig(16, 128, 128, 1, 4, 3),
        triton_moe.MoeTileConfig(16, 64, 256, 1, 4, 3),
        triton_moe.MoeTileConfig(32, 64, 128, 8, 4, 4),
        triton_moe.MoeTileConfig(64, 128, 64, 8, 4, 3),
        triton_moe.MoeTileConfig(64, 128, 64, 8, 8, 4),
        triton_moe.MoeTileConfig(128, 128, 64, 8, 8, 3),
    ]
    for cfg in configs:
        triton_moe.moe_tile_config = lambda *_a, cfg=cfg: cfg
        rows = [moe_case(t, reference=False, path="grouped") for t in (1, 64, 256)]
        print(
            cfg,
            " | ".join(
                f"{r.shape}: {r.triton_us:.1f} us {r.bytes_moved / r.triton_us / 1e3:.0f} GB/s" for r in rows
            ),
        )
        sys.stdout.flush()
    triton_moe.moe_tile_config = base_m

    print(
        "\n## sweep: MoE small path at 1-8 tokens (MoeSmallConfig: gate-up BN, BK, warps; down BN, BK, warps)"
    )
    base_s = triton_moe.moe_small_config
    small_configs = [
        triton_moe.MoeSmallConfig(16, 256, 4, 8, 256, 4),
        triton_moe.MoeSmallConfig(16, 128, 4, 8, 128, 4),
        triton_moe.MoeSmallConfig(32, 256, 4, 16, 256, 4),
        triton_moe.MoeSmallConfig(16, 512, 8, 8, 512, 8),
        triton_moe.MoeSmallConfig(8, 256, 4, 4, 256, 4),
        triton_moe.MoeSmallConfig(16, 256, 8, 16, 128, 4),
    ]
    for cfg in small_configs:
        triton_moe.moe_small_config = lambda *_a, cfg=cfg: cfg
        rows = [moe_case(t, reference=False, path="small") for t in (1, 4, 8)]
        print(
            cfg,
            " | ".join(
                f"{r.shape}: {r.triton_us:.1f} us {r.bytes_moved / r.triton_us / 1e3:.0f} GB/s" for r in rows
            ),
        )
        sys.stdout.flush()
    triton_moe.moe_small_config = base_s

    sweep_moe_small()
    sweep_linear()


def sweep_linear() -> None:
    """Every batch-1 projection shape against a grid of GEMV tile configs (best first), and cuBLAS."""
    print("\n## sweep: GEMV configs per shape (BLOCK_N, BLOCK_K, warps, stages), best 4 and cuBLAS")
    base = triton_linear.linear_config
    grid = [
        triton_linear.LinearConfig(bn, bk, w, st)
        for bn in (1, 2, 4, 8, 16)
        for bk, w in ((256, 4), (512, 4), (1024, 4), (1024, 8), (2048, 8))
        for st in (2, 4)
        if bn * bk <= 8192
    ]
    for n, k in LINEAR_SHAPES:
        if n > 100_000:  # the LM heads: too slow to sweep, and near the copy rate already
            continue
        timed = []
        for cfg in grid:
            triton_linear.linear_config = lambda *_a, cfg=cfg: cfg
            try:
                timed.append((linear_case(n, k).triton_us, cfg))
            except Exception as exc:  # a config that does not compile (registers, shared memory)
                print(f"  {n} x {k} {cfg}: {type(exc).__name__}")
        triton_linear.linear_config = base
        timed.sort(key=lambda t: t[0])
        ref = linear_case(n, k).torch_us
        best = ", ".join(
            f"{us:.1f} us {c.block_n}/{c.block_k}/{c.num_warps}/{c.num_stages}" for us, c in timed[:4]
        )
        print(f"{n} x {k} ({n * k * 2 / 1e6:.0f} MB): cuBLAS {ref:.1f} us; GEMV {best}", flush=True)


def sweep_moe_small(narrow: bool = False, tokens: tuple[int, ...] = (1,)) -> None:
    """The small MoE path: gate-up tiles with the down kernel fixed, then down tiles, each timed as the sum
    over ``tokens`` (one tile serves every token count). Both grids add one- and two-warp programs and
    (gate-up) whole-row K tiles; ``narrow`` times only those."""
    print(
        f"\n## sweep: MoE small path at {', '.join(map(str, tokens))} tokens, us summed over them "
        "(gate-up, then down: BLOCK_N/BLOCK_K/warps/stages)"
    )
    base = triton_moe.moe_small_config
    current = base(torch.device("cuda"))

    def timed(cfg: triton_moe.MoeSmallConfig) -> float:
        triton_moe.moe_small_config = lambda *_a: cfg
        try:
            return sum(moe_case(t, reference=False, path="small").triton_us for t in tokens)
        except Exception as exc:  # a config that does not compile
            print(f"  {cfg}: {type(exc).__name__}")
            return float("inf")
        finally:
            triton_moe.moe_small_config = base

    print(f"current {current}: {timed(current):.1f} us")
    gate_up = [
        (timed(dataclasses.replace(current, gate_up_block_n=bn, gate_up_block_k=bk, gate_up_num_warps=w,
                                   gate_up_num_stages=st)), (bn, bk, w, st))
        for bn in (1, 2, 4, 8, 16) for bk in (256, 512, 1024) for w in (4, 8) for st in (2, 4)
        if bn * bk <= 8192 and not narrow
    ] + [
        (timed(dataclasses.replace(current, gate_up_block_n=bn, gate_up_block_k=bk, gate_up_num_warps=w,
                                   gate_up_num_stages=2)), (bn, bk, w, 2))
        for bn in (1, 2) for bk in (512, 1024, 2048) for w in (1, 2, 4)
    ]  # fmt: skip
    gate_up.sort()
    print("gate-up best:", ", ".join(f"{us:.1f} us {c}" for us, c in gate_up[:5]), flush=True)
    down = [
        (timed(dataclasses.replace(current, down_block_n=bn, down_block_k=bk, down_num_warps=w,
                                   down_num_stages=st)), (bn, bk, w, st))
        for bn in (1, 2, 4, 8) for bk in (128, 256, 512) for w in (2, 4, 8) for st in (2, 4)
        if not narrow
    ] + [
        (timed(dataclasses.replace(current, down_block_n=1, down_block_k=bk, down_num_warps=w,
                                   down_num_stages=st)), (1, bk, w, st))
        for bk in (128, 256, 512) for w in (1, 2) for st in (2, 4)
    ]  # fmt: skip
    down.sort()
    print("down best:", ", ".join(f"{us:.1f} us {c}" for us, c in down[:5]), flush=True)


def sweep_moe_small_fp8() -> None:
    """The small MoE path over float8 weights (Qwen3-30B-A3B-FP8's layout: e4m3, 128 x 128 scale blocks) at
    one token: the word kernels' gate-up tiles with the down tile fixed, then down tiles (float8 K steps;
    BLOCK_N/BLOCK_K/warps/stages); and for comparison the bf16 pair and the grouped GEMM (the path of
    float8 weights the word kernels cannot read). One weight set, routing rotated as in ``moe_case``."""
    print("\n## sweep: MoE small path over float8 weights, 1 token (us; BLOCK_N/BLOCK_K/warps/stages)")
    hidden, inter, experts, top_k = 2048, 768, 128, 8

    def fp8(n: int, k: int) -> Fp8Weight:
        w = Fp8Weight((experts, n, k), (128, 128), DTYPE, "cuda")
        w.weight.copy_((torch.randn(experts, n, k, device="cuda", dtype=DTYPE) * 64).to(w.weight.dtype))
        w.weight_scale.copy_(torch.rand_like(w.weight_scale) * k**-0.5 / 64)
        return w

    w13, w2 = fp8(2 * inter, hidden), fp8(hidden, inter)
    rot = min(8, rotations(top_k * 3 * hidden * inter))
    xs = [torch.randn(1, hidden, device="cuda", dtype=DTYPE) for _ in range(rot)]
    ids = [torch.rand(1, experts, device="cuda").topk(top_k, dim=-1).indices for _ in range(rot)]
    weights = [torch.rand(1, top_k, device="cuda").softmax(-1) for _ in range(rot)]
    base, words, chooser = triton_moe.moe_small_fp8_config, triton_moe._fp8_words, triton_moe.use_small_path
    current = base(torch.device("cuda"))

    def timed(cfg: triton_moe.MoeSmallConfig, grouped: bool = False) -> float:
        triton_moe.moe_small_fp8_config = lambda *_a: cfg
        triton_moe.use_small_path = lambda *_a: True
        if grouped:
            triton_moe._fp8_words = lambda _w: None
        try:
            calls = [lambda i=i: TRITON_OPS.fused_moe(xs[i], w13, w2, weights[i], ids[i]) for i in range(rot)]
            return time_graph(calls)[0]
        except Exception as exc:  # a config that does not compile
            print(f"  {cfg}: {type(exc).__name__}")
            return float("inf")
        finally:
            triton_moe.moe_small_fp8_config, triton_moe._fp8_words = base, words
            triton_moe.use_small_path = chooser

    bf16 = moe_case(1, reference=False, path="small").triton_us
    grouped = timed(current, grouped=True)
    print(f"bf16 pair {bf16:.1f} us; float8 on the grouped GEMM {grouped:.1f} us")
    print(f"float8 words, current {current}: {timed(current):.1f} us", flush=True)
    gate_up = [
        (timed(dataclasses.replace(current, gate_up_block_n=bn, gate_up_block_k=bk, gate_up_num_warps=w,
                                   gate_up_num_stages=st)), (bn, bk, w, st))
        for bn, bk, w, st in ((1, 512, 1, 2), (1, 1024, 1, 2), (1, 1024, 1, 3), (1, 1024, 2, 2), (2, 512, 1, 2),
                              (2, 1024, 1, 2), (1, 2048, 1, 2), (1, 2048, 2, 2), (4, 512, 2, 2))
    ]  # fmt: skip
    gate_up.sort()
    print("gate-up best:", ", ".join(f"{us:.1f} us {c}" for us, c in gate_up[:4]), flush=True)
    down = [
        (timed(dataclasses.replace(current, down_block_n=bn, down_block_k=bk, down_num_warps=w,
                                   down_num_stages=st)), (bn, bk, w, st))
        for bn, bk, w, st in ((1, 128, 4, 4), (1, 256, 4, 4), (1, 256, 4, 2), (1, 256, 2, 4), (1, 256, 8, 4),
                              (1, 512, 4, 4), (1, 512, 8, 4), (2, 256, 4, 4), (2, 128, 2, 4))
    ]  # fmt: skip
    down.sort()
    print("down best:", ", ".join(f"{us:.1f} us {c}" for us, c in down[:4]), flush=True)


def sweep_moe_prefill() -> None:
    """The grouped MoE path at prefill sizes (512 and 2048 tokens: 32 and 128 pairs per expert) against a
    grid of tile configs (BLOCK_M, BLOCK_N, BLOCK_K, group, warps, stages), current config first."""
    print("\n## sweep: grouped MoE at prefill sizes (us, TFLOP/s)")
    base = triton_moe.moe_tile_config
    grid = [
        triton_moe.MoeTileConfig(*c)
        for c in (
            (32, 64, 128, 8, 4, 4), (64, 64, 128, 8, 4, 3), (64, 128, 64, 8, 4, 3), (64, 128, 64, 8, 8, 4),
            (32, 128, 128, 8, 4, 3), (64, 128, 128, 8, 8, 3), (128, 128, 64, 8, 8, 3), (64, 256, 64, 8, 8, 3),
            (16, 128, 128, 1, 4, 4), (32, 128, 64, 8, 4, 4),
        )
    ]  # fmt: skip
    for tokens in (512, 2048):
        current = base(tokens * 8, 128, torch.device("cuda"))
        print(f"{tokens} tokens, current {current}", flush=True)
        timed = []
        for cfg in [current, *[c for c in grid if c != current]]:
            triton_moe.moe_tile_config = lambda *_a, cfg=cfg: cfg
            try:
                row = moe_case(tokens, reference=False, path="grouped")
                timed.append((row.triton_us, cfg))
                print(
                    f"  {row.triton_us:8.1f} us {row.flops / row.triton_us / 1e6:6.1f} TFLOP/s  {cfg}",
                    flush=True,
                )
            except Exception as exc:  # a config that does not compile or does not fit
                print(f"  {cfg}: {type(exc).__name__}", flush=True)
            finally:
                triton_moe.moe_tile_config = base
        timed.sort(key=lambda t: t[0])
        print(f"{tokens} tokens best: " + ", ".join(f"{us:.1f} us {c}" for us, c in timed[:3]), flush=True)


NORM_LINEAR_SHAPES = [(5120, 2048), (128, 2048), (6144, 4096), (28672, 4096), (151936, 2048)]


def norm_linear_compare() -> None:
    """The fused add + RMSNorm + GEMV (``add_rms_norm_linear`` at one row) against the norm kernel then the
    GEMV, per batch-1 shape that reads a norm, in CUDA graphs over rotated weights; then a grid of the
    fused kernel's tiles (BLOCK_N, warps), best first."""
    print("\n## add + RMSNorm + GEMV at one row: fused / norm then GEMV (us per call), then fused tiles")
    base = triton_linear.norm_gemv_config
    for n, k in NORM_LINEAR_SHAPES:
        g = torch.randn(k, device="cuda", dtype=DTYPE)

        def make(n: int = n, k: int = k) -> tuple:
            w = torch.randn(n, k, device="cuda", dtype=DTYPE) * k**-0.5
            return (
                torch.randn(1, k, device="cuda", dtype=DTYPE),
                torch.randn(1, k, device="cuda", dtype=DTYPE),
                w,
            )

        def fused(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, g: torch.Tensor = g) -> object:
            return TRITON_OPS.add_rms_norm_linear(x, r, g, 1e-6, w, True)

        def split(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, g: torch.Tensor = g) -> object:
            h, _ = TRITON_OPS.fused_add_rms_norm(x, r, g, 1e-6)
            return TRITON_OPS.linear(h, w)

        row = rotated_case("add+norm+GEMV", f"1 x {k} -> {n}", (n * k + 3 * k + n) * 2, make, fused, split)
        timed = []
        if n < 100_000:
            sets = [make() for _ in range(rotations(row.bytes_moved))]
            for bn in (1, 2, 4, 8, 16):
                for w in (2, 4, 8, 16):
                    bk = triton.next_power_of_2(k)
                    if bn * bk // (32 * w) > 256:
                        continue
                    cfg = triton_linear.LinearConfig(bn, bk, w, 1)
                    triton_linear.norm_gemv_config = lambda *_a, cfg=cfg: cfg
                    try:
                        timed.append((time_graph([lambda s=s: fused(*s) for s in sets])[0], f"{bn}/{w}"))
                    except Exception as exc:  # registers, shared memory
                        print(f"  {n} x {k} {cfg}: {type(exc).__name__}")
                    triton_linear.norm_gemv_config = base
        timed.sort()
        tiles = ", ".join(f"{t:.1f} us {c}" for t, c in timed[:4])
        print(
            f"{n} x {k} ({n * k * 2 / 1e6:.1f} MB): fused {row.triton_us:.1f} us, norm then GEMV "
            f"{row.torch_us:.1f} us; fused tiles BLOCK_N/warps: {tiles}",
            flush=True,
        )


def pdl_compare() -> None:
    """The decode-path kernels with programmatic dependent launch on and off (back-to-back in a graph)."""
    print("\n## programmatic dependent launch: on / off (us per call, back-to-back calls in one graph)")
    cases = [
        ("linear 4096 x 4096", lambda: linear_case(4096, 4096)),
        ("linear 2048 x 4096", lambda: linear_case(2048, 4096)),
        ("linear 6144 x 4096", lambda: linear_case(6144, 4096)),
        ("add + RMSNorm 1 x 4096", lambda: rms_norm_cases(1)[1]),
        ("decode attention bs 1 ctx 512", lambda: decode_attention_case(1, 512, reference=False)),
        ("qkv prologue 1 token", lambda: qkv_prologue_case(1, True)),
        ("MoE route 1 token", lambda: moe_route_case(1)),
        ("fused MoE 1 token", lambda: moe_case(1, reference=False)),
    ]
    for name, case in cases:
        got = {}
        for on in (True, False):
            triton_device.PDL_ENABLED = on
            got[on] = case().triton_us
        triton_device.PDL_ENABLED = True
        print(f"{name}: {got[True]:.2f} / {got[False]:.2f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="also time tile-config variants")
    parser.add_argument("--quick", action="store_true", help="fewer cases")
    parser.add_argument("--sweep-linear", action="store_true", help="only: GEMV tile configs per shape")
    parser.add_argument("--pdl", action="store_true", help="only: decode kernels with PDL on and off")
    parser.add_argument(
        "--sweep-moe-small", action="store_true", help="only: small MoE path tiles at batch 1"
    )
    parser.add_argument(
        "--sweep-moe-small-fp8",
        action="store_true",
        help="only: small MoE path tiles over float8 weights at batch 1, with the bf16 pair",
    )
    parser.add_argument(
        "--sweep-moe-prefill", action="store_true", help="only: grouped MoE tiles at 512 and 2048 tokens"
    )
    parser.add_argument(
        "--narrow", action="store_true", help="with --sweep-moe-small: only the one- and two-warp additions"
    )
    parser.add_argument(
        "--moe-tokens",
        default="1",
        help="with --sweep-moe-small: comma-separated token counts, each tile timed as the sum over them",
    )
    parser.add_argument(
        "--moe-align", action="store_true", help="only: the three MoE alignments side by side per size"
    )
    parser.add_argument(
        "--norm-linear", action="store_true", help="only: the fused norm + GEMV against the two kernels"
    )
    parser.add_argument(
        "--skinny", action="store_true", help="only: linear at 2-17 rows against cuBLAS and the roofline"
    )
    parser.add_argument(
        "--sweep-skinny", action="store_true", help="only: skinny tiles and split K per shape"
    )
    args = parser.parse_args()
    failed = False
    if not torch.cuda.is_available():
        sys.exit("kernel_bench.py needs a CUDA GPU")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_gbps() * 1e9
    print(
        f"# {props.name}, {props.multi_processor_count} SMs; torch {torch.__version__}, triton {triton.__version__}"
    )
    print(f"# device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)\n")
    if args.moe_align:
        moe_align_compare()
        return
    if args.norm_linear:
        norm_linear_compare()
        return
    if args.skinny:
        skinny_compare(copy_bw)
        return
    if args.sweep_skinny:
        sweep_skinny()
        return
    if (
        args.sweep_linear
        or args.pdl
        or args.sweep_moe_small
        or args.sweep_moe_prefill
        or args.sweep_moe_small_fp8
    ):
        if args.sweep_moe_prefill:
            sweep_moe_prefill()
        if args.sweep_moe_small_fp8:
            sweep_moe_small_fp8()
        if args.sweep_moe_small:
            sweep_moe_small(narrow=args.narrow, tokens=tuple(int(t) for t in args.moe_tokens.split(",")))
        if args.pdl:
            pdl_compare()
        if args.sweep_linear:
            sweep_linear()
        return
    batches = (1, 16, 64, 256) if not args.quick else (1, 64)
    cases: list[Callable[[], Row | list[Row]]] = [
        *(lambda b=b, c=c: decode_attention_case(b, c) for c in (512, 4096) for b in batches),
        lambda: extend_attention_case(4, 2048, 2048),
        lambda: extend_attention_case(1, 4096, 0),
        *(lambda t=t: moe_case(t) for t in ((1, 16, 64, 256) if not args.quick else (1, 256))),
        # The small path against the grouped one at decode batches (8 tokens x top-8 = its 64-pair limit).
        *(
            lambda t=t, p=p: moe_case(t, reference=False, path=p)
            for t in ((1, 2, 4, 8) if not args.quick else (1, 8))
            for p in ("small", "grouped")
        ),
        *(lambda t=t: moe_align_case(t) for t in ALIGN_TOKENS),
        lambda: rms_norm_cases(256),
        lambda: rms_norm_cases(8192),
        lambda: write_kv_case(256),
        lambda: write_kv_case(8192),
        lambda: rope_case(8192),
        lambda: silu_case(4096),
        *(lambda t=t, n=n: qkv_prologue_case(t, n) for t in (1, 8192) for n in (False, True)),
        *(lambda t=t: moe_route_case(t) for t in (1, 64, 4096)),
        *(lambda n=n, k=k: linear_case(n, k) for n, k in LINEAR_SHAPES),
    ]
    rows: list[Row] = []
    for case in cases:
        try:
            got = case()
        except Exception as exc:  # a benchmark keeps going; the failure is printed and the run exits non-zero
            print(f"CASE FAILED: {type(exc).__name__}: {exc}", flush=True)
            failed = True
            continue
        for row in got if isinstance(got, list) else [got]:
            rows.append(row)
            print(f"{row.kernel}, {row.shape}: {row.triton_us:.1f} us (torch {row.torch_us})", flush=True)
        torch.cuda.empty_cache()
    print()
    print_table(rows, copy_bw)
    if args.sweep:
        sweep()
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
