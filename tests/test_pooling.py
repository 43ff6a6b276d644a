"""Embedding requests (engine/pooling.py) against transformers: the pooled last hidden states of random-weight
checkpoints written with transformers' own classes equal ``AutoModel``'s (float32), for each pooling type,
over chunked prompts, prefix-cache hits and batches shared with generating requests; the checkpoint's
sentence-transformers settings and base-model-only weights are read as sentence-transformers and vLLM do."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, PoolingParams, SamplingParams
from engine.errors import InvalidRequestError
from tests.checkpoints import make_checkpoint
from tests.kernel_testing import needs_gpu


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("pool") / "qwen3", seed=11)


def _prompts(n: int, seed: int, lengths: tuple[int, int] = (2, 60)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def hf_states(path: Path, prompt: list[int]) -> torch.Tensor:
    """transformers' last hidden states (after the final norm) of one prompt, float32, [T, hidden]."""
    import transformers

    model = transformers.AutoModel.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([prompt])).last_hidden_state[0]


def pooled(states: torch.Tensor, kind: str, normalize: bool = True) -> torch.Tensor:
    vec = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[kind]
    return torch.nn.functional.normalize(vec, dim=0) if normalize else vec


@pytest.mark.parametrize("arch", ["qwen3", "llama", "qwen3_moe"])
def test_each_pooling_type_matches_transformers(arch: str, tmp_path: Path) -> None:
    """Chunked prompts (a 16-token budget) in batches of several: last, mean and cls pooling, normalised or
    not, equal the same pooling of transformers' hidden states."""
    path = make_checkpoint(arch, tmp_path / arch, seed=5)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=128, max_num_batched_tokens=16)
    prompts = _prompts(5, seed=1)
    states = [hf_states(path, p) for p in prompts]
    for kind in ("last", "mean", "cls"):
        for normalize in (True, False):
            got = llm.embed(prompts, PoolingParams(pooling_type=kind, normalize=normalize))
            for out, want in zip(got, states, strict=True):
                torch.testing.assert_close(torch.tensor(out.embedding), pooled(want, kind, normalize),
                                           atol=2e-5, rtol=1e-4)  # fmt: skip
    assert llm.engine.block_pool.num_free_blocks == 128  # every embedding request gave its blocks back


