"""Prefix-aware routing on a multi-turn, shared-prefix workload: prefix hit rate and TTFT per routing mode.

The workload (deterministic for a seed): ``--groups`` groups, each with a system prompt of
``--system-tokens`` tokens shared by its ``--conversations`` conversations. A conversation has ``--turns``
turns; turn k's prompt is the system prompt, then for every earlier turn its user message
(``--user-tokens``) and a synthetic assistant answer (``--answer-tokens``; synthetic so that the workload
does not depend on what the model says), then turn k's user message. Requests go out round by round (every
conversation's turn 0 in a shuffled order, then every turn 1, ...), ``--concurrency`` at a time, a turn
never before the conversation's previous one has finished; each carries its conversation as
``session_id`` (``--no-session`` leaves it out). Every request generates ``--max-tokens`` tokens.

For each routing mode a fresh mesh is started the way ``pdmesh up`` does (``mesh.cli.Mesh``: one process
per service on loopback, tiny-dense on the CPU, ``--num-prefill`` prefill and ``--num-decode`` decode
workers with ``--num-kv-blocks`` KV blocks each, ``--decode-kv-blocks`` on decode workers), warmed up with a few unrelated requests, then driven
through the router's gRPC API. Modes: ``prefix`` (the default policy), ``prefix-pd0`` (prefix routing with
``--pd-threshold-tokens 0``: every prompt through a prefill worker, so that only the prefill choice
differs from the baselines), ``round_robin``, ``random``.

Reported per mode: prefix hit rate = prompt tokens served from a worker's prefix cache (each request's
``usage.cached_prompt_tokens``, what the worker reports) / prompt tokens, and the router's own counters
for the same; TTFT p50 / p90 (client side: request sent to first token received); wall time; the share
of requests the decode worker prefilled itself. The best hit rate the workload allows assumes one
unlimited cache: every full block whose chain was in an earlier request's prompt is a hit (capped, as the
engine does, so that at least one prompt token is computed).

The default sizes put the mesh in the regime prefix routing is for: the prefill workers' caches together
hold the workload's working set (about 960 blocks of 16 tokens against 3 x 384), one worker's does not.

    python benchmarks/prefix_routing_bench.py [--modes prefix,prefix-pd0,round_robin,random]
        [--groups 12 --conversations 2 --turns 4 --system-tokens 512 --user-tokens 96 --answer-tokens 32]
        [--num-prefill 3 --num-decode 1 --num-kv-blocks 384] [--concurrency 4] [--redis-url URL]

With ``--redis-url`` the mesh uses that Redis for its registry and KV index (use a private redis-server:
workers register under the fixed ``pdmesh:`` prefix); without, the router's in-process index.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import re
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import grpc  # noqa: E402

from benchmarks.common import percentile  # noqa: E402
from mesh.block_hash import block_hashes, root_hash  # noqa: E402
from mesh.cli import Mesh  # noqa: E402
from protos.pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc  # noqa: E402

MODES = {
    "prefix": ["--routing", "prefix"],
    "prefix-pd0": ["--routing", "prefix", "--pd-threshold-tokens", "0"],
    "round_robin": ["--routing", "round_robin"],
    "random": ["--routing", "random"],
}
TOKEN_RANGE = (1, 250)  # byte tokens of the tiny model's tokenizer, clear of its special tokens


@dataclass(frozen=True)
class Turn:
    session: str
    turn: int
    prompt: list[int]


def build_workload(args: argparse.Namespace) -> list[Turn]:
    """Every request, in the order it is sent."""
    rng = random.Random(args.seed)

    def tokens(n: int) -> list[int]:
        return [rng.randint(*TOKEN_RANGE) for _ in range(n)]

    conversations: list[list[Turn]] = []
    for g in range(args.groups):
        system = tokens(args.system_tokens)
        for c in range(args.conversations):
            history, turns = list(system), []
            for t in range(args.turns):
                user = tokens(args.user_tokens)
                turns.append(Turn(f"g{g}-c{c}", t, history + user))
                history = history + user + tokens(args.answer_tokens)
            conversations.append(turns)
    schedule: list[Turn] = []
    for t in range(args.turns):
        order = list(range(len(conversations)))
        rng.shuffle(order)
        schedule += [conversations[i][t] for i in order]
    return schedule


def best_hits(schedule: list[Turn], block_size: int) -> tuple[int, int, int]:
    """(hittable prompt tokens with one unlimited cache, prompt tokens, distinct full blocks)."""
    root = root_hash("prefix-routing-bench")
    seen: set[int] = set()
    hit = total = 0
    for turn in schedule:
        hashes = block_hashes(turn.prompt, block_size, root)
        usable = (len(turn.prompt) - 1) // block_size  # the engine computes at least one token
        n = 0
        for h in hashes[:usable]:
            if h not in seen:
                break
            n += 1
        hit += n * block_size
        total += len(turn.prompt)
        seen.update(hashes)
    return hit, total, len(seen)


@dataclass
class Outcome:
    session: str
    turn: int
    prompt_tokens: int
    cached_tokens: int
    ttft_s: float
    prefill_worker: str
    decode_worker: str


@dataclass
class ModeResult:
    mode: str
    outcomes: list[Outcome] = field(default_factory=list)
    wall_s: float = 0.0
    router_prompt: float = 0.0
    router_hits: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def hit_rate(self) -> float:
        return sum(o.cached_tokens for o in self.outcomes) / max(
            1, sum(o.prompt_tokens for o in self.outcomes)
        )


async def generate(
    stub: router_pb2_grpc.RouterStub, turn: Turn, args: argparse.Namespace, tag: str
) -> Outcome:
    params = common_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    request = router_pb2.GenerateRequest(
        request_id=f"{tag}-{turn.session}-t{turn.turn}",
        token_ids=common_pb2.TokenIds(ids=turn.prompt),
        sampling_params=params,
        session_id="" if args.no_session else turn.session,
    )
    started = time.perf_counter()
    ttft = None
    out = Outcome(turn.session, turn.turn, len(turn.prompt), 0, 0.0, "", "")
    async for msg in stub.Generate(request, timeout=600):
        if ttft is None and msg.token_ids:
            ttft = time.perf_counter() - started
        out.prefill_worker = out.prefill_worker or msg.prefill_worker
        out.decode_worker = out.decode_worker or msg.decode_worker
        if msg.finish_reason:
            out.cached_tokens = msg.usage.cached_prompt_tokens
    out.ttft_s = ttft if ttft is not None else time.perf_counter() - started
    return out


async def drive(
    address: str, schedule: list[Turn], args: argparse.Namespace, tag: str, result: ModeResult
) -> None:
    limit = asyncio.Semaphore(args.concurrency)
    done: dict[tuple[str, int], asyncio.Event] = {(t.session, t.turn): asyncio.Event() for t in schedule}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = router_pb2_grpc.RouterStub(channel)

        async def one(turn: Turn) -> None:
            try:
                if turn.turn > 0:
                    await done[(turn.session, turn.turn - 1)].wait()
                result.outcomes.append(await generate(stub, turn, args, tag))
            except grpc.aio.AioRpcError as exc:
                result.failures.append(f"{turn.session} t{turn.turn}: {exc.code().name}: {exc.details()}")
            finally:
                done[(turn.session, turn.turn)].set()
                limit.release()

        tasks = []
        for turn in schedule:  # sent in schedule order, at most `concurrency` in flight
            await limit.acquire()
            tasks.append(asyncio.create_task(one(turn)))
        await asyncio.gather(*tasks)


def scrape(http_port: int, name: str) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def mesh_args(args: argparse.Namespace, mode: str) -> argparse.Namespace:
    return argparse.Namespace(
        model="tiny-dense", device="cpu", dtype="float32", block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, max_model_len=None, num_prefill=args.num_prefill,
        num_decode=args.num_decode, host="127.0.0.1", port=0, http_port=0, routing=MODES[mode][1],
        redis_url=args.redis_url, kv_transfer="nixl", worker_arg=[],
        router_arg=[*MODES[mode][2:], "--routing-seed", str(args.seed)],
    )  # fmt: skip


class BenchMesh(Mesh):
    """``pdmesh up``'s mesh, with the decode workers' KV pool sized on its own (``--decode-kv-blocks``)."""

    def __init__(self, args: argparse.Namespace, decode_kv_blocks: int | None) -> None:
        super().__init__(args)
        self.decode_kv_blocks = decode_kv_blocks

    def _worker_argv(self, module: str, port: int) -> list[str]:
        argv = super()._worker_argv(module, port)
        if module == "decode_svc" and self.decode_kv_blocks:
            argv += ["--num-kv-blocks", str(self.decode_kv_blocks)]  # the last one counts
        return argv


def run_mode(mode: str, schedule: list[Turn], args: argparse.Namespace) -> ModeResult:
    result = ModeResult(mode)
    mesh = BenchMesh(mesh_args(args, mode), args.decode_kv_blocks)
    started = time.perf_counter()
    try:
        mesh.start(echo=False, timeout=300)
        print(f"[{mode}] mesh up in {time.perf_counter() - started:.1f}s", file=sys.stderr, flush=True)
        address = f"127.0.0.1:{mesh.grpc_port}"
        rng = random.Random(args.seed + 1)
        warmup = [
            Turn(f"warmup-{i}", 0, [rng.randint(*TOKEN_RANGE) for _ in range(40)])
            for i in range(2 * (args.num_prefill + args.num_decode))
        ]
        asyncio.run(drive(address, warmup, args, "warmup", ModeResult("warmup")))
        prompt0 = scrape(mesh.http_port, "pdmesh_router_prompt_tokens_total")
        hits0 = scrape(mesh.http_port, "pdmesh_router_prefix_hit_tokens_total")
        t0 = time.perf_counter()
        asyncio.run(drive(address, schedule, args, mode, result))
        result.wall_s = time.perf_counter() - t0
        result.router_prompt = scrape(mesh.http_port, "pdmesh_router_prompt_tokens_total") - prompt0
        result.router_hits = scrape(mesh.http_port, "pdmesh_router_prefix_hit_tokens_total") - hits0
    finally:
        mesh.stop()
    print(
        f"[{mode}] {len(result.outcomes)} requests in {result.wall_s:.1f}s, hit rate {result.hit_rate:.1%}, "
        f"{len(result.failures)} failures",
        file=sys.stderr,
        flush=True,
    )
    return result


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, rows)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--groups", type=int, default=12)
    parser.add_argument("--conversations", type=int, default=2, help="per group")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--user-tokens", type=int, default=96)
    parser.add_argument("--answer-tokens", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--num-prefill", type=int, default=3)
    parser.add_argument("--num-decode", type=int, default=1)
    parser.add_argument("--num-kv-blocks", type=int, default=384)
    parser.add_argument("--decode-kv-blocks", type=int, default=None, help="default: --num-kv-blocks")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-session", action="store_true", help="send no session_id")
    parser.add_argument("--redis-url", default=None)
    args = parser.parse_args()
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            parser.error(f"unknown mode {m!r}; choose from {', '.join(MODES)}")

    schedule = build_workload(args)
    best, total, distinct = best_hits(schedule, args.block_size)
    print(
        f"workload: {len(schedule)} requests, {total} prompt tokens, {distinct} distinct full blocks; "
        f"{args.groups} groups x {args.conversations} conversations x {args.turns} turns, system "
        f"{args.system_tokens}, user {args.user_tokens}, answer {args.answer_tokens} tokens; best hit rate "
        f"{best / total:.1%}; load average {os.getloadavg()[0]:.2f}, {os.cpu_count()} CPUs",
        flush=True,
    )
    results = [run_mode(m, schedule, args) for m in modes]
    baseline = next((r for r in results if r.mode == "round_robin"), None)
    rows = []
    for r in results:
        ttfts = [o.ttft_s * 1000 for o in r.outcomes]
        local = sum(1 for o in r.outcomes if not o.prefill_worker)
        rows.append(
            [
                r.mode,
                f"{r.hit_rate:.1%}",
                f"{r.router_hits / max(1.0, r.router_prompt):.1%}",
                f"{r.hit_rate / (best / total):.0%}" if best else "-",
                f"{r.hit_rate / baseline.hit_rate:.2f}x" if baseline and baseline.hit_rate else "-",
                f"{percentile(ttfts, 50):.0f} / {percentile(ttfts, 90):.0f}",
                f"{r.wall_s:.1f}",
                f"{local}/{len(r.outcomes)}",
                str(len(r.failures)),
            ]
        )
    rows.append(["best (one unlimited cache)", f"{best / total:.1%}", "", "100%", "", "", "", "", ""])
    print()
    print(
        f"{args.num_prefill} prefill + {args.num_decode} decode workers (tiny-dense, CPU, {args.num_kv_blocks} KV "
        f"blocks of {args.block_size} each, {args.decode_kv_blocks or args.num_kv_blocks} on decode), concurrency {args.concurrency}, {args.max_tokens} new tokens per "
        f"request, index: {'Redis' if args.redis_url else 'in process'}, load average {os.getloadavg()[0]:.2f}"
    )
    header = [
        "mode", "hit rate", "router metric", "of best", "vs round_robin", "TTFT p50 / p90 ms", "wall s",
        "prefilled on decode", "failures",
    ]  # fmt: skip
    print(table(header, rows))
    for r in results:
        for f in r.failures[:5]:
            print(f"{r.mode}: {f}", file=sys.stderr)


if __name__ == "__main__":
    main()
