"""Asynchronous scheduling (one decode step of lookahead) against the synchronous engine.

The same scripted traffic (requests arriving at given steps, aborts mid-stream) runs through both modes;
every output, finish reason, usage count, KV event and cached block hash must be the same, and every block
must come back. The CPU tests run the eager model (the device tensor is a CPU tensor, the logic is the
same); the GPU test runs the Triton ops with CUDA graphs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from dataclasses import dataclass, field

import pytest
import torch

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import CapacityError
from engine.llm_engine import LLMEngine, RequestOutput
from mesh.kv_events import BlocksRemoved, KVEvent, ListEventSink
from tests.kernel_testing import needs_gpu

# Tokens the tiny models produce often, declared EOS, stop tokens or stop strings so requests stop early.
EOS = {"tiny-dense": 70, "tiny-moe": 35}
STOP_TOKENS = {"tiny-dense": [125, 95], "tiny-moe": [96, 87]}
STOP_STRINGS = {"tiny-dense": ["B", "hG", "w"], "tiny-moe": ["T", "W", "'s"]}


@dataclass
class Add:
    step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams


@dataclass
class Abort:
    step: int
    request_id: str


@dataclass
class Import:
    """A request whose prompt KV a prefill worker computed: reserved, its blocks zeroed (the same content
    whichever block ids it gets), and committed with its first token ``pull_steps`` steps later (the KV
    transfer's time)."""

    step: int
    request_id: str
    prompt: list[int]
    params: SamplingParams
    first_token: int
    pull_steps: int = 0


@dataclass
class Commit:
    step: int
    request_id: str
    first_token: int


@dataclass
class Trace:
    outputs: dict[str, list[tuple]] = field(default_factory=dict)
    aborted: list[tuple[str, bool]] = field(default_factory=list)
    events: list[KVEvent] = field(default_factory=list)
    cached_hashes: list[int] = field(default_factory=list)
    totals: tuple[int, int, int] = (0, 0, 0)
    engine: LLMEngine | None = None

    def finish_reasons(self) -> list[tuple]:
        return [outs[-1][2:4] for outs in self.outputs.values()]


def _strip(out: RequestOutput) -> tuple:
    """Everything a caller sees of one output except the timestamps."""
    return (
        out.new_token_ids,
        out.finished,
        out.finish_reason,
        out.stop_reason,
        out.num_prompt_tokens,
        out.num_cached_tokens,
        out.num_output_tokens,
        out.text,
    )


def run_script(
    script: list[Add | Abort | Import], eos: int | None = None, join_prompts: bool = True, **config
) -> Trace:
    sink = ListEventSink()
    engine = LLMEngine(EngineConfig(**config), event_sink=sink)
    engine.lookahead_join_prompts = join_prompts
    if eos is not None:
        engine.eos_token_ids = frozenset({eos})
    trace = Trace(engine=engine)
    todo = sorted(script, key=lambda a: a.step)
    step = 0
    while todo or engine.has_unfinished():
        engine.wait_for_lookahead_point()  # as serving loops do (a wait only with decode graphs)
        while todo and todo[0].step <= step:
            action = todo.pop(0)
            if isinstance(action, Add):
                trace.outputs[action.request_id] = []
                engine.add_request(action.request_id, action.prompt, action.params)
            elif isinstance(action, Import):
                try:
                    blocks = engine.reserve_import(action.request_id, action.prompt, action.params)
                except CapacityError:  # what a decode worker answers RESOURCE_EXHAUSTED
                    trace.aborted.append((action.request_id, False))
                    continue
                trace.outputs[action.request_id] = []
                engine.kv_pool[torch.tensor(blocks)] = 0
                commit = Commit(step + action.pull_steps, action.request_id, action.first_token)
                todo.insert(next((i for i, a in enumerate(todo) if a.step > commit.step), len(todo)), commit)
            elif isinstance(action, Commit):
                engine.commit_import(action.request_id, action.first_token)
            else:
                trace.aborted.append((action.request_id, engine.abort(action.request_id)))
        for out in engine.step():
            outs = trace.outputs[out.request_id]
            assert not (outs and outs[-1][1]), f"{out.request_id}: output after it finished"
            outs.append(_strip(out))
        step += 1
        assert step < 10_000
    imported = {a.request_id for a in script if isinstance(a, Import)}
    for rid, outs in trace.outputs.items():
        assert outs and outs[-1][1], f"{rid} never finished"
        # Tokens streamed == tokens counted. An import's first token came with its handle and is not
        # streamed, unless the request finished on it (its one output then carries it).
        finished_at_commit = rid in imported and len(outs) == 1 and outs[0][6] == 1
        assert sum(len(o[0]) for o in outs) + (rid in imported and not finished_at_commit) == outs[-1][6]
    pool = engine.block_pool
    assert pool.num_free_blocks == pool.num_blocks, "blocks leaked"
    assert sorted(pool.ref_counts) == [0] * pool.num_blocks
    trace.events = sink.events
    trace.cached_hashes = sorted(pool.hash_to_block)
    s = engine.stats()
    trace.totals = (s.prompt_tokens_total, s.cached_prompt_tokens_total, s.generated_tokens_total)
    return trace


def assert_same(sync: Trace, lookahead: Trace) -> None:
    assert lookahead.outputs.keys() == sync.outputs.keys()
    for rid in sync.outputs:
        assert lookahead.outputs[rid] == sync.outputs[rid], rid
    assert lookahead.aborted == sync.aborted
    assert lookahead.totals == sync.totals
    assert lookahead.events == sync.events
    assert lookahead.cached_hashes == sync.cached_hashes


def random_script(
    model: str, seed: int, n: int = 14, last_arrival: int = 30, n_imports: int = 6
) -> list[Add | Abort | Import]:
    """Mixed traffic: shared system prompts (prefix-cache hits), greedy, seeded and unseeded sampling,
    top-k / top-p / min-p, EOS, stop tokens, stop strings, max_tokens from 1 to 60, staggered arrivals,
    aborts of requests that are running, finished or not yet admitted, and imported requests (KV from a
    prefill worker), some with logprobs."""
    rng = random.Random(seed)
    systems = [[rng.randrange(0, 256) for _ in range(rng.choice((20, 40, 70)))] for _ in range(2)]
    script: list[Add | Abort] = []
    for i in range(n):
        tail = [rng.randrange(0, 256) for _ in range(rng.randrange(1, 30))]
        prompt = (rng.choice(systems) + tail) if rng.random() < 0.6 else tail
        kind = rng.choice(("greedy", "seeded", "unseeded", "filtered"))
        params = SamplingParams(
            max_tokens=rng.randrange(1, 4) if rng.random() < 0.2 else rng.randrange(4, 61),
            temperature=0.0 if kind == "greedy" else rng.choice((0.7, 1.0, 1.3)),
            seed=rng.randrange(1 << 30) if kind in ("seeded", "filtered") else None,
            top_k=rng.choice((0, 20)) if kind == "filtered" else 0,
            top_p=rng.choice((1.0, 0.9)) if kind == "filtered" else 1.0,
            min_p=rng.choice((0.0, 0.05)) if kind == "filtered" else 0.0,
            ignore_eos=rng.random() < 0.3,
            stop_token_ids=rng.sample(STOP_TOKENS[model], 1) if rng.random() < 0.4 else [],
            stop=rng.sample(STOP_STRINGS[model], 1) if rng.random() < 0.4 else None,
        )
        script.append(Add(rng.randrange(0, last_arrival) if i else 0, f"r{i}", prompt, params))
    adds = [a for a in script if isinstance(a, Add)]
    for a in rng.sample(adds, 3):
        script.append(Abort(a.step + rng.randrange(1, 25), a.request_id))
    for i in range(n_imports):  # decode-worker traffic: prompts computed elsewhere, most able to run ahead
        params = SamplingParams(
            max_tokens=rng.randrange(1, 40),
            temperature=0.0 if rng.random() < 0.5 else 1.0,
            seed=rng.randrange(1 << 30),
            logprobs=2 if rng.random() < 0.15 else None,
            stop_token_ids=rng.sample(STOP_TOKENS[model], 1) if rng.random() < 0.4 else [],
        )
        prompt = [rng.randrange(0, 256) for _ in range(rng.randrange(1, 60))]
        arrival = rng.randrange(1, last_arrival)
        script.append(Import(arrival, f"i{i}", prompt, params, rng.randrange(3, 256), rng.randrange(0, 4)))
    return script


@pytest.fixture(params=["tiny-dense", "tiny-moe"])
def model(request) -> str:
    return request.param


# Scripts whose sampled tokens reach every finish reason on both models (seed 1's tiny-moe script ends on
# length and aborts only).
SCRIPT_SEEDS = (0, 2, 3)


@pytest.mark.parametrize("seed", SCRIPT_SEEDS)
def test_mixed_traffic_matches_the_synchronous_engine(model: str, seed: int) -> None:
    script = random_script(model, seed)
    config = dict(model=model, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    sync = run_script(script, EOS[model], **config)
    lookahead = run_script(script, EOS[model], async_scheduling=True, **config)
    assert_same(sync, lookahead)
    assert lookahead.engine.lookahead_steps > 0
    reasons = {r for r, _ in sync.finish_reasons()}
    assert {"stop", "length", "abort"} <= reasons, reasons


def test_penalised_requests_step_synchronously_and_match_the_synchronous_engine(model: str) -> None:
    """Penalties read a request's whole output, so a step with a penalised request runs synchronously;
    the outputs, events and totals stay the synchronous engine's, and penalised rows really run (their
    tokens differ from the same script's without penalties)."""
    script = random_script(model, 2)
    adds = [a for a in script if isinstance(a, Add)]
    penalised = [adds[1], adds[4], next(a for a in script if isinstance(a, Import))]
    for a in penalised:
        a.params = dataclasses.replace(
            a.params, repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.3
        )
    config = dict(model=model, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    sync = run_script(script, EOS[model], **config)
    lookahead = run_script(script, EOS[model], async_scheduling=True, **config)
    assert_same(sync, lookahead)
    assert lookahead.engine is not None and lookahead.engine.lookahead_steps > 0  # the rest still ran ahead
    for a in penalised:
        a.params = dataclasses.replace(
            a.params, repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0
        )
    plain = run_script(script, EOS[model], **config)
    assert any(plain.outputs[a.request_id] != sync.outputs[a.request_id] for a in penalised)


def test_biased_requests_with_a_minimum_length_run_ahead_and_match_the_synchronous_engine(model: str) -> None:
    """A logit bias and a minimum length need no history: every request biased and given one, the steps
    still run ahead, with the synchronous engine's outputs, and the bias shows in them."""
    config = dict(model=model, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    script = random_script(model, 3)
    plain = run_script(script, EOS[model], **config)
    for a in script:
        if isinstance(a, (Add, Import)):
            a.params = dataclasses.replace(
                a.params,
                logit_bias={STOP_TOKENS[model][0]: -100.0, 7: 5.0},
                min_tokens=min(4, a.params.max_tokens),  # reads the row's position, right also run ahead
            )
    sync = run_script(script, EOS[model], **config)
    lookahead = run_script(script, EOS[model], async_scheduling=True, **config)
    assert_same(sync, lookahead)
    assert lookahead.engine is not None and lookahead.engine.lookahead_steps > 0

    def sampled(trace: Trace) -> list[int]:
        return [t for outs in trace.outputs.values() for o in outs for t in o[0]]

    assert sampled(sync).count(7) > sampled(plain).count(7) and STOP_TOKENS[model][0] not in sampled(sync)


def test_traffic_mix_reaches_every_finish_kind(model: str) -> None:
    """The scripts above stop on EOS, on stop tokens and on stop strings, not only on length."""
    config = dict(model=model, num_kv_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    kinds: set[str] = set()
    for seed in SCRIPT_SEEDS:
        for reason, stop in run_script(random_script(model, seed), EOS[model], **config).finish_reasons():
            kinds.add(f"{reason}:{type(stop).__name__}")
    assert {"stop:NoneType", "stop:int", "stop:str", "length:NoneType", "abort:NoneType"} <= kinds, kinds


def test_tight_pool_preempts_and_evicts_the_same(model: str) -> None:
    """Few blocks: lookahead steps must not take blocks the synchronous engine would get from a
    finished request, nor evict cached blocks, nor skip a preemption."""
    script = random_script(model, seed=7, n=10, last_arrival=10)
    config = dict(model=model, num_kv_blocks=12, max_num_seqs=6, max_num_batched_tokens=48)
    sync = run_script(script, EOS[model], **config)
    lookahead = run_script(script, EOS[model], async_scheduling=True, **config)
    assert_same(sync, lookahead)
    assert sync.engine.scheduler.num_preemptions > 0
    assert lookahead.engine.scheduler.num_preemptions == sync.engine.scheduler.num_preemptions
    assert lookahead.engine.lookahead_steps > 0  # the engines compared really differ in how they step
    assert any(type(e).__name__ == "BlocksRemoved" for e in sync.events)  # evictions happened
    assert any(rid.startswith("i") for rid, _ in sync.aborted)  # and an import found no room


@pytest.mark.parametrize(("seed", "num_blocks"), [(5, 16), (7, 12), (8, 14), (11, 12)])
def test_full_pool_runs_ahead_without_evicting_cached_blocks(seed: int, num_blocks: int) -> None:
    """Cached blocks of finished requests fill the pool while others decode and stop on stop tokens.
    A lookahead step allocates before the request that stops frees its blocks: taking an evictable
    cached block then, where the synchronous engine reuses the freed one, would change the KV events
    and later prefix hits."""
    rng = random.Random(seed)
    script: list[Add | Abort] = [
        Add(
            0,
            f"w{i}",
            [rng.randrange(256) for _ in range(rng.choice((33, 49)))],
            SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True),
        )
        for i in range(3)
    ]
    for i in range(4):
        params = SamplingParams(
            max_tokens=rng.randrange(20, 60),
            temperature=0.0,
            ignore_eos=i == 0,
            stop_token_ids=rng.sample(STOP_TOKENS["tiny-dense"], 1),
        )
        script.append(Add(4, f"r{i}", [rng.randrange(256) for _ in range(rng.randrange(10, 30))], params))
    config = dict(model="tiny-dense", num_kv_blocks=num_blocks, max_num_seqs=8)
    sync = run_script(script, EOS["tiny-dense"], **config)
    lookahead = run_script(script, EOS["tiny-dense"], async_scheduling=True, **config)
    assert_same(sync, lookahead)
    assert lookahead.engine.lookahead_steps > 0


@pytest.mark.parametrize("max_model_len", [None, 30])
def test_steady_decode_overlaps_and_wastes_no_step(max_model_len: int | None) -> None:
    """Greedy decode of requests all present from the start: after the prefill every step runs ahead;
    max_tokens and max_model_len are known in advance, so no step is launched for a token past them."""
    rng = random.Random(5)
    lengths = [12, 20, 20, 31]
    script: list[Add | Abort] = [
        Add(
            0,
            f"r{i}",
            [rng.randrange(0, 256) for _ in range(9)],
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
        )
        for i, n in enumerate(lengths)
    ]
    config = dict(model="tiny-dense", num_kv_blocks=64, max_model_len=max_model_len)
    sync = run_script(script, **config)
    lookahead = run_script(script, async_scheduling=True, **config)
    assert_same(sync, lookahead)
    longest = max(len(sum((o[0] for o in outs), [])) for outs in sync.outputs.values())
    assert longest == (31 if max_model_len is None else 30 - 9)
    engine = lookahead.engine
    # Step 1 prefills and keeps token 1 on the device; each later step (tokens 2..longest) runs ahead;
    # the only drain reads the last token.
    assert engine.lookahead_steps == longest - 1
    assert engine.lookahead_drains == 1
    assert engine.stats().lookahead_steps == engine.lookahead_steps


def _drains_and_joins(script: list, **config) -> tuple[int, int]:
    sync = run_script(script, **config)
    lookahead = run_script(script, async_scheduling=True, **config)
    assert_same(sync, lookahead)
    return lookahead.engine.lookahead_drains, lookahead.engine.lookahead_joins


def test_new_prompts_join_the_step_in_flight() -> None:
    """Prompts arriving while requests decode join the next lookahead step whole (a mixed step: the
    decodes' tokens from the device, the prompts' from the host), with the synchronous engine's outputs,
    cached prefixes and KV events. Covered: several prompts at once, a prompt with a cached prefix, one
    whose only uncomputed token is its last (a decode-shaped join), one that stops at its first token,
    and a prompt arriving with an import's commit."""
    rng = random.Random(8)
    system = [rng.randrange(0, 256) for _ in range(40)]
    greedy = dict(temperature=0.0, ignore_eos=True)
    script: list = [
        Add(0, "a", [rng.randrange(0, 256) for _ in range(12)], SamplingParams(max_tokens=40, **greedy)),
        Add(0, "sys", system + [7, 8], SamplingParams(max_tokens=30, **greedy)),
        Add(5, "b", [rng.randrange(0, 256) for _ in range(23)], SamplingParams(max_tokens=12, **greedy)),
        Add(5, "c", system + [9], SamplingParams(max_tokens=9, temperature=0.9, seed=3)),  # cached prefix
        Add(9, "d", system[:33], SamplingParams(max_tokens=6, **greedy)),  # 32 cached: one token left
        Add(12, "one", [5, 6, 7], SamplingParams(max_tokens=1, **greedy)),
        Add(
            16, "e", [rng.randrange(0, 256) for _ in range(30)], SamplingParams(max_tokens=8, top_k=5, seed=1)
        ),
        Import(
            14, "i", [rng.randrange(0, 256) for _ in range(20)], SamplingParams(max_tokens=5, **greedy), 77, 2
        ),  # reserved at 14 (free blocks suffice: no drain), committed at 16 with "e" arriving
    ]
    config = dict(model="tiny-dense", num_kv_blocks=64, max_model_len=256)
    sync = run_script(script, **config)
    lookahead = run_script(script, async_scheduling=True, **config)
    assert_same(sync, lookahead)
    assert [o[5] for o in lookahead.outputs["c"]][0] == 32 and lookahead.outputs["d"][0][5] == 32
    engine = lookahead.engine
    # Every arrival joined (b, c, d, one, e, i). The one drain: the last token.
    assert engine.lookahead_joins == 6
    assert engine.lookahead_drains == 1
    # The benchmarks' comparison switch: prompts drain the step in flight, as before they could join.
    draining = run_script(script, join_prompts=False, async_scheduling=True, **config)
    assert_same(sync, draining)
    # One drain per prompt arrival step (5, 9, 12, 16) and one for the last token; the reservation at 14
    # drains in neither mode, as free blocks without cached content suffice for it.
    assert draining.engine.lookahead_joins == 0 and draining.engine.lookahead_drains == 5


def test_imports_that_finish_on_their_first_token() -> None:
    """An import whose first token ends it (max_tokens 1, or a stop token) finishes at its commit, with
    one output carrying that token, while other requests decode with a step in flight."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    script: list = [
        Add(0, "a", list(range(30, 50)), SamplingParams(max_tokens=20, **greedy)),
        Import(3, "one", list(range(60, 77)), SamplingParams(max_tokens=1, **greedy), 9, 1),
        Import(5, "stop", list(range(80, 90)), SamplingParams(max_tokens=9, stop_token_ids=[11]), 11),
        Import(6, "more", list(range(90, 99)), SamplingParams(max_tokens=4, **greedy), 12, 2),
    ]
    sync = run_script(script, model="tiny-dense", num_kv_blocks=64)
    lookahead = run_script(script, model="tiny-dense", num_kv_blocks=64, async_scheduling=True)
    assert_same(sync, lookahead)
    assert [o[:4] for o in lookahead.outputs["one"]] == [([9], True, "length", None)]
    assert [o[:4] for o in lookahead.outputs["stop"]] == [([11], True, "stop", 11)]
    assert sum(len(o[0]) for o in lookahead.outputs["more"]) == 3  # the first came with the handle


def test_prompts_that_would_differ_in_the_synchronous_step_drain_first() -> None:
    """No join when the synchronous scheduler could decide otherwise: a prompt that does not fit the
    token budget whole (it would be chunked), a pool that would have to evict, a request asking for
    logprobs. Outputs and events stay the synchronous engine's."""
    greedy = dict(temperature=0.0, ignore_eos=True)
    long_prompt = list(range(100, 160))  # 60 tokens against a budget of 64 with 8 decodes running
    decoders = [Add(0, f"r{i}", [i + 1] * 5, SamplingParams(max_tokens=30, **greedy)) for i in range(8)]
    chunked = [*decoders, Add(4, "long", long_prompt, SamplingParams(max_tokens=5, **greedy))]
    drains, joins = _drains_and_joins(chunked, model="tiny-moe", num_kv_blocks=64, max_num_batched_tokens=64)
    assert joins == 0 and drains >= 2
    # The same prompt joins where the budget holds it whole.
    drains, joins = _drains_and_joins(chunked, model="tiny-moe", num_kv_blocks=64, max_num_batched_tokens=128)
    assert joins == 1
    # 17 blocks of 16: "done" leaves 3 cached blocks, the four decoders hold 2 blocks each by step 12, so
    # 6 are free and uncached; "late" needs 7: the synchronous scheduler evicts a cached block for it.
    tight = [
        Add(0, "done", list(range(200, 250)), SamplingParams(max_tokens=1, **greedy)),
        *[Add(2, f"r{i}", [i + 1] * 10, SamplingParams(max_tokens=20, **greedy)) for i in range(4)],
        Add(12, "late", list(range(300, 400)), SamplingParams(max_tokens=3, **greedy)),
    ]
    sync = run_script(tight, model="tiny-dense", num_kv_blocks=17)
    lookahead = run_script(tight, model="tiny-dense", num_kv_blocks=17, async_scheduling=True)
    assert_same(sync, lookahead)
    assert any(isinstance(e, BlocksRemoved) for e in sync.events)  # "late" evicted a cached block
    assert lookahead.engine.lookahead_joins == 0
    logprobs = [*decoders[:2], Add(3, "lp", [1, 2, 3], SamplingParams(max_tokens=3, logprobs=1))]
    drains, joins = _drains_and_joins(logprobs, model="tiny-dense", num_kv_blocks=64)
    assert joins == 0


def test_finish_on_content_discards_the_token_in_flight() -> None:
    """A request that stops on EOS has its next step in flight already: that token is never emitted
    nor counted, its blocks come back, and its last block is not hashed with a token it never had."""
    prompt = list(range(10, 41))  # 31 tokens: the 32nd (first generated) fills block 2 of 16
    base = run_script([Add(0, "a", prompt, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))])
    tokens = [t for o in base.outputs["a"] for t in o[0]]
    ran = []
    for k in (1, 2, 5):  # stop on the k-th generated token
        eos = tokens[k - 1]
        if eos in tokens[: k - 1]:
            continue
        ran.append(k)
        script = [
            Add(0, "a", prompt, SamplingParams(max_tokens=20, temperature=0.0)),
            Add(0, "b", prompt[:20], SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)),
        ]
        sync = run_script(script, eos, model="tiny-dense", num_kv_blocks=32)
        lookahead = run_script(script, eos, model="tiny-dense", num_kv_blocks=32, async_scheduling=True)
        assert_same(sync, lookahead)
        assert [t for o in lookahead.outputs["a"] for t in o[0]] == tokens[:k]
        assert lookahead.totals[2] == k + 20
        assert lookahead.engine.lookahead_steps > 0
    assert ran == [1, 2, 5], "the prompt's first tokens must be distinct for every stop position to run"


def test_abort_of_a_request_in_flight_emits_its_token_first() -> None:
    script: list[Add | Abort] = [
        Add(0, "a", list(range(10, 30)), SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)),
        Add(0, "b", list(range(50, 60)), SamplingParams(max_tokens=30, temperature=0.8, ignore_eos=True)),
        Abort(6, "a"),
        Abort(9, "b"),
        Abort(12, "b"),  # already gone: False in both modes
    ]
    sync = run_script(script, model="tiny-moe", num_kv_blocks=32)
    lookahead = run_script(script, model="tiny-moe", num_kv_blocks=32, async_scheduling=True)
    assert_same(sync, lookahead)
    assert lookahead.aborted == [("a", True), ("b", True), ("b", False)]
    assert lookahead.outputs["a"][-1][2] == "abort" and lookahead.outputs["a"][-1][0] == []


def test_logprobs_and_hold_kv_run_synchronously() -> None:
    engine = LLMEngine(EngineConfig(model="tiny-dense", num_kv_blocks=64, async_scheduling=True))
    engine.add_request("lp", list(range(10, 20)), SamplingParams(max_tokens=6, temperature=0.0, logprobs=2))
    engine.add_request(
        "held", list(range(30, 50)), SamplingParams(max_tokens=6, temperature=0.0), hold_kv=True
    )
    got: dict[str, list[RequestOutput]] = {"lp": [], "held": []}
    while engine.has_unfinished():
        for out in engine.step():
            got[out.request_id].append(out)
    assert engine.lookahead_steps == 0 and engine.lookahead_drains == 0
    assert sum(len(o.new_logprobs) for o in got["lp"]) == 6
    assert got["held"][-1].finish_reason == "prefill_done" and engine.held_blocks("held")
    engine.release_held("held")
    assert engine.block_pool.num_free_blocks == 64


def _dense_engine(num_kv_blocks: int, async_scheduling: bool) -> tuple[LLMEngine, ListEventSink]:
    sink = ListEventSink()
    config = EngineConfig(model="tiny-dense", num_kv_blocks=num_kv_blocks, async_scheduling=async_scheduling)
    return LLMEngine(config, event_sink=sink), sink


def test_held_kv_and_imports_while_a_step_is_in_flight() -> None:
    """None of these drains the step in flight: release_held frees the held blocks right after that step's
    tokens are processed (where the synchronous engine freed them), reserve_import takes free blocks without
    cached content where they suffice, and the imported request joins the next lookahead step at
    commit_import. Outputs and KV events are the synchronous engine's."""
    prompt = list(range(100, 140))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    traces = []
    for async_scheduling in (False, True):
        engine, sink = _dense_engine(64, async_scheduling)
        engine.add_request("held", list(range(60, 95)), params, hold_kv=True)
        engine.add_request("a", list(range(10, 30)), params)
        outs: list[tuple] = []
        for _ in range(4):
            outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        drains = engine.lookahead_drains
        assert (engine._inflight is not None) == async_scheduling  # each call below meets a step in flight
        free = engine.block_pool.num_free_blocks
        assert engine.release_held("held")
        held_blocks = 3  # 35 tokens
        assert engine.block_pool.num_free_blocks == free + (0 if async_scheduling else held_blocks)
        outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        assert (engine._inflight is not None) == async_scheduling
        blocks = engine.reserve_import("b", prompt, params)
        assert len(blocks) == 3
        outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        assert (engine._inflight is not None) == async_scheduling
        engine.commit_import("b", 7)  # no KV was written: only the bookkeeping is compared
        assert engine.lookahead_drains == drains
        steps = engine.lookahead_steps
        outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        if async_scheduling:  # "b" joined the step after the one in flight, which was not drained
            assert engine.lookahead_steps == steps + 1 and engine.lookahead_drains == drains
            assert engine.lookahead_joins == 1
            assert [s.request_id for s in engine._inflight.seqs] == ["a", "b"]
        while engine.has_unfinished():
            outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        assert engine.block_pool.num_free_blocks == 64
        traces.append((outs, sink.events, engine.lookahead_steps))
    (sync_outs, sync_events, _), (lookahead_outs, lookahead_events, lookahead_steps) = traces
    for rid in ("held", "a", "b"):
        assert [o for o in lookahead_outs if o[0] == rid] == [o for o in sync_outs if o[0] == rid]
    assert lookahead_events == sync_events
    assert lookahead_steps > 0


def test_an_import_that_evicts_and_one_with_logprobs_match_the_synchronous_engine() -> None:
    """An import whose blocks need an eviction and one with logprobs (which does not join a lookahead step)
    end as in the synchronous engine."""
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    traces = []
    for async_scheduling in (False, True):
        engine, sink = _dense_engine(16, async_scheduling)
        outs: list[tuple] = []
        # A finished request leaves 3 cached, evictable blocks; then "a" decodes with a step in flight.
        engine.add_request("done", list(range(400, 450)), SamplingParams(max_tokens=2, temperature=0.0))
        while engine.has_unfinished():
            outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        engine.add_request("a", list(range(10, 60)), params)
        for _ in range(3):
            outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        assert (engine._inflight is not None) == async_scheduling
        drains = engine.lookahead_drains
        free = engine.block_pool.num_uncached_free_blocks
        engine.reserve_import("tight", list(range(200, 200 + 16 * (free + 1) - 3)), params)  # free + 1 blocks
        assert engine.lookahead_drains - drains == (1 if async_scheduling else 0)
        engine.commit_import("tight", 7)
        outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        engine.reserve_import("lp", list(range(300, 310)), SamplingParams(max_tokens=3, logprobs=2))
        outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        assert (engine._inflight is not None) == async_scheduling
        engine.commit_import("lp", 9)
        drains = engine.lookahead_drains
        outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        # "lp" asks for logprobs: it does not join; the step in flight is drained and the step is synchronous.
        assert engine.lookahead_drains - drains == (1 if async_scheduling else 0)
        assert engine.lookahead_joins == 0
        while engine.has_unfinished():
            outs += [(o.request_id, *_strip(o)) for o in engine.step()]
        assert engine.block_pool.num_free_blocks == 16
        traces.append((outs, sink.events))
    (sync_outs, sync_events), (lookahead_outs, lookahead_events) = traces
    for rid in ("done", "a", "tight", "lp"):
        assert [o for o in lookahead_outs if o[0] == rid] == [o for o in sync_outs if o[0] == rid]
    assert any(isinstance(e, BlocksRemoved) for e in sync_events)  # the import evicted a cached block
    assert lookahead_events == sync_events


def test_async_engine_streams_match_the_synchronous_engine() -> None:
    """The engine thread of the services (AsyncEngine): concurrent streams, one cancelled early."""
    rng = random.Random(2)
    prompts = [[rng.randrange(0, 256) for _ in range(rng.randrange(5, 40))] for _ in range(6)]
    params = [SamplingParams(max_tokens=10 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(6)]

    async def serve(async_scheduling: bool) -> dict[str, list[int]]:
        config = EngineConfig(model="tiny-moe", num_kv_blocks=128, async_scheduling=async_scheduling)
        aengine = AsyncEngine(config)
        aengine.start()
        try:

            async def one(i: int) -> tuple[str, list[int]]:
                tokens: list[int] = []
                stream = aengine.generate(f"r{i}", prompts[i], params[i])
                async for out in stream:
                    tokens += out.new_token_ids
                    if i == 5 and len(tokens) >= 4:
                        break
                await stream.aclose()  # a consumer that left early aborts its request
                return f"r{i}", tokens

            results = dict(await asyncio.gather(*(one(i) for i in range(6))))
            stats = await aengine.call(aengine.engine.stats)
            assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
            assert stats.num_running == stats.num_waiting == 0
            assert (stats.lookahead_steps > 0) == async_scheduling  # the lookahead really ran (or not)
            return results
        finally:
            aengine.stop()

    sync = asyncio.run(serve(False))
    lookahead = asyncio.run(serve(True))
    for rid in sync:
        n = len(sync[rid]) if rid != "r5" else 4
        assert lookahead[rid][:n] == sync[rid][:n], rid
    assert [len(lookahead[f"r{i}"]) for i in range(5)] == [p.max_tokens for p in params[:5]]


def _gpu_script(model: str, stop_early: bool) -> list[Add | Abort | Import]:
    rng = random.Random(11)
    script: list[Add | Abort | Import] = [
        Add(
            rng.randrange(0, 6) if i < 16 else rng.randrange(6, 30),  # the late ones join steps in flight
            f"r{i}",
            [rng.randrange(3, 256) for _ in range(rng.randrange(2, 70))],
            SamplingParams(
                max_tokens=rng.randrange(8, 40),
                temperature=0.0,
                ignore_eos=not stop_early or i % 3 == 0,
                stop_token_ids=STOP_TOKENS[model][:1] if stop_early and i % 4 == 1 else [],
            ),
        )
        for i in range(24)
    ]
    script.append(Abort(15, "r1"))
    for i in range(8):  # decode-worker arrivals: reserved, zeroed, committed after a simulated pull
        params = SamplingParams(
            max_tokens=rng.randrange(4, 30),
            temperature=0.0,
            ignore_eos=not stop_early or i % 2 == 0,
            logprobs=2 if i == 5 else None,
        )
        prompt = [rng.randrange(3, 256) for _ in range(rng.randrange(1, 50))]
        script.append(Import(rng.randrange(2, 24), f"i{i}", prompt, params, rng.randrange(3, 256), i % 3))
    return script


@needs_gpu
@pytest.mark.parametrize("stop_early", [False, True])
@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_cuda_graphs_lookahead_gives_synchronous_greedy_tokens(model: str, stop_early: bool) -> None:
    """Triton ops with CUDA graphs, float32. Without early stops every lookahead step has exactly the
    synchronous step's batch. With EOS and stop tokens, a request that stops keeps its row in the step
    already in flight, so the other rows ran in a batch one larger than the synchronous one: a failure
    only there means a kernel's result for one row depends on the batch size, not a scheduling bug."""
    config = dict(
        model=model,
        device="cuda",
        dtype="float32",
        kernel_backend="triton",
        cuda_graphs=True,
        num_kv_blocks=512,
    )
    script = _gpu_script(model, stop_early)
    sync = run_script(script, EOS[model], **config)
    lookahead = run_script(script, EOS[model], async_scheduling=True, **config)
    assert_same(sync, lookahead)
    engine = lookahead.engine
    assert engine.runner.graphs is not None and sum(engine.runner.graphs.replays.values()) > 0
    assert engine.lookahead_steps > 0
    # 8 imports at most: new prompts joined steps in flight too (mixed steps through the prefill graphs).
    assert engine.lookahead_joins > 8
    # The loop waited for steps in flight to reach their last graph piece, and the outputs stayed the same.
    assert engine.lookahead_late_waits > 0
    if stop_early:
        assert any(outs[-1][2] == "stop" for outs in sync.outputs.values())


def test_serving_loop_waits_for_the_late_point_of_the_step_in_flight() -> None:
    """``wait_for_lookahead_point`` waits on the step in flight's late point only: not without a step in
    flight, not for a step without decode graphs (the CPU's: no late point), not with the setting off.
    The CUDA event, which this machine cannot record, is a stand-in that counts its waits; the GPU test
    above waits on real ones."""
    engine, _ = _dense_engine(64, async_scheduling=True)
    engine.wait_for_lookahead_point()  # nothing in flight
    engine.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=6, temperature=0.0))
    for _ in range(3):
        engine.step()
    assert engine._inflight is not None and engine._inflight.late_point is None  # no decode graph
    engine.wait_for_lookahead_point()
    assert engine.lookahead_late_waits == 0

    class Point:
        waits = 0

        def synchronize(self) -> None:
            Point.waits += 1

    engine._inflight.late_point = Point()  # type: ignore[assignment]
    engine.wait_for_lookahead_point()
    assert Point.waits == 1 and engine.lookahead_late_waits == 1
    engine.config.lookahead_late_launch = False
    engine.wait_for_lookahead_point()
    assert Point.waits == 1 and engine.lookahead_late_waits == 1
    engine.config.lookahead_late_launch = True
    while engine.has_unfinished():
        engine.step()
    engine.wait_for_lookahead_point()  # drained at the end: nothing in flight
    assert Point.waits == 1