def test_prefix_cache_serves_last_pooling_but_not_mean(qwen3: Path) -> None:
    """``last`` takes a cached prefix (the last token is computed either way) and gives the same embedding;
    ``mean`` needs every token's state, so it computes its prompt whole, and still gives the same."""
    llm = LLM(str(qwen3), dtype="float32", num_kv_blocks=128)
    prompt = _prompts(1, seed=2, lengths=(50, 51))[0]
    for kind, cached in (("last", 48), ("mean", 0)):
        params = PoolingParams(pooling_type=kind)
        first, again = llm.embed([prompt], params)[0], llm.embed([prompt], params)[0]
        assert again.num_cached_tokens == cached
        torch.testing.assert_close(
            torch.tensor(again.embedding), torch.tensor(first.embedding), atol=2e-5, rtol=1e-4
        )
    want = pooled(hf_states(qwen3, prompt), "mean")
    torch.testing.assert_close(torch.tensor(again.embedding), want, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_embedding_requests_share_steps_with_generating_ones(qwen3: Path, async_scheduling: bool) -> None:
    """Embedding and generating requests in one engine, arriving while others decode: the generated tokens
    are the engine's without embeddings, the embeddings transformers', and no block leaks."""
    kw = dict(
        dtype="float32", num_kv_blocks=128, max_num_batched_tokens=32, async_scheduling=async_scheduling
    )
    gen_prompts, emb_prompts = _prompts(4, seed=3), _prompts(4, seed=4)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    want_tokens = [o.token_ids for o in LLM(str(qwen3), **kw).generate(gen_prompts, params)]
    engine = LLM(str(qwen3), **kw).engine
    tokens: dict[str, list[int]] = {}
    embeddings: dict[str, list[float]] = {}
    for i, p in enumerate(gen_prompts[:2]):
        engine.add_request(f"g{i}", p, params)
    step = 0
    while engine.has_unfinished() or step < 3:
        if step == 2:  # while the first two decode
            for i, p in enumerate(emb_prompts):
                engine.add_request(f"e{i}", p, SamplingParams(), pooling=PoolingParams())
            for i, p in enumerate(gen_prompts[2:], start=2):
                engine.add_request(f"g{i}", p, params)
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.embedding is not None:
                assert out.finished and not out.new_token_ids
                embeddings[out.request_id] = out.embedding
        step += 1
    assert [tokens[f"g{i}"] for i in range(4)] == want_tokens
    for i, p in enumerate(emb_prompts):
        want = pooled(hf_states(qwen3, p), "last")
        torch.testing.assert_close(torch.tensor(embeddings[f"e{i}"]), want, atol=2e-5, rtol=1e-4)
    assert engine.block_pool.num_free_blocks == 128


def test_mean_pooling_survives_preemption(qwen3: Path) -> None:
    """A pool too small for every request at once preempts some (their prompts are computed again): the
    mean-pooled embeddings still equal transformers'."""
    llm = LLM(
        str(qwen3), dtype="float32", num_kv_blocks=10, max_num_batched_tokens=16, enable_prefix_caching=False
    )
    prompts = _prompts(6, seed=6, lengths=(30, 40))
    gen = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    engine = llm.engine
    for i, p in enumerate(prompts[:2]):
        engine.add_request(f"g{i}", p, gen)
    for i, p in enumerate(prompts[2:]):
        engine.add_request(f"e{i}", p, SamplingParams(), pooling=PoolingParams(pooling_type="mean"))
    got = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.embedding is not None:
                got[out.request_id] = out.embedding
    assert engine.scheduler.num_preemptions > 0
    for i, p in enumerate(prompts[2:]):
        want = pooled(hf_states(qwen3, p), "mean")
        torch.testing.assert_close(torch.tensor(got[f"e{i}"]), want, atol=2e-5, rtol=1e-4)


def test_sentence_transformers_settings_and_matryoshka(qwen3: Path, tmp_path: Path) -> None:
    """The checkpoint's sentence-transformers modules set the default pooling and normalisation; only a
    Matryoshka model (config.json) takes ``dimensions``: the first values, then normalised."""
    path = tmp_path / "st"
    shutil.copytree(qwen3, path)
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    (path / "modules.json").write_text(json.dumps(modules))
    (path / "1_Pooling").mkdir()
    (path / "1_Pooling" / "config.json").write_text(
        json.dumps(
            {
                "word_embedding_dimension": 64,
                "pooling_mode_mean_tokens": True,
                "pooling_mode_cls_token": False,
            }
        )
    )
    prompt = _prompts(1, seed=7)[0]
    states = hf_states(qwen3, prompt)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    got = llm.embed([prompt])[0].embedding  # mean, and no Normalize module: not normalised
    torch.testing.assert_close(
        torch.tensor(got), pooled(states, "mean", normalize=False), atol=2e-5, rtol=1e-4
    )
    with pytest.raises(InvalidRequestError, match="not a Matryoshka model"):
        llm.embed([prompt], PoolingParams(dimensions=16))
    assert len(llm.embed([prompt], PoolingParams(dimensions=64))[0].embedding) == 64  # its own size: fine

    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [16, 32, 64]}))
    modules.append(
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}
    )
    (path / "modules.json").write_text(json.dumps(modules))
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    got = llm.embed([prompt], PoolingParams(dimensions=16))[0].embedding
    want = torch.nn.functional.normalize(states.mean(0)[:16], dim=0)
    torch.testing.assert_close(torch.tensor(got), want, atol=2e-5, rtol=1e-4)
    with pytest.raises(InvalidRequestError, match="16, 32, 64"):
        llm.embed([prompt], PoolingParams(dimensions=20))
    with pytest.raises(InvalidRequestError, match="pooling_type"):
        llm.embed([prompt], PoolingParams(pooling_type="max"))


