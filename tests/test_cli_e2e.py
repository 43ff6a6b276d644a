"""`pdmesh up` starts a whole mesh, answers through the OpenAI API, and stops everything on SIGTERM."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import torch

from tests.test_kv_transfer import HAVE_NIXL

pytestmark = pytest.mark.e2e
REPO = Path(__file__).resolve().parent.parent


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split()[2] == "Z")


class Up:
    """``pdmesh up`` with ``args`` as a child process, its output collected; ``http`` once it is up."""

    def __init__(self, *args: str, quiet: bool = True) -> None:
        path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        env = dict(os.environ, PYTHONPATH=path, NIXL_LOG_LEVEL="WARN", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mesh.cli",
                "up",
                "--http-port",
                "0",
                *(["--quiet"] if quiet else []),
                *args,
            ],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.lines: list[str] = []
        up = threading.Event()

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.lines.append(line)
                if "mesh is up" in line:
                    up.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + 300  # on a GPU each worker captures its graphs first
        while not up.wait(0.5) and self.proc.poll() is None and time.monotonic() < deadline:
            pass
        assert up.is_set(), "".join(self.lines[-40:])
        time.sleep(0.2)
        self.text = "".join(self.lines)
        self.http = re.search(r"OpenAI HTTP\s+(http://\S+)", self.text).group(1)

    def complete(self, body: dict) -> dict:
        req = urllib.request.Request(
            f"{self.http}/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            return json.loads(resp.read())

    def stop_and_check(self) -> None:
        """SIGTERM: ``pdmesh up`` exits 0 and no service process outlives it."""
        services = _children(self.proc.pid)
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0, "".join(self.lines[-40:])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in services):
            time.sleep(0.1)
        assert not [p for p in services if _alive(p)], "service processes outlived pdmesh up"

    def kill(self) -> None:
        """After a failure: the launcher and its services, which would outlive a killed launcher."""
        if self.proc.poll() is None:
            for pid in _children(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            self.proc.kill()


def test_pdmesh_up_serves_and_stops_cleanly_on_sigterm() -> None:
    up = Up("--num-kv-blocks", "256", "--num-prefill", "2")
    try:
        assert len(re.findall(r"^\s+prefill\s+127\.0\.0\.1:\d+", up.text, re.M)) == 2
        body = {"model": "tiny-dense", "prompt": "hello mesh", "max_tokens": 5, "temperature": 0}
        assert up.complete(body)["usage"]["completion_tokens"] == 5
        assert len(_children(up.proc.pid)) == 4  # router, 2 prefill, 1 decode
        up.stop_and_check()
    finally:
        up.kill()


def test_pdmesh_up_with_an_fp8_kv_cache_answers_as_the_offline_engine() -> None:
    """``--kv-cache-dtype fp8``: both workers keep float8 e4m3 pools, the prefill worker's KV moves to the
    decode worker (half the bytes of a 16-bit pool, a quarter of float32's), and the answers are the
    offline engine's with the same KV cache dtype."""
    from engine import LLM, SamplingParams

    prompts = ["an fp8 cache: " + "mesh " * 100, "and a short one"]  # the first past pd_threshold_tokens
    llm = LLM("tiny-dense", num_kv_blocks=256, kv_cache_dtype="fp8")
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    expected = [llm.generate(p, params)[0].text for p in prompts]
    block_nbytes = llm.engine.layout.block_nbytes
    llm.close()
    up = Up("--num-kv-blocks", "256", "--kv-cache-dtype", "fp8", quiet=False)
    try:
        for p, want in zip(prompts, expected, strict=True):
            body = {
                "model": "tiny-dense",
                "prompt": p,
                "max_tokens": 12,
                "temperature": 0,
                "ignore_eos": True,
            }
            assert up.complete(body)["choices"][0]["text"] == want
        address = re.search(r"pdmesh decode ready: grpc=\S+ metrics=(\S+)", up.text).group(1)
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        moved = re.search(r"^pdmesh_decode_kv_transfer_bytes_total (\S+)", text, re.M)
        assert moved is not None and float(moved.group(1)) > 0
        assert float(moved.group(1)) % block_nbytes == 0  # whole float8 blocks
        info = r'^pdmesh_decode_cache_config_info\{[^}]*cache_dtype="float8_e4m3fn"[^}]*\} 1\.0$'
        assert re.search(info, text, re.M), text  # the dashboards' view of the cache
        up.stop_and_check()
    finally:
        up.kill()


def test_pdmesh_up_with_expert_parallel_ranks_answers_as_one_engine() -> None:
    """Two prefill and two decode workers, each pair the two expert-parallel ranks of tiny-moe
    (``--prefill-expert-parallel --decode-expert-parallel``, a group each): concurrent requests, spread
    over the ranks by the router, get the offline engine's greedy text."""
    check_expert_parallel_mesh({})


# The GPU variant's workers and offline engine: the Triton ops (so CUDA graphs, prefill graphs among
# them), float32 so that the ranks' partial expert sums cannot round a token differently.
GPU_WORKERS = {"device": "cuda", "dtype": "float32", "kernel_backend": "triton"}


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not HAVE_NIXL,
    reason="needs two CUDA GPUs and NIXL",
)
def test_gpu_pdmesh_up_with_expert_parallel_ranks_answers_as_one_engine() -> None:
    """The same mesh on two GPUs (``pdmesh up --device cuda``): each worker gets one GPU (prefill rank 0
    GPU 0, prefill rank 1 GPU 1, then the decode ranks likewise), each group's ranks meet over NCCL, and
    the KV moves between processes on different GPUs over NIXL."""
    check_expert_parallel_mesh(GPU_WORKERS)


