"""Time to first token of a long prompt, disaggregated against colocated, with real worker processes.

Starts ``python -m prefill_svc`` and ``python -m decode_svc`` (one GPU for both on CUDA; random bf16 weights
of a Llama-3.1-8B-shaped config, ``load_format=dummy``; KV over NIXL, device memory) and times, from the
client:

* disaggregated: Prefill RPC (the prefill worker computes the prompt and samples token 0) -> Decode RPC with
  the kv_handle (the decode worker pulls the KV with a NIXL READ, then decodes). Reported: time to token 0
  (the Prefill RPC's answer), time to token 1 (the decode worker's first streamed token), and the decode
  worker's KV pull (``pdmesh_decode_kv_transfer_time_seconds``, scraped per request) and whole import (the
  ``kv_transfer`` span: handshake, block reservation, pull, commit).
* colocated: one Decode RPC without a handle: the decode worker prefills locally. Reported: time to its
  first streamed token (token 0) and to its second (token 1).

Each request has a fresh random prompt (no prefix-cache hits); modes alternate; medians are reported. The
disaggregation overhead compares like with like: token 1 against token 1 (the point where the decode
worker streams in both modes) and token 0 against token 0 (what a user sees first).

Run from the repository root on the device machine: ``python3 benchmarks/disagg_ttft_bench.py`` (needs a
NIXL wheel for the machine's CUDA: nixl-cu13 on CUDA 13); ``--smoke`` runs the tiny model on the CPU over
host memory. The short table is printed last; ``--out`` (default ``$OUT``) gets the log and the JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import re
import statistics
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import grpc  # noqa: E402

from benchmarks.common import setup_output  # noqa: E402
from benchmarks.gpu_bench import LLAMA_3_1_8B  # noqa: E402
from mesh.telemetry import read_spans_jsonl  # noqa: E402
from protos.pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc  # noqa: E402
from tests.mesh_fixtures import ServiceProcess  # noqa: E402

log = logging.getLogger("disagg_ttft")
PULL_METRIC = re.compile(r"^pdmesh_decode_kv_transfer_time_seconds_(sum|count) (\S+)$", re.M)


def scrape_pull(metrics_address: str) -> tuple[float, float]:
    """(seconds, pulls) so far, from the decode worker's Prometheus endpoint."""
    text = urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5).read().decode()
    values = dict(PULL_METRIC.findall(text))
    return float(values.get("sum", 0.0)), float(values.get("count", 0.0))


async def disaggregated(prefill, decode, metrics: str, rid: str, prompt: list[int]) -> dict[str, float]:
    params = common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    pull_before = scrape_pull(metrics)
    t0 = time.perf_counter()
    first = await prefill.Prefill(
        worker_pb2.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params),
        timeout=120,
    )
    t_first = time.perf_counter()
    req = worker_pb2.DecodeRequest(
        request_id=rid,
        prompt_token_ids=prompt,
        sampling_params=params,
        kv_handle=first.kv_handle,
        first_token_id=first.first_token_id,
    )
    t_second = None
    async for msg in decode.Decode(req, timeout=120):
        if msg.token_ids and t_second is None:
            t_second = time.perf_counter()
    pull_after = scrape_pull(metrics)
    assert t_second is not None and pull_after[1] == pull_before[1] + 1
    blocks = list(first.kv_handle.block_ids)
    return {
        "token0_ms": (t_first - t0) * 1e3,
        "token1_ms": (t_second - t0) * 1e3,
        "pull_ms": (pull_after[0] - pull_before[0]) * 1e3,
        "handoff_ms": (t_second - t_first) * 1e3,
        # Runs of adjacent block ids on the prefill side (a pull takes at least one descriptor per run).
        "prefill_block_runs": 1 + sum(1 for a, b in zip(blocks, blocks[1:], strict=False) if b != a + 1),
    }


async def colocated(decode, rid: str, prompt: list[int]) -> dict[str, float]:
    params = common_pb2.SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    stamps: list[float] = []
    req = worker_pb2.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling_params=params)
    async for msg in decode.Decode(req, timeout=120):
        stamps += [time.perf_counter()] * len(msg.token_ids)
    assert len(stamps) == 2, stamps
    return {"token0_ms": (stamps[0] - t0) * 1e3, "token1_ms": (stamps[1] - t0) * 1e3}


def import_spans(trace_file: Path) -> dict[str, float]:
    """kv_transfer span duration (ms) per request id, joined to its Worker/Decode parent span."""
    spans = read_spans_jsonl(trace_file)
    rid_of = {
        s["span_id"]: s["attributes"].get("pdmesh.request_id") for s in spans if s["name"] == "Worker/Decode"
    }
    return {
        rid_of.get(s["parent_id"], "?"): (s["end_ns"] - s["start_ns"]) / 1e6
        for s in spans
        if s["name"] == "kv_transfer"
    }


