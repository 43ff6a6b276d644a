"""Drive a running mesh through its OpenAI-compatible API: throughput, TTFT and TPOT percentiles.

    pdmesh up --http-port 8000 &            # or any running mesh
    pdmesh bench --url http://127.0.0.1:8000 --num-requests 64 --concurrency 16

Requests are random byte-token prompts (streaming completions, ``ignore_eos``), so every run of the
same arguments sends the same work. Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import percentile  # noqa: E402


async def one_request(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    prompt: str,
    max_tokens: int,
) -> tuple[float, list[float], int]:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    ttft = float("nan")
    stamps: list[float] = []
    tokens = 0
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                if ttft != ttft:  # nan: first text chunk
                    ttft = now - start
                stamps.append(now)
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    gaps = [b - a for a, b in zip(stamps, stamps[1:], strict=False)]
    return ttft, gaps, tokens


async def run(args: argparse.Namespace) -> None:
    rng = random.Random(args.seed)
    alphabet = "abcdefghijklmnopqrstuvwxyz "
    prompts = [
        "".join(rng.choice(alphabet) for _ in range(args.prompt_len)) for _ in range(args.num_requests)
    ]
    sem = asyncio.Semaphore(args.concurrency)
    results: list[tuple[float, list[float], int]] = []

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as session:

        async def worker(prompt: str) -> None:
            async with sem:
                results.append(await one_request(session, args.url, args.model, prompt, args.max_tokens))

        started = time.perf_counter()
        await asyncio.gather(*(worker(p) for p in prompts))
        elapsed = time.perf_counter() - started
    ttfts = [r[0] for r in results]
    gaps = [g for r in results for g in r[1]]
    tokens = sum(r[2] for r in results)
    print(
        "| requests | concurrency | prompt chars | max tokens | output tok/s | req/s | TTFT p50/p90 ms "
        "| TPOT p50/p90 ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    print(
        f"| {len(results)} | {args.concurrency} | {args.prompt_len} | {args.max_tokens} | {tokens / elapsed:.1f} "
        f"| {len(results) / elapsed:.2f} | {percentile(ttfts, 50) * 1e3:.1f} / {percentile(ttfts, 90) * 1e3:.1f} "
        f"| {percentile(gaps, 50) * 1e3:.2f} / {percentile(gaps, 90) * 1e3:.2f} |"
    )
    if gaps:
        print(f"mean TPOT {statistics.mean(gaps) * 1e3:.2f} ms over {len(gaps)} gaps; total {elapsed:.2f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", default="tiny-dense")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=256, help="prompt length in characters (bytes: tokens)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(run(p.parse_args()))


if __name__ == "__main__":
    main()
