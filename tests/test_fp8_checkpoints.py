"""Float8 checkpoints (``engine/fp8_weights.py``): every float8 weight kept in float8 with its scales
(``kernels.fp8_weight.Fp8Weight``) where the kernels read its layout, else widened at load, standing for
exactly what the checkpoint means (float8 value x scale); greedy tokens equal to transformers' on the same
checkpoint; ``quantization="fp8"`` over a 16-bit checkpoint; and the quantised checkpoints pdmesh cannot
read refused by name before a weight is read."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import FineGrainedFP8Config

from engine import LLM, SamplingParams
from engine.errors import UnsupportedModelError
from engine.fp8_weights import FLOAT8_DTYPES, dequantize
from kernels.fp8_weight import Fp8Weight, as_dense
from tests.checkpoints import hf_greedy, make_checkpoint, quantize_checkpoint, write_weights
from tests.kernel_testing import needs_gpu

NEW_TOKENS = 24
PROMPTS = [[5, 9, 100, 200, 7], [3, 17, 250, 61, 88, 140, 201, 33, 12, 9, 4]]
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)


def _llm(path: Path, **kwargs: object) -> LLM:
    settings = {
        "device": "cpu",
        "dtype": "float32",
        "num_kv_blocks": 64,
        "max_num_batched_tokens": 64,
        **kwargs,
    }
    return LLM(str(path), **settings)


def _tokens(llm: LLM) -> list[list[int]]:
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _check_weights(llm: LLM, meant: dict[str, torch.Tensor]) -> None:
    """The engine's fused weights stand for exactly the widened weights (float8 ones dequantized): q, k, v
    rows of qkv_proj, o_proj, and the MLP's or the first expert's gate, up and down."""
    for name, w in _engine_weights(llm).items():
        if name in meant:
            assert torch.equal(w, meant[name].to(w.device)), name
    assert {n for n in meant if ".experts." not in n or ".experts.0." in n} <= set(_engine_weights(llm))


def _moe_layer(llm: LLM) -> torch.nn.Module:
    return next(layer for layer in llm.engine.model.layers if hasattr(layer.mlp, "w13"))


def _engine_weights(llm: LLM) -> dict[str, torch.Tensor]:
    """The engine's attention, MLP and expert weights under their checkpoint names, float8 ones as the
    tensors they stand for."""
    out: dict[str, torch.Tensor] = {}
    for i, layer in enumerate(llm.engine.model.layers):
        attn, pre = layer.self_attn, f"model.layers.{i}."
        q, kv = attn.q_size, attn.kv_size
        qkv = as_dense(attn.qkv_proj)
        for proj, (lo, hi) in {
            "q_proj": (0, q),
            "k_proj": (q, q + kv),
            "v_proj": (q + kv, q + 2 * kv),
        }.items():
            out[f"{pre}self_attn.{proj}.weight"] = qkv[lo:hi]
        out[f"{pre}self_attn.o_proj.weight"] = as_dense(attn.o_proj)
        mlp = layer.mlp
        if hasattr(mlp, "w13"):
            w13, w2 = as_dense(mlp.w13), as_dense(mlp.w2)
            inter = w2.shape[2]
            for e in range(w13.shape[0]):
                expert = f"{pre}mlp.experts.{e}."
                out[expert + "gate_proj.weight"] = w13[e, :inter]
                out[expert + "up_proj.weight"] = w13[e, inter:]
                out[expert + "down_proj.weight"] = w2[e]
        else:
            gate_up, down = as_dense(mlp.gate_up_proj), as_dense(mlp.down_proj)
            inter = down.shape[1]
            out[f"{pre}mlp.gate_proj.weight"] = gate_up[:inter]
            out[f"{pre}mlp.up_proj.weight"] = gate_up[inter:]
            out[f"{pre}mlp.down_proj.weight"] = down
    return out


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fine_grained_fp8_checkpoint_matches_transformers(arch: str, tmp_path: Path) -> None:
    """A Qwen3-*-FP8-style checkpoint (float8 weights, ``weight_scale_inv`` per 16 x 16 block, experts
    included): the engine's weights are the float8 values times their block's scale, bit for bit, and its
    greedy tokens are transformers' own on the same checkpoint (``FineGrainedFP8Config(dequantize=True)``,
    which it also does by itself without a GPU: the same arithmetic). Widening is not a no-op: the float8 values alone are far from the weights."""
    src = make_checkpoint(arch, tmp_path / "src", seed=5)
    meant = quantize_checkpoint(src, tmp_path / "fp8", "fp8", block=(16, 16))
    llm = _llm(tmp_path / "fp8")
    assert not isinstance(llm.engine.model.layers[0].self_attn.o_proj, Fp8Weight)  # 16-wide blocks: widened
    _check_weights(llm, meant)
    raw = load_file(str(tmp_path / "fp8" / "model.safetensors"))["model.layers.0.self_attn.o_proj.weight"]
    assert (raw.float() - meant["model.layers.0.self_attn.o_proj.weight"]).abs().max() > 10
    tokens = _tokens(llm)
    assert all(len(set(t)) >= 4 for t in tokens), tokens  # varied output: matching it is a real check
    # What transformers does with it on a machine without a GPU; asked for explicitly, so that a GPU
    # machine runs the same reference rather than its float8 GEMMs (which quantise activations too).
    widened = {"quantization_config": FineGrainedFP8Config(dequantize=True)}
    assert tokens == [hf_greedy(tmp_path / "fp8", p, NEW_TOKENS, **widened) for p in PROMPTS]


@pytest.mark.parametrize(
    "fmt, block", [("compressed-tensors", None), ("modelopt", None), ("fp8", (24, 40))], ids=str
)
def test_scale_layouts_stand_for_what_the_checkpoint_means(
    fmt: str, block: tuple[int, int] | None, tmp_path: Path
) -> None:
    """llm-compressor's per-channel ``weight_scale`` (with static ``input_scale``s, not used: activations
    stay unquantised) and ModelOpt's per-tensor scale described in ``hf_quant_config.json``, both kept in
    float8 with a scale per row (q, k and v's per-tensor scales down their rows of the fused weight), and
    fine-grained blocks that do not divide the weights (partial edge blocks, as DeepSeek-V3's; 24 rows is
    no block the kernels index, so widened): the engine's weights are what each format means, and its greedy
    tokens are transformers' on those weights written out in float32 (transformers reads none of these
    formats without their tools or a GPU)."""
    src = make_checkpoint("qwen3_moe", tmp_path / "src", seed=6)
    meant = quantize_checkpoint(src, tmp_path / "q", fmt, **({"block": block} if block else {}))
    llm = _llm(tmp_path / "q")
    layer = _moe_layer(llm)
    kept = [
        isinstance(w, Fp8Weight) for w in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.w13)
    ]
    assert kept == [fmt != "fp8"] * 3, kept
    if fmt != "fp8":
        assert layer.self_attn.qkv_proj.weight_scale.shape[-1] == 1  # a scale per row
    _check_weights(llm, meant)
    reference = write_weights(src, tmp_path / "widened", meant)
    assert _tokens(llm) == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


def test_float8_weights_stay_float8_with_the_widened_tokens(tmp_path: Path) -> None:
    """A Qwen3-MoE checkpoint with scales per 16 x 128 block (one block along these 64-wide rows, as
    Qwen3-FP8's 128 x 128 on 2048-wide ones): the engine keeps its attention and expert weights in float8
    with those scales (a byte a weight and its scales; the router stays 16-bit), they stand for the
    checkpoint's weights bit for bit, its tokens are transformers' on the checkpoint and the same as the
    engine's with the weights widened (``quantization="none"``), and the two are told apart in the model
    fingerprint, the root of every prefix-cache key."""
    src = make_checkpoint("qwen3_moe", tmp_path / "src", seed=5)
    meant = quantize_checkpoint(src, tmp_path / "fp8", "fp8", block=(16, 128))
    kept, widened = (
        _llm(tmp_path / "fp8"),
        _llm(tmp_path / "fp8", quantization="none"),
    )
    layer, wide = _moe_layer(kept), _moe_layer(widened)
    assert isinstance(layer.self_attn.qkv_proj, Fp8Weight) and isinstance(layer.mlp.w13, Fp8Weight)
    assert layer.mlp.w13.weight.dtype == torch.float8_e4m3fn and layer.mlp.w13.block == (16, 64)
    assert not isinstance(layer.mlp.gate, Fp8Weight) and not isinstance(wide.mlp.w13, Fp8Weight)
    for fp8, dense in (
        (layer.mlp.w13, wide.mlp.w13),
        (layer.mlp.w2, wide.mlp.w2),
        (layer.self_attn.qkv_proj, wide.self_attn.qkv_proj),
    ):
        assert fp8.nbytes() < 0.3 * dense.numel() * dense.element_size()  # float32: 4 bytes
        assert torch.equal(fp8.dequantize(), dense)
    _check_weights(kept, meant)
    tokens = _tokens(kept)
    assert all(len(set(t)) >= 4 for t in tokens), tokens
    assert tokens == _tokens(widened)
    reference = {"quantization_config": FineGrainedFP8Config(dequantize=True)}
    assert tokens == [hf_greedy(tmp_path / "fp8", p, NEW_TOKENS, **reference) for p in PROMPTS]
    assert kept.engine.model_fingerprint != widened.engine.model_fingerprint


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_quantization_fp8_quantises_a_16_bit_checkpoint(arch: str, tmp_path: Path) -> None:
    """``quantization="fp8"`` over a 16-bit checkpoint: attention, MLP and expert weights become float8 e4m3
    with a scale per row (64-wide rows: no 128 x 128 blocks), each within half a float8 step of the
    checkpoint's weight, and the engine's greedy tokens are transformers' on the weights they stand for."""
    src = make_checkpoint(arch, tmp_path / "src", seed=8)
    llm = _llm(src, quantization="fp8")
    assert isinstance(llm.engine.model.layers[0].self_attn.o_proj, Fp8Weight)
    original = load_file(str(src / "model.safetensors"))
    stands_for = _engine_weights(llm)
    for name, w in stands_for.items():
        err = (w - original[name].float()).abs()
        assert (err <= original[name].float().abs() / 16 + 1e-6).all(), name
        assert not torch.equal(w, original[name].float()), name  # quantised, not copied
    reference = write_weights(src, tmp_path / "dequantized", stands_for)
    tokens = _tokens(llm)
    assert all(len(set(t)) >= 4 for t in tokens), tokens
    assert tokens == [hf_greedy(reference, p, NEW_TOKENS) for p in PROMPTS]


def test_dequantize_layouts() -> None:
    """Each scale layout against the elementwise definition: per tensor, per row ([rows] and [rows, 1]),
    blocks (even and partial), stacked experts with a scale each, AMD's fnuz formats, and E8M0 exponent
    bytes."""
    torch.manual_seed(0)
    w = (torch.randn(2, 10, 12) * 50).to(torch.float8_e4m3fn)
    wf = w.float()
    rows = torch.rand(10) + 0.5
    assert torch.equal(dequantize("w", w[0], torch.tensor(0.25), None), wf[0] * 0.25)
    assert torch.equal(dequantize("w", w[0], rows, None), wf[0] * rows[:, None])
    assert torch.equal(dequantize("w", w[0], rows[:, None], None), wf[0] * rows[:, None])
    grid = torch.rand(3, 2) + 0.5  # blocks of 4 x 8: rows 8-9 and columns 8-11 in partial blocks
    expected = torch.stack(
        [torch.stack([wf[0, r, c] * grid[r // 4, c // 8] for c in range(12)]) for r in range(10)]
    )
    assert torch.equal(dequantize("w", w[0], grid, (4, 8)), expected)
    even = torch.rand(5, 3) + 0.5  # no block in the config: the grid must divide the weight (2 x 4 blocks)
    assert torch.equal(
        dequantize("w", w[0], even, None), wf[0] * even.repeat_interleave(2, 0).repeat_interleave(4, 1)
    )
    per_expert = torch.tensor([0.5, 2.0])
    assert torch.equal(dequantize("w", w, per_expert, None), wf * per_expert[:, None, None])
    for fmt in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz):  # AMD's formats: their own values x scale
        amd = (torch.randn(10, 12) * 20).to(fmt)
        assert fmt in FLOAT8_DTYPES
        assert torch.equal(dequantize("w", amd, rows, None), amd.float() * rows[:, None])
    exponents = torch.tensor([[126, 127]], dtype=torch.uint8)  # 2^-1 and 2^0 per 10 x 6 block
    assert torch.equal(dequantize("w", w[0], exponents, (10, 6)), wf[0] * torch.tensor([0.5] * 6 + [1.0] * 6))
    with pytest.raises(UnsupportedModelError, match=r"scale shape \(3, 3\) fits none"):
        dequantize("w", w[0], torch.ones(3, 3), (4, 8))
    with pytest.raises(UnsupportedModelError, match="has no w_scale_inv or w_scale"):
        dequantize("w", w[0], None, None)


def _rewrite(
    path: Path, config: dict | None = None, drop: str | None = None, put: dict | None = None
) -> Path:
    if config is not None:
        cfg = json.loads((path / "config.json").read_text())
        cfg.update(config)
        (path / "config.json").write_text(json.dumps(cfg))
    if drop or put:
        tensors = load_file(str(path / "model.safetensors"))
        tensors = {n: t for n, t in tensors.items() if n != drop}
        tensors.update(put or {})
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def test_unsupported_quantization_is_refused_by_name(tmp_path: Path) -> None:
    """GPTQ, AWQ, integer compressed-tensors and ModelOpt NVFP4 are named in the error before any weight
    is read; a float8 weight without its scale, a scale grid that does not fit, and integer weights in an
    otherwise plain checkpoint name the tensor. Nothing reads raw float8 values as weights."""
    src = make_checkpoint("qwen3", tmp_path / "src", seed=7)
    for name, quant, words in (
        ("gptq", {"quant_method": "gptq", "bits": 4}, "'gptq' is not supported"),
        ("awq", {"quant_method": "awq", "bits": 4}, "'awq' is not supported"),
        ("int8", {"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {
            "type": "int", "num_bits": 8, "strategy": "channel"}}}}, "int 8-bit per channel"),
        ("nvfp4", {"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'NVFP4' is not supported"),
    ):  # fmt: skip
        path = write_weights(src, tmp_path / name, {})
        with pytest.raises(UnsupportedModelError, match=words):
            _llm(_rewrite(path, {"quantization_config": quant}))
    fp8 = tmp_path / "fp8"
    quantize_checkpoint(src, fp8, "fp8")
    with pytest.raises(
        UnsupportedModelError, match=r"o_proj.weight is float8 .* no .*o_proj.weight_scale_inv"
    ):
        _llm(_rewrite(fp8, drop="model.layers.1.self_attn.o_proj.weight_scale_inv"))
    quantize_checkpoint(src, fp8, "fp8")
    with pytest.raises(UnsupportedModelError, match=r"o_proj.weight: scale shape \(2, 2\) fits none"):
        _llm(_rewrite(fp8, put={"model.layers.1.self_attn.o_proj.weight_scale_inv": torch.ones(2, 2)}))
    plain = write_weights(
        src, tmp_path / "int", {"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 96, dtype=torch.int8)}
    )
    with pytest.raises(UnsupportedModelError, match=r"down_proj.weight is torch.int8"):
        _llm(plain)
    quantize_checkpoint(src, fp8, "fp8")  # float8 weights in a checkpoint that declares no quantisation
    cfg = json.loads((fp8 / "config.json").read_text())
    del cfg["quantization_config"]
    (fp8 / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="is float8"):
        _llm(fp8)


def test_dtype_auto_is_the_checkpoints(tmp_path: Path) -> None:
    """``dtype`` auto (the default, as vLLM's): a checkpoint's config.json ``dtype`` (or ``torch_dtype``)
    chooses the weights' and the KV cache's dtype, bfloat16 for a float8 checkpoint that names it;
    float32 for the built-in models and for checkpoints naming none; an explicit dtype wins."""
    src = make_checkpoint("qwen3", tmp_path / "src", seed=8)
    quantize_checkpoint(src, tmp_path / "fp8", "fp8")
    _rewrite(tmp_path / "fp8", {"dtype": "bfloat16"})
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    (src / "config.json").write_text(json.dumps(cfg))
    older = write_weights(src, tmp_path / "older", {})
    _rewrite(older, {"torch_dtype": "bfloat16"})
    for model, dtype, expected in (
        (str(tmp_path / "fp8"), "auto", torch.bfloat16),
        (str(tmp_path / "fp8"), "float32", torch.float32),
        (str(older), "auto", torch.bfloat16),
        (str(src), "auto", torch.float32),
        ("tiny-dense", "auto", torch.float32),
    ):
        llm = LLM(model, device="cpu", dtype=dtype, num_kv_blocks=16)
        assert llm.engine.config.dtype == str(expected).removeprefix("torch."), (model, dtype)
        assert llm.engine.model.norm.dtype == llm.engine.kv_pool.dtype == expected, (model, dtype)
        assert len(llm.generate([PROMPTS[0]], GREEDY)[0].token_ids) == NEW_TOKENS


@needs_gpu
@pytest.mark.parametrize("block", [(16, 16), (16, 128)], ids=["widened", "kept"])
def test_gpu_fp8_checkpoint_on_the_fast_path(block: tuple[int, int], tmp_path: Path) -> None:
    """On a GPU, a float8 checkpoint widened at load (16 x 16 blocks) and one kept in float8 (16 x 128):
    the weights stand for the same bits, and the Triton ops with CUDA graphs give the eager reference ops'
    greedy tokens over them (float32: identical)."""
    src = make_checkpoint("qwen3_moe", tmp_path / "src", seed=5)
    meant = quantize_checkpoint(src, tmp_path / "fp8", "fp8", block=block)
    fast = _llm(tmp_path / "fp8", device="cuda", kernel_backend="triton", cuda_graphs=True)
    assert isinstance(_moe_layer(fast).mlp.w13, Fp8Weight) == (block[1] == 128)
    _check_weights(fast, meant)
    reference = _tokens(_llm(tmp_path / "fp8", device="cuda", kernel_backend="torch", cuda_graphs=False))
    assert all(len(set(t)) >= 4 for t in reference), reference
    assert _tokens(fast) == reference
    assert sum(fast.engine.runner.graphs.replays.values()) >= NEW_TOKENS - 1  # decode ran as graphs


@needs_gpu
def test_gpu_quantization_fp8_at_real_shapes(tmp_path: Path) -> None:
    """``quantization="fp8"`` on the GPU over a checkpoint whose projections are whole 128 x 128 blocks
    (hidden 256, a dense layer and three MoE layers): the Triton ops with CUDA graphs (the float8 GEMV,
    skinny and MoE kernels, prefill through the widened weight) give the eager reference ops' greedy tokens
    over the same float8 weights (float32: identical), which take about a byte a weight."""
    src = make_checkpoint(
        "qwen3_moe",
        tmp_path / "src",
        seed=9,
        hidden_size=256,
        intermediate_size=256,
        moe_intermediate_size=128,
        head_dim=64,
    )
    fast = _llm(src, device="cuda", kernel_backend="triton", quantization="fp8")
    eager = _llm(src, device="cuda", kernel_backend="torch", quantization="fp8", cuda_graphs=False)
    w13 = _moe_layer(fast).mlp.w13
    assert isinstance(w13, Fp8Weight) and w13.block == (128, 128)
    assert w13.nbytes() < 1.01 * w13.weight.numel()
    reference = _tokens(eager)
    assert all(len(set(t)) >= 4 for t in reference), reference
    assert _tokens(fast) == reference
    assert sum(fast.engine.runner.graphs.replays.values()) >= NEW_TOKENS - 1  # decode ran as graphs
