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

Classification (vLLM's ``LLM.classify``, ``/classify``, and a cross-encoder's ``/score`` and ``/rerank``): a
sequence classifier's checkpoint (transformers' ``*ForSequenceClassification``) has a ``score`` head; a
``classify`` request pools as above (its last token by default, as transformers does) and returns the head's
logits, through a softmax over the labels (a sigmoid for a single label, a cross-encoder's relevance)
unless ``activation`` is off.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from engine.errors import InvalidRequestError

if TYPE_CHECKING:
    from engine.sequence import Sequence

log = logging.getLogger(__name__)

POOLING_TYPES = ("last", "mean", "cls")
TASKS = ("embed", "classify")
# sentence-transformers' Pooling config keys, by our name.
_ST_MODES = {
    "last": "pooling_mode_lasttoken",
    "mean": "pooling_mode_mean_tokens",
    "cls": "pooling_mode_cls_token",
}


@dataclass(frozen=True)
class PoolingParams:
    """What an embedding or classification request asks for; None fields take the model's defaults
    (``ModelPooling``)."""

    pooling_type: str | None = None
    normalize: bool | None = None
    dimensions: int | None = None
    task: str = "embed"  # or "classify": the classifier head's probabilities (engine.pooling)
    activation: bool | None = None  # classify: softmax / sigmoid (None: on), else the raw logits

    def validate(self) -> None:
        if self.task not in TASKS:
            raise InvalidRequestError(f"task must be one of {', '.join(TASKS)}, not {self.task!r}")
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
    num_labels: int = 0  # a sequence classifier's head (0: the model does not classify)

    @classmethod
    def of(cls, path: Path | None, hidden_size: int, num_labels: int = 0) -> ModelPooling:
        if path is None:
            return cls(hidden_size=hidden_size, num_labels=num_labels)
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
            num_labels=num_labels,
        )

    def resolve(self, params: PoolingParams) -> PoolingParams:
        """``params`` with every None filled in from the model, checked against it."""
        params.validate()
        if params.task == "classify":
            if not self.num_labels:
                raise InvalidRequestError(
                    "this model has no classification head (a *ForSequenceClassification checkpoint "
                    "classifies): it serves embeddings, not classify, score or rerank by a cross-encoder"
                )
            if params.dimensions is not None or params.normalize:
                raise InvalidRequestError("dimensions and normalize apply to embeddings, not to classify")
            return PoolingParams(
                pooling_type=params.pooling_type or "last",
                normalize=False,
                task="classify",
                activation=params.activation is not False,
            )
        if params.activation is not None:
            raise InvalidRequestError("activation applies to classify, not to embeddings")
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


def pool_chunk(
    seq: Sequence, hidden: torch.Tensor, start: int, head: torch.Tensor | None = None
) -> torch.Tensor | None:
    """Take ``hidden`` (the final states of ``seq``'s chunk this step, prompt positions ``start`` on) into
    ``seq``'s pooling; returns the embedding (or, for ``classify``, the probabilities by the model's
    classifier ``head``) once the chunk ends the prompt, else None."""
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
    if params.task == "classify":
        assert head is not None, "classify is resolved against a model with a classifier head"
        # In the model's dtype, as transformers applies the head (a last or cls state is exact there).
        logits = torch.nn.functional.linear(vec.to(head.dtype), head).float()
        if not params.activation:
            return logits
        return torch.sigmoid(logits) if logits.shape[0] == 1 else torch.softmax(logits, dim=0)
    if params.dimensions is not None:
        vec = vec[: params.dimensions]
    if params.normalize:
        vec = torch.nn.functional.normalize(vec, p=2.0, dim=0)
    return vec


def top_label(labels: list[str], probs: list[float]) -> str:
    """A classifier's most probable label's name (the first of equal ones), from its probabilities or
    logits by label id."""
    return labels[max(range(len(probs)), key=probs.__getitem__)]


def score_pairs(data_1: str | list[str], data_2: str | list[str]) -> tuple[list[str], list[str]]:
    """vLLM's score pairing: one first text against each second text, or pairwise when both list as
    many; returns the pairs' first and second texts."""
    firsts = [data_1] if isinstance(data_1, str) else list(data_1)
    seconds = [data_2] if isinstance(data_2, str) else list(data_2)
    if not firsts or not seconds:
        raise InvalidRequestError("score needs at least one text on each side")
    if len(firsts) == 1:
        return firsts * len(seconds), seconds
    if len(firsts) != len(seconds):
        raise InvalidRequestError(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many as text_2"
        )
    return firsts, seconds


def cosine(a: list[float], b: list[float]) -> float:
    """The cosine similarity of two embeddings (0 where either is all zeros)."""
    norm = math.sqrt(sum(x * x for x in a) * sum(y * y for y in b))
    return sum(x * y for x, y in zip(a, b, strict=True)) / norm if norm else 0.0