def check_expert_parallel_mesh(workers: dict[str, str]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from engine import LLM, SamplingParams

    prompts = [f"request {i}: " + "mesh " * (3 * i) for i in range(6)]
    lengths = [12, 3, 8, 1, 16, 5]
    llm = LLM("tiny-moe", num_kv_blocks=256, **workers)
    expected = [
        llm.generate(p, SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].text
        for p, n in zip(prompts, lengths, strict=True)
    ]
    llm.close()
    gpu = workers.get("device") == "cuda"
    extra = ["--device", "cuda", "--dtype", workers["dtype"], "--gpus", "0,1"] if gpu else []
    if gpu:
        extra += ["--worker-arg=--kernel-backend=" + workers["kernel_backend"]]
    up = Up("--model", "tiny-moe", "--num-kv-blocks", "256", "--num-prefill", "2", "--num-decode", "2",
            "--prefill-expert-parallel", "--decode-expert-parallel", "--routing", "round_robin", *extra,
            quiet=False)  # fmt: skip
    try:
        assert len(re.findall(r"^\s+decode\s+127\.0\.0\.1:\d+", up.text, re.M)) == 2
        decode_metrics = re.findall(r"pdmesh decode ready: grpc=\S+ metrics=(\S+)", up.text)
        assert len(decode_metrics) == 2
        backend = "nccl" if gpu else "gloo"
        for rank in (0, 1):  # one prefill and one decode worker each
            assert up.text.count(f"expert-parallel rank {rank} of 2 ({backend})") == 2, up.text[-3000:]
        bodies = [
            {"model": "tiny-moe", "prompt": p, "max_tokens": n, "temperature": 0, "ignore_eos": True}
            for p, n in zip(prompts, lengths, strict=True)
        ]
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(up.complete, bodies))
        assert [a["choices"][0]["text"] for a in answers] == expected
        assert [a["usage"]["completion_tokens"] for a in answers] == lengths
        # Every rank served requests: prompt tokens on both prefill ranks, KV pulled into both decode ranks.
        prefill_metrics = re.findall(r"pdmesh prefill ready: grpc=\S+ metrics=(\S+)", up.text)
        for role, address, name in [
            *(("prefill", a, "pdmesh_prefill_prompt_tokens_tokens_total") for a in prefill_metrics),
            *(("decode", a, "pdmesh_decode_kv_transfer_bytes_total") for a in decode_metrics),
        ]:
            with urllib.request.urlopen(f"http://{address}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            served = re.search(rf"^{name} (\S+)", text, re.M)
            assert served is not None and float(served.group(1)) > 0, (role, address)
        assert len(prefill_metrics) == 2
        up.stop_and_check()
    finally:
        up.kill()


def test_launcher_ports_come_from_below_the_ephemeral_range() -> None:
    """Ports the launcher hands to services are bound later, by child processes; one from the ephemeral
    range could be taken in between by any process's outgoing connection (this made the router fail to
    bind once in CI), so they are drawn below it, and are free when drawn."""
    import socket

    from mesh.cli import _ephemeral_range, free_port

    lo, hi = _ephemeral_range()
    assert 1024 < lo <= hi
    ports = [free_port() for _ in range(20)]
    assert all(1024 <= p < lo for p in ports) and len(set(ports)) > 1
    for port in ports[:5]:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", port))
