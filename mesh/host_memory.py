"""Host memory for KV blocks that another process reads or writes over NIXL: backed by transparent huge pages.

Between two processes on one machine UCX moves host memory with ``cma`` (``process_vm_readv``), whose cost
is dominated by walking and pinning the pages it reads: on the 2-core CPU machine READs of 16-512 blocks of
2 MiB ran at 7.8-8.2 GB/s from 4 KiB pages and 9.5-14 GB/s from huge pages (the side read from is what
counts; performance.md, "Expert moves in one kernel a tensor, and the KV offload store on an H100"). The KV offload store's host pool and a GPU worker's
staging blocks are therefore anonymous mappings advised ``MADV_HUGEPAGE`` (where the kernel offers
transparent huge pages, in ``always`` or ``madvise`` mode; elsewhere they are plain pages), touched once so
that their memory is committed at start, and, for staging next to a GPU, page-locked with
``cudaHostRegister`` so that copies to and from the device run at the copy engines' rate.
"""

from __future__ import annotations

import logging
import math
import mmap

import torch

log = logging.getLogger(__name__)

__all__ = ["HostBlocks"]


class HostBlocks:
    """A zeroed host tensor of ``shape`` and ``dtype`` on huge pages, optionally page-locked for CUDA;
    ``close`` unlocks it (before whatever registered it with NIXL has deregistered, never)."""

    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, pin: bool = False) -> None:
        nbytes = math.prod(shape) * dtype.itemsize
        self.nbytes = nbytes
        self.huge = False
        self.pinned = False
        self._map: mmap.mmap | None = None
        if nbytes and hasattr(mmap, "MADV_HUGEPAGE"):
            self._map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            try:
                self._map.madvise(mmap.MADV_HUGEPAGE)
                self.huge = True
            except OSError as exc:  # no transparent huge pages here: plain pages
                log.debug("MADV_HUGEPAGE refused (%s): KV host blocks on plain pages", exc)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8).view(dtype).view(shape)
            self.tensor.view(torch.uint8).zero_()  # commit the memory now (and its huge pages)
        else:
            self.tensor = torch.zeros(shape, dtype=dtype)
        if pin and nbytes:
            err = torch.cuda.cudart().cudaHostRegister(self.tensor.data_ptr(), nbytes, 0)
            if int(err) != 0:
                self.close()
                raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of KV host blocks failed: {err}")
            self.pinned = True

    def close(self) -> None:
        """Unlock the memory; the mapping goes when the last tensor viewing it does (``torch.frombuffer``
        keeps the mapping object, not an export of it, so unmapping here could leave a view dangling)."""
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.tensor.data_ptr())
            self.pinned = False
        self._map = None
