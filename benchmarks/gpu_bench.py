"""GPU benchmark of the engine in one run: ceilings, decode steps against their roofline, prefill against the
matmul rate, and transformers' ``generate()`` on weights of the same shapes.

1. Ceilings: HBM bandwidth (a device-to-device copy, bytes read + written) and the bf16 matmul rate (8192^3).
2. Models: random bf16 weights (``load_format="dummy"``, only a config.json is written) shaped like
   Llama-3.1-8B (dense) and Qwen3-30B-A3B (MoE), run by ``LLMEngine`` with the Triton ops and CUDA graphs.
3. Decode: steady-state ``engine.step()`` time (scheduler + runner + sampler) at batch 1/16/64/256 and
   context 512/4096. The sequences enter the way a decode worker's do (``reserve_import`` + ``commit_import``:
   blocks allocated, context already in the KV pool, which holds random values). Each row also times the
   captured graph alone (device time of the step) and prints its roofline: the bytes a step must move (every
   weight a step reads: for MoE the non-expert weights plus the experts the batch activates, counted from the
   router per layer; plus the KV read) over the measured copy bandwidth.
4. Prefill (dense): tokens/s over 4096-token prompts; FLOPs = 2 * matmul params * tokens + causal attention
   (2 * heads * head_dim * L^2 per layer) + the LM head of the sampled row, against the measured matmul rate.
5. End to end, like for like with transformers: 512-token prompts, 128 new tokens, batch 1/16/64, through our
   engine, then ``AutoModelForCausalLM.from_config(...).generate()`` (random init on the GPU, bf16).

Run on the device machine from the repository root: ``PYTHONUNBUFFERED=1 python3 benchmarks/gpu_bench.py``;
``--sections`` picks parts, ``--out DIR`` (default ``$OUT`` or ./gpu_bench_out) gets the full log and a JSON
of every number. ``--smoke`` runs small shapes on the CPU to check the plumbing. The short table is last.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.common import copy_gbps, percentile, setup_output  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.models.model_config import ModelConfig  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels import triton_device  # noqa: E402

LLAMA_3_1_8B: dict[str, Any] = dict(
    architectures=["LlamaForCausalLM"],
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    attention_bias=False,
    mlp_bias=False,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)
QWEN3_30B_A3B: dict[str, Any] = dict(
    architectures=["Qwen3MoeForCausalLM"],
    model_type="qwen3_moe",
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    attention_bias=False,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151645,
)
SHAPES = {"dense": ("Llama-3.1-8B shape", LLAMA_3_1_8B), "moe": ("Qwen3-30B-A3B shape", QWEN3_30B_A3B)}
# --smoke: the same code on small shapes, CPU, float32, torch ops.
SMOKE_OVERRIDES: dict[str, Any] = dict(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    num_experts=8,
    num_experts_per_tok=2,
)

log = logging.getLogger("gpu_bench")


@dataclass
class Plan:
    device: str = "cuda"
    dtype: str = "bfloat16"
    backend: str = "triton"
    batches: tuple[int, ...] = (1, 16, 64, 256)
    contexts: tuple[int, ...] = (512, 4096)
    warmup_steps: int = 5
    timed_steps: int = 20
    prefill_len: int = 4096
    prefill_prompts: int = 8
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    e2e_batches: tuple[int, ...] = (1, 16, 64)
    e2e_prompt: int = 512
    e2e_new: int = 128
    serve_rates: tuple[float, ...] = (4.0, 16.0, 64.0)  # requests per second, Poisson arrivals
    serve_requests: int = 64  # each with e2e_prompt tokens in and e2e_new out
    serve_modes: tuple[str, ...] = ("off", "on", "on-early", "on-drain")  # SERVE_MODES, each at every rate
    gpu_mem_fraction: float = 0.80  # of free memory, for weights + KV pool
    async_scheduling: bool | None = None  # None: the engine's default (on for CUDA)
    kv_cache_dtype: str = "auto"  # EngineConfig.kv_cache_dtype: auto (the weights' dtype) or fp8
    quantization: str = "auto"  # EngineConfig.quantization: fp8 keeps the linear weights in float8
    # The decode section's sampling, SamplingParams fields (empty: greedy), e.g. {"temperature": 0.8}.
    decode_sampling: dict[str, float] = field(default_factory=dict)
    megakernel: bool = False  # EngineConfig.decode_megakernel
    # Batch-1 decode points also run with the megakernel off (the batch-1 graph captured again without it)
    megakernel_compare: bool = False
    megakernel_timing: bool = False  # and once more with a timing build (per-phase SM cycles, logged)
    # Batch-1 decode points also with builds of other switches (kernels.decode_megakernel.SWITCHES):
    # (label, switches, with a timing build too)
    megakernel_variants: tuple[tuple[str, dict[str, int], bool], ...] = ()
    smoke: bool = False


@dataclass
class Results:
    env: dict[str, Any] = field(default_factory=dict)
    ceilings: dict[str, float] = field(default_factory=dict)
    decode: list[dict[str, Any]] = field(default_factory=list)
    prefill: list[dict[str, Any]] = field(default_factory=list)
    e2e: list[dict[str, Any]] = field(default_factory=list)
    hf: list[dict[str, Any]] = field(default_factory=list)
    serve: list[dict[str, Any]] = field(default_factory=list)
    megakernel_phases: list[dict[str, Any]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


# ---- counting bytes and FLOPs ----------------------------------------------------------------------
@dataclass
class WeightBytes:
    per_step_dense: float  # bytes every decode step reads whatever the routing (attention, norms, LM head...)
    per_expert: float  # bytes of one expert of one layer
    moe_layers: int
    num_experts: int
    top_k: int
    matmul_params: float  # params in the matmuls of one token's forward (LM head excluded)
    lm_head_params: float
    kv_bytes_per_token: float  # all layers, K and V


def count_weights(
    cfg: ModelConfig, itemsize: int, kv_itemsize: int | None = None, linear_itemsize: float | None = None
) -> WeightBytes:
    """``linear_itemsize``: bytes a weight of the attention, MLP and expert projections (float8: one, plus
    its share of a float32 scale per 128 x 128 block); the router, norms, embeddings and LM head take
    ``itemsize``."""
    h, d = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    attn = h * (q + 2 * kv) + q * h
    norms = 2 * h + (2 * d if cfg.qk_norm else 0)
    dense_mlp = 3 * h * cfg.intermediate_size
    per_expert = 3 * h * cfg.moe_intermediate_size
    moe_layers = sum(1 for m in cfg.moe_layers if m) if cfg.is_moe else 0
    dense_layers = cfg.num_layers - moe_layers
    router = cfg.num_experts * h if cfg.is_moe else 0
    lm_head = cfg.vocab_size * h
    dense_params = (
        cfg.num_layers * (attn + norms) + dense_layers * dense_mlp + moe_layers * router + h + lm_head
    )
    matmul = (
        cfg.num_layers * attn
        + dense_layers * dense_mlp
        + moe_layers * (router + cfg.num_experts_per_tok * per_expert)
    )
    linear = linear_itemsize or itemsize
    linear_dense = cfg.num_layers * attn + dense_layers * dense_mlp  # in dense_params, at `linear` bytes
    return WeightBytes(
        per_step_dense=(dense_params - linear_dense) * itemsize + linear_dense * linear,
        per_expert=per_expert * linear,
        moe_layers=moe_layers,
        num_experts=cfg.num_experts,
        top_k=cfg.num_experts_per_tok,
        matmul_params=matmul,
        lm_head_params=lm_head,
        kv_bytes_per_token=cfg.num_layers * 2 * cfg.num_kv_heads * d * (kv_itemsize or itemsize),
    )


def expected_unique_experts(num_experts: int, top_k: int, tokens: int) -> float:
    """Expected distinct experts hit by ``tokens`` tokens routed uniformly at random, top-k each."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


