"""Batch-1 decode of a Qwen3-MoE-shaped model: every decoder layer in one persistent CUDA kernel.

Experimental and off by default (``decode_megakernel``): it is correct (tests against the reference ops and
greedy tokens in the engine, on an H200), but still slower than the op-by-op graphs it would replace at 512
tokens of context: 2.36 ms against 2.29 ms a Qwen3-30B-A3B step (2.55 against 2.54 at 4k; 2.51 before the
thirty-first run's changes, 2.81 before the thirtieth; docs/gpu.md, "The decode megakernel", with where its
time goes and what is left).

Why: at batch 1 a Qwen3-30B-A3B layer reads ~115 MB of weights (QKV 21, o-proj 17, router 0.5, eight
experts 75), 27 us at the H200's copy rate, but the op-by-op Triton chain takes ~44 us a layer: eight
launches, each a phase that waits for the one before (QKV -> attention -> merge -> o-proj -> router ->
routing -> gate-up -> down), and HBM idles in every latency-bound phase (attention, merge, routing) and at
every boundary. Thirty sessions of measurements (docs/gpu.md, "What is left") found that no change inside
that chain closes the gap to the 80% target, and that a Triton persistent layer with register tiles was
slower; what they left is a kernel whose weight streams keep going between phases, which this attempts.

How (``kernels/cuda/decode_layers.cu`` has the details): one CTA per SM for the whole step, eight consumer
warps and a producer warp. Each CTA owns fixed slices of every projection; the producer copies them from
HBM into an 8-stage ring in shared memory with bulk copies (``cp.async.bulk`` on an mbarrier), in the
order the layer consumes them and as far ahead as the ring allows: the next layer's QKV rows while this
layer's down rows are used, the o-proj rows while the attention runs; the experts' rows once routing has
chosen them, the gate-up rows in chunks handed out by a per-layer counter so that CTAs which stream faster
take more. Values pass between CTAs through "LL" words (a bf16 and a 16-bit flag in one 32-bit store; a
float32 and a 32-bit flag in one 64-bit store), polled by their readers: a grid-wide exchange costs one L2
round trip, with no counter, fence or barrier. Triton cannot express this: its loads become register tiles
or, for ``tl.dot`` operands, software-pipelined copies inside one loop; it has no warp that issues copies
completing on barriers while other warps compute, across loops and phases, which is the design here.

Numerics are the reference ops' rounding points (``kernels/norm.py``, ``linear.py``, ``qkv_prologue.py``,
``attention.py``, ``moe_routing.py``, and the Triton small-MoE path's single fp32 sum over the experts):
CTA c computes expert c's router logit (and c + G, ... where experts outnumber SMs) from the normalised h
in bf16, rounds it to bf16 and publishes it; every CTA routes from the same words, so runs are
deterministic. Routing picks the lowest expert among equal logits, as ``kernels/triton_moe_routing.py``;
the attention's splits follow the step's actual context length (a device value), not a bound.

What it supports (``unsupported`` says why not, and the engine then uses the op-by-op graphs): CUDA of
compute capability 9.0+, bf16 weights and KV pool, every layer MoE without shared experts, head_dim 128,
at most 8 q heads per KV head, one expert-parallel rank, no float8 weights, and shapes whose stages fit the
shared memory of one SM (``MegakernelPlan.shape_problem``; Qwen3-30B-A3B on an H200: 214 of 227 KiB). It
must not decide when it runs (``engine.cuda_graphs`` does: decode graphs of one row).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.cuda_module import CudaKernel, compile_cuda

SOURCE = Path(__file__).parent / "cuda" / "decode_layers.cu"
KERNEL_NAME = "decode_layers"
# These mirror the .cu file's constants (a test compares them).
NWARPS = 8  # consumer warps
NC = 32 * NWARPS  # consumer threads
NT = NC + 32  # and the producer warp
RING = 8
KV_TILE = 45
KV_ROW = 272
MAX_DOWN_ROWS = 32
MAX_SPLITS = 40
MISC_BYTES = 4096
ERR_LL = 1
ERR_MBAR = 2


@dataclass(frozen=True)
class MegakernelPlan:
    """The shapes the kernel is compiled for and the shared memory its slices need, on ``ctas`` SMs."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int  # logical
    top_k: int
    inter: int  # expert intermediate size
    block_size: int
    layers: int
    qk_norm: bool
    norm_topk: bool
    ctas: int

    @property
    def qkv_rows(self) -> int:
        return (self.heads + 2 * self.kv_heads) * self.head_dim

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def stage_bytes(self) -> int:
        """A ring stage (a multiple of 4 KiB): at least a KV tile, a gate-up unit (gate and up rows), an
        o-proj row, a down row, and a CTA's router rows."""
        router_rows = -(-self.experts // self.ctas)
        need = max(
            2 * KV_TILE * KV_ROW,
            4 * self.hidden,
            2 * self.q_dim,
            2 * self.inter,
            2 * router_rows * self.hidden,
        )
        return -(-need // 4096) * 4096

    @property
    def scr_bytes(self) -> int:
        group = self.heads // self.kv_heads
        return _round16(
            max(self.top_k * self.inter * 2, self.q_dim * 2, group * self.head_dim * 2 + NWARPS * 64 * 4)
        )

    @property
    def smem_bytes(self) -> int:
        return RING * self.stage_bytes + 4 * self.hidden + self.scr_bytes + MISC_BYTES + 16 * RING

    def defines(self) -> dict[str, int]:
        return {
            "H": self.hidden, "NQ": self.heads, "NKV": self.kv_heads, "D": self.head_dim, "NE": self.experts,
            "TOPK": self.top_k, "NI": self.inter, "BS": self.block_size, "NL": self.layers,
            "QK_NORM": int(self.qk_norm), "NORM_TOPK": int(self.norm_topk), "STAGE_BYTES": self.stage_bytes, "SCR_BYTES": self.scr_bytes, "MAX_SPLITS": MAX_SPLITS,
        }  # fmt: skip

    def shape_problem(self, max_smem: int) -> str | None:
        """Why the kernel cannot take these shapes on ``ctas`` SMs with ``max_smem`` bytes each, or None."""
        h, group = self.hidden, self.heads // max(1, self.kv_heads)
        rows = -(-h // self.ctas)
        checks = [
            (self.head_dim == 128, f"head_dim {self.head_dim} (the kernel's lanes take 128)"),
            (self.heads % self.kv_heads == 0 and group <= 8, f"{group} q heads per KV head (at most 8)"),
            (h % (4 * NC) == 0, f"hidden size {h} (a multiple of {4 * NC})"),
            (self.q_dim % (4 * NC) == 0, f"q size {self.q_dim} (a multiple of {4 * NC})"),
            ((self.top_k * self.inter) % (4 * NC) == 0, f"top_k x intermediate {self.top_k * self.inter}"),
            (self.inter % 256 == 0, f"expert intermediate size {self.inter} (a multiple of 256)"),
            (self.experts % 4 == 0, f"{self.experts} experts (a multiple of 4)"),
            (self.top_k <= 16, f"top_k {self.top_k} (at most 16)"),
            (rows <= MAX_DOWN_ROWS, f"{rows} output rows a CTA (at most {MAX_DOWN_ROWS})"),
            (self.top_k * self.inter >= self.ctas, "fewer gate-up rows than SMs"),
            (self.ctas >= self.kv_heads, f"{self.ctas} SMs for {self.kv_heads} KV heads"),
            (self.smem_bytes <= max_smem, f"{self.smem_bytes} bytes of shared memory a CTA (the SM has {max_smem})"),
        ]  # fmt: skip
        for ok, what in checks:
            if not ok:
                return what
        return None


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def plan_for(model: torch.nn.Module, block_size: int, ctas: int) -> MegakernelPlan:
    cfg = model.cfg
    return MegakernelPlan(
        hidden=cfg.hidden_size, heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
        experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, inter=cfg.moe_intermediate_size,
        block_size=block_size, layers=cfg.num_layers, qk_norm=cfg.qk_norm, norm_topk=cfg.norm_topk_prob,
        ctas=ctas,
    )  # fmt: skip


def unsupported(model: torch.nn.Module, kv_pool: torch.Tensor) -> str | None:
    """Why ``DecodeMegakernel`` cannot run this model over this pool, or None where it can."""
    device = kv_pool.device
    if device.type != "cuda":
        return "not a CUDA device"
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if (props.major, props.minor) < (9, 0):
        return f"compute capability {props.major}.{props.minor} (bulk copies need 9.0)"
    cfg = model.cfg
    if getattr(cfg, "mla", None) is not None:
        return "latent attention (DeepSeek)"
    if not cfg.is_moe or not all(cfg.moe_layers):
        return "not every layer is an MoE layer"
    if cfg.attention_bias:
        return "q/k/v biases"
    if getattr(model, "fp8", None) is not None:
        return "float8 weights"
    if getattr(model.dispatcher, "ep_size", 1) != 1:  # kernels/ does not import engine/: duck-typed
        return "several expert-parallel ranks"
    if getattr(model, "lora_slots", None) is not None:
        return "LoRA adapters"
    if kv_pool.dtype != torch.bfloat16 or kv_pool.dim() != 6 or kv_pool.stride(-1) != 1:
        return f"a {kv_pool.dtype} KV pool (bf16 only)"
    if model.cos_sin.dtype != torch.float32 or not model.cos_sin.is_contiguous():
        return "a RoPE table that is not contiguous float32"
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if not hasattr(mlp, "w13") or not hasattr(mlp, "placement"):
            return "a dense MLP layer"
        tensors = [layer.input_layernorm, layer.post_attention_layernorm, attn.qkv_proj, attn.o_proj,
                   mlp.gate, mlp.w13, mlp.w2, model.embed_tokens]  # fmt: skip
        if cfg.qk_norm:
            tensors += [attn.q_norm, attn.k_norm]
        if any(
            not isinstance(t, torch.Tensor) or t.dtype != torch.bfloat16 or not t.is_contiguous()
            for t in tensors
        ):
            return "weights that are not contiguous bf16 tensors"
        if mlp.num_physical != mlp.w13.shape[0]:
            return "experts held by other ranks"
        l2p = mlp.placement.logical_to_physical
        if l2p.stride(0) != model.layers[0].mlp.placement.logical_to_physical.stride(0) or l2p.stride(1) != 1:
            return "replica tables of different widths in different layers (the kernel takes one stride)"
    ctas = props.multi_processor_count
    max_smem = getattr(props, "shared_memory_per_block_optin", 0) or 227 * 1024
    return plan_for(model, kv_pool.shape[3], ctas).shape_problem(max_smem)


LAYER_POINTERS = 11  # the fields of decode_layers.cu's LayerPtrs, one row of ``layer_table``
# The Params struct of decode_layers.cu: 30 eight-byte fields, then scale_log2 and eps (float32).
_PARAMS = struct.Struct("<" + "Q" * 30 + "ff")
# Where each of a layer's timing stamps is taken (``timing=True``): the end of ... Every CTA passes the first
# ``SEQUENTIAL_STAMPS`` in order; the rest are extra points of the same layer (the ones marked so only the
# attention CTAs take).
STAMPS = (
    "layer start", "P1 input arrived", "P1 QKV rows", "P2 attention", "P2b merge", "P3 attn arrived",
    "P3 o-proj rows", "P4 h arrived", "P4 own router logit out", "P4 routing", "P4 gate-up",
    "P5 act arrived", "P5 down rows", "P2 q, k, v arrived (attention CTAs)", "P2 tiles scored (attention CTAs)",
    "P2 q stored (attention CTAs)", "P2 first tile arrived (attention CTAs)", "P3 attn in every thread",
)  # fmt: skip
SEQUENTIAL_STAMPS = 13
STAMPS_PER_LAYER = 32  # the .cu's: clock64 at [k], globaltimer at [32 + k]
# The .cu's stage stamps (QKV_STAMP0, QKV_STAMPS, OPJ_STAMP0, OPJ_STAMPS): when each warp found its stage
# landed, right after the stamps above.
QKV_STAMPS, OPJ_STAMPS = 7, 6
STAMPS += tuple(f"P1 QKV stage {i} landed" for i in range(QKV_STAMPS))
STAMPS += tuple(f"P3 o-proj stage {i} landed" for i in range(OPJ_STAMPS))
# The .cu's compile-time switches and their defaults (a test compares them): what each does is in its header.
SWITCHES = {"TPS": 1, "DYN": 1}


class DecodeMegakernel:
    """The compiled kernel for one model and KV pool, with its scratch (LL buffers, epoch, error word) and
    output rows. ``run`` launches one step on the current stream (graph-capturable)."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_pool: torch.Tensor,
        timing: bool = False,
        switches: dict[str, int] | None = None,
    ) -> None:
        """``timing``: a build that stamps each CTA's clock at the end of every part of each layer
        (``STAMPS``; ``phase_cycles`` reads them), for benchmarks. ``switches``: values for some of
        ``SWITCHES`` (the defaults otherwise), for benchmarks that compare them."""
        unknown = set(switches or {}) - set(SWITCHES)
        if unknown:
            raise ValueError(f"unknown megakernel switches {sorted(unknown)} (known: {sorted(SWITCHES)})")
        self.switches = SWITCHES | (switches or {})
        reason = unsupported(model, kv_pool)
        if reason is not None:
            raise ValueError(f"the decode megakernel cannot run this model: {reason}")
        device = kv_pool.device
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)
        props = torch.cuda.get_device_properties(index)
        self.plan = plan = plan_for(model, kv_pool.shape[3], props.multi_processor_count)
        self.model = model
        self.kv_pool = kv_pool
        arch = f"sm_{props.major}{props.minor}"
        defines = plan.defines() | self.switches | ({"TIMING": 1} if timing else {})
        compiled = compile_cuda(SOURCE, defines, arch)
        self.kernel = CudaKernel(compiled, KERNEL_NAME, self.device, plan.smem_bytes)
        h = plan.hidden
        kw = {"device": self.device}
        rows = []
        for layer in model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qn = attn.q_norm if plan.qk_norm else layer.input_layernorm  # never read without QK_NORM
            kn = attn.k_norm if plan.qk_norm else layer.input_layernorm
            rows.append([t.data_ptr() for t in (
                layer.input_layernorm, attn.qkv_proj, qn, kn, attn.o_proj, layer.post_attention_layernorm,
                mlp.w13, mlp.w2, mlp.placement.logical_to_physical, mlp.expert_counts, mlp.gate,
            )])  # fmt: skip
        self.l2p_stride = model.layers[0].mlp.placement.logical_to_physical.stride(0)  # one for all layers
        assert all(len(r) == LAYER_POINTERS for r in rows)
        self.layer_table = torch.tensor(rows, dtype=torch.int64, **kw)  # [layers, LAYER_POINTERS]
        self.x_out = torch.empty((1, h), dtype=torch.bfloat16, **kw)
        self.res_out = torch.empty((1, h), dtype=torch.bfloat16, **kw)
        ll4 = [plan.qkv_rows, plan.q_dim, h, plan.top_k * plan.inter, h]  # qkv, attn, h, act, xo
        self._ll4 = torch.zeros(sum(_round16(n) for n in ll4), dtype=torch.int32, **kw)
        self._ll4_parts = []
        offset = 0
        for n in ll4:
            self._ll4_parts.append(self._ll4[offset : offset + n])
            offset += _round16(n)
        self._part_o = torch.zeros(MAX_SPLITS * plan.heads * plan.head_dim, dtype=torch.int64, **kw)
        self._part_lse = torch.zeros(MAX_SPLITS * plan.heads, dtype=torch.int64, **kw)
        self._ll_logit = torch.zeros((plan.layers, plan.experts), dtype=torch.int64, **kw)
        self._words = torch.zeros(16, dtype=torch.int32, **kw)  # epoch | exit count | error
        # DYN's counters of the gate-up chunks handed out, one a layer, 0 between launches
        self._gate_next = torch.zeros(plan.layers, dtype=torch.int32, **kw)
        self.timing = (
            torch.zeros((plan.ctas, plan.layers, 2 * STAMPS_PER_LAYER), dtype=torch.int64, **kw)
            if timing
            else None
        )
        self.scale_log2 = plan.head_dim**-0.5 * math.log2(math.e)
        self.eps = model.cfg.rms_norm_eps
        self._params: dict[tuple[int, ...], bytes] = {}

    def _pack(self, ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, seq_lens: torch.Tensor,
              block_tables: torch.Tensor) -> bytes:  # fmt: skip
        key = (
            ids.data_ptr(),
            positions.data_ptr(),
            slots.data_ptr(),
            seq_lens.data_ptr(),
            block_tables.data_ptr(),
        )
        packed = self._params.get(key)
        if packed is None:
            pool = self.kv_pool
            words = self._words.data_ptr()
            ll = [t.data_ptr() for t in self._ll4_parts]
            packed = _PARAMS.pack(
                self.layer_table.data_ptr(), self.l2p_stride,
                ids.data_ptr(), positions.data_ptr(), slots.data_ptr(), seq_lens.data_ptr(), block_tables.data_ptr(),
                self.model.embed_tokens.data_ptr(), self.model.cos_sin.data_ptr(), pool.data_ptr(),
                pool.stride(0), pool.stride(1), pool.stride(2), pool.stride(3), pool.stride(4),
                self.x_out.data_ptr(), self.res_out.data_ptr(), *ll,
                self._part_o.data_ptr(), self._part_lse.data_ptr(), self._ll_logit.data_ptr(),
                self._gate_next.data_ptr(), words, words + 4, words + 8,
                self.timing.data_ptr() if self.timing is not None else 0, self.scale_log2, self.eps,
            )  # fmt: skip
            self._params[key] = packed
        return packed

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        seq_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Every decoder layer for one token: input_ids, positions, slot_mapping int64 [1], seq_lens int32 [1],
        block_tables int32 [1, max_blocks] (row 0 is read, contiguous). Writes the new token's K and V into
        the pool and counts its experts, like the layers' ops; returns (x, residual) [1, H] of the last layer
        (the kernel's own output buffers), for ``DecoderModel.final_logits``."""
        for name, t, dtype in (("input_ids", input_ids, torch.int64), ("positions", positions, torch.int64),
                               ("slot_mapping", slot_mapping, torch.int64), ("seq_lens", seq_lens, torch.int32),
                               ("block_tables", block_tables, torch.int32)):  # fmt: skip
            if t.dtype != dtype or t.device != self.device or t.numel() < 1:
                raise ValueError(f"{name} must be a non-empty {dtype} tensor on {self.device}")
        if block_tables.stride(-1) != 1:
            raise ValueError("block_tables rows must be contiguous")
        params = self._pack(input_ids, positions, slot_mapping, seq_lens, block_tables)
        self.kernel.launch(self.plan.ctas, NT, params)
        return self.x_out, self.res_out

    def phase_cycles(self) -> dict[str, dict[str, float]]:
        """From a timing build's last launch: per part of a layer (``STAMPS``, each from the stamp before
        it), SM cycles, the median over layers 1.. of CTA 0 ("cta0") and of the mean over CTAs ("mean");
        and "layer" (stamp 0 to stamp 0 of the next layer). Synchronises."""
        if self.timing is None:
            raise ValueError("not a timing build")
        n = SEQUENTIAL_STAMPS
        t = self.timing.cpu().double()[:, 1:, :n]  # layer 0 waits on the launch itself
        d = t[:, :, 1:n] - t[:, :, : n - 1]
        out = {}
        for i, name in enumerate(STAMPS[1:n]):
            out[name] = {"cta0": float(d[0, :, i].median()), "mean": float(d[:, :, i].mean(0).median())}
        lay = t[:, 1:, 0] - t[:, :-1, 0]
        out["layer"] = {"cta0": float(lay[0].median()), "mean": float(lay.mean(0).median())}
        return out

    def phase_skew(self, layer: int) -> dict[str, list[float]]:
        """From a timing build's last launch, for one layer: per stamp (``STAMPS``), the [min, median, max]
        over CTAs of its global time (ns) after the earliest CTA's layer start, in microseconds; and the 8
        latest CTAs at the gate-up's end and at the QKV rows' end. Synchronises."""
        if self.timing is None:
            raise ValueError("not a timing build")
        t = self.timing.cpu()[:, layer, STAMPS_PER_LAYER : STAMPS_PER_LAYER + len(STAMPS)].double()
        t = (t - t[:, 0].min()) / 1000.0
        out = {}
        for i, name in enumerate(STAMPS):
            col = t[:, i]
            if i >= SEQUENTIAL_STAMPS:
                col = col[col >= 0]  # CTAs that took it in this launch (others hold older stamps, or none)
            if col.numel():
                out[name] = [float(col.min()), float(col.median()), float(col.max())]
        gate_end = STAMPS.index("P4 gate-up")
        out["latest CTAs at the gate-up's end"] = [float(x) for x in torch.argsort(t[:, gate_end])[-8:]]
        qkv_end = STAMPS.index("P1 QKV rows")
        out["latest CTAs at the QKV rows' end"] = [float(x) for x in torch.argsort(t[:, qkv_end])[-8:]]
        return out

    def error(self) -> int:
        """The kernel's error word (synchronises): 0, or ERR_LL / ERR_MBAR bits where a wait gave up."""
        return int(self._words[2].item())
