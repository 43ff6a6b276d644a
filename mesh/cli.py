"""The ``pdmesh`` command: ``up`` (a whole mesh on this machine), ``serve`` (one service), ``demo`` (a mesh
answering one request), ``bench`` (drive a running mesh).

Services are started by module name in their own processes (``python -m prefill_svc ...``); this
module never imports a service package.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mesh.config import add_arguments, dtype_setting, from_sources, quantization_setting, setting
from mesh.kv_layout import KV_CACHE_DTYPES

SERVICES = {
    "router": "router",
    "prefill": "prefill_svc",
    "decode": "decode_svc",
    "eplb": "eplb_svc",
    "kvstore": "kvstore_svc",
}
REPO = Path(__file__).resolve().parent.parent


def _ephemeral_range() -> tuple[int, int]:
    """The kernel's range for ports bound to 0 and outgoing connections (Linux: /proc; else its default)."""
    try:
        lo, hi = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
        return lo, hi
    except (OSError, ValueError):
        return 32768, 60999


def free_port(host: str = "127.0.0.1") -> int:
    """A port free now, for a child process to bind later. It is drawn below the kernel's ephemeral range:
    a port from that range can be taken in between by any process's outgoing connection or port-0 listener
    (the workers' NIXL agents and gRPC channels open many), which once made the router fail to bind."""
    lo = _ephemeral_range()[0]
    first = max(1024, lo - 12288)
    if lo - first >= 1024:
        for port in random.sample(range(first, lo), 64):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range: ask the kernel
        s.bind((host, 0))
        return s.getsockname()[1]


CPU_NUM_KV_BLOCKS = 2048  # a CPU worker's pool when none is given


def worker_gpus(spec: str | None, env: dict[str, str]) -> list[str]:
    """The GPUs ``pdmesh up`` hands its workers, one each in turn: ``spec`` (comma-separated ids) when
    given, else the ids in ``CUDA_VISIBLE_DEVICES``, else every GPU ``nvidia-smi -L`` lists; none when no
    GPU can be found (the workers then see what the launcher sees)."""
    if spec:
        return [g.strip() for g in spec.split(",") if g.strip()]
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g.strip() for g in visible.split(",") if g.strip()]
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, _ in enumerate(line for line in listed.splitlines() if line.startswith("GPU "))]


