"""Router decision latency, and the KV index costs docs/routing.md quotes.

One decision = hash the prompt's blocks (``mesh.block_hash``, from the token list a tokenizer returns),
look the chain up in the KV index, pick a decode worker (KV headroom + load), decide PD on that worker's
cache, pick a prefill worker (prefix 3 + load 2, affinity, hot-spot guard; every time, also when the
decode worker would prefill), the router's order. Measured with the in-process index and with Redis.

Workload (defaults): 64 prefill workers, 16 decode workers, block size 16, 8192-token prompts (512 blocks).
The index holds 16 system prompts of 2048 tokens, each cached on 8 workers (gpu, some in cpu); 256
conversations of 2k-6k tokens after a system prompt, each on its home worker (gpu) and offloaded to another
(cpu); and 1,500 unrelated blocks per worker. Requests: 50% continue a conversation, 30% start one after
a known system prompt, 20% share nothing. Also measured: a worst-case lookup (all 64 workers hold all 512
blocks), apply throughput and memory per block.

    python benchmarks/router_decision_bench.py [--requests 2000] [--redis-url redis://127.0.0.1:6379]

Redis keys go under their own prefix (pdmesh-bench-<uuid>) and are deleted at the end. Redis time is
read from INFO commandstats (usec of MULTI and EXEC, whose time includes the MGET and HGETALL it runs), which also counts
other clients' commands: the script reports whether other MGETs were seen.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import redis  # noqa: E402
import redis.asyncio as aioredis  # noqa: E402
import uvloop  # noqa: E402

from benchmarks.common import percentile  # noqa: E402
from mesh.block_hash import block_hashes, root_hash  # noqa: E402
from mesh.kv_events import BlocksStored, Tier  # noqa: E402
from mesh.kv_index import InProcessKVIndex, KVIndex, RedisKVIndex  # noqa: E402
from mesh.registry import WorkerInfo  # noqa: E402
from router.scoring import PDDecider, RoutingRequest, WorkerState, WorkerStats, make_picker  # noqa: E402

# A fingerprint as engine/loader.py makes them (checkpoint dir, config digest, dtype): it is part of every key.
FP = "Llama-3.1-8B-Instruct:3f2a9c0d5e7b1a46:bfloat16"
VOCAB = 50_000


def tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


@dataclass
class Workload:
    """Token sequences and which worker caches which of them, in which tier."""

    block_size: int
    prompt_tokens: int
    root: int
    system_prompts: list[list[int]] = field(default_factory=list)
    conversations: list[list[int]] = field(default_factory=list)
    stores: list[tuple[str, list[int], Tier]] = field(default_factory=list)  # worker, token sequence, tier
    background: dict[str, list[int]] = field(default_factory=dict)  # worker -> unrelated block hashes


def build_workload(args: argparse.Namespace, workers: list[str], rng: random.Random) -> Workload:
    wl = Workload(args.block_size, args.prompt_tokens, root_hash(FP))
    for _ in range(16):
        sp = tokens(rng, 2048)
        wl.system_prompts.append(sp)
        for i, w in enumerate(rng.sample(workers, 8)):
            wl.stores.append((w, sp, Tier.CPU if i >= 6 else Tier.GPU))
    for _ in range(256):
        conv = rng.choice(wl.system_prompts) + tokens(rng, rng.randrange(2048, 6144))
        wl.conversations.append(conv)
        home, offload = rng.sample(workers, 2)
        wl.stores.append((home, conv, Tier.GPU))
        wl.stores.append((offload, conv, Tier.CPU))
    for w in workers:
        wl.background[w] = [rng.getrandbits(64) for _ in range(1500)]
    return wl


REQUEST_KINDS = ("conversation", "system prompt", "unrelated")


def make_request(wl: Workload, rng: random.Random, kind: str | None = None) -> tuple[list[int], str | None]:
    if kind is None:
        roll = rng.random()
        kind = REQUEST_KINDS[0] if roll < 0.5 else REQUEST_KINDS[1] if roll < 0.8 else REQUEST_KINDS[2]
    if kind == "conversation":
        i = rng.randrange(len(wl.conversations))
        base, session = wl.conversations[i], f"conv-{i}"
    elif kind == "system prompt":
        base, session = rng.choice(wl.system_prompts), None
    else:
        base, session = [], None
    base = base[: wl.prompt_tokens]
    return base + tokens(rng, wl.prompt_tokens - len(base)), session


async def populate(index: KVIndex, wl: Workload) -> tuple[float, int]:
    """Apply every store; returns (seconds, blocks applied)."""
    n = 0
    start = time.perf_counter()
    for w, seq, tier in wl.stores:
        hashes = block_hashes(seq, wl.block_size, wl.root)
        await index.apply(w, [BlocksStored(tuple(hashes), tier)])
        n += len(hashes)
    for w, hashes in wl.background.items():
        await index.apply(w, [BlocksStored(tuple(hashes), Tier.GPU)])
        n += len(hashes)
    return time.perf_counter() - start, n


def worker_states(rng: random.Random, ids: list[str], role: str) -> list[WorkerState]:
    out = []
    for wid in ids:
        info = WorkerInfo(wid, role, f"10.0.0.{len(out) + 1}:50051", FP, 16, 8192)
        free = rng.randrange(500, 8192)
        stats = WorkerStats(
            queued_tokens=rng.choice([0, 0, rng.randrange(0, 40_000)]),
            running_tokens=rng.randrange(0, 16_000),
            num_running=rng.randrange(0, 64),
            num_waiting=rng.randrange(0, 8),
            kv_usage=1 - free / 8192,
            num_kv_blocks_free=free,
            num_kv_blocks_total=8192,
        )
        out.append(WorkerState(info, stats))
    return out


def lookup_stats(client: redis.Redis) -> tuple[int, int]:
    """(MGET calls, usec of a lookup's MULTI and EXEC; EXEC's time includes the MGET and HGETALL it runs)."""
    info = client.info("commandstats")
    usec = sum(int(info.get(f"cmdstat_{c}", {}).get("usec", 0)) for c in ("multi", "exec"))
    return int(info.get("cmdstat_mget", {}).get("calls", 0)), usec


@dataclass
class Timings:
    hash_us: list[float] = field(default_factory=list)
    lookup_us: list[float] = field(default_factory=list)
    pick_us: list[float] = field(default_factory=list)
    total_us: list[float] = field(default_factory=list)
    reasons: dict[str, int] = field(default_factory=dict)
    local_prefill: int = 0
    best_match: list[int] = field(default_factory=list)  # longest cached prefix (blocks) per request


async def run_decisions(index: KVIndex, wl: Workload, args: argparse.Namespace, seed: int) -> Timings:
    rng = random.Random(seed)
    prefill_ids = [f"prefill-{i}" for i in range(args.workers)]
    decode_ids = [f"decode-{i}" for i in range(args.decode_workers)]
    prefill_picker = make_picker("prefix", "prefill", seed=seed)
    decode_picker = make_picker("prefix", "decode", seed=seed)
    decider = PDDecider()
    requests = [make_request(wl, rng) for _ in range(args.requests + args.warmup)]
    t = Timings()
    prefill_states = decode_states = []
    for i, (toks, session) in enumerate(requests):
        if i % 100 == 0:  # loads move between decisions
            prefill_states = worker_states(rng, prefill_ids, "prefill")
            decode_states = worker_states(rng, decode_ids, "decode")
        t0 = time.perf_counter()
        hashes = block_hashes(toks, wl.block_size, wl.root)  # the list, as the router has it
        t1 = time.perf_counter()
        matches = await index.lookup(hashes)
        t2 = time.perf_counter()
        request = RoutingRequest(len(toks), hashes, wl.block_size, FP, session, matches)
        # The router's order (router/scored_chooser.py): decode worker, PD on its cache, prefill worker
        # (picked here every time, also when the decode worker would prefill: the worst case).
        decode = decode_picker.pick(request, decode_states)
        pd = decider.decide(request, prefill_states, decode.worker_id)
        prefill = prefill_picker.pick(request, prefill_states)
        t3 = time.perf_counter()
        if i < args.warmup:
            continue
        t.hash_us.append((t1 - t0) * 1e6)
        t.lookup_us.append((t2 - t1) * 1e6)
        t.pick_us.append((t3 - t2) * 1e6)
        t.total_us.append((t3 - t0) * 1e6)
        t.reasons[prefill.reason] = t.reasons.get(prefill.reason, 0) + 1
        t.local_prefill += pd.prefill_on_decode
        t.best_match.append(max((m.blocks for m in matches.values()), default=0))
    return t


async def timed_lookups(lookup: Callable, hashes: list[int], n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await lookup(hashes)
        out.append((time.perf_counter() - t0) * 1e6)
    return out


def row(cells: list[str], widths: list[int]) -> str:
    return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"


async def bench_index(kind: str, args: argparse.Namespace, wl: Workload, report: list[list[str]]) -> None:
    prefix = f"pdmesh-bench-{uuid.uuid4().hex[:12]}"
    sync_client = redis.Redis.from_url(args.redis_url) if kind == "redis" else None
    client = aioredis.from_url(args.redis_url) if kind == "redis" else None
    index: KVIndex
    if kind == "redis":
        index = RedisKVIndex(client, FP, prefix=prefix)
    else:
        index = InProcessKVIndex()
    try:
        if kind == "inprocess":
            tracemalloc.start()
        apply_s, applied = await populate(index, wl)
        if kind == "inprocess":
            mem_bytes = tracemalloc.get_traced_memory()[0]
            tracemalloc.stop()
            distinct = len(index)  # type: ignore[arg-type]
        else:
            assert client is not None
            mem_bytes, distinct = await redis_memory(client, prefix)
        pairs = applied  # every stored block lands on one (block, worker) pair
        print(
            f"[{kind}] populated {applied} (block, worker) pairs, {distinct} distinct blocks in {apply_s:.2f}s "
            f"({applied / apply_s:,.0f} blocks/s); memory {mem_bytes / 1e6:.1f} MB = "
            f"{mem_bytes / pairs:.0f} B per pair held"
        )

        before = lookup_stats(sync_client) if sync_client else (0, 0)
        gc.collect()
        t = await run_decisions(index, wl, args, args.seed)
        after = lookup_stats(sync_client) if sync_client else (0, 0)
        server = ""
        if sync_client:
            calls, usec = after[0] - before[0], after[1] - before[1]
            ours = args.requests + args.warmup
            note = "" if calls == ours else f" ({calls - ours} MGET calls from other clients included)"
            server = f"{usec / calls:.0f}{note}"
        for phase, values in (
            ("hash 512 blocks", t.hash_us),
            ("index lookup", t.lookup_us),
            ("pick prefill + PD + decode", t.pick_us),
            ("decision total", t.total_us),
        ):
            report.append(
                [
                    kind,
                    phase,
                    f"{percentile(values, 50):.0f}",
                    f"{percentile(values, 99):.0f}",
                    f"{statistics.mean(values):.0f}",
                    server if phase == "index lookup" else "",
                ]
            )
        misses = sum(1 for b in t.best_match if b == 0)
        print(
            f"[{kind}] decision reasons: {dict(sorted(t.reasons.items()))}; "
            f"PD local prefill: {t.local_prefill}/{len(t.total_us)}; longest cached prefix: "
            f"mean {statistics.mean(t.best_match):.0f} blocks, none for {misses}/{len(t.best_match)}"
        )

        # Lookup alone, by kind of request: what a matched block costs.
        rng = random.Random(args.seed + 2)
        for req_kind in REQUEST_KINDS:
            chains = [
                block_hashes(make_request(wl, rng, req_kind)[0], wl.block_size, wl.root) for _ in range(100)
            ]
            matched = [max((m.blocks for m in (await index.lookup(c)).values()), default=0) for c in chains]
            before = lookup_stats(sync_client) if sync_client else (0, 0)
            wall = [w for c in chains for w in await timed_lookups(index.lookup, c, 3)]
            after = lookup_stats(sync_client) if sync_client else (0, 0)
            server = f"{(after[1] - before[1]) / max(1, after[0] - before[0]):.0f}" if sync_client else ""
            report.append(
                [
                    kind,
                    f"lookup, {req_kind} (matched {statistics.mean(matched):.0f} blocks)",
                    f"{percentile(wall, 50):.0f}",
                    f"{percentile(wall, 99):.0f}",
                    f"{statistics.mean(wall):.0f}",
                    server,
                ]
            )

        # Worst case: every worker holds the whole 512-block prompt in gpu.
        rng = random.Random(args.seed + 1)
        worst = block_hashes(tokens(rng, wl.prompt_tokens), wl.block_size, wl.root)
        for i in range(args.workers):
            await index.apply(f"prefill-{i}", [BlocksStored(tuple(worst), Tier.GPU)])
        before = lookup_stats(sync_client) if sync_client else (0, 0)
        wall = await timed_lookups(index.lookup, worst, 300)
        after = lookup_stats(sync_client) if sync_client else (0, 0)
        server = f"{(after[1] - before[1]) / max(1, after[0] - before[0]):.0f}" if sync_client else ""
        got = await index.lookup(worst)
        assert len(got) == args.workers and all(m.blocks == len(worst) for m in got.values())
        report.append(
            [
                kind,
                f"lookup, worst case ({args.workers} x {len(worst)})",
                f"{percentile(wall, 50):.0f}",
                f"{percentile(wall, 99):.0f}",
                f"{statistics.mean(wall):.0f}",
                server,
            ]
        )
    finally:
        if client is not None:
            keys = [k async for k in client.scan_iter(match=f"{prefix}:*", count=5000)]
            for i in range(0, len(keys), 5000):
                await client.unlink(*keys[i : i + 5000])
            await client.aclose()
        if sync_client is not None:
            sync_client.close()


async def redis_memory(client: aioredis.Redis, prefix: str) -> tuple[int, int]:
    """(bytes used by the index's keys, distinct blocks), from MEMORY USAGE of every key."""
    total, blocks = 0, 0
    batch: list[bytes] = []

    async def flush() -> int:
        async with client.pipeline(transaction=False) as pipe:
            for k in batch:
                pipe.memory_usage(k, samples=0)
            return sum(v or 0 for v in await pipe.execute())

    async for key in client.scan_iter(match=f"{prefix}:*", count=5000):
        batch.append(key)
        blocks += b":blk:" in key
        if len(batch) >= 2000:
            total += await flush()
            batch = []
    if batch:
        total += await flush()
    return total, blocks


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=64)
    parser.add_argument("--decode-workers", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=8192)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379")
    parser.add_argument("--skip-redis", action="store_true")
    args = parser.parse_args()

    rng = random.Random(args.seed)
    workers = [f"prefill-{i}" for i in range(args.workers)]
    wl = build_workload(args, workers, rng)
    print(f"load average at start: {os.getloadavg()}; {os.cpu_count()} CPUs")
    report: list[list[str]] = []
    await bench_index("inprocess", args, wl, report)
    if not args.skip_redis:
        await bench_index("redis", args, wl, report)
    print(f"load average at end: {os.getloadavg()}")

    header = ["index", "phase", "p50 us", "p99 us", "mean us", "Redis time per lookup, us"]
    widths = [max(len(r[i]) for r in [header, *report]) for i in range(len(header))]
    print()
    print(
        f"{args.workers} prefill + {args.decode_workers} decode workers, {args.prompt_tokens}-token prompts "
        f"(block size {args.block_size}), {args.requests} decisions"
    )
    print(row(header, widths))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in report:
        print(row(r, widths))


if __name__ == "__main__":
    uvloop.run(main())  # as the router runs (router/__main__.py)
