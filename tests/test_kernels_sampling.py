"""The one-pass Triton temperature sampler (``kernels/triton_sampling.py``) against the torch race.

Without a GPU the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``, set before triton is
imported) on small vocabularies spread over several chunks; the ``gpu`` tests use a 128k vocabulary.
Both sides use the same keys and the same hash, so on fresh random logits they pick the same tokens.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from engine.sampler import Sampler, _position_seed, exponential_noise  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

triton = pytest.importorskip("triton")

from kernels.triton_sampling import gumbel_sample_triton  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def torch_race(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, min_p: torch.Tensor | None):
    probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
    if min_p is not None:
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, 0.0)
    return (probs / exponential_noise(keys, logits.shape[1])).argmax(dim=-1)


@pytest.mark.parametrize("vocab", [7, 64, 300])
@pytest.mark.parametrize("with_min_p", [False, True])
def test_kernel_picks_the_torch_race_token(vocab: int, with_min_p: bool) -> None:
    torch.manual_seed(vocab)
    rows = 24
    logits = torch.randn(rows, vocab, device=DEVICE) * 2
    temps = torch.rand(rows, device=DEVICE) * 1.5 + 0.2
    keys = torch.tensor([_position_seed(5, i) for i in range(rows)], dtype=torch.int64, device=DEVICE)
    min_p = torch.rand(rows, device=DEVICE) * 0.3 if with_min_p else None
    got = gumbel_sample_triton(logits, temps, keys, min_p)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, torch_race(logits, temps, keys, min_p))


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
    temps, keys = torch.ones(5, device=DEVICE), torch.arange(5, dtype=torch.int64, device=DEVICE) + 99
    assert torch.equal(gumbel_sample_triton(logits, temps, keys, None), torch_race(logits, temps, keys, None))
    empty = gumbel_sample_triton(torch.empty(0, 10, device=DEVICE), temps[:0], keys[:0], None)
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
