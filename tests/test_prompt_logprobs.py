"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's): each prompt token's logprob under the model
given the tokens before it, its rank, and the top-N alternatives, against transformers' own forward pass
over the prompt. Chunked prefill, batch-mates, the prefix cache, preemption and asynchronous scheduling
must not change them."""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.llm_engine import LLMEngine
from engine.sequence import TokenLogprobs
from tests.checkpoints import make_checkpoint
from tests.kernel_testing import needs_gpu

TOP = 3


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=7)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 60) for _ in range(n)] for n in (1, 2, 9, 37)]


def _hf_prompt_logprobs(checkpoint, prompt: list[int]) -> torch.Tensor:
    """log_softmax of transformers' logits at every prompt position but the last: [len - 1, V]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1)


def _assert_matches(
    got: list[TokenLogprobs | None] | None, prompt: list[int], expected: torch.Tensor
) -> None:
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    for pos, lp in enumerate(got[1:], start=1):
        assert lp is not None and lp.token_id == prompt[pos]
        row = expected[pos - 1]
        assert lp.logprob == pytest.approx(row[prompt[pos]].item(), abs=1e-4)
        assert lp.rank == int((row > row[prompt[pos]]).sum()) + 1
        top_v, top_i = row.topk(TOP)
        assert [t for t, _ in lp.top] == top_i.tolist()
        assert [v for _, v in lp.top] == pytest.approx(top_v.tolist(), abs=1e-4)


def _params(**kw) -> SamplingParams:
    return SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, **kw)


def test_prompt_logprobs_match_transformers_in_chunks_and_batches(checkpoint) -> None:
    prompts = _prompts()
    expected = [_hf_prompt_logprobs(checkpoint, p) for p in prompts]
    # 8 tokens a step: the longer prompts are prefilled in chunks, batched with the others.
    llm = LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4,
              max_num_batched_tokens=8)  # fmt: skip
    plain = llm.generate(prompts, _params())
    outs = llm.generate(prompts + prompts, [_params(prompt_logprobs=TOP)] * 4 + [_params()] * 4)
    for out, prompt, exp in zip(outs[:4], prompts, expected, strict=True):
        _assert_matches(out.prompt_logprobs, prompt, exp)
    assert all(o.prompt_logprobs is None for o in outs[4:])
    # The tokens are those of requests without prompt logprobs.
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain] * 2
    assert llm.engine.block_pool.num_free_blocks == 64


def test_prompt_logprobs_bypass_the_prefix_cache_and_leave_it_usable(checkpoint) -> None:
    prompt = _prompts()[3]
    expected = _hf_prompt_logprobs(checkpoint, prompt)
    llm = LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    assert llm.generate([prompt], _params())[0].num_cached_tokens == 0
    assert llm.generate([prompt], _params())[0].num_cached_tokens == 36  # the prefix is cached now
    scored = llm.generate([prompt], _params(prompt_logprobs=TOP))[0]
    assert scored.num_cached_tokens == 0  # computed again: cached blocks have no logits
    _assert_matches(scored.prompt_logprobs, prompt, expected)
    assert llm.generate([prompt], _params())[0].num_cached_tokens == 36


def test_preempted_requests_keep_one_logprob_per_prompt_token(checkpoint) -> None:
    prompts = _prompts()[2:] * 3
    expected = [_hf_prompt_logprobs(checkpoint, p) for p in prompts[:2]] * 3
    # 20 blocks of 4 tokens cannot hold six sequences of up to 37 + 24 tokens at once; prompts in chunks
    # of 8 tokens, so some are preempted with their prompt half computed.
    llm = LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=20, block_size=4,
              max_num_seqs=6, max_num_batched_tokens=8)  # fmt: skip
    outs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                                prompt_logprobs=TOP))  # fmt: skip
    assert llm.engine.scheduler.num_preemptions > 0
    for out, prompt, exp in zip(outs, prompts, expected, strict=True):
        _assert_matches(out.prompt_logprobs, prompt, exp)
    assert llm.engine.block_pool.num_free_blocks == 20


