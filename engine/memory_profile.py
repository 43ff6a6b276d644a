"""Sizing the KV pool from a fraction of the GPU's memory (vLLM's ``--gpu-memory-utilization``).

The engine may use ``utilization x total`` bytes of the device. What it needs besides the KV pool is
measured, not estimated: the weights (device memory the load took), the peak of one profiling pass at the
step's full token budget (a forward of ``max_num_batched_tokens`` tokens, the logits of ``max_num_seqs``
rows and each sampling path over them: what an eager step can hold at once), and memory outside torch's
allocator that appeared meanwhile (CUDA context pieces, cuBLAS and NCCL buffers). The pool takes the rest.
Memory of other processes and of other engines in this one is not counted against the fraction, but the
fraction must be free when the engine starts (vLLM's rule), so two engines on one GPU each take their part.

CUDA graphs are captured after the pool is allocated (they record its address), so their memory is not
in the profile: it comes out of the ``1 - utilization`` left over, as in vLLM before its graph profiling;
the engine logs what the captures took (``graph_bytes``) beside the budget.

Owns the measurement only; the engine decides when to size by it (``EngineConfig``: ``num_kv_blocks``
first, then ``kv_cache_memory_gb``, then this on CUDA devices).
"""

from __future__ import annotations

import gc
import logging
from dataclasses import dataclass

import torch

from engine.cuda_graphs import expert_counts_restored
from engine.kv_cache import allocate_pool
from engine.model_runner import profile_sampling, scratch_forward
from engine.models.decoder import DecoderModel
from engine.sampler import Sampler
from mesh.kv_layout import KVLayout

log = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class DeviceMemory:
    """One reading of a device's memory: the driver's free and total, torch's allocated and reserved."""

    free: int
    total: int
    allocated: int
    reserved: int

    @classmethod
    def read(cls, device: torch.device) -> DeviceMemory:
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(free, total, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))


@dataclass(frozen=True)
class MemoryProfile:
    """Where the engine's share of the device goes, in bytes."""

    total: int  # the device's memory
    budget: int  # utilization x total: what the engine may use
    weights: int  # device memory the model's load took
    activation_peak: int  # the profiling pass's peak above the loaded model
    non_torch: int  # memory outside torch's allocator that appeared since the start (>= 0)

    @property
    def kv_bytes(self) -> int:
        return self.budget - self.weights - self.activation_peak - self.non_torch

    def describe(self) -> str:
        return (
            f"budget {self.budget / GIB:.2f} GiB of {self.total / GIB:.2f}: weights {self.weights / GIB:.2f}, "
            f"activation peak {self.activation_peak / GIB:.2f}, outside torch {self.non_torch / GIB:.2f}, "
            f"KV pool {self.kv_bytes / GIB:.2f} GiB"
        )


def check_free(start: DeviceMemory, utilization: float) -> None:
    """vLLM's start-up rule: the fraction asked for must be free before the engine loads anything."""
    budget = int(utilization * start.total)
    if start.free < budget:
        raise ValueError(
            f"gpu_memory_utilization={utilization} asks for {budget / GIB:.2f} GiB of the GPU's "
            f"{start.total / GIB:.2f} GiB, but only {start.free / GIB:.2f} GiB is free (other processes or "
            f"engines hold the rest): lower gpu_memory_utilization to at most {start.free / start.total:.3f}, "
            "or size the KV pool with kv_cache_memory_gb or num_kv_blocks"
        )


def profile_memory(
    start: DeviceMemory,
    utilization: float,
    model: DecoderModel,
    layout: KVLayout,
    sampler: Sampler,
    num_tokens: int,
    num_rows: int,
) -> MemoryProfile:
    """Measure what the loaded ``model`` needs besides the KV pool, ``start`` having been read before it
    was loaded: a forward of ``num_tokens`` tokens over a one-block pool (nothing written to it), the
    logits of its last ``num_rows`` rows, and every sampling path over them. Expert counters are left as
    they were."""
    device = next(model.parameters()).device
    gc.collect()
    torch.cuda.empty_cache()
    loaded = DeviceMemory.read(device)
    torch.cuda.reset_peak_memory_stats(device)
    pool = allocate_pool(layout, 1, device)
    with torch.inference_mode(), expert_counts_restored(model):
        hidden = scratch_forward(model, pool, layout.block_size, num_tokens)
        logits = model.compute_logits(hidden[-num_rows:]).float()
        del hidden
        profile_sampling(sampler, logits)
        del logits
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    after = DeviceMemory.read(device)
    del pool
    gc.collect()
    torch.cuda.empty_cache()
    used_since_start = start.free - after.free
    torch_since_start = after.reserved - start.reserved
    return MemoryProfile(
        total=start.total,
        budget=int(utilization * start.total),
        weights=loaded.allocated - start.allocated,
        activation_peak=max(0, peak - loaded.allocated),
        non_torch=max(0, used_since_start - torch_since_start),
    )


def kv_blocks_within(profile: MemoryProfile, layout: KVLayout, max_model_len: int, utilization: float) -> int:
    """The pool's blocks: the profile's KV bytes in whole blocks. Raises when they cannot hold one
    sequence of ``max_model_len`` tokens (vLLM's rule), saying what would."""
    blocks = max(0, profile.kv_bytes) // layout.block_nbytes
    tokens = blocks * layout.block_size
    if tokens < max_model_len:
        need = -(-max_model_len // layout.block_size) * layout.block_nbytes
        raise ValueError(
            f"the KV pool would hold {tokens} tokens ({max(0, profile.kv_bytes) / GIB:.2f} GiB: "
            f"{profile.describe()}), fewer than one sequence of max_model_len {max_model_len} "
            f"({need / GIB:.2f} GiB): raise gpu_memory_utilization (now {utilization}), lower max_model_len "
            f"to at most {tokens}, or lower max_num_batched_tokens"
        )
    return blocks
