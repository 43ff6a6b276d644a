"""KV transfer: run coalescing, the local agent, and real NIXL READs on host memory (one and two processes)."""

from __future__ import annotations

import dataclasses
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from mesh.kv_layout import KVLayout, LayoutMismatchError
from mesh.kv_transfer import (
    KVTransferAgent,
    KVTransferError,
    LocalKVTransferAgent,
    coalesce_runs,
    create_transfer_agent,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
LAYOUT = KVLayout("test-model", "float32", block_size=4, num_layers=2, num_kv_heads=2, head_dim=8)
POISON = -7.0

try:
    from mesh.nixl_transfer import import_nixl_api

    import_nixl_api()
    HAVE_NIXL = True
except ImportError:
    HAVE_NIXL = False

needs_nixl = pytest.mark.skipif(not HAVE_NIXL, reason="NIXL not installed (pip install nixl-cu12)")
KINDS = ["local", pytest.param("nixl", marks=needs_nixl)]


def random_pool(num_blocks: int, layout: KVLayout = LAYOUT, seed: int = 0) -> torch.Tensor:
    """A pool whose bytes are uniformly random, so every bit pattern (NaNs included) must survive the copy."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.empty(num_blocks, *layout.block_shape, dtype=getattr(torch, layout.dtype))
    raw = pool.view(torch.uint8).view(-1)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))
    return pool


def poisoned_pool(num_blocks: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    return torch.full((num_blocks, *layout.block_shape), POISON, dtype=getattr(torch, layout.dtype))


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def collect_notifications(
    agent: KVTransferAgent, expected: int, timeout_s: float = 5.0
) -> dict[str, list[bytes]]:
    got: dict[str, list[bytes]] = {}
    deadline = time.monotonic() + timeout_s
    while sum(map(len, got.values())) < expected and time.monotonic() < deadline:
        for peer, msgs in agent.get_notifications().items():
            got.setdefault(peer, []).extend(msgs)
        time.sleep(0.001)
    return got


@pytest.fixture
def pair(request: pytest.FixtureRequest):
    """(source agent over a random pool, destination agent over a poisoned pool), destination knows source."""
    kind, kwargs = request.param if isinstance(request.param, tuple) else (request.param, {})
    src = create_transfer_agent(kind, "prefill", random_pool(32), LAYOUT, **kwargs)
    dst = create_transfer_agent(kind, "decode", poisoned_pool(24), LAYOUT, **kwargs)
    dst.add_peer(src.metadata())
    yield src, dst
    dst.close()
    src.close()


# -- coalesce_runs -----------------------------------------------------------------------------------------


def test_coalesce_runs_merges_runs_adjacent_on_both_sides() -> None:
    assert coalesce_runs([], []) == []
    assert coalesce_runs([5], [9]) == [(5, 9, 1)]
    assert coalesce_runs([0, 1, 2, 3], [10, 11, 12, 13]) == [(0, 10, 4)]
    # local adjacent but remote not: two runs; remote adjacent but local not: two runs
    assert coalesce_runs([0, 1], [10, 12]) == [(0, 10, 1), (1, 12, 1)]
    assert coalesce_runs([0, 2], [10, 11]) == [(0, 10, 1), (2, 11, 1)]
    # descending remote ids never merge
    assert coalesce_runs([0, 1], [5, 4]) == [(0, 5, 1), (1, 4, 1)]
    assert coalesce_runs([4, 5, 6, 9, 0], [0, 1, 2, 7, 30]) == [(0, 30, 1), (4, 0, 3), (9, 7, 1)]


def test_coalesce_runs_orders_pairs_by_local_id() -> None:
    # The same mapping given out of order still forms one run.
    assert coalesce_runs([3, 1, 2, 0], [13, 11, 12, 10]) == [(0, 10, 4)]


def test_coalesce_runs_covers_every_pair_exactly_once() -> None:
    g = torch.Generator().manual_seed(3)
    local = torch.randperm(200, generator=g)[:120].tolist()
    remote = torch.randperm(500, generator=g)[:120].tolist()
    runs = coalesce_runs(local, remote)
    expanded = {(ls + k, rs + k) for ls, rs, n in runs for k in range(n)}
    assert expanded == set(zip(local, remote, strict=True))
    assert sum(n for _, _, n in runs) == len(local)


def test_coalesce_runs_rejects_length_mismatch() -> None:
    with pytest.raises(ValueError, match="3 ids"):
        coalesce_runs([1, 2, 3], [1, 2])


# -- reads (local and NIXL) --------------------------------------------------------------------------------

SCATTERED_REMOTE = [3, 4, 5, 6, 9, 17, 18, 30, 0, 25]
SCATTERED_LOCAL = [0, 1, 2, 3, 7, 10, 11, 12, 20, 23]  # runs: 3-6 -> 0-3, 17-18 -> 10-11; the rest single


@pytest.mark.parametrize(
    "pair",
    [
        "local",
        pytest.param(("nixl", {}), marks=needs_nixl, id="nixl-coalesced"),
        pytest.param(("nixl", {"xfer_mode": "prepped"}), marks=needs_nixl, id="nixl-prepped"),
    ],
    indirect=True,
)
def test_read_scattered_blocks_is_byte_exact_and_notifies_source(pair) -> None:
    src, dst = pair
    peer = src.agent_name
    h = dst.start_read(peer, SCATTERED_REMOTE, SCATTERED_LOCAL, b"req-42")
    assert h.num_descriptors == len(coalesce_runs(SCATTERED_LOCAL, SCATTERED_REMOTE)) == 6
    dst.wait(h, timeout_s=10)
    assert dst.poll(h) == "DONE"
    dst.release(h)

    for local, remote in zip(SCATTERED_LOCAL, SCATTERED_REMOTE, strict=True):
        assert same_bytes(dst.pool[local], src.pool[remote]), f"block {remote} -> {local} differs"
    untouched = [i for i in range(dst.num_blocks) if i not in SCATTERED_LOCAL]
    assert bool((dst.pool[untouched] == POISON).all()), "a block outside the read was written"

    assert collect_notifications(src, 1) == {dst.agent_name: [b"req-42"]}
    assert dst.bytes_transferred == len(SCATTERED_LOCAL) * LAYOUT.block_nbytes
    assert dst.transfers_completed == 1 and dst.transfer_seconds > 0


@pytest.mark.parametrize("pair", KINDS, indirect=True)
def test_notifications_both_ways_and_empty_read(pair) -> None:
    src, dst = pair
    # An empty read (all blocks already cached) still tells the source it may free its blocks.
    h = dst.start_read(src.agent_name, [], [], b"req-empty")
    assert dst.poll(h) == "DONE"
    dst.send_notification(src.agent_name, b"standalone")
    assert sorted(collect_notifications(src, 2)[dst.agent_name]) == [b"req-empty", b"standalone"]
    src.add_peer(dst.metadata())
    src.send_notification(dst.agent_name, b"back")
    assert collect_notifications(dst, 1) == {src.agent_name: [b"back"]}


@pytest.mark.parametrize("pair", KINDS, indirect=True)
def test_add_peer_is_idempotent_and_rehandshakes_on_changed_metadata(pair) -> None:
    src, dst = pair
    meta = src.metadata()
    assert dst.add_peer(meta) == src.agent_name
    assert dst.has_peer(src.agent_name)
    # A changed announcement (here: fewer blocks) replaces the cached one and is what reads are checked against.
    assert dst.add_peer(dataclasses.replace(meta, num_blocks=8)) == src.agent_name
    with pytest.raises(ValueError, match="out of range"):
        dst.start_read(src.agent_name, [8], [0])
    h = dst.start_read(src.agent_name, [7], [0])
    dst.wait(h, timeout_s=10)
    assert same_bytes(dst.pool[0], src.pool[7])
    dst.remove_peer(src.agent_name)
    assert not dst.has_peer(src.agent_name)
    with pytest.raises(KVTransferError, match="unknown peer"):
        dst.start_read(src.agent_name, [1], [1])


# -- nothing moves when a check fails ----------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
def test_layout_mismatch_raises_and_moves_no_bytes(kind: str) -> None:
    other = dataclasses.replace(LAYOUT, block_size=8)
    src = create_transfer_agent(kind, "prefill", random_pool(16, other), other)
    dst = create_transfer_agent(kind, "decode", poisoned_pool(16), LAYOUT)
    try:
        with pytest.raises(LayoutMismatchError, match="fingerprint mismatch"):
            dst.add_peer(src.metadata())
        assert not dst.has_peer(src.agent_name)
        with pytest.raises(KVTransferError, match="unknown peer"):
            dst.start_read(src.agent_name, [0, 1], [0, 1])
        # Same fingerprint but a forged block size is refused too.
        good = create_transfer_agent(kind, "prefill2", random_pool(16), LAYOUT)
        forged = dataclasses.replace(good.metadata(), block_nbytes=LAYOUT.block_nbytes * 2)
        with pytest.raises(LayoutMismatchError):
            dst.add_peer(forged)
        # A KV handle whose fingerprint disagrees is refused before the read, even from a known peer.
        dst.add_peer(good.metadata())
        with pytest.raises(LayoutMismatchError):
            dst.start_read(good.agent_name, [0, 1], [0, 1], b"req", layout_fingerprint=other.fingerprint)
        good.close()
        assert bool((dst.pool == POISON).all()), "destination pool was written despite the mismatch"
        assert dst.bytes_transferred == 0 and dst.descriptors_posted == 0
        assert collect_notifications(src, 1, timeout_s=0.2) == {}
    finally:
        dst.close()
        src.close()


@pytest.mark.parametrize("kind", KINDS)
def test_fp8_pools_move_bytes_and_refuse_a_16_bit_peer(kind: str) -> None:
    """kv_cache_dtype fp8: float8 e4m3 pools move byte for byte (a block is half a 16-bit one's bytes),
    and a 16-bit pool of the same model is refused before any byte moves."""
    fp8 = dataclasses.replace(LAYOUT, dtype="float8_e4m3fn")
    bf16 = dataclasses.replace(LAYOUT, dtype="bfloat16")
    assert fp8.block_nbytes * 2 == bf16.block_nbytes and fp8.fingerprint != bf16.fingerprint
    src = create_transfer_agent(kind, "prefill", random_pool(16, fp8), fp8)
    wide = create_transfer_agent(kind, "prefill16", random_pool(16, bf16), bf16)
    dst = create_transfer_agent(
        kind, "decode", torch.zeros(8, *fp8.block_shape, dtype=torch.float8_e4m3fn), fp8
    )
    try:
        assert dst.pool.dtype == torch.float8_e4m3fn
        dst.add_peer(src.metadata())
        h = dst.start_read(src.agent_name, [5, 6, 11], [0, 1, 7], b"req-fp8")
        dst.wait(h, timeout_s=10)
        dst.release(h)
        for local, remote in ((0, 5), (1, 6), (7, 11)):
            assert same_bytes(dst.pool[local], src.pool[remote])
        assert bool((dst.pool[2:7].view(torch.uint8) == 0).all())
        assert dst.bytes_transferred == 3 * fp8.block_nbytes
        with pytest.raises(LayoutMismatchError, match="fingerprint mismatch"):
            dst.add_peer(wide.metadata())
    finally:
        dst.close()
        wide.close()
        src.close()


@pytest.mark.parametrize("pair", KINDS, indirect=True)
@pytest.mark.parametrize(
    ("remote", "local", "message"),
    [
        ([0, 32], [0, 1], "remote block id 32 out of range"),
        ([0, 1], [0, 24], "local block id 24 out of range"),
        ([-1], [0], "remote block id -1"),
        ([0, 1], [2, 2], "duplicates"),
        ([0, 1], [0], "2 remote block ids but 1 local"),
    ],
)
def test_bad_block_ids_raise_before_any_transfer(
    pair, remote: list[int], local: list[int], message: str
) -> None:
    src, dst = pair
    with pytest.raises(ValueError, match=message):
        dst.start_read(src.agent_name, remote, local, b"req-bad")
    assert bool((dst.pool == POISON).all())
    assert dst.descriptors_posted == 0 and dst.transfers_completed == 0
    assert collect_notifications(src, 1, timeout_s=0.1) == {}


# -- lifecycle and factory ---------------------------------------------------------------------------------


def test_pool_must_match_layout() -> None:
    with pytest.raises(ValueError, match="shape"):
        LocalKVTransferAgent("x", torch.zeros(4, 3), LAYOUT)
    with pytest.raises(ValueError, match="dtype"):
        LocalKVTransferAgent("x", torch.zeros(4, *LAYOUT.block_shape, dtype=torch.bfloat16), LAYOUT)
    with pytest.raises(ValueError, match="contiguous"):
        LocalKVTransferAgent("x", torch.zeros(*LAYOUT.block_shape, 4).movedim(-1, 0), LAYOUT)


def test_closed_agent_refuses_work_and_close_is_idempotent() -> None:
    src = LocalKVTransferAgent("prefill", random_pool(4), LAYOUT)
    dst = LocalKVTransferAgent("decode", poisoned_pool(4), LAYOUT)
    dst.add_peer(src.metadata())
    h = dst.start_read(src.agent_name, [0], [0])
    dst.close()
    assert h.released, "close() must release reads it still holds before deregistering"
    dst.close()
    with pytest.raises(KVTransferError, match="closed"):
        dst.start_read(src.agent_name, [0], [0])
    src.close()


def test_factory_names_the_pip_package_when_nixl_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import mesh.nixl_transfer as nixl_transfer

    monkeypatch.setattr(nixl_transfer, "_NIXL_MODULES", ("pdmesh_no_such_module._api",))
    with pytest.raises(ImportError, match="pip install nixl-cu12"):
        create_transfer_agent("nixl", "x", poisoned_pool(2), LAYOUT)
    with pytest.raises(ValueError, match="unknown KV transfer kind"):
        create_transfer_agent("rdma", "x", poisoned_pool(2), LAYOUT)  # type: ignore[arg-type]


# -- two processes over NIXL -------------------------------------------------------------------------------

PREFILL_CHILD = textwrap.dedent(
    """
    import base64, pickle, sys, time
    sys.path.insert(0, sys.argv[1])
    from tests.test_kv_transfer import LAYOUT, random_pool
    from mesh.kv_transfer import create_transfer_agent

    agent = create_transfer_agent("nixl", "prefill-child", random_pool(128, seed=11), LAYOUT)
    print("META", base64.b64encode(pickle.dumps(agent.metadata())).decode(), flush=True)
    deadline = time.monotonic() + 20
    notes = {}
    while not notes and time.monotonic() < deadline:
        notes = agent.get_notifications()
        time.sleep(0.001)
    print("NOTES", base64.b64encode(pickle.dumps(notes)).decode(), flush=True)
    sys.stdin.readline()  # keep the pool registered until the parent is done
    agent.close()
    """
)


def read_tagged(child: subprocess.Popen[str], tag: str) -> str:
    """The payload of the child's next stdout line starting with ``tag`` (NIXL logs to stdout as well)."""
    assert child.stdout is not None
    for line in child.stdout:
        if line.startswith(tag + " "):
            return line.split(" ", 1)[1].strip()
    raise AssertionError(f"child exited before sending {tag}: {child.stderr.read() if child.stderr else ''}")


@needs_nixl
def test_nixl_read_between_two_processes() -> None:
    import base64

    child = subprocess.Popen(
        [sys.executable, "-c", PREFILL_CHILD, str(REPO_ROOT)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
    )
    dst = create_transfer_agent("nixl", "decode-parent", poisoned_pool(96), LAYOUT)
    try:
        assert child.stdout is not None and child.stdin is not None
        peer = dst.add_peer(pickle.loads(base64.b64decode(read_tagged(child, "META"))))
        # 64 blocks: four runs of 8 and 32 single blocks, local ids scattered over the destination pool
        remote = [b for start in (0, 20, 40, 100) for b in range(start, start + 8)] + list(range(60, 124, 2))
        local = list(range(64, 96)) + list(range(0, 64, 2))
        h = dst.start_read(peer, remote, local, b"req-two-proc")
        dst.wait(h, timeout_s=20)
        dst.release(h)
        expected = random_pool(128, seed=11)
        assert same_bytes(dst.pool[local], expected[remote])
        assert bool((dst.pool[list(range(1, 64, 2))] == POISON).all())
        assert h.num_descriptors == 4 + 32

        notes = pickle.loads(base64.b64decode(read_tagged(child, "NOTES")))
        assert notes == {dst.agent_name: [b"req-two-proc"]}
        child.stdin.write("done\n")
        child.stdin.flush()
        assert child.wait(timeout=20) == 0

        # The prefill process is gone: a read fails with a typed error instead of hanging or crashing.
        with pytest.raises(KVTransferError):
            h = dst.start_read(peer, remote, local, b"req-after-exit")
            dst.wait(h, timeout_s=10)
        dst.remove_peer(peer)
        assert not dst.has_peer(peer)
    finally:
        dst.close()
        if child.poll() is None:
            child.kill()
            child.wait()


def test_nixl_wheel_of_torchs_cuda_major_is_tried_first() -> None:
    """With both NIXL wheels installed, the one built for torch's CUDA major version is imported: the
    other's UCX cannot register device memory (nixl-cu12 under torch for CUDA 13 refuses VRAM)."""
    from mesh.nixl_transfer import nixl_modules

    assert nixl_modules("13.0") == ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
    assert nixl_modules("12.8") == ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")
    assert nixl_modules(None) == ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")  # CPU torch


def test_the_local_agent_takes_nixl_options_and_ignores_them() -> None:
    """A worker passes its NIXL settings whatever the kind; anything else is still an error."""
    agent = create_transfer_agent(
        "local", "opts", random_pool(4), LAYOUT, xfer_mode="prepped", progress_thread=False
    )
    try:
        assert agent.num_blocks == 4
    finally:
        agent.close()
    with pytest.raises(TypeError):
        create_transfer_agent("local", "bad", random_pool(4), LAYOUT, no_such_option=1)
