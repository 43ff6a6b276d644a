"""The GPU fast path (Triton ops + captured decode graphs) against the eager PyTorch reference.

In float32 the greedy tokens must be identical. In bf16 two correct implementations round differently,
and one flipped rounding can flip a later choice (a logit tie, or an MoE router tie that changes the
experts and so the whole output): there a sequence may leave the reference only where each side's token is
among the other side's top ``TOP`` candidates (the criterion of vLLM's ``check_logprobs_close``), and it is
not compared after that. The GPU tests are skipped without CUDA; the first test runs on the CPU: the pieces
a decode step is captured in compute exactly the model's forward.
"""

from __future__ import annotations

import gc
import random
import threading
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.cuda_graphs import capturing
from engine.llm import CompletionOutput
from tests.kernel_testing import needs_gpu

NEW_TOKENS = 16
TOP = 5
WITH_LOGPROBS = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logprobs=TOP)


def _prompts(n: int, seed: int, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(2, 70))] for _ in range(n)]


def _llm(model: str, backend: str, graphs: bool, dtype: str) -> LLM:
    llm = LLM(model, device="cuda", dtype=dtype, kernel_backend=backend, num_kv_blocks=512)
    runner = llm.engine.runner
    if graphs:
        assert runner.enable_cuda_graphs(llm.engine.config.max_num_seqs, llm.engine.max_model_len)
    else:
        runner.graphs = runner.prefill_graphs = None  # eager, whatever the engine's default
    return llm


def assert_same_greedy(got: list[CompletionOutput], ref: list[CompletionOutput], exact: bool) -> None:
    if exact:
        assert [o.token_ids for o in got] == [o.token_ids for o in ref]
        return
    compared = total = 0
    for i, (g, r) in enumerate(zip(got, ref, strict=True)):
        assert len(g.token_ids) == len(r.token_ids)
        total += len(r.token_ids)
        for pos, (a, b) in enumerate(zip(g.token_ids, r.token_ids, strict=True)):
            if a != b:
                ref_top = [t for t, _ in r.logprobs[pos].top]
                got_top = [t for t, _ in g.logprobs[pos].top]
                assert a in ref_top and b in got_top, (
                    f"sequence {i} token {pos}: {a} (reference's top {ref_top}) != {b} (top {got_top})"
                )
                break
            compared += 1
    assert compared >= total // 4, f"only {compared} of {total} tokens agree before a divergence"


def test_decode_pieces_compute_the_model_forward() -> None:
    """CPU: the layer-range pieces (one graph each on a GPU) give the logits of forward + compute_logits."""
    from engine.cuda_graphs import decode_step_pieces
    from engine.models.decoder import AttentionMetadata

    for model_name in ("tiny-dense", "tiny-moe"):
        llm = LLM(model_name, num_kv_blocks=32)
        model, pool = llm.engine.model, llm.engine.kv_pool
        ids = torch.tensor([5, 9, 77])
        positions = torch.tensor([3, 0, 17])
        meta = AttentionMetadata(
            slot_mapping=torch.tensor([3, 16, 49]),
            block_tables=torch.tensor([[0, 5], [1, 6], [2, 3]], dtype=torch.int32),
            seq_lens=torch.tensor([4, 1, 18], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1, 2, 3], dtype=torch.int32),
        )
        pool.normal_()
        expected = model.compute_logits(model(ids, positions, pool, meta))
        logits = torch.empty_like(expected)
        pieces = decode_step_pieces(model, ids, positions, pool, meta, logits, layers_per_piece=3)
        assert len(pieces) == 2  # 4 layers
        for run in pieces:
            run()
        assert torch.equal(logits, expected)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(
        "llama",
        tmp_path_factory.mktemp("llama"),
        seed=11,
        hidden_size=256,
        intermediate_size=512,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        num_hidden_layers=4,
    )


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe", "llama-checkpoint"])
def test_triton_with_graphs_gives_torch_eager_tokens(
    model: str, dtype: str, request: pytest.FixtureRequest
) -> None:
    name = str(request.getfixturevalue("llama_checkpoint")) if model == "llama-checkpoint" else model
    prompts = _prompts(8, seed=3, vocab=380)
    reference = _llm(name, "torch", graphs=False, dtype=dtype).generate(prompts, WITH_LOGPROBS)
    assert len({t for r in reference for t in r.token_ids}) > 20  # varied output: a real check
    fast = _llm(name, "triton", graphs=True, dtype=dtype)
    got = fast.generate(prompts, WITH_LOGPROBS)
    assert_same_greedy(got, reference, exact=dtype == "float32")
    assert sum(fast.engine.runner.graphs.replays.values()) >= NEW_TOKENS - 1  # decode ran as graphs


