"""Speculative decoding by n-gram lookup (engine/speculative.py, LLMEngine's drafts): the tokens are the
ones decoding token by token gives (greedy and seeded, with stops, logprobs rows beside, preemption,
asynchronous scheduling, the prefix cache), in fewer steps; the proposer and the config on their own."""

from __future__ import annotations

import json
import random

import pytest

from engine import LLM, SamplingParams
from engine.speculative import NgramSpec, parse_speculative_config, propose

SPEC = json.dumps(
    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
)


def _prompts(seed: int = 0) -> list[list[int]]:
    """Prompts that repeat themselves (drafts find matches), and one that does not."""
    rng = random.Random(seed)
    motif = [rng.randrange(0, 256) for _ in range(9)]
    return [
        motif * 5 + [1, 2],
        [rng.randrange(0, 256) for _ in range(50)],
        list(range(40, 70)) * 2,
        motif * 2 + [rng.randrange(0, 256) for _ in range(20)] + motif,
    ]


def _params() -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=40, temperature=0.9, top_p=0.9, seed=11, ignore_eos=True),
        SamplingParams(
            max_tokens=30, temperature=0.0, logprobs=2, ignore_eos=True
        ),  # logprobs of each position
        SamplingParams(max_tokens=44, temperature=0.0, stop=["e", "Q"], stop_token_ids=[7]),
        # a minimum length and a bias read each drafted position's own output index
        SamplingParams(max_tokens=30, temperature=0.7, seed=3, min_tokens=20, logit_bias={5: 3.0}),
    ]


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_drafted_requests_give_the_tokens_of_plain_decoding_in_fewer_steps(model: str) -> None:
    prompts, params = _prompts(), _params()
    plain = LLM(model, num_kv_blocks=256)
    fast = LLM(model, num_kv_blocks=256, speculative_config=SPEC)
    for p in params:
        expected = plain.generate(prompts, p)
        got = fast.generate(prompts, p)
        for e, g in zip(expected, got, strict=True):
            assert (g.token_ids, g.text, g.finish_reason) == (e.token_ids, e.text, e.finish_reason)
            assert [lp.token_id for lp in g.logprobs or []] == [lp.token_id for lp in e.logprobs or []]
            for a, b in zip(g.logprobs or [], e.logprobs or [], strict=True):
                assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                assert [t for t, _ in a.top] == [t for t, _ in b.top]
    stats = fast.engine.stats()
    assert stats.spec_accepted_tokens > 20 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert fast.engine.runner.forward_passes < plain.engine.runner.forward_passes
    assert fast.engine.block_pool.num_free_blocks == 256


def test_a_tight_pool_and_asynchronous_scheduling_keep_the_tokens() -> None:
    """Few blocks (drafts only where free blocks hold them; preemption still happens), and asynchronous
    scheduling asked for (speculation turns it off): the plain synchronous engine's tokens."""
    prompts = _prompts(3) * 2
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = [o.token_ids for o in LLM("tiny-dense", num_kv_blocks=256).generate(prompts, greedy)]
    tight = LLM("tiny-dense", num_kv_blocks=20, max_num_seqs=8, speculative_config=SPEC)
    assert [o.token_ids for o in tight.generate(prompts, greedy)] == expected
    assert tight.engine.scheduler.num_preemptions > 0 and tight.engine.stats().spec_accepted_tokens > 0
    assert tight.engine.block_pool.num_free_blocks == 20
    ahead = LLM("tiny-dense", num_kv_blocks=256, speculative_config=SPEC, async_scheduling=True)
    assert not ahead.engine.config.async_scheduling  # a draft needs the host's tokens: steps run in turn
    assert [o.token_ids for o in ahead.generate(prompts, greedy)] == expected
    assert ahead.engine.stats().spec_accepted_tokens > 0


def test_the_prefix_cache_holds_only_tokens_that_were_kept() -> None:
    """Blocks are hashed only up to the kept tokens: after the same traffic the drafting engine's cached
    block hashes are the plain engine's, and a request reusing them decodes the same."""
    prompts = _prompts(5)
    greedy = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)
    engines = [
        LLM("tiny-dense", num_kv_blocks=256),
        LLM("tiny-dense", num_kv_blocks=256, speculative_config=SPEC),
    ]
    outs = [llm.generate(prompts, greedy) for llm in engines]
    hashes = [set(llm.engine.block_pool.hash_to_block) for llm in engines]
    assert hashes[0] == hashes[1] and len(hashes[0]) > 10
    follow = [p + o.token_ids for p, o in zip(prompts, outs[0], strict=True)]
    again = [llm.generate(follow, greedy) for llm in engines]
    assert [o.token_ids for o in again[0]] == [o.token_ids for o in again[1]]
    assert all(o.num_cached_tokens > 0 for o in again[1])


