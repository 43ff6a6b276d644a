"""The sampler chooses each row's path from that row's parameters, never from its batch-mates'.

With the Triton kernel (``kernels/triton_sampling.py``) every non-greedy row takes it, top-k and top-p
included; without it, rows with top-k or top-p take the torch race with a sort and the others the torch
race without one. The kernel and the torch race agree only up to float rounding, so the tests build
near-ties on which they disagree, and check that a seeded row draws the kernel's token whatever else is
in its batch. Without a GPU the kernel runs in the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported) on CPU tensors, through the sampler's
``kernel_on_cpu`` option.
"""

from __future__ import annotations

import pytest
import torch

import kernels.sampling as race_module
from engine.sampler import Sampler, _position_seed
from engine.sampling_params import SamplingParams
from kernels.sampling import exponential_noise
from tests.kernel_testing import DEVICE

VOCAB = 96  # two of the interpreter's 64-wide chunks
SEED = 42
TEMPERATURE = 0.7


def kernel_sampler() -> Sampler:
    return Sampler(3, "triton", kernel_on_cpu=DEVICE.type == "cpu")


def near_ties(positions: int) -> torch.Tensor:
    """[positions, VOCAB] logits whose race scores ``l / T - log E`` are all equal, for the row of SEED at
    each position: every token ties, so rounding alone picks the winner, and the paths often differ."""
    keys = torch.tensor([_position_seed(SEED, p) for p in range(positions)], dtype=torch.int64)
    return (TEMPERATURE * exponential_noise(keys, VOCAB).log()).to(DEVICE)


def disagreeing_row() -> tuple[torch.Tensor, int, int]:
    """A near-tie row (its logits [VOCAB] and position) on which the kernel's token differs from the torch
    race's, and the kernel's token."""
    n = 32
    logits = near_ties(n)
    params = [SamplingParams(temperature=TEMPERATURE, seed=SEED)] * n
    by_kernel = kernel_sampler().sample(logits, params, list(range(n))).tolist()
    by_torch = Sampler(3, "torch").sample(logits, params, list(range(n))).tolist()
    pos = next(p for p in range(n) if by_kernel[p] != by_torch[p])
    return logits[pos], pos, by_kernel[pos]


def test_kernel_option_needs_the_triton_backend() -> None:
    with pytest.raises(ValueError, match="kernel_backend='triton'"):
        Sampler(0, "torch", kernel_on_cpu=True)
    assert kernel_sampler().uses_kernel(DEVICE)
    assert not Sampler(0, "torch").uses_kernel(DEVICE)
    assert not Sampler(0, "triton").uses_kernel(torch.device("cpu"))  # compiled kernels take GPU tensors


def test_seeded_row_draws_the_kernels_token_beside_top_k_and_top_p_rows() -> None:
    """A batch-wide path choice sent this row through the torch race as soon as one row used top-k or
    top-p, which picks another token on this near-tie."""
    row, pos, kernel_token = disagreeing_row()
    seeded = SamplingParams(temperature=TEMPERATURE, seed=SEED)
    sampler = kernel_sampler()
    alone = sampler.sample(row.unsqueeze(0), [seeded], [pos]).tolist()
    torch.manual_seed(0)
    others = torch.randn(4, VOCAB, device=DEVICE) * 3
    logits = torch.stack([others[0], row, others[1], others[2], others[3]])
    params = [
        SamplingParams(temperature=1.0, top_k=3, seed=1),
        seeded,
        SamplingParams(temperature=0.9, top_p=0.5, seed=2),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2, min_p=0.1),  # unseeded, and min-p: the kernel's other variant
    ]
    mixed = sampler.sample(logits, params, [0, pos, 7, 9, 11]).tolist()
    assert alone == [kernel_token]
    assert mixed[1] == kernel_token
    assert mixed[0] in others[0].topk(3).indices.tolist()
    assert mixed[3] == int(others[2].argmax())