@needs_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_graph_replay_equals_eager_at_several_batch_sizes(model: str, dtype: str) -> None:
    eager = _llm(model, "triton", graphs=False, dtype=dtype)
    graphed = _llm(model, "triton", graphs=True, dtype=dtype)
    graphs = graphed.engine.runner.graphs
    for batch in (1, 3, 13, 40):  # buckets 1, 4, 16, 48: exact and padded
        prompts = _prompts(batch, seed=batch)
        before = dict(graphs.replays)
        reference = eager.generate(prompts, WITH_LOGPROBS)
        got = graphed.generate(prompts, WITH_LOGPROBS)
        assert_same_greedy(got, reference, exact=dtype == "float32")
        bucket = graphs.bucket_for(batch)
        assert graphs.replays[bucket] > before[bucket], (batch, graphs.replays)


def test_capturing_collects_first_and_defers_collections() -> None:
    """``capturing``: garbage (a reference cycle) is freed on entry, the collector is off inside, and on
    again after, also when the block raises."""
    freed = threading.Event()

    class Cycle:
        def __init__(self) -> None:
            self.me = self

        def __del__(self) -> None:
            freed.set()

    assert gc.isenabled()
    Cycle()
    with capturing():
        assert freed.is_set()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), capturing():
        raise RuntimeError("capture failed")
    assert gc.isenabled()


def _graphs_to_discard(count: int) -> list[torch.cuda.CUDAGraph]:
    x = torch.zeros(8, device="cuda")
    graphs = []
    for _ in range(count):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            x.add_(1)
        graphs.append(graph)
    return graphs


@needs_gpu
def test_capture_survives_the_collector_freeing_old_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: graphs of an unreachable engine (here a reference cycle holding captured graphs) must not
    be finalised inside a capture (destroying a graph is not permitted while a stream captures). The cycle
    loses its last outside reference as the first capture begins, and the collector is made to run at
    almost every allocation, so without ``capturing`` it would run inside that capture."""

    class OldEngine:
        def __init__(self) -> None:
            self.me = self
            self.graphs = _graphs_to_discard(8)

    held = [OldEngine()]
    begin = torch.cuda.CUDAGraph.capture_begin

    def capture_begin(self: torch.cuda.CUDAGraph, *args: object, **kwargs: object) -> None:
        begin(self, *args, **kwargs)
        held.clear()  # the cycle is garbage from now on

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        llm = _llm("tiny-moe", "triton", graphs=True, dtype="bfloat16")
    finally:
        gc.set_threshold(*threshold)
    assert llm.engine.runner.graphs is not None and llm.engine.runner.prefill_graphs is not None
    out = llm.generate(_prompts(3, seed=5), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [4, 4, 4]


@needs_gpu
def test_capture_survives_another_thread_freeing_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: another thread's CUDA calls that are unsafe during a capture (here destroying graphs, as
    an engine torn down on another thread does) must not fail this thread's captures."""
    graphs = _graphs_to_discard(200)
    capturing_now, stop = threading.Event(), threading.Event()
    destroyed_in_capture = 0
    begin, end = torch.cuda.CUDAGraph.capture_begin, torch.cuda.CUDAGraph.capture_end

    def capture_begin(self: torch.cuda.CUDAGraph, *args: object, **kwargs: object) -> None:
        begin(self, *args, **kwargs)
        capturing_now.set()

    def capture_end(self: torch.cuda.CUDAGraph) -> None:
        capturing_now.clear()
        end(self)

    def discard() -> None:
        nonlocal destroyed_in_capture
        while graphs and not stop.is_set():
            if capturing_now.wait(0.01):
                graphs.pop()  # the last reference: the graph is destroyed on this thread
                destroyed_in_capture += 1
                stop.wait(0.001)

    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_begin", capture_begin)
    monkeypatch.setattr(torch.cuda.CUDAGraph, "capture_end", capture_end)
    thread = threading.Thread(target=discard, daemon=True)
    thread.start()
    try:
        llm = _llm("tiny-moe", "triton", graphs=True, dtype="bfloat16")
    finally:
        stop.set()
        thread.join()
    assert destroyed_in_capture > 0, "no graph was destroyed while the engine captured"
    out = llm.generate(_prompts(2, seed=6), SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert [len(o.token_ids) for o in out] == [4, 4]


@needs_gpu
def test_expert_counts_exclude_padding_rows() -> None:
    """Every token is counted top_k times per MoE layer, however padded the graph it ran in."""
    llm = _llm("tiny-moe", "triton", graphs=True, dtype="bfloat16")
    llm.engine.take_expert_counts()
    prompts = _prompts(5, seed=9)  # batch 5 runs in the batch-8 graph: 3 padding rows per step
    outs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))
    counts = llm.engine.take_expert_counts()
    tokens = sum(len(p) for p in prompts) + sum(len(o.token_ids) - 1 for o in outs)
    top_k = llm.engine.model_config.num_experts_per_tok
    assert counts.sum(dim=1).tolist() == [tokens * top_k] * counts.shape[0]
    assert llm.engine.runner.graphs.replays[8] > 0


