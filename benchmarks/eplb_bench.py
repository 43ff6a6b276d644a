"""What expert placements cost on one device: decode with redundant expert slots, and applying a new
placement (every slot's expert reshuffled) between steps.

Builds gpu_bench's Qwen3-30B-A3B-shaped model with random weights (``load_format="dummy"``) twice, without
and with ``enable_eplb`` and redundant slots, and reports decode tok/s of each at the given batches; then
applies placements that rewrite a given share of the slots and times the move (``set_expert_placement``
on one rank: device copies) against the device-to-device copy rate (the move reads and writes each
rewritten slot's bytes once: its roofline), with the engine's copy op and, beside it, the reference's
(``--move-ops``). ``--smoke``: gpu_bench's small shapes on the CPU (CI runs it).

    python3 benchmarks/eplb_bench.py [--redundant 16] [--batches 1,64] [--smoke]
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import itertools
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine import LLM, SamplingParams  # noqa: E402
from engine.models.model_config import ModelConfig  # noqa: E402
from engine.moe.rebalance import expert_tensors  # noqa: E402
from kernels.copy_rows import copy_rows_torch  # noqa: E402


def rate(llm: LLM, prompts: list[list[int]], params: SamplingParams, repeats: int) -> float:
    """Output tokens per second of ``generate`` (median of ``repeats``, after one warm-up)."""
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        times.append(time.perf_counter() - start)
    return sum(len(o.token_ids) for o in outs) / statistics.median(times)


def reshuffled(old: list[list[int]], share: float, num_logical: int, rng: random.Random) -> list[list[int]]:
    """``old`` with about ``share`` of each layer's slots given other experts: the chosen slots' experts
    permuted among them, the permutation that changes the most slots of a few random ones (replicas of
    one expert may leave some unchanged). Every logical expert stays."""
    rows = []
    for row in old:
        chosen = rng.sample(range(len(row)), max(2, round(share * len(row))))
        values = [row[s] for s in chosen]
        best, best_changed = list(values), 0
        for _ in range(50):
            rng.shuffle(values)
            changed = sum(v != row[s] for v, s in zip(values, chosen, strict=True))
            if changed > best_changed:
                best, best_changed = list(values), changed
            if changed == len(chosen):
                break
        new = list(row)
        for s, v in zip(chosen, best, strict=True):
            new[s] = v
        assert set(new) == set(range(num_logical))
        rows.append(new)
    return rows


def copy_gbps(device: str) -> float:
    """Device-to-device copy rate (read + write bytes per second), 1 GiB buffers, median of 10."""
    n = 2**30 if device == "cuda" else 2**26
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(10):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        b.copy_(a)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return 2 * n / statistics.median(times) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--redundant", type=int, default=16, help="redundant expert slots per MoE layer")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--shares", default="0.1,0.5,1.0", help="shares of slots a placement rewrites")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--smoke", action="store_true", help="gpu_bench's small shapes, on the CPU")
    ap.add_argument("--move-ops", default="engine,torch",
                    help="copy ops the moves are timed with: engine (the engine's table: one kernel a tensor "
                         "and layer on a GPU), torch (the reference: gather into a temporary, then scatter)")  # fmt: skip
    args = ap.parse_args()
    from benchmarks.gpu_bench import SHAPES, write_config

    model_dir = write_config(SHAPES["moe"][1], smoke=args.smoke)
    cfg = ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    gpu = not args.smoke and torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    common = dict(device=device, dtype="bfloat16" if gpu else "float32",
                  kernel_backend="triton" if gpu else "torch", load_format="dummy", num_kv_blocks=4096,
                  max_num_seqs=max(batches), enable_prefix_caching=False)  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(3, cfg.vocab_size) for _ in range(256)] for _ in range(b)] for b in batches}

    plain = LLM(str(model_dir), **common)
    base = {b: rate(plain, prompts[b], params, args.repeats) for b in batches}
    del plain
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    llm = LLM(str(model_dir), enable_eplb=True, num_redundant_experts=args.redundant, **common)
    engine = llm.engine
    layout = engine.moe_layout()
    redundant = {b: rate(llm, prompts[b], params, args.repeats) for b in batches}
    slot_bytes = sum(t[0].numel() * t[0].element_size() for t in expert_tensors(engine.model.moe_blocks()[0]))
    ceiling = copy_gbps(device)
    moves = []
    version = 0
    blocks = engine.model.moe_blocks()
    tables = {"engine": blocks[0].ops, "torch": dataclasses.replace(blocks[0].ops, copy_rows=copy_rows_torch)}
    # One placement untimed per copy op first: the kernels' compiles stay out of the timings.
    for move_op in args.move_ops.split(","):
        for block in blocks:
            block.ops = tables[move_op]
        version += 1
        engine.set_expert_placement(
            version, reshuffled(engine.expert_placement(), 0.1, layout.num_logical, rng)
        )
    for share, move_op in itertools.product(
        (float(s) for s in args.shares.split(",")), args.move_ops.split(",")
    ):
        for block in blocks:
            block.ops = tables[move_op]
        times, slots = [], 0
        for _ in range(args.repeats):
            old = engine.expert_placement()
            placement = reshuffled(old, share, layout.num_logical, rng)
            slots = sum(
                a != b for o, n in zip(old, placement, strict=True) for a, b in zip(o, n, strict=True)
            )
            version += 1
            if gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            engine.set_expert_placement(version, placement)
            if gpu:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        ms = statistics.median(times) * 1e3
        moved_gb = slots * slot_bytes / 1e9
        moves.append((share, move_op, slots, moved_gb, ms, 2 * moved_gb / ceiling * 1e3))
    for block in blocks:
        block.ops = tables["engine"]
    after = {b: rate(llm, prompts[b], params, args.repeats) for b in batches}
    name = torch.cuda.get_device_name() if gpu else "cpu"
    print(f"{SHAPES['moe'][0]}{' (smoke)' if args.smoke else ''} on {name}: {layout.num_logical} experts, "
          f"{layout.num_physical} slots ({args.redundant} redundant) x {layout.num_layers} MoE layers, "
          f"{slot_bytes / 2**20:.2f} MiB a slot; copy rate {ceiling:.0f} GB/s")  # fmt: skip
    print(f"{'batch':>5} {'tok/s, no EPLB':>15} {'redundant slots':>16} {'after placements':>17}")
    for b in batches:
        print(f"{b:>5} {base[b]:>15.1f} {redundant[b]:>10.1f} ({redundant[b] / base[b]:.2f}) "
              f"{after[b]:>10.1f} ({after[b] / base[b]:.2f})")  # fmt: skip
    print(
        f"{'share':>5} {'copy op':>8} {'slots':>6} {'GB':>7} {'apply ms':>9} {'roofline ms':>12} {'ratio':>6}"
    )
    for share, move_op, slots, gb, ms, roof in moves:
        print(f"{share:>5.2f} {move_op:>8} {slots:>6} {gb:>7.2f} {ms:>9.1f} {roof:>12.1f} {roof / ms:>6.2f}")


if __name__ == "__main__":
    main()