def test_each_path_runs_on_its_own_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel runs once on the whole batch for every sampling row, top-k/top-p rows included, with the
    filters only when a row has them; without the kernel the torch race runs on the top-k/top-p rows only
    (its noise has their rows, not the batch's); greedy rows take neither."""
    sampler = kernel_sampler()
    kernel = sampler._gumbel_sample
    kernel_rows: list[tuple[int, bool]] = []  # (rows, filters)
    noise_rows: list[int] = []
    smallest: list[int | None] = []  # the host's hint: the smallest top-k of the rows

    def counted_kernel(logits: torch.Tensor, *args: torch.Tensor | None, **hint: int | None) -> torch.Tensor:
        kernel_rows.append((logits.shape[0], args[-1] is not None))
        smallest.append(hint["smallest_top_k"])
        return kernel(logits, *args, **hint)

    def counted_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
        noise_rows.append(keys.shape[0])
        return exponential_noise(keys, vocab)

    sampler._gumbel_sample = counted_kernel
    monkeypatch.setattr(race_module, "exponential_noise", counted_noise)
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB, device=DEVICE)
    plain = SamplingParams(temperature=0.8, seed=5)
    top_p = SamplingParams(temperature=0.8, top_p=0.8, seed=6)
    greedy = SamplingParams(temperature=0.0)
    sampler.sample(logits, [plain, top_p, greedy, plain, top_p, top_p], list(range(6)))
    assert (kernel_rows, noise_rows) == ([(6, True)], [])
    top_ks = [SamplingParams(temperature=0.8, top_k=k, seed=k) for k in (300, 40, 90)]
    sampler.sample(logits[:4], [*top_ks, top_p], list(range(4)))
    assert smallest == [None, 40]  # top-p alone: no hint; then the smallest top-k of the rows
    for batch, want in (
        ([top_p, greedy], ([(2, True)], [])),
        ([plain, greedy], ([(2, False)], [])),
        ([greedy, greedy], ([], [])),
    ):
        kernel_rows.clear(), noise_rows.clear()
        sampler.sample(logits[: len(batch)], batch, list(range(len(batch))))
        assert (kernel_rows, noise_rows) == want
    # Without a kernel the plain rows take the torch race apart from the sorting rows.
    noise_rows.clear()
    Sampler(3, "torch").sample(logits, [plain, top_p, greedy, plain, top_p, top_p], list(range(6)))
    assert noise_rows == [2, 3]


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_every_seeded_row_draws_what_it_draws_alone(backend: str) -> None:
    """A mixed batch of seeded rows (plain, min-p, top-k, top-p, both, greedy): each row's token equals
    the token it draws in a batch of its own."""
    sampler = kernel_sampler() if backend == "triton" else Sampler(3, "torch")
    torch.manual_seed(2)
    logits = torch.randn(7, VOCAB, device=DEVICE) * 2
    params = [
        SamplingParams(temperature=0.8, seed=10),
        SamplingParams(temperature=1.1, min_p=0.05, seed=11),
        SamplingParams(temperature=0.9, top_k=5, seed=12),
        SamplingParams(temperature=1.0, top_p=0.7, seed=13),
        SamplingParams(temperature=1.3, top_k=20, top_p=0.9, min_p=0.02, seed=14),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.5, seed=16),
    ]
    positions = [3, 1, 4, 1, 5, 9, 2]
    together = sampler.sample(logits, params, positions).tolist()
    alone = [
        sampler.sample(logits[i : i + 1], [p], [pos]).item()
        for i, (p, pos) in enumerate(zip(params, positions, strict=True))
    ]
    assert together == alone
    # Without a greedy row every token comes from the races (no argmax to start from).
    sampling_rows = [i for i, p in enumerate(params) if not p.greedy]
    no_greedy = sampler.sample(
        logits[sampling_rows], [params[i] for i in sampling_rows], [positions[i] for i in sampling_rows]
    )
    assert no_greedy.tolist() == [alone[i] for i in sampling_rows]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_mixed_batch_samples_without_a_host_sync() -> None:
    """At a 128k vocabulary, a batch mixing every path (kernel rows with min-p, sorting rows, greedy and
    unseeded rows) launches its work without the host waiting for the device."""
    sampler = Sampler(3, "triton")
    assert sampler.uses_kernel(torch.device("cuda"))
    torch.manual_seed(4)
    logits = torch.randn(8, 128_256, device="cuda") * 3
    params = [
        SamplingParams(temperature=0.8, seed=1),
        SamplingParams(temperature=1.1, min_p=0.05, seed=2),
        SamplingParams(temperature=0.9, top_k=50, seed=3),
        SamplingParams(temperature=1.0, top_p=0.9, seed=4),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.2),
        SamplingParams(temperature=0.7, top_k=40, top_p=0.95, min_p=0.01),
        SamplingParams(temperature=1.0, seed=8),
    ]
    positions = list(range(8))
    first = sampler.sample(logits, params, positions)  # compiles the kernel
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = sampler.sample(logits, params, positions)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    seeded = [0, 1, 2, 3, 4, 7]
    assert again.is_cuda and again[seeded].tolist() == first[seeded].tolist()