def _holders(obj: object, depth: int = 3) -> list[str]:
    """What keeps ``obj`` alive, a few referrer levels up (for the assertion's message)."""
    out, frontier, seen = [], [obj], {id(obj)}
    for level in range(depth):
        nxt = []
        for o in frontier:
            for r in gc.get_referrers(o):
                if id(r) in seen or r is frontier or r is nxt or type(r).__name__ == "frame":
                    continue
                seen.add(id(r))
                out.append(f"{'  ' * level}{type(r).__module__}.{type(r).__qualname__}: {str(r)[:120]}")
                nxt.append(r)
        frontier = nxt[:8]
    return out[:40]


def _live_cuda_tensors() -> list[str]:
    """The largest CUDA tensors the garbage collector can see, with what holds each (for a message)."""
    found = [o for o in gc.get_objects() if isinstance(o, torch.Tensor) and o.is_cuda]
    found.sort(key=lambda t: -t.numel() * t.element_size())
    return [f"{tuple(t.shape)} {t.dtype} held by {_holders(t, 2)[:4]}" for t in found[:5]]


def _settle() -> None:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


@needs_gpu
@pytest.mark.parametrize("close", [False, True], ids=["dropped", "closed"])
def test_an_engine_gives_its_gpu_memory_back(close: bool) -> None:
    """An engine with CUDA graphs and asynchronous scheduling (the CUDA defaults) that is dropped, closed
    first or not, leaves no tensor behind: its KV pool, weights and graph pools go back to the allocator. A
    process that builds engines one after another (a benchmark going through shapes, a test module) would
    otherwise see each new KV pool sized from what the last one left. The first engine pays the process's
    one-time allocations (cuBLAS workspaces and the like); the second is measured."""
    import weakref

    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine

    def run_one() -> tuple[weakref.ref, int, int]:
        engine = LLMEngine(
            EngineConfig(
                model="tiny-moe",
                device="cuda",
                dtype="bfloat16",
                kernel_backend="triton",
                num_kv_blocks=65536,
            )
        )
        assert engine.runner.graphs is not None and engine.config.async_scheduling
        pool_bytes = engine.kv_pool.numel() * engine.kv_pool.element_size()
        for i, prompt in enumerate(_prompts(6, seed=3)):
            engine.add_request(
                f"r{i}", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            )
        while engine.has_unfinished():
            engine.step()
        assert sum(engine.runner.graphs.replays.values()) > 0
        in_use = torch.cuda.memory_allocated()
        if close:
            engine.close()
        return weakref.ref(engine), pool_bytes, in_use

    run_one()
    _settle()
    base_alloc, base_reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    ref, pool_bytes, in_use = run_one()
    assert pool_bytes >= 2**29 and in_use - base_alloc >= pool_bytes  # what must come back was taken
    _settle()
    alive = ref()
    assert alive is None, "the engine is still referenced:\n" + "\n".join(_holders(alive))
    left_alloc = torch.cuda.memory_allocated() - base_alloc
    left_reserved = torch.cuda.memory_reserved() - base_reserved
    assert left_alloc < 2**22, f"{left_alloc / 2**20:.1f} MiB still allocated: {_live_cuda_tensors()}"
    assert left_reserved < 2**24, f"{left_reserved / 2**20:.1f} MiB still reserved"
