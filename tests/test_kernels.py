"""Triton kernels against their PyTorch references.

Without a GPU, the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py when CUDA is absent) at tiny shapes. With a GPU the same small tests run
compiled, and the ``gpu``-marked tests add real model shapes, a no-host-sync check and CUDA-graph capture.

Every check draws fresh seeded random inputs, fills every float buffer the op allocates with NaN first
(so an unwritten element fails), and compares with the reference computed in float32 from the same
inputs, under per-dtype bounds.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import torch
import triton
import triton.language as tl

from kernels import triton_attention, triton_moe
from kernels.activation import silu_and_mul_torch
from kernels.attention import paged_attention_torch
from kernels.kv_cache import FP8_E4M3_MAX, FP8_KV_DTYPES, FP8_MAX, inv_scale, to_pool_dtype, write_kv_torch
from kernels.moe import fused_moe_torch
from kernels.norm import fused_add_rms_norm_torch, rms_norm_torch
from kernels.ops import TORCH_OPS, get_ops
from kernels.rope import apply_rope_torch
from kernels.triton_kv_cache import to_pool
from kernels.triton_ops import TRITON_OPS
from tests.kernel_testing import (
    DEVICE,
    DTYPES,
    assert_close,
    gpu,
    make_paged_case,
    needs_cuda,
    poison_allocations,  # noqa: F401  (autouse fixture: NaN-filled torch.empty)
    randn,
    up,
)

# ---------------------------------------------------------------------------------------------------------
# The op table


def test_triton_table_matches_torch_signatures() -> None:
    assert get_ops("triton") is TRITON_OPS
    for field in TORCH_OPS.__dataclass_fields__:
        if field == "name":
            continue
        ref = inspect.signature(getattr(TORCH_OPS, field)).parameters
        new = inspect.signature(getattr(TRITON_OPS, field)).parameters
        assert list(new)[: len(ref)] == list(ref), field
        # Anything beyond the reference signature is an optional keyword-only hint.
        for extra in list(new)[len(ref) :]:
            assert new[extra].kind is inspect.Parameter.KEYWORD_ONLY, (field, extra)
            assert new[extra].default is not inspect.Parameter.empty, (field, extra)


# ---------------------------------------------------------------------------------------------------------
# Elementwise and row ops


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [48, 64])
def test_rms_norm(dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(1)
    x, res, w = randn(7, hidden, dtype=dtype), randn(7, hidden, dtype=dtype), randn(hidden, dtype=dtype)
    assert_close(TRITON_OPS.rms_norm(x, w, 1e-6), rms_norm_torch(*up(x), w.float(), 1e-6), dtype, "rms_norm")
    out, summed = TRITON_OPS.fused_add_rms_norm(x, res, w, 1e-6)
    ref_out, ref_sum = fused_add_rms_norm_torch(*up(x, res, w), 1e-6)
    assert_close(summed, ref_sum, dtype, "residual sum")
    assert_close(out, ref_out, dtype, "fused_add_rms_norm")
    # Inputs are not modified, as in the reference.
    x_before, res_before = x.clone(), res.clone()
    TRITON_OPS.fused_add_rms_norm(x, res, w, 1e-6)
    assert torch.equal(x, x_before) and torch.equal(res, res_before)


def test_rms_norm_3d_and_strided_rows() -> None:
    torch.manual_seed(2)
    base = randn(4, 3, 80)
    x = base[..., :64]  # rows with a stride of 80
    w = randn(64)
    assert_close(TRITON_OPS.rms_norm(x, w, 1e-5), rms_norm_torch(x, w, 1e-5), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_q_heads", "num_k_heads", "head_dim"), [(4, 2, 32), (3, 3, 16), (8, 1, 64)])
def test_rope(dtype: torch.dtype, num_q_heads: int, num_k_heads: int, head_dim: int) -> None:
    torch.manual_seed(3)
    tokens = 9
    # q and k as strided views of one fused projection, as a model produces them.
    qkv = randn(tokens, (num_q_heads + 2 * num_k_heads) * head_dim, dtype=dtype)
    q = qkv[:, : num_q_heads * head_dim].view(tokens, num_q_heads, head_dim)
    k = qkv[:, num_q_heads * head_dim : (num_q_heads + num_k_heads) * head_dim].view(
        tokens, num_k_heads, head_dim
    )
    cache = randn(64, head_dim)
    positions = torch.randint(0, 64, (tokens,), device=DEVICE)
    q_out, k_out = TRITON_OPS.apply_rope(q, k, positions, cache)
    q_ref, k_ref = apply_rope_torch(*up(q, k), positions, cache)
    assert_close(q_out, q_ref, dtype, "rope q")
    assert_close(k_out, k_ref, dtype, "rope k")
    assert q_out.dtype == dtype and k_out.dtype == dtype


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [40, 64])
def test_silu_and_mul(dtype: torch.dtype, inter: int) -> None:
    torch.manual_seed(4)
    x = randn(2, 3, 2 * inter, dtype=dtype)
    assert_close(TRITON_OPS.silu_and_mul(x), silu_and_mul_torch(x.float()), dtype, "silu_and_mul")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 4])
def test_write_kv(dtype: torch.dtype, block_size: int) -> None:
    torch.manual_seed(5)
    num_blocks, layers, kv_heads, head_dim, tokens = 6, 3, 2, 32, 11
    pool = randn(num_blocks, layers, 2, block_size, kv_heads, head_dim, dtype=dtype)
    ref_pool = pool.clone()
    kv = randn(tokens, 2 * kv_heads, head_dim, dtype=dtype)
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]  # strided views
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[3] = -1  # padding: skipped
    TRITON_OPS.write_kv(pool, 1, k, v, slots)
    write_kv_torch(ref_pool, 1, k, v, slots)
    assert torch.equal(pool, ref_pool)


@pytest.mark.parametrize("fp8", FP8_KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_write_kv_into_an_fp8_pool(dtype: torch.dtype, fp8: torch.dtype) -> None:
    """A float8 pool (``kv_cache_dtype`` fp8: e4m3, or fp8_e5m2): values clamped to the format's largest
    (448, 57344) and rounded to nearest even, bit for bit as the reference, from outliers down to
    subnormals and zero."""
    torch.manual_seed(51)
    num_blocks, layers, kv_heads, head_dim, tokens, block_size = 6, 3, 2, 32, 11, 4
    pool = torch.zeros(num_blocks, layers, 2, block_size, kv_heads, head_dim, device=DEVICE)
    pool = pool.to(fp8)
    ref_pool = pool.clone()
    scales = torch.logspace(-7, 3, tokens * 2 * kv_heads * head_dim, device=DEVICE)
    kv = (randn(tokens, 2 * kv_heads, head_dim) * scales.view(tokens, 2 * kv_heads, head_dim)).to(dtype)
    kv[0, 0, :4] = torch.tensor([1e4, -1e4, FP8_MAX[fp8] + 1, -0.0]).to(
        dtype
    )  # saturate (e4m3), both, keep -0
    kv[0, 0, 4:6] = torch.tensor([1e6, -1e6]).to(dtype)  # saturate either
    k, v = kv[:, :kv_heads], kv[:, kv_heads:]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    slots[3] = -1
    TRITON_OPS.write_kv(pool, 1, k, v, slots)
    write_kv_torch(ref_pool, 1, k, v, slots)
    assert_same_fp8(pool, ref_pool)
    stored = ref_pool.float()
    assert float(stored.abs().max()) == FP8_MAX[fp8] and not stored.isnan().any() and stored.isfinite().all()
    assert int(pool.view(torch.uint8).ne(0).sum()) > tokens  # something was written
    # With a layer's KV scales the pool holds k / k_scale and v / v_scale, still bit for bit.
    TRITON_OPS.write_kv(pool, 2, k, v, slots, k_scale=20.0, v_scale=0.01)
    write_kv_torch(ref_pool, 2, k, v, slots, k_scale=20.0, v_scale=0.01)
    assert_same_fp8(pool, ref_pool)
    assert not torch.equal(ref_pool[:, 2].float(), ref_pool[:, 1].float())


def test_kv_scales_keep_large_keys_from_saturating() -> None:
    """What calibrated KV scales are for: keys of magnitude ~1000 (as some models' are) saturate a float8
    pool at +-448 and the attention goes wrong; stored divided by a k_scale of amax / 448 and read back
    times it, they keep e4m3's relative precision. The Triton attention (decode and extend) applies the
    scales as the reference does."""
    torch.manual_seed(57)
    q_lens, seq_lens = [1, 1, 1], [40, 17, 64]
    q, pool, bt, sl, qsl = make_paged_case(q_lens, seq_lens, 4, 2, 32, 4, torch.float32)
    pool[:, :, 0] *= 1000.0  # large keys
    q = q * 0.01
    exact = paged_attention_torch(q, pool, 1, bt, sl, qsl, 32**-0.5)
    k_scale = float(pool[:, :, 0].abs().max()) / FP8_E4M3_MAX
    unscaled = to_pool_dtype(pool, torch.float8_e4m3fn)
    scaled = pool.clone()
    scaled[:, :, 0] = to_pool_dtype(pool[:, :, 0], torch.float8_e4m3fn, inv_scale(k_scale)).float()
    scaled = scaled.to(torch.float8_e4m3fn)
    error_unscaled = (paged_attention_torch(q, unscaled, 1, bt, sl, qsl, 32**-0.5) - exact).abs().max()
    ref = paged_attention_torch(q, scaled, 1, bt, sl, qsl, 32**-0.5, k_scale=k_scale)
    error_scaled = (ref - exact).abs().max()
    assert float(error_scaled) < 0.25 * float(error_unscaled), (error_scaled, error_unscaled)
    got = TRITON_OPS.paged_attention(q, scaled, 1, bt, sl, qsl, 32**-0.5, k_scale=k_scale, v_scale=1.0)
    assert_close(got, ref, torch.float32, "scaled decode attention")
    # an extend (prefill over the cached prefix) with both scales
    qx = randn(9, 4, 32) * 0.01
    qsl_x = torch.tensor([0, 4, 6, 9], dtype=torch.int32, device=DEVICE)
    ref_x = paged_attention_torch(qx, scaled, 1, bt, sl, qsl_x, 32**-0.5, k_scale=k_scale, v_scale=2.5)
    got_x = TRITON_OPS.paged_attention(qx, scaled, 1, bt, sl, qsl_x, 32**-0.5, k_scale=k_scale, v_scale=2.5)
    assert_close(got_x, ref_x, torch.float32, "scaled extend attention")


@pytest.mark.parametrize("op", ["write_kv", "paged_attention"])
def test_kv_scales_are_for_fp8_pools_and_positive(op: str) -> None:
    """A 16-bit pool stores values as they are: a scale other than 1.0 for it is an error, as is a
    non-positive or non-finite scale for any pool."""
    q, pool, bt, sl, qsl = make_paged_case([1, 1], [5, 9], 4, 2, 32, 4, torch.float32)
    kv, slots = randn(2, 2, 32), torch.tensor([0, 5], device=DEVICE)
    fp8 = pool.to(torch.float8_e4m3fn)
    for backend in (TORCH_OPS, TRITON_OPS):
        call = (
            (lambda p, b=backend, **kw: b.write_kv(p, 1, kv, kv, slots, **kw))
            if op == "write_kv"
            else (lambda p, b=backend, **kw: b.paged_attention(q, p, 1, bt, sl, qsl, 0.2, **kw))
        )
        with pytest.raises(ValueError, match="scales apply to float8 pools"):
            call(pool, k_scale=2.0)
        for bad in (0.0, -1.0, float("inf"), float("nan")):
            with pytest.raises(ValueError, match="positive and finite"):
                call(fp8, v_scale=bad)
        call(pool, k_scale=1.0, v_scale=1.0)  # 1.0 is every pool's
        call(fp8, k_scale=0.5, v_scale=4.0)


@pytest.mark.parametrize("fp8", FP8_KV_DTYPES, ids=str)
def test_fp8_rounding_matches_torch_on_every_edge(fp8: torch.dtype) -> None:
    """``to_pool``'s rounding to float8 (e4m3, e5m2) against torch's cast (the same values), on every finite
    value, every midpoint between neighbours (ties to even), values just off the midpoints, and random
    values across the format's range (the interpreter's own fp32 -> fp8 cast gets the carry into the
    exponent wrong: 31.9 -> 16 in e4m3)."""
    finite = torch.arange(256, dtype=torch.uint8).view(fp8).float()
    finite = finite[finite.isfinite()].unique()
    mids = (finite[1:] + finite[:-1]) / 2
    off = (mids[:, None] * torch.tensor([1 - 2**-12, 1 + 2**-12])).flatten()
    gen = torch.Generator().manual_seed(52)
    spread = torch.randn(4000, generator=gen) * torch.logspace(-7, 5, 4000)
    x = torch.cat([finite, mids, off, spread, torch.tensor([500.0, -1e6, 6e4, 0.0, -0.0])]).to(DEVICE)
    got = torch.empty(len(x), dtype=fp8, device=DEVICE)
    _to_pool_kernel[(triton.cdiv(len(x), 1024),)](x, got, len(x), 1.0, BLOCK=1024)
    assert_same_fp8(got, to_pool_dtype(x, fp8))
    # A layer's KV scale: the value times 1 / scale in float32, then rounded as above (scales below 1
    # spread values over more of e4m3's range, above 1 saturate fewer).
    for scale in (0.37, 3.0):
        _to_pool_kernel[(triton.cdiv(len(x), 1024),)](x, got, len(x), inv_scale(scale), BLOCK=1024)
        want = to_pool_dtype(x, fp8, inv_scale(scale))
        assert_same_fp8(got, want)
        assert not torch.equal(want.float(), to_pool_dtype(x, fp8).float())


def assert_same_fp8(got: torch.Tensor, want: torch.Tensor) -> None:
    """The same float8 values. A zero's sign may differ: on the H200 the kernel stores a negative value
    that rounds to zero, and -0.0 itself, as +0.0 where torch keeps -0.0 (equal in every product)."""
    bad = got.float() != want.float()
    assert not bad.any(), (int(bad.sum()), got.float()[bad][:8].tolist(), want.float()[bad][:8].tolist())


@triton.jit
def _to_pool_kernel(x_ptr, y_ptr, n, inv, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + i, to_pool(tl.load(x_ptr + i, mask=i < n), y_ptr.dtype.element_ty, inv), mask=i < n)


def test_pool_ops_reject_a_pool_strided_in_head_dim() -> None:
    """write_kv, paged_attention and qkv_prologue address the pool with a unit head_dim stride."""
    torch.manual_seed(12)
    # [blocks, layers, 2, block_size, Hkv, D] with D strided (Hkv is the unit-stride dimension).
    pool = randn(4, 2, 2, 4, 32, 2).transpose(-1, -2)
    assert pool.stride(-1) != 1
    kv, slots = randn(3, 2, 32), torch.tensor([0, 5, 9], device=DEVICE)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        TRITON_OPS.write_kv(pool, 1, kv, kv, slots)
    qsl = torch.arange(4, dtype=torch.int32, device=DEVICE)
    bt = torch.arange(4, dtype=torch.int32, device=DEVICE).view(2, 2)[[0, 1, 0]]
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        TRITON_OPS.paged_attention(randn(3, 4, 32), pool, 1, bt, qsl[1:], qsl, 0.2)
    with pytest.raises(ValueError, match="contiguous in head_dim"):
        TRITON_OPS.qkv_prologue(
            randn(3, 8 * 32), 4, 2, 32, None, None, 1e-6, slots, randn(16, 32), pool, 1, slots
        )


# ---------------------------------------------------------------------------------------------------------
# Paged attention


def check_attention(
    q_lens: list[int],
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
    **kwargs: int,
) -> torch.Tensor:
    """The Triton attention against the reference on a random case; ``kv_dtype``: the pool's dtype when
    not q's (a float8 pool: both read the same quantised values). Returns the reference's output."""
    q, pool, bt, sl, qsl = make_paged_case(
        q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype
    )
    if kv_dtype is not None:
        pool = to_pool_dtype(pool, kv_dtype)
    scale = head_dim**-0.5
    out = TRITON_OPS.paged_attention(q, pool, 1, bt, sl, qsl, scale, **kwargs)
    ref = paged_attention_torch(q.float(), pool.float(), 1, bt, sl, qsl, scale)
    real = torch.zeros(q.shape[0], dtype=torch.bool, device=DEVICE)
    for b, (q0, q1) in enumerate(zip(qsl[:-1].tolist(), qsl[1:].tolist(), strict=True)):
        real[q0:q1] = seq_lens[b] > 0
    assert_close(out[real], ref[real], dtype, f"attention q_lens={q_lens} seq_lens={seq_lens}")
    return ref


# (num_heads, num_kv_heads, head_dim, block_size, dtype): GQA 1/2/4, D 16/32/64, block 16/4, each dtype.
ATTN_LAYOUTS = [
    (4, 4, 16, 16, torch.float32),
    (4, 2, 32, 4, torch.bfloat16),
    (8, 2, 64, 16, torch.float16),
    (8, 2, 32, 4, torch.float32),
    (4, 1, 64, 4, torch.bfloat16),
    (2, 2, 64, 4, torch.float16),
]


@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 3, 9]], ids=["decode", "extend"])
def test_attention_writes_into_out(q_lens: list[int]) -> None:
    """Both versions write into a given buffer (a view of a wider static buffer's rows, as the prefill
    graphs pass) and return it; one of the wrong shape is refused."""
    torch.manual_seed(8)
    q, pool, bt, sl, qsl = make_paged_case(q_lens, [9, 20, 33], 4, 2, 32, 4, torch.float32)
    want = paged_attention_torch(q, pool, 1, bt, sl, qsl, 0.2)
    t = q.shape[0]
    for op in (paged_attention_torch, TRITON_OPS.paged_attention):
        static = torch.full((t + 3, 4 * 32), float("nan"), device=DEVICE)
        got = op(q, pool, 1, bt, sl, qsl, 0.2, out=static[:t].view(t, 4, 32))
        assert got.data_ptr() == static.data_ptr()
        assert_close(static[:t].view(t, 4, 32), want, torch.float32, "attention out")
        assert torch.isnan(static[t:]).all()
        with pytest.raises(ValueError, match="out must be"):
            op(q, pool, 1, bt, sl, qsl, 0.2, out=static[: t - 1].view(t - 1, 4, 32))


@pytest.mark.parametrize("layout", ATTN_LAYOUTS, ids=lambda p: f"h{p[0]}-kv{p[1]}-d{p[2]}-bs{p[3]}-{p[4]}")
def test_decode_attention_long_and_short(layout: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(6)
    heads, kv_heads, head_dim, block_size, dtype = layout
    seq_lens = [1, 7, 33, 130]  # one token, inside a block, crossing blocks, many blocks
    check_attention([1] * 4, seq_lens, heads, kv_heads, head_dim, block_size, dtype)
    # Force several KV splits, some past the end of the short sequences, so the LSE merge is exercised.
    monkeypatch.setattr(triton_attention, "num_kv_splits", lambda *_: 4)
    check_attention([1] * 4, seq_lens, heads, kv_heads, head_dim, block_size, dtype)


def test_kv_split_count_follows_occupancy_length_and_the_one_token_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """num_kv_splits: about two waves of programs, >= min_tokens_per_split keys a split, a power of two, and
    a higher cap for one query token (a batch-1 decode step) than for several."""
    cfg = dataclasses.replace(
        triton_attention.DECODE_CONFIG, min_tokens_per_split=128, max_splits=4, max_splits_one_token=8
    )
    monkeypatch.setattr(triton_attention, "DECODE_CONFIG", cfg)
    monkeypatch.setattr(triton_attention, "sm_count", lambda _device: 132)
    cuda = torch.device("cuda")  # only read for its type: sm_count is patched
    splits = triton_attention.num_kv_splits
    assert splits(1, 4, 8192, cuda) == 8  # occupancy 66, length 64: the one-token cap
    assert splits(2, 4, 8192, cuda) == 4  # occupancy 33: the cap for several tokens
    assert splits(1, 4, 300, cuda) == 4  # length: cdiv(300, 128) = 3, rounded up to a power of two
    assert splits(64, 4, 8192, cuda) == 2  # occupancy: cdiv(264, 256) = 2
    assert splits(1, 4, 1, cuda) == 1


def test_decode_merge_never_reads_an_empty_split(monkeypatch: pytest.MonkeyPatch) -> None:
    """Splits past a short sequence's end write only their lse (-inf), not a partial output: with the
    partials' scratch poisoned with NaN, the merged output must still be exact (0 * NaN would show)."""
    torch.manual_seed(61)
    splits, seq_lens = 8, [1, 7, 33, 130]
    scratch: list[torch.Tensor] = []

    def poisoned(shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        scratch.append(torch.full(shape, float("nan"), dtype=torch.float32, device=device))
        return scratch[-1]

    monkeypatch.setattr(triton_attention, "num_kv_splits", lambda *_, n=splits: n)
    monkeypatch.setattr(triton_attention, "_split_scratch", poisoned)
    check_attention([1] * 4, seq_lens, 4, 2, 32, 16, torch.float32)
    mid_o = scratch[0]  # [T, heads, splits, head_dim]; the second is the lse, written by every split
    block_n = triton_attention.DECODE_CONFIG.block_n
    for t, length in enumerate(seq_lens):
        per_split = (length + splits - 1) // splits
        split_len = (per_split + block_n - 1) // block_n * block_n  # as _split_keys: whole tiles
        for s in range(splits):
            written = ~torch.isnan(mid_o[t, :, s])
            # a split with keys writes its partial; an empty one (past the end) writes nothing
            assert bool(written.all() if s * split_len < length else not written.any()), (t, s)


@pytest.mark.parametrize(
    "layout", ATTN_LAYOUTS[:3], ids=lambda p: f"h{p[0]}-kv{p[1]}-d{p[2]}-bs{p[3]}-{p[4]}"
)
def test_extend_attention_with_and_without_prefix(layout: tuple) -> None:
    torch.manual_seed(7)
    heads, kv_heads, head_dim, block_size, dtype = layout
    # prefill without prefix (70 tokens: two query tiles), chunked prefill on a cached prefix, one decode.
    check_attention([70, 5, 9, 1], [70, 42, 9, 20], heads, kv_heads, head_dim, block_size, dtype)


@pytest.mark.parametrize("fp8", FP8_KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("q_lens", [[1, 1, 1, 1], [70, 5, 9, 1]], ids=["decode", "extend"])
def test_attention_over_an_fp8_pool(q_lens: list[int], dtype: torch.dtype, fp8: torch.dtype) -> None:
    """Decode and extend attention read a float8 pool's values widened to q's dtype, as the reference
    does; and what fp8 costs: against the attention over the unquantised values the outputs differ by
    the format's rounding (e4m3: 3 mantissa bits, a few percent; e5m2: 2 bits, about twice that)."""
    torch.manual_seed(53)
    seq_lens = [130, 42, 9, 20] if q_lens[0] == 1 else [70, 42, 9, 20]
    case = (q_lens, seq_lens, 8, 2, 32, 4, dtype)
    ref = check_attention(*case, kv_dtype=fp8)
    torch.manual_seed(53)
    exact = check_attention(*case)  # the same random case, the pool unquantised
    bound = 0.1 if fp8 == torch.float8_e4m3fn else 0.2
    assert float((ref - exact).abs().max()) <= bound * float(exact.abs().max())
    assert not torch.equal(ref, exact)


def test_mixed_query_lengths_in_decode_shape() -> None:
    """T <= B picks the decode kernel; it must stay exact when lengths are not all one."""
    torch.manual_seed(8)
    check_attention([0, 2, 1, 0], [5, 19, 40, 3], 4, 2, 32, 4, torch.float32)
    check_attention([0, 2], [3, 17], 4, 2, 32, 16, torch.float32)


def test_decode_with_explicit_max_seq_len_and_empty_padding() -> None:
    """CUDA-graph padding: a padded sequence (seq_len 0) must not disturb the others."""
    torch.manual_seed(9)
    check_attention([1, 1, 1], [12, 0, 65], 8, 2, 16, 16, torch.float32, max_seq_len=80)


# ---------------------------------------------------------------------------------------------------------
# Fused MoE


def make_moe_case(
    tokens: int, hidden: int, inter: int, experts: int, top_k: int, dtype: torch.dtype, used_experts: int
) -> tuple[torch.Tensor, ...]:
    x = randn(tokens, hidden, dtype=dtype)
    w13 = randn(experts, 2 * inter, hidden, dtype=dtype, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, dtype=dtype, scale=inter**-0.5)
    # Only `used_experts` of the experts receive tokens: the rest must be skipped cleanly.
    allowed = torch.randperm(experts, device=DEVICE)[:used_experts]
    ids = torch.stack([allowed[torch.randperm(used_experts, device=DEVICE)[:top_k]] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, device=DEVICE).softmax(-1)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize(
    ("tokens", "top_k", "dtype"),
    [(1, 1, torch.float32), (5, 2, torch.bfloat16), (33, 4, torch.float16), (17, 2, torch.float32)],
)
def test_fused_moe(tokens: int, top_k: int, dtype: torch.dtype) -> None:
    torch.manual_seed(10)
    x, w13, w2, weights, ids = make_moe_case(tokens, 32, 48, 8, top_k, dtype, used_experts=max(top_k, 5))
    out = TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    ref = fused_moe_torch(*up(x, w13, w2), weights, ids)
    assert_close(out, ref, dtype, "fused_moe")
    assert out.dtype == dtype


def align_case(tokens: int, top_k: int, experts: int, used: int) -> torch.Tensor:
    """Routing of ``tokens`` to ``top_k`` distinct experts each, all among ``used`` of them (the rest get
    no pairs)."""
    allowed = torch.randperm(experts, device=DEVICE)[:used]
    return torch.stack([allowed[torch.randperm(used, device=DEVICE)[:top_k]] for _ in range(tokens)])


def check_align_layout(got: tuple[torch.Tensor, ...], ids: torch.Tensor, experts: int, block_m: int) -> None:
    """Equal to the torch reference, and a valid layout: each tile's pairs belong to its expert, and every
    pair appears once."""
    pairs = ids.numel()
    want = triton_moe._moe_align_torch(
        ids, block_m, experts, triton_moe.align_max_rows(pairs, experts, block_m)
    )
    for name, a, b in zip(("sorted_ids", "expert_ids", "num_rows_padded"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    sorted_ids, expert_ids, num_rows = got
    counts = torch.bincount(ids.reshape(-1), minlength=experts)
    assert int(num_rows) == int(((counts + block_m - 1) // block_m * block_m).sum())
    flat = ids.reshape(-1)
    real = sorted_ids[: int(num_rows)].view(-1, block_m)
    owners = expert_ids[: int(num_rows) // block_m, None].expand_as(real)
    used = real < pairs
    assert (flat[real[used].long()] == owners[used]).all()
    assert torch.equal(real[used].sort().values, torch.arange(pairs, dtype=torch.int32, device=DEVICE))


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "block_m"),
    [(4, 2, 6, 4), (37, 4, 16, 16), (300, 5, 64, 16), (256, 8, 128, 32), (512, 8, 128, 64)],
)
def test_moe_align_block_size(tokens: int, top_k: int, experts: int, block_m: int) -> None:
    """Both Triton alignments (single program, multi-program) equal the torch reference."""
    torch.manual_seed(11)
    ids = align_case(tokens, top_k, experts, used=max(top_k, experts // 2))
    max_rows = triton_moe.align_max_rows(ids.numel(), experts, block_m)
    check_align_layout(triton_moe._moe_align_triton(ids, block_m, experts, max_rows), ids, experts, block_m)
    check_align_layout(triton_moe._moe_align_chunked(ids, block_m, experts, max_rows), ids, experts, block_m)


@pytest.mark.parametrize(
    ("tokens", "top_k", "experts", "used", "block_m", "max_chunks"),
    [
        (1100, 8, 128, 64, 64, None),  # 8800 pairs: 69 chunks, the last one partial
        (333, 1, 16, 1, 16, None),  # every pair to one expert: its run crosses every chunk
        (1, 8, 128, 128, 64, None),  # one program, 8 pairs
        (129, 2, 64, 40, 32, None),
        (171, 3, 32, 16, 16, None),
        (250, 5, 128, 30, 32, None),
        (120, 6, 60, 45, 64, None),  # experts not a power of two
        (97, 7, 256, 100, 16, None),  # 256 experts: fewer counts-table rows per load
        (700, 4, 32, 20, 16, 3),  # 3 chunks of 8 steps each (1024 pairs), the last one 752 pairs
        (64, 8, 128, 64, 32, None),  # 512 pairs: whole chunks only
    ],
)
def test_moe_align_multi_program_matches_torch(
    monkeypatch: pytest.MonkeyPatch,
    tokens: int,
    top_k: int,
    experts: int,
    used: int,
    block_m: int,
    max_chunks: int | None,
) -> None:
    """The multi-program alignment equals the torch reference: pairs past 4096 and not a multiple of a
    chunk, experts with no pairs, top-k 1 to 8, several tile heights, chunks of several steps. Integer
    buffers start as garbage, so a row the kernels leave unwritten fails."""
    torch.manual_seed(12)
    if max_chunks is not None:
        monkeypatch.setattr(triton_moe, "ALIGN_MAX_CHUNKS", max_chunks)
    empty = torch.empty  # already the NaN-poisoning one for floats

    def garbage(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)
        return t.fill_(-7) if t.dtype == torch.int32 else t

    monkeypatch.setattr(torch, "empty", garbage)
    ids = align_case(tokens, top_k, experts, used)
    max_rows = triton_moe.align_max_rows(ids.numel(), experts, block_m)
    got = triton_moe._moe_align_chunked(ids, block_m, experts, max_rows)
    check_align_layout(got, ids, experts, block_m)


LIMIT_TOKENS = triton_moe.ALIGN_KERNEL_MAX_PAIRS // 8  # the most top-8 tokens the single program takes


@pytest.mark.parametrize(
    ("tokens", "path"),
    [
        (1, "_moe_align_triton"),
        (LIMIT_TOKENS, "_moe_align_triton"),
        (LIMIT_TOKENS + 1, "_moe_align_chunked"),
        (1024, "_moe_align_chunked"),  # past the 4096 pairs where the torch path used to take over
        (8192, "_moe_align_chunked"),
    ],
)
def test_moe_align_dispatch(monkeypatch: pytest.MonkeyPatch, tokens: int, path: str) -> None:
    """Up to ALIGN_KERNEL_MAX_PAIRS pairs the single program (one launch after the fill), past it the
    multi-program kernels at any size; never the torch path, whose ~30 launches per MoE layer made a
    prefill host-bound (docs/kernels.md)."""
    taken: list[str] = []
    for name in ("_moe_align_triton", "_moe_align_chunked", "_moe_align_torch"):
        monkeypatch.setattr(triton_moe, name, lambda *a, name=name: taken.append(name))
    ids = torch.randint(0, 128, (tokens, 8), device=DEVICE)
    triton_moe.moe_align_block_size(ids, 64, 128)
    assert taken == [path]


# ---------------------------------------------------------------------------------------------------------
# GPU: real shapes, no host sync, CUDA graphs


@gpu
@needs_cuda
def test_gpu_decode_attention_llama8b() -> None:
    torch.manual_seed(20)
    seq_lens = torch.randint(1, 4097, (64,)).tolist()
    seq_lens[:2] = [4096, 1]
    check_attention([1] * 64, seq_lens, 32, 8, 128, 16, torch.bfloat16)


@gpu
@needs_cuda
def test_gpu_attention_over_an_fp8_pool_llama8b() -> None:
    torch.manual_seed(22)
    seq_lens = torch.randint(1, 4097, (64,)).tolist()
    check_attention([1] * 64, seq_lens, 32, 8, 128, 16, torch.bfloat16, kv_dtype=torch.float8_e4m3fn)
    check_attention(
        [1024, 300, 1], [1024, 2348, 3000], 32, 8, 128, 16, torch.bfloat16, kv_dtype=torch.float8_e4m3fn
    )


@gpu
@needs_cuda
@pytest.mark.parametrize(
    "head_dim, kv_dtype", [(128, torch.float8_e4m3fn), (96, torch.float8_e4m3fn), (128, torch.float8_e5m2)]
)
def test_gpu_decode_reads_an_fp8_pool_as_words(
    head_dim: int, kv_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On an sm_89+ GPU the decode kernel reads a float8 pool as 4-byte words widened in registers
    (``_load_fp8_words``) where its splits are long (32 sequences: 2 splits of ~2k keys, and 4 forced
    ones of ~1k), and loads float8 and casts where they are short (one sequence: 32 splits of 128 keys).
    Both agree with the reference and give what the other gives: the same float16 operands and dots, so
    the path a batch's size picks changes no output. head_dim 96 leaves a quarter of each 128-wide tile's
    words masked; the split counts put some splits past the short sequences' ends. With KV scales (the
    attention folds k_scale into its softmax scale and multiplies its output by v_scale, either path).
    e4m3 and e5m2 pools alike (the same words, each format's conversion)."""
    taken: list[bool] = []
    choose = triton_attention.fp8_words

    def spied(pool: torch.Tensor, keys_per_split: int) -> bool:
        taken.append(choose(pool, keys_per_split))
        return taken[-1]

    monkeypatch.setattr(triton_attention, "fp8_words", spied)
    torch.manual_seed(23)
    long_lens = [1, 17, 300, 4096] + torch.randint(1, 4097, (28,)).tolist()
    for seq_lens, splits, words in ((long_lens, None, True), (long_lens, 4, True), ([4096], None, False)):
        torch.manual_seed(24)
        q, pool, bt, sl, qsl = make_paged_case(
            [1] * len(seq_lens), seq_lens, 32, 8, head_dim, 16, torch.bfloat16
        )
        pool = to_pool_dtype(pool, kv_dtype)
        scales = {"k_scale": 0.5, "v_scale": 2.0}
        with monkeypatch.context() as m:
            if splits is not None:
                m.setattr(triton_attention, "num_kv_splits", lambda *_, n=splits: n)
            got = TRITON_OPS.paged_attention(q, pool, 1, bt, sl, qsl, head_dim**-0.5, **scales)
            assert taken[-1] is words, (seq_lens[:4], splits)
            m.setattr(triton_attention, "fp8_words", lambda _pool, _keys, w=words: not w)
            other = TRITON_OPS.paged_attention(q, pool, 1, bt, sl, qsl, head_dim**-0.5, **scales)
        ref = paged_attention_torch(q.float(), pool, 1, bt, sl, qsl, head_dim**-0.5, **scales)
        assert_close(got, ref, torch.bfloat16, f"{kv_dtype} pool, head_dim {head_dim}, words {words}")
        assert torch.equal(got, other), float((got.float() - other.float()).abs().max())


def test_fp8_words_only_on_a_gpu_pool_of_float8() -> None:
    """The interpreter (and any CPU pool) keeps the cast path: the widening asm has no interpreter."""
    pool = torch.zeros(4, 2, 2, 16, 2, 32, dtype=torch.float8_e4m3fn)
    assert not triton_attention.fp8_words(pool, 4096)
    assert not triton_attention.fp8_words(pool.to(torch.float8_e5m2), 4096)
    assert not triton_attention.fp8_words(pool.to(torch.bfloat16), 4096)
    assert not triton_attention.opaque_values(pool)  # inline asm: the interpreter has none


@gpu
@needs_cuda
def test_gpu_extend_attention_llama8b() -> None:
    torch.manual_seed(21)
    q_lens = [1024, 300, 77, 1]
    seq_lens = [1024, 2348, 577, 3000]
    check_attention(q_lens, seq_lens, 32, 8, 128, 16, torch.bfloat16)
    check_attention(q_lens, seq_lens, 32, 8, 128, 16, torch.float32)


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 64, 256])
def test_gpu_fused_moe_qwen3_30b_a3b(tokens: int) -> None:
    torch.manual_seed(22)
    x, w13, w2, weights, ids = make_moe_case(tokens, 2048, 768, 128, 8, torch.bfloat16, used_experts=128)
    out = TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    assert_close(out, fused_moe_torch(*up(x, w13, w2), weights, ids), torch.bfloat16, "fused_moe")


@gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [16, 64, 1024, 8192])
def test_gpu_moe_align_in_cuda_graph(tokens: int) -> None:
    """Either alignment path, captured once at a real size (Qwen3-30B-A3B: 128 experts, top-8) and replayed
    with new routing, equals the torch reference; the 8192-token prompt's chunks take several steps."""
    torch.manual_seed(26)
    experts, block_m = 128, 64
    ids = torch.rand(tokens, experts, device=DEVICE).topk(8, dim=-1).indices
    triton_moe.moe_align_block_size(ids, block_m, experts)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = triton_moe.moe_align_block_size(ids, block_m, experts)
    for _ in range(2):
        ids.copy_(torch.rand(tokens, experts, device=DEVICE).topk(8, dim=-1).indices)
        graph.replay()
        torch.cuda.synchronize()
        check_align_layout(got, ids, experts, block_m)


@gpu
@needs_cuda
def test_gpu_row_ops_real_shapes() -> None:
    torch.manual_seed(23)
    dtype = torch.bfloat16
    x, res, w = randn(512, 4096, dtype=dtype), randn(512, 4096, dtype=dtype), randn(4096, dtype=dtype)
    out, summed = TRITON_OPS.fused_add_rms_norm(x, res, w, 1e-5)
    ref_out, ref_sum = fused_add_rms_norm_torch(*up(x, res, w), 1e-5)
    assert_close(summed, ref_sum, dtype)
    assert_close(out, ref_out, dtype)
    q, k = randn(512, 32, 128, dtype=dtype), randn(512, 8, 128, dtype=dtype)
    cache, pos = randn(8192, 128), torch.randint(0, 8192, (512,), device=DEVICE)
    for got, want in zip(
        TRITON_OPS.apply_rope(q, k, pos, cache), apply_rope_torch(*up(q, k), pos, cache), strict=True
    ):
        assert_close(got, want, dtype)
    g = randn(512, 2 * 14336, dtype=dtype)
    assert_close(TRITON_OPS.silu_and_mul(g), silu_and_mul_torch(g.float()), dtype)


def _decode_step_inputs(batch: int) -> tuple[torch.Tensor, ...]:
    q, pool, bt, sl, qsl = make_paged_case([1] * batch, [4096] * batch, 32, 8, 128, 16, torch.bfloat16)
    k, v = randn(batch, 8, 128, dtype=torch.bfloat16), randn(batch, 8, 128, dtype=torch.bfloat16)
    return q, pool, bt, sl, qsl, k, v


@gpu
@needs_cuda
def test_gpu_decode_step_has_no_host_sync() -> None:
    torch.manual_seed(24)
    q, pool, bt, sl, qsl, k, v = _decode_step_inputs(8)
    slots = (bt[:, 0].long() * 16).contiguous()
    x, w13, w2, weights, ids = make_moe_case(8, 2048, 768, 128, 8, torch.bfloat16, used_experts=128)
    TRITON_OPS.paged_attention(q, pool, 1, bt, sl, qsl, 0.088)  # compile outside the check
    TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    TRITON_OPS.write_kv(pool, 1, k, v, slots)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        TRITON_OPS.write_kv(pool, 1, k, v, slots)
        TRITON_OPS.paged_attention(q, pool, 1, bt, sl, qsl, 0.088)
        TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@gpu
@needs_cuda
def test_gpu_decode_step_in_cuda_graph() -> None:
    """Capture attention + MoE once, then replay with new lengths, tables and routing."""
    torch.manual_seed(25)
    batch = 16
    q, pool, bt, sl, qsl, _, _ = _decode_step_inputs(batch)
    sl.copy_(torch.randint(1, 4097, (batch,), device=DEVICE, dtype=torch.int32))
    x, w13, w2, weights, ids = make_moe_case(batch, 2048, 768, 128, 8, torch.bfloat16, used_experts=128)
    scale = 128**-0.5
    TRITON_OPS.paged_attention(q, pool, 1, bt, sl, qsl, scale, max_seq_len=4096)
    TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        attn_out = TRITON_OPS.paged_attention(q, pool, 1, bt, sl, qsl, scale, max_seq_len=4096)
        moe_out = TRITON_OPS.fused_moe(x, w13, w2, weights, ids)
    for _ in range(2):
        sl.copy_(torch.randint(1, 4097, (batch,), device=DEVICE, dtype=torch.int32))
        bt.copy_(bt[torch.randperm(batch, device=DEVICE)])
        q.copy_(randn(*q.shape, dtype=q.dtype))
        ids.copy_(torch.stack([torch.randperm(128, device=DEVICE)[:8] for _ in range(batch)]))
        graph.replay()
        torch.cuda.synchronize()
        assert_close(
            attn_out, paged_attention_torch(q.float(), pool.float(), 1, bt, sl, qsl, scale), torch.bfloat16
        )
        assert_close(moe_out, fused_moe_torch(*up(x, w13, w2), weights, ids), torch.bfloat16)


# ---------------------------------------------------------------------------------------------------------
# Programmatic dependent launch


def test_pdl_only_where_the_device_has_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """Off on the CPU (the interpreter has no grid dependency control) and when switched off; on a CUDA
    device of compute capability 9.0+ both the kernel's constexpr and the launch option are set."""
    from kernels import triton_device

    assert triton_device.pdl_kwargs(torch.device("cpu")) == {"USE_PDL": False}
    monkeypatch.setattr(triton_device, "_supports_pdl", lambda _index: True)
    assert triton_device.pdl_kwargs(torch.device("cuda", 0)) == {"USE_PDL": True, "launch_pdl": True}
    monkeypatch.setattr(triton_device, "PDL_ENABLED", False)
    assert triton_device.pdl_kwargs(torch.device("cuda", 0)) == {"USE_PDL": False}
    monkeypatch.setattr(triton_device, "PDL_ENABLED", True)
    monkeypatch.setattr(triton_device, "_supports_pdl", lambda _index: False)
    assert triton_device.pdl_kwargs(torch.device("cuda", 0)) == {"USE_PDL": False}


@pytest.mark.parametrize("kernel", ["_extend_kernel", "_decode_split_kernel"])
def test_attention_compiles_one_variant_for_any_block_table_width(kernel: str) -> None:
    """Triton compiles a variant of a kernel per class of each integer argument it specialises on (equal to
    1, divisible by 16, other). The block table's width varies from step to step in eager attention (the
    prefill graphs' attention runs eagerly), so the attention kernels must not specialise on its stride (or
    on the sequence count): a new class would compile in the middle of serving. Checked with Triton's own
    argument binder for an sm_90 target (no GPU needed)."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import JITFunction, create_function_from_signature

    fn = getattr(triton_attention, kernel)
    if not isinstance(fn, JITFunction):  # under the interpreter: the same function, jitted as on a GPU
        fn = JITFunction(fn.fn, **fn.kwargs)
    binder = create_function_from_signature(fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    variants = set()
    for width, seqs in ((1, 1), (33, 3), (47, 16), (48, 17), (64, 64)):
        args: dict[str, object] = {}
        for param in fn.params:
            name = param.name
            if param.is_constexpr:
                args[name] = "tf32" if name == "DOT_PRECISION" else 16
            elif name.endswith("_ptr"):
                args[name] = torch.empty(64, dtype=torch.int32)
            else:
                args[name] = {"stride_bt": width, "num_seqs": seqs}.get(name, 0.5 if "scale" in name else 7)
        variants.add(str(binder(**args)[1]))
    assert len(variants) == 1, variants


def test_every_pdl_kernel_waits_before_its_first_load() -> None:
    """A kernel launched with PDL may start while the previous one still writes its inputs: each kernel
    with a USE_PDL switch must call pdl_wait before any tl.store or call of a jit helper of its module, and
    before any tl.load except those marked ``# pre-wait`` (step inputs no kernel of the step writes, each
    with its reason)."""
    import re

    from kernels import (
        triton_activation,
        triton_fp8_linear,
        triton_linear,
        triton_mla,
        triton_moe_routing,
        triton_norm,
        triton_prologue,
    )

    modules = (triton_activation, triton_attention, triton_fp8_linear, triton_linear, triton_mla, triton_moe,
               triton_moe_routing, triton_norm, triton_prologue)  # fmt: skip
    checked = 0
    for module in modules:
        source = inspect.getsource(module)
        for match in re.finditer(r"def (\w+)\((?:(?!\ndef ).)*?USE_PDL: tl\.constexpr,\n\):(?:  # fmt: skip)?\n(.*?)(?=\n@triton|\ndef |\Z)",
                                 source, re.S):  # fmt: skip
            # Unmarked lines only: a marked load states why nothing the previous kernel writes is read.
            body = "\n".join(line for line in match.group(2).split("\n") if "# pre-wait" not in line)
            wait = body.find("pdl_wait(USE_PDL)")
            # A call of a module's own jit helper (``_name(``) may load or store: it counts as an access.
            helper = re.search(r"(?<![\w.])_\w+\(", body)
            first_access = min(
                (
                    i
                    for i in (body.find("tl.load("), body.find("tl.store("), helper.start() if helper else -1)
                    if i >= 0
                ),
                default=-1,
            )
            assert 0 <= wait < first_access, (
                f"{module.__name__}.{match.group(1)} reads or writes before pdl_wait"
            )
            checked += 1
    # Every kernel that declares the switch was found: norm, SiLU, attention x2, GEMV, norm + GEMV, the
    # skinny kernel, its one-weight-row variant and its split-K sum, the float8 GEMV, prologue, routing,
    # MoE x9, the latent attention's split, merge, prologue and value projection, the SiLU GEMV (a kernel
    # whose signature the pattern misses would otherwise go unchecked).
    declared = sum(inspect.getsource(m).count("USE_PDL: tl.constexpr") for m in modules)
    assert checked == declared == 25
