"""Routing policy: each scorer's formula, the pickers' decisions and reasons, and the PD decider."""

from __future__ import annotations

import collections

import pytest

from mesh.kv_events import Tier
from mesh.kv_index import PrefixMatch
from mesh.registry import WorkerInfo
from router.scoring import (
    Decision,
    KVHeadroomScorer,
    LoadScorer,
    NoEligibleWorkerError,
    PDDecider,
    PrefixScorer,
    RandomPicker,
    RoundRobinPicker,
    RoutingRequest,
    SessionAffinity,
    WeightedPicker,
    WorkerState,
    WorkerStats,
    eligible,
    make_picker,
)

FP = "model-a"
BS = 16


def ws(
    wid: str,
    *,
    role: str = "prefill",
    fp: str = FP,
    block_size: int = BS,
    draining: bool = False,
    num_kv_blocks: int = 1000,
    **stats: float,
) -> WorkerState:
    info = WorkerInfo(
        wid,
        role,
        f"127.0.0.1:{abs(hash(wid)) % 10000 + 20000}",
        fp,
        block_size,
        num_kv_blocks,
        draining=draining,
    )
    return WorkerState(info, WorkerStats(**stats))  # type: ignore[arg-type]


def req(
    blocks: int = 10,
    matches: dict[str, PrefixMatch] | None = None,
    session: str | None = None,
    prompt_len: int | None = None,
) -> RoutingRequest:
    return RoutingRequest(
        prompt_len_tokens=prompt_len if prompt_len is not None else blocks * BS,
        block_hashes=list(range(1, blocks + 1)),
        block_size=BS,
        model_fingerprint=FP,
        session_id=session,
        prefix_matches=matches or {},
    )


def m(gpu: int = 0, cpu: int = 0, disk: int = 0) -> PrefixMatch:
    return PrefixMatch.from_counts(gpu, cpu, disk)


# --- scorers ------------------------------------------------------------------------------------------


def test_prefix_scorer_weights_tiers_over_prompt_blocks() -> None:
    cands = [ws("a"), ws("b"), ws("c"), ws("d")]
    r = req(blocks=10, matches={"a": m(gpu=10), "b": m(gpu=2, cpu=5), "c": m(disk=4)})
    got = PrefixScorer().score(r, cands)
    assert got["a"] == pytest.approx(1.0)
    assert got["b"] == pytest.approx((2 * 1.0 + 5 * 0.8) / 10)
    assert got["c"] == pytest.approx(4 * 0.25 / 10)
    assert got["d"] == 0.0
    custom = PrefixScorer(tier_weights={Tier.GPU: 1.0, Tier.CPU: 0.5, Tier.DISK: 0.0})
    assert custom.score(r, cands)["b"] == pytest.approx((2 + 2.5) / 10)
    assert custom.score(r, cands)["c"] == 0.0
    # No full block in the prompt: nothing can be cached.
    assert PrefixScorer().score(req(blocks=0), cands) == dict.fromkeys("abcd", 0.0)


def test_load_scorer_formula() -> None:
    cands = [
        ws("idle"),
        ws("busy", queued_tokens=12000, running_tokens=4000, kv_usage=0.5),
        ws("half", queued_tokens=8000, kv_usage=1.3),  # kv_usage clamped to 1
    ]
    got = LoadScorer().score(req(), cands)
    # T_ref = max(8192, 16000) = 16000
    assert got["idle"] == pytest.approx(1.0)
    assert got["busy"] == pytest.approx(1 - (0.5 * 16000 / 16000 + 0.5 * 0.5))
    assert got["half"] == pytest.approx(1 - (0.5 * 8000 / 16000 + 0.5 * 1.0))
    # Lightly loaded workers are compared against the floor, not against each other.
    light = LoadScorer().score(req(), [ws("x", running_tokens=100), ws("y", running_tokens=200)])
    assert light["x"] == pytest.approx(1 - 0.5 * 100 / 8192)
    assert light["y"] == pytest.approx(1 - 0.5 * 200 / 8192)
    tokens_only = LoadScorer(token_weight=1.0, kv_weight=0.0).score(req(), cands)
    assert tokens_only["half"] == pytest.approx(0.5)
    with pytest.raises(ValueError):
        LoadScorer(token_weight=0, kv_weight=0)


def test_kv_headroom_scorer_formula() -> None:
    cands = [
        ws("roomy", role="decode", num_kv_blocks_free=900, num_kv_blocks_total=1000),
        ws("tight", role="decode", num_kv_blocks_free=5, num_kv_blocks_total=1000),
        ws("unreported", role="decode", num_kv_blocks=500, num_kv_blocks_free=100),
        ws("empty-pool", role="decode", num_kv_blocks=0),
    ]
    r = req(blocks=6, prompt_len=100)  # ceil(100 / 16) = 7 blocks
    got = KVHeadroomScorer().score(r, cands)
    assert got["roomy"] == pytest.approx((900 - 7) / 1000)
    assert got["tight"] == 0.0  # cannot hold the request without preempting
    assert got["unreported"] == pytest.approx((100 - 7) / 500)
    assert got["empty-pool"] == 0.0
    reserved = KVHeadroomScorer(reserve_output_tokens=60).score(r, cands)  # ceil(160 / 16) = 10
    assert reserved["roomy"] == pytest.approx((900 - 10) / 1000)


