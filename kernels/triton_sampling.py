"""Temperature sampling in one pass over the logits: the Gumbel-max form of ``kernels/sampling.py``'s race.

The sampler draws ``argmax(probs / E)`` with ``E ~ Exponential(1)`` from a counter-based hash of (row key,
token id). Since ``probs = softmax(logits / T)``, that is ``argmax(logits / T - log E)``: no softmax, no
[B, V] intermediates, one read of the logits. One program per row streams its logits in ``BLOCK_V``
chunks, computes the same splitmix64 hash as ``kernels.sampling.exponential_noise`` (uint64 arithmetic),
applies min-p (a token survives when ``(l - l_max) / T >= log(min_p)``, i.e. ``p >= min_p * p_max``;
that takes a first pass for the row's max), and keeps the running argmax (the first index wins a tie).
Top-k and top-p need a sort and stay on the torch path. On an H200 at a 128k vocabulary the torch path
costs 1.25 ms per step at batch 64 (``benchmarks/sampler_bench.py``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _gumbel_sample_kernel(
    logits_ptr,
    inv_temp_ptr,
    keys_ptr,
    log_min_p_ptr,
    out_ptr,
    vocab,
    stride_row,
    HAS_MIN_P: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride_row
    inv_t = tl.load(inv_temp_ptr + row)
    key = tl.load(keys_ptr + row).to(tl.uint64)
    offs = tl.arange(0, BLOCK_V)
    row_max = 0.0
    log_min_p = 0.0
    if HAS_MIN_P:
        log_min_p = tl.load(log_min_p_ptr + row)
        m = tl.full([BLOCK_V], float("-inf"), tl.float32)
        for v0 in range(0, vocab, BLOCK_V):
            m = tl.maximum(m, tl.load(base + v0 + offs, mask=v0 + offs < vocab, other=float("-inf")))
        row_max = tl.max(m, axis=0)
    best_score = float("-inf")
    best_index = 0
    seed = key * 0x9E3779B97F4A7C15
    for v0 in range(0, vocab, BLOCK_V):
        ids = v0 + offs
        valid = ids < vocab
        logit = tl.load(base + ids, mask=valid, other=float("-inf"))
        z = seed + ids.to(tl.uint64) + 0x9E3779B97F4A7C15
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
        z = (z ^ (z >> 27)) * 0x94D049BB133111EB
        z = z ^ (z >> 31)
        u = ((z >> 40).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        score = logit * inv_t - tl.log(-tl.log(u))
        keep = valid
        if HAS_MIN_P:
            keep = keep & ((logit - row_max) * inv_t >= log_min_p)
        score = tl.where(keep, score, float("-inf"))
        chunk_best = tl.max(score, axis=0)
        chunk_index = tl.argmax(score, axis=0) + v0
        better = chunk_best > best_score
        best_index = tl.where(better, chunk_index, best_index)
        best_score = tl.where(better, chunk_best, best_score)
    tl.store(out_ptr + row, best_index)


def interpreted() -> bool:
    """Whether the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1`` when this module was
    imported), which takes CPU tensors; compiled, it takes GPU tensors only."""
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_gumbel_sample_kernel, InterpretedFunction)


def gumbel_sample_triton(
    logits: torch.Tensor, temperatures: torch.Tensor, row_keys: torch.Tensor, min_p: torch.Tensor | None
) -> torch.Tensor:
    """logits [B, V] fp32 (last dim contiguous); temperatures [B] > 0; row_keys [B] int64 (the sampler's
    per-row keys); min_p [B] in [0, 1] or None. Returns the sampled token ids, [B] int64."""
    batch, vocab = logits.shape
    out = torch.empty(batch, dtype=torch.int64, device=logits.device)
    if batch == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    inv_temp = (1.0 / temperatures.to(torch.float32)).contiguous()
    log_min_p = torch.log(min_p.to(torch.float32)).contiguous() if min_p is not None else inv_temp
    _gumbel_sample_kernel[(batch,)](
        logits, inv_temp, row_keys.contiguous(), log_min_p, out, vocab, logits.stride(0),
        HAS_MIN_P=min_p is not None, BLOCK_V=4096 if logits.is_cuda else 64,
        num_warps=8 if logits.is_cuda else 1,
    )  # fmt: skip
    return out