async def measure(
    prefill_proc: ServiceProcess, decode_proc: ServiceProcess, args, vocab: int
) -> dict[str, Any]:
    rng = random.Random(1)
    rows: dict[str, list[dict[str, float]]] = {"disaggregated": [], "colocated": []}
    async with (
        grpc.aio.insecure_channel(prefill_proc.address) as pch,
        grpc.aio.insecure_channel(decode_proc.address) as dch,
    ):
        prefill = worker_pb2_grpc.WorkerStub(pch)
        decode = worker_pb2_grpc.WorkerStub(dch)
        for i in range(args.warmup + args.reps):
            for mode in ("disaggregated", "colocated") if i % 2 == 0 else ("colocated", "disaggregated"):
                prompt = [rng.randrange(0, vocab) for _ in range(args.prompt_len)]
                rid = f"{mode}-{i}"
                if mode == "disaggregated":
                    r = await disaggregated(prefill, decode, decode_proc.metrics_address, rid, prompt)
                else:
                    r = await colocated(decode, rid, prompt)
                r["rid"] = rid  # type: ignore[assignment]
                r["warmup"] = i < args.warmup  # type: ignore[assignment]
                log.info("%s %s", mode, json.dumps(r))
                rows[mode].append(r)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--num-kv-blocks", type=int, default=2048)
    parser.add_argument("--smoke", action="store_true", help="tiny-dense on the CPU over host memory")
    parser.add_argument("--out", default=os.environ.get("OUT") or "disagg_ttft_out")
    args = parser.parse_args(argv)
    out = setup_output(args.out, "disagg_ttft.log")
    workdir = Path(tempfile.mkdtemp(prefix="pdmesh-disagg-"))
    trace_file = workdir / "spans.jsonl"
    if args.smoke:
        model, vocab = "tiny-dense", 256
        engine_args = ["--model", model, "--device", "cpu", "--dtype", "float32"]
    else:
        (workdir / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
        vocab = LLAMA_3_1_8B["vocab_size"]
        engine_args = [
            "--model",
            str(workdir),
            "--device",
            "cuda",
            "--dtype",
            "bfloat16",
            "--kernel-backend",
            "triton",
            "--load-format",
            "dummy",
        ]
    common = [
        *engine_args,
        "--num-kv-blocks",
        str(args.num_kv_blocks),
        "--kv-transfer",
        "nixl",
        "--max-num-batched-tokens",
        "8192",
        "--max-model-len",
        "8192",
        "--trace-file",
        str(trace_file),
    ]
    started = time.perf_counter()
    procs: dict[str, ServiceProcess] = {}
    try:
        # Both start at once; the decode worker's Prometheus endpoint gives the pull time of each request.
        with ThreadPoolExecutor(2) as pool:
            futures = {
                module: pool.submit(
                    ServiceProcess.start, module, *common, "--metrics-port", port, timeout=600
                )
                for module, port in (("prefill_svc", "-1"), ("decode_svc", "0"))
            }
            for module, fut in futures.items():
                try:
                    procs[module] = fut.result()
                except Exception:
                    log.exception("%s did not start", module)
        if len(procs) < 2:
            raise RuntimeError("a worker did not start")
        log.info("workers ready in %.1f s", time.perf_counter() - started)
        rows = asyncio.run(measure(procs["prefill_svc"], procs["decode_svc"], args, vocab))
    except BaseException:
        for proc in procs.values():
            log.error("%s log tail:\n%s", proc.module, "\n".join(proc.lines[-60:]))
        raise
    finally:
        for proc in procs.values():
            proc.stop()
            (out / f"{proc.module}.log").write_text(proc.log() + "\n")
    imports = import_spans(trace_file)
    for r in rows["disaggregated"]:
        r["import_ms"] = imports.get(r["rid"], float("nan"))  # type: ignore[index]

    def med(mode: str, key: str) -> float:
        values = [r[key] for r in rows[mode] if not r["warmup"] and key in r]
        return statistics.median(values) if values else float("nan")

    d0, d1, c0, c1 = (
        med("disaggregated", "token0_ms"),
        med("disaggregated", "token1_ms"),
        med("colocated", "token0_ms"),
        med("colocated", "token1_ms"),
    )
    result = {
        "prompt_len": args.prompt_len,
        "reps": args.reps,
        "device": "cpu" if args.smoke else "cuda",
        "disaggregated": {
            "token0_ms": d0,
            "token1_ms": d1,
            "pull_ms": med("disaggregated", "pull_ms"),
            "import_ms": med("disaggregated", "import_ms"),
            "handoff_ms": med("disaggregated", "handoff_ms"),
        },
        "colocated": {"token0_ms": c0, "token1_ms": c1},
        "overhead_token1_pct": 100 * (d1 / c1 - 1),
        "overhead_token0_pct": 100 * (d0 / c0 - 1),
        "rows": rows,
    }
    (out / "disagg_ttft.json").write_text(json.dumps(result, indent=1))
    dd = result["disaggregated"]
    print(
        f"\nTTFT, {args.prompt_len}-token prompt, median of {args.reps} (after {args.warmup} warm-up each)\n"
        "| mode | token 0 ms | token 1 ms | KV pull ms | KV import ms | prefill answer -> token 1 ms |\n"
        "|---|---:|---:|---:|---:|---:|\n"
        f"| disaggregated | {d0:.1f} | {d1:.1f} | {dd['pull_ms']:.2f} | {dd['import_ms']:.2f} | {dd['handoff_ms']:.1f} |\n"
        f"| colocated | {c0:.1f} | {c1:.1f} | - | - | - |\n"
        f"disaggregation adds {result['overhead_token1_pct']:+.1f}% at token 1 and "
        f"{result['overhead_token0_pct']:+.1f}% at token 0 (target: <= 5% at 4k) -> "
        f"{'MET' if result['overhead_token1_pct'] <= 5 else 'NOT MET'}",
        flush=True,
    )


if __name__ == "__main__":
    main()
