"""NIXL implementation of the KV-transfer interface: one UCX agent per KV pool, block READs as NIXL READs.

Owns the NIXL agent of one worker: it registers the whole pool once (host memory as ``DRAM``, device memory as
``VRAM``), loads peers' agent metadata, turns coalesced block runs into NIXL descriptors and posts READs whose
notification reaches the peer when the read completes. Validation (fingerprints, block ranges) is done by
``mesh.kv_transfer.KVTransferAgent`` before anything here runs. It must not decide which blocks to move or when
to free them; that is the services' job.

NIXL is optional: it is imported when an agent is created, from ``nixl._api`` (meta-package ``nixl``),
``nixl_cu12._api`` or ``nixl_cu13._api``, whichever is installed (with both, the one of torch's CUDA major
version first: a wheel built for another CUDA version has a UCX that cannot see device memory).
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType
from typing import Any, Literal

import numpy as np
import torch

from mesh.kv_layout import KVLayout
from mesh.kv_transfer import KVTransferAgent, KVTransferError, TransferHandle, TransferMetadata

__all__ = ["NixlKVTransferAgent", "NixlNotInstalledError", "import_nixl_api"]

_NIXL_MODULES = ("nixl._api", "nixl_cu12._api", "nixl_cu13._api")

# UCX turns CUDA-IPC get-zcopy off when it sees no NVLink and READs of device memory between two processes fall
# back to ~0.5 GB/s; with it on they run over cuda_ipc (see shared REFERENCES.md, NIXL section). UCX reads the
# environment when each agent's backend is created, so it is set just before. Only for device pools: on a host
# with no CUDA transport loaded UCX warns "unused environment variable" on every agent.
_UCX_VRAM_DEFAULT_ENV = {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": "y"}

XferMode = Literal["coalesced", "prepped"]


class NixlNotInstalledError(ImportError):
    """NIXL was requested but no NIXL Python package is importable."""


def nixl_modules(cuda_version: str | None) -> tuple[str, ...]:
    """The NIXL modules to try, in order, for torch built with ``cuda_version`` (None: no CUDA): the
    meta-package, then the wheel of that CUDA major version, then the other."""
    if cuda_version and cuda_version.split(".")[0] == "13":
        return ("nixl._api", "nixl_cu13._api", "nixl_cu12._api")
    return _NIXL_MODULES


def import_nixl_api() -> ModuleType:
    """Return NIXL's ``_api`` module from whichever NIXL wheel is installed."""
    errors = []
    for module in nixl_modules(torch.version.cuda):
        try:
            return importlib.import_module(module)
        except ImportError as e:
            errors.append(f"{module}: {e}")
    raise NixlNotInstalledError(
        "KV transfer kind 'nixl' needs NIXL: `pip install nixl-cu12` (CUDA 12 wheel, also runs on host "
        "memory with no GPU), `pip install nixl-cu13` (CUDA 13) or `pip install nixl`; tried "
        + "; ".join(errors)
    )


def _device_id(device: str) -> int:
    # NIXL wants 0 for host memory and the CUDA ordinal for device memory.
    d = torch.device(device)
    return (d.index or 0) if d.type == "cuda" else 0


def _run_descs(
    base: int, block_nbytes: int, dev_id: int, starts: np.ndarray, counts: np.ndarray
) -> np.ndarray:
    descs = np.empty((len(starts), 3), dtype=np.uint64)
    descs[:, 0] = base + starts.astype(np.uint64) * block_nbytes
    descs[:, 1] = counts.astype(np.uint64) * block_nbytes
    descs[:, 2] = dev_id
    return descs


