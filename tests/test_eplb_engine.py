"""Expert placements in the engine (``enable_eplb``): redundant experts, a new placement applied at run time
(weights moved in place, tables rewritten), on one rank and over two expert-parallel ranks (gloo), with
the tokens unchanged; the move plan's messages; bad placements refused."""

from __future__ import annotations

import faulthandler
import random

import pytest
import torch
import torch.multiprocessing as mp

from engine import LLM, SamplingParams
from engine.moe.rebalance import plan_moves
from mesh.cli import free_port
from mesh.expert_placement import PlacementError, check_placement, initial_placement

PROMPTS = [[5, 17, 99, 3, 250, 7, 64, 12, 200], [200, 12, 64, 7, 250, 3, 99, 17, 5], [9, 8, 7, 6, 5, 4]]
PARAMS = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
WATCHDOG_S = 240


def scrambled(num_layers: int, num_logical: int, num_physical: int, seed: int) -> list[list[int]]:
    """A valid placement unlike the initial one: every expert once, in a shuffled order, the redundant
    slots replicating random experts, shuffled in too."""
    rng = random.Random(seed)
    rows = []
    for _ in range(num_layers):
        row = list(range(num_logical)) + [
            rng.randrange(num_logical) for _ in range(num_physical - num_logical)
        ]
        rng.shuffle(row)
        rows.append(row)
    return rows


def logical_load(counts: torch.Tensor, placement: list[list[int]], num_logical: int) -> torch.Tensor:
    out = torch.zeros(counts.shape[0], num_logical, dtype=torch.int64)
    return out.scatter_add_(1, torch.tensor(placement), counts)


@pytest.fixture(scope="module")
def baseline() -> dict:
    llm = LLM("tiny-moe", num_kv_blocks=64)
    tokens = [o.token_ids for o in llm.generate(PROMPTS, PARAMS)]
    blocks = llm.engine.model.moe_blocks()
    out = {
        "tokens": tokens,
        "load": llm.engine.take_expert_counts(),  # identity placement: physical = logical
        "w13": [b.w13.detach().clone() for b in blocks],
        "w2": [b.w2.detach().clone() for b in blocks],
    }
    llm.close()
    return out


def test_redundant_experts_and_new_placements_leave_the_tokens_unchanged(baseline: dict) -> None:
    llm = LLM("tiny-moe", num_kv_blocks=64, enable_eplb=True, num_redundant_experts=4)
    engine = llm.engine
    layout = engine.moe_layout()
    assert layout is not None and (layout.num_logical, layout.num_physical, layout.num_ranks) == (8, 12, 1)
    assert engine.expert_placement() == initial_placement(layout.num_layers, 8, 12)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == baseline["tokens"]
    engine.take_expert_counts()
    for version in (1, 2):
        placement = scrambled(layout.num_layers, 8, 12, seed=version)
        engine.set_expert_placement(version, placement)
        assert engine.placement_version == version and engine.expert_placement() == placement
        for i, block in enumerate(engine.model.moe_blocks()):  # every slot holds its expert's weights
            assert torch.equal(block.w13, baseline["w13"][i][placement[i]])
            assert torch.equal(block.w2, baseline["w2"][i][placement[i]])
            assert block.placement.replica_counts.tolist() == [placement[i].count(e) for e in range(8)]
        assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == baseline["tokens"]
        counts = engine.take_expert_counts()
        tokens = sum(len(p) for p in PROMPTS) + len(PROMPTS) * (PARAMS.max_tokens - 1)
        assert counts.sum(dim=1).tolist() == [tokens * 2] * layout.num_layers
        # The same tokens route to the same logical experts; replicas share an expert's tokens.
        assert torch.equal(logical_load(counts, placement, 8), baseline["load"])
        used = [{s for s in range(12) if counts[layer, s] > 0} for layer in range(layout.num_layers)]
        replicated = [e for e in range(8) if placement[0].count(e) > 1]
        assert any(len({s for s in used[0] if placement[0][s] == e}) > 1 for e in replicated)
    engine.set_expert_placement(1, initial_placement(layout.num_layers, 8, 12))  # older: ignored
    assert engine.placement_version == 2
    llm.close()


