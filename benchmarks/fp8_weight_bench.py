"""Float8 weights (``kernels/triton_fp8_linear.py``, the MoE's float8 paths) against 16-bit ones and the
copy rate, at the benchmark models' decode shapes.

    PYTHONPATH=. python3 benchmarks/fp8_weight_bench.py [--sweep]

Each case is a CUDA graph of calls over rotated weights (so that L2 holds none, as ``kernel_bench.py``):
the bf16 GEMV, the float8 GEMV with 128 x 128 scale blocks and with a scale per row; the input norm and
the projection (bf16: fused into the GEMV; float8: the norm kernel, then the GEMV); 2, 4, 8 and 16 rows
on the skinny kernel (tensor cores); and the small MoE path at one and eight tokens (Qwen3-30B-A3B's
experts). "bytes" is the weight (plus scales) read once; "% copy" is bytes / time against the
device-to-device copy rate. ``--sweep`` times float8 GEMV tiles (one row) and the skinny kernel's (4 and
16 rows); ``--sweep-wide`` the skinny kernel's wide tiles at 64-256 rows. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton  # noqa: E402

from benchmarks.common import copy_gbps  # noqa: E402
from benchmarks.kernel_bench import rotations, time_graph  # noqa: E402
from kernels import triton_fp8_linear, triton_linear  # noqa: E402
from kernels.fp8_weight import Fp8Weight  # noqa: E402
from kernels.triton_fp8_linear import Fp8GemvConfig  # noqa: E402
from kernels.triton_linear import LinearConfig, skinny_linear_triton  # noqa: E402
from kernels.triton_ops import TRITON_OPS  # noqa: E402

BF16 = torch.bfloat16
# (name, N, K): Qwen3-30B-A3B QKV and o-proj; Llama-3.1-8B QKV, o-proj, gate-up, down.
SHAPES = [
    ("qwen3-moe qkv", 5120, 2048),
    ("qwen3-moe o", 2048, 4096),
    ("llama qkv", 6144, 4096),
    ("llama o", 4096, 4096),
    ("llama gate-up", 28672, 4096),
    ("llama down", 4096, 14336),
]


def fp8_weight(shape: tuple[int, ...], block: tuple[int, int]) -> Fp8Weight:
    w = Fp8Weight(shape, block, BF16, "cuda")
    w.quantize_(torch.randn(*shape, device="cuda") * shape[-1] ** -0.5)
    return w


def timed(make: Callable[[], tuple], fn: Callable, nbytes: float) -> float:
    sets = [make() for _ in range(rotations(nbytes))]
    us, _ = time_graph([(lambda s=s: fn(*s)) for s in sets])
    return us


def row(name: str, what: str, us: float, nbytes: float, copy_bw: float, ref_us: float | None = None) -> None:
    gbs = nbytes / us / 1e3
    vs = f"{ref_us / us:.2f}x" if ref_us else ""
    print(
        f"| {name} | {what} | {us:.1f} | {nbytes / 1e6:.1f} | {gbs:.0f} | {100 * gbs * 1e9 / copy_bw:.0f}% | {vs} |"
    )


def linear_cases(copy_bw: float) -> None:
    print("| shape | kernel | us | MB | GB/s | % copy | vs bf16 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for name, n, k in SHAPES:
        bf = n * k * 2
        x = torch.randn(1, k, device="cuda", dtype=BF16)
        bf16_us = timed(
            lambda n=n, k=k: (torch.randn(n, k, device="cuda", dtype=BF16),),
            lambda w, x=x: TRITON_OPS.linear(x, w),
            bf,
        )
        row(name, "bf16 GEMV", bf16_us, bf, copy_bw)
        for label, block in (("fp8 GEMV, 128x128 blocks", (128, 128)), ("fp8 GEMV, row scales", (1, k))):
            w0 = fp8_weight((n, k), block)
            nbytes = w0.nbytes()
            us = timed(
                lambda n=n, k=k, block=block: (fp8_weight((n, k), block),),
                lambda w, x=x: TRITON_OPS.linear(x, w),
                nbytes,
            )
            row(name, label, us, nbytes, copy_bw, bf16_us)
        g = torch.ones(k, device="cuda", dtype=BF16)
        res = torch.randn(1, k, device="cuda", dtype=BF16)
        nbytes = w0.nbytes()
        b16_norm = timed(
            lambda n=n, k=k: (torch.randn(n, k, device="cuda", dtype=BF16),),
            lambda w, x=x, res=res, g=g: TRITON_OPS.add_rms_norm_linear(x, res, g, 1e-6, w, False),
            bf,
        )
        row(name, "bf16 norm + GEMV (fused)", b16_norm, bf, copy_bw)
        us = timed(
            lambda n=n, k=k: (fp8_weight((n, k), (128, 128)),),
            lambda w, x=x, res=res, g=g: TRITON_OPS.add_rms_norm_linear(x, res, g, 1e-6, w, False),
            nbytes,
        )
        row(name, "fp8 norm kernel + GEMV", us, nbytes, copy_bw, b16_norm)
        for m in (2, 4, 8, 16):
            xm = torch.randn(m, k, device="cuda", dtype=BF16)
            b16 = timed(
                lambda n=n, k=k: (torch.randn(n, k, device="cuda", dtype=BF16),),
                lambda w, xm=xm: TRITON_OPS.linear(xm, w),
                bf,
            )
            row(name, f"{m} rows: bf16 (skinny)", b16, bf, copy_bw)
            us = timed(
                lambda n=n, k=k: (fp8_weight((n, k), (128, 128)),),
                lambda w, xm=xm: TRITON_OPS.linear(xm, w),
                nbytes,
            )
            row(name, f"{m} rows: fp8 skinny", us, nbytes, copy_bw, b16)


def moe_cases(copy_bw: float) -> None:
    """The MoE at Qwen3-30B-A3B's shape (128 experts, top-8, H 2048, I 768) at 1 and 8 tokens."""
    e, h, inter, top_k = 128, 2048, 768, 8
    for tokens in (1, 8):
        x = torch.randn(tokens, h, device="cuda", dtype=BF16)
        ids = torch.stack([torch.randperm(e, device="cuda")[:top_k] for _ in range(tokens)]).to(torch.int32)
        weights = torch.softmax(torch.randn(tokens, top_k, device="cuda"), -1).to(BF16)
        unique = len(set(ids.flatten().tolist()))
        bf = unique * 3 * h * inter * 2

        def bf16_set() -> tuple:
            return (torch.randn(e, 2 * inter, h, device="cuda", dtype=BF16) * h**-0.5,
                    torch.randn(e, h, inter, device="cuda", dtype=BF16) * inter**-0.5)  # fmt: skip

        def fp8_set() -> tuple:
            return fp8_weight((e, 2 * inter, h), (128, 128)), fp8_weight((e, h, inter), (128, 128))

        def run(w13: object, w2: object, x: torch.Tensor = x, weights: torch.Tensor = weights,
                ids: torch.Tensor = ids) -> object:  # fmt: skip
            return TRITON_OPS.fused_moe(x, w13, w2, weights, ids)

        b16 = timed(bf16_set, run, bf)
        row(f"moe {tokens} token(s)", "bf16", b16, bf, copy_bw)
        us = timed(fp8_set, run, bf / 2)
        row(f"moe {tokens} token(s)", "fp8, 128x128 blocks", us, bf / 2, copy_bw, b16)


