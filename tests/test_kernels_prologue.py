"""The fused Triton attention prologue (q/k RMSNorm + RoPE + KV write) against ``kernels/qkv_prologue.py``.

Without a GPU, the kernel runs under the Triton interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py when CUDA is absent) at tiny shapes. With a GPU the same small tests run compiled,
and the ``gpu``-marked tests add the Llama-3.1-8B and Qwen3-30B-A3B shapes, a single-launch and no-host-sync
check and CUDA-graph capture.

The reference runs in the same dtype on the same inputs, so it has the same rounding points (norm output
rounded before RoPE, RoPE output rounded): q and the pool's k must agree within about one rounding of the
dtype (float32 tightly), v and every slot not written must be bit-identical. Every float buffer the op
allocates starts as NaN, so an unwritten element fails.
"""

from __future__ import annotations

import pytest
import torch

from engine.models.rope_cache import cos_sin_cache
from kernels.qkv_prologue import qkv_prologue_torch
from kernels.triton_ops import TRITON_OPS
from kernels.triton_prologue import qkv_prologue_triton
from tests.kernel_testing import (
    DEVICE,
    DTYPES,
    gpu,
    needs_cuda,
    poison_allocations,  # noqa: F401  (autouse fixture: NaN-filled torch.empty)
    randn,
)

# |out - ref| <= tol * (|ref| + mean|ref|). float32 differs only by rsqrt's precision and fused
# multiply-adds; in 16 bits a different rsqrt can flip the norm's or the weight product's rounding, which
# the final rounding can carry to two ulps: 2^-6 is a quarter of the bound the single-op tests use for bf16.
TOL = {torch.float32: 1e-5, torch.float16: 2.0**-9, torch.bfloat16: 2.0**-6}
# A float8 pool (kv_cache_dtype fp8): k values that differ in their last 16-bit place can round to
# neighbouring e4m3 values, one step (2^-3 relative at most) apart.
TOL[torch.float8_e4m3fn] = 2.0**-3
LAYERS, LAYER = 3, 1


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype, (
        what,
        out.shape,
        ref.shape,
        out.dtype,
        ref.dtype,
    )
    out32, ref32 = out.float(), ref.float()
    assert torch.isfinite(out32).all(), f"{what}: non-finite (unwritten?) elements"
    bound = tol * (ref32.abs() + ref32.abs().mean())
    err = (out32 - ref32).abs()
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"{what}: max error {err.max().item():.3g} is {worst:.2f}x the bound"