class NixlKVTransferAgent(KVTransferAgent):
    """KV transfer over NIXL (UCX backend).

    ``xfer_mode="coalesced"`` (this class's default; the workers' ``--kv-xfer-mode`` defaults to prepped)
    builds one descriptor per run of adjacent blocks and posts it with
    ``initialize_xfer``. ``xfer_mode="prepped"`` prepares one descriptor per block of each pool once (local at
    construction, remote per peer) and posts ``make_prepped_xfer`` with block indices; see
    ``benchmarks/kv_transfer_bench.py`` for how the two compare.

    ``progress_thread`` (default on) gives the UCX backend its own progress thread. The *target* of a READ (the
    prefill side, whose pool is read) needs progress: without it a peer's READ never completes (the bytes land,
    but the initiator never sees DONE; seen with NIXL 1.5.1 on host memory), or completes only as often as the
    target calls ``get_notifications``. The reader makes its own progress in ``poll``. NIXL 1.5.1's Python API
    runs the thread with no delay between progress calls, so it keeps one core busy for as long as the agent
    lives, idle or not: on a small CPU machine an agent that only reads (decode) may turn it off.
    """

    def __init__(
        self,
        name: str,
        pool: torch.Tensor,
        layout: KVLayout,
        *,
        xfer_mode: XferMode = "coalesced",
        backends: tuple[str, ...] = ("UCX",),
        progress_thread: bool = True,
        num_threads: int = 0,
    ) -> None:
        if xfer_mode not in ("coalesced", "prepped"):
            raise ValueError(f"xfer_mode must be 'coalesced' or 'prepped', not {xfer_mode!r}")
        super().__init__(name, pool, layout)
        api = import_nixl_api()
        if self.mem_type == "VRAM":
            for key, value in _UCX_VRAM_DEFAULT_ENV.items():
                os.environ.setdefault(key, value)
        self.xfer_mode = xfer_mode
        self._dev_id = _device_id(self.device)
        self._agent = api.nixl_agent(
            self.agent_name,
            api.nixl_agent_config(
                backends=list(backends), enable_prog_thread=progress_thread, num_threads=num_threads
            ),
        )
        if not self._agent.backends:
            raise KVTransferError(f"NIXL could not create any of the backends {list(backends)}")
        # One registration for the whole pool, for the agent's lifetime.
        try:
            self._reg = self._agent.register_memory(
                [(self.base_address, self.num_blocks * self.block_nbytes, self._dev_id, "")], self.mem_type
            )
        except Exception as e:  # NIXL raises its own backend errors
            hint = ""
            if self.mem_type == "VRAM":  # seen with nixl-cu12 under torch for CUDA 13
                hint = (
                    f"; device memory needs a NIXL whose UCX was built for torch's CUDA "
                    f"({torch.version.cuda}): nixl-cu{(torch.version.cuda or '12').split('.')[0]}, "
                    f"not {api.__name__.split('.')[0]}?"
                )
            raise KVTransferError(
                f"NIXL could not register the KV pool's {self.mem_type} memory: {e!r}{hint}"
            ) from e
        # The agent metadata carries the registration, so it is taken after register_memory.
        self._md = self._agent.get_agent_metadata()
        self._local_prepped: Any = None
        self._remote_prepped: dict[str, Any] = {}
        if xfer_mode == "prepped":
            all_blocks = np.arange(self.num_blocks)
            descs = _run_descs(
                self.base_address, self.block_nbytes, self._dev_id, all_blocks, np.ones_like(all_blocks)
            )
            self._local_prepped = self._agent.prep_xfer_dlist("NIXL_INIT_AGENT", descs, self.mem_type)

    def _agent_metadata(self) -> bytes:
        return self._md

    def _connect_peer(self, meta: TransferMetadata) -> None:
        try:
            loaded = self._agent.add_remote_agent(meta.agent_metadata)
        except Exception as e:
            raise KVTransferError(f"NIXL could not load metadata of peer {meta.agent_name}: {e!r}") from e
        # add_remote_agent returns the name as bytes.
        loaded_name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if loaded_name != meta.agent_name:
            self._agent.remove_remote_agent(loaded_name)
            raise KVTransferError(
                f"peer metadata names agent {loaded_name!r} but the handshake said {meta.agent_name!r}"
            )
        if self.xfer_mode == "prepped":
            all_blocks = np.arange(meta.num_blocks)
            descs = _run_descs(
                meta.base_address,
                meta.block_nbytes,
                _device_id(meta.device),
                all_blocks,
                np.ones_like(all_blocks),
            )
            try:
                self._remote_prepped[meta.agent_name] = self._agent.prep_xfer_dlist(
                    meta.agent_name, descs, meta.mem_type
                )
            except Exception as e:
                self._agent.remove_remote_agent(meta.agent_name)
                raise KVTransferError(
                    f"NIXL could not prepare descriptors of peer {meta.agent_name}: {e!r}"
                ) from e

    def _disconnect_peer(self, name: str) -> None:
        prepped = self._remote_prepped.pop(name, None)
        if prepped is not None:
            prepped.release()
        self._agent.remove_remote_agent(name)

    def _post_read(
        self,
        peer: TransferMetadata,
        runs: list[tuple[int, int, int]],
        local_block_ids: list[int],
        remote_block_ids: list[int],
        notif: bytes,
    ) -> Any:
        try:
            if self.xfer_mode == "prepped":
                h = self._agent.make_prepped_xfer(
                    "READ",
                    self._local_prepped,
                    np.asarray(local_block_ids, dtype=np.int32),
                    self._remote_prepped[peer.agent_name],
                    np.asarray(remote_block_ids, dtype=np.int32),
                    notif,
                )
            else:
                r = np.asarray(runs, dtype=np.int64).reshape(-1, 3)
                local = _run_descs(self.base_address, self.block_nbytes, self._dev_id, r[:, 0], r[:, 2])
                remote = _run_descs(
                    peer.base_address, peer.block_nbytes, _device_id(peer.device), r[:, 1], r[:, 2]
                )
                h = self._agent.initialize_xfer(
                    "READ",
                    self._agent.get_xfer_descs(local, self.mem_type),
                    self._agent.get_xfer_descs(remote, peer.mem_type),
                    peer.agent_name,
                    notif,
                )
        except Exception as e:
            raise KVTransferError(f"NIXL could not create a READ from {peer.agent_name}: {e!r}") from e
        try:
            state = self._agent.transfer(h)
        except Exception as e:
            h.release()
            raise KVTransferError(f"NIXL could not post a READ from {peer.agent_name}: {e!r}") from e
        if state == "ERR":
            h.release()
            raise KVTransferError(f"NIXL READ from {peer.agent_name} failed when posted")
        return h

    def _check(self, handle: TransferHandle) -> str:
        try:
            return self._agent.check_xfer_state(handle.backend_handle)
        except Exception as e:
            # A peer that went away can surface as an exception here (e.g. nixlRemoteDisconnectError).
            handle.error = repr(e)
            return "ERR"

    def _release(self, handle: TransferHandle) -> None:
        try:
            handle.backend_handle.release()
        except Exception as e:
            raise KVTransferError(f"NIXL could not release a READ from {handle.peer}: {e!r}") from e

    def _get_notifications(self) -> dict[str, list[bytes]]:
        return self._agent.get_new_notifs()

    def _send_notification(self, peer: str, msg: bytes) -> None:
        try:
            self._agent.send_notif(peer, msg)
        except Exception as e:
            raise KVTransferError(f"NIXL could not notify {peer}: {e!r}") from e

    def _close(self) -> None:
        if self._local_prepped is not None:
            self._local_prepped.release()
            self._local_prepped = None
        self._agent.deregister_memory(self._reg)
        # Dropping the agent stops its progress thread (which otherwise keeps spinning a core).
        self._agent = None
