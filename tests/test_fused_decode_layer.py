"""The fused one-token MoE decoder layer (``kernels/triton_decode_layer.py``) against the layer op by op.

Without a GPU the kernel runs under the Triton interpreter, phase by phase (``phased=True``: the
interpreter runs programs one after another, so a grid barrier would never open), at tiny shapes and with
a few programs so that every round-robin loop wraps. With a GPU the ``gpu`` tests run the real persistent
launch with its barriers at the Qwen3-30B-A3B layer shape, inside a CUDA graph and repeatedly (the
barrier counter must come back to zero), and check the engine takes the fused path at batch 1.

The reference is the same layer with the PyTorch ops (same weights, same pool): outputs within the bf16
bound, the new token's k and v in the pool within it, every other pool element bit-identical, and the
expert counters incremented exactly as the reference increments them.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from engine.loader import _init_tiny  # noqa: E402
from engine.models.decoder import AttentionMetadata, DecoderModel  # noqa: E402
from engine.models.model_config import ModelConfig  # noqa: E402
from kernels.ops import TORCH_OPS  # noqa: E402

pytest.importorskip("triton")

from kernels import triton_decode_layer as fused  # noqa: E402
from kernels.triton_ops import TRITON_OPS  # noqa: E402
from tests.test_kernels import DEVICE, assert_close, gpu, needs_cuda  # noqa: E402

DTYPE = torch.bfloat16


def hf_config(arch: str, **kw: object) -> dict:
    cfg: dict = dict(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=64,
        rms_norm_eps=1e-6,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        eos_token_id=1,
    )
    if arch == "qwen3_moe":
        cfg.update(architectures=["Qwen3MoeForCausalLM"], num_experts=8, num_experts_per_tok=2,
                   moe_intermediate_size=24, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[])  # fmt: skip
    else:  # Mixtral: no q/k norm, top-2 of 4, no renormalisation flag (Mixtral always renormalises)
        cfg.update(architectures=["MixtralForCausalLM"], num_local_experts=4, num_experts_per_tok=2,
                   intermediate_size=40)  # fmt: skip
    cfg.update(kw)
    return cfg


class Setup:
    """Two models with the same weights (Triton ops and PyTorch ops) and a pool holding a cached context."""

    def __init__(
        self,
        hf: dict,
        *,
        context: int,
        block_size: int = 4,
        max_blocks: int = 64,
        physical_to_logical: list[int] | None = None,
        seed: int = 0,
    ) -> None:
        self.cfg = ModelConfig.from_hf_dict(hf)
        p2l = [physical_to_logical] * self.cfg.num_layers if physical_to_logical else None
        kw = dict(dtype=DTYPE, device=DEVICE, max_positions=4096, physical_to_logical=p2l)
        self.model = DecoderModel(self.cfg, TRITON_OPS, **kw)
        self.ref_model = DecoderModel(self.cfg, TORCH_OPS, **kw)
        _init_tiny(self.model, seed)
        self.ref_model.load_state_dict(self.model.state_dict())
        gen = torch.Generator(device="cpu").manual_seed(seed + 1)
        num_blocks = max_blocks + 2
        self.pool = (
            torch.randn(num_blocks, self.cfg.num_layers, 2, block_size, self.cfg.num_kv_heads,
                        self.cfg.head_dim, generator=gen) * 2.0
        ).to(DTYPE).to(DEVICE)  # fmt: skip
        # The sequence's blocks are scattered; the new token sits at position context - 1.
        table = torch.randperm(num_blocks, generator=gen)[:max_blocks].to(torch.int32)
        pos = context - 1
        self.block_tables = table[None, :].to(DEVICE)
        self.positions = torch.tensor([max(pos, 0)], dtype=torch.int64, device=DEVICE)
        slot = int(table[pos // block_size]) * block_size + pos % block_size if context > 0 else -1
        self.slot = slot
        self.meta = AttentionMetadata(
            slot_mapping=torch.tensor([slot], dtype=torch.int64, device=DEVICE),
            block_tables=self.block_tables,
            seq_lens=torch.tensor([context], dtype=torch.int32, device=DEVICE),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=DEVICE),
        )
        self.x = (torch.randn(1, self.cfg.hidden_size, generator=gen)).to(DTYPE).to(DEVICE)
        self.residual = (torch.randn(1, self.cfg.hidden_size, generator=gen) * 2).to(DTYPE).to(DEVICE)

    def reference(self, layer: int, residual: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        pool = self.pool.clone()
        blk = self.ref_model.layers[layer]
        out, res = blk(self.x, self.residual if residual else None, self.positions, self.ref_model.cos_sin,
                       pool, self.meta)  # fmt: skip
        return out, res, pool

    def fused(
        self, layer: int, residual: bool, pool: torch.Tensor, **kw: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.model.layers[layer].fused_decode_weights()
        return fused.moe_decode_layer_triton(
            w, self.x, self.residual if residual else None, self.positions, self.model.cos_sin, pool, layer,
            self.meta.slot_mapping, self.block_tables, self.meta.seq_lens, self.model.decode_sync, **kw,
        )  # fmt: skip

    def check(self, layer: int, residual: bool, **kw: object) -> None:
        ref_out, ref_res, ref_pool = self.reference(layer, residual)
        pool = self.pool.clone()
        out, res = self.fused(layer, residual, pool, **kw)
        assert_close(res, ref_res, DTYPE, "residual after attention")
        assert_close(out, ref_out, DTYPE, "MoE output")
        written = torch.zeros(self.pool.shape[:4], dtype=torch.bool, device=DEVICE)
        if self.slot >= 0:
            bs = self.pool.shape[3]
            written[self.slot // bs, layer, :, self.slot % bs] = True
            assert_close(pool[written], ref_pool[written], DTYPE, "new k/v in the pool")
        assert torch.equal(pool[~written], self.pool[~written]), "the layer wrote outside its slot"
        ref_counts = self.ref_model.layers[layer].mlp.expert_counts
        counts = self.model.layers[layer].mlp.expert_counts
        assert int(ref_counts.sum()) == self.cfg.num_experts_per_tok
        assert torch.equal(counts, ref_counts), (counts, ref_counts)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("context,programs", [(1, 1), (23, 3), (150, 7)])
def test_phased_matches_reference(arch: str, context: int, programs: int) -> None:
    s = Setup(hf_config(arch), context=context)
    s.check(1, residual=True, phased=True, num_programs=programs)


def test_phased_first_layer_without_residual() -> None:
    s = Setup(hf_config("qwen3_moe"), context=37)
    s.check(0, residual=False, phased=True, num_programs=2)


def test_phased_no_renormalisation_and_replicas() -> None:
    # Experts 2 and 5 have a second replica: the one token takes the first, as the routing op does.
    s = Setup(
        hf_config("qwen3_moe", norm_topk_prob=False),
        context=9,
        physical_to_logical=[0, 1, 2, 3, 4, 5, 6, 7, 2, 5],
    )
    s.check(1, residual=True, phased=True, num_programs=4)


def test_phased_padding_row_writes_nothing() -> None:
    """A padding row (slot -1, no keys) attends to nothing and leaves the pool alone, as the ops do."""
    s = Setup(hf_config("qwen3_moe"), context=0)
    s.check(1, residual=True, phased=True, num_programs=3)


def test_unsupported_shapes_are_refused() -> None:
    s = Setup(hf_config("qwen3_moe"), context=5)
    two = torch.cat([s.x, s.x])
    with pytest.raises(ValueError, match="one token"):
        fused.moe_decode_layer_triton(
            s.model.layers[1].fused_decode_weights(), two, None, s.positions, s.model.cos_sin, s.pool, 1,
            s.meta.slot_mapping, s.block_tables, s.meta.seq_lens, s.model.decode_sync, phased=True,
        )  # fmt: skip
    with pytest.raises(TypeError, match="dense"):
        Setup(hf_config("qwen3_moe", mlp_only_layers=[0]), context=5).model.layers[0].fused_decode_weights()


def test_engine_layer_uses_fused_path_only_on_a_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU the decoder never takes the fused path (its barriers need a GPU); MoE layers with
    Triton ops are marked eligible, dense ones and the torch ops are not."""
    monkeypatch.setattr(fused, "FUSED_DECODE_LAYER_ENABLED", True)
    s = Setup(hf_config("qwen3_moe", mlp_only_layers=[0]), context=5)
    assert [blk._fused_ok for blk in s.model.layers] == [False, True]
    assert not any(blk._fused_ok for blk in s.ref_model.layers)
    if DEVICE.type == "cpu":
        blk = s.model.layers[1]
        pool = s.pool.clone()
        assert blk._fused_decode(s.x, s.residual, s.positions, s.model.cos_sin, pool, s.meta) is None


