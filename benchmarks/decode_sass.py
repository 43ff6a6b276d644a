"""The decode split kernel compiled offline for sm_90 (no GPU needed): registers, shared memory and the
instructions of its main loop per warp, over a bfloat16 pool and over a float8 pool read both ways
(cast, and as 4-byte words). This is how the float8 words path was found (docs/kernels.md, "A float8 KV
pool"): the counts say what a tile costs the SMs before any GPU time is spent.

    PYTHONPATH=. python3 benchmarks/decode_sass.py [--heads 32 --kv-heads 8 --head-dim 128]

Triton compiles with its bundled ptxas and reads the cubin with its bundled cuobjdump. The counts depend
on the Triton version: install the GPU machine's (3.6 here) into a separate directory and put it first
on PYTHONPATH to see what the H200 runs. Launches are intercepted and compiled instead of run (Triton's
launch path needs a driver); nothing is executed.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass

os.environ.pop("TRITON_INTERPRET", None)  # compile, not interpret

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, make_backend  # noqa: E402
from triton.runtime.jit import JITFunction, create_function_from_signature  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)


@dataclass
class Compiled:
    name: str
    kernel: object


def compile_instead_of_launching(compiled: list[Compiled]) -> None:
    """Patch ``JITFunction.run`` so that a launch binds its arguments as Triton would (specialisation
    included) and compiles for sm_90, recording the kernel."""

    def run(self: JITFunction, *args: object, grid: object, warmup: bool, **kwargs: object) -> object:
        backend = make_backend(TARGET)
        binder = create_function_from_signature(self.signature, self.params, backend)
        kwargs.pop("launch_pdl", None)
        bound, specialization, options = binder(*args, **kwargs)
        options, signature, constexprs, attrs = self._pack_args(
            backend, kwargs, bound, specialization, options
        )
        kernel = triton.compile(
            ASTSource(self, signature, constexprs, attrs), target=TARGET, options=options.__dict__
        )
        compiled.append(Compiled(self.fn.__name__, kernel))
        return kernel

    JITFunction.run = run  # type: ignore[method-assign]


def cuobjdump() -> str:
    from triton.backends.nvidia import compiler as nvidia

    return os.path.join(os.path.dirname(nvidia.__file__), "bin", "cuobjdump")


def loop_counts(kernel: object) -> tuple[str, int, collections.Counter[str]]:
    """Resource usage, and the longest backward-branch loop's instruction count and opcode histogram."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])  # type: ignore[attr-defined]
        f.flush()
        usage = subprocess.run([cuobjdump(), "-res-usage", f.name], capture_output=True, text=True).stdout
        sass = subprocess.run([cuobjdump(), "-sass", f.name], capture_output=True, text=True).stdout
    code = [
        (int(m.group(1), 16), m.group(2))
        for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", sass, re.M)
    ]
    index = {address: i for i, (address, _) in enumerate(code)}
    body: list[str] = []
    for i, (address, text) in enumerate(code):
        target = re.search(r"BRA\s.*?0x([0-9a-f]+)", text)
        if target and int(target.group(1), 16) < address and int(target.group(1), 16) in index:
            loop = code[index[int(target.group(1), 16)] : i + 1]
            if len(loop) > len(body):
                body = [t.split()[1] if t.startswith("@") else t.split()[0] for _, t in loop]
    resources = " ".join(re.findall(r"REG:\d+|SHARED:\d+|STACK:\d+", usage))
    return resources, len(body), collections.Counter(op.split(".")[0] for op in body)


def dot_kwidths(kernel: object) -> list[int]:
    """The operand register width (``kWidth``) Triton gave each ``tt.dot``, in program order (the decode
    loop's q.k then p.v)."""
    return [
        int(m.group(1))
        for line in kernel.asm["ttgir"].splitlines()  # type: ignore[attr-defined]
        if " tt.dot " in line and (m := re.search(r"kWidth = (\d+)", line))
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=4096)
    args = parser.parse_args()

    from kernels import triton_attention

    compiled: list[Compiled] = []
    compile_instead_of_launching(compiled)
    triton_attention.sm_count = lambda _device: 132  # an H200's, so the split count is the GPU's
    words_path, opaque = triton_attention.fp8_words, triton_attention.opaque_values
    # As on a GPU: a float8 pool's values pass through the opaque move (a CPU pool would not).
    triton_attention.opaque_values = lambda pool: pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
    rows = []
    for label, dtype, words in (
        ("bfloat16 pool", torch.bfloat16, False),
        ("float8 pool, cast", torch.float8_e4m3fn, False),
        ("float8 pool, words", torch.float8_e4m3fn, True),
        ("float8 e5m2 pool, cast", torch.float8_e5m2, False),
        ("float8 e5m2 pool, words", torch.float8_e5m2, True),
    ):
        triton_attention.fp8_words = lambda _pool, _keys, w=words: w  # a CPU pool would never take words
        b, d, hk, block = args.batch, args.head_dim, args.kv_heads, 16
        pool = torch.zeros(b * args.context // block + 1, 1, 2, block, hk, d, dtype=dtype)
        blocks = torch.arange(b * (args.context // block), dtype=torch.int32).view(b, -1)
        compiled.clear()
        triton_attention.qkv_attention_triton(
            torch.zeros(b, (args.heads + 2 * hk) * d, dtype=torch.bfloat16), args.heads, hk, d, None, None,
            1e-6, torch.full((b,), args.context - 1), torch.zeros(args.context, d), pool, 0,
            torch.arange(b), blocks, torch.full((b,), args.context, dtype=torch.int32),
            torch.arange(b + 1, dtype=torch.int32), d**-0.5,
        )  # fmt: skip
        split = next(c.kernel for c in compiled if c.name == "_decode_split_kernel")
        resources, length, ops = loop_counts(split)
        top = ", ".join(f"{op} {n}" for op, n in ops.most_common(6))
        widths = "/".join(str(w) for w in dot_kwidths(split))
        rows.append(f"| {label} | {resources} | {length} | {widths} | {top} |")
    triton_attention.fp8_words, triton_attention.opaque_values = words_path, opaque
    print(f"decode split kernel, sm_90, Triton {triton.__version__}: {args.heads} q heads, {args.kv_heads} KV "
          f"heads, head_dim {args.head_dim}, {args.batch} x {args.context}")  # fmt: skip
    print("| pool | resources | loop instructions a warp | dots' kWidth (q.k/p.v) | most frequent |")
    print("|---|---|---:|---|---|")
    print("\n".join(rows))


if __name__ == "__main__":
    sys.exit(main())
