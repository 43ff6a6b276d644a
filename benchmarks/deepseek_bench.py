"""DeepSeek-V3-architecture decode on one GPU (engine/models/mla.py): a Moonlight-16B-A3B-shaped model
(``DeepseekV3ForCausalLM``: latent attention without a query rank, 64 routed experts of which 6, 2 shared,
a dense first layer) with random weights, against transformers' ``generate()`` on the same shapes, side by
side in one run, with the roofline of each batch's decode step.

    python benchmarks/deepseek_bench.py [--batches 1,16] [--prompt 512] [--new 64]
    python benchmarks/deepseek_bench.py --smoke          # small shapes, on the CPU

Decode tok/s: ``batch x new`` tokens over the time of a ``new``-token generation less that of a one-token
one (the prompts' prefill, one step for the whole batch, as transformers' is), medians of ``--repeats``;
prefill tok/s: the batch's prompt tokens over that one-token generation's time (the engine's). The engine
runs the Triton ops (``kernels/triton_mla.py`` for the latent attention and the grouped routing) and its
decode CUDA graphs. ``--profile`` logs the kernel
timeline of the batch-1 decode graph (``gpu_bench.kernel_timeline``: each kernel's marginal time along the
chain). Roofline: the bytes a decode step must read (the weights of the attention, the dense and shared
MLPs, the routed experts the batch activates at most (every one once a batch chooses them all), the LM head,
and each sequence's latent KV) over the measured copy bandwidth.
"""

from __future__ import annotations

import argparse
import functools
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

from engine import LLM, SamplingParams  # noqa: E402

# moonshotai/Moonlight-16B-A3B's config.json, as published (the fields the model reads).
MOONLIGHT = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "vocab_size": 163840,
    "hidden_size": 2048,
    "intermediate_size": 11264,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "topk_method": "noaux_tc",
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 6,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 50000.0,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
}
SMOKE = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
             num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
             num_experts_per_tok=2, kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16,
             bos_token_id=1, eos_token_id=2)  # fmt: skip


def step_bytes(cfg: dict, batch: int, context: int, weight_bytes: int = 2, kv_bytes: int = 2) -> float:
    """What one decode step must read: every weight a step uses once, the routed experts' of at most
    ``batch x k`` distinct experts a layer, and the batch's latent KV (``kv_bytes`` a value: 1 in a float8
    pool). ``weight_bytes``: 1 for float8 projections (``--quantization fp8``; their scales, one float a
    128 x 128 block, are left out); kv_b_proj (absorbed), the router (float32), embeddings and LM head stay
    as they are."""
    h, heads, layers = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_hidden_layers"]
    nope, rope, v, rank = (
        cfg["qk_nope_head_dim"],
        cfg["qk_rope_head_dim"],
        cfg["v_head_dim"],
        cfg["kv_lora_rank"],
    )
    attn = (h * heads * (nope + rope) + h * (rank + rope) + heads * v * h) * weight_bytes
    attn += rank * heads * (nope + v) * 2  # kv_b_proj
    dense = 3 * h * cfg["intermediate_size"] * weight_bytes
    expert = 3 * h * cfg["moe_intermediate_size"] * weight_bytes
    moe_layers = layers - cfg["first_k_dense_replace"]
    active = min(cfg["n_routed_experts"], batch * cfg["num_experts_per_tok"])
    moe = (cfg["n_shared_experts"] + active) * expert + cfg["n_routed_experts"] * h * 4  # the router: float32
    weights = (
        layers * attn + cfg["first_k_dense_replace"] * dense + moe_layers * moe + cfg["vocab_size"] * h * 2
    )
    kv = batch * context * layers * (rank + rope) * kv_bytes
    return weights + kv


def copy_gbps() -> float:
    x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (time.perf_counter() - start) / 1e9