class Case:
    """Inputs of one prologue call: qkv as a strided row view of a wider buffer, as a projection gives it."""

    def __init__(
        self,
        tokens: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        *,
        qk_norm: bool,
        pool_dtype: torch.dtype | None = None,
        norm_dtype: torch.dtype | None = None,
        block_size: int = 4,
        max_positions: int = 4096,
        padding: int = 2,
        row_pad: int = 8,
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        width = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv = randn(tokens, width + row_pad, dtype=dtype)[:, row_pad // 2 : row_pad // 2 + width]
        norm_dtype = norm_dtype or dtype
        self.q_norm = randn(head_dim, dtype=norm_dtype) if qk_norm else None
        self.k_norm = randn(head_dim, dtype=norm_dtype) if qk_norm else None
        self.eps = 1e-6
        self.cache = cos_sin_cache(head_dim, max_positions, 1e6, None, device=DEVICE)
        # Out of order, and reaching the end of the cache.
        self.positions = torch.randperm(max_positions, device=DEVICE)[:tokens]
        if tokens:
            self.positions[0] = max_positions - 1
        self.block_size = block_size
        num_blocks = max(2, 2 * tokens // block_size + 2)
        self.pool = randn(
            num_blocks, LAYERS, 2, block_size, num_kv_heads, head_dim, dtype=pool_dtype or dtype
        )
        self.slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
        self.slots[torch.randperm(tokens, device=DEVICE)[: min(padding, tokens)]] = -1

    def args(self, pool: torch.Tensor) -> tuple:
        return (
            self.qkv,
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            self.q_norm,
            self.k_norm,
            self.eps,
            self.positions,
            self.cache,
            pool,
            LAYER,
            self.slots,
        )

    def written(self) -> torch.Tensor:
        """Bool mask over the pool: the (block, LAYER, k and v, offset) rows this call writes."""
        mask = torch.zeros(self.pool.shape[:4], dtype=torch.bool, device=DEVICE)
        valid = self.slots[self.slots >= 0]
        mask[valid // self.block_size, LAYER, :, valid % self.block_size] = True
        return mask


def check(case: Case) -> torch.Tensor:
    """Run the fused kernel and the reference on copies of the pool and compare everything."""
    before = case.pool.clone()
    ref_pool, pool = case.pool.clone(), case.pool.clone()
    q_ref = qkv_prologue_torch(*case.args(ref_pool))
    q = qkv_prologue_triton(*case.args(pool))
    act_dtype = case.qkv.dtype
    q_tol = max(
        TOL[q_ref.dtype], TOL[act_dtype], 0.0 if pool.dtype == torch.float8_e4m3fn else TOL[pool.dtype]
    )
    tol = max(q_tol, TOL[pool.dtype])
    assert q.is_contiguous()
    assert_close(q, q_ref, q_tol, "q")
    written = case.written()
    # Padding slots, other slots, other layers: bit-identical to before.
    assert torch.equal(pool[~written], before[~written])
    assert torch.equal(ref_pool[~written], before[~written])
    k_rows = written.clone()
    k_rows[:, :, 1] = False
    v_rows = written.clone()
    v_rows[:, :, 0] = False
    assert_close(pool[k_rows], ref_pool[k_rows], tol, "pool k")
    assert torch.equal(pool[v_rows], ref_pool[v_rows]), "pool v"
    return q


# ---------------------------------------------------------------------------------------------------------
# Small shapes (interpreted without a GPU)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "head_dim"), [(4, 2, 32), (12, 2, 64), (3, 3, 48), (8, 1, 16), (5, 1, 32)]
)
def test_prologue_matches_reference(
    dtype: torch.dtype, qk_norm: bool, num_heads: int, num_kv_heads: int, head_dim: int
) -> None:
    torch.manual_seed(1)
    check(Case(9, num_heads, num_kv_heads, head_dim, dtype, qk_norm=qk_norm))


@pytest.mark.parametrize(
    ("dtype", "pool_dtype", "norm_dtype"),
    [
        (torch.bfloat16, torch.float32, None),
        (torch.float32, torch.bfloat16, None),
        (torch.float16, torch.bfloat16, None),
        # float32 norm weights over bf16 activations: q (and k before the pool cast) in float32.
        (torch.bfloat16, torch.bfloat16, torch.float32),
        # A float8 pool (kv_cache_dtype fp8): k and v clamped and rounded to e4m3 as the reference does.
        (torch.bfloat16, torch.float8_e4m3fn, None),
        (torch.float32, torch.float8_e4m3fn, None),
    ],
)
def test_prologue_pool_and_norm_dtypes(
    dtype: torch.dtype, pool_dtype: torch.dtype, norm_dtype: torch.dtype | None
) -> None:
    torch.manual_seed(2)
    case = Case(7, 4, 2, 32, dtype, qk_norm=True, pool_dtype=pool_dtype, norm_dtype=norm_dtype)
    q = check(case)
    assert q.dtype == (norm_dtype or dtype)


def test_prologue_large_positions_and_padding() -> None:
    torch.manual_seed(4)
    case = Case(10, 4, 2, 32, torch.float32, qk_norm=True, max_positions=1 << 17, padding=4, block_size=16)
    case.positions = torch.randint((1 << 17) - 1000, 1 << 17, (10,), device=DEVICE)
    case.slots[0] = -1
    case.slots[-1] = -1
    check(case)


def test_prologue_all_padding_writes_nothing() -> None:
    torch.manual_seed(5)
    case = Case(5, 4, 2, 32, torch.bfloat16, qk_norm=True, padding=5)
    assert (case.slots < 0).all()
    check(case)


def test_prologue_empty_batch() -> None:
    torch.manual_seed(6)
    case = Case(0, 12, 2, 64, torch.bfloat16, qk_norm=True)
    pool = case.pool.clone()
    q = qkv_prologue_triton(*case.args(pool))
    assert q.shape == (0, 12, 64) and q.dtype == torch.bfloat16
    assert torch.equal(pool, case.pool)


def test_prologue_is_the_table_op_and_leaves_qkv_alone() -> None:
    assert TRITON_OPS.qkv_prologue is qkv_prologue_triton
    torch.manual_seed(7)
    case = Case(4, 4, 2, 32, torch.float16, qk_norm=True)
    qkv_before = case.qkv.clone()
    qkv_prologue_triton(*case.args(case.pool.clone()))
    assert torch.equal(case.qkv, qkv_before)


def test_prologue_rejects_one_norm_only() -> None:
    case = Case(2, 4, 2, 32, torch.float32, qk_norm=True)
    args = list(case.args(case.pool))
    args[5] = None
    with pytest.raises(ValueError, match="together"):
        qkv_prologue_triton(*args)


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes, one launch, no host sync, CUDA graphs

LLAMA_8B = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "qk_norm": False}
QWEN3_30B_A3B = {"num_heads": 32, "num_kv_heads": 4, "head_dim": 128, "qk_norm": True}


def real_case(tokens: int, model: dict) -> Case:
    return Case(
        tokens,
        model["num_heads"],
        model["num_kv_heads"],
        model["head_dim"],
        torch.bfloat16,
        qk_norm=model["qk_norm"],
        block_size=16,
        max_positions=1 << 17,
        padding=1,
        row_pad=0,
    )


@gpu
@needs_cuda
@pytest.mark.parametrize("model", [LLAMA_8B, QWEN3_30B_A3B], ids=["llama-3.1-8b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("tokens", [1, 64, 8192])
def test_gpu_prologue_real_shapes(model: dict, tokens: int) -> None:
    torch.manual_seed(20)
    case = real_case(tokens, model)
    if tokens == 1:
        case.slots[0] = 5  # keep the single token
    check(case)


@gpu
@needs_cuda
def test_gpu_prologue_is_one_launch_without_host_sync() -> None:
    torch.manual_seed(21)
    case = real_case(8, QWEN3_30B_A3B)
    pool = case.pool.clone()
    qkv_prologue_triton(*case.args(pool))  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        qkv_prologue_triton(*case.args(pool))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        qkv_prologue_triton(*case.args(pool))
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [name for name in kernels if "Fill" not in name]  # the test's NaN poisoning of q
    assert kernels == ["_qkv_prologue_kernel"], kernels


@gpu
@needs_cuda
@pytest.mark.parametrize("model", [LLAMA_8B, QWEN3_30B_A3B], ids=["llama-3.1-8b", "qwen3-30b-a3b"])
def test_gpu_prologue_in_cuda_graph(model: dict) -> None:
    """Capture once, then replay with new activations, positions and slots (padding included)."""
    torch.manual_seed(22)
    batch = 16
    case = real_case(batch, model)
    pool = case.pool.clone()
    qkv_prologue_triton(*case.args(pool))
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = qkv_prologue_triton(*case.args(pool))
    num_slots = case.pool.shape[0] * case.block_size
    for _ in range(3):
        case.qkv.copy_(randn(*case.qkv.shape, dtype=case.qkv.dtype))
        case.positions.copy_(torch.randint(0, 1 << 17, (batch,), device=DEVICE))
        case.slots.copy_(torch.randperm(num_slots, device=DEVICE)[:batch])
        case.slots[3] = -1
        before = pool.clone()
        graph.replay()
        torch.cuda.synchronize()
        ref_pool = before.clone()
        q_ref = qkv_prologue_torch(*case.args(ref_pool))
        assert_close(q, q_ref, TOL[torch.bfloat16], "graph q")
        written = case.written()
        assert torch.equal(pool[~written], before[~written])
        assert_close(pool[written], ref_pool[written], TOL[torch.bfloat16], "graph pool")


def test_prologue_writes_into_out() -> None:
    """Both versions write q into a given buffer (here rows of a wider static buffer, as the prefill
    graphs pass) and return it; a buffer of the wrong shape or dtype is refused."""
    torch.manual_seed(7)
    case = Case(6, 4, 2, 32, torch.bfloat16, qk_norm=True)
    want = qkv_prologue_torch(*case.args(case.pool.clone()))
    for op in (qkv_prologue_torch, qkv_prologue_triton):
        static = torch.full((9, 4, 32), float("nan"), dtype=torch.bfloat16, device=DEVICE)
        got = op(*case.args(case.pool.clone()), out=static[:6])
        assert got.data_ptr() == static.data_ptr()
        assert_close(static[:6], want, TOL[torch.bfloat16], f"{op.__name__} out")
        assert torch.isnan(static[6:].float()).all()  # nothing past the rows given
        with pytest.raises(ValueError, match="out must be"):
            op(*case.args(case.pool.clone()), out=static[:5])
        with pytest.raises(ValueError, match="out must be"):
            op(*case.args(case.pool.clone()), out=static[:6].float())
