"""The engine's side of KV offloading (``engine.kv_offload``): blocks held while the store reads them, blocks
loaded into reserved blocks entering the prefix cache, and no block leaked either way."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.kv_offload import KVOffload, layout_for_model
from mesh.block_hash import block_hashes
from mesh.kv_events import BlocksStored, ListEventSink, Tier

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
BS = 16
PROMPT = [(i * 37 + 11) % 256 for i in range(100)]  # six full blocks and four tokens


def _llm(events: ListEventSink | None = None) -> LLM:
    llm = LLM("tiny-dense", num_kv_blocks=64)
    if events is not None:
        llm.engine.block_pool.event_sink = events
    return llm


def test_layout_for_model_is_the_engines_without_loading_weights() -> None:
    llm = _llm()
    assert layout_for_model("tiny-dense") == llm.engine.layout
    assert layout_for_model("tiny-dense", kv_cache_dtype="fp8").fingerprint != llm.engine.layout.fingerprint


def test_finished_requests_blocks_are_held_until_the_store_answers_then_known() -> None:
    llm = _llm()
    engine = llm.engine
    offload = engine.enable_kv_offload(max_held_blocks=32)
    woken = []
    offload.on_ready = lambda: woken.append(1)
    total = engine.block_pool.num_blocks
    llm.generate([PROMPT], GREEDY)
    # 112 tokens, the last one's KV never computed: six full blocks, all of the prompt.
    chain = block_hashes(PROMPT, BS, engine.root_hash)
    assert woken and offload.num_held_blocks == 6
    assert engine.block_pool.num_free_blocks == total - 6  # referenced: not reusable while the store reads
    (batch,) = offload.take()
    assert batch.parent_hash is None and list(batch.block_hashes) == chain
    assert [engine.block_pool.hash_to_block[h] for h in batch.block_hashes] == list(batch.block_ids)
    offload.finish(batch.batch_id, batch.block_hashes[:4])  # the store kept four of them
    assert offload.num_held_blocks == 0 and engine.block_pool.num_free_blocks == total
    assert offload.blocks_stored == 4
    # The same prompt again: the four blocks the store holds are not offered again, the rest are.
    llm.generate([PROMPT], GREEDY)
    (again,) = offload.take()
    assert again.parent_hash == chain[3] and again.block_hashes == batch.block_hashes[4:]
    offload.finish(again.batch_id)  # a failed Put: nothing known, references dropped all the same
    assert engine.block_pool.num_free_blocks == total


def test_offload_holds_at_most_max_held_blocks() -> None:
    llm = _llm()
    offload = llm.engine.enable_kv_offload(max_held_blocks=3)
    llm.generate([PROMPT], GREEDY)
    assert offload.num_held_blocks == 3 and offload.blocks_dropped == 3
    assert offload.drop_queued() == 3
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


@pytest.mark.parametrize("local_blocks", [0, 2])
def test_loaded_blocks_are_hit_by_the_request_added_next_with_the_same_tokens(local_blocks: int) -> None:
    source = _llm()
    expected = source.generate([PROMPT], GREEDY)[0]
    src = source.engine
    chain = block_hashes(PROMPT, BS, src.root_hash)[: (len(PROMPT) - 1) // BS]
    source_blocks = [src.block_pool.hash_to_block[h] for h in chain]

    events = ListEventSink()
    llm = _llm(events)
    engine = llm.engine
    offload: KVOffload = engine.enable_kv_offload(max_held_blocks=32)
    if local_blocks:  # the first blocks are cached here already: only the rest is loaded
        llm.generate([PROMPT[: local_blocks * BS + 1]], SamplingParams(max_tokens=1))
        offload.drop_queued()
    assert offload.local_prefix(chain) == local_blocks
    events.drain()
    wanted = chain[local_blocks:]
    blocks = offload.reserve_load("r1", wanted, chain[local_blocks - 1] if local_blocks else None)
    assert len(blocks) == len(wanted)
    # The READ: the source's blocks' bytes into the reserved ones.
    engine.kv_pool[blocks] = src.kv_pool[source_blocks[local_blocks:]]
    assert offload.commit_load("r1") == len(wanted)
    stored = [e for e in events.drain() if isinstance(e, BlocksStored)]
    assert stored == [
        BlocksStored(tuple(wanted), Tier.GPU, chain[local_blocks - 1] if local_blocks else None)
    ]
    out = llm.generate([PROMPT], GREEDY)[0]
    assert out.token_ids == expected.token_ids
    assert out.num_cached_tokens == len(chain) * BS
    offload.drop_queued()
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_a_cancelled_or_impossible_load_leaks_no_block() -> None:
    llm = _llm()
    engine = llm.engine
    offload = engine.enable_kv_offload(max_held_blocks=32)
    total = engine.block_pool.num_blocks
    chain = block_hashes(PROMPT, BS, engine.root_hash)
    assert len(offload.reserve_load("a", chain, None)) == len(chain)
    assert engine.block_pool.num_free_blocks == total - len(chain)
    with pytest.raises(ValueError):
        offload.reserve_load("a", chain, None)
    assert offload.cancel_load("a") and not offload.cancel_load("a")
    assert engine.block_pool.num_free_blocks == total
    assert offload.reserve_load("big", list(range(1, total + 2)), None) == []  # more than the pool: nothing
    assert offload.num_loads == 0 and engine.block_pool.num_free_blocks == total
    assert not engine.block_pool.hash_to_block  # cancelled blocks never entered the prefix cache
    # A hash that got cached meanwhile keeps its block; the loaded copy is freed.
    llm.generate([PROMPT], SamplingParams(max_tokens=1))
    offload.drop_queued()
    blocks = offload.reserve_load("b", chain[:2], None)
    before = dict(engine.block_pool.hash_to_block)
    assert offload.commit_load("b") == 0
    assert engine.block_pool.hash_to_block == before and all(b not in before.values() for b in blocks)
    assert engine.block_pool.num_free_blocks == total


def test_store_answers_and_cancelled_loads_meet_a_step_in_flight_without_reading_it_out() -> None:
    """With asynchronous scheduling, an offload's answer and a cancelled load free their blocks right after
    the step in flight is processed (no drain); outputs and KV events are the synchronous engine's."""
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    other = [(i * 53 + 7) % 256 for i in range(40)]
    loaded = block_hashes([(i * 29 + 3) % 256 for i in range(70)], BS, 12345)[:4]  # any chain
    traces = []
    for async_scheduling in (False, True):
        events = ListEventSink()
        config = EngineConfig(model="tiny-dense", num_kv_blocks=64, async_scheduling=async_scheduling)
        engine = LLMEngine(config, event_sink=events)
        offload = engine.enable_kv_offload(max_held_blocks=32)
        outs: list[tuple] = []

        def step(engine=engine, outs=outs) -> None:
            outs.extend((o.request_id, tuple(o.new_token_ids), o.finish_reason) for o in engine.step())

        engine.add_request("first", PROMPT, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
        while engine.has_unfinished():
            step()
        (batch,) = offload.take()
        engine.add_request("long", other, GREEDY)
        for _ in range(3):
            step()
        assert (engine._inflight is not None) == async_scheduling  # the calls below meet a step in flight
        drains = engine.lookahead_drains
        offload.finish(batch.batch_id, batch.block_hashes[:3])
        assert offload.num_held_blocks == (6 if async_scheduling else 0)  # freed once that step is processed
        assert len(offload.reserve_load("r", loaded, None)) == 4
        assert offload.cancel_load("r")
        step()
        assert offload.num_held_blocks == 0 and offload.num_loads == 0
        assert engine.lookahead_drains == drains
        while engine.has_unfinished():
            step()
        assert offload.drop_queued() > 0  # "long"'s blocks, offered when it finished
        assert engine.block_pool.num_free_blocks == 64
        traces.append((outs, events.events))
    assert traces[0] == traces[1]
    assert traces[1][0][-1] == ("long", traces[1][0][-1][1], "length")


def test_with_at_prefill_a_prompt_is_offered_at_its_first_token_and_the_rest_when_it_finishes() -> None:
    llm = _llm()
    engine = llm.engine
    offload = engine.enable_kv_offload(max_held_blocks=32, at_prefill=True)
    total = engine.block_pool.num_blocks
    engine.add_request("r", PROMPT, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    engine.step()  # the prompt and its first token
    chain = block_hashes(PROMPT, BS, engine.root_hash)
    (prompt_batch,) = offload.take()
    assert list(prompt_batch.block_hashes) == chain and engine.has_unfinished()  # still decoding
    offload.finish(prompt_batch.batch_id, prompt_batch.block_hashes)
    while engine.has_unfinished():
        engine.step()
    (rest,) = offload.take()  # 130 tokens, the last one's KV never computed: eight full blocks
    assert rest.parent_hash == chain[-1] and len(rest.block_hashes) == 129 // BS - len(chain)
    offload.finish(rest.batch_id)
    assert engine.block_pool.num_free_blocks == total
    # A disaggregated request's blocks wait for its KV lease to end, and an imported prompt for its finish.
    engine.add_request("held", [t + 1 for t in PROMPT], SamplingParams(max_tokens=4), hold_kv=True)
    engine.step()
    assert offload.take() == []
    assert engine.release_held("held")
    (held,) = offload.take()
    offload.finish(held.batch_id)
    assert engine.block_pool.num_free_blocks == total
