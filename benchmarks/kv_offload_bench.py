"""What the KV offload store saves: time to first token of a long prompt the worker's prefix cache does not
hold, computed against loaded from the store, with real processes.

Starts ``python -m kvstore_svc`` and one ``python -m decode_svc`` pointed at it (``--kvstore-address``; one
GPU for the worker on CUDA: random bf16 weights of a Llama-3.1-8B-shaped config, ``load_format=dummy``, KV
over NIXL from device memory into the store's host pool). Each round takes a fresh random prompt and times,
from the client, a Decode RPC without a KV handle (the worker prefills locally, ``max_tokens`` 1) to its
first streamed token:

* computed: the worker's prefix cache reset, the prompt never seen by the store (the worker's Fetch
  misses, so this row pays the ~0.3 ms round trip a worker with a store always pays). When the request
  finishes the worker offers the prompt's blocks to the store; the benchmark waits until the store's
  ``Lookup`` of the prompt's block hashes answers every block.
* local hit: the same prompt once more without a reset: the worker's own prefix cache holds it
  (reference: the best a cache can do).
* loaded: the worker's prefix cache reset again, the same prompt: its blocks come from the store (Fetch,
  one NIXL READ into reserved blocks, commit) and only the last block's tokens are computed.

The rows of a round run in that order (each needs the one before). The loaded row's greedy tokens must
equal the local hit's (the same kernels over the same KV bytes, loaded or the worker's own); the computed
row's equal them in float32, while in bf16 a whole prefill and a cached prefix's last block round
differently, so with random weights' near-ties they may part; medians are over ``--reps`` rounds
after ``--warmup``; the worker's own histogram of its loads' phases (Fetch, READ, staging copy) gives their
means. Each row reports the cached prompt tokens of its response (``usage``): 0 computed, the
prompt's full blocks but the last token's loaded and local.

Run from the repository root on the device machine: ``python3 benchmarks/kv_offload_bench.py`` (needs a
NIXL wheel for the machine's CUDA); ``--smoke`` runs the tiny model on the CPU over host memory (under a
minute). The short table is printed last; ``--out`` (default ``$OUT``) gets the log, the processes' logs
and the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from benchmarks.common import setup_output  # noqa: E402
from benchmarks.gpu_bench import LLAMA_3_1_8B  # noqa: E402
from mesh.block_hash import block_hashes, root_hash  # noqa: E402
from protos.pdmesh.v1 import common_pb2, kvstore_pb2, kvstore_pb2_grpc, worker_pb2, worker_pb2_grpc  # noqa: E402
from tests.mesh_fixtures import ServiceProcess  # noqa: E402

log = logging.getLogger("kv_offload_bench")
BLOCK_SIZE = 16
ROWS = ("computed", "loaded", "local hit")


async def first_token(worker, rid: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    """One Decode RPC without a KV handle: ms to the first streamed token, the cached prompt tokens, and the
    greedy tokens (the rows of a round compare them)."""
    params = common_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    req = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params)
    t0 = time.perf_counter()
    ttft = None
    cached = -1
    tokens: list[int] = []
    async for msg in worker.Decode(req, timeout=300):
        if msg.token_ids and ttft is None:
            ttft = (time.perf_counter() - t0) * 1e3
        tokens += list(msg.token_ids)
        if msg.HasField("usage"):
            cached = msg.usage.cached_prompt_tokens
    assert ttft is not None, rid
    return {"ttft_ms": ttft, "cached_tokens": cached, "tokens": tokens}


async def wait_stored(store, fingerprint: str, prompt: list[int], timeout: float = 60.0) -> float:
    """Wait until the store's Lookup answers every loadable block of ``prompt`` (all full blocks but the
    last token's, which a request always computes); seconds waited."""
    chain = block_hashes(prompt, BLOCK_SIZE, root_hash(fingerprint))[: (len(prompt) - 1) // BLOCK_SIZE]
    t0 = time.perf_counter()
    while True:
        found = await store.Lookup(
            kvstore_pb2.LookupRequest(model_fingerprint=fingerprint, block_hashes=chain), timeout=10
        )
        if found.num_prefix_blocks == len(chain):
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"the store holds {found.num_prefix_blocks} of {len(chain)} blocks")
        await asyncio.sleep(0.005)


async def reset_until(worker, blocks: int, timeout: float = 30.0) -> int:
    """ResetPrefixCache until at least ``blocks`` cached blocks were evicted in all; how many were."""
    evicted = 0
    t0 = time.perf_counter()
    while True:
        evicted += (await worker.ResetPrefixCache(worker_pb2.ResetPrefixCacheRequest())).num_evicted_blocks
        if evicted >= blocks:
            return evicted
        if time.perf_counter() - t0 > timeout:
            raise TimeoutError(f"the worker evicted {evicted} of {blocks} blocks")
        await asyncio.sleep(0.002)


