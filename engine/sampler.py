"""Sampling from logits: greedy, temperature, top-k, top-p, min-p, allowed tokens, logit bias, a minimum
length and penalties, per-request seeds, top-N logprobs.

Sampling is an exponential race, argmax(probs / E) with E ~ Exponential(1) per token. The noise comes
from a counter-based hash of (row key, token id), computed in one vectorised pass on the logits' device;
a seeded request's row key is a hash of (seed, output position) alone, so its tokens do not depend on
what else is in the batch, nor on which worker or device samples which position (the prefill worker
samples position 0, the decode worker the rest): the integer hash is exact everywhere. Unseeded rows take
their keys from the sampler's own generator. Rows race through the op table's ``gumbel_sample``: with
the Triton backend on a GPU, the kernel of ``kernels/triton_sampling.py`` (same race, same hash; top-k and
top-p without a sort) takes every sampling row; elsewhere ``kernels/sampling.py``'s torch race, which sorts
the vocabulary for top-k and top-p, so only the rows that need it take that sort. The path is chosen per
row, from that row's own parameters and device: the kernel and the torch race agree only up to float
rounding (at near-ties, at the min-p and top-p boundaries), so a batch-wide choice would let a row's
batch-mates change its token. (Drawing the noise
from a CPU generator per row, as an earlier version did, cost a host-side draw of batch x vocab values
and a copy to the GPU every step: 32 MB at batch 64 with a 128k vocabulary.)
"""

from __future__ import annotations

from collections.abc import Collection

import torch
import xxhash

from engine.device_copy import host_to_device
from engine.logits_processors import process_logits
from engine.sampling_params import SamplingParams
from engine.sequence import TokenLogprobs
from kernels.ops import TORCH_OPS, get_ops


def _position_seed(seed: int, position: int) -> int:
    return xxhash.xxh3_64_intdigest(f"{seed}:{position}".encode()) & ((1 << 63) - 1)


class Sampler:
    def __init__(self, seed: int = 0, kernel_backend: str = "torch", *, kernel_on_cpu: bool = False) -> None:
        """Sampling rows race through the op table's ``gumbel_sample`` of ``kernel_backend``
        (``kernels.ops.get_ops``, which rejects unknown names): the Triton table's is a kernel, which needs
        GPU logits, so on CPU logits the rows take the torch table's race.
        ``kernel_on_cpu``: with the Triton backend, rows on the CPU take the kernel too, which works only
        under the Triton interpreter (``TRITON_INTERPRET=1`` before triton is imported): for tests of the
        per-row path choice."""
        self._unseeded = torch.Generator().manual_seed(seed)
        ops = get_ops(kernel_backend)
        self._gumbel_sample = ops.gumbel_sample
        self._compiled = ops is not TORCH_OPS
        self._kernel_devices = ("cuda",)
        if kernel_on_cpu:
            if not self._compiled:
                raise ValueError("kernel_on_cpu needs kernel_backend='triton'")
            from kernels.triton_sampling import interpreted

            if not interpreted():
                raise ValueError("kernel_on_cpu needs TRITON_INTERPRET=1 set before triton is imported")
            self._kernel_devices = ("cuda", "cpu")

    def uses_kernel(self, device: torch.device) -> bool:
        """Whether sampling rows whose logits are on ``device`` take the Triton kernel."""
        return self._compiled and device.type in self._kernel_devices

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: list[tuple[list[int], list[int]]] | None = None,
        eos_token_ids: Collection[int] = (),
    ) -> torch.Tensor:
        """The sampled token ids [B] (int64), left on the logits' device. The per-row values go to a GPU
        through pinned memory (``host_to_device``), so the host does not wait for the device work queued
        before (asynchronous scheduling launches the next step meanwhile).

        Each row's path follows from its own parameters and the device, decided on the host: greedy rows
        take the argmax; where ``uses_kernel``, every other row the op table's kernel (top-k and top-p
        without a sort); elsewhere rows with top-k or top-p take the torch race with a sort (on those rows
        only) and the others the torch race without one. Rows with allowed tokens, a logit bias, a minimum
        length or penalties sample from their processed logits (``engine.logits_processors``); penalties
        need ``histories`` (each row's prompt and output token ids), a minimum length ``eos_token_ids``."""
        logits = process_logits(logits, params, histories, positions, eos_token_ids)
        batch, vocab = logits.shape
        device = logits.device
        if all(p.greedy for p in params):  # decided on the host: no device round trip for greedy batches
            return logits.argmax(dim=-1)
        racing = [i for i, p in enumerate(params) if not p.greedy]
        # The greedy rows' tokens, where there are any (the sampling rows' are written below).
        tokens = (
            logits.argmax(dim=-1)
            if len(racing) < batch
            else torch.empty(batch, dtype=torch.int64, device=device)
        )
        sorting = [i for i in racing if params[i].top_k > 0 or params[i].top_p < 1.0]
        plain = [i for i in racing if params[i].top_k <= 0 and params[i].top_p >= 1.0]
        # Only unseeded sampling rows draw from the generator: seeded rows (the engine's warm-up samples
        # with a seed) leave the unseeded requests' keys as they were.
        n_unseeded = sum(p.seed is None for p in params if not p.greedy)
        unseeded = iter(torch.randint(0, 1 << 62, (n_unseeded,), generator=self._unseeded).tolist())
        keys = [
            0 if p.greedy else (_position_seed(p.seed, pos) if p.seed is not None else next(unseeded))
            for p, pos in zip(params, positions, strict=True)
        ]
        # Two host-to-device copies: the per-row values, and the row keys followed by each path's rows.
        rows = host_to_device(_row_values(params, vocab), device)
        ints = host_to_device(torch.tensor(keys + plain + sorting, dtype=torch.int64), device)
        row_keys = ints[:batch]
        if self.uses_kernel(device):
            # The kernel reads each row in a few passes, without a sort, so it runs on the whole batch
            # rather than on a gathered copy of the sampling rows; only their tokens are kept.
            racing_index = None if len(racing) == batch else ints[batch:]
            min_p = rows[:, 1] if any(params[i].min_p > 0 for i in racing) else None
            # The kernel takes top-k and top-p together (the off values: vocabulary size, 1); without a
            # top-k row it is given no top-k, so it sets no scratch aside for the select and takes the
            # variant without the chunks' own top k, which it also takes where the smallest top-k is large.
            top_p = rows[:, 2] if sorting else None
            top_ks = [params[i].top_k for i in sorting if params[i].top_k > 0]
            top_k = rows[:, 3] if top_ks else None
            drawn = self._gumbel_sample(
                logits, rows[:, 0], row_keys, min_p, top_k, top_p, smallest_top_k=min(top_ks, default=None)
            )
            return _put(tokens, racing_index, drawn if racing_index is None else drawn[racing_index])
        if plain:
            index = None if len(plain) == batch else ints[batch : batch + len(plain)]
            tokens = _put(
                tokens, index, _torch_race(logits, [params[i] for i in plain], rows, row_keys, index)
            )
        if sorting:
            index = None if len(sorting) == batch else ints[batch + len(plain) :]
            tokens = _put(
                tokens, index, _torch_race(logits, [params[i] for i in sorting], rows, row_keys, index)
            )
        return tokens

    def __call__(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        positions: list[int],
        histories: list[tuple[list[int], list[int]]] | None = None,
        eos_token_ids: Collection[int] = (),
    ) -> tuple[list[int], list[TokenLogprobs | None]]:
        """logits: [B, V] fp32; positions: each request's output index of the token being sampled;
        histories: each row's prompt and output token ids (needed where a row has penalties). Logprobs
        are those of the raw logits, before penalties and temperature (vLLM's default)."""
        batch = logits.shape[0]
        device = logits.device
        tokens = self.sample(logits, params, positions, histories, eos_token_ids)
        token_list = tokens.tolist()
        logprobs: list[TokenLogprobs | None] = [None] * batch
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:  # one transfer of each result to the host, not one per row
            rows = torch.tensor(want, device=device)
            found = token_logprobs(logits[rows], tokens[rows], [params[i].logprobs or 0 for i in want])
            for i, lp in zip(want, found, strict=True):
                logprobs[i] = lp
        return token_list, logprobs


