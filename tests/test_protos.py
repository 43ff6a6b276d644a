"""The committed generated code matches the protos, and the contracts hold the shapes services rely on."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from mesh import kv_events
from protos.generate import REPO_ROOT, generated_files, proto_files
from protos.pdmesh.v1 import common_pb2, eplb_pb2, kvstore_pb2, router_pb2, worker_pb2


def test_generated_code_has_not_drifted(tmp_path: Path) -> None:
    # In a subprocess: grpc_tools' compiler must not share a process with NIXL's libraries (see generate.py).
    subprocess.run(
        [sys.executable, "-m", "protos.generate", str(tmp_path)],
        cwd=REPO_ROOT,
        check=True,
        capture_output=True,
    )
    fresh = generated_files(tmp_path)
    committed = generated_files(REPO_ROOT)
    rel = lambda paths, root: sorted(p.relative_to(root) for p in paths)  # noqa: E731
    assert rel(fresh, tmp_path) == rel(committed, REPO_ROOT), "run `python -m protos.generate` and commit"
    # Every proto yields its three modules.
    assert len(fresh) == 3 * len(proto_files())
    stale = [
        p.name
        for p in committed
        if _unstamped(p.read_text()) != _unstamped((tmp_path / p.relative_to(REPO_ROOT)).read_text())
    ]
    assert not stale, f"generated code differs from the protos in {stale}: run `python -m protos.generate`"


_STAMPS = (
    (re.compile(r"GRPC_GENERATED_VERSION = '[^']*'"), "GRPC_GENERATED_VERSION = ''"),
    (re.compile(r"# Protobuf Python Version: \S+"), "# Protobuf Python Version:"),
    (
        re.compile(
            r"(ValidateProtobufRuntimeVersion\(\s*_runtime_version\.Domain\.PUBLIC,)\s*\d+,\s*\d+,\s*\d+,"
        ),
        r"\1",
    ),
)


def _unstamped(code: str) -> str:
    """Generated code without the generators' version stamps: a newer grpcio-tools or protoc than the one
    that generated the committed code (a fresh install takes the newest the requirements admit) writes its
    own version and nothing else differs; what the stamps demand of the runtime is checked below."""
    for pattern, blank in _STAMPS:
        code = pattern.sub(blank, code)
    return code


def test_declared_dependencies_cover_the_generated_code() -> None:
    """The committed code refuses to import under a protobuf runtime older than the one that generated it
    (or of another major version), and its gRPC stubs under an older grpcio: the package's requirements
    must not admit such versions."""
    import tomllib

    from packaging.requirements import Requirement
    from packaging.version import Version

    deps = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = {r.name: r.specifier for r in map(Requirement, deps)}
    pb2 = (REPO_ROOT / "protos/pdmesh/v1/worker_pb2.py").read_text()
    grpc_py = (REPO_ROOT / "protos/pdmesh/v1/worker_pb2_grpc.py").read_text()
    made_pb = Version(re.search(r"Protobuf Python Version: (\S+)", pb2).group(1))
    made_grpc = Version(re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_py).group(1))
    lowest = lambda s: min(Version(c.version) for c in s if c.operator == ">=")  # noqa: E731
    assert lowest(spec["protobuf"]) >= made_pb and Version(f"{made_pb.major + 1}") not in spec["protobuf"]
    for name in ("grpcio", "grpcio-health-checking", "grpcio-reflection"):
        assert lowest(spec[name]) >= made_grpc, name


def test_generate_request_round_trip_keeps_oneof_and_presence() -> None:
    params = common_pb2.SamplingParams(
        max_tokens=32, temperature=0.0, top_k=-1, seed=1234, stop=["\n\n"], stop_token_ids=[2], logprobs=5
    )
    req = router_pb2.GenerateRequest(
        token_ids=common_pb2.TokenIds(ids=[1, 2, 3, 70000]),
        sampling_params=params,
        session_id="s",
        cache_salt="t",
    )
    back = router_pb2.GenerateRequest.FromString(req.SerializeToString())
    assert back == req
    assert back.WhichOneof("prompt") == "token_ids"
    assert list(back.token_ids.ids) == [1, 2, 3, 70000]
    sp = back.sampling_params
    # temperature 0 (greedy) is distinguishable from "unset" (engine default 1.0).
    assert sp.HasField("temperature") and sp.temperature == 0.0
    assert not sp.HasField("top_p") and not sp.HasField("presence_penalty")
    assert sp.top_k == -1 and sp.seed == 1234 and sp.logprobs == 5
    assert not common_pb2.SamplingParams().HasField("seed")

    text_req = router_pb2.GenerateRequest(text="hello")
    assert router_pb2.GenerateRequest.FromString(text_req.SerializeToString()).WhichOneof("prompt") == "text"


def test_prefill_to_decode_handoff_round_trip() -> None:
    handle = common_pb2.KVHandle(
        worker_id="prefill-0",
        worker_address="127.0.0.1:5001",
        agent_name="prefill-0-agent",
        block_ids=[7, 8, 9],
        layout_fingerprint="ab" * 16,
        num_tokens=40,
        lease_deadline_unix_ms=1_900_000_000_000,
        request_id="r1",
    )
    first = common_pb2.Logprobs(
        token_id=0, logprob=-0.25, top_logprobs=[common_pb2.TokenLogprob(token_id=0, logprob=-0.25)]
    )
    prefill = worker_pb2.PrefillResponse(
        request_id="r1", first_token_id=0, first_token_logprobs=first, kv_handle=handle, num_cached_tokens=16
    )
    back = worker_pb2.PrefillResponse.FromString(prefill.SerializeToString())
    assert back == prefill and back.finish_reason == common_pb2.FINISH_REASON_UNSPECIFIED

    decode = worker_pb2.DecodeRequest(
        request_id="r1",
        prompt_token_ids=range(40),
        kv_handle=back.kv_handle,
        first_token_id=back.first_token_id,
        cache_salt="s",
        lora_name="sql",  # the adapter the prefill ran with, as the cache salt: the router sends both
    )
    back_decode = worker_pb2.DecodeRequest.FromString(decode.SerializeToString())
    assert (back_decode.cache_salt, back_decode.lora_name) == ("s", "sql")
    # Token id 0 is a real token: presence, not truthiness, says the prefill happened elsewhere.
    assert back_decode.HasField("first_token_id") and back_decode.first_token_id == 0
    assert back_decode.HasField("kv_handle") and list(back_decode.kv_handle.block_ids) == [7, 8, 9]
    local = worker_pb2.DecodeRequest(request_id="r2", prompt_token_ids=[1, 2])
    assert not local.HasField("kv_handle") and not local.HasField("first_token_id")


def test_kv_event_batch_round_trip() -> None:
    top_hash = 2**64 - 1  # xxh3_64 hashes use the whole u64 range
    batch = common_pb2.KVEventBatch(
        worker_id="decode-1",
        model_fingerprint="tiny-dense",
        seq=42,
        events=[
            common_pb2.KVEvent(
                blocks_stored=common_pb2.BlocksStored(
                    block_hashes=[1, top_hash], tier=common_pb2.TIER_GPU, parent_hash=0
                )
            ),
            common_pb2.KVEvent(
                blocks_removed=common_pb2.BlocksRemoved(block_hashes=[1], tier=common_pb2.TIER_CPU)
            ),
            common_pb2.KVEvent(all_blocks_cleared=common_pb2.AllBlocksCleared(tier=common_pb2.TIER_DISK)),
        ],
    )
    back = common_pb2.KVEventBatch.FromString(batch.SerializeToString())
    assert back == batch
    assert [e.WhichOneof("event") for e in back.events] == [
        "blocks_stored",
        "blocks_removed",
        "all_blocks_cleared",
    ]
    stored = back.events[0].blocks_stored
    assert stored.block_hashes[1] == top_hash
    assert stored.HasField("parent_hash") and stored.parent_hash == 0  # hash 0 is not "no parent"
    assert not common_pb2.BlocksStored(block_hashes=[5]).HasField("parent_hash")


def test_eplb_placement_round_trip() -> None:
    placement = eplb_pb2.Placement(
        version=3,
        num_layers=2,
        num_physical_experts=3,
        num_logical_experts=2,
        physical_to_logical=[0, 1, 1, 1, 0, -1],
        model_fingerprint="tiny-moe",
    )
    assert eplb_pb2.Placement.FromString(placement.SerializeToString()) == placement
    assert not eplb_pb2.PlacementRequest().HasField("after_version")
    assert eplb_pb2.PlacementRequest(after_version=0).HasField("after_version")


def test_tiers_match_the_mesh_kv_events_tiers() -> None:
    proto_tiers = {v.name for v in common_pb2.Tier.DESCRIPTOR.values if v.number != 0}
    assert proto_tiers == {f"TIER_{t.name}" for t in kv_events.Tier}
    assert common_pb2.Tier.Name(0) == "TIER_UNSPECIFIED"
    assert common_pb2.FinishReason.Name(0) == "FINISH_REASON_UNSPECIFIED"


@pytest.mark.parametrize(
    ("module", "service", "methods"),
    [
        (router_pb2, "Router", {"Generate": True, "ListModels": False, "Embed": False, "Classify": False}),
        (
            worker_pb2,
            "Worker",
            {
                "Prefill": False,
                "Decode": True,
                "Abort": False,
                "GetTransferMetadata": False,
                "ReleaseKV": False,
                "GetStats": False,
                "Drain": False,
                "StreamKVEvents": True,
                "ResetPrefixCache": False,
                "LoadLoRAAdapter": False,
                "UnloadLoRAAdapter": False,
                "Embed": False,
            },
        ),
        (
            kvstore_pb2,
            "KVStore",
            {
                "Put": False,
                "Lookup": False,
                "Fetch": False,
                "GetTransferMetadata": False,
                "GetStats": False,
                "Release": False,
            },
        ),
        (eplb_pb2, "EPLB", {"ReportExpertLoad": False, "GetPlacement": False, "WatchPlacement": True}),
    ],
)
def test_services_have_their_rpcs(module: object, service: str, methods: dict[str, bool]) -> None:
    desc = module.DESCRIPTOR.services_by_name[service]  # type: ignore[attr-defined]
    assert desc.full_name == f"pdmesh.v1.{service}"
    assert {m.name: m.server_streaming for m in desc.methods} == methods
    assert not any(m.client_streaming for m in desc.methods)