def sweep(copy_bw: float) -> None:
    """Float8 GEMV tiles (rows a program, warps; 8 pieces a step) at one row; the skinny kernel's tiles
    (weight rows a program, K parts, stages) at 4 and 16 rows."""
    base = triton_fp8_linear.fp8_gemv_config
    grid = [Fp8GemvConfig(bn, 8, w) for bn in (1, 2, 4, 8, 16) for w in (1, 2, 4)]
    shapes = (SHAPES[0], SHAPES[2], SHAPES[4], SHAPES[5])
    for name, n, k in shapes:
        results = []
        x = torch.randn(1, k, device="cuda", dtype=BF16)
        for cfg in grid:
            triton_fp8_linear.fp8_gemv_config = lambda *_a, cfg=cfg: cfg
            try:
                us = timed(lambda n=n, k=k: (fp8_weight((n, k), (128, 128)),),
                           lambda w, x=x: TRITON_OPS.linear(x, w), n * k)  # fmt: skip
            except Exception as exc:  # a tile that does not compile
                print(f"  {name} {cfg}: {type(exc).__name__}")
                continue
            results.append((us, cfg))
        triton_fp8_linear.fp8_gemv_config = base
        results.sort(key=lambda r: r[0])
        best = ", ".join(f"{us:.1f} us {c.block_n}/{c.pieces}/{c.num_warps}" for us, c in results[:4])
        print(f"GEMV {name} ({n} x {k}): {best}", flush=True)
    tiles = [LinearConfig(bn, 128, 4, st, sp) for bn in (32, 64, 128) for sp in (1, 2, 4) for st in (3, 5)]
    for name, n, k in shapes:
        default = triton_linear.skinny_config(n, k, torch.device("cuda"), fp8=True)
        for m in (4, 16):
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            results = []
            for cfg in [*tiles, LinearConfig(128, 128, 8, 4, 1)]:
                try:
                    us = timed(lambda n=n, k=k: (fp8_weight((n, k), (128, 128)),),
                               lambda w, x=x, cfg=cfg: skinny_linear_triton(x, w, cfg), n * k)  # fmt: skip
                except Exception as exc:  # a tile that does not compile or fit
                    print(f"  {name} {cfg}: {type(exc).__name__}")
                    continue
                results.append((us, cfg))
            results.sort(key=lambda r: r[0])
            best = ", ".join(
                f"{us:.1f} us {c.block_n}x{c.block_k}/{c.num_warps}w/{c.num_stages}s/split {c.split_k}"
                for us, c in results[:4]
            )
            print(
                f"skinny {name} ({n} x {k}), {m} rows (default split {default.split_k}): {best}", flush=True
            )


