"""What a request does to its logits before sampling, in vLLM's order and by its rules: allowed tokens,
bad words, logit bias, the minimum length, then penalties.

``allowed_token_ids`` sets every other token's logit to -inf. ``bad_words`` (their token ids) set to -inf
the last token of each word whose other tokens end the output so far (a one-token word always).
``logit_bias`` adds each listed token's bias to its logit (OpenAI's). ``min_tokens`` sets the logits of the end-of-sequence tokens (unless
``ignore_eos``) and of ``stop_token_ids`` to -inf while fewer tokens than that have been generated. Then,
for each row with a penalty, over the vocabulary: the repetition penalty r divides the positive logits and
multiplies the negative ones of every token seen in the prompt or the output so far (transformers'
``RepetitionPenaltyLogitsProcessor``); then the frequency penalty subtracts f times each token's count in
the output, and the presence penalty p once for each token the output holds. Rows without any of these
are not touched, and nothing is computed for a batch without any. The sampler's logprobs stay those of
the raw logits (vLLM's default). A penalised row needs its whole output so far, so the engine runs steps
with such a request synchronously (``SamplingParams.needs_host_step``); the others need only the request
and the row's output position, which the host knows also for a step run ahead.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from engine.device_copy import host_to_device
from engine.sampling_params import SamplingParams


def process_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None,
    positions: Sequence[int] = (),
    eos_token_ids: Collection[int] = (),
) -> torch.Tensor:
    """The logits each row samples from (a new tensor), or ``logits`` itself when no row asks for any
    processing. ``histories``: as ``apply_penalties``; ``positions``: each row's output index of the token
    being sampled (needed for ``min_tokens``); ``eos_token_ids``: the model's end-of-sequence tokens."""
    if not any(p.processes_logits for p in params):  # one pass over the batch, every step: keep it cheap
        return logits
    logits = apply_allowed_token_ids(logits, params)
    logits = apply_bad_words(logits, params, histories)
    logits = apply_logit_bias(logits, params)
    logits = apply_min_tokens(logits, params, positions, eos_token_ids)
    return apply_penalties(logits, params, histories)


def apply_allowed_token_ids(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` with -inf outside each row's ``allowed_token_ids`` (a new tensor), or ``logits`` itself
    when no row restricts its tokens."""
    entries = [
        (r, t) for r, p in enumerate(params) if p.allowed_token_ids is not None for t in p.allowed_token_ids
    ]
    if not entries:
        return logits
    rows = sorted({r for r, _ in entries})
    index = host_to_device(torch.tensor(entries, dtype=torch.int64), logits.device)
    keep = torch.zeros_like(logits, dtype=torch.bool)
    keep.index_put_((index[:, 0], index[:, 1]), keep.new_ones(()))  # a device value: no copy, no wait
    restricted = torch.zeros(logits.shape[0], dtype=torch.bool)
    restricted[rows] = True
    keep |= ~host_to_device(restricted, logits.device)[:, None]  # unrestricted rows keep every token
    return logits.masked_fill(~keep, float("-inf"))


def apply_bad_words(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None,
) -> torch.Tensor:
    """``logits`` with -inf on each row's banned tokens (a new tensor), or ``logits`` itself when no row
    bans one: a bad word's last token where the row's output ends with the word's other tokens (vLLM's
    rule: the output only, not the prompt)."""
    entries = []
    for r, p in enumerate(params):
        for ids in p.bad_words_token_ids:
            if len(ids) > 1:
                if histories is None:
                    raise ValueError("bad words of several tokens need each row's output token ids")
                output = histories[r][1]
                if len(output) < len(ids) - 1 or list(output[len(output) - len(ids) + 1 :]) != ids[:-1]:
                    continue
            entries.append((r, ids[-1]))
    if not entries:
        return logits
    index = host_to_device(torch.tensor(entries, dtype=torch.int64), logits.device)
    out = logits.clone()
    out.index_put_((index[:, 0], index[:, 1]), out.new_full((), float("-inf")))
    return out


def apply_min_tokens(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    positions: Sequence[int],
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """``logits`` with -inf at the stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) of each
    row whose output has fewer than ``min_tokens`` tokens (a new tensor), or ``logits`` itself when none."""
    entries = []
    for row, p in enumerate(params):
        if p.min_tokens and positions[row] < p.min_tokens:
            stops = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            entries += [(row, t) for t in sorted(stops)]
    if not entries:
        return logits
    index = host_to_device(torch.tensor(entries, dtype=torch.int64), logits.device)
    return logits.index_put((index[:, 0], index[:, 1]), logits.new_full((), float("-inf")))


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits`` with each row's ``logit_bias`` added (a new tensor), or ``logits`` itself when no row
    has one."""
    entries = [(row, token, bias) for row, p in enumerate(params) for token, bias in p.logit_bias.items()]
    if not entries:
        return logits
    device = logits.device
    index = host_to_device(torch.tensor([(r, t) for r, t, _ in entries], dtype=torch.int64), device)
    values = host_to_device(torch.tensor([b for _, _, b in entries], dtype=logits.dtype), device)
    return logits.index_put((index[:, 0], index[:, 1]), values, accumulate=True)


def apply_penalties(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[tuple[Sequence[int], Sequence[int]]] | None,
) -> torch.Tensor:
    """``logits`` [B, V] with each penalised row's penalties applied (a new tensor), or ``logits`` itself
    when no row has one. ``histories``: each row's (prompt token ids, output token ids so far)."""
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if not rows:
        return logits
    if histories is None:
        raise ValueError("penalties need each row's prompt and output token ids")
    batch, vocab = logits.shape
    device = logits.device
    # One host tensor of every penalised row's ids, padded with `vocab` (a column dropped below), and
    # the rows' three penalties: two copies to the device.
    prompts = [list(histories[i][0]) for i in rows]
    outputs = [list(histories[i][1]) for i in rows]
    width = max(1, *(len(p) for p in prompts), *(len(o) for o in outputs))
    ids = torch.full((len(rows), 2, width), vocab, dtype=torch.int64)
    for r, (p, o) in enumerate(zip(prompts, outputs, strict=True)):
        ids[r, 0, : len(p)] = torch.tensor(p, dtype=torch.int64)
        ids[r, 1, : len(o)] = torch.tensor(o, dtype=torch.int64)
    values = torch.tensor(
        [
            (params[i].repetition_penalty, params[i].frequency_penalty, params[i].presence_penalty)
            for i in rows
        ],
        dtype=torch.float32,
    )
    ids, values = host_to_device(ids, device), host_to_device(values, device)
    ones = torch.ones(ids.shape[1:], dtype=torch.float32, device=device).expand(len(rows), -1, -1)
    counts = torch.zeros((len(rows), 2, vocab + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(2, ids, ones)
    output_counts = counts[:, 1, :vocab]
    seen = (counts[:, 0, :vocab] + output_counts) > 0
    index = host_to_device(torch.tensor(rows, dtype=torch.int64), device) if len(rows) < batch else None
    x = logits.float() if index is None else logits[index].float()
    rep = values[:, 0:1]
    x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    x = x - values[:, 1:2] * output_counts - values[:, 2:3] * (output_counts > 0).to(x.dtype)
    if index is None:
        return x.to(logits.dtype)
    out = logits.clone()
    out.index_copy_(0, index, x.to(logits.dtype))
    return out
