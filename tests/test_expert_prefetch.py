"""The speculative expert prefetch (kernels/triton_expert_prefetch.py, engine/moe/expert_prefetch.py).

In the interpreter (CPU) and on a GPU: the kernel's guess is the top-k of the router applied to the
post-attention norm of its input, under the reference's roundings, as physical replica-0 ids, and its
arrival counts are back at zero after each launch (on the GPU: with 32 programs that wait for one another,
several launches in a row and inside a CUDA graph). On a GPU (marked ``gpu``): the engine's tokens and
logprobs with the prefetch in its batch-1 graphs are bit-identical to those without it, and the recorded
guesses and routed experts give a hit rate.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kernels.triton_expert_prefetch import expert_prefetch_triton
from tests.kernel_testing import DEVICE, needs_gpu


def _case(experts: int, hidden: int, inter: int, top_k: int, dtype: torch.dtype, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (scale * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)

    p2l = torch.randperm(experts, generator=g)  # a placement that is not the identity
    l2p = torch.empty(experts, 1, dtype=torch.int64)
    l2p[p2l, 0] = torch.arange(experts)
    return dict(
        h=rnd(1, hidden), g=(1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype).to(DEVICE),
        router=rnd(experts, hidden, scale=0.05), l2p=l2p.to(DEVICE), w13=rnd(experts, 2 * inter, hidden),
        w2=rnd(experts, hidden, inter), top_k=top_k,
    )  # fmt: skip


def _reference_logits(c: dict, eps: float) -> torch.Tensor:
    """The engine's post-attention norm (kernels/norm.py's roundings) and router, in float32."""
    h = c["h"].float()
    dtype = c["h"].dtype
    normed = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)).to(dtype).float()
    xn = (c["g"].float() * normed).to(dtype).float()
    return (xn @ c["router"].float().t())[0]


def _launch(c: dict, num_programs: int | None = None, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    experts = c["router"].shape[0]
    logits = torch.full((experts,), float("nan"), dtype=torch.float32, device=DEVICE)
    counts = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    guessed = torch.full((c["top_k"],), -1, dtype=torch.int32, device=DEVICE)
    for _ in range(3):  # the counts must come back to zero for the next launch to pass its wait
        expert_prefetch_triton(c["h"], c["g"], eps, c["router"], c["l2p"], c["w13"], c["w2"], c["top_k"], 0.5,
                               0.25, logits, counts, guessed, num_programs)  # fmt: skip
    assert counts.tolist() == [0, 0]
    return logits, guessed


def _assert_guess(c: dict, logits: torch.Tensor, guessed: torch.Tensor) -> None:
    ref = _reference_logits(c, 1e-6)
    torch.testing.assert_close(logits, ref, rtol=1e-4, atol=1e-4)
    order = ref.sort(descending=True)
    k = c["top_k"]
    assert order.values[k - 1] - order.values[k] > 1e-3, "the case's k-th and next logits nearly tie"
    expect = c["l2p"][order.indices[:k], 0]
    assert sorted(guessed.tolist()) == sorted(expect.tolist())
    assert guessed.tolist() == expect.tolist(), "the guesses are stored best first"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_guess_is_the_routers_top_k_on_the_layer_input(dtype: torch.dtype) -> None:
    c = _case(16, 64, 32, 4, dtype, seed=3)
    logits, guessed = _launch(c)
    _assert_guess(c, logits, guessed)


def test_more_than_one_row_is_refused() -> None:
    c = _case(8, 32, 16, 2, torch.float32, seed=1)
    with pytest.raises(ValueError, match="one row"):
        expert_prefetch_triton(torch.zeros(2, 32, device=DEVICE), c["g"], 1e-6, c["router"], c["l2p"], c["w13"],
                               c["w2"], 2, 0.5, 0.0, torch.empty(8, device=DEVICE),
                               torch.zeros(2, dtype=torch.int32, device=DEVICE),
                               torch.empty(2, dtype=torch.int32, device=DEVICE))  # fmt: skip


def test_the_prefetcher_is_refused_where_it_cannot_run() -> None:
    from engine import LLM
    from engine.moe.expert_prefetch import ExpertPrefetcher

    model = LLM("tiny-moe").engine.model
    with pytest.raises(ValueError, match="CUDA"):
        ExpertPrefetcher(model.moe_blocks(), torch.device("cpu"))
    with pytest.raises(ValueError, match="MoE layers"):
        ExpertPrefetcher([], torch.device("cpu"))


@needs_gpu
def test_many_programs_wait_for_one_another_and_reset_on_the_gpu() -> None:
    c = _case(128, 2048, 768, 8, torch.bfloat16, seed=11)
    logits, guessed = _launch(c, num_programs=32)
    _assert_guess(c, logits, guessed)
    # Captured in a CUDA graph and replayed: the same guess each time, the counts back at zero.
    counts = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    out = torch.full((8,), -1, dtype=torch.int32, device=DEVICE)
    scratch = torch.empty(128, dtype=torch.float32, device=DEVICE)
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph):
        expert_prefetch_triton(c["h"], c["g"], 1e-6, c["router"], c["l2p"], c["w13"], c["w2"], 8, 1.0, 1.0,
                               scratch, counts, out, 32)  # fmt: skip
    for _ in range(4):
        out.fill_(-1)
        graph.replay()
        torch.cuda.synchronize()
        assert out.tolist() == guessed.tolist()
        assert counts.tolist() == [0, 0]


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(
        "qwen3_moe_norm", tmp_path_factory.mktemp("qwen3moe_pf"), seed=5, hidden_size=512,
        num_attention_heads=8, num_key_value_heads=2, head_dim=64, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=256, decoder_sparse_step=1, num_hidden_layers=3, max_position_embeddings=2048,
    )  # fmt: skip


@needs_gpu
def test_engine_tokens_are_bit_identical_with_the_prefetch(moe_checkpoint: Path) -> None:
    from engine import LLM, SamplingParams
    from engine.moe.expert_prefetch import ExpertPrefetcher
    from tests.test_gpu_engine import TOP, _prompts

    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=TOP)
    prompts = _prompts(3, seed=4, vocab=380)
    llm = LLM(str(moe_checkpoint), device="cuda", dtype="bfloat16", kernel_backend="triton", num_kv_blocks=256)
    engine = llm.engine
    graphs = engine.runner.graphs
    assert graphs is not None and 1 in graphs.graphs
    before = [llm.generate([p], params)[0] for p in prompts]  # one at a time: batch-1 graphs
    prefetch = ExpertPrefetcher(engine.model.moe_blocks(), torch.device("cuda"), 1.0, 1.0)
    prefetch.record(True)
    engine.model.set_expert_prefetch(prefetch)
    graphs.set_megakernel(graphs.megakernel)  # the batch-1 graph captured again, with the side launches
    replays = graphs.replays[1]
    after = [llm.generate([p], params)[0] for p in prompts]
    assert graphs.replays[1] - replays >= 3 * 12
    for a, b in zip(after, before, strict=True):
        assert a.token_ids == b.token_ids
        assert [lp.top for lp in a.logprobs] == [lp.top for lp in b.logprobs]
    hit = prefetch.hit_rate()
    assert 0.0 <= hit <= 1.0
    for i, block in enumerate(prefetch.blocks):
        assert block.routed is not None and (block.routed >= 0).all() and (block.routed < 16).all()
        assert (prefetch.guessed[i] >= 0).all() and (prefetch.guessed[i] < 16).all()
    assert prefetch.counts.tolist() == [0, 0]
