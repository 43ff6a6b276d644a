"""The sampling race (temperature, top-k, top-p, min-p): the PyTorch reference of
``kernels/triton_sampling.py``, and the noise both use.

Sampling is an exponential race, ``argmax(probs / E)`` with ``E ~ Exponential(1)`` per token. The noise is
a counter-based hash of (row key, token id), exact integer arithmetic on any device, so a row's draw
depends on its key alone (``engine/sampler.py`` makes the keys and picks the rows). Top-k and top-p sort
the vocabulary here; the Triton kernel finds the same kept set without a sort.
"""

from __future__ import annotations

import torch


def _signed64(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


_GOLDEN = _signed64(0x9E3779B97F4A7C15)
_MIX1 = _signed64(0xBF58476D1CE4E5B9)
_MIX2 = _signed64(0x94D049BB133111EB)


def _shr(z: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's >> is arithmetic)."""
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def exponential_noise(row_keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """[B, vocab] float32 Exponential(1) noise: splitmix64 of (key * golden + token id), int64 arithmetic
    wrapping mod 2**64 (the same on every device), 24 bits to a uniform in (0, 1), then -log."""
    ids = torch.arange(vocab, device=row_keys.device, dtype=torch.int64)
    z = row_keys.unsqueeze(1) * _GOLDEN + ids.unsqueeze(0)
    z = z + _GOLDEN
    z = (z ^ _shr(z, 30)) * _MIX1
    z = (z ^ _shr(z, 27)) * _MIX2
    z = z ^ _shr(z, 31)
    u = _shr(z, 40).to(torch.float32).add_(0.5).mul_(2.0**-24)
    return u.log_().neg_()


def min_p_filter(probs: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """Probabilities [B, V] with the tokens below ``min_p * p_max`` of their row set to 0 (``min_p`` [B];
    None: unchanged)."""
    if min_p is None:
        return probs
    return probs.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, 0.0)


def race(probs: torch.Tensor, row_keys: torch.Tensor, min_p: torch.Tensor | None) -> torch.Tensor:
    """The race over probabilities [B, V] (any positive scale per row; dropped tokens 0): ``min_p_filter``,
    then ``argmax(probs / E)``. Every torch sampling path ends here (``engine/sampler.py`` filters top-k
    and top-p before)."""
    probs = min_p_filter(probs, min_p)
    return (probs / exponential_noise(row_keys, probs.shape[1])).argmax(dim=-1)


def top_k_top_p_probs(
    scaled: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Softmax of the temperature-scaled logits [B, V] with each row's top-k, then top-p applied (dropped
    tokens get probability 0), as vLLM and SGLang apply them. ``top_k`` [B] integer (the vocabulary size
    where off) and ``top_p`` [B] in (0, 1] (1 where off), or None for no row. The vocabulary is sorted once:
    top-k reads its k-th value and top-p its cumulative mass from the same descending order (softmax keeps
    the logits' order). A token tied with the k-th value is kept."""
    sorted_vals, order = scaled.sort(dim=-1, descending=True)
    if top_k is not None:
        kth = sorted_vals.gather(1, top_k.long().unsqueeze(1) - 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p is not None:
        sorted_probs = probs.gather(1, order)
        # Keep the smallest set whose mass reaches top-p. Rows with top-p off drop nothing: in float32 the
        # running mass of a large vocabulary can reach 1 before its tail (10% of 128k random logits did).
        top_p = top_p.unsqueeze(1)
        drop_sorted = ((sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p) & (top_p < 1.0)
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), 0.0)
    return probs


def gumbel_sample_torch(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    row_keys: torch.Tensor,
    min_p: torch.Tensor | None,
    top_k: torch.Tensor | None = None,
    top_p: torch.Tensor | None = None,
    *,
    smallest_top_k: int | None = None,
) -> torch.Tensor:
    """logits [B, V] fp32; temperatures [B] > 0; row_keys [B] int64; min_p [B] in [0, 1] or None; top_k
    [B] (the vocabulary size where off) or None; top_p [B] (1 where off) or None. Returns the sampled token
    ids, [B] int64: ``race`` over ``softmax(logits / T)``, filtered by ``top_k_top_p_probs`` when either is
    given (a sort of the vocabulary). ``smallest_top_k``: the Triton op's hint (the smallest top-k of the
    rows, from the host), unused here."""
    del smallest_top_k
    scaled = logits / temperatures.unsqueeze(1)
    if top_k is None and top_p is None:
        return race(torch.softmax(scaled, dim=-1), row_keys, min_p)
    return race(top_k_top_p_probs(scaled, top_k, top_p), row_keys, min_p)