def test_proposals_follow_the_latest_earlier_occurrence() -> None:
    spec = NgramSpec(num_tokens=3, lookup_max=3, lookup_min=1)
    assert propose([1, 2, 3, 9, 9, 1, 2, 3, 4, 5, 1, 2, 3], spec, 10) == [4, 5, 1]  # the latest [1, 2, 3]
    assert propose([5, 6, 7, 8, 6, 7], spec, 10) == [8, 6, 7]  # [6, 7] (no [x, 6, 7] earlier)
    assert propose([5, 6, 7, 8, 6, 7], spec, 2) == [8, 6]  # the room left caps it
    assert propose([1, 2, 3, 4], spec, 10) == []  # nothing repeats
    assert propose([1, 2, 3, 2], NgramSpec(3, 3, 2), 10) == []  # too short a match for lookup_min 2


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"method": "eagle", "num_speculative_tokens": 2}', "'ngram' \\(prompt lookup\\) and 'mtp'"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        (
            '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
            "exceeds",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 2, "model": "x"}', "does not know"),
        ("ngram", "must be JSON"),
    ],
)
def test_bad_speculative_configs_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_speculative_config(text)
    with pytest.raises(ValueError, match=message):
        LLM("tiny-dense", num_kv_blocks=16, speculative_config=text)


def test_a_mesh_whose_workers_draft_answers_as_plain_offline_decoding() -> None:
    """Workers started with --speculative-config: a disaggregated request (the decode worker drafts after
    the KV import) gives the plain offline engine's tokens, and the decode worker counts its drafts under
    pdmesh's and vLLM's names."""
    import re
    import urllib.request

    import openai

    from tests.mesh_fixtures import ServiceProcess, worker_pair

    prompt = "abcabcabcabcabcabc " * 4
    llm = LLM("tiny-dense", num_kv_blocks=256)
    expected = llm.generate([prompt], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    with worker_pair("--speculative-config", SPEC) as (prefill, decode):
        router = ServiceProcess.start(
            "router", "--model", "tiny-dense", "--http-port", "0", "--prefill-workers", prefill.address,
            "--decode-workers", decode.address, "--pd-threshold-tokens", "0",
        )  # fmt: skip
        try:
            http = re.search(r"http=(\S+)", next(line for line in router.lines if "ready:" in line)).group(1)
            client = openai.OpenAI(base_url=f"http://{http}/v1", api_key="x", max_retries=0)
            reply = client.completions.create(model="tiny-dense", prompt=prompt, max_tokens=40, temperature=0.0,
                                              extra_body={"ignore_eos": True})  # fmt: skip
            assert reply.choices[0].text == expected.text
            with urllib.request.urlopen(f"http://{decode.metrics_address}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            ours = float(
                re.search(r"^pdmesh_decode_spec_decode_accepted_tokens_tokens_total (\S+)$", text, re.M)[1]
            )
            theirs = re.search(r"^vllm:spec_decode_num_accepted_tokens_total\{[^}]*\} (\S+)$", text, re.M)
            assert ours > 0 and float(theirs[1]) == ours
        finally:
            assert router.stop() == 0, router.log()


@pytest.mark.parametrize("seed", range(4))
def test_random_budgets_pools_and_drafts_keep_plain_decodings_tokens(seed: int) -> None:
    """Drafts cut by a small token budget, pools small enough to preempt, 1-5 draft tokens, greedy or
    seeded: the plain engine's tokens, and every block back."""
    rng = random.Random(seed)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": rng.randint(1, 5),
                       "prompt_lookup_max": rng.randint(1, 4), "prompt_lookup_min": 1})  # fmt: skip
    motif = [rng.randrange(0, 256) for _ in range(rng.randint(3, 10))]
    prompts = [motif * rng.randint(1, 4) + [rng.randrange(0, 256) for _ in range(rng.randint(1, 20))]
               for _ in range(rng.randint(2, 6))]  # fmt: skip
    params = SamplingParams(max_tokens=rng.randint(10, 40), temperature=rng.choice([0.0, 0.8]), seed=seed,
                            ignore_eos=rng.random() < 0.7)  # fmt: skip
    config = dict(
        num_kv_blocks=rng.choice([12, 24]), max_num_batched_tokens=rng.choice([3, 5, 8]), max_num_seqs=8
    )
    model = rng.choice(["tiny-dense", "tiny-moe"])
    expected = [o.token_ids for o in LLM(model, **config).generate(prompts, params)]
    drafting = LLM(model, speculative_config=spec, **config)
    assert [o.token_ids for o in drafting.generate(prompts, params)] == expected
    assert drafting.engine.block_pool.num_free_blocks == config["num_kv_blocks"]
