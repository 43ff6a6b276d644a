"""Prefill and mixed steps replayed as piecewise CUDA graphs (``engine/prefill_graphs.py``) against the
same engine stepping them eagerly.

On a GPU both sides run the Triton ops with decode graphs; only ``prefill_graph_tokens`` differs, so in
float32 the greedy tokens must be identical and their logprobs equal up to rounding (a padded bucket is a
larger matrix, for which cuBLAS and the MoE tiles may sum in another order). The prompts cross several
token buckets (padded and exact), a chunked prefill whose first chunk is larger than the graphs (eager)
and whose last one replays them, and a prompt whose prefix is cached (attention over cached blocks
between the pieces). On the CPU the same path runs with the pieces called eagerly instead of replayed.
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import counting_live_rows
from engine.models.decoder import AttentionMetadata
from engine.prefill_graphs import PrefillGraphs
from tests.kernel_testing import needs_gpu

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=3)


def _llm(model: str, prefill_graph_tokens: int) -> LLM:
    return LLM(
        model,
        device="cuda",
        dtype="float32",
        kernel_backend="triton",
        num_kv_blocks=512,
        max_num_batched_tokens=512,
        prefill_graph_tokens=prefill_graph_tokens,
    )


def _prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(n)] for n in lengths]


def _same(got: list, want: list) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        assert [lp.logprob for lp in g.logprobs] == pytest.approx([lp.logprob for lp in w.logprobs], abs=1e-4)


@needs_gpu
@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe", "tiny-deepseek"])
def test_prefill_graphs_give_the_eager_tokens(model: str) -> None:
    eager, graphed = _llm(model, 0), _llm(model, 256)
    assert eager.engine.runner.prefill_graphs is None
    pg = graphed.engine.runner.prefill_graphs
    assert pg is not None and pg.sizes[-1] == 256
    for lengths, seed in (([5], 1), ([16], 2), ([3, 40, 100], 3), ([130, 7], 4), ([300, 250, 9], 5)):
        prompts = _prompts(lengths, seed)
        before = sum(pg.replays.values())
        want = eager.generate(prompts, GREEDY)
        assert len({t for o in want for t in o.token_ids}) > 3  # varied output: a real check
        _same(graphed.generate(prompts, GREEDY), want)
        assert sum(pg.replays.values()) > before, lengths
    # A cached prefix: the second prompt's prefill attends over the first one's blocks.
    shared = _prompts([96], 6)[0]
    for prompt in (shared + [7, 8, 9], shared + [11] * 50):
        _same(graphed.generate([prompt], GREEDY), eager.generate([prompt], GREEDY))


@needs_gpu
def test_prefill_graph_expert_counts_exclude_padding_rows() -> None:
    """Every token is counted top_k times per MoE layer, however padded the graph its step ran in."""
    llm = _llm("tiny-moe", 256)
    llm.engine.take_expert_counts()
    prompts = _prompts([37, 5, 70], 8)  # 112 tokens: the 128-token graph, 16 padding rows
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    counts = llm.engine.take_expert_counts()
    tokens = sum(len(p) for p in prompts) + sum(len(o.token_ids) - 1 for o in outs)
    top_k = llm.engine.model_config.num_experts_per_tok
    assert counts.sum(dim=1).tolist() == [tokens * top_k] * counts.shape[0]
    assert llm.engine.runner.prefill_graphs.replays[128] > 0


def test_prefill_pieces_compute_the_model_forward() -> None:
    """CPU: the pieces (one graph each on a GPU), with attention run between them on the real rows and
    the padding rows staged as ``run`` stages them, give the hidden states and KV of ``forward``; padding
    rows write no KV."""
    torch.manual_seed(0)
    for name in ("tiny-dense", "tiny-moe", "tiny-deepseek"):
        runner = LLM(name, num_kv_blocks=16).engine.runner
        model = runner.model
        n, bucket = 37, 64
        meta = AttentionMetadata(
            slot_mapping=torch.arange(16, 16 + n),  # blocks 1-3
            block_tables=torch.tensor([[1, 2, 3]], dtype=torch.int32),
            seq_lens=torch.tensor([n], dtype=torch.int32),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        )
        ids, positions = torch.randint(3, 200, (n,)), torch.arange(n)
        pool_eager, pool_pieces = runner.kv_pool.clone(), runner.kv_pool.clone()
        want = model(ids, positions, pool_eager, meta)
        pg = PrefillGraphs(model, pool_pieces, 100, torch.device("cpu"))
        assert pg.sizes[-1] == 100 and pg.bucket_for(n) == bucket and pg.bucket_for(101) is None
        key = (bucket, True)  # the graphs with the LoRA ops (the only ones without adapters)
        pg._runs[key] = pg._pieces(key)
        pg.attn_out.fill_(7.0)  # stale rows of an earlier, longer step
        pg.stage(torch.randint(3, 200, (60,)), torch.arange(60), torch.arange(60))
        assert pg.stage(ids, positions, meta.slot_mapping) == (bucket, n)
        assert pg.slot_mapping[n:bucket].eq(-1).all() and pg.attn_out[n:bucket].eq(0).all()
        pg._forward(key, n, meta, replay=False)
        torch.testing.assert_close(pg._state[key]["hidden"][:n], want)
        torch.testing.assert_close(pool_pieces, pool_eager)  # a 64-row matmul may round unlike a 37-row one
        untouched = [b for b in range(pool_pieces.shape[0]) if b not in (1, 2, 3)]
        assert torch.equal(pool_pieces[untouched], runner.kv_pool[untouched])


class EagerPieces(PrefillGraphs):
    """Prefill graphs whose pieces run eagerly instead of replaying (no CUDA on the CPU), so that the
    engine's whole prefill-graph path (bucket choice, staging, padding, attention between the pieces, the
    expert counters of live rows only; with several expert-parallel ranks, the exchanges of fixed
    size the graphs capture, and the padding rows that run on no expert) runs in CI."""

    def capture(self) -> None:
        for size in self.sizes:
            for with_lora in (True, False) if self.lora is not None else (True,):
                self._runs[size, with_lora] = self._pieces((size, with_lora))

    def _forward(self, key: tuple[int, bool], n: int, meta: AttentionMetadata | None, replay: bool) -> None:
        # What each replay runs: the pieces as captured, counting the live rows only, and without the LoRA
        # ops where they were captured without them.
        lora = self.lora.without_lora() if not key[1] else contextlib.nullcontext()
        with self.uniform_batches(), counting_live_rows(self.model, self.live), lora:
            super()._forward(key, n, meta, replay=False)


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_engine_through_prefill_pieces_gives_the_eager_tokens_and_counts(model: str) -> None:
    """CPU: an engine whose prefill and mixed steps go through the pieces (eagerly, as on a GPU they replay)
    generates the tokens of the plain engine, with the same expert counts, over padded buckets, chunked
    prefill (a 48-token budget), mixed prefill-and-decode steps and a cached prefix."""
    kwargs = dict(num_kv_blocks=64, max_num_batched_tokens=48, enable_prefix_caching=True)
    plain, piecewise = LLM(model, **kwargs), LLM(model, **kwargs)
    runner = piecewise.engine.runner
    pieces = runner.prefill_graphs = EagerPieces(runner.model, runner.kv_pool, 48, torch.device("cpu"))
    pieces.capture()
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompts = _prompts([5, 30, 70], 11) + [_prompts([40], 12)[0] * 2]
    for engine in (plain.engine, piecewise.engine):
        engine.take_expert_counts()
    want = plain.generate(prompts, params)
    got = piecewise.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert sum(pieces.replays.values()) > 0 and pieces.replays[48] > 0  # full chunks, and padded buckets
    assert sum(n for size, n in pieces.replays.items() if size < 48) > 0
    # How the passes ran, as the stats (and a worker's metrics) count them: on the CPU no decode graph;
    # the pieces, and eagerly only the chunks larger than them; the plain engine all eagerly.
    stats, plain_stats = piecewise.engine.stats(), plain.engine.stats()
    assert stats.prefill_graph_passes == sum(pieces.replays.values()) and stats.decode_graph_passes == 0
    assert stats.eager_passes + stats.prefill_graph_passes == runner.forward_passes
    assert plain_stats.eager_passes == plain.engine.runner.forward_passes > 0
    assert plain_stats.prefill_graph_passes == plain_stats.decode_graph_passes == 0
    counts_want, counts_got = plain.engine.take_expert_counts(), piecewise.engine.take_expert_counts()
    if counts_want is not None:
        assert counts_got is not None and torch.equal(counts_got, counts_want)


def test_warm_up_skips_the_sizes_the_prefill_graphs_replay(monkeypatch: pytest.MonkeyPatch) -> None:
    """Their capture compiled those kernels, and such steps never run eagerly: the start-up warm-up runs
    eager prefill forwards only for the sizes beyond the largest bucket."""
    llm = LLM("tiny-moe", num_kv_blocks=64, max_num_batched_tokens=128)
    runner = llm.engine.runner
    sizes: list[int] = []
    forward = runner.model.forward
    monkeypatch.setattr(runner.model, "forward", lambda ids, *a: sizes.append(len(ids)) or forward(ids, *a))
    runner.warm_up([16, 48, 100])
    assert sizes == [16, 48, 100]
    sizes.clear()
    runner.prefill_graphs = EagerPieces(runner.model, runner.kv_pool, 48, torch.device("cpu"))
    runner.warm_up([16, 48, 100])
    assert sizes == [100]