# ---------------------------------------------------------------------------------------------------------
# GPU: the persistent launch with its barriers


QWEN3_30B_LAYER = dict(
    hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
    num_experts_per_tok=8, moe_intermediate_size=768, num_hidden_layers=2, vocab_size=256,
)  # fmt: skip


@gpu
@needs_cuda
@pytest.mark.parametrize("context", [1, 512, 4096])
def test_gpu_fused_matches_reference_qwen3_30b_a3b(context: int) -> None:
    s = Setup(hf_config("qwen3_moe", **QWEN3_30B_LAYER), block_size=16, max_blocks=260, context=context)
    s.check(1, residual=True)
    assert int(s.model.decode_sync.item()) == 0, "the barrier counter was not reset"


@gpu
@needs_cuda
def test_gpu_fused_equals_phased_and_replays_in_a_graph() -> None:
    """The barrier version computes what the seven separate launches compute, bit for bit, and a
    captured graph replayed many times keeps doing so (the counter returns to zero every launch)."""
    s = Setup(hf_config("qwen3_moe", **QWEN3_30B_LAYER), block_size=16, max_blocks=64, context=300)
    pool_a, pool_b = s.pool.clone(), s.pool.clone()
    out_p, res_p = s.fused(1, True, pool_a, phased=True)
    out_f, res_f = s.fused(1, True, pool_b)
    assert torch.equal(out_f, out_p) and torch.equal(res_f, res_p)
    assert torch.equal(pool_a, pool_b)
    pool = s.pool.clone()
    s.fused(1, True, pool)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_g, res_g = s.fused(1, True, pool)
    for _ in range(50):
        graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out_g, out_p) and torch.equal(res_g, res_p)
    assert int(s.model.decode_sync.item()) == 0


def test_fused_path_is_off_by_default() -> None:
    """Measured slower than the op-by-op layer on the H200 (the module docstring): opt-in only."""
    assert fused.FUSED_DECODE_LAYER_ENABLED is False


@gpu
@needs_cuda
def test_gpu_decoder_takes_fused_path_at_batch_1(monkeypatch: pytest.MonkeyPatch) -> None:
    s = Setup(hf_config("qwen3_moe", **QWEN3_30B_LAYER), block_size=16, max_blocks=64, context=100)
    calls: list[int] = []
    original = fused.moe_decode_layer_triton

    def spy(*a: object, **k: object) -> object:
        calls.append(1)
        return original(*a, **k)

    monkeypatch.setattr(fused, "moe_decode_layer_triton", spy)
    monkeypatch.setattr(fused, "FUSED_DECODE_LAYER_ENABLED", True)
    blk = s.model.layers[1]
    out = blk(s.x, s.residual, s.positions, s.model.cos_sin, s.pool.clone(), s.meta)
    assert calls == [1]
    ref_out, _, _ = s.reference(1, True)
    assert_close(out[0], ref_out, DTYPE, "MoE output through DecoderLayer.forward")
