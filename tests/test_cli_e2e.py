"""`pdmesh up` starts a whole mesh, answers through the OpenAI API, and stops everything on SIGTERM."""

from __future__ import annotations

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


def test_pdmesh_up_serves_and_stops_cleanly_on_sigterm() -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO), NIXL_LOG_LEVEL="WARN", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "mesh.cli",
            "up",
            "--http-port",
            "0",
            "--num-kv-blocks",
            "256",
            "--num-prefill",
            "2",
            "--quiet",
        ],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    up = threading.Event()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if "mesh is up" in line:
                up.set()

    threading.Thread(target=pump, daemon=True).start()
    try:
        assert up.wait(120), "".join(lines[-40:])
        time.sleep(0.2)
        text = "".join(lines)
        http = re.search(r"OpenAI HTTP\s+(http://\S+)", text).group(1)
        assert len(re.findall(r"^\s+prefill\s+127\.0\.0\.1:\d+", text, re.M)) == 2
        body = json.dumps({"model": "tiny-dense", "prompt": "hello mesh", "max_tokens": 5, "temperature": 0})
        req = urllib.request.Request(
            f"{http}/completions", data=body.encode(), headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 5
        services = _children(proc.pid)
        assert len(services) == 4  # router, 2 prefill, 1 decode
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, "".join(lines[-40:])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in services):
            time.sleep(0.1)
        assert not [p for p in services if _alive(p)], "service processes outlived pdmesh up"
    finally:
        if proc.poll() is None:
            proc.kill()


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
