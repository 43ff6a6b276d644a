"""Sampler time per decode step: greedy, temperature, top-k, top-p, min-p, seeded, at several batch sizes.

    python benchmarks/sampler_bench.py [--device cuda] [--vocab 128256] [--batches 1,64,256]

Times ``engine.sampler.Sampler.__call__`` on random fp32 logits (what the runner hands it), including the
host side (building the per-row tensors, the token list it returns), median of 20 after 3 warm-ups, with
a device synchronisation around each call. Peers: greedy argmax (the floor for any sampling), and the
previous sampler's temperature path (noise drawn by a CPU generator per row, then copied to the device),
rebuilt here as ``previous_temperature_sample``. On a GPU also the Triton backend's kernel
(``kernels/triton_sampling.py``), and a second table of top-k/top-p settings: the torch sampler (which
sorts the vocabulary) against the Triton sampler (which does not), with the kernel's device time alone.

    python benchmarks/sampler_bench.py --kernel-graphs [--baseline OLD/kernels/triton_sampling.py]

Only the Triton op's device time, from CUDA-graph replays of 10 calls (no host issue time in it), for
each kind of row; ``--baseline`` times another version of the module (a file from another checkout, e.g.
``git archive``) side by side in the same process.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.sampler import Sampler  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

MODES = {
    "greedy": SamplingParams(temperature=0.0),
    "temperature 0.8": SamplingParams(temperature=0.8),
    "temperature 0.8, top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "temperature 0.8, seeded": SamplingParams(temperature=0.8, seed=1234),
}


def previous_temperature_sample(logits: torch.Tensor, temperature: float, gen: torch.Generator) -> list[int]:
    """The sampler before 2026-11-29's change, temperature only: CPU exponential noise per row."""
    probs = torch.softmax(logits / temperature, dim=-1)
    noise = torch.empty(logits.shape, dtype=torch.float32)
    for i in range(logits.shape[0]):
        noise[i].exponential_(generator=gen)
    return (probs / noise.to(logits.device)).argmax(dim=-1).tolist()


def time_call(
    fn: Callable, logits: torch.Tensor, params: list[SamplingParams], device: torch.device
) -> float:
    positions = list(range(logits.shape[0]))
    times = []
    for i in range(23):
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn(logits, params, positions)
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= 3:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


FILTERED = {
    "temperature 0.8, top-k 50": SamplingParams(temperature=0.8, top_k=50),
    "temperature 0.6, top-k 20, top-p 0.95 (Qwen3's)": SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
    "temperature 0.8, top-p 0.9": SamplingParams(temperature=0.8, top_p=0.9),
    "temperature 1.0, top-k 1000, top-p 0.95": SamplingParams(temperature=1.0, top_k=1000, top_p=0.95),
    "temperature 1.0, top-p 0.95, min-p 0.05": SamplingParams(temperature=1.0, top_p=0.95, min_p=0.05),
}


def kernel_device_ms(logits: torch.Tensor, params: SamplingParams) -> float:
    """Time of one ``gumbel_sample_triton`` call between CUDA events (median of 20 after 3 warm-ups), with
    the per-row tensors built once: the kernel without the sampler's host work. With the device idle
    before the call, the events also time the wrapper's issue of it (~0.1 ms of host time), so small
    figures are an upper bound on the kernel's device time."""
    from kernels.triton_sampling import gumbel_sample_triton

    args = row_arguments(logits, params)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        gumbel_sample_triton(*args)
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def row_arguments(logits: torch.Tensor, params: SamplingParams) -> tuple:
    """``gumbel_sample``'s arguments for every row of ``logits`` sampled with ``params``."""
    batch, vocab = logits.shape
    device = logits.device
    temps = torch.full((batch,), params.temperature, device=device)
    keys = torch.arange(batch, dtype=torch.int64, device=device) * 7919
    min_p = torch.full((batch,), params.min_p, device=device) if params.min_p > 0 else None
    filtered = params.top_k > 0 or params.top_p < 1.0
    top_k = torch.full((batch,), params.top_k, device=device) if params.top_k > 0 else None  # as Sampler
    top_p = torch.full((batch,), params.top_p, device=device) if filtered else None
    return logits, temps, keys, min_p, top_k, top_p


KERNEL_ROWS = {
    "temperature 0.8": SamplingParams(temperature=0.8),
    "temperature 0.8, min-p 0.05": SamplingParams(temperature=0.8, min_p=0.05),
    **FILTERED,
}


def op_arguments(batch: int, vocab: int, params: SamplingParams, device: torch.device) -> tuple:
    """``gumbel_sample``'s arguments for ``batch`` rows of ``params`` on random logits x 3."""
    return row_arguments(torch.randn(batch, vocab, device=device) * 3, params)