# --- eligibility ----------------------------------------------------------------------------------------


def test_draining_and_mismatched_workers_are_never_picked() -> None:
    cands = [
        ws("ok"),
        ws("draining", draining=True),
        ws("bs32", block_size=32),
        ws("other-model", fp="model-b"),
    ]
    # The excluded ones hold the whole prompt and are idle; they must still lose.
    matches = {w: m(gpu=10) for w in ("draining", "bs32", "other-model")}
    r = req(matches=matches)
    assert [c.worker_id for c in eligible(r, cands)] == ["ok"]
    for picker in (WeightedPicker(seed=0), RoundRobinPicker(), RandomPicker(seed=0)):
        for _ in range(5):
            d = picker.pick(r, cands)
            assert (d.worker_id, d.reason) == ("ok", "only_candidate")
    with pytest.raises(NoEligibleWorkerError, match=r"draining.*block_size 32 != 16.*'model-b' != 'model-a'"):
        WeightedPicker().pick(r, cands[1:])
    with pytest.raises(NoEligibleWorkerError, match="no workers registered"):
        RandomPicker().pick(r, [])


# --- weighted picker ------------------------------------------------------------------------------------


def test_weighted_picker_combines_scores_with_weights() -> None:
    cands = [ws("cached", running_tokens=8000), ws("idle")]
    r = req(blocks=10, matches={"cached": m(gpu=10)})
    d = WeightedPicker(seed=0).pick(r, cands)
    # cached: 3 * 1.0 + 2 * (1 - 0.5 * 8000 / 8192); idle: 3 * 0 + 2 * 1.0
    assert d.scores["cached"] == pytest.approx(3.0 + 2 * (1 - 0.5 * 8000 / 8192))
    assert d.scores["idle"] == pytest.approx(2.0)
    assert (d.worker_id, d.reason) == ("cached", "prefix")
    assert d.scorer_scores["prefix"] == {"cached": 1.0, "idle": 0.0}
    # With prefix weighted down, load decides: 0.5 * 1.0 + 2 * 0.51 < 2 * 1.0.
    load_first = WeightedPicker([(PrefixScorer(), 0.5), (LoadScorer(), 2.0)], seed=0).pick(r, cands)
    assert (load_first.worker_id, load_first.reason) == ("idle", "load")


def test_weighted_picker_breaks_ties_at_random_reproducibly() -> None:
    cands = [ws(f"w{i}") for i in range(4)]
    r = req()

    def picks(seed: int) -> list[str]:
        picker = WeightedPicker(seed=seed)
        return [picker.pick(r, cands).worker_id for _ in range(200)]

    first = picks(1)
    assert picks(1) == first  # seeded: reproducible
    assert picks(2) != first
    counts = collections.Counter(first)
    assert set(counts) == {"w0", "w1", "w2", "w3"}
    assert min(counts.values()) > 25  # roughly uniform, not the first id every time
    assert WeightedPicker(seed=1).pick(r, cands).reason == "tie"


def test_hotspot_guard_falls_back_to_load() -> None:
    margin = 8000
    hot = ws("hot", queued_tokens=30000)
    cands = [hot, ws("cool", running_tokens=1000), ws("cold", running_tokens=20000)]
    r = req(blocks=10, matches={"hot": m(gpu=10)})
    picker = WeightedPicker(hotspot_margin_tokens=margin, seed=0)
    d = picker.pick(r, cands)
    assert (d.worker_id, d.reason) == ("cool", "hotspot_guard")
    assert d.scores["hot"] > d.scores["cool"]  # the cache hit would have won without the guard
    # Within the margin, the cache hit wins.
    within = [ws("hot", queued_tokens=8500), ws("cool", running_tokens=1000)]
    assert WeightedPicker(hotspot_margin_tokens=margin, seed=0).pick(r, within).reason == "prefix"
    # Guard off: the hot worker wins.
    unguarded = WeightedPicker(hotspot_margin_tokens=None, seed=0).pick(r, cands)
    assert (unguarded.worker_id, unguarded.reason) == ("hot", "prefix")