def test_bad_placements_and_settings_are_refused() -> None:
    llm = LLM("tiny-moe", num_kv_blocks=16, enable_eplb=True, num_redundant_experts=2)
    engine = llm.engine
    layers = engine.moe_layout().num_layers
    good = initial_placement(layers, 8, 10)
    with pytest.raises(PlacementError, match="layers"):
        engine.set_expert_placement(1, good[:-1])
    with pytest.raises(PlacementError, match="10"):
        engine.set_expert_placement(1, [row[:-1] for row in good])
    with pytest.raises(PlacementError, match="without a replica"):
        engine.set_expert_placement(1, [[0] * 10 for _ in range(layers)])
    with pytest.raises(PlacementError, match="outside"):
        engine.set_expert_placement(1, [[*row[:-1], 8] for row in good])
    assert engine.placement_version == 0 and engine.expert_placement() == good
    llm.close()
    with pytest.raises(ValueError, match="needs enable_eplb"):
        LLM("tiny-moe", num_kv_blocks=16, num_redundant_experts=2)
    with pytest.raises(ValueError, match="no MoE layers"):
        LLM("tiny-dense", num_kv_blocks=16, enable_eplb=True)
    dense = LLM("tiny-dense", num_kv_blocks=16)
    assert dense.engine.moe_layout() is None and dense.engine.expert_placement() is None
    with pytest.raises(PlacementError, match="no MoE layers"):
        dense.engine.set_expert_placement(1, [[0]])
    dense.close()


@pytest.mark.parametrize("ranks", [1, 2, 4])
def test_the_move_plans_of_all_ranks_match_and_reach_the_new_placement(ranks: int) -> None:
    rng = random.Random(ranks)
    for trial in range(30):
        num_logical, num_physical = 8, 8 + ranks * rng.randrange(0, 3)
        old = scrambled(1, num_logical, num_physical, seed=trial)[0]
        new = scrambled(1, num_logical, num_physical, seed=1000 + trial)[0]
        if trial % 3 == 0:  # partly unchanged: a few slots trade places
            new, moving = list(old), rng.sample(range(num_physical), 3)
            for a, b in zip(moving, moving[1:] + moving[:1], strict=True):
                new[a] = old[b]
        check_placement([new], 1, num_logical, num_physical)
        plans = [plan_moves(old, new, ranks, r) for r in range(ranks)]
        per = num_physical // ranks
        # What each rank sends to a peer, in order, is what that peer receives from it, in order.
        for src in range(ranks):
            for dst in range(ranks):
                sent = [old[src * per + slot] for peer, slot in plans[src].send if peer == dst]
                got = [logical for peer, logical, _ in plans[dst].recv if peer == src]
                assert sent == got
        for r, plan in enumerate(plans):
            slots = old[r * per : (r + 1) * per]
            result = list(slots)
            for dst, src in plan.local.items():
                result[dst] = slots[src]
            for _peer, logical, dsts in plan.recv:
                for dst in dsts:
                    result[dst] = logical
            assert result == new[r * per : (r + 1) * per]
            unchanged = [j for j in range(per) if old[r * per + j] == new[r * per + j]]
            touched = set(plan.local) | {d for _p, _l, ds in plan.recv for d in ds}
            assert not touched & set(unchanged)