def graph_device_us(fn: Callable, args: tuple, calls: int = 10) -> float:
    """Device time of one call of ``fn(*args)``, us: a CUDA graph of ``calls`` calls, median of 20 timed
    replays after 3. The graph holds the op's own tensor work (the wrapper's casts, its scratch) too."""
    fn(*args)  # compile
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(*args)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(*args)
    times = []
    for i in range(23):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def load_module(path: str, name: str):  # noqa: ANN201 (a module)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def kernel_graphs(vocab: int, batches: list[int], baseline: str | None) -> None:
    """The Triton op's device time per kind of row and batch, against ``baseline``'s where given."""
    from kernels.triton_sampling import gumbel_sample_triton

    old = load_module(baseline, "baseline_triton_sampling").gumbel_sample_triton if baseline else None
    print(f"# Triton sampling op, device time from CUDA-graph replays, vocab {vocab}")
    print("| batch | rows | this op us | baseline us | baseline / this |")
    print("|---:|---|---:|---:|---:|")
    for batch in batches:
        for name, params in KERNEL_ROWS.items():
            args = op_arguments(batch, vocab, params, torch.device("cuda"))
            # As the sampler calls it: with the host's smallest top-k (a baseline may not take it).
            op = functools.partial(gumbel_sample_triton, smallest_top_k=params.top_k or None)
            new_us = graph_device_us(op, args)
            if old is not None:
                old_us = graph_device_us(old, args)
                assert torch.equal(old(*args), op(*args)), f"tokens differ: {batch}, {name}"
                cells = f"{old_us:.1f} | {old_us / new_us:.2f}x"
            else:
                cells = "- | -"
            print(f"| {batch} | {name} | {new_us:.1f} | {cells} |", flush=True)


SWEEP_TILES = ((4096, 8), (4096, 16), (8192, 16), (2048, 8), (4096, 32), (1024, 4))


def sweep_tiles(vocab: int) -> None:
    """The Triton kernel's device time per (chunk width, warps) at batch 1 and 64, for plain rows, top-p,
    top-k and both: where ``kernels.triton_sampling.CUDA_BLOCK_V`` and ``CUDA_NUM_WARPS`` come from."""
    from kernels import triton_sampling

    print("| BLOCK_V | warps | batch | plain ms | top-p 0.9 ms | top-k 50 ms | top-k 1000 + top-p 0.95 ms |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    settings = (
        SamplingParams(temperature=0.8),
        SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=0.8, top_k=50),
        SamplingParams(temperature=0.8, top_k=1000, top_p=0.95),
    )
    chosen = triton_sampling.CUDA_BLOCK_V, triton_sampling.CUDA_NUM_WARPS
    for block_v, warps in SWEEP_TILES:
        triton_sampling.CUDA_BLOCK_V, triton_sampling.CUDA_NUM_WARPS = block_v, warps
        for batch in (1, 64):
            logits = torch.randn(batch, vocab, device="cuda") * 3
            cells = " | ".join(f"{kernel_device_ms(logits, p):.3f}" for p in settings)
            print(f"| {block_v} | {warps} | {batch} | {cells} |", flush=True)
    triton_sampling.CUDA_BLOCK_V, triton_sampling.CUDA_NUM_WARPS = chosen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--vocab", type=int, default=128_256)
    parser.add_argument("--batches", default="1,64,256")
    parser.add_argument("--skip-previous", action="store_true", help="leave out the previous sampler (slow)")
    parser.add_argument("--sweep-tiles", action="store_true", help="only: the kernel's chunk width and warps")
    parser.add_argument("--kernel-graphs", action="store_true", help="only: the Triton op's device time")
    parser.add_argument("--baseline", help="with --kernel-graphs: another triton_sampling.py, side by side")
    args = parser.parse_args()
    if args.kernel_graphs:
        kernel_graphs(args.vocab, [int(b) for b in args.batches.split(",")], args.baseline)
        return
    if args.sweep_tiles:
        sweep_tiles(args.vocab)
        return
    device = torch.device(args.device)
    sampler = Sampler()
    print(f"# sampler, vocab {args.vocab}, device {device}, torch {torch.__version__}")
    gen = torch.Generator().manual_seed(0)

    def previous(logits: torch.Tensor, params: list[SamplingParams], _positions: list[int]) -> list[int]:
        return previous_temperature_sample(logits, params[0].temperature, gen)

    fused = Sampler(kernel_backend="triton") if device.type == "cuda" else None
    header = [*MODES] + ([] if args.skip_previous else ["previous sampler, temperature 0.8"])
    if fused is not None:
        header += ["Triton kernel, temperature 0.8", "Triton kernel, temperature 0.8 + min-p 0.05"]
    print("| batch | " + " | ".join(f"{m} ms" for m in header) + " |")
    print("|---:|" + "---:|" * len(header))
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        logits = torch.randn(batch, args.vocab, device=device) * 3
        cells = [f"{time_call(sampler, logits, [p] * batch, device):.3f}" for p in MODES.values()]
        if not args.skip_previous:
            cells.append(f"{time_call(previous, logits, [MODES['temperature 0.8']] * batch, device):.3f}")
        if fused is not None:
            min_p = SamplingParams(temperature=0.8, min_p=0.05)
            cells.append(f"{time_call(fused, logits, [MODES['temperature 0.8']] * batch, device):.3f}")
            cells.append(f"{time_call(fused, logits, [min_p] * batch, device):.3f}")
        print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)
    # Top-k and top-p: the torch race sorts the vocabulary; the Triton kernel does not (radix select and
    # rejection). Sampler calls (host work included) and the kernel's device time alone.
    print()
    print("| batch | filters | torch sampler ms | Triton sampler ms | Triton kernel call ms (events) |")
    print("|---:|---|---:|---:|---:|")
    for batch in batches:
        logits = torch.randn(batch, args.vocab, device=device) * 3
        for name, params in FILTERED.items():
            torch_ms = time_call(sampler, logits, [params] * batch, device)
            fused_ms = f"{time_call(fused, logits, [params] * batch, device):.3f}" if fused else "-"
            kernel_ms = f"{kernel_device_ms(logits, params):.3f}" if fused else "-"
            print(f"| {batch} | {name} | {torch_ms:.3f} | {fused_ms} | {kernel_ms} |", flush=True)


if __name__ == "__main__":
    main()
