"""Routing with a KV offload store: the blocks a store holds count for every worker (any worker can load
them), at the store's tiers and beyond each worker's own prefix; the store itself is never a candidate."""

from __future__ import annotations

import pytest

from mesh.block_hash import block_hashes, root_hash
from mesh.kv_events import BlocksStored, Tier
from mesh.kv_index import InProcessKVIndex, PrefixMatch
from router.chooser import RouteRequest
from router.metrics import RouterMetrics
from router.prefix_index import PrefixIndex
from router.scored_chooser import ScoredChooser
from router.scoring import PrefixScorer, RoutingRequest
from router.worker_pool import DECODE, PREFILL
from tests.mesh_fixtures import async_test
from tests.test_router_routing import BS, FP, make_pool, tokens
from tests.test_scoring import ws


def _request(matches: dict[str, PrefixMatch], offload: PrefixMatch | None) -> RoutingRequest:
    return RoutingRequest(
        prompt_len_tokens=10 * BS,
        block_hashes=list(range(1, 11)),
        block_size=BS,
        model_fingerprint=FP,
        prefix_matches=matches,
        offload_match=offload,
    )


def test_store_blocks_count_beyond_each_workers_own_prefix_at_the_stores_tiers() -> None:
    store = PrefixMatch.from_counts(0, 6, 2)  # 8 blocks: 6 in host memory, 2 on disk
    r = _request({"a": PrefixMatch.from_counts(4, 0, 0), "c": PrefixMatch.from_counts(9, 0, 0)}, store)
    a = r.match_of("a")
    assert a is not None and a.blocks == 8
    assert a.blocks_by_tier[Tier.GPU] == 4 and a.blocks_by_tier[Tier.CPU] + a.blocks_by_tier[Tier.DISK] == 4
    assert r.match_of("b") == PrefixMatch(8, {Tier.CPU: 6, Tier.DISK: 2})  # nothing of its own
    assert r.match_of("c") == PrefixMatch.from_counts(9, 0, 0)  # its own prefix is longer
    assert r.cached_blocks("b") == 8
    scores = PrefixScorer().score(r, [ws("a"), ws("b"), ws("c")])
    assert scores["c"] > scores["a"] > scores["b"] == pytest.approx((6 * 0.8 + 2 * 0.25) / 10)
    assert _request({}, None).match_of("b") is None


@async_test
async def test_a_store_holding_the_prompt_lets_the_decode_worker_prefill_locally_and_is_never_chosen() -> (
    None
):
    pool, metrics, index = make_pool(2, 1), RouterMetrics(), InProcessKVIndex()
    prompt = tokens(640)
    index.apply_sync("kvstore-1", [BlocksStored(tuple(block_hashes(prompt, BS, root_hash(FP))), Tier.CPU)])
    chooser = ScoredChooser("prefix", pool, metrics, PrefixIndex(metrics, in_process=index), seed=1)
    # Not known as a store (no registry): an index entry of an unknown worker, credited to nobody.
    rr = RouteRequest("r1", prompt)
    decode = await chooser.choose(DECODE, rr, pool.by_role(DECODE))
    assert not (await chooser.local_prefill(rr, pool.by_role(PREFILL), decode.worker)).prefill_on_decode
    # Registered as a store: the decode worker can load all 40 blocks, so it prefills the rest itself.
    pool.kvstore_ids = frozenset({"kvstore-1"})
    rr = RouteRequest("r2", prompt)
    decode = await chooser.choose(DECODE, rr, pool.by_role(DECODE))
    local = await chooser.local_prefill(rr, pool.by_role(PREFILL), decode.worker)
    assert local.prefill_on_decode
    choice = await chooser.choose(PREFILL, RouteRequest("r3", prompt), pool.by_role(PREFILL))
    assert choice.worker.name in {"p0", "p1"}
