"""Sequence classifiers (transformers' ``*ForSequenceClassification``, engine/pooling.py's ``classify``) against
transformers: the class probabilities and logits of random-weight checkpoints written with transformers' own
classes equal ``AutoModelForSequenceClassification``'s (float32), over chunked prompts in batches; a
one-label classifier scores text pairs as a cross-encoder (the tokenizer's pair template, then a sigmoid),
as vLLM's ``LLM.score`` does; what a classifier cannot do, and what only a classifier can, is refused."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from engine import LLM, PoolingParams, SamplingParams
from engine.errors import InvalidRequestError
from tests.checkpoints import make_checkpoint
from tests.kernel_testing import needs_gpu

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def classifier(arch: str, path: Path, num_labels: int = 3, seed: int = 3) -> Path:
    cls = {"qwen3": "Qwen3ForSequenceClassification", "llama": "LlamaForSequenceClassification",
           "qwen3_moe": "Qwen3MoeForSequenceClassification"}[arch]  # fmt: skip
    labels = {"id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}} if num_labels == 3 else {}
    return make_checkpoint(arch, path, seed=seed, cls=cls, num_labels=num_labels, pad_token_id=258, **labels)


def with_pair_template(path: Path) -> Path:
    """The checkpoint's tokenizer with a post-processor that marks a pair (as a cross-encoder's has):
    ``<s> A`` alone, ``<s> A </s> B`` for a pair."""
    from tokenizers import Tokenizer, processors

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    bos, eos = tok.token_to_id("<s>"), tok.token_to_id("</s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A </s> $B:1", special_tokens=[("<s>", bos), ("</s>", eos)]
    )
    tok.save(str(path / "tokenizer.json"))
    return path


def hf_logits(path: Path, prompt: list[int]) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForSequenceClassification.from_pretrained(str(path), dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(input_ids=torch.tensor([prompt])).logits[0]


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(2, 50))] for _ in range(n)]


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_class_probabilities_match_transformers(arch: str, tmp_path: Path) -> None:
    """Prompts chunked by a 16-token budget, several a step: softmax probabilities, the raw logits
    (``activation=False``) and the most probable label's name equal transformers' for each prompt; the
    classifier generates nothing and gives every block back."""
    path = classifier(arch, tmp_path / arch)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16)
    assert llm.engine.model_config.labels == ["negative", "neutral", "positive"]
    prompts = _prompts(5, seed=4)
    want = [hf_logits(path, p) for p in prompts]
    probs = llm.classify(prompts)
    logits = llm.classify(prompts, activation=False)
    for p, raw, w, prompt in zip(probs, logits, want, prompts, strict=True):
        assert p.prompt_token_ids == prompt
        torch.testing.assert_close(torch.tensor(raw.probs), w, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(torch.tensor(p.probs), torch.softmax(w, 0), atol=2e-5, rtol=1e-4)
        assert p.label == LABELS[int(w.argmax())]
    assert llm.engine.block_pool.num_free_blocks == 128
    with pytest.raises(InvalidRequestError, match="no LM head"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))


def test_a_cross_encoder_scores_pairs_as_transformers(tmp_path: Path) -> None:
    """A one-label classifier is a cross-encoder: ``score`` reads each (query, document) pair as the
    tokenizer's pair template (transformers' ``tokenizer(query, document)``) and gives the sigmoid of the
    logit; one query against several documents, or pairwise."""
    import transformers

    path = with_pair_template(classifier("qwen3", tmp_path / "ce", num_labels=1))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    query, docs = "what is a cat", ["a cat is a small animal", "stocks fell today", "cats purr"]
    got = llm.score(query, docs)
    for out, doc in zip(got, docs, strict=True):
        ids = hf_tok(query, doc)["input_ids"]
        assert out.prompt_token_ids == ids
        assert ids[0] == hf_tok.convert_tokens_to_ids("<s>") and hf_tok.convert_tokens_to_ids("</s>") in ids
        want = torch.sigmoid(hf_logits(path, ids))[0]
        assert out.score == pytest.approx(float(want), abs=2e-5)
    pairwise = llm.score([query, "stocks"], [docs[0], docs[1]])
    assert pairwise[0].score == pytest.approx(got[0].score, abs=1e-6)
    assert pairwise[1].prompt_token_ids == hf_tok("stocks", docs[1])["input_ids"]
    with pytest.raises(InvalidRequestError, match="one text_1, or as many"):
        llm.score(["a", "b"], ["c", "d", "e"])


def test_what_a_classifier_and_an_embedding_model_refuse(tmp_path: Path) -> None:
    """classify needs a classifier head; dimensions and normalize are an embedding's, activation a
    classification's; a classifier of several labels is no cross-encoder. A classifier still embeds (its
    pooled hidden states), and an embedding model scores by cosine."""
    path = classifier("qwen3", tmp_path / "cls")
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    prompt = [5, 6, 7, 8]
    with pytest.raises(InvalidRequestError, match="apply to embeddings"):
        llm.embed([prompt], PoolingParams(task="classify", dimensions=8))
    with pytest.raises(InvalidRequestError, match="task must be"):
        llm.embed([prompt], PoolingParams(task="generate"))
    with pytest.raises(InvalidRequestError, match="3 labels"):
        llm.score("a", "b")
    assert len(llm.embed([prompt])[0].embedding) == llm.engine.model_config.hidden_size
    plain = make_checkpoint("qwen3", tmp_path / "plain", seed=3)
    embedder = LLM(str(plain), dtype="float32", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="no classification head"):
        embedder.classify([prompt])
    with pytest.raises(InvalidRequestError, match="activation applies to classify"):
        embedder.embed([prompt], PoolingParams(activation=False))
    a, b = embedder.embed(["hello there", "general kenobi"])
    cos = float(
        torch.nn.functional.cosine_similarity(torch.tensor(a.embedding), torch.tensor(b.embedding), 0)
    )
    assert embedder.score("hello there", "general kenobi")[0].score == pytest.approx(cos, abs=1e-5)


def test_labels_without_names_and_unnamed_configs(tmp_path: Path) -> None:
    """transformers names unnamed labels ``LABEL_i``; a config.json without ``id2label`` but with
    ``num_labels`` gets as many."""
    path = classifier("llama", tmp_path / "two", num_labels=2)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=32)
    assert llm.engine.model_config.labels == ["LABEL_0", "LABEL_1"]
    out = llm.classify([[5, 6, 7]])[0]
    assert len(out.probs) == 2 and sum(out.probs) == pytest.approx(1.0, abs=1e-6)
    cfg = json.loads((path / "config.json").read_text())
    cfg.pop("id2label", None)
    cfg.pop("label2id", None)
    cfg["num_labels"] = 4
    from engine.models.model_config import ModelConfig

    assert ModelConfig.from_hf_dict(cfg).labels == ["LABEL_0", "LABEL_1", "LABEL_2", "LABEL_3"]


@needs_gpu
def test_gpu_classifier_with_graphs_matches_transformers(tmp_path: Path) -> None:
    """On a GPU: the Triton ops with prefill graphs give transformers' class probabilities (float32, and
    bf16 within bf16's error), prompts chunked through the graphs' buckets."""
    path = classifier("qwen3_moe", tmp_path / "moe")
    prompts = _prompts(6, seed=12)
    want = torch.stack([torch.softmax(hf_logits(path, p), 0) for p in prompts])
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 3e-2)):
        llm = LLM(str(path), device="cuda", dtype=dtype, kernel_backend="triton", num_kv_blocks=256,
                  max_num_batched_tokens=32)  # fmt: skip
        assert llm.engine.runner.prefill_graphs is not None
        got = torch.tensor([o.probs for o in llm.classify(prompts)])
        torch.testing.assert_close(got, want, atol=tol, rtol=0)
        del llm
