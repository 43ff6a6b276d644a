"""Time to first token of one prompt on the engine, wall time against device kernel time.

    PYTHONPATH=. python3 benchmarks/prefill_profile.py [--shape moe] [--prompt 512,1024] [--align-max-pairs N,M]
        [--prefill-graphs on,off]

Builds the engine ``gpu_bench.py`` builds (random weights of the Llama-3.1-8B or Qwen3-30B-A3B shape, the
Triton ops, CUDA graphs), then steps single prompts of ``--prompt`` random tokens to their first token: 3
warm-ups, 5 timed (wall time, synchronised), and 3 under the torch profiler, which gives the device time of
their kernels and the busiest kernels. Wall time well above device time means the prefill waits on the
host's launches. ``--align-max-pairs`` overrides ``kernels.triton_moe.ALIGN_KERNEL_MAX_PAIRS`` (up to that
many token-expert pairs the MoE alignment is the single-program Triton kernel, above it the multi-program
one) to compare the two. ``--prefill-graphs on,off`` runs each prompt with the piecewise prefill graphs
(``engine/prefill_graphs.py``, captured up to 2048 tokens) and eagerly. Each flag takes a comma-separated
list; every prompt length runs with every combination, on one engine. Needs a CUDA GPU.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import gpu_bench  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels import triton_moe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="moe", choices=tuple(gpu_bench.SHAPES))
    parser.add_argument("--prompt", default="512", help="prompt lengths, comma-separated")
    parser.add_argument("--align-max-pairs", default=None, help="alignment limits, comma-separated")
    parser.add_argument(
        "--prefill-graphs", default="on", help="on, off or on,off: steps replay the piecewise prefill graphs"
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_profile.py needs a CUDA GPU")
    prompts = [int(p) for p in args.prompt.split(",")]
    limits = [int(n) for n in args.align_max_pairs.split(",")] if args.align_max_pairs else [None]
    plan = gpu_bench.Plan(batches=(1,), contexts=(max(prompts),))
    engine = gpu_bench.build_engine(
        gpu_bench.write_config(gpu_bench.SHAPES[args.shape][1], False), plan, 2048
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    default_limit = triton_moe.ALIGN_KERNEL_MAX_PAIRS
    captured = engine.runner.prefill_graphs
    summary = []
    for prompt in prompts:
        for limit in limits:
            for graphs in args.prefill_graphs.split(","):
                triton_moe.ALIGN_KERNEL_MAX_PAIRS = default_limit if limit is None else limit
                engine.runner.prefill_graphs = captured if graphs == "on" else None
                line = profile_prompt(engine, rng, params, args.shape, prompt)
                summary.append(f"{line}; prefill graphs {graphs if captured else 'not captured'}")
    for line in summary:
        print(line)


def profile_prompt(
    engine: LLMEngine, rng: np.random.Generator, params: SamplingParams, shape: str, prompt: int
) -> str:
    """Steps single prompts of ``prompt`` tokens to their first token (3 warm-ups, 5 timed, 3 profiled);
    prints the busiest kernels and returns the summary line."""
    count = 0

    def prefill() -> None:
        nonlocal count
        count += 1
        engine.add_request(f"p{prompt}-{count}", rng.integers(0, engine.vocab_size, prompt).tolist(), params)
        while engine.has_unfinished():
            engine.step()
        torch.cuda.synchronize()

    for _ in range(3):
        prefill()
    walls = []
    for _ in range(5):
        t = time.perf_counter()
        prefill()
        walls.append((time.perf_counter() - t) * 1e3)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            prefill()
    events = prof.key_averages()
    device_ms = sum(
        e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA
    )
    print(events.table(sort_by="self_device_time_total", row_limit=25, max_name_column_width=60))
    line = (
        f"{shape}, {prompt}-token prompt, single-program alignment up to "
        f"{triton_moe.ALIGN_KERNEL_MAX_PAIRS} pairs: wall ms per prefill {[round(w, 1) for w in walls]}; "
        f"device kernel time per prefill {device_ms / 3 / 1e3:.1f} ms"
    )
    print(line, flush=True)
    return line


if __name__ == "__main__":
    main()
