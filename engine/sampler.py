"""Sampling from logits: greedy, temperature, top-k, top-p, min-p, per-request seeds, top-N logprobs.

Sampling is an exponential race, argmax(probs / E) with E ~ Exponential(1) per token. The noise comes
from a counter-based hash of (row key, token id), computed in one vectorised pass on the logits' device;
a seeded request's row key is a hash of (seed, output position) alone, so its tokens do not depend on
what else is in the batch, nor on which worker or device samples which position (the prefill worker
samples position 0, the decode worker the rest): the integer hash is exact everywhere. Unseeded rows take
their keys from the sampler's own generator. With the Triton backend on a GPU, rows without top-k or
top-p take the one-pass Gumbel-max kernel of ``kernels/triton_sampling.py`` (same race, same hash). (Drawing the noise from a CPU generator per row, as an
earlier version did, cost a host-side draw of batch x vocab values and a copy to the GPU every step:
32 MB at batch 64 with a 128k vocabulary.)
"""

from __future__ import annotations

import torch
import xxhash

from engine.device_copy import host_to_device
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs


def _position_seed(seed: int, position: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{seed}:{position}".encode()) & ((1 << 63) - 1)


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


class Sampler:
    def __init__(self, seed: int = 0, kernel_backend: str = "torch") -> None:
        self._unseeded = torch.Generator().manual_seed(seed)
        self._gumbel_sample = None
        if kernel_backend == "triton":  # one-pass temperature sampling on GPUs (kernels/triton_sampling.py)
            from kernels.triton_sampling import gumbel_sample_triton

            self._gumbel_sample = gumbel_sample_triton

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        non_blocking: bool = False,
    ) -> torch.Tensor:
        """The sampled token ids [B] (int64), left on the logits' device. With ``non_blocking`` the
        per-row values go to a GPU through pinned memory, so the host does not wait for the device work
        queued before (asynchronous scheduling launches the next step meanwhile)."""
        batch, vocab = logits.shape
        device = logits.device
        tokens = logits.argmax(dim=-1)
        if not all(p.greedy for p in params):  # decided on the host: no device round trip for greedy batches
            unseeded = torch.randint(0, 1 << 62, (batch,), generator=self._unseeded).tolist()
            keys = [
                _position_seed(p.seed, pos) if p.seed is not None else key
                for p, pos, key in zip(params, positions, unseeded, strict=True)
            ]
            # Per-row values in two host-to-device copies (a pageable copy waits for the queued device work).
            rows = host_to_device(_row_values(params, vocab), device, non_blocking)
            temps, greedy, min_p_rows = rows[:, 0], rows[:, 1] > 0, rows[:, 2]
            row_keys = host_to_device(torch.tensor(keys, dtype=torch.int64), device, non_blocking)
            needs_sort = any(p.top_k > 0 or p.top_p < 1.0 for p in params)
            if self._gumbel_sample is not None and logits.is_cuda and not needs_sort:
                has_min_p = any(p.min_p > 0 for p in params)
                sampled = self._gumbel_sample(logits, temps, row_keys, min_p_rows if has_min_p else None)
            else:
                probs = _filtered_probs(logits / temps.unsqueeze(1), params, rows)
                sampled = (probs / exponential_noise(row_keys, vocab)).argmax(dim=-1)
            tokens = torch.where(greedy, tokens, sampled)
        return tokens

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [B, V] fp32; positions: each request's output index of the token being sampled."""
        batch = logits.shape[0]
        device = logits.device
        tokens = self.sample(logits, params, positions)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * batch
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:  # one transfer of each result to the host, not one per row
            rows = torch.tensor(want, device=device)
            lp = torch.log_softmax(logits[rows], dim=-1)
            chosen = lp.gather(1, tokens[rows].unsqueeze(1)).squeeze(1).tolist()
            top_n = max(params[i].logprobs or 0 for i in want)
            top_v, top_i = lp.topk(top_n, dim=-1)
            top_v_rows, top_i_rows = top_v.tolist(), top_i.tolist()
            for row, i in enumerate(want):
                n = params[i].logprobs or 0
                top = list(zip(top_i_rows[row][:n], top_v_rows[row][:n], strict=True))
                logprobs[i] = TokenLogprobs(token_list[i], chosen[row], top)
        return token_list, logprobs


def _row_values(params: list[SamplingParams], vocab: int) -> torch.Tensor:
    """Per-row sampling values, one host tensor [B, 5] float32 (one copy to the device): temperature (1
    for greedy rows), greedy flag, min-p, top-p, top-k (the vocabulary size when off; exact in float32)."""
    return torch.tensor(
        [
            (
                p.temperature if p.temperature > 0 else 1.0,
                float(p.greedy),
                p.min_p,
                p.top_p,
                min(p.top_k, vocab) if p.top_k > 0 else vocab,
            )
            for p in params
        ],
        dtype=torch.float32,
    )


def _filtered_probs(scaled: torch.Tensor, params: list[SamplingParams], rows: torch.Tensor) -> torch.Tensor:
    """Softmax of the temperature-scaled logits with each row's top-k, top-p and min-p applied (dropped
    tokens get probability 0); ``rows`` is ``_row_values`` on the logits' device. The vocabulary is sorted
    at most once per batch: top-k reads its k-th value and top-p its cumulative mass from the same
    descending order (softmax keeps the logits' order). Which filters run is decided from ``params`` on
    the host; their per-row values come from ``rows``, so nothing here copies from host memory."""
    need_k = any(p.top_k > 0 for p in params)
    need_p = any(p.top_p < 1.0 for p in params)
    order = None
    if need_k or need_p:
        sorted_vals, order = scaled.sort(dim=-1, descending=True)
    if need_k:
        kth = sorted_vals.gather(1, rows[:, 4:5].long() - 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if need_p:
        assert order is not None
        sorted_probs = probs.gather(1, order)
        # Keep the smallest set whose mass reaches top-p.
        drop_sorted = (sorted_probs.cumsum(dim=-1) - sorted_probs) >= rows[:, 3:4]
        probs = probs.masked_fill(torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted), 0.0)
    if any(p.min_p > 0 for p in params):
        probs = probs.masked_fill(probs < rows[:, 2:3] * probs.max(dim=-1, keepdim=True).values, 0.0)
    return probs