def _rank_main(rank: int, world: int, port: int, out: dict) -> None:
    import torch.distributed as dist

    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    torch.set_num_threads(1)
    try:
        llm = LLM(
            "tiny-moe", num_kv_blocks=64, expert_parallel_size=world, expert_parallel_rank=rank,
            distributed_init_method=f"tcp://127.0.0.1:{port}", enable_eplb=True, num_redundant_experts=2,
        )  # fmt: skip
        engine = llm.engine
        layers = engine.moe_layout().num_layers
        first = llm.generate([PROMPTS[rank]], PARAMS)
        placement = scrambled(layers, 8, 10, seed=7)
        engine.set_expert_placement(1, placement)
        assert engine.placement_version == 0  # staged: the group applies it together
        engine.take_expert_counts()
        second = llm.generate([PROMPTS[rank]], PARAMS)
        blocks = engine.model.moe_blocks()
        out[rank] = {
            "first": [o.token_ids for o in first],
            "second": [o.token_ids for o in second],
            "version": engine.placement_version,
            "placement": engine.expert_placement() == placement,
            "w13": [b.w13.detach().clone() for b in blocks],
            "counts": engine.take_expert_counts(),
        }
        llm.close()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_move_experts_between_them_and_keep_their_tokens(baseline: dict) -> None:
    out = mp.Manager().dict()
    mp.spawn(_rank_main, args=(2, free_port(), out), nprocs=2, join=True)
    placement = scrambled(len(baseline["w13"]), 8, 10, seed=7)
    for rank in range(2):
        got = out[rank]
        assert got["first"] == got["second"] == [baseline["tokens"][rank]]
        assert got["version"] == 1 and got["placement"]
        for layer, w13 in enumerate(got["w13"]):  # each rank's slots hold the new placement's experts
            assert torch.equal(w13, baseline["w13"][layer][placement[layer][rank * 5 : rank * 5 + 5]])
    both = out[0]["counts"] + out[1]["counts"]
    assert torch.equal(logical_load(both, placement, 8).sum(dim=1), both.sum(dim=1))


@pytest.mark.gpu
def test_gpu_graphs_run_a_new_placement_and_count_only_real_tokens() -> None:
    """On a GPU with decode and prefill graphs (Triton ops, float32): a placement with replicas, applied
    between steps, gives the tokens of the engine without EPLB, and the counters (live rows only) add up to
    the real tokens' pairs, per logical expert as without EPLB."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kw = {"device": "cuda", "kernel_backend": "triton", "dtype": "float32", "num_kv_blocks": 64}
    base = LLM("tiny-moe", **kw)
    want = [o.token_ids for o in base.generate(PROMPTS, PARAMS)]
    want_load = base.engine.take_expert_counts()
    base.close()
    llm = LLM("tiny-moe", enable_eplb=True, num_redundant_experts=4, **kw)
    engine = llm.engine
    assert engine.runner.graphs is not None
    layers = engine.moe_layout().num_layers
    for version in (1, 2):
        placement = scrambled(layers, 8, 12, seed=version)
        engine.set_expert_placement(version, placement)
        outs = llm.generate(PROMPTS, PARAMS)
        assert [o.token_ids for o in outs] == want
        counts = engine.take_expert_counts()
        # Every real token top_k times a layer, padding rows never (the engine without EPLB counts so too,
        # so comparing with it alone could not catch a count both get wrong).
        tokens = sum(len(p) for p in PROMPTS) + sum(len(o.token_ids) - 1 for o in outs)
        assert counts.sum(dim=1).tolist() == [tokens * 2] * layers
        assert torch.equal(logical_load(counts, placement, 8), want_load)
    assert sum(engine.runner.graphs.replays.values()) > 0
    llm.close()


def test_float8_experts_move_with_their_scales() -> None:
    """With float8 expert weights (``quantization="fp8"``) a placement moves values and scales as bytes."""
    base = LLM("tiny-moe", num_kv_blocks=32, quantization="fp8")
    want = [o.token_ids for o in base.generate(PROMPTS, PARAMS)]
    w13 = [(b.w13.weight.clone(), b.w13.weight_scale.clone()) for b in base.engine.model.moe_blocks()]
    base.close()
    llm = LLM("tiny-moe", num_kv_blocks=32, quantization="fp8", enable_eplb=True, num_redundant_experts=4)
    layers = llm.engine.moe_layout().num_layers
    placement = scrambled(layers, 8, 12, seed=3)
    llm.engine.set_expert_placement(1, placement)
    for layer, ((values, scales), block) in enumerate(zip(w13, llm.engine.model.moe_blocks(), strict=True)):
        row = placement[layer]
        assert torch.equal(block.w13.weight.view(torch.uint8), values[row].view(torch.uint8))
        assert torch.equal(block.w13.weight_scale, scales[row])
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == want
    llm.close()