def sweep_wide(copy_bw: float) -> None:
    """64 to 256 rows: bf16 (cuBLAS), float8 widened then cuBLAS, and the skinny kernel's wide tiles (x rows
    a tile, weight rows, K parts, warps); the default tile (``fp8_wide_config``) marked."""
    tiles = [
        LinearConfig(bn, 128, 8 if bm == 128 else 4, 3, sp, bm)
        for bm in (32, 64, 128)
        for bn in (64, 128)
        for sp in (1, 2, 4)
    ]
    for name, n, k in (SHAPES[0], SHAPES[2], SHAPES[4], SHAPES[5]):
        default = triton_fp8_linear.fp8_wide_config(n, k, torch.device("cuda"))
        if default not in tiles:
            tiles.append(default)
        for m in (64, 128, 256):
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            b16 = timed(lambda n=n, k=k: (torch.randn(n, k, device="cuda", dtype=BF16),),
                        lambda w, x=x: TRITON_OPS.linear(x, w), n * k * 2)  # fmt: skip
            make = lambda n=n, k=k: (fp8_weight((n, k), (128, 128)),)  # noqa: E731
            deq = timed(make, lambda w, x=x: x @ triton_fp8_linear.dequantize_triton(w).t(), n * k)
            results = []
            for cfg in tiles:
                try:
                    us = timed(make, lambda w, x=x, cfg=cfg: skinny_linear_triton(x, w, cfg), n * k)
                except Exception as exc:  # a tile that does not compile or fit
                    print(f"  {name} {cfg}: {type(exc).__name__}")
                    continue
                results.append((us, cfg))
            results.sort(key=lambda r: r[0])
            mine = next((us for us, c in results if c == default), float("nan"))
            best = ", ".join(
                f"{us:.1f} us {c.block_m}x{c.block_n}/{c.num_warps}w/split {c.split_k}"
                for us, c in results[:4]
            )
            print(f"wide {name} ({n} x {k}), {m} rows: bf16 {b16:.1f}, fp8 dequant + cuBLAS {deq:.1f}, "
                  f"default tile {mine:.1f}; best {best}", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sweep", action="store_true", help="also: float8 GEMV and skinny tiles per shape")
    parser.add_argument("--sweep-wide", action="store_true", help="only: the skinny kernel at 64-256 rows")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("fp8_weight_bench.py needs a CUDA GPU")
    torch.manual_seed(0)
    props = torch.cuda.get_device_properties(0)
    copy_bw = copy_gbps() * 1e9
    print(f"# {props.name}; torch {torch.__version__}, triton {triton.__version__}")
    print(f"# device-to-device copy: {copy_bw / 1e9:.0f} GB/s (read + write)\n")
    if args.sweep_wide:
        sweep_wide(copy_bw)
        return
    linear_cases(copy_bw)
    moe_cases(copy_bw)
    if args.sweep:
        sweep(copy_bw)


if __name__ == "__main__":
    main()