def _row_values(params: list[SamplingParams], vocab: int) -> torch.Tensor:
    """Per-row sampling values, one host tensor [B, 4] float32 (one copy to the device): temperature (1
    for greedy rows), min-p, top-p, top-k (the vocabulary size when off; exact in float32)."""
    return torch.tensor(
        [
            (
                p.temperature if p.temperature > 0 else 1.0,
                p.min_p,
                p.top_p,
                min(p.top_k, vocab) if p.top_k > 0 else vocab,
            )
            for p in params
        ],
        dtype=torch.float32,
    )


def _put(tokens: torch.Tensor, index: torch.Tensor | None, values: torch.Tensor) -> torch.Tensor:
    """``tokens`` with rows ``index`` (a device tensor; None: every row) set to ``values``."""
    return values if index is None else tokens.index_copy_(0, index, values)


def _torch_race(
    logits: torch.Tensor,
    params: list[SamplingParams],
    rows: torch.Tensor,
    row_keys: torch.Tensor,
    index: torch.Tensor | None,
) -> torch.Tensor:
    """The torch race (``TORCH_OPS.gumbel_sample``) of the rows ``index`` (None: every row), whose
    parameters are ``params``; ``rows`` and ``row_keys`` are the whole batch's, on the logits' device. Which
    filters run is decided from ``params`` on the host (top-k and top-p sort the vocabulary); their per-row
    values come from ``rows``, so nothing here copies from host memory."""
    if index is not None:
        logits, rows, row_keys = logits[index], rows[index], row_keys[index]
    min_p = rows[:, 1] if any(p.min_p > 0 for p in params) else None
    top_k = rows[:, 3] if any(p.top_k > 0 for p in params) else None
    top_p = rows[:, 2] if any(p.top_p < 1.0 for p in params) else None
    return TORCH_OPS.gumbel_sample(logits, rows[:, 0], row_keys, min_p, top_k, top_p)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, top_ns: list[int]) -> list[TokenLogprobs]:
    """Row i's logprob of ``token_ids[i]``, its rank (1 = most likely; ties rank together) and the row's
    ``top_ns[i]`` most likely tokens, from raw logits [n, V]. One transfer to the host for all of it (in
    float64, which holds float32 values, ranks and token ids exactly). Sampled tokens' logprobs (the
    sampler) and prompt logprobs (``ModelRunner.execute``) both come here."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = token_ids.view(-1, 1)
    chosen = lp.gather(1, ids)
    rank = (lp > chosen).sum(dim=1, keepdim=True) + 1
    top_v, top_i = lp.topk(max(top_ns, default=0), dim=-1)
    rows = torch.cat([t.double() for t in (ids, chosen, rank, top_v, top_i)], dim=1).tolist()
    k = top_v.shape[1]
    return [
        TokenLogprobs(
            int(row[0]),
            row[1],
            [(int(t), v) for t, v in zip(row[3 + k : 3 + k + n], row[3 : 3 + n], strict=True)],
            int(row[2]),
        )
        for row, n in zip(rows, top_ns, strict=True)
    ]