def _stepped(engine: LLMEngine, late: list[int]) -> dict[str, tuple[list[int], list | None]]:
    """One request decoding alone, then prompts arriving one a step while it runs (with asynchronous
    scheduling, each arrives with a step in flight): each request's tokens and prompt logprobs."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, prompt_logprobs=TOP)
    engine.add_request("first", [7, 8, 9], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    results: dict[str, tuple[list[int], list | None]] = {}
    arrivals = [(3 + i, f"late-{i}", prompt) for i, prompt in enumerate(late)]
    step = 0
    while arrivals or engine.has_unfinished():
        while arrivals and arrivals[0][0] <= step:
            _, rid, prompt = arrivals.pop(0)
            engine.add_request(rid, prompt, params)
        for out in engine.step():
            tokens, prompt_lps = results.setdefault(out.request_id, ([], None))
            if out.prompt_logprobs is not None:
                prompt_lps = out.prompt_logprobs
            results[out.request_id] = (tokens + out.new_token_ids, prompt_lps)
        step += 1
    return results


def test_asynchronous_scheduling_gives_the_same_prompt_logprobs_and_still_runs_ahead(checkpoint) -> None:
    late = _prompts()
    config = dict(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=64, block_size=4)
    sync = _stepped(LLMEngine(EngineConfig(**config)), late)
    ahead_engine = LLMEngine(EngineConfig(**config, async_scheduling=True))
    ahead = _stepped(ahead_engine, late)
    assert ahead == sync
    for i, prompt in enumerate(late):
        _assert_matches(ahead[f"late-{i}"][1], prompt, _hf_prompt_logprobs(checkpoint, prompt))
    assert ahead_engine.lookahead_steps > 0  # decode steps still run ahead


def test_a_request_aborted_mid_prompt_leaves_nothing_behind() -> None:
    llm = LLM("tiny-dense", num_kv_blocks=32, block_size=4, max_num_batched_tokens=8)
    engine = llm.engine
    engine.add_request("scored", list(range(3, 40)), _params(prompt_logprobs=1))
    engine.step()  # the first chunk of 8
    assert engine._scoring == {"scored"}
    assert engine.abort("scored")
    assert not engine._scoring and engine.block_pool.num_free_blocks == 32
    assert [o.finish_reason for o in engine.step()] == ["abort"]
    # Finished requests leave it too; without any, steps skip the scan.
    llm.generate([[5, 6, 7]], _params(prompt_logprobs=0))
    assert not engine._scoring


@pytest.mark.parametrize("value", [-1, 21])
def test_prompt_logprobs_out_of_range_is_refused(value: int) -> None:
    llm = LLM("tiny-dense", num_kv_blocks=16)
    with pytest.raises(InvalidRequestError, match="prompt_logprobs must be between 0 and 20"):
        llm.generate([[1, 2, 3]], SamplingParams(prompt_logprobs=value))


@needs_gpu
@pytest.mark.gpu
def test_gpu_prompt_logprobs_equal_the_cpu_engines_with_graphs() -> None:
    """Chunks of one token replay the decode graph (its logits rows give the prompt logprobs); the others
    run the prefill graphs or eagerly."""
    prompts = _prompts()
    params = _params(prompt_logprobs=TOP)
    cpu = LLM("tiny-dense", dtype="float32", num_kv_blocks=64, block_size=4).generate(prompts, params)
    for budget in (1, 8, 64):
        gpu = LLM("tiny-dense", device="cuda", dtype="float32", kernel_backend="triton", num_kv_blocks=64,
                  block_size=4, max_num_batched_tokens=budget)  # fmt: skip
        got = gpu.generate(prompts, params)
        for g, c in zip(got, cpu, strict=True):
            assert g.prompt_logprobs is not None and c.prompt_logprobs is not None
            assert [x and x.token_id for x in g.prompt_logprobs] == [
                x and x.token_id for x in c.prompt_logprobs
            ]
            for a, b in zip(g.prompt_logprobs[1:], c.prompt_logprobs[1:], strict=True):
                assert a is not None and b is not None and a.logprob == pytest.approx(b.logprob, abs=2e-3)
