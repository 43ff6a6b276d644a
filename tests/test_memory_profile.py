"""Sizing the KV pool: num_kv_blocks, kv_cache_memory_gb, and gpu_memory_utilization's profile
(engine.memory_profile). The arithmetic and the settings run on the CPU; the measurement on a GPU (marked
``gpu``): the engine's memory stays within its fraction, and the fraction must be free at start-up."""

from __future__ import annotations

import gc

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.memory_profile import GIB, DeviceMemory, MemoryProfile, check_free, kv_blocks_within
from tests.kernel_testing import needs_gpu

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def test_pool_size_settings_on_the_cpu() -> None:
    default = LLM("tiny-dense").engine
    block = default.layout.block_nbytes
    assert default.block_pool.num_blocks == (GIB // 2) // block  # 0.5 GiB on the CPU
    assert default.memory_profile is None  # no profile off a GPU
    assert default.cache_info()["gpu_memory_utilization"] == ""
    sized = LLM("tiny-dense", kv_cache_memory_gb=0.01).engine
    assert sized.block_pool.num_blocks == int(0.01 * GIB) // block
    both = LLM("tiny-dense", kv_cache_memory_gb=0.01, num_kv_blocks=40).engine
    assert both.block_pool.num_blocks == 40 and both.kv_pool.shape[0] == 40


@pytest.mark.parametrize(
    "bad",
    [
        {"gpu_memory_utilization": 0.0},
        {"gpu_memory_utilization": 1.2},
        {"kv_cache_memory_gb": 0.0},
        {"num_kv_blocks": 0},
    ],
)
def test_bad_sizes_are_refused(bad: dict) -> None:
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name):
        EngineConfig(**bad)


def _profile(**kw: int) -> MemoryProfile:
    values = {"total": 100 * GIB, "budget": 90 * GIB, "weights": 60 * GIB, "activation_peak": 2 * GIB,
              "non_torch": GIB // 2} | kw  # fmt: skip
    return MemoryProfile(**values)


def test_blocks_within_the_budget() -> None:
    layout = LLM("tiny-dense", num_kv_blocks=4).engine.layout
    profile = _profile()
    assert profile.kv_bytes == 90 * GIB - 60 * GIB - 2 * GIB - GIB // 2
    blocks = kv_blocks_within(profile, layout, max_model_len=4096, utilization=0.9)
    assert blocks == profile.kv_bytes // layout.block_nbytes
    assert blocks * layout.block_nbytes <= profile.kv_bytes < (blocks + 1) * layout.block_nbytes
    assert "KV pool 27.50 GiB" in profile.describe()


def test_a_budget_short_of_one_sequence_says_what_would_do() -> None:
    layout = LLM("tiny-dense", num_kv_blocks=4).engine.layout
    tight = _profile(budget=60 * GIB + 2 * GIB + GIB // 2 + 10 * layout.block_nbytes)  # 10 blocks
    assert kv_blocks_within(tight, layout, max_model_len=10 * layout.block_size, utilization=0.9) == 10
    with pytest.raises(ValueError, match=f"lower max_model_len to at most {10 * layout.block_size}"):
        kv_blocks_within(tight, layout, max_model_len=10 * layout.block_size + 1, utilization=0.9)
    over = _profile(budget=50 * GIB)  # the weights alone pass the budget
    with pytest.raises(ValueError, match="raise gpu_memory_utilization"):
        kv_blocks_within(over, layout, max_model_len=16, utilization=0.5)


def test_the_fraction_must_be_free_at_start() -> None:
    reading = DeviceMemory(free=50 * GIB, total=100 * GIB, allocated=0, reserved=0)
    check_free(reading, 0.5)
    with pytest.raises(ValueError, match=r"only 50.00 GiB is free.*at most 0.500"):
        check_free(reading, 0.6)


# ---- on a GPU ---------------------------------------------------------------------------------------


def _free() -> int:
    gc.collect()
    torch.cuda.empty_cache()
    return DeviceMemory.read(torch.device("cuda")).free


@needs_gpu
@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_engine_keeps_to_its_fraction(model: str) -> None:
    """The engine's memory (weights, pool, warm-up, graphs aside) stays within utilization x total, and
    takes most of it; the pool is the profile's KV bytes in whole blocks; tokens equal a sized pool's."""
    utilization = 0.03
    before = _free()
    llm = LLM(model, device="cuda", dtype="bfloat16", kernel_backend="triton",
              gpu_memory_utilization=utilization)  # fmt: skip
    engine = llm.engine
    profile = engine.memory_profile
    assert profile is not None and engine.graph_memory_bytes is not None
    assert profile.budget == int(utilization * profile.total)
    assert engine.cache_info()["gpu_memory_utilization"] == str(utilization)
    assert profile.weights > 0 and profile.activation_peak > 0
    pool_bytes = engine.kv_pool.numel() * engine.kv_pool.element_size()
    assert pool_bytes == engine.block_pool.num_blocks * engine.layout.block_nbytes
    assert profile.kv_bytes - engine.layout.block_nbytes < pool_bytes <= profile.kv_bytes
    prompts = [[7, 8, 9, 10, 11, 12], [100, 3, 5]]
    got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    used = before - DeviceMemory.read(torch.device("cuda")).free
    # Within the budget but for the graphs, and for what the warm-up's kernel modules and the allocator's
    # rounding add after the profile (a few MiB on these models).
    assert used - engine.graph_memory_bytes <= profile.budget + 32 * 2**20
    assert used >= 0.9 * profile.budget
    del llm, engine
    sized = LLM(model, device="cuda", dtype="bfloat16", kernel_backend="triton", num_kv_blocks=256)
    assert [o.token_ids for o in sized.generate(prompts, GREEDY)] == got


@needs_gpu
def test_a_second_engine_cannot_take_what_the_first_holds() -> None:
    kw = dict(device="cuda", dtype="bfloat16", kernel_backend="triton")
    first = LLM("tiny-dense", gpu_memory_utilization=0.4, **kw)
    with pytest.raises(ValueError, match="lower gpu_memory_utilization"):
        LLM("tiny-dense", gpu_memory_utilization=0.65, **kw)
    assert first.generate([[5, 6, 7]], GREEDY)[0].token_ids  # the first engine is unharmed
