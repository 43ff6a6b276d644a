"""DeepSeek-V3 (engine/models/mla.py) beyond greedy parity (tests/test_parity.py runs both DeepSeek
checkpoints of tests/checkpoints.py against transformers): the latent KV pool's layout, the routing op
against transformers' router, prefix-cache hits and preemption, the Triton ops (in the interpreter), two
expert-parallel ranks over gloo, YaRN for the other families, and what such a model refuses."""

from __future__ import annotations

import faulthandler
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from engine import LLM, SamplingParams
from mesh.cli import free_port
from tests.checkpoints import VOCAB, hf_greedy, make_checkpoint
from tests.kernel_testing import needs_gpu

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("ds") / "ds", seed=7)


def _prompts(n: int, seed: int, lengths: tuple[int, int] = (3, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def test_the_pool_holds_one_latent_a_token(deepseek: Path) -> None:
    """The KV pool holds the latent (kv_lora_rank normalised values) and the rotary key, split across its
    K and V halves: (32 + 16) / 2 values each, one head, not heads x head_dim twice."""
    llm = LLM(str(deepseek), dtype="float32", num_kv_blocks=16)
    layout = llm.engine.layout
    assert (layout.num_kv_heads, layout.head_dim) == (1, 24)
    assert tuple(llm.engine.kv_pool.shape[2:]) == (2, 16, 1, 24)
    prompt = _prompts(1, seed=1)[0]
    llm.generate([prompt], GREEDY)
    attn = llm.engine.model.layers[0].self_attn
    # The first token's latent: the normalised kv_a projection of its input's norm, then its rotary key.
    layer0 = llm.engine.model.layers[0]
    h = torch.nn.functional.rms_norm(
        llm.engine.model.embed_tokens[prompt[:1]], (64,), layer0.input_layernorm, 1e-6
    )
    kv = h @ attn.kv_a_proj_with_mqa.t()
    want = torch.nn.functional.rms_norm(kv[:, :32], (32,), attn.kv_a_layernorm, 1e-6)[0]
    pool = llm.engine.kv_pool
    stored = torch.cat([pool[:, 0, 0, 0, 0], pool[:, 0, 1, 0, 0]], dim=-1)[:, :32]  # every block's slot 0
    assert any(torch.allclose(row, want, atol=1e-5) for row in stored)


def test_grouped_routing_equals_transformers_router() -> None:
    """The routing op picks transformers' experts with its weights (choice bias, groups, renormalisation,
    scaling), and counts each pair for its physical replica."""
    import transformers

    from kernels.moe_routing import moe_route_grouped_torch

    config = transformers.DeepseekV3Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
                                           topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)  # fmt: skip
    router = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(config)
    torch.manual_seed(0)
    with torch.no_grad():
        router.weight.normal_()
        router.e_score_correction_bias.normal_(0, 0.3)
    x = torch.randn(50, 32)
    logits, want_w, want_ids = router(x)
    counts = torch.zeros(16, dtype=torch.int64)
    identity = torch.arange(16).unsqueeze(1)
    got_w, got_ids = moe_route_grouped_torch(logits, router.e_score_correction_bias, 4, 4, 2, True, 2.5, identity,
                                             torch.ones(16, dtype=torch.int64), counts, torch.float32)  # fmt: skip
    order_w, order_g = want_ids.sort(dim=1), got_ids.sort(dim=1)
    assert torch.equal(order_w.values, order_g.values)
    torch.testing.assert_close(got_w.gather(1, order_g.indices), want_w.gather(1, order_w.indices))
    assert int(counts.sum()) == 50 * 4 and torch.equal(
        counts, torch.bincount(want_ids.reshape(-1), minlength=16)
    )


def test_v2_routing_equals_transformers_router() -> None:
    """DeepSeek-V2's routing (softmax scores, groups scored by their best, scaled, not renormalised)
    picks transformers' experts with its weights, greedy and group-limited."""
    import transformers

    from kernels.moe_routing import moe_route_grouped_torch

    for method, groups, kept in (("group_limited_greedy", 4, 2), ("greedy", 1, 1)):
        config = transformers.DeepseekV2Config(hidden_size=32, n_routed_experts=16, num_experts_per_tok=3,
                                               n_group=groups, topk_group=kept, topk_method=method,
                                               routed_scaling_factor=1.7)  # fmt: skip
        router = transformers.models.deepseek_v2.modeling_deepseek_v2.DeepseekV2TopkRouter(config)
        torch.manual_seed(1)
        with torch.no_grad():
            router.weight.normal_()
        logits, want_w, want_ids = router(torch.randn(40, 32))
        counts = torch.zeros(16, dtype=torch.int64)
        got_w, got_ids = moe_route_grouped_torch(logits, torch.zeros(16), 3, groups, kept, False, 1.7,
                                                 torch.arange(16).unsqueeze(1), torch.ones(16, dtype=torch.int64),
                                                 counts, torch.float32, softmax=True)  # fmt: skip
        order_w, order_g = want_ids.sort(dim=1), got_ids.sort(dim=1)
        assert torch.equal(order_w.values, order_g.values), method
        torch.testing.assert_close(got_w.gather(1, order_g.indices), want_w.gather(1, order_w.indices))


def test_prefix_cache_hits_and_preemption_keep_the_tokens(deepseek: Path) -> None:
    """A prompt whose prefix is cached, and requests preempted by a pool too small for all of them, give
    the tokens of a fresh engine (the latent blocks are shared and recomputed as any KV)."""
    prompts = _prompts(4, seed=2, lengths=(34, 40))
    shared = prompts[0][:32] + [7, 8, 9]
    want = [
        o.token_ids
        for o in LLM(str(deepseek), dtype="float32", num_kv_blocks=64).generate(prompts + [shared], GREEDY)
    ]
    llm = LLM(str(deepseek), dtype="float32", num_kv_blocks=64)
    llm.generate(prompts[:1], GREEDY)
    again = llm.generate([shared], GREEDY)[0]
    assert again.num_cached_tokens == 32 and again.token_ids == want[-1]
    long = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    fresh = LLM(str(deepseek), dtype="float32", num_kv_blocks=64, enable_prefix_caching=False)
    small = LLM(str(deepseek), dtype="float32", num_kv_blocks=10, enable_prefix_caching=False)
    outs = small.generate(prompts, long)
    assert [o.token_ids for o in outs] == [o.token_ids for o in fresh.generate(prompts, long)]
    assert small.engine.scheduler.num_preemptions > 0


def test_triton_ops_in_the_interpreter_give_the_torch_tokens(
    deepseek: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    prompts = _prompts(2, seed=3)
    kw = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    triton = LLM(str(deepseek), kernel_backend="triton", **kw).generate(prompts, GREEDY)
    torch_ = LLM(str(deepseek), **kw).generate(prompts, GREEDY)
    assert [o.token_ids for o in triton] == [o.token_ids for o in torch_]


def _rank(rank: int, world: int, port: int, path: str, prompts: list[list[int]], kw: dict, out: dict) -> None:
    faulthandler.dump_traceback_later(180, exit=True)
    torch.set_num_threads(1)
    llm = LLM(path, dtype="float32", num_kv_blocks=64, expert_parallel_size=world, expert_parallel_rank=rank,
              distributed_init_method=f"tcp://127.0.0.1:{port}", **kw)  # fmt: skip
    w13 = llm.engine.model.moe_blocks()[0].w13
    assert w13.shape[0] == 8 // world
    out[f"w13_{rank}"] = type(w13).__name__
    out[rank] = [o.token_ids for o in llm.generate([prompts[rank]], GREEDY)]
    llm.close()


@pytest.mark.slow
@pytest.mark.parametrize("float8", [False, True], ids=["bf16-like", "float8-weights-and-kv"])
def test_two_expert_parallel_ranks_give_one_ranks_tokens(
    deepseek: Path, float8: bool, tmp_path: Path
) -> None:
    """Each of two ranks holds half of the routed experts (the shared expert and attention whole) and
    serves its own prompt; together they give the single engine's tokens. Also with a float8 checkpoint's
    weights kept in float8 (each rank's experts too) and a float8 latent pool."""
    from tests.checkpoints import quantize_checkpoint

    path, kw = deepseek, {}
    if float8:
        path, kw = tmp_path / "fp8", {"kv_cache_dtype": "fp8"}
        quantize_checkpoint(deepseek, path, "fp8", block=(16, 128))
    prompts = _prompts(2, seed=4)
    single = LLM(str(path), dtype="float32", num_kv_blocks=64, **kw)
    want = [single.generate([p], GREEDY)[0].token_ids for p in prompts]
    out = mp.Manager().dict()
    mp.spawn(_rank, args=(2, free_port(), str(path), prompts, kw, out), nprocs=2, join=True)
    assert [out[0][0], out[1][0]] == want
    assert out["w13_0"] == out["w13_1"] == ("Fp8Weight" if float8 else "Parameter")


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_yarn_scaling_matches_transformers(arch: str, tmp_path: Path) -> None:
    """YaRN for the other families too (Qwen3's long-context setting): the cos/sin factor and the
    frequencies' ramp, past the original context."""
    yarn = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
    path = make_checkpoint(arch, tmp_path / arch, seed=9, rope_parameters=yarn, rope_scaling=None)
    prompt = _prompts(1, seed=5, lengths=(60, 61))[0]
    want = hf_greedy(path, prompt, 12)
    assert LLM(str(path), dtype="float32", num_kv_blocks=64).generate([prompt], SamplingParams(
        max_tokens=12, temperature=0.0, ignore_eos=True))[0].token_ids == want  # fmt: skip


def test_what_a_deepseek_model_refuses(deepseek: Path, tmp_path: Path) -> None:
    """A float8 KV pool for a checkpoint with calibrated KV scales (the latent is stored unscaled; the same
    checkpoint serves with a 16-bit pool, where scales are not used)."""
    from tests.checkpoints import write_weights

    scaled = write_weights(
        deepseek, tmp_path / "scaled", {"model.layers.0.self_attn.k_scale": torch.tensor(0.5)}
    )
    with pytest.raises(ValueError, match="KV scales .* for latent attention are not served"):
        LLM(str(scaled), dtype="float32", num_kv_blocks=16, kv_cache_dtype="fp8")
    assert LLM(str(scaled), dtype="float32", num_kv_blocks=16).engine.model.layers[0].self_attn.k_scale == 0.5


def test_the_decode_path_of_the_latent_attention_equals_the_general_one() -> None:
    """The graph-safe decode path (one query a sequence, no host synchronisation) gives the per-sequence
    path's result; a padding row (seq_len 0) gets zeros, not NaNs."""
    from kernels.mla_attention import mla_attention_torch

    gen = torch.Generator().manual_seed(0)
    pool = torch.randn(12, 2, 2, 4, 1, 24, generator=gen)  # 12 blocks, 2 layers, block size 4, latent 48
    seq_lens = torch.tensor([5, 1, 9, 0], dtype=torch.int32)
    tables = torch.tensor([[3, 7, 0], [5, 0, 0], [1, 2, 11], [0, 0, 0]], dtype=torch.int32)
    q = torch.randn(4, 3, 48, generator=gen)
    qsl = torch.arange(5, dtype=torch.int32)
    fast = mla_attention_torch(q, pool, 1, tables, seq_lens, qsl, 0.3, 32, decode=True)
    slow = mla_attention_torch(q[:3], pool, 1, tables[:3], seq_lens[:3], qsl[:4], 0.3, 32)
    torch.testing.assert_close(fast[:3], slow)
    assert torch.equal(fast[3], torch.zeros(3, 32))


def test_the_latent_attentions_prompt_path_bounds_its_scores(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt's queries go through the reference in chunks of rows whose scores fit
    ``SCORE_CHUNK_ELEMENTS`` (a whole 4k prompt's would be gigabytes at V3's 128 heads): chunks of one to
    three rows give the one-chunk result, causality kept across the chunks (a sequence with a cached
    prefix and new rows, one of a single row, one of 11)."""
    from kernels import mla_attention

    gen = torch.Generator().manual_seed(4)
    pool = torch.randn(12, 2, 2, 4, 1, 24, generator=gen)
    seq_lens = torch.tensor([9, 1, 11], dtype=torch.int32)
    tables = torch.tensor([[1, 2, 11], [5, 0, 0], [3, 7, 9]], dtype=torch.int32)
    qsl = torch.tensor([0, 6, 7, 18], dtype=torch.int32)  # 6 new rows after 3 cached; 1; 11
    q = torch.randn(18, 3, 48, generator=gen)
    whole = mla_attention.mla_attention_torch(q, pool, 1, tables, seq_lens, qsl, 0.3, 32)
    for budget in (3 * 11, 3 * 11 * 3):  # heads x S: one row a chunk, then three
        monkeypatch.setattr(mla_attention, "SCORE_CHUNK_ELEMENTS", budget)
        got = mla_attention.mla_attention_torch(q, pool, 1, tables, seq_lens, qsl, 0.3, 32)
        torch.testing.assert_close(got, whole, atol=1e-6, rtol=1e-6)
    # Row 0 of the first sequence sees its 3 cached keys and itself: changing key 4 leaves it alone.
    later = pool.clone()
    later[2, 1, :, 0] += 1.0  # block 2's slot 0: the first sequence's key 4 (0-based)
    moved = mla_attention.mla_attention_torch(q, later, 1, tables, seq_lens, qsl, 0.3, 32)
    assert torch.equal(moved[0], got[0]) and not torch.equal(moved[1], got[1])


def test_decode_graph_pieces_equal_the_forward(deepseek: Path) -> None:
    """CPU: the decode graphs' pieces (``decode_step_pieces`` with the decode metadata) compute the
    model's logits, as the eager forward does."""
    from engine.cuda_graphs import decode_step_pieces
    from engine.models.decoder import AttentionMetadata

    llm = LLM(str(deepseek), dtype="float32", num_kv_blocks=32)
    prompts = _prompts(3, seed=6, lengths=(5, 20))
    model, pool = llm.engine.model, llm.engine.kv_pool
    n = [len(p) for p in prompts]
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]], dtype=torch.int32)
    # Write each prompt's latents into its own blocks with an eager prefill pass.
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for p in prompts for i in range(len(p))])
    slots = torch.tensor(
        [int(tables[b, i // 16]) * 16 + i % 16 for b, p in enumerate(prompts) for i in range(len(p))]
    )
    qsl = torch.tensor([0, n[0], n[0] + n[1], sum(n)], dtype=torch.int32)
    prefill = AttentionMetadata(slots, tables, torch.tensor(n, dtype=torch.int32), qsl)
    model(ids, positions, pool, prefill)
    step_ids = torch.tensor([7, 8, 9])
    step_pos = torch.tensor(n)
    step_slots = torch.tensor([int(tables[b, n[b] // 16]) * 16 + n[b] % 16 for b in range(3)])
    lens = torch.tensor([x + 1 for x in n], dtype=torch.int32)
    eager_meta = AttentionMetadata(step_slots, tables, lens, torch.arange(4, dtype=torch.int32))
    want = model.compute_logits(model(step_ids, step_pos, pool, eager_meta))
    logits = torch.zeros(3, model.cfg.vocab_size)
    meta = AttentionMetadata(step_slots, tables, lens, torch.arange(4, dtype=torch.int32), decode=True)
    for piece in decode_step_pieces(model, step_ids, step_pos, pool, meta, logits, layers_per_piece=2):
        piece()
    torch.testing.assert_close(logits, want, atol=1e-4, rtol=1e-4)


@needs_gpu
@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2"])
def test_gpu_triton_ops_and_decode_graphs_give_the_torch_tokens(arch: str, tmp_path: Path) -> None:
    """On a GPU: the Triton ops, the decode CUDA graphs (the latent attention's graph-safe path inside
    them), the prefill graphs (the latent attention eager between their pieces) and asynchronous
    scheduling give the CPU torch engine's tokens (float32), V3's sigmoid routing and V2's softmax one;
    bf16 runs too."""
    deepseek = make_checkpoint(arch, tmp_path / arch, seed=7)
    prompts = _prompts(5, seed=8, lengths=(3, 60))
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [
        o.token_ids for o in LLM(str(deepseek), dtype="float32", num_kv_blocks=64).generate(prompts, long)
    ]
    fast = LLM(str(deepseek), device="cuda", dtype="float32", kernel_backend="triton", num_kv_blocks=64)
    runner = fast.engine.runner
    assert runner.graphs is not None and runner.prefill_graphs is not None
    assert [o.token_ids for o in fast.generate(prompts, long)] == want
    assert sum(runner.graphs.replays.values()) > 0 and sum(runner.prefill_graphs.replays.values()) > 0
    del fast
    half = LLM(str(deepseek), device="cuda", dtype="bfloat16", kernel_backend="triton", num_kv_blocks=64)
    outs = half.generate(prompts, long)
    assert all(len(o.token_ids) == 24 for o in outs)
    agree = sum(
        a == b for o, w in zip(outs, want, strict=True) for a, b in zip(o.token_ids[:4], w[:4], strict=True)
    )
    assert agree >= 10  # bf16 rounding may part from float32 late, rarely in the first tokens


@pytest.mark.parametrize("softmax", [False, True])
@pytest.mark.parametrize("experts,groups,kept,k", [(8, 4, 2, 3), (64, 1, 1, 6), (256, 8, 4, 8)])
def test_the_triton_grouped_routing_equals_the_reference(
    experts: int, groups: int, kept: int, k: int, softmax: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the interpreter: the same experts, weights and counts (replicas too), for DeepSeek-V3's own
    shape (256 experts, 8 groups, 4 kept, 8 chosen), Moonlight's (one group) and the tests' model's; V3's
    sigmoid routing and V2's softmax one."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.moe_routing import moe_route_grouped_torch
    from kernels.triton_mla import moe_route_grouped_triton

    gen = torch.Generator().manual_seed(experts)
    logits, bias = torch.randn(9, experts, generator=gen), torch.randn(experts, generator=gen) * 0.3
    physical = experts + 2  # the first two experts have a second replica
    l2p = torch.full((experts, 2), -1, dtype=torch.int64)
    l2p[:, 0] = torch.arange(experts)
    l2p[:2, 1] = torch.tensor([experts, experts + 1])
    replicas = torch.ones(experts, dtype=torch.int64)
    replicas[:2] = 2
    live = torch.tensor([1, 1, 1, 1, 1, 1, 1, 0, 1])
    runs = []
    for route in (moe_route_grouped_torch, moe_route_grouped_triton):
        counts = torch.zeros(physical, dtype=torch.int64)
        weights, ids = route(
            logits,
            bias,
            k,
            groups,
            kept,
            not softmax,
            2.5,
            l2p,
            replicas,
            counts,
            torch.float32,
            live,
            softmax=softmax,
        )
        order = ids.sort(dim=1)
        runs.append((order.values, weights.gather(1, order.indices), counts))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][2], runs[1][2])
    torch.testing.assert_close(runs[0][1], runs[1][1])


def _short_rows(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seq_lens = torch.tensor([5, 1, 11, 0], dtype=torch.int32)
    tables = torch.tensor([[3, 7, 0], [5, 0, 0], [1, 2, 11], [0, 0, 0]], dtype=torch.int32)
    return torch.randn(12, 2, 2, 4, 1, 24, generator=gen), seq_lens, tables


def _wide_rows(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seq_lens = torch.tensor([70, 33, 0, 129, 16], dtype=torch.int32)
    pool = torch.randn(90, 2, 2, 4, 1, 24, generator=gen)
    return pool, seq_lens, torch.randint(0, 90, (5, 80), generator=gen, dtype=torch.int32)


@pytest.mark.parametrize(
    ("rows", "splits"),
    [
        (_short_rows, 1),
        (_short_rows, 2),
        (_short_rows, 16),
        (_wide_rows, None),
        (_wide_rows, 4),
        (_wide_rows, 64),
    ],
)
def test_the_triton_latent_attention_equals_the_reference(
    rows: Callable, splits: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the interpreter: the split-KV decode kernel and its merge give the reference's decode path,
    with one split or several (some of them empty), and zeros for a padding row. Sequences much shorter
    than the block table's span (a wide table, as a long ``max_model_len`` gives) still spread over the
    splits (runs of whole 16-key tiles of their own length: the 129-token one over three of four), the
    default count and 64 (the merge's chunks of eight) included."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.mla_attention import mla_attention_torch
    from kernels.triton_mla import mla_attention_triton

    gen = torch.Generator().manual_seed(splits or 0)
    pool, seq_lens, tables = rows(gen)
    q = torch.randn(len(seq_lens), 3, 48, generator=gen)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    want = mla_attention_torch(q, pool, 1, tables, seq_lens, qsl, 0.3, 32, decode=True)
    got = mla_attention_triton(q, pool, 1, tables, seq_lens, qsl, 0.3, 32, decode=True, num_splits=splits)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    padding = int((seq_lens == 0).nonzero()[0, 0])
    assert torch.equal(got[padding], torch.zeros(3, 32))


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_the_triton_latent_attention_reads_a_float8_pool(
    pool_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the interpreter: over a float8 pool (``kv_cache_dtype`` fp8 or fp8_e5m2) the split kernel widens
    each latent tile to the query's dtype and gives the reference's decode path, which widens the pool to
    float32; both read the values the pool holds (not a 16-bit copy of them)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.mla_attention import mla_attention_torch
    from kernels.triton_mla import mla_attention_triton

    gen = torch.Generator().manual_seed(5)
    pool, seq_lens, tables = _wide_rows(gen)
    pool = pool.to(pool_dtype)
    q = torch.randn(len(seq_lens), 3, 48, generator=gen)
    qsl = torch.arange(len(seq_lens) + 1, dtype=torch.int32)
    want = mla_attention_torch(q, pool, 1, tables, seq_lens, qsl, 0.3, 32, decode=True)
    got = mla_attention_triton(q, pool, 1, tables, seq_lens, qsl, 0.3, 32, decode=True, num_splits=4)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    wider = mla_attention_torch(q, pool.float() * 1.01, 1, tables, seq_lens, qsl, 0.3, 32, decode=True)
    assert not torch.allclose(got, wider, atol=1e-3)


@pytest.mark.parametrize("prompt_rows", [1024, 5])
def test_the_triton_latent_attention_of_prompt_chunks_equals_the_reference(
    prompt_rows: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the interpreter: prompt chunks (several query tokens a sequence after a cached prefix, a whole
    prompt, a sequence without new tokens, one token) attend causally as the reference does, each token a
    row of its own over its context up to itself, in launches of ``PROMPT_ROWS`` tokens (5: rows of one
    sequence in two launches); the per-token rows' lengths are the tokens' positions plus one."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels import triton_mla
    from kernels.mla_attention import mla_attention_torch

    monkeypatch.setattr(triton_mla, "PROMPT_ROWS", prompt_rows)
    launches = _calls(monkeypatch, triton_mla, "_attend_rows")  # the kernels' path, not the reference
    gen = torch.Generator().manual_seed(prompt_rows)
    pool = torch.randn(20, 2, 2, 4, 1, 24, generator=gen)
    seq_lens = torch.tensor([11, 7, 5, 9], dtype=torch.int32)
    tables = torch.tensor([[3, 7, 12], [5, 1, 0], [2, 19, 0], [4, 6, 8]], dtype=torch.int32)
    qsl = torch.tensor([0, 6, 13, 13, 14], dtype=torch.int32)  # 6 new after 5 cached; all 7; none; 1
    q = torch.randn(14, 3, 48, generator=gen)
    seq_of, lens = triton_mla.per_token_rows(seq_lens, qsl, 14)
    assert seq_of.tolist() == [0] * 6 + [1] * 7 + [3]
    assert lens.tolist() == [6, 7, 8, 9, 10, 11, 1, 2, 3, 4, 5, 6, 7, 9]
    want = mla_attention_torch(q, pool, 1, tables, seq_lens, qsl, 0.3, 32)
    got = triton_mla.mla_attention_triton(q, pool, 1, tables, seq_lens, qsl, 0.3, 32)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert len(launches) == -(-14 // prompt_rows)  # 14 tokens: one launch, or three of up to 5


def test_the_latent_attention_splits_cut_each_sequences_own_length(monkeypatch: pytest.MonkeyPatch) -> None:
    """In the interpreter, which splits hold keys (a finite log-sum-exp) in a wide block table (320 slots
    a row): with 4 splits the 129-token sequence's runs of whole 16-key tiles are 48, 48 and 33 keys, so
    three splits hold keys (cutting the table's width, 80 slots a split, would put it in two and the
    70- and 33-token ones in one); the 16-token one is in the first split alone, the empty row in none."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.triton_mla import mla_splits

    gen = torch.Generator().manual_seed(3)
    pool, seq_lens, tables = _wide_rows(gen)
    q = torch.randn(len(seq_lens), 3, 48, generator=gen)
    _, lse = mla_splits(q, pool, 1, tables, seq_lens, 0.3, 32, 4)
    holds = torch.isfinite(lse).all(dim=2)  # [sequence, split]: every head alike
    assert torch.isfinite(lse).any(dim=2).equal(holds)
    assert holds.tolist() == [
        [True, True, True, False],  # 70 keys: runs of 32, 32, 6
        [True, True, True, False],  # 33 keys: runs of 16, 16, 1
        [False, False, False, False],
        [True, True, True, False],
        [True, False, False, False],
    ]


def _prologue_inputs(tokens: int, heads: int, nope: int, rope: int, rank: int, v: int, device: str,
                     dtype: torch.dtype, seed: int) -> dict:  # fmt: skip
    gen = torch.Generator(device=device).manual_seed(seed)

    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device=device) * scale).to(dtype)

    cos_sin = torch.cat([torch.cos(torch.arange(64.0)[:, None] * torch.arange(1, rope // 2 + 1) * 0.1),
                         torch.sin(torch.arange(64.0)[:, None] * torch.arange(1, rope // 2 + 1) * 0.1)], -1)  # fmt: skip
    blocks = max(10, tokens // 2)  # 4 slots a block: room for every token, and slots left unwritten
    slots = torch.randperm(4 * blocks, generator=torch.Generator().manual_seed(seed))[:tokens].to(device)
    slots[1::5] = -1  # padding rows write nothing
    half = (rank + rope) // 2
    return dict(
        q=rand(tokens, heads * (nope + rope)),
        kv=rand(tokens, rank + rope),
        positions=torch.randint(0, 64, (tokens,), generator=gen, device=device),
        cos_sin=cos_sin.to(device),
        norm_weight=rand(rank, scale=0.5),
        eps=1e-6,
        w_kv=rand(heads * (nope + v), rank, scale=0.1).view(heads, nope + v, rank),
        kv_pool=rand(blocks, 3, 2, 4, 1, half),
        layer=2,
        slot_mapping=slots,
    )


def _calls(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[int]:
    """Counts the calls of ``module.name`` (still made) in the list it returns."""
    calls: list[int] = []
    original = getattr(module, name)

    def counted(*args: object) -> object:
        calls.append(1)
        return original(*args)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize(("tokens", "nope"), [(1, 16), (3, 16), (21, 16), (3, 24), (70, 16)])
def test_the_triton_latent_attention_prologue_and_value_projection_equal_the_reference(
    tokens: int, nope: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the interpreter: the one-launch prologue (latent norm, RoPE of queries and keys, the pool write,
    the key projection absorbed into the queries) gives the reference's queries and pool, padding slots
    untouched, over one, a few and more than a block of tokens; so does its fallback of Triton ops for a
    shape the kernel does not take (a query head of 24 + 16) and for a pass longer than
    ``MLA_FUSED_MAX_TOKENS`` (a prompt); the value projection the reference's."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels import triton_mla
    from kernels.mla_attention import mla_prologue_torch, mla_value_proj_torch
    from kernels.triton_mla import mla_prologue_triton, mla_value_proj_triton

    fallbacks = _calls(monkeypatch, triton_mla, "mla_prologue_composed")
    value_fallbacks = _calls(monkeypatch, triton_mla, "mla_value_proj_torch")

    want_in = _prologue_inputs(tokens, 3, nope, 16, 32, 16, "cpu", torch.float32, tokens)
    got_in = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in want_in.items()}
    want = mla_prologue_torch(**want_in)
    got = mla_prologue_triton(**got_in)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got_in["kv_pool"], want_in["kv_pool"], atol=1e-5, rtol=1e-5)
    assert not torch.equal(want_in["kv_pool"], _prologue_inputs(tokens, 3, nope, 16, 32, 16, "cpu", torch.float32,
                                                                 tokens)["kv_pool"])  # fmt: skip
    o = torch.randn(tokens, 3, 32, generator=torch.Generator().manual_seed(tokens))
    torch.testing.assert_close(
        mla_value_proj_triton(o, want_in["w_kv"], 16), mla_value_proj_torch(o, want_in["w_kv"], 16),
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip
    assert len(fallbacks) == int(nope != 16 or tokens > triton_mla.MLA_FUSED_MAX_TOKENS)
    assert len(value_fallbacks) == int(tokens > triton_mla.MLA_FUSED_MAX_TOKENS)


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("tokens", [1, 21])
def test_the_triton_latent_prologue_writes_a_float8_pool_as_the_reference(
    tokens: int, pool_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the interpreter: the one-launch prologue writes a float8 pool's latents bit for bit as the
    reference (clamped, rounded to nearest even; keys of up to +-600 saturate e4m3 at 448), padding slots
    untouched, and gives its queries."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels import triton_mla
    from kernels.mla_attention import mla_prologue_torch
    from kernels.triton_mla import mla_prologue_triton

    fallbacks = _calls(monkeypatch, triton_mla, "mla_prologue_composed")
    want_in = _prologue_inputs(tokens, 3, 16, 16, 32, 16, "cpu", torch.float32, tokens)
    want_in["kv"][:, 32:] *= 200.0  # rotary keys past e4m3's range, and spread over its exponents
    want_in["kv_pool"] = want_in["kv_pool"].to(pool_dtype)
    got_in = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in want_in.items()}
    before = want_in["kv_pool"].clone()
    want = mla_prologue_torch(**want_in)
    got = mla_prologue_triton(**got_in)
    assert not fallbacks  # the kernel's own path
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_in["kv_pool"].view(torch.uint8), want_in["kv_pool"].view(torch.uint8))
    assert not torch.equal(want_in["kv_pool"].view(torch.uint8), before.view(torch.uint8))
    if pool_dtype == torch.float8_e4m3fn:
        assert want_in["kv_pool"].float().abs().max() == 448.0


@needs_gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_triton_latent_prologue_and_value_projection_at_deepseeks_shape(heads: int) -> None:
    """On a GPU at DeepSeek-V3's latent (128 + 64 query dims, 512 + 64 latent, 128 value dims) in bf16:
    the prologue's queries and pool and the value projection equal the reference within bf16's error."""
    from kernels.mla_attention import mla_prologue_torch, mla_value_proj_torch
    from kernels.triton_mla import mla_prologue_triton, mla_value_proj_triton

    for tokens in (1, 37):
        want_in = _prologue_inputs(tokens, heads, 128, 64, 512, 128, "cuda", torch.bfloat16, heads)
        got_in = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in want_in.items()}
        want = mla_prologue_torch(**want_in)
        got = mla_prologue_triton(**got_in)
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(
            got_in["kv_pool"].float(), want_in["kv_pool"].float(), atol=2e-2, rtol=2e-2
        )
        o = torch.randn(tokens, heads, 512, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close(
            mla_value_proj_triton(o, want_in["w_kv"], 128).float(),
            mla_value_proj_torch(o, want_in["w_kv"], 128).float(),
            atol=2e-2, rtol=2e-2,
        )  # fmt: skip


@needs_gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_triton_latent_attention_at_deepseeks_shape(heads: int) -> None:
    """On a GPU, DeepSeek-V3's latent (512 + 64) in bf16, Moonlight's and V3's head counts, contexts up
    to 3000 tokens over random blocks: the kernels give the reference's decode path within bf16's error,
    and its prompt path (a row a query token, over two launches of ``PROMPT_ROWS``);
    the routing kernel gives the reference's experts at V3's routing shape."""
    from kernels.mla_attention import mla_attention_torch
    from kernels.moe_routing import moe_route_grouped_torch
    from kernels.triton_mla import mla_attention_triton, moe_route_grouped_triton

    gen = torch.Generator(device="cuda").manual_seed(heads)
    pool = torch.randn(400, 2, 2, 16, 1, 288, generator=gen, device="cuda", dtype=torch.bfloat16)
    seq_lens = torch.tensor([1, 700, 3000, 0, 129], dtype=torch.int32, device="cuda")
    tables = torch.randint(0, 400, (5, 188), generator=gen, device="cuda", dtype=torch.int32)
    q = torch.randn(5, heads, 576, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.1
    qsl = torch.arange(6, dtype=torch.int32, device="cuda")
    want = mla_attention_torch(q, pool, 1, tables, seq_lens, qsl, 0.07, 512, decode=True)
    got = mla_attention_triton(q, pool, 1, tables, seq_lens, qsl, 0.07, 512, decode=True)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    # Prompt chunks: 600 new tokens after 100 cached, a whole 1200-token prompt, 3 tokens after 2996.
    seq_lens = torch.tensor([700, 1200, 2999], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0, 600, 1800, 1803], dtype=torch.int32, device="cuda")
    q = torch.randn(1803, heads, 576, generator=gen, device="cuda", dtype=torch.bfloat16) * 0.1
    want = mla_attention_torch(q, pool, 1, tables[:3], seq_lens, qsl, 0.07, 512)
    got = mla_attention_triton(q, pool, 1, tables[:3], seq_lens, qsl, 0.07, 512)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    logits = torch.randn(64, 256, generator=gen, device="cuda")
    bias = torch.randn(256, generator=gen, device="cuda") * 0.1
    l2p, replicas = (
        torch.arange(256, device="cuda").unsqueeze(1),
        torch.ones(256, dtype=torch.int64, device="cuda"),
    )
    counts = [torch.zeros(256, dtype=torch.int64, device="cuda") for _ in range(2)]
    a = moe_route_grouped_torch(logits, bias, 8, 8, 4, True, 2.5, l2p, replicas, counts[0], torch.bfloat16)
    b = moe_route_grouped_triton(logits, bias, 8, 8, 4, True, 2.5, l2p, replicas, counts[1], torch.bfloat16)
    assert torch.equal(a[1].sort(1).values, b[1].sort(1).values) and torch.equal(counts[0], counts[1])


def test_the_built_in_tiny_deepseek_model() -> None:
    """``tiny-deepseek`` (no checkpoint): its latent KV layout, and batched generation equal to one
    request at a time (chunked prompts, several sequences a step)."""
    llm = LLM("tiny-deepseek", num_kv_blocks=64, max_num_batched_tokens=16)
    assert llm.engine.model_config.mla is not None and llm.engine.layout.head_dim == 24
    prompts = ["Hello there, latent attention", "experts in groups", "x"]
    batched = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert batched == [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
    assert len({t for out in batched for t in out}) > 5


def test_new_expert_placements_leave_the_tokens_unchanged() -> None:
    """EPLB on a DeepSeek model (``enable_eplb``, redundant slots): placements applied at run time move
    the routed experts (the shared one and the router stay), the grouped routing still picks the same
    logical experts, and the tokens are unchanged."""
    from tests.test_eplb_engine import logical_load, scrambled

    prompts = [[5, 17, 99, 3, 250, 7, 64, 12, 200], [9, 8, 7, 6, 5, 4]]
    plain = LLM("tiny-deepseek", num_kv_blocks=64)
    want = [o.token_ids for o in plain.generate(prompts, GREEDY)]
    load = plain.engine.take_expert_counts()
    llm = LLM("tiny-deepseek", num_kv_blocks=64, enable_eplb=True, num_redundant_experts=4)
    engine = llm.engine
    layout = engine.moe_layout()
    assert layout is not None and (layout.num_layers, layout.num_logical, layout.num_physical) == (3, 8, 12)
    for version in (1, 2):
        placement = scrambled(layout.num_layers, 8, 12, seed=version)
        engine.set_expert_placement(version, placement)
        engine.take_expert_counts()
        assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
        assert torch.equal(logical_load(engine.take_expert_counts(), placement, 8), load)


def _engine_deepseek_weights(llm: LLM) -> dict[str, torch.Tensor]:
    """Every layer's query, latent and output projections, MLP, shared and routed experts, under their
    checkpoint names and in the checkpoint's row order (the loader's rotary reordering undone), float8
    ones as the tensors they stand for."""
    from engine.models.mla import rotary_row_order
    from kernels.fp8_weight import as_dense

    cfg = llm.engine.model_config

    def undo(w: torch.Tensor, proj: str) -> torch.Tensor:
        order = rotary_row_order(cfg, proj)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(len(order))
        return w[inverse]

    def gated(pre: str, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        inter = down.shape[1]
        out[pre + "gate_proj.weight"], out[pre + "up_proj.weight"] = gate_up[:inter], gate_up[inter:]
        out[pre + "down_proj.weight"] = down

    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(llm.engine.model.layers):
        attn, pre = layer.self_attn, f"model.layers.{i}.self_attn."
        qkv_a = as_dense(attn.qkv_a_proj)
        q, kv = qkv_a[: attn.q_rows], qkv_a[attn.q_rows :]
        if attn.q_lora:
            out[pre + "q_a_proj.weight"] = q
            out[pre + "q_b_proj.weight"] = undo(as_dense(attn.q_b_proj), "q")
        else:
            out[pre + "q_proj.weight"] = undo(q, "q")
        out[pre + "kv_a_proj_with_mqa.weight"] = undo(kv, "kv_a")
        out[pre + "kv_b_proj.weight"] = attn.kv_b_proj
        out[pre + "o_proj.weight"] = as_dense(attn.o_proj)
        mlp, pre = layer.mlp, f"model.layers.{i}.mlp."
        if not hasattr(mlp, "w13"):
            gated(pre, as_dense(mlp.gate_up_proj), as_dense(mlp.down_proj))
            continue
        shared = mlp.shared_experts
        gated(pre + "shared_experts.", as_dense(shared.gate_up_proj), as_dense(shared.down_proj))
        w13, w2 = as_dense(mlp.w13), as_dense(mlp.w2)
        for e in range(w13.shape[0]):
            gated(f"{pre}experts.{e}.", w13[e], w2[e])
    return out


@pytest.mark.parametrize(
    "arch, block, kept",
    [
        ("deepseek_v3", (16, 128), True),
        ("deepseek_v2_lite", (16, 128), True),
        ("deepseek_v3", (8, 128), False),
        ("deepseek_v3", (16, 16), False),
    ],
    ids=["v3-kept", "v2-lite-kept", "v3-rotary-rows-straddle-blocks", "v3-blocks-the-kernels-do-not-read"],
)
def test_a_float8_checkpoint_keeps_its_float8_weights(
    arch: str, block: tuple[int, int], kept: bool, tmp_path: Path
) -> None:
    """DeepSeek-V3's own checkpoints are fine-grained FP8 (``weight_scale_inv`` per 128 x 128 block). With
    blocks the kernels read (here 16 x 128: one block along these short rows) the query and latent
    projections (one stacked weight), the output projection, the shared and routed experts stay float8 with
    their scales, kv_b_proj (absorbed) and the router are widened; the rotary rows are reordered within
    their scale blocks. Where the reordering would move rows across blocks (8-row blocks split each head's
    16 rotary rows) or the kernels do not read the blocks (16 wide), everything is widened. Either way the
    weights stand for the checkpoint's bit for bit and the tokens are transformers' on the checkpoint."""
    from transformers import FineGrainedFP8Config

    from kernels.fp8_weight import Fp8Weight
    from tests.checkpoints import quantize_checkpoint

    src = make_checkpoint(arch, tmp_path / "src", seed=7)
    meant = quantize_checkpoint(src, tmp_path / "fp8", "fp8", block=block)
    llm = LLM(str(tmp_path / "fp8"), dtype="float32", num_kv_blocks=32)
    layer = llm.engine.model.layers[1]
    attn, mlp = layer.self_attn, layer.mlp
    float8 = [attn.qkv_a_proj, attn.o_proj, mlp.w13, mlp.w2, mlp.shared_experts.gate_up_proj]
    float8 += [attn.q_b_proj] if attn.q_lora else []
    assert [isinstance(w, Fp8Weight) for w in float8] == [kept] * len(float8)
    assert not isinstance(attn.kv_b_proj, Fp8Weight) and mlp.gate.dtype == torch.float32
    got = _engine_deepseek_weights(llm)
    assert set(got) == set(meant)
    for name, w in got.items():
        assert torch.equal(w, meant[name]), name
    prompt = _prompts(1, seed=11, lengths=(20, 21))[0]
    tokens = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[
        0
    ].token_ids
    assert len(set(tokens)) >= 4, tokens
    widened = {"quantization_config": FineGrainedFP8Config(dequantize=True)}
    assert tokens == hf_greedy(tmp_path / "fp8", prompt, 12, **widened)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2_lite"])
def test_quantization_fp8_quantises_a_16_bit_deepseek_checkpoint(arch: str, tmp_path: Path) -> None:
    """``quantization="fp8"`` over a DeepSeek checkpoint: its projections become float8 with a scale per
    row (these rows are not whole 128 x 128 blocks), the rotary rows' scales reordered with them; each
    weight within half a float8 step of the checkpoint's (kv_b_proj copied), and the tokens are
    transformers' on the weights they stand for."""
    from safetensors.torch import load_file

    from kernels.fp8_weight import Fp8Weight
    from tests.checkpoints import write_weights

    src = make_checkpoint(arch, tmp_path / "src", seed=8)
    llm = LLM(str(src), dtype="float32", num_kv_blocks=32, quantization="fp8")
    attn = llm.engine.model.layers[0].self_attn
    assert isinstance(attn.qkv_a_proj, Fp8Weight) and attn.qkv_a_proj.block == (1, 64)
    original = load_file(str(src / "model.safetensors"))
    stands_for = _engine_deepseek_weights(llm)
    assert set(stands_for) == {n for n in original if n.endswith(("_proj.weight", "_proj_with_mqa.weight"))}
    for name, w in stands_for.items():
        want = original[name].float()
        if name.endswith("kv_b_proj.weight"):
            assert torch.equal(w, want), name
            continue
        assert ((w - want).abs() <= want.abs() / 16 + 1e-6).all(), name
        assert not torch.equal(w, want), name  # quantised, not copied
    reference = write_weights(src, tmp_path / "dequantized", stands_for)
    prompt = _prompts(1, seed=12, lengths=(20, 21))[0]
    tokens = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[
        0
    ].token_ids
    assert len(set(tokens)) >= 4, tokens
    assert tokens == hf_greedy(reference, prompt, 12)


def test_float8_deepseek_triton_ops_in_the_interpreter_give_the_torch_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Triton ops over the float8 weights (the norm-GEMV into the stacked query and latent projection,
    the float8 GEMVs, the float8 MoE) give the reference ops' greedy tokens (float32)."""
    from kernels.fp8_weight import Fp8Weight
    from tests.checkpoints import quantize_checkpoint

    src = make_checkpoint("deepseek_v3", tmp_path / "src", seed=7)
    quantize_checkpoint(src, tmp_path / "fp8", "fp8", block=(16, 128))
    from kernels import triton_fp8_linear

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    fp8_linears = _calls(monkeypatch, triton_fp8_linear, "fp8_linear_triton")
    prompts = _prompts(2, seed=3)
    kw = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    fast = LLM(str(tmp_path / "fp8"), kernel_backend="triton", **kw)
    assert isinstance(fast.engine.model.layers[1].mlp.w13, Fp8Weight)
    triton = fast.generate(prompts, GREEDY)
    assert fp8_linears  # the float8 projections ran their Triton kernels
    torch_ = LLM(str(tmp_path / "fp8"), **kw).generate(prompts, GREEDY)
    assert [o.token_ids for o in triton] == [o.token_ids for o in torch_]


def test_a_float8_latent_kv_cache(deepseek: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``kv_cache_dtype="fp8"``: the pool holds float8 e4m3 latents, a byte a value (twice the tokens in the
    same memory); layer 0's latents, which no attention precedes, are the 16-bit pool's rounded to float8;
    prefix-cache hits keep the tokens; the Triton ops in the interpreter give the torch ops' tokens; and the
    tokens follow the float32 pool's for the first ones (the rounding parts them later, if at all)."""
    prompts = _prompts(3, seed=21, lengths=(20, 40))
    kw = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=64)
    fp8 = LLM(str(deepseek), kv_cache_dtype="fp8", **kw)
    wide = LLM(str(deepseek), **kw)
    assert (
        fp8.engine.kv_pool.dtype == torch.float8_e4m3fn
        and fp8.engine.layout.dtype != wide.engine.layout.dtype
    )
    long = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    got = [o.token_ids for o in fp8.generate(prompts, long)]
    want = [o.token_ids for o in wide.generate(prompts, long)]
    assert sum(g[:3] == w[:3] for g, w in zip(got, want, strict=True)) >= 2, (got, want)
    # A prompt alone in fresh engines (zeroed pools, the same blocks): its layer-0 latents.
    one = [_prompts(1, seed=22, lengths=(30, 31))[0]]
    pools = []
    for kv_cache_dtype in ("fp8", "auto"):
        fresh = LLM(str(deepseek), kv_cache_dtype=kv_cache_dtype, **kw)
        fresh.generate(one, SamplingParams(max_tokens=1, temperature=0.0))
        pools.append(fresh.engine.kv_pool[:, 0])
    from kernels.kv_cache import to_pool_dtype

    assert pools[1].count_nonzero() > 30 * 24  # written
    assert torch.equal(
        pools[0].view(torch.uint8), to_pool_dtype(pools[1], torch.float8_e4m3fn).view(torch.uint8)
    )
    again = fp8.generate(prompts, long)  # the prompts' blocks now from the prefix cache
    assert [o.token_ids for o in again] == got and all(o.num_cached_tokens >= 16 for o in again)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton = LLM(str(deepseek), kv_cache_dtype="fp8", kernel_backend="triton", **kw)
    assert [o.token_ids for o in triton.generate(prompts, long)] == got


@needs_gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_float8_deepseek_on_the_fast_path(kv_cache_dtype: str, tmp_path: Path) -> None:
    """On a GPU, a float8 DeepSeek-V3 checkpoint (16 x 128 blocks, kept in float8), with a 16-bit and a
    float8 latent pool: the Triton ops with the decode CUDA graphs give the eager reference ops' greedy
    tokens (float32: identical)."""
    from kernels.fp8_weight import Fp8Weight
    from tests.checkpoints import quantize_checkpoint

    src = make_checkpoint("deepseek_v3", tmp_path / "src", seed=7)
    quantize_checkpoint(src, tmp_path / "fp8", "fp8", block=(16, 128))
    prompts = _prompts(5, seed=8, lengths=(3, 60))
    long = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=64, kv_cache_dtype=kv_cache_dtype)
    eager = LLM(str(tmp_path / "fp8"), kernel_backend="torch", cuda_graphs=False, **kw)
    want = [o.token_ids for o in eager.generate(prompts, long)]
    del eager
    fast = LLM(str(tmp_path / "fp8"), kernel_backend="triton", **kw)
    assert isinstance(fast.engine.model.layers[1].mlp.w13, Fp8Weight)
    assert [o.token_ids for o in fast.generate(prompts, long)] == want
    assert sum(fast.engine.runner.graphs.replays.values()) > 0
