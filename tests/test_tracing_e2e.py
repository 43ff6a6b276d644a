"""One request through router, prefill and decode processes is one trace with spans from all three."""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from mesh.telemetry import read_spans_jsonl
from tests.mesh_fixtures import ServiceProcess, worker_args

pytestmark = pytest.mark.e2e


def test_one_request_is_one_trace_across_three_services(tmp_path) -> None:
    trace_file = tmp_path / "spans.jsonl"
    tracing = ["--trace-file", str(trace_file)]
    prefill = ServiceProcess.start("prefill_svc", *worker_args(), *tracing)
    decode = ServiceProcess.start("decode_svc", *worker_args(), *tracing)
    router = None
    try:
        router = ServiceProcess.start(
            "router",
            "--model",
            "tiny-dense",
            "--http-port",
            "0",
            "--routing",
            "round_robin",
            "--prefill-workers",
            prefill.address,
            "--decode-workers",
            decode.address,
            *tracing,
        )
        http = re.search(r"http=(\S+)", "\n".join(router.lines)).group(1)
        body = json.dumps(
            {
                "model": "tiny-dense",
                "prompt": "Trace me through the mesh, please.",
                "max_tokens": 8,
                "temperature": 0,
            }
        ).encode()
        req = urllib.request.Request(
            f"http://{http}/v1/completions", data=body, headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            assert resp.status == 200
            assert json.loads(resp.read())["usage"]["completion_tokens"] == 8
        # Each process exports its spans in its own time (the decode worker's server span ends after the
        # client has its answer): wait until every span the checks below name has been written.
        wanted = {"Worker/Prefill", "prefill.queue", "prefill.compute", "Worker/Decode", "kv_transfer"}
        deadline = time.monotonic() + 10
        spans: list[dict] = []
        while time.monotonic() < deadline:
            spans = read_spans_jsonl(trace_file)
            if {s["service"] for s in spans} >= {
                "pdmesh-router",
                "pdmesh-prefill",
                "pdmesh-decode",
            } and wanted <= {s["name"] for s in spans}:
                break
            time.sleep(0.1)
    finally:
        for svc in (router, decode, prefill):
            if svc is not None:
                svc.stop()
    traces = {s["trace_id"] for s in spans}
    assert len(traces) == 1, (
        f"expected one trace, got {len(traces)}: {[(s['service'], s['name']) for s in spans]}"
    )
    services = {s["service"] for s in spans}
    assert services == {"pdmesh-router", "pdmesh-prefill", "pdmesh-decode"}
    names = {s["name"] for s in spans}
    assert wanted <= names, wanted - names
    # Parent links hold the trace together: every span but the root has its parent in the trace.
    ids = {s["span_id"] for s in spans}
    roots = [s for s in spans if s["parent_id"] is None or s["parent_id"] not in ids]
    assert len(roots) == 1 and roots[0]["service"] == "pdmesh-router", roots
