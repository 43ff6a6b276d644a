"""The KV-transfer interface: one worker's registered KV pool, peers, block READs and notifications.

Owns the small contract every KV mover implements (in the spirit of vLLM's KV connectors):
``KVTransferAgent`` with ``metadata``/``add_peer``/``start_read``/``poll``/``wait``/``release``/
``get_notifications``/``send_notification``/``close``, the ``TransferMetadata`` a handshake RPC carries,
the pure ``coalesce_runs`` that turns block ids into descriptor runs, a same-process
``LocalKVTransferAgent`` for tests of the code above this layer, and the ``create_transfer_agent`` factory.
The NIXL implementation lives in ``mesh/nixl_transfer.py``.

All checks that guard the pool live here, in the base class, so every implementation gets them: the peer's
layout fingerprint is compared before a peer is registered and again before any read, and block ids are
range-checked before a descriptor is built. This module must not import NIXL (it is optional), any service
package, or know what a request is: a notification is opaque bytes chosen by the caller.
"""

from __future__ import annotations

import itertools
import threading
import time
import uuid
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from mesh.kv_layout import KVLayout, LayoutMismatchError, check_compatible

__all__ = [
    "KVTransferAgent",
    "KVTransferError",
    "KVTransferTimeoutError",
    "LayoutMismatchError",
    "LocalKVTransferAgent",
    "TransferHandle",
    "TransferMetadata",
    "TransferState",
    "coalesce_runs",
    "create_transfer_agent",
]

TransferState = Literal["DONE", "PROC"]


class KVTransferError(RuntimeError):
    """A KV transfer could not be set up or failed on the wire (unknown peer, backend error, ERR state)."""


class KVTransferTimeoutError(KVTransferError, TimeoutError):
    """``wait`` ran out of time; the transfer may still complete, the handle is not released."""


@dataclass(frozen=True)
class TransferMetadata:
    """What one worker tells a peer in the handshake RPC so the peer can read its pool."""

    agent_name: str
    agent_metadata: bytes  # backend connection info (NIXL agent metadata); empty for the local agent
    layout_fingerprint: str
    block_nbytes: int
    num_blocks: int
    base_address: int
    device: str  # torch device string of the pool, e.g. "cpu", "cuda:0"
    mem_type: str  # "DRAM" or "VRAM"


@dataclass
class TransferHandle:
    """One in-flight READ. Opaque to callers except for the read-only facts below."""

    peer: str
    nbytes: int
    num_blocks: int
    num_descriptors: int
    notif: bytes
    started_at: float
    state: str = "PROC"  # "PROC", "DONE" or "ERR"
    finished_at: float | None = None
    released: bool = False
    error: str | None = None
    backend_handle: Any = field(default=None, repr=False)


def coalesce_runs(
    local_block_ids: Sequence[int], remote_block_ids: Sequence[int]
) -> list[tuple[int, int, int]]:
    """Group a block mapping into runs that are contiguous on both sides.

    Pair ``i`` reads remote block ``remote_block_ids[i]`` into local block ``local_block_ids[i]``. The pairs are
    ordered by local id, then consecutive local ids that map to consecutive remote ids merge into one run.
    Returns ``[(local_start, remote_start, nblocks), ...]`` ordered by ``local_start``; each run becomes one
    transfer descriptor, because a fixed cost per descriptor dominates small transfers.
    """
    if len(local_block_ids) != len(remote_block_ids):
        raise ValueError(
            f"local_block_ids has {len(local_block_ids)} ids but remote_block_ids has {len(remote_block_ids)}"
        )
    runs: list[tuple[int, int, int]] = []
    for local, remote in sorted(zip(local_block_ids, remote_block_ids, strict=True)):
        if runs:
            l0, r0, n = runs[-1]
            if local == l0 + n and remote == r0 + n:
                runs[-1] = (l0, r0, n + 1)
                continue
        runs.append((int(local), int(remote), 1))
    return runs


def _mem_type(device: torch.device) -> str:
    return "VRAM" if device.type == "cuda" else "DRAM"


