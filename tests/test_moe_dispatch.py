"""Expert parallelism through the dispatch interface: two gloo ranks, each holding half of the physical
experts, give the same tokens as one rank holding all of them."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from engine import LLM, SamplingParams
from mesh.cli import free_port

# Rank r serves prompt r (data-parallel attention); both ranks see every token in the MoE layers. The
# prompts have the same length so both ranks take the same number of steps (collectives line up).
PROMPTS = [[5, 17, 99, 3, 250, 7, 64, 12, 200], [200, 12, 64, 7, 250, 3, 99, 17, 5]]
PARAMS = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


# The GPU variant's engines: the Triton ops (with CUDA graphs where they apply), float32 so that the
# ranks' partial expert sums cannot round a token differently from the single rank's.
GPU_ENGINE = {"device": "cuda", "kernel_backend": "triton", "dtype": "float32"}


def _rank_main(
    rank: int, world: int, port: int, prompts: list[list[int]], out: dict, engine_kw: dict | None = None
) -> None:
    import torch.distributed as dist

    from engine import EngineConfig, LLMEngine
    from engine.moe.dispatch import AllGatherDispatcher

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    if engine_kw:  # one GPU per rank, over NCCL
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", rank=rank, world_size=world, device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dispatcher = AllGatherDispatcher()
        config = EngineConfig(model="tiny-moe", num_kv_blocks=64, **(engine_kw or {}))
        engine = LLMEngine(config, dispatcher=dispatcher)
        # Each rank holds half of the 8 physical experts.
        assert engine.model.moe_blocks()[0].w13.shape[0] == 8 // world
        # Decode cannot be captured with several ranks (the dispatcher reads token counts on the host).
        assert engine.runner.graphs is None
        llm = LLM.__new__(LLM)
        llm.engine, llm.tokenizer = engine, engine.tokenizer
        out[rank] = [o.token_ids for o in llm.generate(prompts[rank], PARAMS)]
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
    """Two GPUs, one rank each, all-gather and all-reduce over NCCL: the single GPU's tokens (its engine
    with decode graphs, the ranks' without)."""
    single = LLM("tiny-moe", num_kv_blocks=64, **GPU_ENGINE)
    assert single.engine.runner.graphs is not None
    expected = [single.generate([p], PARAMS)[0].token_ids for p in PROMPTS]
    del single
    out = mp.Manager().dict()
    mp.spawn(_rank_main, args=(2, free_port(), [[p] for p in PROMPTS], out, GPU_ENGINE), nprocs=2, join=True)
    assert [out[0][0], out[1][0]] == expected
