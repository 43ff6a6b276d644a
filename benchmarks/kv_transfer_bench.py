"""KV transfer throughput, prefill -> decode, over NIXL between two processes, against a local-copy roofline.

A child process (the prefill side) owns a KV pool and a NIXL agent; the parent (the decode side) handshakes once
and READs 16 ... 4096 blocks, placed as one contiguous run (one descriptor) or scattered every other block
(one descriptor per block), with notifications, as the decode service does. For each size it also times a
plain copy of the same number of bytes inside one process (host memcpy on the CPU, device-to-device copy on
CUDA), which is the roofline the ratio is taken against.

    python benchmarks/kv_transfer_bench.py                  # CPU, small-model layout (128 KiB blocks)
    python benchmarks/kv_transfer_bench.py --device cuda    # one GPU, both processes, Llama-3.1-8B layout (2 MiB)
    python benchmarks/kv_transfer_bench.py --device cuda --source cpu   # the source's pool in host memory

``--source cpu`` / ``cpu-pinned`` put the source's pool in host memory (pageable, or page-locked through CUDA),
as the KV offload store's host tier is, read into the GPU pool: the roofline is then a host-to-device copy of
the same bytes from page-locked memory in one process.

This is a benchmark, not a test: it prints a table and checks only that the bytes it read are the right ones.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

# NIXL's Python logger writes INFO lines to stdout; keep the table readable unless the user asked otherwise.
os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from mesh.kv_layout import KVLayout  # noqa: E402
from mesh.kv_transfer import KVTransferAgent, coalesce_runs, create_transfer_agent  # noqa: E402

LAYOUTS = {
    # Small dense model on the CPU: 8 layers x 2 x 16 tokens x 2 KV heads x 64 x fp32 = 128 KiB per block.
    "cpu": KVLayout("bench-small", "float32", block_size=16, num_layers=8, num_kv_heads=2, head_dim=64),
    # Llama-3.1-8B: 32 layers x 2 x 16 tokens x 8 KV heads x 128 x bf16 = 2 MiB per block.
    "cuda": KVLayout(
        "bench-llama-3.1-8b", "bfloat16", block_size=16, num_layers=32, num_kv_heads=8, head_dim=128
    ),
}
MARK_MOD = 251  # block i is filled with i % 251, exact in bf16 too


@dataclass
class Row:
    mode: str
    placement: str
    blocks: int
    nbytes: int
    descriptors: int
    ms: float
    gbps: float
    copy_gbps: float

    @property
    def ratio(self) -> float:
        return self.gbps / self.copy_gbps


def make_pool(num_blocks: int, layout: KVLayout, device: str, huge: bool = False) -> torch.Tensor:
    """``device``: cpu, cuda, or cpu-pinned (host memory page-locked through CUDA); ``huge``: host memory on
    transparent huge pages (``mesh.host_memory``, as the KV offload store's pool and a worker's staging)."""
    pinned = device == "cpu-pinned"
    device = "cpu" if pinned else device
    if huge and device == "cpu":
        from mesh.host_memory import HostBlocks

        return HostBlocks((num_blocks, *layout.block_shape), getattr(torch, layout.dtype), pin=pinned).tensor
    pool = torch.empty(
        num_blocks, *layout.block_shape, dtype=getattr(torch, layout.dtype), device=device, pin_memory=pinned
    )
    pool.fill_(0)  # touch every page now, not inside the timed region
    return pool


def prefill_side(
    conn: Connection, num_blocks: int, layout: KVLayout, device: str, huge: bool = False
) -> None:
    """Child process: own a pool whose block i holds i % 251, serve READs, drain notifications until told to stop."""
    pool = make_pool(num_blocks, layout, device, huge)
    marks = (torch.arange(num_blocks, device=pool.device) % MARK_MOD).to(pool.dtype)
    pool.view(num_blocks, -1).copy_(marks[:, None].expand(num_blocks, pool[0].numel()))
    if device == "cuda":
        torch.cuda.synchronize()
    agent = create_transfer_agent("nixl", "bench-prefill", pool, layout)
    conn.send(agent.metadata())
    notifications = 0
    while not conn.poll(0.01):
        notifications += sum(map(len, agent.get_notifications().values()))
    conn.recv()
    notifications += sum(map(len, agent.get_notifications().values()))
    conn.send(notifications)
    agent.close()


def placements(n: int) -> dict[str, tuple[list[int], list[int]]]:
    every_other = list(range(0, 2 * n, 2))
    return {"contiguous": (list(range(n)), list(range(n))), "scattered": (every_other, every_other)}


def check_marks(pool: torch.Tensor, local: list[int], remote: list[int]) -> None:
    flat = pool.view(pool.shape[0], -1)
    idx = torch.tensor(local, device=pool.device)
    want = (torch.tensor(remote, device=pool.device) % MARK_MOD).to(pool.dtype)
    if not (torch.equal(flat[idx, 0], want) and torch.equal(flat[idx, -1], want)):
        raise SystemExit("KV transfer benchmark read the wrong bytes")


def time_reads(
    agent: KVTransferAgent, peer: str, remote: list[int], local: list[int], min_time_s: float, min_iters: int
) -> list[float]:
    for i in range(2):  # warm-up: connection, registration caches
        h = agent.start_read(peer, remote, local, b"warmup-%d" % i)
        agent.wait(h, timeout_s=120)
        agent.release(h)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_iters or (time.perf_counter() - start < min_time_s and len(times) < 1000):
        t0 = time.perf_counter()
        h = agent.start_read(peer, remote, local, b"req-%d" % len(times))
        agent.wait(h, timeout_s=120)
        times.append(time.perf_counter() - t0)
        agent.release(h)
    return times


def time_copy(nbytes: int, device: str, min_time_s: float, min_iters: int, from_host: bool = False) -> float:
    """Median seconds of one plain copy of ``nbytes`` in this process (the roofline).

    On the CPU it is one thread's memcpy (``numpy.copyto``), like the single ``process_vm_readv`` stream UCX's
    ``cma`` transport uses; torch's multi-threaded ``copy_`` collapses on a loaded 2-core machine. With
    ``from_host``, a host-to-device copy from page-locked memory.
    """
    device = "cpu" if device == "cpu-pinned" else device
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=from_host, device="cpu" if from_host else device)
    src.fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device).fill_(0)
    if device == "cuda":

        def copy() -> None:
            dst.copy_(src)
            torch.cuda.synchronize()
    else:
        src_np, dst_np = src.numpy(), dst.numpy()

        def copy() -> None:
            np.copyto(dst_np, src_np)

    for _ in range(2):
        copy()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < min_iters or (time.perf_counter() - start < min_time_s and len(times) < 1000):
        t0 = time.perf_counter()
        copy()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--device", choices=["cpu", "cuda", "cpu-pinned"], default="cpu", help="the reader's pool memory"
    )
    ap.add_argument("--layout", choices=sorted(LAYOUTS), help="default: cuda's for cuda, else cpu's")
    ap.add_argument("--blocks", default="16,64,256,1024,4096", help="comma-separated block counts")
    ap.add_argument("--modes", default="coalesced,prepped", help="NIXL agent xfer modes to compare")
    ap.add_argument(
        "--min-time", type=float, default=0.5, help="seconds of timed transfers per row (at least)"
    )
    ap.add_argument("--min-iters", type=int, default=5)
    ap.add_argument(
        "--host-pages",
        choices=["4k", "huge"],
        default="4k",
        help="host pools on plain pages or on transparent huge pages (the KV offload store's and staging's)",
    )
    ap.add_argument(
        "--source",
        choices=["same", "cpu", "cpu-pinned"],
        default="same",
        help="the source pool's memory: the reader's device, or host memory (pageable or page-locked)",
    )
    ap.add_argument(
        "--progress-thread",
        choices=["both", "source"],
        default="both",
        help="which NIXL agents run a UCX progress thread (each keeps a core busy; the source's is required)",
    )
    ap.add_argument("--threads", type=int, default=0, help="NIXL's num_threads for the reader's UCX backend")
    args = ap.parse_args()

    layout = LAYOUTS[args.layout or ("cuda" if args.device == "cuda" else "cpu")]
    device = args.device
    sizes = [int(x) for x in args.blocks.split(",")]
    modes = args.modes.split(",")
    pool_blocks = 2 * max(sizes)  # room for the scattered placement
    pool_gib = pool_blocks * layout.block_nbytes / 2**30
    print(
        f"layout {layout.num_layers} layers, {layout.num_kv_heads} KV heads, head_dim {layout.head_dim}, "
        f"{layout.dtype}, block {layout.block_size}: {layout.block_nbytes / 2**10:.0f} KiB per block; "
        f"two pools of {pool_blocks} blocks ({pool_gib:.2f} GiB each) on {device}",
        file=sys.stderr,
    )

    # The roofline first, while no NIXL progress thread competes for the cores.
    source = device if args.source == "same" else args.source
    from_host = device == "cuda" and source != device
    copy_s = {
        n: time_copy(n * layout.block_nbytes, device, args.min_time, args.min_iters, from_host) for n in sizes
    }
    if device == "cuda":
        torch.cuda.empty_cache()  # hand the copy buffers back before the pools are allocated

    reader_progress = args.progress_thread == "both"
    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    huge = args.host_pages == "huge"
    child = ctx.Process(
        target=prefill_side, args=(child_conn, pool_blocks, layout, source, huge), daemon=True
    )
    child.start()
    pool = make_pool(pool_blocks, layout, device, huge)
    meta = conn.recv()
    first_read_ms: dict[str, float] = {}
    rows: list[Row] = []
    for mode in modes:
        # One decode agent at a time: each agent's progress thread holds a core.
        agent = create_transfer_agent(
            "nixl", f"bench-decode-{mode}", pool, layout, xfer_mode=mode, progress_thread=reader_progress,
            num_threads=args.threads,
        )  # fmt: skip
        t0 = time.perf_counter()
        peer = agent.add_peer(meta)
        h = agent.start_read(peer, [0], [0], b"first")
        agent.wait(h, timeout_s=120)
        agent.release(h)
        first_read_ms[mode] = (time.perf_counter() - t0) * 1e3
        for n in sizes:
            for placement, (remote, local) in placements(n).items():
                pool.view(pool_blocks, -1)[local, 0] = -1  # a stale mark must not pass the check
                times = time_reads(agent, peer, remote, local, args.min_time, args.min_iters)
                check_marks(pool, local, remote)
                med = statistics.median(times)
                nbytes = n * layout.block_nbytes
                # coalesced posts one descriptor per run; prepped posts one index per block (NIXL may merge)
                descs = len(coalesce_runs(local, remote)) if mode == "coalesced" else n
                row = Row(
                    mode, placement, n, nbytes, descs, med * 1e3, nbytes / med / 1e9, nbytes / copy_s[n] / 1e9
                )
                rows.append(row)
                print(
                    f"  {mode:9s} {placement:10s} {n:5d} blocks: {row.ms:9.3f} ms  {row.gbps:7.2f} GB/s "
                    f"({len(times)} reads)",
                    file=sys.stderr,
                )
        agent.close()
        del agent

    conn.send("stop")
    notifications = conn.recv()
    child.join(timeout=30)

    print()
    device_name = torch.cuda.get_device_name() if device == "cuda" else f"CPU, {os.cpu_count()} cores"
    print(
        f"KV transfer, NIXL READ between two processes ({device_name}), {layout.block_nbytes / 2**10:.0f} KiB blocks, "
        f"source pool on {source}, read into {device}, host pages {args.host_pages}"
    )
    print(
        "first read after handshake (connection set-up): "
        + ", ".join(f"{m} {ms:.1f} ms" for m, ms in first_read_ms.items())
    )
    print(
        f"progress threads: {args.progress_thread}; notifications received by the prefill side: "
        f"{notifications}"
    )
    copy_name = ("H2D copy" if from_host else "D2D copy") if device == "cuda" else "memcpy"
    header = f"| mode | placement | blocks | MiB | descs posted | ms/xfer | GB/s | {copy_name} GB/s | ratio |"
    print(header)
    print("|" + "---|" * 9)
    for r in rows:
        print(
            f"| {r.mode} | {r.placement} | {r.blocks} | {r.nbytes / 2**20:.0f} | {r.descriptors} | {r.ms:.3f} "
            f"| {r.gbps:.2f} | {r.copy_gbps:.2f} | {r.ratio:.2f} |"
        )


if __name__ == "__main__":
    main()
