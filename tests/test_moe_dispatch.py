"""Expert parallelism through the dispatch interface: two ranks, each holding half of the physical
experts, give the same tokens as one rank holding all of them. On the CPU over gloo, also with uneven
work per rank (``engine.data_parallel.Lockstep``: a rank with nothing to run joins the others' passes);
on two GPUs (marked ``gpu``, skipped with fewer) over NCCL, with the Triton ops.

A rank that missed a collective would leave the other waiting: the process groups time out after
``TIMEOUT``, and a rank process still running ``WATCHDOG`` after its start exits with its stacks dumped,
so such a bug fails the test instead of hanging it."""

from __future__ import annotations

import faulthandler
import os
from datetime import timedelta

import pytest
import torch
import torch.multiprocessing as mp

from engine import LLM, SamplingParams
from mesh.cli import free_port
from tests.test_prefill_graphs import EagerPieces

# Rank r serves prompt r (data-parallel attention); both ranks see every token in the MoE layers. Here the
# prompts have the same length, so no rank idles; the uneven case is further down.
PROMPTS = [[5, 17, 99, 3, 250, 7, 64, 12, 200], [200, 12, 64, 7, 250, 3, 99, 17, 5]]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
TIMEOUT = timedelta(seconds=120)
WATCHDOG = TIMEOUT.total_seconds() + 60


# The GPU variant's engines: the Triton ops (with CUDA graphs where they apply), float32 so that the
# ranks' partial expert sums cannot round a token differently from the single rank's.
GPU_ENGINE = {"device": "cuda", "kernel_backend": "triton", "dtype": "float32"}


def _join(rank: int, world: int, port: int, engine_kw: dict | None) -> None:
    """This process's rank of the group: over NCCL, one GPU each, for GPU engines; over gloo otherwise."""
    import torch.distributed as dist

    faulthandler.dump_traceback_later(WATCHDOG, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if engine_kw:
        torch.cuda.set_device(rank)
        dist.init_process_group(
            "nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank), timeout=TIMEOUT
        )
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world, timeout=TIMEOUT)