class KVTransferAgent(ABC):
    """Owns one registered KV pool and reads blocks from peers' pools into it.

    Subclasses implement the ``_``-prefixed hooks; validation, coalescing and counters live here. Not a
    process-wide singleton: one agent per pool. Methods are safe to call from several threads.
    """

    def __init__(self, name: str, pool: torch.Tensor, layout: KVLayout) -> None:
        expected_shape = layout.block_shape
        if pool.dim() != 1 + len(expected_shape) or tuple(pool.shape[1:]) != expected_shape:
            raise ValueError(
                f"KV pool shape {tuple(pool.shape)} does not match layout "
                f"[num_blocks, {', '.join(map(str, expected_shape))}]"
            )
        if str(pool.dtype).removeprefix("torch.") != layout.dtype:
            raise ValueError(f"KV pool dtype {pool.dtype} does not match layout dtype {layout.dtype}")
        if not pool.is_contiguous():
            raise ValueError("KV pool must be one contiguous tensor (block i is one byte range)")
        self.name = name
        # Backends key peers by agent name; a uuid keeps two agents of one process (or a restarted worker)
        # from colliding.
        self.agent_name = f"{name}-{uuid.uuid4().hex[:12]}"
        self.pool = pool
        self.layout = layout
        self.num_blocks = int(pool.shape[0])
        self.block_nbytes = layout.block_nbytes
        self.base_address = int(pool.data_ptr())
        self.device = str(pool.device)
        self.mem_type = _mem_type(pool.device)
        self._peers: dict[str, TransferMetadata] = {}
        self._unreleased: dict[int, TransferHandle] = {}  # released (cancelled if need be) by close()
        self._lock = threading.RLock()
        self._closed = False
        # Counters for metrics (read them; only this class writes them).
        self.bytes_transferred = 0
        self.transfer_seconds = 0.0
        self.transfers_completed = 0
        self.transfers_failed = 0
        self.descriptors_posted = 0

    # -- handshake -------------------------------------------------------------------------------------

    def metadata(self) -> TransferMetadata:
        return TransferMetadata(
            agent_name=self.agent_name,
            agent_metadata=self._agent_metadata(),
            layout_fingerprint=self.layout.fingerprint,
            block_nbytes=self.block_nbytes,
            num_blocks=self.num_blocks,
            base_address=self.base_address,
            device=self.device,
            mem_type=self.mem_type,
        )

    def add_peer(self, meta: TransferMetadata) -> str:
        """Register a peer from its handshake metadata; returns its name. Idempotent for unchanged metadata."""
        check_compatible(self.layout, meta.layout_fingerprint)
        if meta.block_nbytes != self.block_nbytes:
            raise LayoutMismatchError(
                f"peer {meta.agent_name} announces {meta.block_nbytes} bytes per block, local layout has "
                f"{self.block_nbytes}"
            )
        with self._lock:
            self._check_open()
            known = self._peers.get(meta.agent_name)
            if known == meta:
                return meta.agent_name
            if known is not None:
                self._disconnect_peer(meta.agent_name)
                del self._peers[meta.agent_name]
            self._connect_peer(meta)
            self._peers[meta.agent_name] = meta
        return meta.agent_name

    def has_peer(self, name: str) -> bool:
        with self._lock:
            return name in self._peers

    def remove_peer(self, name: str) -> None:
        with self._lock:
            if self._peers.pop(name, None) is not None:
                self._disconnect_peer(name)

    # -- reads -----------------------------------------------------------------------------------------

    def start_read(
        self,
        peer: str,
        remote_block_ids: Sequence[int],
        local_block_ids: Sequence[int],
        notif: bytes = b"",
        *,
        layout_fingerprint: str | None = None,
    ) -> TransferHandle:
        """Start reading ``peer``'s blocks into the local pool; returns at once.

        ``notif`` reaches the peer (``get_notifications``) when the read completes; an empty ``notif`` sends
        nothing. ``layout_fingerprint``, when given (the one a KV handle carries), is checked too. All checks
        happen before any byte moves.
        """
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(
                f"{len(remote_block_ids)} remote block ids but {len(local_block_ids)} local block ids"
            )
        with self._lock:
            self._check_open()
            meta = self._peers.get(peer)
            if meta is None:
                raise KVTransferError(
                    f"unknown peer {peer!r}: call add_peer with its handshake metadata first"
                )
            check_compatible(self.layout, meta.layout_fingerprint)
            if layout_fingerprint is not None:
                check_compatible(self.layout, layout_fingerprint)
            _check_ids("remote", remote_block_ids, meta.num_blocks)
            _check_ids("local", local_block_ids, self.num_blocks)
            if len(set(local_block_ids)) != len(local_block_ids):
                raise ValueError("local_block_ids contains duplicates: two blocks would be read into one")
            runs = coalesce_runs(local_block_ids, remote_block_ids)
            handle = TransferHandle(
                peer=peer,
                nbytes=len(local_block_ids) * self.block_nbytes,
                num_blocks=len(local_block_ids),
                num_descriptors=len(runs),
                notif=notif,
                started_at=time.perf_counter(),
            )
            if not runs:
                # Nothing to move (everything was cached locally) but the peer still waits to free its blocks.
                if notif:
                    self._send_notification(peer, notif)
                self._finish(handle, "DONE")
                return handle
            try:
                handle.backend_handle = self._post_read(
                    meta, runs, list(local_block_ids), list(remote_block_ids), notif
                )
            except KVTransferError:
                self.transfers_failed += 1
                raise
            self.descriptors_posted += len(runs)
            self._unreleased[id(handle)] = handle
            return handle

    def poll(self, handle: TransferHandle) -> TransferState:
        """``"DONE"`` or ``"PROC"``; raises ``KVTransferError`` if the transfer failed."""
        with self._lock:
            if handle.state == "PROC":
                self._check_open()
                if handle.released:
                    raise KVTransferError("poll on a released transfer handle")
                self._finish(handle, self._check(handle))
            if handle.state == "ERR":
                raise KVTransferError(
                    f"KV read of {handle.num_blocks} blocks from {handle.peer} failed"
                    + (f": {handle.error}" if handle.error else "")
                )
            return "DONE" if handle.state == "DONE" else "PROC"

    def wait(self, handle: TransferHandle, timeout_s: float | None = None) -> None:
        """Block until ``handle`` is done; raises ``KVTransferTimeoutError`` after ``timeout_s``."""
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        spins = 0
        while self.poll(handle) != "DONE":
            if deadline is not None and time.perf_counter() > deadline:
                raise KVTransferTimeoutError(
                    f"KV read of {handle.num_blocks} blocks from {handle.peer} not done after {timeout_s} s"
                )
            spins += 1
            # Spin briefly (small reads finish in microseconds), then stop burning a core.
            time.sleep(0 if spins < 1000 else 0.0002)

    def release(self, handle: TransferHandle) -> None:
        """Free the backend's resources for ``handle``. Releasing an unfinished read cancels it if it can."""
        with self._lock:
            if handle.released:
                return
            handle.released = True
            self._unreleased.pop(id(handle), None)
            if handle.backend_handle is not None:
                self._release(handle)
                handle.backend_handle = None

    # -- notifications ---------------------------------------------------------------------------------

    def get_notifications(self) -> dict[str, list[bytes]]:
        """New notifications since the last call, by sender agent name."""
        with self._lock:
            self._check_open()
            return self._get_notifications()

    def send_notification(self, peer: str, msg: bytes) -> None:
        with self._lock:
            self._check_open()
            if peer not in self._peers:
                raise KVTransferError(
                    f"unknown peer {peer!r}: call add_peer with its handshake metadata first"
                )
            self._send_notification(peer, msg)

    # -- lifecycle -------------------------------------------------------------------------------------

    def close(self) -> None:
        """Release unreleased reads, forget all peers and deregister the pool. Idempotent."""
        with self._lock:
            if self._closed:
                return
            # Memory must not be deregistered under a read still in flight.
            for handle in list(self._unreleased.values()):
                self.release(handle)
            for name in list(self._peers):
                self.remove_peer(name)
            self._close()
            self._closed = True

    def __enter__(self) -> KVTransferAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise KVTransferError(f"KV transfer agent {self.agent_name} is closed")

    def _finish(self, handle: TransferHandle, state: str) -> None:
        if state == "PROC":
            return
        handle.state = state
        handle.finished_at = time.perf_counter()
        if state == "DONE":
            self.bytes_transferred += handle.nbytes
            self.transfer_seconds += handle.finished_at - handle.started_at
            self.transfers_completed += 1
        else:
            self.transfers_failed += 1

    # -- backend hooks ---------------------------------------------------------------------------------

    @abstractmethod
    def _agent_metadata(self) -> bytes: ...

    @abstractmethod
    def _connect_peer(self, meta: TransferMetadata) -> None: ...

    @abstractmethod
    def _disconnect_peer(self, name: str) -> None: ...

    @abstractmethod
    def _post_read(
        self,
        peer: TransferMetadata,
        runs: list[tuple[int, int, int]],
        local_block_ids: list[int],
        remote_block_ids: list[int],
        notif: bytes,
    ) -> Any:
        """Post the read of validated ``runs``; return the backend's handle. Raise ``KVTransferError``."""

    @abstractmethod
    def _check(self, handle: TransferHandle) -> str:
        """``"DONE"``, ``"PROC"`` or ``"ERR"``."""

    @abstractmethod
    def _release(self, handle: TransferHandle) -> None: ...

    @abstractmethod
    def _get_notifications(self) -> dict[str, list[bytes]]: ...

    @abstractmethod
    def _send_notification(self, peer: str, msg: bytes) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...


