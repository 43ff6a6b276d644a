"""Decode with several expert-parallel ranks on one host: CUDA graphs against eager passes, and one GPU.

Each of ``--world`` processes is one rank with one GPU (NCCL): data-parallel attention over its own
``batch`` sequences, the Qwen3-30B-A3B-shaped MoE layers' experts split between the ranks
(``AllGatherDispatcher``), random bf16 weights (``load_format="dummy"``). Sequences enter as a decode
worker's do (``reserve_import`` + ``commit_import``, ``--ctx`` tokens of context already in the pool), and
the ranks step together (``engine.data_parallel.Lockstep``). Per batch, the same engines run:

- ``graphs``: each pass replays the decode graph of the bucket the ranks agree on;
- ``device-flags``: the same, with the lockstep's per-step flags exchanged as device tensors over NCCL
  instead of host tensors over gloo;
- ``graphs-async``: the same with asynchronous scheduling (``expert_parallel_async_scheduling``): each
  rank launches a step while the one before runs, so its step time is the timed loop's wall time over its
  steps (no device synchronisation between them);
- ``eager``: the graphs (decode and prefill) put aside, every pass runs eagerly (with a host exchange of
  the ranks' token counts);
- ``prefill-join``: the graphs in place, and in each timed step a new ``--join-tokens`` prompt joins rank
  0's batch (one output token): what an arriving prompt costs every rank's decoding. With several ranks
  every rank replays that step's prefill graphs (the bucket that holds rank 0's step: the other ranks'
  decode batches are padded to it); with ``--world 1`` it is the one GPU's mixed step. Its roofline
  columns are left empty (nan), and the run's ``max_num_seqs`` has one more sequence for it;
- ``prefill-join-eager``: the same with the prefill graphs put aside, so that step runs eagerly on
  every rank (as it did before the ranks agreed on prefill graphs).

``--world 1`` runs the same steps on one GPU holding every expert (no exchange), for reference.

Each row: the median step (wall, rank 0: the host's agreement, the pass and sampling), the part of a step
spent in the lockstep's flag exchanges (rank 0, mean), the median graph
replay (device time, both ranks replaying together), tokens/s over all ranks, and the roofline of one rank:
the bytes it must read from HBM in a step (non-expert weights, its experts that the group's tokens
activate, counted from the router per layer, and its KV) over the measured copy rate. The exchanges'
NVLink traffic is not in the roofline.

Run from the repository root on a host with ``--world`` GPUs:
``PYTHONUNBUFFERED=1 python3 benchmarks/ep_bench.py --world 2 --out DIR``; the table is printed last.
``--smoke`` runs the same code on the CPU (gloo, the torch ops, float32, small shapes, no graphs) to check
its plumbing; its times mean nothing.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.multiprocessing as mp

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from common import copy_gbps  # noqa: E402
from gpu_bench import QWEN3_30B_A3B, count_weights, cuda_median_ms, write_config  # noqa: E402

log = logging.getLogger("ep_bench")


def _rank(rank: int, world: int, port: int, args: argparse.Namespace, out: dict) -> None:
    from engine import EngineConfig, LLMEngine, SamplingParams
    from engine.data_parallel import Lockstep

    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s r{rank} %(name)s %(message)s")
    faulthandler.dump_traceback_later(args.watchdog, exit=True)  # a rank stuck in a collective: its stack
    cuda = not args.smoke
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    cfg = dict(QWEN3_30B_A3B)
    if args.layers:
        cfg["num_hidden_layers"] = args.layers
    model_dir = write_config(cfg, smoke=args.smoke)
    batches = [int(b) for b in args.batches.split(",")]
    steps = args.warmup + args.steps
    # Room for one joining prompt beside the batch.
    joins = any(m.startswith("prefill-join") for m in args.modes.split(","))
    blocks = max(batches) * -(-(args.ctx + steps + 16) // 16) + joins * -(-(args.join_tokens + 16) // 16)
    ep = {"expert_parallel_size": world, "expert_parallel_rank": rank} if world > 1 else {}
    engine = LLMEngine(
        EngineConfig(
            model=str(model_dir), device="cuda" if cuda else "cpu", dtype="bfloat16" if cuda else "float32",
            kernel_backend="triton" if cuda else "torch",
            load_format="dummy", num_kv_blocks=blocks, max_num_seqs=max(batches) + joins, max_model_len=8192,
            distributed_init_method=f"tcp://127.0.0.1:{port}", async_scheduling=True,
            expert_parallel_async_scheduling=True, **ep,
        )
    )  # fmt: skip
    with torch.no_grad():
        engine.kv_pool.normal_()
    runner = engine.runner
    graphs, prefill_graphs = runner.graphs, runner.prefill_graphs
    locksteps = {
        "host": Lockstep.for_engine(engine),
        "device": Lockstep.for_engine(engine, flags_on_device=True),
    }
    wb = count_weights(
        engine.model_config, engine.model.embed_tokens.element_size(), engine.kv_pool.element_size()
    )
    hbm = copy_gbps() if rank == 0 and cuda else float("nan")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    vocab = engine.vocab_size
    rows = []
    for batch in batches:
        for mode in args.modes.split(","):
            lockstep = locksteps["device" if mode == "device-flags" else "host"]
            step = lockstep.step if lockstep else engine.step
            runner.graphs = None if mode == "eager" else graphs  # every rank puts its graphs aside alike
            runner.prefill_graphs = None if mode in ("eager", "prefill-join-eager") else prefill_graphs
            ahead = mode == "graphs-async"
            engine.config.async_scheduling = ahead  # the engine reads it at each step
            runner.group_batch = lockstep._agree if lockstep else None
            print(f"rank {rank}: batch {batch}, {mode}", flush=True)
            rng = np.random.default_rng(rank * 7919 + batch)
            params = SamplingParams(max_tokens=steps + 8, ignore_eos=True, temperature=0.0)
            rids = []
            for i in range(batch):
                rid = f"r{rank}-{mode}-b{batch}-{i}"
                engine.reserve_import(rid, rng.integers(0, vocab, args.ctx).tolist(), params)
                engine.commit_import(rid, int(rng.integers(0, vocab)))
                rids.append(rid)
            for _ in range(args.warmup):
                step()
            engine.take_expert_counts()
            step()
            counts = engine.take_expert_counts()  # this rank's tokens over all physical experts
            times = []
            joined = 0  # prefill-join prompts answered on this rank within their step
            synced = lockstep.sync_seconds if lockstep else 0.0
            lookahead = engine.lookahead_steps
            sync()
            prof = _profiler(cuda) if rank == 0 and mode in args.profile.split(",") else None
            if prof is not None:
                prof.__enter__()
            loop_started = time.perf_counter()
            for i in range(args.steps):
                if mode.startswith("prefill-join") and rank == 0:  # a new prompt joins rank 0's batch
                    engine.add_request(
                        f"j{rank}-b{batch}-{i}", rng.integers(0, vocab, args.join_tokens).tolist(),
                        SamplingParams(max_tokens=1, temperature=0.0),
                    )  # fmt: skip
                if not ahead:  # each step alone; running ahead, the loop's mean is what counts
                    sync()
                t = time.perf_counter()
                outputs = step() or []
                if not ahead:
                    sync()
                times.append(time.perf_counter() - t)
                joined += sum(o.finished and o.request_id.startswith("j") for o in outputs)
            sync()
            if ahead:
                times = [(time.perf_counter() - loop_started) / args.steps]
            if prof is not None:
                prof.__exit__(None, None, None)
                _write_profile(
                    prof, Path(args.out) / f"profile_w{world}_b{batch}_{mode}.txt", args.steps, cuda
                )
            lookahead = engine.lookahead_steps - lookahead
            sync_ms = ((lockstep.sync_seconds if lockstep else 0.0) - synced) / args.steps * 1e3
            replay_ms = float("nan")
            if mode == "graphs" and graphs is not None:
                size = graphs.bucket_for(batch)
                replay_ms = cuda_median_ms(lambda size=size: graphs.replay(size), iters=20)
            for rid in rids:
                engine.abort(rid)
            if lockstep is not None:
                while lockstep.step() is not None:  # every rank leaves in the same step
                    pass
            while engine.has_unfinished():
                engine.step()
            if rank == 0:
                print(f"rank 0: batch {batch}, {mode}: step {statistics.median(times) * 1e3:.2f} ms, "
                      f"flags {sync_ms:.2f} ms, graph {replay_ms:.2f} ms", flush=True)  # fmt: skip
            rows.append(
                dict(batch=batch, mode=mode, step_ms=statistics.median(times) * 1e3, replay_ms=replay_ms,
                     sync_ms=sync_ms, joined=joined, lookahead=lookahead,
                     counts=counts.tolist() if counts is not None else None)
            )  # fmt: skip
    out[rank] = {"rows": rows, "hbm": hbm, "wb": wb.__dict__, "layers": engine.model_config.num_layers}
    # The last mode may have put them aside: close releases them before the group.
    runner.graphs, runner.prefill_graphs = graphs, prefill_graphs
    engine.close()


def _profiler(cuda: bool) -> Any:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    return profile(activities=acts)


def _write_profile(prof: Any, path: Path, steps: int, cuda: bool) -> None:
    """The timed steps' ops by host time and by device time (``--profile``), per step."""
    path.parent.mkdir(parents=True, exist_ok=True)
    avg = prof.key_averages()
    parts = [f"{steps} steps; totals over them\n", avg.table(sort_by="self_cpu_time_total", row_limit=40)]
    if cuda:
        parts.append(avg.table(sort_by="self_cuda_time_total", row_limit=30))
    path.write_text("\n".join(parts))