def _rank_main(
    rank: int, world: int, port: int, prompts: list[list[int]], out: dict, engine_kw: dict | None = None
) -> None:
    import torch.distributed as dist

    from engine.moe.dispatch import AllGatherDispatcher

    _join(rank, world, port, engine_kw)
    try:
        llm = LLM("tiny-moe", num_kv_blocks=64, dispatcher=AllGatherDispatcher(), **(engine_kw or {}))
        # Each rank holds half of the 8 physical experts.
        assert llm.engine.model.moe_blocks()[0].w13.shape[0] == 8 // world
        graphs = llm.engine.runner.graphs
        assert (graphs is not None) == bool(engine_kw)  # decode graphs on the GPU, with several ranks too
        out[rank] = [o.token_ids for o in llm.generate(prompts[rank], PARAMS)]
        if graphs is not None:
            out[f"replays{rank}"] = sum(graphs.replays.values())
        llm.close()  # the graphs, before the group they captured collectives of
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_allgather_dispatch_over_two_gloo_ranks_matches_single_rank() -> None:
    single = LLM("tiny-moe", num_kv_blocks=64)
    expected = [single.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    out = mp.Manager().dict()
    mp.spawn(_rank_main, args=(2, free_port(), [[p] for p in PROMPTS], out), nprocs=2, join=True)
    assert [out[0][0], out[1][0]] == expected


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_gpu_allgather_dispatch_over_two_nccl_ranks_matches_single_rank() -> None:
    """Two GPUs, one rank each, all-gather and all-reduce over NCCL: the single GPU's tokens. Both the
    single GPU and the ranks decode through CUDA graphs (the ranks' capture their token exchanges)."""
    single = LLM("tiny-moe", num_kv_blocks=64, **GPU_ENGINE)
    assert single.engine.runner.graphs is not None
    expected = [single.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    del single
    out = mp.Manager().dict()
    mp.spawn(_rank_main, args=(2, free_port(), [[p] for p in PROMPTS], out, GPU_ENGINE), nprocs=2, join=True)
    assert [out[0][0], out[1][0]] == expected
    # One prefill pass, then every decode step of the 12 tokens replays a graph on both ranks.
    assert out["replays0"] == out["replays1"] == PARAMS.max_tokens - 1


def _uniform_rank_main(rank: int, world: int, port: int, out: dict) -> None:
    """One MoE block's dispatch with the ranks' batches padded to one size (``uniform_batches``, what the
    decode graphs capture) against the same rows exchanged with their true counts."""
    import torch.distributed as dist

    from engine.moe.dispatch import AllGatherDispatcher

    _join(rank, world, port, None)
    try:
        llm = LLM("tiny-moe", num_kv_blocks=64, dispatcher=AllGatherDispatcher())
        blk = llm.engine.model.moe_blocks()[0]
        dispatcher = blk.dispatcher
        hidden = blk.gate.shape[1]
        gen = torch.Generator().manual_seed(rank)
        rows = 3 if rank == 0 else 1  # uneven: rank 1 pads two rows of zeros
        x = torch.randn(rows, hidden, generator=gen)
        dispatcher.begin_forward()
        exact = blk(x)
        padded = torch.cat([x, torch.zeros(3 - rows, hidden)])
        before = [c.clone() for c in (b.expert_counts for b in llm.engine.model.moe_blocks())]
        with dispatcher.uniform_batches():
            dispatcher.begin_forward()
            uniform = blk(padded)
        counted = int(blk.expert_counts.sum() - before[0].sum())
        # The graphs' padding: rows marked padding (live 0; here random rows) run on no expert, any rank's.
        # As the prefill graphs mark them (a bool mask) and as the decode graphs do (their seq_lens).
        noisy = torch.cat([x, torch.randn(3 - rows, hidden, generator=gen)])
        with dispatcher.uniform_batches(live=torch.arange(3) < rows):
            dispatcher.begin_forward()
            masked = blk(noisy)
        seq_lens = torch.tensor([17, 5, 9][:rows] + [0] * (3 - rows), dtype=torch.int32)
        with dispatcher.uniform_batches(live=seq_lens):
            dispatcher.begin_forward()
            by_lens = blk(noisy)
        with dispatcher.uniform_batches():
            dispatcher.begin_forward()
            unmasked = blk(noisy)
        out[rank] = {
            "same": torch.allclose(uniform[:rows], exact, rtol=1e-5, atol=1e-6),
            "rows": tuple(uniform.shape),
            "counted": counted,
            "top_k": blk.top_k,
            "masked_same": torch.allclose(masked[:rows], exact, rtol=1e-5, atol=1e-6),
            "masked_padding_zero": bool(masked[rows:].eq(0).all()),
            "by_lens_same": torch.equal(by_lens, masked),
            "unmasked_padding_nonzero": bool(unmasked[rows:].ne(0).any(dim=1).all()),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_uniform_batches_dispatch_matches_exchanged_counts() -> None:
    out = mp.Manager().dict()
    mp.spawn(_uniform_rank_main, args=(2, free_port(), out), nprocs=2, join=True)
    for rank in (0, 1):
        assert out[rank]["same"], rank
        assert out[rank]["rows"] == (3, out[rank]["rows"][1])
        assert out[rank]["counted"] == 3 * out[rank]["top_k"]  # padding rows route too (graphs correct it)
    # Marked as padding, rank 1's two padding rows add nothing on either rank; rank 0 has none.
    assert out[0]["masked_same"] and out[1]["masked_same"]
    assert out[1]["masked_padding_zero"] and out[1]["unmasked_padding_nonzero"]
    assert out[0]["by_lens_same"] and out[1]["by_lens_same"]  # seq_lens mark the same rows


# Ranks with uneven work: rank 0 one long generation, rank 1 two short ones (one prompt a prefix of the
# other's). Rank 1 finishes first and must keep joining rank 0's passes.
UNEVEN = {
    0: ([PROMPTS[0]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)),
    1: ([PROMPTS[1][:4], PROMPTS[1]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)),
}


def _lockstep_rank_main(
    rank: int, world: int, port: int, out: dict, engine_kw: dict | None = None, eager_pieces: int = 0
) -> None:
    """A rank set up by the engine itself, from its settings (as a worker process is): it joins the group
    (gloo on the CPU; NCCL and GPU ``rank`` on CUDA) and makes the dispatcher. ``eager_pieces`` (CPU):
    the prefill graphs' path up to that many tokens, the pieces run eagerly (``EagerPieces``)."""
    import torch.distributed as dist

    faulthandler.dump_traceback_later(WATCHDOG, exit=True)
    torch.set_num_threads(1)
    try:
        llm = LLM(
            **{"model": "tiny-moe", **(engine_kw or {})}, num_kv_blocks=64, expert_parallel_size=world,
            expert_parallel_rank=rank, distributed_init_method=f"tcp://127.0.0.1:{port}",
        )  # fmt: skip
        assert llm.engine.model.moe_blocks()[0].w13.shape[0] == 8 // world
        runner = llm.engine.runner
        if eager_pieces:
            pieces = runner.prefill_graphs = EagerPieces(
                runner.model, runner.kv_pool, eager_pieces, runner.device
            )
            pieces.capture()
        prompts, params = UNEVEN[rank]
        first = llm.generate(prompts, params)
        # Then rank 1 has no request at all, and only joins rank 0's passes.
        second = llm.generate(prompts if rank == 0 else [], params)
        forwarded = sum(
            len(o.prompt_token_ids) - o.num_cached_tokens + len(o.token_ids) - 1 for o in first + second
        )
        blocks = llm.engine.model.moe_blocks()
        graphs, pieces = runner.graphs, runner.prefill_graphs
        out[rank] = {
            "graph_passes": llm._lockstep.graph_passes if llm._lockstep else -1,
            "prefill_graph_passes": llm._lockstep.prefill_graph_passes if llm._lockstep else -1,
            "forward_passes": runner.forward_passes,
            "pass_kinds": dict(runner.pass_kinds),
            "replays": sum(graphs.replays.values()) if graphs is not None else 0,
            "prefill_replays": sum(pieces.replays.values()) if pieces is not None else 0,
            "first": [o.token_ids for o in first],
            "second": [o.token_ids for o in second],
            "idle_passes": llm._lockstep.idle_passes if llm._lockstep else -1,
            "lookahead_steps": llm.engine.lookahead_steps,
            "async": llm.engine.config.async_scheduling,
            # each rank counts its own tokens' (token, expert) pairs, over all physical experts
            "pairs": [int(b.expert_counts.sum()) for b in blocks],
            "expected_pairs": forwarded * blocks[0].top_k,
        }
        llm.close()  # the graphs, then the group the engine joined
        assert not dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_with_uneven_work_step_together_and_match_a_single_rank() -> None:
    """Data-parallel attention: each rank generates its own prompts, of different lengths and counts,
    and a rank with nothing left runs idle passes (counted by no expert) until every rank is done."""
    check_uneven_work({})


@pytest.mark.slow
def test_ranks_with_asynchronous_scheduling_match_a_single_rank() -> None:
    """``expert_parallel_async_scheduling``: the ranks launch each decode step while the one before runs
    (one step of lookahead each), agreeing on every pass as before; the same tokens and expert counts."""
    check_uneven_work(ASYNC)


ASYNC = {"async_scheduling": True, "expert_parallel_async_scheduling": True}
SYNC = {"async_scheduling": False}
SCHEDULING = pytest.mark.parametrize("scheduling", [SYNC, ASYNC], ids=["sync", "async"])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@SCHEDULING
def test_gpu_ranks_with_uneven_work_step_together_and_match_a_single_rank(scheduling: dict) -> None:
    check_uneven_work({**GPU_ENGINE, **scheduling})


# One sequence a rank at a time: rank 1's second prompt starts while rank 0 decodes, so rank 0's decode
# batch joins rank 1's prefill pass.
ONE_AT_A_TIME = {"max_num_seqs": 1}


def check_prefill_passes_joined(engine_kw: dict, eager_pieces: int = 0) -> None:
    out = check_uneven_work({**engine_kw, **ONE_AT_A_TIME}, eager_pieces)
    # Rank 0 prefills its prompt twice and never idles; a third prefill-graph pass ran its decode row.
    assert out[0]["idle_passes"] == 0 and out[0]["prefill_graph_passes"] >= 3
    assert out[1]["idle_passes"] > 0  # in the second call: rank 0's prefill joined with padding only


@pytest.mark.slow
def test_ranks_join_each_others_prefill_passes_through_the_pieces() -> None:
    """CPU: the prefill graphs' path with several ranks (the pieces run eagerly, ``EagerPieces``): the ranks
    agree on one bucket for each pass, a decode batch and an idle rank join another rank's prefill in it,
    and the tokens and exact expert counts are the single rank's."""
    check_prefill_passes_joined({}, eager_pieces=32)


@pytest.mark.slow
def test_deepseek_ranks_join_each_others_prefill_passes_through_the_pieces() -> None:
    """The same with ``tiny-deepseek``: the latent attention runs eagerly between the pieces on each rank
    (its grouped routing and shared expert inside them)."""
    check_prefill_passes_joined({"model": "tiny-deepseek"}, eager_pieces=32)


@pytest.mark.slow
def test_ranks_with_asynchronous_scheduling_join_each_others_prefill_passes_through_the_pieces() -> None:
    """The same with asynchronous scheduling: lookahead steps (decode, and prompts beside decode rows)
    agree on the pieces' bucket too."""
    check_prefill_passes_joined(ASYNC, eager_pieces=32)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
@SCHEDULING
def test_gpu_ranks_join_each_others_prefill_passes_in_the_graphs(scheduling: dict) -> None:
    check_prefill_passes_joined({**GPU_ENGINE, **scheduling})


def check_uneven_work(engine_kw: dict, eager_pieces: int = 0) -> dict:
    single = LLM(**{"model": "tiny-moe", **engine_kw}, num_kv_blocks=64)
    expected = {r: [o.token_ids for o in single.generate(*UNEVEN[r])] for r in (0, 1)}
    del single
    out = mp.Manager().dict()
    args = (2, free_port(), out, engine_kw or None, eager_pieces)
    mp.spawn(_lockstep_rank_main, args=args, nprocs=2, join=True)
    assert out[0]["first"] == expected[0] and out[1]["first"] == expected[1]
    assert out[0]["second"] == expected[0] and out[1]["second"] == []
    # Rank 1's 4-token generations end well before rank 0's 12, and the second call is all idle for it.
    assert out[0]["idle_passes"] == 0 and out[1]["idle_passes"] >= 12
    # Asynchronous scheduling is on by default on CUDA, and expert parallelism keeps it by default.
    ahead = engine_kw.get("async_scheduling", engine_kw.get("device") == "cuda")
    assert out[0]["async"] is out[1]["async"] is ahead
    if ahead:  # the ranks ran ahead (rank 1 only while it had requests)
        assert out[0]["lookahead_steps"] >= 2 * (PARAMS.max_tokens - 2) and out[1]["lookahead_steps"] > 0
    else:
        assert out[0]["lookahead_steps"] == out[1]["lookahead_steps"] == 0
    if engine_kw.get("device") == "cuda":  # the decode passes were graphs, on both ranks alike
        assert out[0]["graph_passes"] == out[1]["graph_passes"] >= 2 * (PARAMS.max_tokens - 2)
        assert out[0]["replays"] == out[1]["replays"] == out[0]["graph_passes"]  # rank 1's idle: padding
    else:
        assert out[0]["replays"] == out[1]["replays"] == 0
    if engine_kw.get("device") == "cuda" or eager_pieces:  # every other pass: the prefill graphs' path
        # (prompts; on the CPU, with no decode graphs, every pass), on both ranks alike; no eager pass
        assert out[0]["prefill_graph_passes"] == out[1]["prefill_graph_passes"] >= 2
        for r in (0, 1):
            assert out[r]["prefill_replays"] == out[r]["prefill_graph_passes"], r
            assert out[r]["forward_passes"] == out[r]["graph_passes"] + out[r]["prefill_graph_passes"], r
    else:
        assert out[0]["prefill_replays"] == out[1]["prefill_replays"] == 0
    for rank in (0, 1):
        assert out[rank]["pairs"] == [out[rank]["expected_pairs"]] * len(out[rank]["pairs"]), rank
        # Each pass is counted once by how it ran (the workers' forward_passes metric).
        assert sum(out[rank]["pass_kinds"].values()) == out[rank]["forward_passes"], rank
    return dict(out)


def _dying_rank_main(rank: int, world: int, port: int, out: dict) -> None:
    """Rank 1 dies (its process exits) while rank 0 generates."""
    import time

    faulthandler.dump_traceback_later(WATCHDOG, exit=True)
    torch.set_num_threads(1)
    llm = LLM(
        "tiny-moe", num_kv_blocks=64, expert_parallel_size=world, expert_parallel_rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}",
    )  # fmt: skip
    if rank == 1:
        llm.generate([PROMPTS[1]], PARAMS)  # some steps together first
        os._exit(3)
    llm.generate([PROMPTS[0]], PARAMS)
    started = time.monotonic()
    try:
        llm.generate([PROMPTS[0]], SamplingParams(max_tokens=10_000, temperature=0.0, ignore_eos=True))
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["seconds"] = time.monotonic() - started
    os._exit(0)  # the group is broken: leave without destroying it


@pytest.mark.slow
def test_a_rank_that_dies_fails_the_others_step_at_once() -> None:
    """The lockstep's per-step flags go over gloo, whose connections close with a dead peer's process: the
    surviving rank's next step raises (so its worker's engine thread stops and admission refuses requests)
    instead of waiting for the process group's timeout."""
    out = mp.Manager().dict()
    ctx = mp.spawn(_dying_rank_main, args=(2, free_port(), out), nprocs=2, join=False)
    for p in ctx.processes:
        p.join(WATCHDOG + 30)
    # gloo's words: "Connection closed by peer" or "Connection reset by peer"
    assert out["error"] is not None and "by peer" in out["error"], out.get("error")
    assert out["seconds"] < TIMEOUT.total_seconds() / 4


def _hanging_rank_main(rank: int, world: int, port: int, out: dict) -> None:
    """Rank 1 stops stepping (alive, but stuck elsewhere) while rank 0 generates."""
    import time

    faulthandler.dump_traceback_later(WATCHDOG, exit=True)
    torch.set_num_threads(1)
    llm = LLM(
        "tiny-moe", num_kv_blocks=64, expert_parallel_size=world, expert_parallel_rank=rank,
        distributed_init_method=f"tcp://127.0.0.1:{port}", distributed_timeout_s=HANG_TIMEOUT_S,
    )  # fmt: skip
    if rank == 1:
        llm.generate([PROMPTS[1]], PARAMS)
        time.sleep(HANG_TIMEOUT_S * 4)  # never joins rank 0's next steps
        os._exit(0)
    llm.generate([PROMPTS[0]], PARAMS)
    started = time.monotonic()
    try:
        llm.generate([PROMPTS[0]], PARAMS)
        out["error"] = None
    except RuntimeError as exc:
        out["error"] = str(exc)
    out["seconds"] = time.monotonic() - started
    os._exit(0)


HANG_TIMEOUT_S = 3.0


@pytest.mark.slow
def test_a_rank_that_hangs_fails_the_others_step_after_the_timeout() -> None:
    """``distributed_timeout_s`` bounds a collective: a rank that stops stepping without dying fails the
    others' next step after it (not after the default's ten minutes)."""
    out = mp.Manager().dict()
    ctx = mp.spawn(_hanging_rank_main, args=(2, free_port(), out), nprocs=2, join=False)
    for p in ctx.processes:
        p.join(WATCHDOG + 30)
    assert out["error"] is not None and "timed out" in out["error"].lower(), out.get("error")
    assert HANG_TIMEOUT_S * 0.9 <= out["seconds"] < HANG_TIMEOUT_S * 3, out["seconds"]
