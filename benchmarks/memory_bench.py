"""What ``gpu_memory_utilization`` gives and whether it holds (engine/memory_profile.py): on one GPU, an
engine at the shape's weights sized by the fraction, its profile, the pool it got, what the CUDA graphs
took, and a burst that fills the pool (prompts whose KV together pass it, at the full step budget) with
the device's memory read throughout.

    python benchmarks/memory_bench.py --shape moe [--utilization 0.9] [--max-num-seqs 256]

Rows: the profile (weights, activation peak, memory outside torch, KV pool, graphs), the pool in tokens,
then the burst: requests, prompt tokens, the KV pool's peak use, preemptions, the device's peak use
(``mem_get_info``, all processes; sampled after every step) against ``utilization x total`` and against
the card. The peer is the budget itself: the engine passes its fraction by at most what its graphs took.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import SamplingParams  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.memory_profile import GIB, DeviceMemory  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("moe", "dense"), required=True)
    ap.add_argument("--utilization", type=float, default=0.9)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--fill", type=float, default=0.95, help="the burst's prompt tokens over the pool's")
    ap.add_argument("--new-tokens", type=int, default=4)
    args = ap.parse_args()
    from benchmarks.gpu_bench import SHAPES, write_config

    device = torch.device("cuda")
    start = DeviceMemory.read(device)
    config = EngineConfig(
        model=str(write_config(SHAPES[args.shape][1], smoke=False)), device="cuda", dtype="bfloat16",
        kernel_backend="triton", load_format="dummy", gpu_memory_utilization=args.utilization,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len, enable_prefix_caching=False,
    )  # fmt: skip
    built = time.perf_counter()
    engine = LLMEngine(config)
    built = time.perf_counter() - built
    profile = engine.memory_profile
    assert profile is not None and engine.graph_memory_bytes is not None
    pool_tokens = engine.block_pool.num_blocks * config.block_size
    print(f"{SHAPES[args.shape][0]}, {torch.cuda.get_device_name(device)}, utilization {args.utilization}, "
          f"engine built in {built:.0f} s")  # fmt: skip
    print(f"  {profile.describe()}")
    print(f"  CUDA graphs {engine.graph_memory_bytes / GIB:.2f} GiB; pool {engine.block_pool.num_blocks} blocks, "
          f"{pool_tokens} tokens")  # fmt: skip

    # The burst: equal prompts of random ids whose KV together passes the pool by --fill.
    prompt_len = args.max_model_len - args.new_tokens - 1
    count = max(1, int(args.fill * pool_tokens / prompt_len))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.vocab_size
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    for i in range(count):
        ids = torch.randint(3, vocab, (prompt_len,), generator=gen).tolist()
        engine.add_request(f"r{i}", ids, params)
    peak_used = start.total - DeviceMemory.read(device).free
    peak_blocks = 0
    finished = 0
    began = time.perf_counter()
    while finished < count:
        outputs = engine.step()
        finished += sum(1 for o in outputs if o.finished)
        stats = engine.stats()
        peak_blocks = max(peak_blocks, stats.num_kv_blocks_total - stats.num_kv_blocks_free)
        free, _ = torch.cuda.mem_get_info(device)
        peak_used = max(peak_used, start.total - free)
    took = time.perf_counter() - began
    stats = engine.stats()
    budget_used = peak_used - (start.total - start.free)  # what this process added since the start
    print(f"  burst: {count} requests of {prompt_len} prompt tokens ({count * prompt_len} tokens, "
          f"{count * prompt_len / pool_tokens:.2f}x the pool) in {took:.1f} s; KV pool peak "
          f"{peak_blocks / engine.block_pool.num_blocks:.1%}; preemptions {stats.num_preemptions}")  # fmt: skip
    print(f"  device peak in use {peak_used / GIB:.2f} GiB of {start.total / GIB:.2f}; this engine "
          f"{budget_used / GIB:.2f} GiB against its budget {profile.budget / GIB:.2f} GiB "
          f"({budget_used / profile.budget:.1%}); graphs aside {(budget_used - engine.graph_memory_bytes) / GIB:.2f} GiB")  # fmt: skip


if __name__ == "__main__":
    main()