def test_late_point_is_recorded_before_the_last_graph_piece() -> None:
    """The decode step's pieces launch in order with the late point between the last two (a single piece:
    before it). Stand-ins for the graphs and the event record the order; the replay logic is the engine's."""
    from engine.cuda_graphs import _Graph

    order: list[str] = []

    class Piece:
        def __init__(self, name: str) -> None:
            self.name = name

        def replay(self) -> None:
            order.append(self.name)

    class Point:
        def record(self) -> None:
            order.append("late")

    _Graph(size=1, pieces=[Piece(f"p{i}") for i in range(6)]).replay(Point())  # type: ignore[list-item]
    assert order == ["p0", "p1", "p2", "p3", "p4", "late", "p5"]
    order.clear()
    _Graph(size=1, pieces=[Piece("only")]).replay(Point())  # type: ignore[list-item]
    assert order == ["late", "only"]
    order.clear()
    _Graph(size=1, pieces=[Piece("a"), Piece("b")]).replay()  # type: ignore[list-item]
    assert order == ["a", "b"]


def test_priorities_and_bad_words_run_ahead_as_the_synchronous_engine_runs(model: str) -> None:
    """The priority policy's queue order and its preemptions, and bad words (one-token words run ahead,
    words of several tokens need the output and run synchronously): the same outputs either way, still
    with lookahead steps, and the bans show."""
    config = dict(model=model, num_kv_blocks=24, max_num_seqs=6, max_num_batched_tokens=64,
                  scheduling_policy="priority")  # fmt: skip
    script = random_script(model, 4)
    rng = random.Random(4)
    for i, a in enumerate(script):
        if isinstance(a, (Add, Import)):
            words = ["e", "a"] if i % 3 else ["e", "th"]
            a.params = dataclasses.replace(a.params, priority=rng.choice((-1, 0, 0, 3)), bad_words=words)
    sync = run_script(script, EOS[model], **config)
    lookahead = run_script(script, EOS[model], async_scheduling=True, **config)
    assert_same(sync, lookahead)
    assert lookahead.engine is not None and lookahead.engine.lookahead_steps > 0
    tokenizer = sync.engine.tokenizer
    checked = 0
    for a in script:
        if isinstance(a, Add):  # (an import's first token is the script's, not sampled here)
            banned = {
                tokenizer.encode(w, add_special_tokens=False)[0] for w in a.params.bad_words if len(w) == 1
            }
            tokens = [t for o in sync.outputs[a.request_id] for t in o[0]]
            assert not banned & set(tokens), a.request_id
            checked += len(tokens)
    assert checked > 100
