"""What serving LoRA adapters costs (engine/lora.py): the same decode batches through an engine without
LoRA, and through one with ``enable_lora`` whose requests run on the base model, on one adapter, and spread
over ``--adapters`` adapters, side by side in one run on one device.

    python benchmarks/lora_bench.py --shape dense [--rank 16] [--adapters 4] [--batches 1,16,64]
    python benchmarks/lora_bench.py --shape dense --smoke        # the plumbing, on the CPU

Random-weight models of gpu_bench.py's shapes (``load_format="dummy"``) and random adapters of every
attention and dense MLP projection (MoE layers: attention only), written here in PEFT's format. Per batch:
decode tokens/s (``generate`` of 256-token random prompts, ``--max-tokens`` new tokens, greedy, medians of
``--repeats``) and the ratio to the engine without LoRA. The peer is that engine; vLLM's punica kernels are
the design this stands beside (docs/performance.md). One engine at a time (two Qwen3-30B-A3B-shaped ones do
not fit an H200 together).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLM, LoRARequest, SamplingParams  # noqa: E402
from engine.lora import module_shape  # noqa: E402
from engine.models.model_config import ModelConfig  # noqa: E402


def write_random_adapter(cfg: ModelConfig, path: Path, rank: int, seed: int) -> Path:
    """A PEFT adapter directory of random A and B for every projection an adapter may take."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(cfg.num_layers):
        moe = bool(cfg.moe_layers and cfg.moe_layers[layer])
        modules = ["q_proj", "k_proj", "v_proj", "o_proj"] + (
            [] if moe else ["gate_proj", "up_proj", "down_proj"]
        )
        for module in modules:
            in_dim, out_dim = module_shape(cfg, module)
            group = "self_attn" if module in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{group}.{module}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_dim, generator=gen) / in_dim**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_dim, rank, generator=gen) * 0.01
    path.mkdir(parents=True, exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"r": rank, "lora_alpha": 2 * rank, "target_modules": modules,
                                                          "peft_type": "LORA"}))  # fmt: skip
    return path


def use_two_kernel_lora(llm: LLM) -> None:
    """Give the engine's LoRA layers kernels/triton_lora.py's two kernels at every batch size (the Triton
    backend takes them up to 16 rows) and capture its graphs again with them."""
    from kernels.triton_lora import lora_apply_triton

    engine = llm.engine
    for layer in engine.lora.layers:
        layer.ops = dataclasses.replace(layer.ops, lora_apply=lora_apply_triton)
    runner = engine.runner
    runner.release_graphs()
    runner.enable_cuda_graphs(engine.config.max_num_seqs, engine.max_model_len)
    runner.enable_prefill_graphs(
        min(engine.config.prefill_graph_tokens, engine.config.max_num_batched_tokens)
    )


def build(model_dir: Path, **kwargs) -> tuple[LLM, str]:
    """An engine and what its construction cost: wall seconds, graph capture seconds, device memory."""
    start = time.perf_counter()
    llm = LLM(str(model_dir), **kwargs)
    seconds = time.perf_counter() - start
    runner = llm.engine.runner
    decode = runner.graphs.capture_seconds if runner.graphs is not None else 0.0
    prefill = runner.prefill_graphs.capture_seconds if runner.prefill_graphs is not None else 0.0
    reserved = torch.cuda.memory_reserved() / 2**30 if torch.cuda.is_available() else 0.0
    return (
        llm,
        f"built in {seconds:.1f} s (graphs: decode {decode:.1f} s, prefill {prefill:.1f} s), {reserved:.1f} GiB reserved",
    )


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams, loras: list, repeats: int) -> float:
    llm.generate(prompts, params, lora_request=loras)  # warm-up: compiles, fills the slots
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=loras)
        times.append(time.perf_counter() - start)
    return sum(len(o.token_ids) for o in outs) / statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("moe", "dense"), default="dense")
    ap.add_argument("--smoke", action="store_true", help="gpu_bench's small shapes, on the CPU")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from benchmarks.gpu_bench import SHAPES, write_config

    model_dir = write_config(SHAPES[args.shape][1], smoke=args.smoke)
    cfg = ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    root = Path(tempfile.mkdtemp(prefix="pdmesh-lora-"))
    adapters = [LoRARequest(f"a{i}", i + 1, str(write_random_adapter(cfg, root / f"a{i}", args.rank, i)))
                for i in range(args.adapters)]  # fmt: skip
    gpu = not args.smoke and torch.cuda.is_available()
    common = dict(device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                  kernel_backend="triton" if gpu else "torch", load_format="dummy", num_kv_blocks=4096,
                  max_num_seqs=max(int(b) for b in args.batches.split(",")), enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(3, cfg.vocab_size) for _ in range(256)] for _ in range(b)] for b in batches}

    plain, built = build(model_dir, **common)
    cost = {"no LoRA": built}
    base = {b: timed(plain, prompts[b], params, [None] * b, args.repeats) for b in batches}
    del plain
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    lora_kwargs = dict(enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank, **common)
    lora, cost["LoRA (first build: compiles)"] = build(model_dir, **lora_kwargs)
    rows = []
    for b in batches:
        no_adapter = timed(lora, prompts[b], params, [None] * b, args.repeats)
        one = timed(lora, prompts[b], params, [adapters[0]] * b, args.repeats)
        spread = timed(
            lora, prompts[b], params, [adapters[i % len(adapters)] for i in range(b)], args.repeats
        )
        rows.append([b, base[b], no_adapter, one, spread])
    if common["kernel_backend"] == "triton":  # the same engine with the two-kernel Triton LoRA op
        use_two_kernel_lora(lora)
        for row in rows:
            b = row[0]
            row.append(timed(lora, prompts[b], params, [adapters[0]] * b, args.repeats))
    if gpu:  # what the graphs without the LoRA ops cost to capture and hold, kernels compiled by now
        for name, specialize in (
            ("LoRA, one graph set", False),
            ("LoRA, graphs with and without LoRA ops", True),
        ):
            del lora
            gc.collect()
            torch.cuda.empty_cache()
            lora, cost[name] = build(model_dir, cudagraph_specialize_lora=specialize, **lora_kwargs)
    device = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"{SHAPES[args.shape][0]}{' (smoke)' if args.smoke else ''} on {device}, rank {args.rank}, "
          f"{args.adapters} slots, {args.max_tokens} new tokens, decode tok/s (ratio to no LoRA)")  # fmt: skip
    print(f"{'batch':>5} {'no LoRA':>10} {'LoRA on, base':>18} {'one adapter':>18} {f'{args.adapters} adapters':>18}"
          f"{'  one, two-kernel op' if len(rows[0]) > 5 else ''}")  # fmt: skip
    for b, plain_rate, *rates in rows:
        cells = " ".join(f"{r:>10.1f} ({r / plain_rate:.2f})" for r in rates)
        print(f"{b:>5} {plain_rate:>10.1f} {cells}")
    for name, line in cost.items():
        print(f"{name}: {line}")


if __name__ == "__main__":
    main()