@dataclass
class Child:
    name: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)  # on top of the launcher's environment
    proc: subprocess.Popen | None = None
    lines: list[str] = field(default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)
    wave: int = 0  # start-up wave: a worker starts once every worker of the waves before is ready

    def start(self, env: dict[str, str], echo: bool) -> None:
        self.proc = subprocess.Popen(
            self.argv,
            env={**env, **self.env},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._pump, args=(echo,), daemon=True).start()

    def _pump(self, echo: bool) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            self.lines.append(line)
            if " ready:" in line or "listening" in line:
                self.ready.set()
            if echo:
                print(f"[{self.name}] {line}", flush=True)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def terminate(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def wait(self, timeout: float) -> None:
        if self.proc is None:
            return
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


class Mesh:
    """A router, prefill and decode workers on loopback, each its own process."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.host = args.host
        self.children: list[Child] = []
        self.prefill_addrs: list[str] = []
        self.decode_addrs: list[str] = []
        self.grpc_port = args.port or free_port(self.host)
        self.http_port = args.http_port or free_port(self.host)
        self.router_argv: list[str] = []
        self.eplb_addr = ""
        self.kvstore_addr = ""

    def _worker_argv(self, module: str, port: int) -> list[str]:
        a = self.args
        argv = [
            sys.executable,
            "-m",
            module,
            "--host",
            self.host,
            "--port",
            str(port),
            "--model",
            a.model,
            "--device",
            a.device,
            "--dtype",
            a.dtype,
            "--quantization",
            a.quantization,
            "--kv-cache-dtype",
            a.kv_cache_dtype,
            "--block-size",
            str(a.block_size),
            "--metrics-port",
            "0",
            "--kv-transfer",
            a.kv_transfer,
        ]
        if a.num_kv_blocks:
            argv += ["--num-kv-blocks", str(a.num_kv_blocks)]
        elif a.device == "cpu":
            argv += ["--num-kv-blocks", str(CPU_NUM_KV_BLOCKS)]
        if a.redis_url:
            argv += ["--redis-url", a.redis_url]
        if a.max_model_len:
            argv += ["--max-model-len", str(a.max_model_len)]
        if a.enable_lora:  # every worker the same: prefill and decode must run a request's adapter alike
            argv += [
                "--enable-lora",
                "--max-loras",
                str(a.max_loras),
                "--max-lora-rank",
                str(a.max_lora_rank),
            ]
        if a.lora_modules:  # without enable_lora the workers refuse it at start, saying so
            argv += ["--lora-modules", *a.lora_modules]
        if a.speculative_config:  # every worker the same: an MTP draft's KV layer is in every block
            argv += ["--speculative-config", a.speculative_config]
        return argv + a.worker_arg

    def plan(self, env: dict[str, str]) -> None:
        """The children to start (workers, then the router), with their flags and, on CUDA, their GPUs:
        each worker in turn (prefill workers first) gets the next of ``worker_gpus`` as its only visible
        GPU, so an expert-parallel rank or a worker of its own gets a GPU of its own while there are enough."""
        a = self.args
        gpus = worker_gpus(a.gpus, env) if a.device == "cuda" else []
        workers = a.num_prefill + a.num_decode
        if gpus and len(gpus) < workers:
            print(
                f"pdmesh: {workers} workers share {len(gpus)} GPUs ({','.join(gpus)})",
                file=sys.stderr,
                flush=True,
            )
        for role, count, addrs in (
            ("prefill", a.num_prefill, self.prefill_addrs),
            ("decode", a.num_decode, self.decode_addrs),
        ):
            ranks = count > 1 and (
                a.decode_expert_parallel if role == "decode" else a.prefill_expert_parallel
            )
            meet = f"tcp://{self.host}:{free_port(self.host)}"  # the ranks' rendezvous
            for i in range(count):
                port = free_port(self.host)
                addrs.append(f"{self.host}:{port}")
                argv = self._worker_argv(SERVICES[role], port)
                if ranks:
                    argv += ["--expert-parallel-size", str(count), "--expert-parallel-rank", str(i),
                             "--distributed-init-method", meet]  # fmt: skip
                child_env = {}
                wave = 0
                if gpus:
                    slot = len(self.children)
                    child_env = {"CUDA_VISIBLE_DEVICES": gpus[slot % len(gpus)]}
                    # Expert-parallel ranks meet as they start, so they start together.
                    wave = 0 if ranks else slot // len(gpus)
                    argv += self._memory_share(slot, len(gpus), workers)
                self.children.append(Child(f"{role}-{i}", argv, child_env, wave=wave))
        if a.eplb:
            self._plan_eplb()
        if a.kvstore:
            self._plan_kvstore()
        router_argv = [
            sys.executable,
            "-m",
            "router",
            "--host",
            self.host,
            "--port",
            str(self.grpc_port),
            "--http-port",
            str(self.http_port),
            "--model",
            a.model,
            "--routing",
            a.routing,
            "--tool-call-parser",
            a.tool_call_parser,
            "--reasoning-parser",
            a.reasoning_parser,
        ]
        if self.prefill_addrs:
            router_argv += ["--prefill-workers", *self.prefill_addrs]
        router_argv += ["--decode-workers", *self.decode_addrs]
        if a.redis_url:
            router_argv += ["--redis-url", a.redis_url]
        router_argv += a.router_arg
        self.router_argv = router_argv

    def _plan_eplb(self) -> None:
        """The EPLB controller, and the workers pointed at it (they retry until it is up, so it starts with
        the first wave)."""
        a = self.args
        port = free_port(self.host)
        self.eplb_addr = f"{self.host}:{port}"
        eplb_flags = ["--enable-eplb", "--num-redundant-experts", str(a.num_redundant_experts),
                      "--eplb-address", self.eplb_addr]  # fmt: skip
        for child in self.children:  # after "python -m <module>", before the --worker-arg flags (they win)
            child.argv[3:3] = eplb_flags
        argv = [sys.executable, "-m", SERVICES["eplb"], "--host", self.host, "--port", str(port),
                "--metrics-port", "0"]  # fmt: skip
        if a.redis_url:
            argv += ["--redis-url", a.redis_url]
        self.children.append(Child("eplb", argv + a.eplb_arg))

    def _plan_kvstore(self) -> None:
        """The KV offload store, with the workers' model and KV settings, and the workers pointed at it (a
        store not up yet is only skipped by a worker, so it starts with the first wave)."""
        a = self.args
        port = free_port(self.host)
        self.kvstore_addr = f"{self.host}:{port}"
        for child in self.children:  # after "python -m <module>", before the --worker-arg flags (they win)
            if child.name.startswith(("prefill", "decode")):
                child.argv[3:3] = ["--kvstore-address", self.kvstore_addr]
        argv = [sys.executable, "-m", SERVICES["kvstore"], "--host", self.host, "--port", str(port),
                "--metrics-port", "0", "--model", a.model, "--dtype", a.dtype, "--quantization", a.quantization,
                "--kv-cache-dtype", a.kv_cache_dtype, "--block-size", str(a.block_size),
                "--host-memory-gb", str(a.kvstore_memory_gb), "--kv-transfer", a.kv_transfer]  # fmt: skip
        if a.kvstore_disk_path:
            argv += ["--disk-path", a.kvstore_disk_path, "--disk-gb", str(a.kvstore_disk_gb)]
        if a.redis_url:
            argv += ["--redis-url", a.redis_url]
        if a.speculative_config:
            argv += ["--speculative-config", a.speculative_config]
        self.children.append(Child("kvstore", argv + a.kvstore_arg))

    def _memory_share(self, slot: int, num_gpus: int, workers: int) -> list[str]:
        """The ``--gpu-memory-utilization`` of the worker in ``slot``: its GPU's fraction over the workers
        that share the GPU; none where the pool's size is given (here or in --worker-arg)."""
        a = self.args
        sizing = ("--num-kv-blocks", "--kv-cache-memory-gb", "--gpu-memory-utilization")
        if a.num_kv_blocks or any(arg.split("=")[0] in sizing for arg in a.worker_arg):
            return []
        sharers = len(range(slot % num_gpus, workers, num_gpus))
        return ["--gpu-memory-utilization", f"{a.gpu_memory_utilization / sharers:.4f}"]

    def start(self, echo: bool = True, timeout: float = 120.0) -> None:
        env = dict(os.environ)
        env.setdefault("NIXL_LOG_LEVEL", "WARN")
        env["PYTHONUNBUFFERED"] = "1"
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        self.plan(env)
        # Workers sharing a GPU start in waves, each after the one before it is ready: a worker's memory
        # profile reads the device's free memory, which a neighbour loading meanwhile would disturb.
        for wave in sorted({child.wave for child in self.children}):
            starting = [child for child in self.children if child.wave == wave]
            for child in starting:
                child.start(env, echo)
            self._wait_ready(starting, timeout)
        router = Child("router", self.router_argv)
        self.children.append(router)
        router.start(env, echo)
        self._wait_http(timeout)

    def _wait_ready(self, children: list[Child], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for child in children:
            while not child.ready.wait(0.1):
                if not child.alive:
                    raise RuntimeError(
                        f"{child.name} exited during start-up:\n" + "\n".join(child.lines[-30:])
                    )
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{child.name} not ready after {timeout}s")

    def _wait_http(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        url = f"http://{self.host}:{self.http_port}/health"
        router = self.children[-1]
        while time.monotonic() < deadline:
            if not router.alive:
                raise RuntimeError("router exited during start-up:\n" + "\n".join(router.lines[-30:]))
            try:
                with urllib.request.urlopen(url, timeout=1) as resp:
                    if resp.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(0.1)
        raise TimeoutError(f"router HTTP not healthy at {url} after {timeout}s")

    def endpoints(self) -> str:
        lines = [
            f"  router gRPC   {self.host}:{self.grpc_port}   (pdmesh.v1.Router)",
            f"  OpenAI HTTP   http://{self.host}:{self.http_port}/v1   (/metrics on the same port)",
        ]
        lines += [f"  prefill       {addr}" for addr in self.prefill_addrs]
        lines += [f"  decode        {addr}" for addr in self.decode_addrs]
        if self.eplb_addr:
            lines.append(f"  eplb          {self.eplb_addr}   (pdmesh.v1.EPLB)")
        if self.kvstore_addr:
            lines.append(f"  kvstore       {self.kvstore_addr}   (pdmesh.v1.KVStore)")
        return "\n".join(lines)

    def stop(self, timeout: float = 30.0) -> None:
        for child in reversed(self.children):  # router first: no new work reaches the workers
            child.terminate()
            if child.name == "router":
                child.wait(timeout)
        for child in self.children:
            child.wait(timeout)


@dataclass
class LauncherSettings:
    """What ``pdmesh up`` and ``pdmesh demo`` start (flags and ``PDMESH_*`` twins through ``mesh.config``).
    The choices repeat ``EngineConfig``'s and ``RouterConfig``'s (``mesh`` imports neither the engine nor
    the router); tests/test_mesh_config.py checks that they agree."""

    model: str = setting(
        "tiny-dense",
        "Built-in model (tiny-dense, tiny-moe, tiny-deepseek) or a Hugging Face checkpoint directory.",
    )
    device: str = setting("cpu", "Device the workers' models run on.", choices=("cpu", "cuda"))
    gpus: str | None = setting(
        None,
        "With device cuda: GPU ids (comma-separated) handed to the workers one each in turn, prefill "
        "workers first, as their CUDA_VISIBLE_DEVICES; default: CUDA_VISIBLE_DEVICES's ids, else every GPU "
        "nvidia-smi lists. With fewer GPUs than workers they are reused from the first.",
    )
    dtype: str = dtype_setting()
    quantization: str = quantization_setting()
    kv_cache_dtype: str = setting(
        "auto",
        "The workers' KV cache dtype: auto (the weights' dtype), fp8 (float8 e4m3, half the bytes of a "
        "16-bit cache, with the checkpoint's KV scales where it has them) or fp8_e5m2 (float8 e5m2: wider "
        "range, less precision); every worker the same.",
        choices=tuple(KV_CACHE_DTYPES),
    )
    block_size: int = setting(16, "Tokens per KV block.")
    num_kv_blocks: int | None = setting(
        None,
        "KV pool size per worker, in blocks; default: 2048 on the CPU, and on GPUs each worker's pool takes "
        "its share of gpu_memory_utilization.",
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "With device cuda and no num_kv_blocks: the fraction of each GPU its workers may use together, split "
        "evenly among the workers that share it (each gets --gpu-memory-utilization of its part, and workers "
        "sharing a GPU start one after another, so that each one's memory profile sees the others' memory "
        "as taken).",
    )
    max_model_len: int | None = setting(
        None, "Longest prompt plus output, in tokens; default: the model's own limit."
    )
    num_prefill: int = setting(1, "Prefill workers to start.")
    num_decode: int = setting(1, "Decode workers to start.")
    prefill_expert_parallel: bool = setting(
        False,
        "The prefill workers are the expert-parallel ranks of one MoE model (num_prefill ranks, one GPU "
        "each on CUDA): each holds 1/num_prefill of the experts and serves its own requests.",
    )
    decode_expert_parallel: bool = setting(
        False,
        "The decode workers are the expert-parallel ranks of one MoE model, as prefill_expert_parallel.",
    )
    host: str = setting("127.0.0.1", "Address every service listens on.")
    port: int = setting(0, "Router gRPC port (0: a free one).")
    http_port: int = setting(8000, "OpenAI-compatible HTTP port (0: a free one).")
    routing: str = setting(
        "prefix", "How the router chooses workers.", choices=("prefix", "round_robin", "random")
    )
    redis_url: str | None = setting(None, "Redis for the registry and the KV index (default: none).")
    kv_transfer: str = setting("nixl", "KV transfer backend.", choices=("nixl", "local"))
    tool_call_parser: str = setting(
        "hermes",
        'How the router reads chat replies for tool calls when tool_choice is "auto".',
        choices=("hermes", "qwen3_coder", "llama3_json", "pythonic", "none"),
    )
    reasoning_parser: str = setting(
        "none",
        "How the router splits chat replies' thinking into reasoning_content.",
        choices=("none", "qwen3", "deepseek_r1"),
    )
    enable_lora: bool = setting(
        False,
        "Every worker serves LoRA adapters (vLLM's --enable-lora); a request selects one by its model field.",
    )
    max_loras: int = setting(1, "With enable_lora: each worker's adapters in device slots at once.")
    max_lora_rank: int = setting(16, "With enable_lora: the highest adapter rank served.")
    lora_modules: list[str] = setting(
        [],
        "With enable_lora: adapters every worker registers at start (vLLM's --lora-modules): name=path, or "
        'JSON {"name": ..., "path": ...}.',
    )
    speculative_config: str | None = setting(
        None,
        "Every worker (and the KV offload store) runs with this --speculative-config (vLLM's JSON): "
        '{"method": "ngram", ...} or, for a DeepSeek-V3 checkpoint, {"method": "mtp"} (its own '
        "multi-token-prediction layer drafts).",
    )
    eplb: bool = setting(
        False,
        "Also start an EPLB controller (python -m eplb_svc) and run every worker with --enable-eplb, reporting "
        "expert load to it and taking its placements (a MoE model only; docs/eplb.md). Its own flags: "
        "--eplb-arg.",
    )
    num_redundant_experts: int = setting(
        0,
        "With eplb: redundant physical expert slots per MoE layer on every worker, for replicas of hot "
        "experts (vLLM's --num-redundant-experts); experts plus these must divide over the expert-parallel "
        "ranks.",
    )
    kvstore: bool = setting(
        False,
        "Also start a KV offload store (python -m kvstore_svc) with the workers' model and KV settings, and "
        "point every worker at it: finished requests' KV blocks are kept there and loaded back by any worker "
        "(docs/kv_offload.md). Its own flags: --kvstore-arg.",
    )
    kvstore_memory_gb: float = setting(1.0, "With kvstore: the store's host-memory tier, in GiB.")
    kvstore_disk_path: str | None = setting(
        None, "With kvstore: the file of the store's disk tier (none: host memory only)."
    )
    kvstore_disk_gb: float = setting(4.0, "With kvstore and kvstore_disk_path: the disk tier's size, in GiB.")


def _add_mesh_args(p: argparse.ArgumentParser) -> None:
    """The launcher's flags: ``LauncherSettings`` (each with its ``PDMESH_*`` twin), and the pass-through
    flags that have none."""
    add_arguments(p, LauncherSettings, "what to launch")
    p.add_argument("--worker-arg", action="append", default=[], help="extra flag passed to every worker")
    p.add_argument("--router-arg", action="append", default=[], help="extra flag passed to the router")
    p.add_argument("--eplb-arg", action="append", default=[], help="extra flag passed to the EPLB controller")
    p.add_argument(
        "--kvstore-arg", action="append", default=[], help="extra flag passed to the KV offload store"
    )
    p.add_argument("--quiet", action="store_true", help="do not echo the services' logs")


def cmd_up(args: argparse.Namespace) -> int:
    mesh = Mesh(args)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        mesh.start(echo=not args.quiet)
        print(
            f"pdmesh mesh is up (model {args.model}):\n{mesh.endpoints()}\nCtrl-C stops everything.",
            flush=True,
        )
        while not stop.wait(0.5):
            dead = [c.name for c in mesh.children if not c.alive]
            if dead:
                print(f"pdmesh: {', '.join(dead)} exited; stopping the mesh", file=sys.stderr, flush=True)
                return 1
        return 0
    finally:
        print("pdmesh: stopping (draining)...", flush=True)
        mesh.stop()


def cmd_demo(args: argparse.Namespace) -> int:
    """Start a mesh, send one chat request through the OpenAI-compatible API, print the answer, stop."""
    args.http_port = args.http_port if args.http_port != 8000 else 0
    # Show the disaggregated path even for a short prompt (by default the router prefills short prompts
    # on the decode worker itself).
    args.router_arg = ["--pd-threshold-tokens", "0", *args.router_arg]
    mesh = Mesh(args)
    try:
        mesh.start(echo=False)
        print(f"mesh up:\n{mesh.endpoints()}", flush=True)
        body = {
            "model": args.model,
            "messages": [{"role": "user", "content": args.prompt}],
            "max_tokens": args.max_tokens,
            "temperature": 0.0,
        }
        req = urllib.request.Request(
            f"http://{args.host}:{mesh.http_port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json", **_auth_header()},
        )
        started = time.monotonic()
        with urllib.request.urlopen(req, timeout=120) as resp:
            answer = json.loads(resp.read())
        elapsed = time.monotonic() - started
        print(f"request: {args.prompt!r}")
        print(f"answer:  {answer['choices'][0]['message']['content']!r}")
        print(f"usage:   {answer['usage']}  ({elapsed * 1000:.0f} ms)")
        moved = sum(
            _metric(c, "pdmesh_decode_kv_transfer_bytes_total")
            for c in mesh.children
            if c.name.startswith("decode")
        )
        print(f"KV cache moved prefill -> decode worker over {args.kv_transfer}: {moved:.0f} bytes")
        return 0
    finally:
        mesh.stop()


def _auth_header() -> dict[str, str]:
    """The demo's key, where the router it starts takes one from PDMESH_API_KEY (router.auth)."""
    keys = [k for k in os.environ.get("PDMESH_API_KEY", "").split(",") if k.strip()]
    return {"Authorization": f"Bearer {keys[0].strip()}"} if keys else {}


def _metric(child: Child, name: str) -> float:
    """One sample of a service's Prometheus metric (0 when absent), read from its /metrics endpoint."""
    import re

    for line in child.lines:
        m = re.search(r"metrics=(\S+)", line)
        if m:
            try:
                with urllib.request.urlopen(f"http://{m.group(1)}/metrics", timeout=5) as resp:
                    text = resp.read().decode()
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                return 0.0
            return sum(float(x.split()[-1]) for x in text.splitlines() if x.startswith(name))
    return 0.0


def cmd_serve(args: argparse.Namespace, rest: list[str]) -> int:
    module = SERVICES[args.service]
    return subprocess.call([sys.executable, "-m", module, *rest])


def cmd_bench(args: argparse.Namespace, rest: list[str]) -> int:
    return subprocess.call([sys.executable, str(REPO / "benchmarks" / "serving_bench.py"), *rest])


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    """The command line and the ``PDMESH_*`` variables, checked: a usage error (exit 2) for a bad value
    from either. Returns the arguments and, for ``serve`` and ``bench``, the flags they pass on."""
    parser = argparse.ArgumentParser(prog="pdmesh", description="LLM serving as a mesh of gRPC services.")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start a whole mesh on this machine (one process per service)")
    _add_mesh_args(up)
    demo = sub.add_parser("demo", help="start a mesh, answer one request through the OpenAI API, stop")
    _add_mesh_args(demo)
    demo.add_argument("--prompt", default="Hello from pdmesh! What is disaggregated serving?")
    demo.add_argument("--max-tokens", type=int, default=32)
    serve = sub.add_parser(
        "serve", help="start one service; other flags go to it (see --help of each)", add_help=False
    )
    serve.add_argument("service", choices=sorted(SERVICES))
    sub.add_parser("bench", help="drive a running mesh (benchmarks/serving_bench.py)", add_help=False)
    args, rest = parser.parse_known_args(argv)
    if args.command in ("up", "demo"):
        command = up if args.command == "up" else demo
        if rest:
            command.error(f"unrecognized arguments: {' '.join(rest)}")
        try:  # flags, then PDMESH_* variables (converted and checked against the choices), then defaults
            settings = from_sources(LauncherSettings, args)
        except ValueError as exc:
            command.error(str(exc))
        vars(args).update(asdict(settings))
    return args, rest


def main(argv: list[str] | None = None) -> None:
    args, rest = parse_args(argv)
    if args.command == "serve":
        sys.exit(cmd_serve(args, rest))
    if args.command == "bench":
        sys.exit(cmd_bench(args, rest))
    sys.exit(cmd_up(args) if args.command == "up" else cmd_demo(args))


if __name__ == "__main__":
    main()