def _check_ids(side: str, block_ids: Sequence[int], num_blocks: int) -> None:
    for b in block_ids:
        if not 0 <= b < num_blocks:
            raise ValueError(f"{side} block id {b} out of range: that pool has {num_blocks} blocks")


class LocalKVTransferAgent(KVTransferAgent):
    """Same-process implementation: peers are other local agents, reads are torch copies of block runs.

    For unit tests of the code above the transfer layer; it moves nothing between processes. Reads complete
    inside ``start_read``; notifications go to the target's in-process inbox.
    """

    _registry: dict[str, LocalKVTransferAgent] = {}
    _inboxes: dict[str, dict[str, list[bytes]]] = {}
    _registry_lock = threading.Lock()
    _handle_ids = itertools.count()

    def __init__(self, name: str, pool: torch.Tensor, layout: KVLayout) -> None:
        super().__init__(name, pool, layout)
        with self._registry_lock:
            self._registry[self.agent_name] = self
            self._inboxes[self.agent_name] = {}

    def _agent_metadata(self) -> bytes:
        return b""

    def _connect_peer(self, meta: TransferMetadata) -> None:
        with self._registry_lock:
            if meta.agent_name not in self._registry:
                raise KVTransferError(
                    f"local agent {meta.agent_name!r} is not registered in this process "
                    "(LocalKVTransferAgent only reaches agents of the same process)"
                )

    def _disconnect_peer(self, name: str) -> None:
        pass

    def _peer_agent(self, name: str) -> LocalKVTransferAgent:
        with self._registry_lock:
            peer = self._registry.get(name)
        if peer is None:
            raise KVTransferError(f"local peer {name!r} is gone (closed)")
        return peer

    def _post_read(
        self,
        peer: TransferMetadata,
        runs: list[tuple[int, int, int]],
        local_block_ids: list[int],
        remote_block_ids: list[int],
        notif: bytes,
    ) -> Any:
        source = self._peer_agent(peer.agent_name).pool
        for local_start, remote_start, n in runs:
            self.pool[local_start : local_start + n].copy_(source[remote_start : remote_start + n])
        if notif:
            self._send_notification(peer.agent_name, notif)
        return next(self._handle_ids)

    def _check(self, handle: TransferHandle) -> str:
        return "DONE"

    def _release(self, handle: TransferHandle) -> None:
        pass

    def _get_notifications(self) -> dict[str, list[bytes]]:
        with self._registry_lock:
            inbox = self._inboxes.get(self.agent_name, {})
            self._inboxes[self.agent_name] = {}
        return inbox

    def _send_notification(self, peer: str, msg: bytes) -> None:
        with self._registry_lock:
            inbox = self._inboxes.get(peer)
            if inbox is None:
                raise KVTransferError(f"local peer {peer!r} is gone (closed)")
            inbox.setdefault(self.agent_name, []).append(bytes(msg))

    def _close(self) -> None:
        with self._registry_lock:
            self._registry.pop(self.agent_name, None)
            self._inboxes.pop(self.agent_name, None)


_NIXL_ONLY = ("xfer_mode", "progress_thread", "num_threads")


def create_transfer_agent(
    kind: Literal["nixl", "local"], name: str, pool: torch.Tensor, layout: KVLayout, **kwargs: Any
) -> KVTransferAgent:
    """Build the KV-transfer agent ``kind`` for ``pool``; extra keyword arguments go to the implementation.
    NIXL's own options (``xfer_mode``, ``progress_thread``) are dropped for the local agent, which has no use
    for them, so callers pass a worker's settings whatever the kind."""
    if kind == "local":
        kwargs = {k: v for k, v in kwargs.items() if k not in _NIXL_ONLY}
        return LocalKVTransferAgent(name, pool, layout, **kwargs)
    if kind == "nixl":
        from mesh.nixl_transfer import NixlKVTransferAgent  # NIXL is optional: import only when asked

        return NixlKVTransferAgent(name, pool, layout, **kwargs)
    raise ValueError(f"unknown KV transfer kind {kind!r}: expected 'nixl' or 'local'")
