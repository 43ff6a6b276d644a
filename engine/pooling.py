"""Embeddings: a request that computes its prompt and, instead of sampling, returns the model's last hidden
states (after the final norm) pooled over the prompt: vLLM's pooling runner (``LLM.embed``, the OpenAI
``/v1/embeddings`` API) for decoder models such as Qwen3-Embedding or gte-Qwen2.

Pooling types, as sentence-transformers' ``Pooling`` module names them: ``last`` (the last prompt token's
state: decoder embedding models), ``mean`` (the mean over every prompt token) and ``cls`` (the first
token's). A checkpoint's own choice is read from its sentence-transformers files (``modules.json`` and the
``Pooling`` module's ``config.json``), else ``last``. The pooled vector is float32, optionally cut to its
first ``dimensions`` values (Matryoshka models only), then L2-normalised unless ``normalize`` is off.

``mean`` and ``cls`` need every prompt token's state, so such a request never takes its prompt from the
prefix cache; ``last`` does (the last token is always computed). A request's prompt may span several steps
(chunked prefill): ``mean`` keeps a running sum on the sequence, reset if it is preempted and recomputed.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.sequence import Sequence

log = logging.getLogger(__name__)

POOLING_TYPES = ("last", "mean", "cls")
# sentence-transformers' Pooling config keys, by our name.
_ST_MODES = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


@dataclass(frozen=True)
class PoolingParams:
    """What an embedding request asks for; None fields take the model's defaults (``ModelPooling``)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None

    def validate(self) -> None:
        if self.pooling_type is not None and self.pooling_type not in POOLING_TYPES:
            raise InvalidRequestError(
                f"pooling_type must be one of {', '.join(POOLING_TYPES)}, not {self.pooling_type!r}"
            )
        if self.dimensions is not None and self.dimensions < 1:
            raise InvalidRequestError(f"dimensions must be at least 1, got {self.dimensions}")


@dataclass(frozen=True)
class ModelPooling:
    """A model's pooling defaults and what it allows: read from its checkpoint (``of``)."""

    pooling_type: str = "last"
    normalize: bool = True
    hidden_size: int = 0
    # Matryoshka models (config.json's ``is_matryoshka`` or ``matryoshka_dimensions``): the sizes an
    # embedding may be cut to (None: any up to hidden_size); a model that is not one refuses ``dimensions``.
    matryoshka: bool = False
    matryoshka_dimensions: tuple[int, ...] | None = None

    @classmethod
    def of(cls, path: Path | None, hidden_size: int) -> ModelPooling:
        if path is None:
            return cls(hidden_size=hidden_size)
        pooling, normalize = "last", True
        modules_file = path / "modules.json"
        if modules_file.is_file():
            modules = json.loads(modules_file.read_text())
            for module in modules:
                kind = str(module.get("type", ""))
                if kind.endswith("Pooling"):
                    config = path / module.get("path", "") / "config.json"
                    if config.is_file():
                        settings = json.loads(config.read_text())
                        chosen = [name for name, key in _ST_MODES.items() if settings.get(key)]
                        others = [k for k, v in settings.items() if k.startswith("pooling_mode_") and v]
                        if len(chosen) == 1 and len(others) == 1:
                            pooling = chosen[0]
                        elif others:
                            log.warning(
                                "%s: pooling %s is not supported; pooling by the last token", path, others
                            )
            normalize = any(str(m.get("type", "")).endswith("Normalize") for m in modules)
        config = json.loads((path / "config.json").read_text()) if (path / "config.json").is_file() else {}
        dims = config.get("matryoshka_dimensions")
        return cls(
            pooling_type=pooling,
            normalize=normalize,
            hidden_size=hidden_size,
            matryoshka=bool(config.get("is_matryoshka") or dims),
            matryoshka_dimensions=tuple(int(d) for d in dims) if dims else None,
        )

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """``params`` with every None filled in from the model, checked against it."""
        params.validate()
        dims = params.dimensions
        if dims is not None and dims != self.hidden_size:
            if not self.matryoshka:
                raise InvalidRequestError(
                    f"dimensions {dims}: this model is not a Matryoshka model, so its embeddings have "
                    f"{self.hidden_size} values and cannot be shortened"
                )
            allowed = self.matryoshka_dimensions
            if dims > self.hidden_size or (allowed is not None and dims not in allowed):
                sizes = ", ".join(map(str, allowed)) if allowed else f"1 to {self.hidden_size}"
                raise InvalidRequestError(
                    f"dimensions {dims}: this model's embeddings can have {sizes} values"
                )
        return PoolingParams(
            pooling_type=params.pooling_type or self.pooling_type,
            normalize=self.normalize if params.normalize is None else params.normalize,
            dimensions=None if dims == self.hidden_size else dims,
        )


def needs_every_token(params: PoolingParams | None) -> bool:
    """Whether the request's prompt must be computed whole (no prefix cache hit)."""
    return params is not None and params.pooling_type in ("mean", "cls")


def pool_chunk(seq: Sequence, hidden: torch.Tensor, start: int) -> torch.Tensor | None:
    """Take ``hidden`` (the final states of ``seq``'s chunk this step, prompt positions ``start`` on) into
    ``seq``'s pooling; returns the embedding once the chunk ends the prompt, else None."""
    params = seq.pooling
    assert params is not None
    n_prompt = len(seq.prompt_token_ids)
    ends = start + hidden.shape[0] >= n_prompt
    if params.pooling_type == "mean":
        part = hidden.float().sum(0)
        seq.pool_state = part if start == 0 or seq.pool_state is None else seq.pool_state + part
        if not ends:
            return None
        vec = seq.pool_state / n_prompt
    elif params.pooling_type == "cls":
        if start == 0:  # a copy: ``hidden`` may be a CUDA graph's memory, rewritten by the next replay
            seq.pool_state = hidden[0].to(torch.float32, copy=True)
        if not ends:
            return None
        assert seq.pool_state is not None
        vec = seq.pool_state
    else:
        if not ends:
            return None
        vec = hidden[-1].to(torch.float32, copy=True)
    seq.pool_state = None
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
    return vec