def attention_flops(cfg: ModelConfig, prompt_len: int) -> float:
    """Causal attention of one prompt: QK^T and PV over the lower triangle, every layer."""
    return 2.0 * cfg.num_layers * cfg.num_heads * cfg.head_dim * prompt_len * prompt_len


# ---- timing helpers --------------------------------------------------------------------------------
def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def cuda_median_ms(fn: Callable[[], None], iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends, strict=True):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))


def _matmul_tflops(n: int = 8192) -> float:
    mats = [torch.randn(n, n, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    out = torch.empty(n, n, device="cuda", dtype=torch.bfloat16)
    calls = [0]

    def mm() -> None:  # alternate input sets so no product reads the previous one's inputs from L2
        k = calls[0] % 2
        torch.matmul(mats[k], mats[2 + k], out=out)
        calls[0] += 1

    ms = cuda_median_ms(mm, iters=20)
    return 2 * n**3 / ms / 1e9


def measure_ceilings(res: Results) -> None:
    res.ceilings["hbm_gbps"] = copy_gbps()
    res.ceilings["matmul_tflops"] = _matmul_tflops()
    torch.cuda.empty_cache()
    log.info(
        "ceilings: copy %.0f GB/s, bf16 matmul %.0f TFLOP/s",
        res.ceilings["hbm_gbps"],
        res.ceilings["matmul_tflops"],
    )


# ---- the engine --------------------------------------------------------------------------------
def write_config(cfg: dict[str, Any], smoke: bool) -> Path:
    cfg = dict(cfg)
    if smoke:
        cfg.update({k: v for k, v in SMOKE_OVERRIDES.items() if k in cfg})
    path = Path(tempfile.mkdtemp(prefix="pdmesh-bench-"))
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def blocks_needed(batch: int, ctx: int, plan: Plan, block_size: int = 16) -> int:
    extra = plan.warmup_steps + plan.timed_steps + 16
    return batch * -(-(ctx + extra) // block_size)


def build_engine(model_dir: Path, plan: Plan, num_blocks: int) -> LLMEngine:
    cfg = EngineConfig(
        model=str(model_dir),
        device=plan.device,
        dtype=plan.dtype,
        kernel_backend=plan.backend,
        load_format="dummy",
        num_kv_blocks=num_blocks,
        max_num_seqs=max(plan.batches),
        max_num_batched_tokens=plan.max_num_batched_tokens,
        max_model_len=plan.max_model_len,
        async_scheduling=plan.async_scheduling,
        kv_cache_dtype=plan.kv_cache_dtype,
        quantization=plan.quantization,
        decode_megakernel=plan.megakernel,
    )
    t = time.perf_counter()
    engine = LLMEngine(cfg)
    built = time.perf_counter() - t
    graphs = engine.runner.graphs  # captured by LLMEngine (config.cuda_graphs) on CUDA with the Triton ops
    log.info(
        "engine built in %.1f s; CUDA graphs %s%s",
        built,
        "on" if graphs else "off",
        f" (captured in {graphs.capture_seconds:.1f} s)" if graphs else "",
    )
    with torch.no_grad():  # attention never reads zeros (they can run faster than real data)
        pool = engine.kv_pool
        if pool.element_size() >= 2:
            pool.normal_()
        else:  # float8 has no normal_: fill a few blocks at a time through a float32 buffer
            step = max(1, (256 << 20) // max(1, pool[0].numel() * 2))
            for i in range(0, pool.shape[0], step):
                pool[i : i + step].copy_(torch.randn(pool[i : i + step].shape, device=pool.device))
    return engine


def drain(engine: LLMEngine, rids: list[str]) -> None:
    for rid in rids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()


def host_launch_ms(fn: Callable[[], None], iters: int = 10) -> float:
    """Host time of one call of ``fn`` (graph launches), each started on an idle device."""
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e3


def kernel_profile(fn: Callable[[], None], iters: int = 5) -> str:
    """Device time per kernel over ``iters`` calls (for the log)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("self_device_time_total", "self_cuda_time_total", "cuda_time_total"):
        try:
            return averages.table(sort_by=key, row_limit=30)
        except Exception:  # the sort key's name changed across torch versions
            continue
    return averages.table(row_limit=30)


def kernel_timeline(fn: Callable[[], None], iters: int = 3) -> str:
    """Where a call's device time goes along its chain of kernels (for the log). With programmatic
    dependent launch the kernels overlap, so a kernel's own duration says little; what it adds to the
    chain is its end minus the previous kernel's end (its *marginal* time, which sums to the span). Per
    kernel name over ``iters`` calls: launches per call, mean duration, mean marginal, total marginal per
    call."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
            torch.cuda.synchronize()
    kernels = sorted(
        (e for e in prof.events() if e.device_type == DeviceType.CUDA),
        key=lambda e: e.time_range.start,
    )
    if not kernels:
        return "(no kernel events)"
    rows: dict[str, list[float]] = {}
    span, prev_end, t0, order = 0.0, None, 0.0, []
    for e in kernels:
        start, end = e.time_range.start, e.time_range.end
        if prev_end is None or start - prev_end > 50.0:  # a new call (the host synchronised in between)
            prev_end, t0, order = start, start, []
        order.append(f"  {start - t0:9.2f} {end - t0:9.2f} {end - prev_end:7.2f}  {e.name[:70]}")
        marginal = max(0.0, end - prev_end)
        prev_end = max(prev_end, end)
        span += marginal
        row = rows.setdefault(e.name[:60], [0, 0.0, 0.0])
        row[0] += 1
        row[1] += end - start
        row[2] += marginal
    lines = [f"{'kernel':60} {'n/call':>7} {'dur us':>8} {'marg us':>8} {'marg/call us':>12}"]
    for name, (n, dur, marg) in sorted(rows.items(), key=lambda kv: -kv[1][2]):
        lines.append(f"{name:60} {n / iters:7.1f} {dur / n:8.2f} {marg / n:8.2f} {marg / iters:12.1f}")
    lines.append(f"span per call {span / iters:.1f} us")
    lines.append(
        "the last call's kernels 20-60: start, end (us from its first kernel's start), marginal, name"
    )
    lines += order[20:60]
    return "\n".join(lines)


class StepBreakdown:
    """Host wall time inside the runner (``execute``, or ``execute_lookahead`` under asynchronous
    scheduling: batch metadata, copies, launch, all asynchronous) and the
    sampler (``__call__`` waits for the device first; ``sample``, used by asynchronous scheduling, does
    not) over the steps run inside the ``with``."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.seconds = {"runner": 0.0, "sampler": 0.0}
        self.calls = {"runner": 0, "sampler": 0}

    def _wrap(self, key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - t
                self.calls[key] += 1

        return timed

    def __enter__(self) -> StepBreakdown:
        self._runner, self._sampler = self.engine.runner, self.engine.sampler
        runner = self._runner
        runner.execute = self._wrap("runner", runner.execute)  # type: ignore[method-assign]
        runner.execute_lookahead = self._wrap("runner", runner.execute_lookahead)  # type: ignore[method-assign]
        self.engine.sampler = _TimedSampler(self._sampler, self._wrap)  # type: ignore[assignment]
        return self

    def __exit__(self, *exc: object) -> None:
        del self.engine.runner.execute, self.engine.runner.execute_lookahead
        self.engine.sampler = self._sampler

    def mean_ms(self, key: str) -> float:
        return self.seconds[key] / max(1, self.calls[key]) * 1e3


class _TimedSampler:
    """The engine's sampler with its two entry points timed (everything else passes through)."""

    def __init__(self, inner: Any, wrap: Callable[..., Callable[..., Any]]) -> None:
        self._inner = inner
        self._call = wrap("sampler", inner.__call__)
        self.sample = wrap("sampler", inner.sample)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def decode_point(
    engine: LLMEngine,
    name: str,
    batch: int,
    ctx: int,
    plan: Plan,
    wb: WeightBytes,
    res: Results,
    profile: bool,
) -> None:
    vocab = engine.vocab_size
    rng = np.random.default_rng(batch * 100003 + ctx)
    params = SamplingParams(
        max_tokens=plan.warmup_steps + plan.timed_steps + 8,
        ignore_eos=True,
        **({"temperature": 0.0} | plan.decode_sampling),
    )
    rids = []
    for i in range(batch):
        rid = f"{name}-b{batch}-c{ctx}-{i}"
        prompt = rng.integers(0, vocab, ctx).tolist()
        engine.reserve_import(rid, prompt, params)
        engine.commit_import(rid, int(rng.integers(0, vocab)))
        rids.append(rid)
    try:
        for _ in range(plan.warmup_steps):
            engine.step()
        assert len(engine.scheduler.running) == batch, "every sequence decodes in every step"
        engine.take_expert_counts()
        engine.step()
        counts = engine.take_expert_counts()
        unique = float((counts > 0).sum(dim=1).float().mean()) if counts is not None else 0.0
        times = []
        with StepBreakdown(engine) as parts:
            for _ in range(plan.timed_steps):
                t = time.perf_counter()
                engine.step()
                times.append(time.perf_counter() - t)
        step_ms = statistics.median(times) * 1e3
        graphs = engine.runner.graphs
        replay_ms = float("nan")
        bucket = graphs.bucket_for(batch) if graphs else None
        launch_ms = float("nan")
        if bucket is not None and plan.device == "cuda":

            def replay() -> None:
                graphs.replay(bucket)

            replay_ms = cuda_median_ms(replay, iters=20)
            launch_ms = host_launch_ms(replay)
            if profile:
                log.info(
                    "kernel profile, %s batch %d ctx %d (graph replays):\n%s",
                    name,
                    batch,
                    ctx,
                    kernel_profile(replay),
                )
                log.info(
                    "kernel timeline, %s batch %d ctx %d (graph replays):\n%s",
                    name,
                    batch,
                    ctx,
                    kernel_timeline(replay),
                )
        t = time.perf_counter()
        running = list(engine.scheduler.running)
        for seq in running:
            engine.block_pool.cache_full_blocks(seq)
        cache_blocks_ms = (time.perf_counter() - t) * 1e3
    finally:
        drain(engine, rids)
    ctx_now = ctx + plan.warmup_steps + 1 + plan.timed_steps // 2
    kv_bytes = batch * ctx_now * wb.kv_bytes_per_token
    expected = expected_unique_experts(wb.num_experts, wb.top_k, batch) if wb.moe_layers else 0.0
    weight_bytes = wb.per_step_dense + wb.moe_layers * unique * wb.per_expert
    total = weight_bytes + kv_bytes
    row: dict[str, Any] = dict(
        model=name,
        batch=batch,
        ctx=ctx,
        step_ms=step_ms,
        step_ms_min=min(times) * 1e3,
        replay_ms=replay_ms,
        tok_s=batch / step_ms * 1e3,
        weight_gb=weight_bytes / 1e9,
        kv_gb=kv_bytes / 1e9,
        experts_per_layer=unique,
        experts_expected=expected,
        cache_full_blocks_ms=cache_blocks_ms,
        launch_ms=launch_ms,
        runner_ms=parts.mean_ms("runner"),
        sampler_ms=parts.mean_ms("sampler"),
    )
    bw = res.ceilings.get("hbm_gbps")
    if bw:
        roof_ms = total / bw / 1e6
        row.update(
            roofline_ms=roof_ms,
            pct_roofline=100 * roof_ms / step_ms,
            pct_roofline_graph=100 * roof_ms / replay_ms if replay_ms == replay_ms else float("nan"),
            roofline_tok_s=batch / roof_ms * 1e3,
        )
    res.decode.append(row)
    log.info("decode %s", json.dumps(row))


def prefill_point(engine: LLMEngine, name: str, plan: Plan, wb: WeightBytes, res: Results) -> None:
    vocab = engine.vocab_size
    rng = np.random.default_rng(7)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(n: int, tag: str) -> float:
        for i in range(n):
            engine.add_request(f"{tag}-{i}", rng.integers(0, vocab, plan.prefill_len).tolist(), params)
        _sync(plan.device)
        t = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        _sync(plan.device)
        return time.perf_counter() - t

    run(2, f"{name}-prefill-warm")
    seconds = run(plan.prefill_prompts, f"{name}-prefill")
    cfg = engine.model_config
    tokens = plan.prefill_prompts * plan.prefill_len
    flops = plan.prefill_prompts * (
        2 * wb.matmul_params * plan.prefill_len
        + attention_flops(cfg, plan.prefill_len)
        + 2 * wb.lm_head_params
    )
    row: dict[str, Any] = dict(
        model=name,
        prompt_len=plan.prefill_len,
        prompts=plan.prefill_prompts,
        seconds=seconds,
        tok_s=tokens / seconds,
        tflops=flops / seconds / 1e12,
        attention_share=attention_flops(cfg, plan.prefill_len) * plan.prefill_prompts / flops,
        max_num_batched_tokens=plan.max_num_batched_tokens,
    )
    if res.ceilings.get("matmul_tflops"):
        row["pct_matmul"] = 100 * row["tflops"] / res.ceilings["matmul_tflops"]
    res.prefill.append(row)
    log.info("prefill %s", json.dumps(row))


def _generate(
    engine: LLMEngine, tag: str, batch: int, prompt_len: int, new: int, seed: int
) -> dict[str, Any]:
    """``batch`` random prompts added at once and stepped to completion; per-step times."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=new, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", rng.integers(0, engine.vocab_size, prompt_len).tolist(), params)
    graphs = engine.runner.graphs
    replays_before = sum(graphs.replays.values()) if graphs else 0
    steps: list[float] = []
    generated = 0
    t = time.perf_counter()
    while engine.has_unfinished():
        s0 = time.perf_counter()
        generated += sum(len(o.new_token_ids) for o in engine.step())
        steps.append(time.perf_counter() - s0)
    seconds = time.perf_counter() - t
    return dict(
        seconds=seconds,
        generated=generated,
        steps=len(steps),
        graph_replays=(sum(graphs.replays.values()) if graphs else 0) - replays_before,
        median_step_ms=statistics.median(steps) * 1e3,
        slowest_steps_ms=sorted((round(x * 1e3, 1), i) for i, x in enumerate(steps))[-3:],
    )


def e2e_point(engine: LLMEngine, name: str, batch: int, plan: Plan, res: Results) -> None:
    """Our engine on transformers' workload: ``batch`` prompts at once, prefill included.

    A short run of the same shape goes first: the first prefill of a new shape class JIT-compiles Triton
    variants (seen: 3 to 4.5 s in one step, 2026-11-29), which a served engine pays once, not per request.
    """
    warm = _generate(engine, f"{name}-e2e{batch}-warm", batch, plan.e2e_prompt, 2, seed=batch + 99)
    run = _generate(engine, f"{name}-e2e{batch}", batch, plan.e2e_prompt, plan.e2e_new, seed=batch + 5)
    log.info("e2e %s batch %d: warm-up %s; timed %s", name, batch, json.dumps(warm), json.dumps(run))
    row = dict(
        model=name,
        engine="pdmesh",
        batch=batch,
        prompt=plan.e2e_prompt,
        new=plan.e2e_new,
        seconds=run["seconds"],
        tok_s=run["generated"] / run["seconds"],
        warmup_seconds=warm["seconds"],
    )
    res.e2e.append(row)
    log.info("e2e %s", json.dumps(row))


class CompileLog:
    """Triton JIT compiles as they happen (the runtime's pre- and post-compile hooks): kernel and seconds.
    A compile inside a served step is what a request waits for; the serve rows count them."""

    def __init__(self) -> None:
        self.compiles: list[tuple[str, float]] = []
        self._started = 0.0

    def install(self) -> None:
        import triton

        triton.knobs.runtime.jit_cache_hook = self._before
        triton.knobs.runtime.jit_post_compile_hook = self._after

    def _before(self, **kwargs: Any) -> None:
        self._started = time.perf_counter()

    def _after(self, *, fn: Any, **kwargs: Any) -> None:
        seconds = time.perf_counter() - self._started
        self.compiles.append((fn.name, seconds))
        log.info("triton compile: %s, %.2f s", fn.name, seconds)


COMPILES = CompileLog()


# Per mode: asynchronous scheduling, new prompts joining the lookahead step, late launch. "on-early"
# launches each step as soon as the loop comes round (as before 2026-11-30 06:00 UTC); "on-drain" also
# has waiting prompts drain the step in flight (as before they could join it).
SERVE_MODES = {
    "off": (False, False, False),
    "on": (True, True, True),
    "on-early": (True, True, False),
    "on-drain": (True, False, False),
}


def serve_point(engine: LLMEngine, name: str, rate: float, mode: str, plan: Plan, res: Results) -> None:
    """Requests arriving one by one (Poisson, ``rate`` per second), each a ``plan.e2e_prompt``-token prompt
    and ``plan.e2e_new`` new tokens, stepped as a worker's loop steps: TTFT (arrival to the step that
    returns the first token), TPOT and throughput, in one of ``SERVE_MODES``.

    Arrivals and prompts depend on the rate alone, so every mode serves the same work. The mode is
    switched on the same engine between runs, with nothing in flight (the engine reads it every step), and
    the prefix cache is emptied first: otherwise only the first mode at a rate would prefill its prompts and
    the later ones would find them cached (as the rows before 2026-11-30 04:25 UTC did).
    """
    async_on, join_prompts, late = SERVE_MODES[mode]
    engine.config.async_scheduling = async_on
    engine.config.lookahead_late_launch = late
    engine.lookahead_join_prompts = join_prompts
    engine.reset_prefix_cache()
    rng = np.random.default_rng(int(rate * 1000))
    n = plan.serve_requests
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    prompts = [rng.integers(0, engine.vocab_size, plan.e2e_prompt).tolist() for _ in range(n)]
    params = SamplingParams(max_tokens=plan.e2e_new, temperature=0.0, ignore_eos=True)
    tag = f"{name}-serve{rate:g}-{mode}"
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    counts = [0] * n
    before = (
        engine.lookahead_steps,
        engine.lookahead_drains,
        engine.lookahead_joins,
        engine.lookahead_late_waits,
    )
    compiles_before = len(COMPILES.compiles)
    steps = 0
    t0 = time.perf_counter()
    added = 0
    while added < n or engine.has_unfinished():
        engine.wait_for_lookahead_point()  # as the worker's loop (engine.async_engine) does
        now = time.perf_counter() - t0
        while added < n and arrivals[added] <= now:
            engine.add_request(f"{tag}-{added}", prompts[added], params)
            added += 1
        if not engine.has_unfinished():
            time.sleep(max(0.0, arrivals[added] - (time.perf_counter() - t0)))
            continue
        outs = engine.step()
        steps += 1
        t = time.perf_counter() - t0
        for o in outs:
            if o.new_token_ids:
                i = int(o.request_id.rsplit("-", 1)[1])
                first.setdefault(i, t)
                last[i] = t
                counts[i] += len(o.new_token_ids)
    makespan = time.perf_counter() - t0
    if sorted(counts) != [plan.e2e_new] * n:
        raise RuntimeError(f"serve {tag}: token counts {sorted(set(counts))}, expected {plan.e2e_new} each")
    ttft = [1e3 * (first[i] - arrivals[i]) for i in range(n)]
    tpot = [1e3 * (last[i] - first[i]) / (counts[i] - 1) for i in range(n)]
    row = dict(
        model=name,
        rate=rate,
        async_scheduling=async_on,
        mode=mode,
        requests=n,
        ttft_p50_ms=percentile(ttft, 50),
        ttft_p99_ms=percentile(ttft, 99),
        tpot_p50_ms=percentile(tpot, 50),
        tpot_p99_ms=percentile(tpot, 99),
        tok_s=sum(counts) / makespan,
        steps=steps,
        lookahead_steps=engine.lookahead_steps - before[0],
        lookahead_drains=engine.lookahead_drains - before[1],
        lookahead_joins=engine.lookahead_joins - before[2],
        lookahead_late_waits=engine.lookahead_late_waits - before[3],
        compiles=len(COMPILES.compiles) - compiles_before,  # Triton JIT compiles during the run
        compile_s=sum(t for _, t in COMPILES.compiles[compiles_before:]),
    )
    res.serve.append(row)
    log.info("serve %s", json.dumps(row))


def release_memory(plan: Plan) -> None:
    """Give what the last engine or model held back to the device, once the frame that ran it has returned:
    until then its locals (the graphs, megakernel builds, outputs) keep the weights and the KV pool alive,
    and the next shape's KV pool, sized from the device's free memory, would come out too small."""
    gc.collect()
    if plan.device == "cuda":
        torch.cuda.empty_cache()
        log.info("device memory free after release: %.1f GiB", torch.cuda.mem_get_info()[0] / 2**30)


def run_engine_sections(shape: str, plan: Plan, res: Results, sections: set[str], profile: bool) -> None:
    label, raw = SHAPES[shape]
    model_dir = write_config(raw, plan.smoke)
    from engine.loader import resolve_model_config

    mcfg, _ = resolve_model_config(str(model_dir))
    itemsize = 2 if plan.dtype != "float32" else 4
    fp8_weights = 1 + 4 / 128**2 if plan.quantization == "fp8" else None  # a byte, a scale per block
    wb = count_weights(mcfg, itemsize, 1 if plan.kv_cache_dtype != "auto" else None, fp8_weights)
    block_bytes = wb.kv_bytes_per_token * 16
    fits = {(b, c): blocks_needed(b, c, plan) for b in plan.batches for c in plan.contexts}
    # Every weight in memory: what steps read, all experts, and the input embedding (a step reads a row).
    weights_bytes = (
        wb.per_step_dense
        + wb.moe_layers * wb.num_experts * wb.per_expert
        + mcfg.vocab_size * mcfg.hidden_size * itemsize
    )
    if plan.device == "cuda":
        free, _ = torch.cuda.mem_get_info()
        budget = int((free * plan.gpu_mem_fraction - weights_bytes) // block_bytes)
    else:
        budget = 4096
    # The pool holds the largest decode point that fits in memory (bigger ones are skipped), two prefill
    # prompts, and the largest generate batch.
    want = [n for n in fits.values() if n <= budget] + [2 * blocks_needed(1, plan.prefill_len, plan)]
    want += [b * -(-(plan.e2e_prompt + plan.e2e_new) // 16) for b in plan.e2e_batches]
    num_blocks = max(64, min(max(want), budget))
    log.info(
        "%s: %.2f GB of weights, %d KV blocks of %.2f MiB",
        label,
        weights_bytes / 1e9,
        num_blocks,
        block_bytes / 2**20,
    )
    engine = build_engine(model_dir, plan, num_blocks)
    try:
        if "decode" in sections:
            for ctx in plan.contexts:
                for batch in plan.batches:
                    if fits[(batch, ctx)] > num_blocks:
                        log.info(
                            "decode %s batch %d ctx %d: needs %d KV blocks, the pool has %d: skipped",
                            shape,
                            batch,
                            ctx,
                            fits[(batch, ctx)],
                            num_blocks,
                        )
                        res.decode.append(dict(model=shape, batch=batch, ctx=ctx, skipped="KV does not fit"))
                        continue
                    megakernel = engine.runner.megakernel
                    variants = [(shape, megakernel)]
                    if plan.megakernel_compare and batch == 1 and megakernel is not None:
                        variants.append((f"{shape}-ops", None))  # the op-by-op graph, same engine
                    timed = []  # (label, timing build)
                    if megakernel is not None and batch == 1:
                        from kernels.decode_megakernel import DecodeMegakernel

                        if plan.megakernel_timing:
                            build = DecodeMegakernel(engine.model, engine.kv_pool, timing=True)
                            timed.append((f"{shape}-timed", build))
                            variants.append((f"{shape}-timed", build))
                        for label, switches, with_timing in plan.megakernel_variants:
                            build = DecodeMegakernel(engine.model, engine.kv_pool, switches=switches)
                            variants.append((f"{shape}-mk-{label}", build))
                            if with_timing:
                                build = DecodeMegakernel(
                                    engine.model, engine.kv_pool, timing=True, switches=switches
                                )
                                timed.append((f"{shape}-mk-{label}-timed", build))
                                variants.append((f"{shape}-mk-{label}-timed", build))
                    for name, mk in variants:
                        graphs = engine.runner.graphs
                        if graphs is not None and graphs.megakernel is not mk:
                            graphs.set_megakernel(mk)
                        try:
                            decode_point(
                                engine,
                                name,
                                batch,
                                ctx,
                                plan,
                                wb,
                                res,
                                profile=profile and ctx == plan.contexts[0] and batch in (1, 4, 16, 64),
                            )
                        except Exception as exc:
                            log.exception("decode %s batch %d ctx %d failed", name, batch, ctx)
                            res.errors.append(f"decode {name} b{batch} c{ctx}: {exc!r}")
                    for label, build in timed:
                        phases = build.phase_cycles()
                        skew = build.phase_skew(build.plan.layers // 2)
                        res.megakernel_phases.append(dict(model=label, ctx=ctx, cycles=phases, skew=skew))
                        log.info(
                            "megakernel phases, %s ctx %d (SM cycles): %s", label, ctx, json.dumps(phases)
                        )
                        log.info("megakernel skew, %s ctx %d (us: min, median, max over CTAs): %s", label, ctx,
                                 json.dumps(skew))  # fmt: skip
                    for name, build in variants[1:]:
                        if build is not None and build.error():
                            res.errors.append(f"decode megakernel {name} error word {build.error()}")
                    if engine.runner.graphs is not None and engine.runner.graphs.megakernel is not megakernel:
                        engine.runner.graphs.set_megakernel(megakernel)
                    if megakernel is not None and megakernel.error():
                        res.errors.append(f"decode megakernel error word {megakernel.error()}")
        if "prefill" in sections and shape == "dense":
            prefill_point(engine, shape, plan, wb, res)
        if "e2e" in sections:
            for batch in plan.e2e_batches:
                e2e_point(engine, shape, batch, plan, res)
        if "serve" in sections:
            setting, join_prompts = engine.config.async_scheduling, engine.lookahead_join_prompts
            late = engine.config.lookahead_late_launch
            try:
                for rate in plan.serve_rates:
                    for mode in plan.serve_modes:
                        serve_point(engine, shape, rate, mode, plan, res)
            finally:
                engine.config.async_scheduling = setting
                engine.config.lookahead_late_launch = late
                engine.lookahead_join_prompts = join_prompts
    finally:
        engine.close()  # its CUDA graphs now; the rest once this frame's locals (graphs, builds) are gone


# ---- transformers ------------------------------------------------------------------------------
def run_hf(shape: str, plan: Plan, res: Results) -> None:
    import transformers

    _, raw = SHAPES[shape]
    raw = dict(raw)
    if plan.smoke:
        raw.update({k: v for k, v in SMOKE_OVERRIDES.items() if k in raw})
    model_type = raw.pop("model_type")
    raw.pop("architectures")
    cfg = transformers.AutoConfig.for_model(model_type, **raw)
    dtype = torch.bfloat16 if plan.dtype == "bfloat16" else torch.float32
    t = time.perf_counter()
    with torch.device(plan.device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    log.info(
        "transformers %s %s built in %.1f s",
        transformers.__version__,
        type(model).__name__,
        time.perf_counter() - t,
    )
    gen = torch.Generator(device=plan.device).manual_seed(0)

    def generate(batch: int, new: int) -> float:
        ids = torch.randint(0, cfg.vocab_size, (batch, plan.e2e_prompt), device=plan.device, generator=gen)
        _sync(plan.device)
        t = time.perf_counter()
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        _sync(plan.device)
        assert out.shape[1] == plan.e2e_prompt + new, out.shape
        return time.perf_counter() - t

    for batch in plan.e2e_batches:
        generate(batch, 2)  # the same warm-up per batch shape as pdmesh's (e2e_point)
        seconds = generate(batch, plan.e2e_new)
        row = dict(
            model=shape,
            engine=f"transformers {transformers.__version__}",
            batch=batch,
            prompt=plan.e2e_prompt,
            new=plan.e2e_new,
            seconds=seconds,
            tok_s=batch * plan.e2e_new / seconds,
        )
        res.hf.append(row)
        log.info("hf %s", json.dumps(row))


# ---- report ------------------------------------------------------------------------------------
def _f(x: Any, fmt: str = ".1f") -> str:
    if x is None or (isinstance(x, float) and x != x):
        return "-"
    return format(x, fmt)


def sampling_label(plan: Plan) -> str:
    return ", ".join(f"{k} {v:g}" for k, v in plan.decode_sampling.items()) or "greedy"


# The SamplingParams fields ``--decode-sampling`` may set, with their types (the decode section sets
# max_tokens and ignore_eos itself).
SAMPLING_FIELDS = {"temperature": float, "top_p": float, "top_k": int, "min_p": float, "seed": int}


def parse_megakernel_variants(text: str) -> tuple[tuple[str, dict[str, int], bool], ...]:
    """'label[+t]:NAME=V,NAME=V;...' -> ((label, {NAME: V}, timing), ...); names from ``SWITCHES``."""
    from kernels.decode_megakernel import SWITCHES

    out = []
    for part in filter(None, (p.strip() for p in text.split(";"))):
        label, _, pairs = part.partition(":")
        timing = label.endswith("+t")
        label = label.removesuffix("+t")
        switches: dict[str, int] = {}
        for pair in filter(None, pairs.split(",")):
            name, _, value = pair.partition("=")
            if name not in SWITCHES or not value.lstrip("-").isdigit():
                raise argparse.ArgumentTypeError(
                    f"{pair!r}: expected NAME=integer, NAME one of {sorted(SWITCHES)}"
                )
            switches[name] = int(value)
        if not label:
            raise argparse.ArgumentTypeError(f"{part!r}: a variant needs a label")
        out.append((label, switches, timing))
    return tuple(out)


def parse_sampling(text: str) -> dict[str, float]:
    """``temperature=0.8,top_p=0.9`` -> SamplingParams fields (numbers)."""
    out: dict[str, float] = {}
    for item in filter(None, text.split(",")):
        key, _, value = item.partition("=")
        try:
            out[key] = SAMPLING_FIELDS[key](value)
        except (KeyError, ValueError):
            raise argparse.ArgumentTypeError(
                f"not one of {', '.join(SAMPLING_FIELDS)} with a number: {item!r}"
            ) from None
    return out


def summary(res: Results, plan: Plan) -> str:
    lines = []
    c = res.ceilings
    if c:
        lines.append(
            f"ceilings: copy {c['hbm_gbps']:.0f} GB/s (read+write), bf16 matmul 8192^3 "
            f"{c['matmul_tflops']:.0f} TFLOP/s"
        )
    if res.decode:
        lines += [
            "",
            "decode (engine.step: scheduler + graph replay + sampler; graph = replay alone, device time; "
            f"sampling: {sampling_label(plan)}; KV cache: {plan.kv_cache_dtype}; weights: {plan.quantization})",
            "| model | batch | ctx | step ms | graph ms | tok/s | experts/layer | GB moved | roofline ms "
            "| % roofline (step) | % roofline (graph) | runner ms | launch ms | sampler ms |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in res.decode:
            if "skipped" in r:
                lines.append(
                    f"| {r['model']} | {r['batch']} | {r['ctx']} | {r['skipped']} | | | | | | | | | |"
                )
                continue
            lines.append(
                f"| {r['model']} | {r['batch']} | {r['ctx']} | {_f(r['step_ms'], '.2f')} | {_f(r['replay_ms'], '.2f')} "
                f"| {_f(r['tok_s'], '.0f')} | {_f(r['experts_per_layer'])} | {_f(r['weight_gb'] + r['kv_gb'], '.2f')} "
                f"| {_f(r.get('roofline_ms'), '.2f')} | {_f(r.get('pct_roofline'), '.0f')} "
                f"| {_f(r.get('pct_roofline_graph'), '.0f')} | {_f(r['runner_ms'], '.2f')} "
                f"| {_f(r['launch_ms'], '.2f')} | {_f(r['sampler_ms'], '.2f')} |"
            )
        lines.append(
            "(runner ms: host time in the runner per step, launches included; sampler ms: with synchronous "
            "steps it includes waiting for the step's device work, about the graph time; with asynchronous "
            "scheduling it is host time only)"
        )
    for ph in res.megakernel_phases:
        lines += ["", f"megakernel phases, {ph['model']} ctx {ph['ctx']}: SM cycles per layer, CTA 0 / mean"]
        lines.append(" | ".join(f"{k} {v['cta0']:.0f}/{v['mean']:.0f}" for k, v in ph["cycles"].items()))
        if "skew" in ph:
            lines.append("skew (us after the first CTA's layer start; min/median/max over CTAs): " + " | ".join(
                f"{k} " + "/".join(f"{x:.1f}" for x in v) for k, v in ph["skew"].items()
            ))  # fmt: skip
    if res.prefill:
        lines += [
            "",
            "prefill (dense, 4096-token prompts)",
            "| model | tokens/s | TFLOP/s | % matmul rate | attention share of FLOPs |",
            "|---|---:|---:|---:|---:|",
        ]
        for r in res.prefill:
            lines.append(
                f"| {r['model']} | {r['tok_s']:.0f} | {r['tflops']:.0f} | {_f(r.get('pct_matmul'), '.0f')} "
                f"| {100 * r['attention_share']:.0f}% |"
            )
    if res.e2e or res.hf:
        lines += [
            "",
            f"generate: {plan.e2e_prompt}-token prompts, {plan.e2e_new} new tokens, all at once (prefill included)",
            "| model | batch | pdmesh tok/s | transformers tok/s | speed-up |",
            "|---|---:|---:|---:|---:|",
        ]
        for shape in SHAPES:
            for b in plan.e2e_batches:
                ours = next((r["tok_s"] for r in res.e2e if r["model"] == shape and r["batch"] == b), None)
                hf = next((r["tok_s"] for r in res.hf if r["model"] == shape and r["batch"] == b), None)
                if ours is None and hf is None:
                    continue
                ratio = ours / hf if ours and hf else None
                lines.append(f"| {shape} | {b} | {_f(ours, '.0f')} | {_f(hf, '.1f')} | {_f(ratio, '.1f')}x |")
    if res.serve:
        lines += [
            "",
            f"serve: {plan.serve_requests} requests arriving (Poisson), {plan.e2e_prompt}-token prompts, "
            f"{plan.e2e_new} new tokens; asynchronous scheduling off, on (each step launched at the last "
            "graph piece of the one in flight), on-early (launched at once), on-drain (at once, and new "
            "prompts drain the step in flight)",
            "| model | req/s | async | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | TPOT p99 ms | tok/s | steps "
            "| lookahead steps | drains | joins | late waits | JIT compiles (s) |",
            "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for r in res.serve:
            lines.append(
                f"| {r['model']} | {r['rate']:g} | {r['mode']} "
                f"| {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | {r['tpot_p50_ms']:.2f} "
                f"| {r['tpot_p99_ms']:.2f} | {r['tok_s']:.0f} | {r['steps']} | {r['lookahead_steps']} "
                f"| {r['lookahead_drains']} | {r['lookahead_joins']} | {r['lookahead_late_waits']} "
                f"| {r['compiles']} ({r['compile_s']:.1f}) |"
            )
    lines += ["", "targets:"]
    for shape in SHAPES:
        r = next(
            (
                r
                for r in res.decode
                if r["model"] == shape and r["batch"] == 1 and r["ctx"] == 512 and "pct_roofline" in r
            ),
            None,
        )
        if r:
            lines.append(
                f"  decode batch 1 {shape} >= 80% of roofline: {r['pct_roofline']:.0f}% "
                f"({r['tok_s']:.0f} of {r['roofline_tok_s']:.0f} tok/s) -> {'MET' if r['pct_roofline'] >= 80 else 'NOT MET'}"
            )
    r = next(
        (
            r
            for r in res.decode
            if r["model"] == "moe" and r["batch"] == 64 and r["ctx"] == 512 and "pct_roofline" in r
        ),
        None,
    )
    if r:
        lines.append(
            f"  decode batch 64 moe >= 70% of roofline: {r['pct_roofline']:.0f}% -> "
            f"{'MET' if r['pct_roofline'] >= 70 else 'NOT MET'}"
        )
    r = next((r for r in res.prefill if "pct_matmul" in r), None)
    if r:
        lines.append(
            f"  4k prefill dense >= 50% of matmul rate: {r['pct_matmul']:.0f}% -> "
            f"{'MET' if r['pct_matmul'] >= 50 else 'NOT MET'}"
        )
    if res.errors:
        lines += ["", "errors:"] + [f"  {e}" for e in res.errors]
    return "\n".join(lines)


def environment(plan: Plan) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "pdl": triton_device.pdl_kwargs(torch.device(plan.device))["USE_PDL"],  # in effect, not requested
        "async_scheduling": EngineConfig(
            device=plan.device, async_scheduling=plan.async_scheduling
        ).async_scheduling,
        "kv_cache_dtype": plan.kv_cache_dtype,
        "quantization": plan.quantization,
    }
    try:
        import transformers
        import triton

        env.update(triton=triton.__version__, transformers=transformers.__version__)
    except ImportError:
        pass
    if plan.device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(gpu=p.name, sms=p.multi_processor_count, memory_gib=round(p.total_memory / 2**30, 1))
    return env


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sections",
        default="ceilings,decode,prefill,e2e,hf",
        help="comma-separated: ceilings, decode, prefill, e2e, serve, hf",
    )
    parser.add_argument("--shapes", default="dense,moe")
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument(
        "--profile", action="store_true", help="log per-kernel device time of some decode graphs"
    )
    parser.add_argument(
        "--no-pdl",
        action="store_true",
        help="launch the Triton kernels without programmatic dependent launch",
    )
    parser.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="engines overlap each step's host work with the next decode step (EngineConfig.async_scheduling; "
        "unset: the engine's default, on for CUDA)",
    )
    parser.add_argument(
        "--serve-modes",
        default=",".join(Plan.serve_modes),
        help="comma-separated serve modes: off, on (asynchronous scheduling, each step launched once the "
        "one in flight reaches its last graph piece), on-early (each step launched at once), on-drain "
        "(on-early, with new prompts draining the step in flight as before they could join it)",
    )
    parser.add_argument(
        "--decode-sampling",
        type=parse_sampling,
        default={},
        help="the decode section samples with these SamplingParams fields, e.g. temperature=0.8,top_p=0.9 "
        "(default: greedy)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        default="auto",
        choices=("auto", "fp8", "fp8_e5m2"),
        help="the engines' KV cache dtype (EngineConfig.kv_cache_dtype); fp8 halves the KV bytes a decode "
        "step reads, and its roofline counts them so",
    )
    parser.add_argument(
        "--quantization",
        default="auto",
        choices=("auto", "fp8"),
        help="the engines' weight quantization (EngineConfig.quantization); fp8 keeps the attention, MLP and "
        "expert weights in float8 (128 x 128 scale blocks), and the roofline counts them at a byte",
    )
    parser.add_argument(
        "--megakernel", action="store_true", help="the engines with the batch-1 decode megakernel"
    )
    parser.add_argument(
        "--megakernel-compare",
        action="store_true",
        help="batch-1 decode points also without the megakernel (the batch-1 graph captured again)",
    )
    parser.add_argument(
        "--megakernel-timing",
        action="store_true",
        help="batch-1 decode points also with a timing build of the megakernel (per-phase SM cycles)",
    )
    parser.add_argument(
        "--megakernel-variants",
        type=parse_megakernel_variants,
        default=(),
        help="batch-1 decode points also with megakernel builds of other switches, e.g. "
        "'two:TPS=2;all+t:TPS=0' (label, '+t' for a timing build too, then SWITCH=value pairs; "
        "kernels.decode_megakernel.SWITCHES)",
    )
    parser.add_argument("--smoke", action="store_true", help="small shapes on the CPU: checks the plumbing")
    parser.add_argument("--out", default=os.environ.get("OUT") or "gpu_bench_out")
    args = parser.parse_args(argv)
    out = setup_output(args.out, "gpu_bench.log")
    plan = Plan(
        batches=tuple(int(x) for x in args.batches.split(",")),
        contexts=tuple(int(x) for x in args.contexts.split(",")),
    )
    if args.smoke:
        plan = Plan(
            device="cpu",
            dtype="float32",
            backend="torch",
            batches=(1, 4),
            contexts=(32, 64),
            warmup_steps=1,
            timed_steps=3,
            prefill_len=64,
            prefill_prompts=2,
            max_num_batched_tokens=256,
            max_model_len=512,
            e2e_batches=(1, 2),
            serve_rates=(50.0,),
            serve_requests=4,
            e2e_prompt=16,
            e2e_new=4,
            smoke=True,
        )
    modes = tuple(args.serve_modes.split(","))
    if not set(modes) <= SERVE_MODES.keys():
        parser.error(f"--serve-modes: each of {', '.join(SERVE_MODES)}")
    plan = dataclasses.replace(
        plan,
        async_scheduling=args.async_scheduling,
        serve_modes=modes,
        decode_sampling=args.decode_sampling,
        kv_cache_dtype=args.kv_cache_dtype,
        quantization=args.quantization,
        megakernel=args.megakernel
        or args.megakernel_compare
        or args.megakernel_timing
        or bool(args.megakernel_variants),
        megakernel_compare=args.megakernel_compare,
        megakernel_timing=args.megakernel_timing,
        megakernel_variants=args.megakernel_variants,
    )
    sections = set(args.sections.split(","))
    triton_device.PDL_ENABLED = not args.no_pdl
    if plan.device == "cuda":
        COMPILES.install()
    res = Results(env=environment(plan))
    log.info("environment %s", json.dumps(res.env))
    if "ceilings" in sections and plan.device == "cuda":
        measure_ceilings(res)
    for shape in args.shapes.split(","):
        if sections & {"decode", "prefill", "e2e", "serve"}:
            try:
                run_engine_sections(shape, plan, res, sections, args.profile)
            except Exception as exc:
                log.exception("engine sections of %s failed", shape)
                res.errors.append(f"engine {shape}: {exc!r}")
            release_memory(plan)
    if "hf" in sections:
        for shape in args.shapes.split(","):
            try:
                run_hf(shape, plan, res)
            except Exception as exc:
                log.exception("transformers %s failed", shape)
                res.errors.append(f"transformers {shape}: {exc!r}")
            release_memory(plan)
    (out / "gpu_bench.json").write_text(json.dumps(asdict(res), indent=1))
    text = summary(res, plan)
    (out / "gpu_bench_summary.md").write_text(text + "\n")
    print(text, flush=True)


if __name__ == "__main__":
    main()