def test_session_affinity_sticks_unless_ineligible_or_hot() -> None:
    affinity = SessionAffinity(capacity=100)
    picker = WeightedPicker(hotspot_margin_tokens=8000, affinity=affinity, seed=0)
    a, b = ws("a"), ws("b", running_tokens=3000)
    first = picker.pick(req(matches={"a": m(gpu=10)}, session="s1"), [a, b])
    assert (first.worker_id, first.reason) == ("a", "prefix")
    # Next turn: b now holds more of the prompt, but the session stays on a.
    again = picker.pick(req(matches={"b": m(gpu=10)}, session="s1"), [a, b])
    assert (again.worker_id, again.reason) == ("a", "affinity")
    # a is draining now: the session moves, and the new worker becomes its home.
    moved = picker.pick(req(session="s1"), [ws("a", draining=True), b])
    assert moved.worker_id == "b" and moved.reason == "only_candidate"
    assert affinity.get("s1") == "b"
    # b is over the hot-spot margin: no affinity, the load choice wins.
    hot_b = ws("b", queued_tokens=20000)
    d = picker.pick(req(session="s1"), [ws("a"), hot_b])
    assert (d.worker_id, d.reason) == ("a", "load")
    # Requests without a session are not affected and not recorded.
    picker.pick(req(), [a, b])
    assert len(affinity) == 1


def test_session_affinity_is_a_bounded_lru() -> None:
    aff = SessionAffinity(capacity=2)
    aff.record("s1", "a")
    aff.record("s2", "b")
    assert aff.get("s1") == "a"  # s1 is now the most recently used
    aff.record("s3", "c")
    assert (aff.get("s1"), aff.get("s2"), aff.get("s3")) == ("a", None, "c")
    assert len(aff) == 2


# --- baseline pickers -----------------------------------------------------------------------------------


def test_round_robin_cycles_in_worker_id_order() -> None:
    cands = [ws("c"), ws("a"), ws("b")]
    picker = RoundRobinPicker()
    got = [picker.pick(req(), cands) for _ in range(6)]
    assert [d.worker_id for d in got] == ["a", "b", "c", "a", "b", "c"]
    assert {d.reason for d in got} == {"round_robin"}


def test_random_picker_is_seedable_and_covers_all() -> None:
    cands = [ws("a"), ws("b"), ws("c")]

    def run(seed: int) -> list[Decision]:
        picker = RandomPicker(seed=seed)
        return [picker.pick(req(), cands) for _ in range(60)]

    seq = run(3)
    assert [d.worker_id for d in run(3)] == [d.worker_id for d in seq]
    assert {d.worker_id for d in seq} == {"a", "b", "c"}
    assert {d.reason for d in seq} == {"random"}


def test_make_picker_routing_modes() -> None:
    assert isinstance(make_picker("round_robin", "prefill"), RoundRobinPicker)
    assert isinstance(make_picker("random", "decode", seed=1), RandomPicker)
    prefill = make_picker("prefix", "prefill", seed=0)
    assert isinstance(prefill, WeightedPicker)
    assert [(s.name, w) for s, w in prefill.scorers] == [("prefix", 3.0), ("load", 2.0)]
    decode = make_picker("prefix", "decode", seed=0)
    assert isinstance(decode, WeightedPicker)
    cands = [
        ws("full", role="decode", num_kv_blocks_free=10, num_kv_blocks_total=1000, kv_usage=0.99),
        ws("free", role="decode", num_kv_blocks_free=990, num_kv_blocks_total=1000, kv_usage=0.01),
    ]
    d: Decision = decode.pick(req(), cands)
    assert d.worker_id == "free" and d.reason == "kv_headroom"
    with pytest.raises(ValueError, match="round_robin"):
        make_picker("cache_aware", "prefill")


# --- PD decider -----------------------------------------------------------------------------------------


def test_pd_decider_threshold_on_uncached_tokens() -> None:
    decider = PDDecider(threshold_tokens=256)
    prefill = [ws("p0"), ws("p1"), ws("p-draining", draining=True)]
    prompt = 64 * BS  # 1024 tokens
    # Best prefix on an eligible prefill worker: 50 blocks = 800 tokens -> 224 uncached < 256: local.
    r = req(blocks=64, matches={"p0": m(gpu=10), "p1": m(cpu=50), "p-draining": m(gpu=64)})
    d = decider.decide(r, prefill)
    assert (d.prefill_on_decode, d.uncached_tokens, d.reason) == (True, prompt - 800, "short_uncached")
    # 48 blocks = 768 tokens -> 256 uncached, not below the threshold: prefill worker.
    r = req(blocks=64, matches={"p1": m(gpu=48)})
    d = decider.decide(r, prefill)
    assert (d.prefill_on_decode, d.uncached_tokens, d.reason) == (False, 256, "long_uncached")
    # A short prompt with nothing cached.
    assert decider.decide(req(blocks=2, prompt_len=40), prefill).prefill_on_decode is True
    # No eligible prefill worker at all.
    d = decider.decide(req(blocks=64), [ws("p-draining", draining=True)])
    assert (d.prefill_on_decode, d.reason) == (True, "no_prefill_worker")
    # Threshold 0: always disaggregate, even for a fully cached prompt.
    full = req(blocks=64, matches={"p0": m(gpu=64)})
    assert PDDecider(threshold_tokens=0).decide(full, prefill).prefill_on_decode is False
