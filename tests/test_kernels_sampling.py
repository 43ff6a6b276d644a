"""The one-pass Triton temperature sampler (``kernels/triton_sampling.py``) against the engine's sampler.

Without a GPU the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py) on small vocabularies spread over several chunks; the ``gpu`` tests use a 128k vocabulary.
The reference is ``Sampler`` with the torch backend (the production path on the CPU) given seeded
parameters: its per-row keys are ``_position_seed(seed, position)``, which the kernel is handed too, so on
fresh random logits both pick the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, _position_seed
from engine.sampling_params import SamplingParams
from kernels.triton_sampling import gumbel_sample_triton
from tests.kernel_testing import DEVICE


def sampler_reference(
    logits: torch.Tensor, temps: torch.Tensor, seed: int, min_p: torch.Tensor | None
) -> torch.Tensor:
    """What the engine's torch sampler draws for these rows: row i seeded with ``seed`` at position i."""
    params = [
        SamplingParams(temperature=float(t), seed=seed, min_p=float(min_p[i]) if min_p is not None else 0.0)
        for i, t in enumerate(temps.tolist())
    ]
    return Sampler(0, "torch").sample(logits, params, list(range(len(params))))


def row_keys(seed: int, rows: int) -> torch.Tensor:
    return torch.tensor([_position_seed(seed, i) for i in range(rows)], dtype=torch.int64, device=DEVICE)


@pytest.mark.parametrize("vocab", [7, 64, 300])
@pytest.mark.parametrize("with_min_p", [False, True])
def test_kernel_picks_the_torch_race_token(vocab: int, with_min_p: bool) -> None:
    torch.manual_seed(vocab)
    rows = 24
    logits = torch.randn(rows, vocab, device=DEVICE) * 2
    temps = torch.rand(rows, device=DEVICE) * 1.5 + 0.2
    min_p = torch.rand(rows, device=DEVICE) * 0.3 if with_min_p else None
    got = gumbel_sample_triton(logits, temps, row_keys(5, rows), min_p)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, sampler_reference(logits, temps, 5, min_p))
    assert not torch.equal(got, logits.argmax(-1)), "temperatures up to 1.7 should sample away from argmax"


def test_kernel_respects_min_p_and_low_temperature() -> None:
    """min_p 1 keeps only the argmax; a tiny temperature makes any key pick it too."""
    torch.manual_seed(1)
    logits = torch.randn(6, 200, device=DEVICE)
    keys = torch.arange(6, dtype=torch.int64, device=DEVICE) * 7919
    ones = torch.ones(6, device=DEVICE)
    assert torch.equal(gumbel_sample_triton(logits, ones, keys, ones), logits.argmax(-1))
    assert torch.equal(gumbel_sample_triton(logits, ones * 1e-4, keys, None), logits.argmax(-1))


def test_strided_rows_and_empty_batch() -> None:
    torch.manual_seed(2)
    wide = torch.randn(5, 130, device=DEVICE)
    logits = wide[:, :100]
    temps = torch.ones(5, device=DEVICE)
    got = gumbel_sample_triton(logits, temps, row_keys(99, 5), None)
    assert torch.equal(got, sampler_reference(logits, temps, 99, None))
    empty = gumbel_sample_triton(torch.empty(0, 10, device=DEVICE), temps[:0], row_keys(99, 0), None)
    assert empty.shape == (0,)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sampler_uses_the_kernel_and_matches_the_torch_path() -> None:
    """A 128k vocabulary at batch 64: the Triton sampler and the torch sampler agree on (nearly) every
    row (float rounding may flip a near-tie), and the kernel runs without a host synchronisation."""
    torch.manual_seed(3)
    logits = torch.randn(64, 128_256, device="cuda") * 3
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(32)]
    params += [SamplingParams(temperature=1.1, min_p=0.05) for _ in range(31)] + [
        SamplingParams(temperature=0)
    ]
    positions = list(range(64))
    fused, reference = Sampler(7, "triton"), Sampler(7, "torch")
    kernel_calls: list[int] = []
    kernel = fused._gumbel_sample
    assert kernel is gumbel_sample_triton
    fused._gumbel_sample = lambda *args: kernel_calls.append(1) or kernel(*args)
    a, _ = fused(logits, params, positions)
    assert kernel_calls == [1], "the Triton sampler did not take the one-pass kernel"
    b, _ = reference(logits, params, positions)
    assert sum(x != y for x, y in zip(a, b, strict=True)) <= 1, (a, b)
    assert a[-1] == int(logits[-1].argmax())
    temps, keys = torch.full((64,), 0.8, device="cuda"), torch.arange(64, dtype=torch.int64, device="cuda")
    gumbel_sample_triton(logits, temps, keys, None)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gumbel_sample_triton(logits, temps, keys, None)
    finally:
        torch.cuda.set_sync_debug_mode("default")
