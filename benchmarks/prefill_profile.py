"""Time to first token of one prompt on the engine, wall time against device kernel time.

    PYTHONPATH=. python3 benchmarks/prefill_profile.py [--shape moe] [--prompt 512] [--align-max-pairs N]

Builds the engine ``gpu_bench.py`` builds (random weights of the Llama-3.1-8B or Qwen3-30B-A3B shape, the
Triton ops, CUDA graphs), then steps single prompts of ``--prompt`` random tokens to their first token: 3
warm-ups, 5 timed (wall time, synchronised), and 3 under the torch profiler, which gives the device time of
their kernels and the busiest kernels. Wall time well above device time means the prefill waits on the
host's launches. ``--align-max-pairs`` overrides ``kernels.triton_moe.ALIGN_KERNEL_MAX_PAIRS`` (up to that
many token-expert pairs the MoE alignment is one Triton launch, above it ~30 torch launches) to compare the
two. Needs a CUDA GPU.
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
from engine.sampling_params import SamplingParams  # noqa: E402
from kernels import triton_moe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", default="moe", choices=tuple(gpu_bench.SHAPES))
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--align-max-pairs", type=int, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("prefill_profile.py needs a CUDA GPU")
    if args.align_max_pairs is not None:
        triton_moe.ALIGN_KERNEL_MAX_PAIRS = args.align_max_pairs
    plan = gpu_bench.Plan(batches=(1,), contexts=(args.prompt,))
    engine = gpu_bench.build_engine(
        gpu_bench.write_config(gpu_bench.SHAPES[args.shape][1], False), plan, 2048
    )
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    count = 0

    def prefill() -> None:
        nonlocal count
        count += 1
        engine.add_request(f"p{count}", rng.integers(0, engine.vocab_size, args.prompt).tolist(), params)
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
    print(
        f"{args.shape}, {args.prompt}-token prompt, alignment kernel up to {triton_moe.ALIGN_KERNEL_MAX_PAIRS} "
        f"pairs: wall ms per prefill {[round(w, 1) for w in walls]}; device kernel time per prefill "
        f"{device_ms / 3 / 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