async def measure(
    store_proc: ServiceProcess, worker_proc: ServiceProcess, args, vocab: int
) -> dict[str, Any]:
    rng = random.Random(1)
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name in ROWS}
    async with (
        grpc.aio.insecure_channel(store_proc.address) as sch,
        grpc.aio.insecure_channel(worker_proc.address) as wch,
    ):
        store = kvstore_pb2_grpc.KVStoreStub(sch)
        worker = worker_pb2_grpc.WorkerStub(wch)
        fingerprint = (await store.GetStats(kvstore_pb2.KVStoreStatsRequest())).model_fingerprint
        reset = worker_pb2.ResetPrefixCacheRequest()
        for i in range(args.warmup + args.reps):
            prompt = [rng.randrange(0, vocab) for _ in range(args.prompt_len)]
            await worker.ResetPrefixCache(reset)
            computed = await first_token(worker, f"computed-{i}", prompt, args.tokens)
            computed["offload_wait_s"] = await wait_stored(store, fingerprint, prompt)
            # The worker's own blocks, before any load: the reference the loaded row must equal token for
            # token (both compute only the last block over a cached prefix, the same kernels).
            local = await first_token(worker, f"local-{i}", prompt, args.tokens)
            # The worker drops its references to the offered blocks only after the store's answer: reset
            # until they are evicted too, so the loaded row finds none of the prompt's blocks locally.
            loaded_evicted = await reset_until(worker, (args.prompt_len - 1) // BLOCK_SIZE)
            loaded = await first_token(worker, f"loaded-{i}", prompt, args.tokens)
            loaded["evicted_before"] = loaded_evicted
            for name, r in zip(ROWS, (computed, loaded, local), strict=True):
                r["round"] = i
                r["warmup"] = i < args.warmup
                rows[name].append(r)
                log.info("%s %s", name, json.dumps(r))
        stats = await store.GetStats(kvstore_pb2.KVStoreStatsRequest())
    phases = load_phases(worker_proc)
    store_stats = {
        k: int(getattr(stats, k))
        for k in ("num_puts", "num_blocks_put", "num_fetches", "num_blocks_hit", "num_blocks_dropped")
    }
    return {"rows": rows, "store": store_stats, "load_phases_ms": phases}


def load_phases(worker_proc: ServiceProcess) -> dict[str, float]:
    """Mean ms of each phase of the worker's loads (its ``kvstore_load_seconds`` histogram), warm-up
    included."""
    import urllib.request

    sums: dict[str, float] = {}
    counts: dict[str, float] = {}
    with urllib.request.urlopen(f"http://{worker_proc.metrics_address}/metrics", timeout=10) as resp:
        for line in resp.read().decode().splitlines():
            for suffix, into in (("_sum{", sums), ("_count{", counts)):
                if "kvstore_load_seconds" + suffix in line:
                    phase = line.split('phase="')[1].split('"')[0]
                    into[phase] = float(line.rsplit(" ", 1)[1])
    return {p: 1e3 * sums[p] / counts[p] for p in sums if counts.get(p)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-len", type=int, default=None, help="default 2048 (1024 with --smoke)")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument(
        "--tokens", type=int, default=4, help="greedy tokens a request generates (the rows' must be equal)"
    )
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="tiny-dense on the CPU over host memory")
    parser.add_argument(
        "--staging",
        choices=("auto", "on", "off"),
        default="auto",
        help="the worker's --kvstore-staging (auto: through host blocks of its own on a GPU)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT") or "kv_offload_out")
    args = parser.parse_args(argv)
    if args.prompt_len is None:
        args.prompt_len = 1024 if args.smoke else 2048
    prompt_blocks = args.prompt_len // BLOCK_SIZE + 1
    if args.num_kv_blocks < 2 * prompt_blocks:
        parser.error(
            f"--num-kv-blocks must be at least {2 * prompt_blocks} for a {args.prompt_len}-token prompt"
        )
    out = setup_output(args.out, "kv_offload_bench.log")
    workdir = Path(tempfile.mkdtemp(prefix="pdmesh-kvoffload-"))
    if args.smoke:
        vocab = 256
        model_args = ["--model", "tiny-dense", "--dtype", "float32"]
        engine_args = [*model_args, "--device", "cpu"]
    else:
        (workdir / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
        vocab = LLAMA_3_1_8B["vocab_size"]
        model_args = ["--model", str(workdir), "--dtype", "bfloat16", "--load-format", "dummy"]
        engine_args = [*model_args, "--device", "cuda", "--kernel-backend", "triton"]
    # Room in the store for every round's prompt (nothing is evicted or dropped while the rounds run).
    host_blocks = (args.warmup + args.reps) * prompt_blocks + 64
    started = time.perf_counter()
    procs: list[ServiceProcess] = []
    try:
        store_proc = ServiceProcess.start(
            "kvstore_svc",
            *model_args,
            "--block-size",
            str(BLOCK_SIZE),
            "--host-blocks",
            str(host_blocks),
            "--metrics-port",
            "-1",
            timeout=300,
        )
        procs.append(store_proc)
        with ThreadPoolExecutor(1) as pool:  # the store is ready long before a GPU worker
            worker_proc = pool.submit(
                ServiceProcess.start,
                "decode_svc",
                *engine_args,
                "--block-size",
                str(BLOCK_SIZE),
                "--num-kv-blocks",
                str(args.num_kv_blocks),
                "--kv-transfer",
                "nixl",
                "--max-num-batched-tokens",
                "8192",
                "--max-model-len",
                "8192",
                "--metrics-port",
                "0",
                "--kvstore-address",
                store_proc.address,
                # A whole prompt is offered at once (the default holds at most a quarter of the pool), and a
                # loaded CPU does not time out the store's calls.
                "--kvstore-max-held-blocks",
                str(args.num_kv_blocks // 2),
                "--kvstore-timeout-s",
                "10",
                "--kvstore-staging",
                args.staging,
                timeout=600,
            ).result()
        procs.append(worker_proc)
        log.info("store and worker ready in %.1f s", time.perf_counter() - started)
        result = asyncio.run(measure(store_proc, worker_proc, args, vocab))
    except BaseException:
        for proc in procs:
            log.error("%s log tail:\n%s", proc.module, "\n".join(proc.lines[-60:]))
        raise
    finally:
        ServiceProcess.stop_all(procs)
        for proc in procs:
            (out / f"{proc.module}.log").write_text(proc.log() + "\n")
    rows = result["rows"]

    def med(name: str, key: str) -> float:
        values = [r[key] for r in rows[name] if not r["warmup"]]
        return statistics.median(values) if values else float("nan")

    summary = {
        name: {"ttft_ms": med(name, "ttft_ms"), "cached_tokens": med(name, "cached_tokens")} for name in ROWS
    }
    computed_ms = summary["computed"]["ttft_ms"]
    for name in ROWS:
        summary[name]["vs_computed"] = summary[name]["ttft_ms"] / computed_ms
    summary["computed"]["offload_wait_ms"] = med("computed", "offload_wait_s") * 1e3
    report = {
        "prompt_len": args.prompt_len,
        "block_size": BLOCK_SIZE,
        "reps": args.reps,
        "warmup": args.warmup,
        "device": "cpu" if args.smoke else "cuda",
        "staging": args.staging,
        "model": "tiny-dense" if args.smoke else "llama-3.1-8b-shaped (dummy bf16)",
        "summary": summary,
        "load_phases_ms": result["load_phases_ms"],
        "store": result["store"],
        "rows": rows,
    }
    (out / "kv_offload_bench.json").write_text(json.dumps(report, indent=1))
    lines = [
        f"\nTTFT, {args.prompt_len}-token prompt on a worker with a KV offload store, "
        f"median of {args.reps} (after {args.warmup} warm-up), --kvstore-staging {args.staging}",
        "| row | TTFT ms | cached prompt tokens | vs computed |",
        "|---|---:|---:|---:|",
    ]
    for name in ROWS:
        s = summary[name]
        lines.append(f"| {name} | {s['ttft_ms']:.1f} | {s['cached_tokens']:.0f} | {s['vs_computed']:.2f}x |")
    n = len(rows["computed"])
    same_kv = sum(
        ld["tokens"] == lh["tokens"] for ld, lh in zip(rows["loaded"], rows["local hit"], strict=True)
    )
    same_path = sum(
        c["tokens"] == lh["tokens"] for c, lh in zip(rows["computed"], rows["local hit"], strict=True)
    )
    lines.append(
        f"greedy tokens ({args.tokens}), loaded equal to local hit (the same kernels, KV from the store "
        f"against the worker's own): {same_kv} of {n} rounds"
    )
    lines.append(
        f"greedy tokens, computed equal to local hit (a whole prefill against a cached prefix: equal in "
        f"float32, may part in bf16): {same_path} of {n} rounds"
    )
    phases = result["load_phases_ms"]
    lines.append(
        "load phases, mean ms (every Fetch, a miss included): "
        + ", ".join(f"{p} {phases[p]:.2f}" for p in ("fetch", "read", "copy") if p in phases)
    )
    lines.append(
        f"store: {result['store']['num_blocks_put']} blocks put, {result['store']['num_fetches']} fetches; "
        f"offload of a finished prompt until the store answered it: {summary['computed']['offload_wait_ms']:.1f} ms"
    )
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
