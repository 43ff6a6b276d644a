"""DeepSeek's latent attention of prompt chunks in the unabsorbed form (``ops.mla_prefill``: the context's
latents up-projected into every head's keys and values, vLLM's and SGLang's MLA prefill): the form against
the absorbed one, the Triton op (interpreter) against the reference, with key chunks and a float8 pool, the
rule that picks the form, and whole engines with every prompt chunk unabsorbed against transformers and
against the torch ops."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.models import mla
from tests.checkpoints import VOCAB, hf_greedy, make_checkpoint
from tests.kernel_testing import needs_gpu

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _inputs(gen: torch.Generator, nope: int = 32, rope: int = 16, v_dim: int = 16, rank: int = 32):
    """A pool of 24 blocks of 4 tokens (2 layers; the latent's rank + rope values split across the halves),
    3 heads, and one sequence of 150 tokens scattered over its blocks whose last 37 are queries."""
    heads, seq_len, n = 3, 150, 37
    pool = torch.randn(48, 2, 2, 4, 1, (rank + rope) // 2, generator=gen)
    table = torch.randperm(48, generator=gen)[: -(-seq_len // 4)].to(torch.int32)
    w_kv = torch.randn(heads, nope + v_dim, rank, generator=gen) / rank**0.5
    q_nope = torch.randn(n, heads, nope, generator=gen)
    q_pe = torch.randn(n, heads, rope, generator=gen)
    return q_nope, q_pe, pool, table, seq_len, w_kv


def test_the_unabsorbed_form_equals_the_absorbed_one() -> None:
    """The reference's unabsorbed attention (keys and values up-projected per head) gives what the absorbed
    form gives (the key projection folded into the queries, attention over the latents, then each head's
    value projection), for the last 37 tokens of a 150-token sequence (a cached prefix before them)."""
    from kernels.mla_attention import mla_attention_torch, mla_prefill_torch, mla_value_proj_torch

    gen = torch.Generator().manual_seed(0)
    q_nope, q_pe, pool, table, seq_len, w_kv = _inputs(gen)
    n, heads, nope = q_nope.shape
    got = mla_prefill_torch(q_nope, q_pe, pool, 1, table, seq_len, w_kv, 0.2)
    q_latent = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_kv[:, :nope]), q_pe], dim=-1)
    o = mla_attention_torch(q_latent, pool, 1, table[None], torch.tensor([seq_len]),
                            torch.tensor([0, n], dtype=torch.int32), 0.2, 32)  # fmt: skip
    want = mla_value_proj_torch(o, w_kv, 16).view(n, heads, 16)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert got.abs().mean() > 0.1


@pytest.mark.parametrize(
    ("chunk_bytes", "pool_dtype"),
    [(256 << 20, torch.float32), (64 * 3 * 48 * 4, torch.float32), (256 << 20, torch.float8_e4m3fn)],
    ids=["one-chunk", "three-key-chunks", "float8-pool"],
)
def test_the_triton_unabsorbed_prefill_equals_the_reference(
    chunk_bytes: int, pool_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In the interpreter: the up-projection and the causal flash kernel give the reference's output, in
    one key chunk or in three of 64 keys (the running output and log-sum-exp merged between them), over a
    float8 pool too (its latents widened before the up-projection); the reference is never called."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels import triton_mla
    from kernels.mla_attention import mla_prefill_torch

    monkeypatch.setattr(triton_mla, "PREFILL_KEY_CHUNK_BYTES", chunk_bytes)
    fallbacks: list[int] = []
    monkeypatch.setattr(
        triton_mla, "mla_prefill_torch", lambda *a: fallbacks.append(1) or mla_prefill_torch(*a)
    )
    matmuls: list[int] = []
    real_matmul = torch.matmul
    monkeypatch.setattr(torch, "matmul", lambda *a: matmuls.append(1) or real_matmul(*a))
    gen = torch.Generator().manual_seed(1)
    q_nope, q_pe, pool, table, seq_len, w_kv = _inputs(gen)
    pool = pool.to(pool_dtype)
    want = mla_prefill_torch(q_nope, q_pe, pool, 1, table, seq_len, w_kv, 0.2)
    matmuls.clear()
    got = triton_mla.mla_prefill_triton(q_nope, q_pe, pool, 1, table, seq_len, w_kv, 0.2)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not fallbacks
    assert len(matmuls) == (1 if chunk_bytes > 1 << 20 else 3)  # one up-projection a key chunk


def test_which_prompts_take_the_unabsorbed_form() -> None:
    """By arithmetic a head: at Moonlight's and V3's shape (rank 512, rope 64, nope 128, v 128) a prompt of
    341 tokens and more with nothing cached, a 512-token chunk after a 3,584-token prefix, never a decode
    token nor 64 tokens after 4k."""

    class Shape:
        rank, rope, nope, v_dim = 512, 64, 128, 128

    assert not mla.takes_unabsorbed(340, 340, Shape())  # type: ignore[arg-type]
    assert mla.takes_unabsorbed(341, 341, Shape())  # type: ignore[arg-type]
    assert mla.takes_unabsorbed(4096, 4096, Shape())  # type: ignore[arg-type]
    assert mla.takes_unabsorbed(512, 4096, Shape())  # type: ignore[arg-type]
    assert not mla.takes_unabsorbed(64, 4096, Shape())  # type: ignore[arg-type]
    assert not mla.takes_unabsorbed(1, 100_000, Shape())  # type: ignore[arg-type]


def _prompts(n: int, seed: int, lengths: tuple[int, int]) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def _count_unabsorbed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The list that each pass taking the unabsorbed form (``MLAttention._prefill``) appends to."""
    calls: list[int] = []
    original = mla.MLAttention._prefill
    monkeypatch.setattr(mla.MLAttention, "_prefill", lambda *a: calls.append(1) or original(*a))
    return calls


def _every_chunk_unabsorbed(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every prompt chunk of two tokens or more unabsorbed; returns ``_count_unabsorbed``'s list."""
    monkeypatch.setattr(mla, "takes_unabsorbed", lambda n, seq_len, attn: n > 1)
    return _count_unabsorbed(monkeypatch)


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2_lite"])
def test_an_engine_with_every_prompt_unabsorbed_gives_transformers_tokens(
    arch: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Prompts in chunks of up to 24 tokens beside other requests' decode rows (the absorbed ops take
    those rows in the same pass), a prompt whose first 32 tokens are cached: transformers' greedy tokens."""
    calls = _every_chunk_unabsorbed(monkeypatch)
    path = make_checkpoint(arch, tmp_path / arch, seed=11)
    prompts = _prompts(3, seed=4, lengths=(30, 60))
    want = [hf_greedy(path, p, GREEDY.max_tokens) for p in prompts]
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, max_num_batched_tokens=24)
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert calls
    shared = prompts[0][:32] + [7, 8, 9, 10, 11]
    again = llm.generate([shared], GREEDY)[0]
    assert again.num_cached_tokens == 32
    assert again.token_ids == hf_greedy(path, shared, GREEDY.max_tokens)


def test_the_triton_ops_unabsorbed_in_the_interpreter_give_the_torch_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """DeepSeek-V2-Lite's shape (every part a power of two): the Triton prefill kernel, not the reference,
    gives the torch ops' tokens, both with every chunk unabsorbed."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels import triton_mla
    from kernels.triton_ops import TRITON_OPS

    kernel_calls = _every_chunk_unabsorbed(monkeypatch)
    assert TRITON_OPS.mla_prefill is triton_mla.mla_prefill_triton
    fallbacks: list[int] = []
    reference = triton_mla.mla_prefill_torch
    monkeypatch.setattr(triton_mla, "mla_prefill_torch", lambda *a: fallbacks.append(1) or reference(*a))
    path = make_checkpoint("deepseek_v2_lite", tmp_path / "lite", seed=5)
    prompts = _prompts(2, seed=6, lengths=(20, 40))
    kw = dict(dtype="float32", num_kv_blocks=64, max_num_batched_tokens=16)
    triton = LLM(str(path), kernel_backend="triton", **kw).generate(prompts, GREEDY)
    assert kernel_calls and not fallbacks
    torch_ = LLM(str(path), **kw).generate(prompts, GREEDY)
    assert [o.token_ids for o in triton] == [o.token_ids for o in torch_]


@needs_gpu
@pytest.mark.parametrize("heads", [16, 128])
def test_gpu_unabsorbed_prefill_at_deepseeks_shape(heads: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, V3's latent (512 + 64), nope 128 and v 128 in bf16, Moonlight's and V3's head counts: a
    1,500-token prompt after 500 cached tokens, in one key chunk and in three, gives the reference within
    bf16's error."""
    from kernels import triton_mla
    from kernels.mla_attention import mla_prefill_torch

    gen = torch.Generator(device="cuda").manual_seed(heads)
    kw = dict(generator=gen, device="cuda", dtype=torch.bfloat16)
    pool = torch.randn(200, 2, 2, 16, 1, 288, **kw)
    table = torch.randperm(200, generator=gen, device="cuda")[:125].to(torch.int32)
    w_kv = torch.randn(heads, 256, 512, **kw) / 512**0.5
    q_nope = torch.randn(1500, heads, 128, **kw)
    q_pe = torch.randn(1500, heads, 64, **kw)
    want = mla_prefill_torch(q_nope, q_pe, pool, 1, table, 2000, w_kv, 0.07)
    got = triton_mla.mla_prefill_triton(q_nope, q_pe, pool, 1, table, 2000, w_kv, 0.07)
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    monkeypatch.setattr(triton_mla, "PREFILL_KEY_CHUNK_BYTES", 700 * heads * 256 * 2)
    chunked = triton_mla.mla_prefill_triton(q_nope, q_pe, pool, 1, table, 2000, w_kv, 0.07)
    torch.testing.assert_close(chunked.float(), want.float(), atol=2e-2, rtol=2e-2)


@needs_gpu
def test_gpu_long_prompts_unabsorbed_give_the_torch_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a GPU, by the engine's own rule (no patch): prompts of 300-400 tokens, long enough at the test
    checkpoint's shape to take the unabsorbed form, with the Triton ops, decode graphs and asynchronous
    scheduling give the CPU torch engine's tokens (float32)."""
    calls = _count_unabsorbed(monkeypatch)
    path = make_checkpoint("deepseek_v2_lite", tmp_path / "lite", seed=9)
    prompts = _prompts(3, seed=10, lengths=(300, 400))
    want = [o.token_ids for o in LLM(str(path), dtype="float32", num_kv_blocks=128).generate(prompts, GREEDY)]
    assert calls
    calls.clear()
    fast = LLM(str(path), device="cuda", dtype="float32", kernel_backend="triton", num_kv_blocks=128)
    assert [o.token_ids for o in fast.generate(prompts, GREEDY)] == want
    assert calls


def test_the_mtp_layers_prompt_passes_unabsorbed_draft_its_predictions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With every prompt chunk unabsorbed, the MTP layer's own prompt passes too (its pool layer is the
    last): each draft is still transformers' MTP prediction and the output transformers' greedy one."""
    from tests.checkpoints import add_mtp_layer
    from tests.test_mtp import _check_drafts, _recording

    monkeypatch.setattr(mla, "takes_unabsorbed", lambda n, seq_len, attn: n > 1)
    layers: list[int] = []
    original = mla.MLAttention._prefill
    monkeypatch.setattr(
        mla.MLAttention, "_prefill", lambda self, *a: layers.append(self.layer) or original(self, *a)
    )
    base = make_checkpoint("deepseek_v3", tmp_path / "base", seed=7)
    path = add_mtp_layer(base, tmp_path / "mtp", seed=11)
    llm = LLM(str(path), dtype="float32", num_kv_blocks=64, speculative_config='{"method": "mtp"}')
    made = _recording(llm)
    prompts = _prompts(2, seed=12, lengths=(12, 30))
    outputs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert llm.engine.model.cfg.num_layers in layers  # the MTP layer's pool layer
    ids = list(dict.fromkeys(rid for rid, _, _ in made))
    for rid, prompt, out in zip(ids, prompts, outputs, strict=True):
        assert out == hf_greedy(path, prompt, GREEDY.max_tokens)
        assert _check_drafts(path, made, rid, prompt + out) >= 3


def test_prefill_pieces_with_the_attention_unabsorbed_between_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU, ``tiny-deepseek``: the prefill graphs' pieces (run eagerly) with the latent attention between
    them unabsorbed (``MLAttention.project`` hands ``attend`` the nope queries beside the absorbed ones)
    give the forward's hidden states, which equal the absorbed forward's up to rounding."""
    import numpy as np

    from engine.models.decoder import AttentionMetadata
    from engine.prefill_graphs import PrefillGraphs

    calls = _every_chunk_unabsorbed(monkeypatch)
    runner = LLM("tiny-deepseek", num_kv_blocks=16).engine.runner
    model = runner.model
    n, bucket = 37, 64
    kw = dict(
        slot_mapping=torch.arange(16, 16 + n),
        block_tables=torch.tensor([[1, 2, 3]], dtype=torch.int32),
        seq_lens=torch.tensor([n], dtype=torch.int32),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32),
    )
    meta = AttentionMetadata(**kw, host_lens=(np.array([n]), np.array([0, n])))
    ids, positions = torch.randint(3, 200, (n,)), torch.arange(n)
    absorbed = model(ids, positions, runner.kv_pool.clone(), AttentionMetadata(**kw))
    assert not calls
    want = model(ids, positions, runner.kv_pool.clone(), meta)
    assert len(calls) == len(model.layers)
    torch.testing.assert_close(want, absorbed, atol=1e-4, rtol=1e-4)
    pg = PrefillGraphs(model, runner.kv_pool.clone(), 100, torch.device("cpu"))
    key = (bucket, True)
    pg._runs[key] = pg._pieces(key)
    assert pg.stage(ids, positions, meta.slot_mapping) == (bucket, n)
    pg._forward(key, n, meta, replay=False)
    assert len(calls) == 2 * len(model.layers)
    torch.testing.assert_close(pg._state[key]["hidden"][:n], want)