def test_a_base_model_checkpoint_embeds_and_refuses_to_generate(qwen3: Path, tmp_path: Path) -> None:
    """Weights saved from transformers' base model (``AutoModel``: names without ``model.``, no LM head,
    untied) load; they embed as the whole checkpoint does, and a generating request is refused."""
    import transformers

    base = transformers.AutoModel.from_pretrained(str(qwen3), dtype=torch.float32)
    path = tmp_path / "base"
    base.save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (qwen3 / name).exists():
            shutil.copy(qwen3 / name, path / name)
    prompts = _prompts(3, seed=8)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64)
    assert not llm.engine.generates
    whole = LLM(str(qwen3), dtype="float32", num_kv_blocks=64).embed(prompts)
    for a, b in zip(llm.embed(prompts), whole, strict=True):
        torch.testing.assert_close(torch.tensor(a.embedding), torch.tensor(b.embedding), atol=1e-6, rtol=1e-5)
    with pytest.raises(InvalidRequestError, match="embeddings only"):
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))


def test_embedding_request_limits(qwen3: Path) -> None:
    """An embedding request's prompt may fill max_model_len (it generates nothing), not exceed it; it
    holds no KV for a decode worker."""
    llm = LLM(str(qwen3), dtype="float32", num_kv_blocks=64, max_model_len=32)
    assert len(llm.embed([list(range(3, 35))])[0].embedding) == 64
    with pytest.raises(InvalidRequestError, match="more than max_model_len"):
        llm.embed([list(range(3, 36))])
    with pytest.raises(ValueError, match="no KV to hold"):
        llm.engine.add_request("x", [5, 6], SamplingParams(), hold_kv=True, pooling=PoolingParams())


def test_embeddings_through_the_prefill_graphs_pieces(qwen3: Path) -> None:
    """CPU (the prefill graphs' pieces run eagerly, ``EagerPieces``, as on a GPU they replay): embeddings of
    prompts chunked through padded buckets equal the eager engine's, for each pooling type."""
    from tests.test_prefill_graphs import EagerPieces

    kw = dict(dtype="float32", num_kv_blocks=128, max_num_batched_tokens=48)
    eager = LLM(str(qwen3), **kw)
    llm = LLM(str(qwen3), **kw)
    runner = llm.engine.runner
    pieces = runner.prefill_graphs = EagerPieces(runner.model, runner.kv_pool, 48, torch.device("cpu"))
    pieces.capture()
    prompts = _prompts(5, seed=9, lengths=(5, 90))
    for kind in ("last", "mean", "cls"):
        params = PoolingParams(pooling_type=kind)
        for a, b in zip(llm.embed(prompts, params), eager.embed(prompts, params), strict=True):
            torch.testing.assert_close(
                torch.tensor(a.embedding), torch.tensor(b.embedding), atol=2e-5, rtol=1e-4
            )
    assert sum(pieces.replays.values()) > 0


@needs_gpu
def test_gpu_embeddings_with_graphs_equal_the_eager_reference(qwen3: Path) -> None:
    """On a GPU: the Triton ops with decode and prefill graphs and asynchronous scheduling, embedding requests
    beside generating ones, give the eager torch ops' embeddings (float32) and tokens."""
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=256, max_num_batched_tokens=64)
    fast = LLM(str(qwen3), kernel_backend="triton", **kw)
    eager = LLM(str(qwen3), kernel_backend="torch", cuda_graphs=False, **kw)
    assert fast.engine.runner.prefill_graphs is not None
    prompts = _prompts(6, seed=10, lengths=(2, 120))
    for kind in ("last", "mean", "cls"):
        params = PoolingParams(pooling_type=kind)
        for a, b in zip(fast.embed(prompts, params), eager.embed(prompts, params), strict=True):
            torch.testing.assert_close(
                torch.tensor(a.embedding), torch.tensor(b.embedding), atol=1e-4, rtol=1e-3
            )
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert [o.token_ids for o in fast.generate(prompts, greedy)] == [
        o.token_ids for o in eager.generate(prompts, greedy)
    ]