def roofline_ms(wb: dict[str, Any], counts_all: list[list[list[int]]], world: int, rank: int,
                batch: int, ctx: int, hbm: float) -> float:  # fmt: skip
    """One rank's bytes per step over the copy rate: its non-expert weights, its physical experts that any
    rank's tokens activate (per layer), its KV."""
    layers = np.array(counts_all[0]).shape[0]
    total = np.sum(np.array(counts_all), axis=0)  # [layers, physical experts], all ranks' tokens
    per_rank = total.shape[1] // world
    local = total[:, rank * per_rank : (rank + 1) * per_rank]
    experts = float((local > 0).sum()) / layers * wb["moe_layers"]
    kv = batch * (ctx + 8) * wb["kv_bytes_per_token"]
    return (wb["per_step_dense"] + experts * wb["per_expert"] + kv) / hbm / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=max(1, torch.cuda.device_count()))
    p.add_argument("--batches", default="1,16,64", help="sequences per rank")
    p.add_argument("--ctx", type=int, default=512)
    p.add_argument("--modes", default="graphs,device-flags,eager")
    p.add_argument("--join-tokens", type=int, default=512, help="prompt length of the prefill-join mode")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--layers", type=int, default=0, help="override num_hidden_layers (0: the model's 48)")
    p.add_argument(
        "--watchdog", type=float, default=900, help="seconds before a rank dumps its stack and exits"
    )
    p.add_argument(
        "--profile", default="", help="modes whose timed steps rank 0 profiles (torch.profiler) into --out"
    )
    p.add_argument("--smoke", action="store_true", help="the CPU, small shapes: checks the plumbing only")
    p.add_argument("--out", default=os.environ.get("OUT", "ep_bench_out"))
    args = p.parse_args()
    if not args.smoke and torch.cuda.device_count() < args.world:
        sys.exit(f"--world {args.world} needs as many GPUs; {torch.cuda.device_count()} visible")
    from mesh.cli import free_port

    out = mp.Manager().dict()
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    mp.spawn(_rank, args=(args.world, free_port(), args, out), nprocs=args.world, join=True)
    hbm = out[0]["hbm"]
    table = []
    for i, row in enumerate(out[0]["rows"]):
        counts = [out[r]["rows"][i]["counts"] for r in range(args.world)]
        roof = roofline_ms(out[0]["wb"], counts, args.world, 0, row["batch"], args.ctx, hbm)
        if row["mode"].startswith("prefill-join"):  # a prefill's step: not what the decode roofline says
            roof = float("nan")
        best = row["replay_ms"] if row["replay_ms"] == row["replay_ms"] else row["step_ms"]
        table.append(
            dict(world=args.world, batch_per_rank=row["batch"], mode=row["mode"], step_ms=row["step_ms"],
                 sync_ms=row["sync_ms"],
                 replay_ms=row["replay_ms"], tok_s=args.world * row["batch"] / row["step_ms"] * 1e3,
                 roofline_ms=roof, pct_roofline=100 * roof / best, joined=row["joined"],
                 lookahead=row["lookahead"])
        )  # fmt: skip
    path = Path(args.out)
    path.mkdir(parents=True, exist_ok=True)
    (path / f"ep_bench_w{args.world}.json").write_text(
        json.dumps({"started": started, "ctx": args.ctx, "hbm_gbps": hbm, "rows": table}, indent=1)
    )
    print(
        f"\nexpert-parallel decode, {args.world} rank(s), ctx {args.ctx}, copy rate {hbm:.0f} GB/s ({started})"
    )
    print(
        "| ranks | batch/rank | mode | step ms | flags ms | graph ms | tok/s (all ranks) | roofline ms | % |"
    )
    print("|---:|---:|---|---:|---:|---:|---:|---:|---:|")
    for r in table:
        print(
            f"| {r['world']} | {r['batch_per_rank']} | {r['mode']} | {r['step_ms']:.2f} | {r['sync_ms']:.2f} "
            f"| {r['replay_ms']:.2f} "
            f"| {r['tok_s']:.0f} | {r['roofline_ms']:.2f} | {r['pct_roofline']:.0f} |"
        )


if __name__ == "__main__":
    main()
