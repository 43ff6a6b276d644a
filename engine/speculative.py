"""Speculative decoding by n-gram lookup (vLLM's ``--speculative-config '{"method": "ngram", ...}'``, prompt
lookup decoding): draft tokens come from the request's own context, no draft model.

For a decoding request, the last ``n`` tokens (``prompt_lookup_max`` down to ``prompt_lookup_min``) are
looked for earlier in its prompt and output; the ``num_speculative_tokens`` tokens that followed their
latest earlier occurrence are the draft. The engine (``LLMEngine._step_sync``) computes the request's last
token and the draft in one pass and samples every position of it as the request samples (the same
temperature, filters, seed and output position), then keeps the samples up to the first that differs
from the draft. A draft token is kept only where the sample equals it, so the output is the one decoding
token by token gives: for greedy and seeded requests the same tokens, for the others the same
distribution (with a one-token draft, accepting on equality is the optimal rejection rule); logprobs are
each position's, as plain decoding's. Requests with penalties or bad words of several tokens (each
position would need the output before it) and constrained ones are not drafted. Nothing here touches the
engine.

Method ``mtp`` (vLLM's ``{"method": "mtp"}``, also ``deepseek_mtp``): the draft is what a DeepSeek-V3
checkpoint's own multi-token-prediction layer predicts after the step that made a request's last token
known, with ``num_speculative_tokens`` K > 1 the layer run again on its own output for K tokens
(engine.models.mtp); it is verified the same way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


@dataclass(frozen=True)
class NgramSpec:
    num_tokens: int  # draft tokens a step at most
    lookup_max: int  # the longest context suffix looked up
    lookup_min: int  # the shortest


@dataclass(frozen=True)
class MtpSpec:
    num_tokens: int  # draft tokens a step: the checkpoint's first MTP layer, run again on its own output


MTP_METHODS = ("mtp", "deepseek_mtp")


def parse_speculative_config(text: str | None) -> NgramSpec | MtpSpec | None:
    """vLLM's JSON; the ``ngram`` and ``mtp`` (``deepseek_mtp``) methods are served (a draft model is
    refused). Whether the model has an MTP layer is the engine's check."""
    if not text:
        return None
    try:
        cfg = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"speculative_config must be JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise ValueError("speculative_config must be a JSON object")
    method = cfg.get("method")
    if method in MTP_METHODS:
        return _mtp_spec(cfg)
    if method != "ngram":
        raise ValueError(
            f"speculative_config method {method!r} is not served: 'ngram' (prompt lookup) and 'mtp' (a "
            "DeepSeek-V3 checkpoint's multi-token-prediction layer) are"
        )
    unknown = set(cfg) - {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"}
    if unknown:
        raise ValueError(f"speculative_config has keys this engine does not know: {sorted(unknown)}")
    k = cfg.get("num_speculative_tokens")
    hi = cfg.get("prompt_lookup_max", 4)
    lo = cfg.get("prompt_lookup_min", min(2, hi) if isinstance(hi, int) else 2)
    for name, value in (("num_speculative_tokens", k), ("prompt_lookup_max", hi), ("prompt_lookup_min", lo)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"speculative_config {name} must be a positive integer, got {value!r}")
    if lo > hi:
        raise ValueError(f"speculative_config prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
    return NgramSpec(k, hi, lo)


def _mtp_spec(cfg: dict) -> MtpSpec:
    unknown = set(cfg) - {"method", "num_speculative_tokens"}
    if unknown:
        raise ValueError(f"speculative_config method mtp has no keys {sorted(unknown)}")
    k = cfg.get("num_speculative_tokens", 1)
    if not isinstance(k, int) or isinstance(k, bool) or k < 1:
        raise ValueError(f"speculative_config num_speculative_tokens must be a positive integer, got {k!r}")
    return MtpSpec(k)


def propose(tokens: Sequence[int] | np.ndarray, spec: NgramSpec, limit: int) -> list[int]:
    """Up to ``limit`` (at most ``spec.num_tokens``) tokens that followed the latest earlier occurrence of
    the longest suffix of ``tokens`` (``lookup_max`` down to ``lookup_min`` long) found; none if none is."""
    limit = min(limit, spec.num_tokens)
    if limit <= 0 or len(tokens) < spec.lookup_min + 1:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(spec.lookup_max, len(arr) - 1), spec.lookup_min - 1, -1):
        windows = sliding_window_view(arr[:-1], n)  # every n-gram that ends before the last token
        hits = np.flatnonzero((windows == arr[-n:]).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n  # what followed the latest occurrence
            return arr[start : start + limit].tolist()
    return []
