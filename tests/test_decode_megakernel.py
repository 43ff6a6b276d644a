"""The batch-1 decode megakernel (kernels/decode_megakernel.py, kernels/cuda/decode_layers.cu).

On the CPU: its plan (which shapes fit, the shared memory they need), the constants the host mirrors from
the CUDA source, and, where nvcc exists, that the source compiles for sm_90 without spills. On a GPU of
compute capability 9.0+ (marked ``gpu``): the kernel against the layer ops (the PyTorch reference ops, in
bf16, routing taken from the kernel only where the reference's own logits tie within rounding) at the
real Qwen3-30B-A3B layer shape, over several context lengths and scattered block tables, every KV-pool
byte outside the new token's slot unchanged; and the engine's greedy tokens with the megakernel in its
batch-1 graph against the eager PyTorch reference, on a transformers checkpoint.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from kernels import decode_megakernel as dm
from kernels.cuda_module import compile_cuda, find_nvcc
from tests.kernel_testing import needs_gpu


def _plan(**over: int) -> dm.MegakernelPlan:
    base = dict(hidden=2048, heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, inter=768,
                block_size=16, layers=48, qk_norm=True, norm_topk=True, ctas=132)  # fmt: skip
    base.update(over)
    return dm.MegakernelPlan(**base)


def test_plan_of_qwen3_30b_a3b_on_an_h200_fits_its_shared_memory() -> None:
    plan = _plan()
    assert plan.stage_bytes == 24576  # six QKV rows, three o-proj rows, three gate-up units, 16 down rows
    assert plan.smem_bytes <= 227 * 1024
    assert plan.shape_problem(227 * 1024) is None


@pytest.mark.parametrize(
    ("over", "words"),
    [
        (dict(head_dim=64), "head_dim 64"),
        (dict(heads=64), "16 q heads per KV head"),
        (dict(hidden=1536), "hidden size 1536"),
        (dict(inter=320), "top_k x intermediate"),
        (dict(inter=384), "expert intermediate size 384"),
        (dict(ctas=60), "35 output rows"),
        (dict(hidden=8192, heads=64, kv_heads=8, ctas=264), "shared memory"),  # a gate-up unit is 32 KiB
    ],
)
def test_plan_says_which_shape_does_not_fit(over: dict[str, int], words: str) -> None:
    problem = _plan(**over).shape_problem(227 * 1024)
    assert problem is not None and words in problem, problem


def test_host_constants_mirror_the_cuda_source() -> None:
    src = dm.SOURCE.read_text()
    defined = dict(re.findall(r"^#define (\w+) (\d+)\b", src, re.M))
    for name in ("NWARPS", "RING", "KV_TILE", "KV_ROW", "MAX_DOWN_ROWS", "MISC_BYTES"):
        assert int(defined[name]) == getattr(dm, name), name
    assert int(defined["STAMPS_PER_LAYER"]) == dm.STAMPS_PER_LAYER
    # The stage stamps follow the parts' stamps, and every name has its slot.
    assert int(defined["QKV_STAMP0"]) == dm.STAMPS.index("P1 QKV stage 0 landed")
    assert int(defined["OPJ_STAMP0"]) == dm.STAMPS.index("P3 o-proj stage 0 landed")
    assert (int(defined["QKV_STAMPS"]), int(defined["OPJ_STAMPS"])) == (dm.QKV_STAMPS, dm.OPJ_STAMPS)
    assert len(dm.STAMPS) <= dm.STAMPS_PER_LAYER
    for name, value in dm.SWITCHES.items():  # each switch's default, as the source sets it when undefined
        assert re.search(rf"#ifndef {name}\n#define {name} (\d+)\n#endif", src).group(1) == str(value), name
    assert re.search(r"#define ERR_LL (\d+)u", src).group(1) == str(dm.ERR_LL)
    assert re.search(r"#define ERR_MBAR (\d+)u", src).group(1) == str(dm.ERR_MBAR)
    # The Params struct: 30 eight-byte fields, then two floats, as the host packs it.
    body = src[src.index("struct Params {") : src.index("};", src.index("struct Params {"))]
    fields = [f for f in re.findall(r"^\s+([^/\n]+?);", body, re.M)]
    eight = sum(len(f.split(",")) for f in fields if not f.startswith("float"))
    assert eight == 30 and sum(len(f.split(",")) for f in fields if f.startswith("float")) == 2
    assert dm._PARAMS.size == 30 * 8 + 2 * 4
    layer = src[src.index("struct LayerPtrs {") : src.index("};", src.index("struct LayerPtrs {"))]
    assert len(re.findall(r"^\s+[^/\n]+?\*\s*\w+;", layer, re.M)) == dm.LAYER_POINTERS


# Switch sets the GPU tests run besides the defaults: the other attention splits (TPS), fixed gate-up slices
# (DYN 0).
OTHER_SWITCHES = [dict(TPS=0), dict(TPS=2), dict(DYN=0)]


def test_unknown_switches_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown megakernel switches"):
        dm.DecodeMegakernel(torch.nn.Module(), torch.empty(0), switches={"NOPE": 1})


@pytest.mark.skipif(find_nvcc() is None, reason="needs nvcc")
@pytest.mark.parametrize("switches", [{}, *OTHER_SWITCHES, dict(TIMING=1)], ids=str)
def test_the_source_compiles_for_sm90_without_spills(
    switches: dict[str, int], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kernels.cuda_module._load_nvrtc", lambda: None)  # nvcc prints the resource report
    compiled = compile_cuda(dm.SOURCE, _plan().defines() | dm.SWITCHES | switches, "sm_90", use_cache=False)
    assert compiled.compiler == "nvcc" and len(compiled.cubin) > 10_000
    report = compiled.log
    assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in report, report
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    assert regs <= 255  # one CTA of 256 threads per SM: up to 255 registers a thread


# ---- GPU -----------------------------------------------------------------------------------------------
def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


needs_hopper = pytest.mark.skipif(not _hopper(), reason="needs a GPU of compute capability 9.0+")


def _model(tmp: Path, layers: int, seed: int = 0) -> tuple[torch.nn.Module, torch.Tensor]:
    from benchmarks.gpu_bench import QWEN3_30B_A3B  # the benchmark's shape, the one the kernel is tuned for
    from engine.kv_cache import allocate_pool, make_layout
    from engine.loader import load_model
    from kernels.ops import get_ops

    cfg = dict(QWEN3_30B_A3B, num_hidden_layers=layers)
    (tmp / "config.json").write_text(json.dumps(cfg))
    loaded = load_model(str(tmp), "bfloat16", torch.device("cuda"), get_ops("triton"), max_positions=8192,
                        load_format="dummy", seed=seed)  # fmt: skip
    net = loaded.model
    # Weights of a trained model's scale: unit-variance embeddings, fan-in scaled projections, norms near 1.
    gen = torch.Generator(device="cuda").manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in net.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, device="cuda", generator=gen))
            elif "embed" in name:
                p.normal_(0.0, 1.0, generator=gen)
            else:
                p.normal_(0.0, p.shape[-1] ** -0.5, generator=gen)
    pool = allocate_pool(make_layout(loaded.cfg, "test", "bfloat16", 16), 600, torch.device("cuda"))
    pool.normal_(generator=gen)
    return net, pool


def _reference(net: torch.nn.Module, pool: torch.Tensor, token: int, ctx: int, slot: int, table: torch.Tensor,
               chosen: list[set[int]]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The decoder layers on the PyTorch reference ops (bf16 on the GPU): routing by the reference's own
    logits, except where the kernel chose otherwise and those logits tie within rounding."""
    from engine.models.decoder import AttentionMetadata
    from kernels.ops import get_ops

    ops = get_ops("torch")
    dev = pool.device
    positions = torch.tensor([ctx - 1], device=dev)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([slot], device=dev),
        block_tables=table.view(1, -1),
        seq_lens=torch.tensor([ctx], dtype=torch.int32, device=dev),
        query_start_loc=torch.tensor([0, 1], dtype=torch.int32, device=dev),
    )
    x = net.embed_tokens[torch.tensor([token], device=dev)]
    residual = None
    eps = net.cfg.rms_norm_eps
    for i, layer in enumerate(net.layers):
        attn, mlp = layer.self_attn, layer.mlp
        qkv, _, residual = ops.add_rms_norm_linear(
            x, residual, layer.input_layernorm, eps, attn.qkv_proj, False
        )
        o = ops.qkv_attention(qkv, *attn._prologue_args(positions, net.cos_sin, pool, meta.slot_mapping),
                              meta.block_tables, meta.seq_lens, meta.query_start_loc, attn.scale)  # fmt: skip
        o = ops.linear(o.reshape(1, -1), attn.o_proj)
        logits, h, residual = ops.add_rms_norm_linear(o, residual, layer.post_attention_layernorm, eps,
                                                      mlp.gate, True)  # fmt: skip
        lg = logits.float()[0]
        ref_set = set(torch.topk(lg, mlp.top_k).indices.tolist())
        kernel_set = chosen[i]
        if ref_set != kernel_set:
            # a swap the reference's logits cannot tell apart: within 3% of the boundary logit
            boundary = torch.sort(lg, descending=True).values[mlp.top_k - 1].abs().item()
            lo = min(lg[e].item() for e in kernel_set - ref_set)
            hi = max(lg[e].item() for e in ref_set - kernel_set)
            assert hi - lo <= 0.03 * max(1.0, boundary), (i, sorted(ref_set), sorted(kernel_set), hi, lo)
        ids = sorted(kernel_set, key=lambda e: -lg[e].item())
        probs = torch.softmax(lg, dim=-1)
        w = probs[ids]
        if mlp.norm_topk_prob:
            w = w / w.sum()
        phys = mlp.placement.logical_to_physical[ids, 0].view(1, -1)
        x = ops.fused_moe(h, mlp.w13, mlp.w2, w.to(h.dtype).view(1, -1), phys)
    return x, residual


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@needs_gpu
@needs_hopper
@pytest.mark.parametrize(
    ("ctx", "switches"),
    [(ctx, {}) for ctx in (1, 5, 90, 91, 512, 3001)]
    + [(ctx, sw) for sw in OTHER_SWITCHES for ctx in (91, 3001)],
    ids=str,
)
def test_megakernel_matches_the_reference_layers(ctx: int, switches: dict[str, int], tmp_path: Path) -> None:
    net, pool = _model(tmp_path, layers=3, seed=ctx)
    assert dm.unsupported(net, pool) is None
    mk = dm.DecodeMegakernel(net, pool, switches=switches)
    gen = torch.Generator().manual_seed(ctx)
    blocks = -(-ctx // 16)
    table = torch.randperm(pool.shape[0], generator=gen)[: blocks + 2].to(torch.int32).cuda()  # scattered
    slot = int(table[(ctx - 1) // 16]) * 16 + (ctx - 1) % 16
    token = int(torch.randint(0, net.cfg.vocab_size, (1,), generator=gen))
    pool_ref = pool.clone()
    counts = [blk.expert_counts.clone() for blk in net.moe_blocks()]
    dev = pool.device
    # Later launches must see new flags (the epoch) and give the same bits: DYN hands the gate-up chunks out
    # in a different order every launch.
    launches = 4
    for step in range(launches):
        x, res = mk.run(torch.tensor([token], device=dev), torch.tensor([ctx - 1], device=dev),
                        torch.tensor([slot], device=dev), torch.tensor([ctx], dtype=torch.int32, device=dev),
                        table.view(1, -1))  # fmt: skip
        torch.cuda.synchronize()
        assert mk.error() == 0
        if step == 0:
            x0, res0 = x.clone(), res.clone()
        else:
            assert torch.equal(x, x0) and torch.equal(res, res0), f"launch {step} gave other values"
    chosen = []
    for blk, before in zip(net.moe_blocks(), counts, strict=True):
        delta = blk.expert_counts - before
        assert int(delta.sum()) == launches * blk.top_k and bool(((delta == 0) | (delta == launches)).all())
        p2l = blk.placement.physical_to_logical
        chosen.append({int(p2l[e]) for e in torch.nonzero(delta).flatten().tolist()})
    written = pool.clone()
    x_ref, res_ref = _reference(net, pool_ref, token, ctx, slot, table, chosen)
    assert _rel(res, res_ref) < 2e-2, _rel(res, res_ref)
    assert _rel(x, x_ref) < 3e-2, _rel(x, x_ref)
    # The new token's k and v in every layer, and nothing else of the pool changed.
    blk_id, off = slot // 16, slot % 16
    new_k, ref_k = written[blk_id, :, :, off], pool_ref[blk_id, :, :, off]
    assert _rel(new_k, ref_k) < 2e-2
    written[blk_id, :, :, off] = pool_ref[blk_id, :, :, off]
    assert torch.equal(written, pool_ref), "the kernel wrote outside the new token's slot"


@needs_gpu
@needs_hopper
def test_padding_row_writes_nothing_and_finishes(tmp_path: Path) -> None:
    net, pool = _model(tmp_path, layers=2)
    mk = dm.DecodeMegakernel(net, pool)
    before = pool.clone()
    dev = pool.device
    zero = torch.zeros(1, dtype=torch.int64, device=dev)
    x, res = mk.run(zero, zero, torch.full((1,), -1, device=dev), torch.zeros(1, dtype=torch.int32, device=dev),
                    torch.zeros((1, 4), dtype=torch.int32, device=dev))  # fmt: skip
    torch.cuda.synchronize()
    assert mk.error() == 0
    assert torch.equal(pool, before)
    assert torch.isfinite(x.float()).all() and torch.isfinite(res.float()).all()


@pytest.fixture(scope="module")
def moe_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A transformers Qwen3-MoE checkpoint of shapes the kernel takes (hidden 1024, 8 q heads of 128 over
    2 KV heads, 16 experts of 256, top-4, two layers)."""
    from tests.checkpoints import make_checkpoint

    return make_checkpoint(
        "qwen3_moe_norm", tmp_path_factory.mktemp("qwen3moe"), seed=5, hidden_size=1024,
        num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=16, num_experts_per_tok=4,
        moe_intermediate_size=256, decoder_sparse_step=1, num_hidden_layers=2, max_position_embeddings=2048,
    )  # fmt: skip


@needs_gpu
@needs_hopper
def test_engine_decodes_batch_1_in_the_megakernel(moe_checkpoint: Path) -> None:
    from engine import LLM, SamplingParams
    from tests.test_gpu_engine import TOP, _prompts, assert_same_greedy

    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=TOP)
    prompts = _prompts(3, seed=9, vocab=380)
    reference = LLM(str(moe_checkpoint), device="cuda", dtype="bfloat16", kernel_backend="torch",
                    num_kv_blocks=256).generate(prompts, params)  # fmt: skip
    fast = LLM(str(moe_checkpoint), device="cuda", dtype="bfloat16", kernel_backend="triton", num_kv_blocks=256,
               decode_megakernel=True)  # fmt: skip
    runner = fast.engine.runner
    assert runner.megakernel is not None, "the batch-1 graph should run the megakernel"
    got = [fast.generate([p], params)[0] for p in prompts]  # one at a time: batch-1 graphs
    assert runner.graphs.replays[1] >= 3 * 20
    assert runner.megakernel.error() == 0
    assert_same_greedy(got, reference, exact=False)
