"""The ``qkv_attention`` op (the QKV prologue and attention as one op) against its reference.

In the decode shape (query tokens <= sequences) the Triton op folds the prologue into the split-KV
attention kernel: q is normalised and rotated in the kernel, and the program whose split holds a new
token's position writes that token's k and v into the pool before reading the split. These tests check the
output and the pool (k close, v bit-identical, every other slot untouched) against the reference
composition ``qkv_prologue_torch`` + ``paged_attention_torch`` run in the same dtype on a copy of the pool;
the positions and slots are the ones the engine gives (a token's KV slot is where attention reads its
position), so a write the kernel missed or made after its read fails. Without a GPU the kernels run in the
interpreter (``tests/conftest.py``); every float buffer the op allocates starts as NaN.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from engine.models.rope_cache import cos_sin_cache
from kernels import triton_attention
from kernels.kv_cache import inv_scale, to_pool_dtype
from kernels.qkv_prologue import qkv_attention_torch
from kernels.triton_ops import TRITON_OPS
from tests.kernel_testing import (
    DEVICE,
    assert_close,
    gpu,
    make_paged_case,
    needs_cuda,
    poison_allocations,  # noqa: F401  (autouse fixture: NaN-filled torch.empty)
    randn,
)

LAYERS, LAYER = 2, 1


class Case:
    """A batch of sequences: their contexts in the pool, the new tokens' raw QKV rows, positions and slots."""

    def __init__(
        self,
        q_lens: list[int],
        seq_lens: list[int],
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        *,
        qk_norm: bool,
        padding_tokens: tuple[int, ...] = (),
        kv_dtype: torch.dtype | None = None,
        kv_scales: tuple[float, float] | None = None,
    ) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        _, self.pool, self.block_tables, self.seq_lens, self.qsl = make_paged_case(
            q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_layers=LAYERS
        )
        # A layer's KV scales (a float8 pool's): the ops take them, the old context is stored divided by them.
        self.kv_scales = {} if kv_scales is None else {"k_scale": kv_scales[0], "v_scale": kv_scales[1]}
        if kv_dtype is not None:  # a float8 pool (kv_cache_dtype fp8)
            pool = self.pool.clone()
            for i, scale in enumerate(kv_scales or (1.0, 1.0)):
                pool[:, :, i] = to_pool_dtype(self.pool[:, :, i], kv_dtype, inv_scale(scale)).to(pool.dtype)
            self.pool = pool.to(kv_dtype)
        positions, slots = [], []
        for b, (q_len, seq_len) in enumerate(zip(q_lens, seq_lens, strict=True)):
            for j in range(q_len):
                pos = seq_len - q_len + j
                positions.append(pos)
                slots.append(int(self.block_tables[b, pos // block_size]) * block_size + pos % block_size)
        for t in padding_tokens:  # a token whose KV is not written (slot -1); attention reads the old pool
            slots[t] = -1
        self.positions = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
        self.slots = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
        width = (num_heads + 2 * num_kv_heads) * head_dim
        self.qkv = randn(len(positions), width + 8, dtype=dtype)[:, 4 : 4 + width]  # a strided row view
        self.q_norm = (1 + 0.3 * randn(head_dim)).to(dtype) if qk_norm else None
        self.k_norm = (1 + 0.3 * randn(head_dim)).to(dtype) if qk_norm else None
        self.cache = cos_sin_cache(head_dim, max(seq_lens) + 8, 1e4, None, device=DEVICE)
        self.block_size = block_size

    def args(self, pool: torch.Tensor) -> tuple:
        return (self.qkv, self.num_heads, self.num_kv_heads, self.head_dim, self.q_norm, self.k_norm, 1e-6,
                self.positions, self.cache, pool, LAYER, self.slots, self.block_tables, self.seq_lens, self.qsl,
                self.head_dim**-0.5)  # fmt: skip

    def written(self) -> torch.Tensor:
        mask = torch.zeros(self.pool.shape[:4], dtype=torch.bool, device=DEVICE)
        valid = self.slots[self.slots >= 0]
        mask[valid // self.block_size, LAYER, :, valid % self.block_size] = True
        return mask


@pytest.fixture
def prologue_launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Counts the separate prologue's launches from ``qkv_attention_triton`` (0 where it was folded in)."""
    calls: list[int] = []
    original = triton_attention.qkv_prologue_triton

    def counting(qkv: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(qkv.shape[0])
        return original(qkv, *args, **kwargs)

    monkeypatch.setattr(triton_attention, "qkv_prologue_triton", counting)
    yield calls


def check(case: Case) -> torch.Tensor:
    before = case.pool.clone()
    ref_pool, pool = case.pool.clone(), case.pool.clone()
    ref = qkv_attention_torch(*case.args(ref_pool), **case.kv_scales)
    out = TRITON_OPS.qkv_attention(*case.args(pool), **case.kv_scales)
    dtype = case.qkv.dtype
    assert out.dtype == dtype and out.shape == ref.shape
    assert_close(out, ref.float(), dtype, "attention output")
    written = case.written()
    assert torch.equal(pool[~written], before[~written]), "a slot not written changed"
    k_rows, v_rows = written.clone(), written.clone()
    k_rows[:, :, 1] = False
    v_rows[:, :, 0] = False
    k_dtype = torch.float8_e4m3fn if pool.dtype == torch.float8_e4m3fn else dtype
    assert_close(pool[k_rows], ref_pool[k_rows].float(), k_dtype, "pool k")
    assert torch.equal(pool[v_rows], ref_pool[v_rows]), "pool v"
    return out


# (num_heads, num_kv_heads, head_dim, block_size, dtype, qk_norm)
LAYOUTS = [
    (4, 2, 32, 4, torch.bfloat16, True),
    (8, 2, 64, 16, torch.float32, False),
    (4, 4, 16, 16, torch.float16, True),
    (8, 1, 32, 4, torch.bfloat16, False),
]


@pytest.mark.parametrize(
    "layout", LAYOUTS, ids=lambda p: f"h{p[0]}-kv{p[1]}-d{p[2]}-bs{p[3]}-{p[4]}-norm{p[5]}"
)
def test_decode_folds_the_prologue(
    layout: tuple, monkeypatch: pytest.MonkeyPatch, prologue_launches: list[int]
) -> None:
    """One new token per sequence, contexts of 1 to 300 tokens (64: the new token is the last key of a tile); with one split and with four (so the new
    token's position sits in a later split than the first, some splits are empty, and splits of
    old context run several tiles)."""
    heads, kv_heads, head_dim, block_size, dtype, qk_norm = layout
    for splits in (1, 4):
        torch.manual_seed(10 + splits)
        monkeypatch.setattr(triton_attention, "num_kv_splits", lambda *_a, s=splits: s)
        case = Case(
            [1] * 6, [1, 9, 33, 64, 70, 300], heads, kv_heads, head_dim, block_size, dtype, qk_norm=qk_norm
        )
        check(case)
    assert prologue_launches == []


@pytest.mark.parametrize("kv_scales", [None, (0.05, 3.0)], ids=["unscaled", "scaled"])
@pytest.mark.parametrize("splits", [1, 4])
def test_decode_folds_the_prologue_over_an_fp8_pool(
    splits: int,
    kv_scales: tuple[float, float] | None,
    monkeypatch: pytest.MonkeyPatch,
    prologue_launches: list[int],
) -> None:
    """kv_cache_dtype fp8: the folded prologue writes the new token's k and v as float8 e4m3 (divided by
    the layer's KV scales where it has some, clamped and rounded as the reference) and the split kernel
    reads old and new keys widened to q's dtype (times the scales)."""
    torch.manual_seed(30 + splits)
    monkeypatch.setattr(triton_attention, "num_kv_splits", lambda *_a: splits)
    case = Case([1] * 5, [1, 9, 64, 70, 300], 8, 2, 32, 4, torch.float32, qk_norm=True,
                kv_dtype=torch.float8_e4m3fn, kv_scales=kv_scales)  # fmt: skip
    check(case)
    assert prologue_launches == []


def test_prefill_over_an_fp8_pool_with_kv_scales(prologue_launches: list[int]) -> None:
    """A prefill over a cached float8 prefix with KV scales: the separate prologue writes k / k_scale and
    v / v_scale, and the extend kernel reads them back times the scales, as the reference."""
    torch.manual_seed(41)
    check(Case([5, 3], [5, 20], 4, 2, 32, 4, torch.bfloat16, qk_norm=True, kv_dtype=torch.float8_e4m3fn,
               kv_scales=(0.05, 3.0)))  # fmt: skip
    assert prologue_launches == [8]


def test_decode_shape_with_several_tokens_of_one_sequence(
    monkeypatch: pytest.MonkeyPatch, prologue_launches: list[int]
) -> None:
    """T <= B but one sequence brings two tokens and another none: each token's programs write the new
    tokens in their splits, so the second token sees the first one's k and v."""
    monkeypatch.setattr(triton_attention, "num_kv_splits", lambda *_a: 2)
    torch.manual_seed(20)
    check(Case([2, 0, 1], [40, 5, 17], 4, 2, 32, 4, torch.float32, qk_norm=True))
    assert prologue_launches == []


def test_padding_slot_writes_nothing(prologue_launches: list[int]) -> None:
    """A token with slot -1 writes no KV (its attention reads the pool as it was), as with the reference."""
    torch.manual_seed(30)
    check(Case([1] * 3, [5, 12, 20], 4, 2, 32, 4, torch.bfloat16, qk_norm=True, padding_tokens=(1,)))
    assert prologue_launches == []


def test_unfoldable_cases_run_the_prologue(prologue_launches: list[int]) -> None:
    """A head_dim that is not a power of two, and a prefill (more tokens than sequences): the separate
    prologue, then attention, with the same results."""
    torch.manual_seed(40)
    check(Case([1] * 2, [6, 13], 4, 2, 48, 4, torch.float32, qk_norm=True))
    check(Case([5, 3], [5, 20], 4, 2, 32, 4, torch.bfloat16, qk_norm=False))
    assert prologue_launches == [2, 8]


@gpu
@needs_cuda
@pytest.mark.parametrize(
    ("heads", "kv_heads", "qk_norm"), [(32, 8, False), (32, 4, True)], ids=["llama-3.1-8b", "qwen3-30b-a3b"]
)
@pytest.mark.parametrize("batch", [1, 64])
def test_gpu_decode_real_shapes(heads: int, kv_heads: int, qk_norm: bool, batch: int) -> None:
    torch.manual_seed(50)
    seq_lens = torch.randint(1, 1500, (batch,)).tolist()
    check(Case([1] * batch, seq_lens, heads, kv_heads, 128, 16, torch.bfloat16, qk_norm=qk_norm))
