"""What n-gram speculative decoding (engine/speculative.py) gains or costs: the same requests decoded with
and without ``--speculative-config``, side by side in one run on one device.

    python benchmarks/speculative_bench.py [--model tiny-dense] [--device cpu] [--batches 1,8]
        [--tokens 4] [--max-tokens 128]
    python benchmarks/speculative_bench.py --shape moe --device cuda --dtype bfloat16 --kernel-backend triton

The prompts repeat themselves (a block of text given twice, as in editing or summarising code, where
prompt lookup helps) or do not (random tokens: drafts rarely match). Per batch size and prompt kind: the
plain engine's tokens/s, the drafting engine's, the ratio, the share of draft tokens kept and the forward
passes each needed; the tokens are checked equal (greedy) in float32, and in 16-bit dtypes the share of
requests whose tokens equal plain decoding's is reported (a step with drafts rounds differently). On a GPU, pass ``--device cuda --dtype
bfloat16 --kernel-backend triton`` and a checkpoint directory as ``--model``; with a random-weight model
the acceptance rate says little about real text, but the cost of a step with drafts does. Medians of
``--repeats`` runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from engine import LLM, SamplingParams  # noqa: E402


def prompts(kind: str, n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if kind == "repetitive":
            block = [rng.randrange(3, vocab) for _ in range(96)]
            out.append(block + [rng.randrange(3, vocab) for _ in range(8)] + block[:48])
        else:
            out.append([rng.randrange(3, vocab) for _ in range(144)])
    return out


def run(llm: LLM, batch: list[list[int]], params: SamplingParams, repeats: int) -> tuple[float, list, int]:
    llm.generate(batch, params)  # warm-up (compiles, graphs)
    times, outs = [], []
    passes = llm.engine.runner.forward_passes
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(batch, params)
        times.append(time.perf_counter() - start)
    per_run = (llm.engine.runner.forward_passes - passes) // repeats
    tokens = sum(len(o.token_ids) for o in outs)
    return tokens / statistics.median(times), outs, per_run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-dense")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--kernel-backend", default="torch")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--tokens", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--num-kv-blocks", type=int, default=1024)
    ap.add_argument(
        "--shape",
        choices=("moe", "dense"),
        help="instead of --model: gpu_bench.py's random-weight Qwen3-30B-A3B or Llama-3.1-8B shape (GPU)",
    )
    ap.add_argument("--smoke", action="store_true", help="with --shape: gpu_bench's small smoke shapes (CPU)")
    args = ap.parse_args()
    load_format = "auto"
    if args.shape is not None:  # a config.json only, random weights built on the device
        from benchmarks.gpu_bench import SHAPES, write_config

        args.model, load_format = str(write_config(SHAPES[args.shape][1], smoke=args.smoke)), "dummy"
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": args.tokens, "prompt_lookup_max": 4,
                       "prompt_lookup_min": 2})  # fmt: skip
    common = dict(device=args.device, dtype=args.dtype, kernel_backend=args.kernel_backend,
                  num_kv_blocks=args.num_kv_blocks, enable_prefix_caching=False, load_format=load_format)  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    cases = [(int(b), kind) for b in args.batches.split(",") for kind in ("repetitive", "random")]
    # One engine at a time (two Qwen3-30B-A3B-shaped ones do not fit an H200 beside each other).
    plain = LLM(args.model, **common)
    vocab = plain.engine.vocab_size
    exact = plain.engine.config.dtype == "float32"
    base = {case: run(plain, prompts(case[1], case[0], vocab), params, args.repeats) for case in cases}
    del plain
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    drafting = LLM(args.model, speculative_config=spec, **common)
    rows = []
    for case in cases:
        before = drafting.engine.stats()
        fast, got, fast_passes = run(drafting, prompts(case[1], case[0], vocab), params, args.repeats)
        after = drafting.engine.stats()
        rate, expected, base_passes = base[case]
        same = sum(g.token_ids == e.token_ids for g, e in zip(got, expected, strict=True)) / len(got)
        # float32: the tokens must be plain decoding's. In bf16 a step with drafts (several tokens a
        # sequence) rounds differently from a decode step, so a greedy choice near a tie can flip: the
        # share of requests with identical tokens is reported instead.
        assert same == 1.0 or not exact, "drafting changed tokens"
        drafted = after.spec_draft_tokens - before.spec_draft_tokens
        kept = after.spec_accepted_tokens - before.spec_accepted_tokens
        rows.append((*case, rate, fast, fast / rate, kept / drafted if drafted else 0.0, base_passes,
                     fast_passes, same))  # fmt: skip
    print(
        f"model {args.model} on {args.device}, {args.tokens} draft tokens, {args.max_tokens} new tokens a request"
    )
    print(f"{'batch':>5} {'prompts':>10} {'plain tok/s':>12} {'ngram tok/s':>12} {'ratio':>6} {'kept':>6} "
          f"{'passes':>13} {'same':>5}")  # fmt: skip
    for b, kind, rate, fast, ratio, kept, bp, fp, same in rows:
        print(f"{b:>5} {kind:>10} {rate:>12.1f} {fast:>12.1f} {ratio:>6.2f} {kept:>6.0%} {bp:>6} -> {fp:<5} "
              f"{same:>5.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