def decode_rate(run, batch: int, new: int, repeats: int) -> tuple[float, float]:
    """(decode tok/s, prefill seconds): ``run(n)`` generates n tokens for the batch."""
    run(2)  # warm-up
    one, full = [], []
    for _ in range(repeats):
        for n, times in ((1, one), (new + 1, full)):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            start = time.perf_counter()
            run(n)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
    decode = statistics.median(full) - statistics.median(one)
    return batch * new / decode, statistics.median(one)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--quantization",
        default="none",
        choices=["none", "fp8"],
        help="fp8: float8 e4m3 weights, 128 x 128 blocks",
    )
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument(
        "--profile", action="store_true", help="log the kernel timeline of the batch-1 decode graph (GPU)"
    )
    args = ap.parse_args()
    cfg = dict(MOONLIGHT, **(SMOKE if args.smoke else {}))
    gpu = torch.cuda.is_available() and not args.smoke
    device, dtype = ("cuda", torch.bfloat16) if gpu else ("cpu", torch.float32)
    path = Path(tempfile.mkdtemp(prefix="pdmesh-ds-"))
    (path / "config.json").write_text(json.dumps(cfg))
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    prompts = {
        b: [[rng.randrange(3, cfg["vocab_size"]) for _ in range(args.prompt)] for _ in range(b)]
        for b in batches
    }
    llm = LLM(str(path), load_format="dummy", device=device, dtype="bfloat16" if gpu else "float32",
              kernel_backend="triton" if gpu else "torch", max_num_seqs=max(batches), enable_prefix_caching=False, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype,
              max_num_batched_tokens=max(batches) * args.prompt,  # every prompt in one step: then decode alone
              max_model_len=args.prompt + args.new + 16, num_kv_blocks=max(batches) * (-(-(args.prompt + args.new + 16) // 16)) + 8)  # fmt: skip
    graphs = llm.engine.runner.graphs is not None
    engine_rates = {}
    for b in batches:

        def run(n: int, b: int = b, llm: LLM = llm) -> None:
            llm.generate(prompts[b], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

        engine_rates[b] = decode_rate(run, b, args.new, args.repeats)
        if args.profile and graphs and b == 1:
            from benchmarks.gpu_bench import kernel_timeline

            runner_graphs = llm.engine.runner.graphs
            bucket = runner_graphs.bucket_for(1)
            print(f"kernel timeline of the batch-1 decode graph (bucket {bucket}):")
            print(kernel_timeline(functools.partial(runner_graphs.replay, bucket)), flush=True)
    replays = sum(llm.engine.runner.graphs.replays.values()) if graphs else 0
    del llm
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    hf_rates: dict[int, tuple[float, float]] = {}
    if not args.skip_hf:
        import transformers

        raw = {k: v for k, v in cfg.items() if k not in ("architectures", "model_type")}
        hf_cfg = transformers.AutoConfig.for_model("deepseek_v3", **raw)
        with torch.device(device):
            model = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype).eval()
        for b in batches:
            ids = torch.tensor(prompts[b], device=device)

            def run(n: int, ids: torch.Tensor = ids) -> None:
                with torch.no_grad():
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                   do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip

            hf_rates[b] = decode_rate(run, b, args.new, args.repeats)
        del model
    bandwidth = copy_gbps() if gpu else 0.0
    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"Moonlight-16B-A3B shape (DeepseekV3ForCausalLM){' (smoke)' if args.smoke else ''} on {name}: "
          f"{args.quantization} weights, {args.kv_cache_dtype} KV, {args.prompt}-token prompts, {args.new} new tokens, decode tok/s, medians of {args.repeats}; "
          f"engine decode graphs: {graphs} ({replays} replays); copy bandwidth {bandwidth:.0f} GB/s")  # fmt: skip
    print(
        f"{'batch':>5} {'pdmesh':>10} {'transformers':>13} {'ratio':>7} {'roofline':>10} {'of roofline':>12}"
        f" {'prefill tok/s':>14}"
    )
    for b in batches:
        rate = engine_rates[b][0]
        hf = hf_rates.get(b, (0.0, 0.0))[0]
        ctx = args.prompt + args.new // 2
        weight_bytes = 1 if args.quantization == "fp8" else 2
        kv_bytes = 1 if args.kv_cache_dtype == "fp8" else 2
        roof = b / (step_bytes(cfg, b, ctx, weight_bytes, kv_bytes) / (bandwidth * 1e9)) if bandwidth else 0.0
        prefill = b * args.prompt / engine_rates[b][1]  # the one-token generation: the prompts and a step
        print(f"{b:>5} {rate:>10.1f} {hf:>13.1f} {rate / hf if hf else 0:>6.2f}x {roof:>10.1f} "
              f"{rate / roof if roof else 0:>11.0%} {prefill:>14.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
