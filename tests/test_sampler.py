"""The sampler's exponential-race noise: distribution, determinism, batch independence, device agreement."""

from __future__ import annotations

import math

import pytest
import torch

from engine.sampler import Sampler, _position_seed
from engine.sampling_params import SamplingParams
from kernels.sampling import exponential_noise


def test_noise_is_exponential_and_keyed() -> None:
    keys = torch.tensor([_position_seed(7, pos) for pos in range(64)], dtype=torch.int64)
    noise = exponential_noise(keys, 4096)
    assert noise.shape == (64, 4096) and noise.dtype == torch.float32
    assert bool((noise > 0).all()) and bool(torch.isfinite(noise).all())
    flat = noise.double().flatten()
    assert abs(flat.mean().item() - 1.0) < 0.01 and abs(flat.var().item() - 1.0) < 0.03
    # P(E > 1) = 1/e; rows and columns are not correlated with their neighbours.
    assert abs((flat > 1).double().mean().item() - math.exp(-1)) < 0.005
    assert abs(torch.corrcoef(torch.stack([noise[:, :-1].flatten(), noise[:, 1:].flatten()]))[0, 1]) < 0.01
    assert abs(torch.corrcoef(torch.stack([noise[:-1].flatten(), noise[1:].flatten()]))[0, 1]) < 0.01
    assert torch.equal(exponential_noise(keys, 4096), noise)  # a key always gives the same row
    assert torch.equal(exponential_noise(keys[5:6], 100), noise[5:6, :100])  # whatever the batch or vocab


def test_sampled_frequencies_follow_the_distribution() -> None:
    """20,000 seeded draws (one position each) of a 6-token distribution land within 1.5 points."""
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    probs = torch.softmax(logits, dim=-1)[0]
    sampler = Sampler()
    n, counts = 20_000, torch.zeros(6)
    params = [SamplingParams(temperature=1.0, seed=11)] * 500
    for start in range(0, n, 500):
        tokens, _ = sampler(logits.expand(500, 6).contiguous(), params, list(range(start, start + 500)))
        counts += torch.bincount(torch.tensor(tokens), minlength=6)
    assert torch.allclose(counts / n, probs, atol=0.015), (counts / n, probs)


def test_seeded_row_ignores_the_rest_of_the_batch() -> None:
    torch.manual_seed(0)
    logits = torch.randn(5, 1000)
    sampler = Sampler(seed=3)
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=42)
    others = [
        SamplingParams(temperature=1.3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.5),
    ]
    alone, _ = sampler(logits[2:3], [seeded], [17])
    together, _ = sampler(logits[[0, 1, 2, 4]], [others[0], others[1], seeded, others[2]], [0, 5, 17, 9])
    assert together[2] == alone[0]
    assert together[1] == int(logits[1].argmax())  # greedy rows stay greedy


def test_backend_names_are_the_op_tables() -> None:
    """The sampler's plain-row race is the op table's ``gumbel_sample``, and it rejects what get_ops
    rejects, with the same message."""
    from kernels.ops import TORCH_OPS, get_ops

    assert Sampler(0, "torch")._gumbel_sample is TORCH_OPS.gumbel_sample
    assert Sampler(0, "triton")._gumbel_sample is get_ops("triton").gumbel_sample
    with pytest.raises(ValueError, match="unknown kernel_backend 'cuda'") as from_sampler:
        Sampler(0, "cuda")
    with pytest.raises(ValueError) as from_ops:
        get_ops("cuda")
    assert str(from_sampler.value) == str(from_ops.value)


def test_torch_race_of_plain_rows_is_the_filtered_race() -> None:
    """Rows without top-k or top-p take the op table's race (``gumbel_sample_torch``); the same rows with
    a top-k that drops nothing take the sorting race. Both draw the same tokens, min-p included, and a
    plain row draws the same beside a filtering row as alone: a row's path cannot change its token."""
    torch.manual_seed(5)
    vocab = 300
    logits = torch.randn(7, vocab) * 3
    params = [SamplingParams(temperature=0.7, seed=s, min_p=0.05 * (s % 2)) for s in range(6)]
    positions = list(range(6))
    alone = Sampler(0).sample(logits[:6], params, positions)
    unfiltered = [SamplingParams(temperature=0.7, seed=p.seed, min_p=p.min_p, top_k=vocab) for p in params]
    assert torch.equal(Sampler(0).sample(logits[:6], unfiltered, positions), alone)
    with_top_k = Sampler(0).sample(
        logits, [*params, SamplingParams(temperature=0.7, top_k=5, seed=9)], [*positions, 0]
    )
    assert torch.equal(with_top_k[:6], alone)


def test_only_unseeded_rows_draw_from_the_generator() -> None:
    """Seeded and greedy rows leave the sampler's generator alone, so sampling with a seed (as the
    engine's warm-up does) does not change what later unseeded requests draw."""
    torch.manual_seed(5)
    logits = torch.randn(3, 200)
    unseeded = [SamplingParams(temperature=1.0)] * 3
    fresh = Sampler(seed=9)
    used = Sampler(seed=9)
    state = used._unseeded.get_state()
    used.sample(logits, [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0.0)], [0, 0])
    used.sample(logits[:1], [SamplingParams(temperature=0.9, top_k=4, seed=2)], [3])
    assert torch.equal(used._unseeded.get_state(), state)
    assert torch.equal(used.sample(logits, unseeded, [0, 1, 2]), fresh.sample(logits, unseeded, [0, 1, 2]))
    # Unseeded rows among seeded ones take the generator's next keys in row order.
    mixed = [SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=1.0)]
    assert used.sample(logits[:2], mixed, [0, 0])[1] == fresh.sample(logits[1:2], mixed[1:], [0])[0]


def test_logprobs_are_of_the_sampled_token_with_each_rows_top_n() -> None:
    torch.manual_seed(1)
    logits = torch.randn(5, 300)
    params = [
        SamplingParams(temperature=1.0, seed=5, logprobs=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=6, logprobs=0),
        SamplingParams(temperature=0.0, logprobs=5),
        SamplingParams(temperature=1.2, seed=7, logprobs=1),
    ]
    tokens, logprobs = Sampler()(logits, params, [0, 1, 2, 3, 4])
    lp = torch.log_softmax(logits, dim=-1)
    assert logprobs[1] is None
    for i in (0, 2, 3, 4):
        got, n = logprobs[i], params[i].logprobs
        assert got is not None and got.token_id == tokens[i]
        assert got.logprob == lp[i, tokens[i]].item()
        assert got.rank == int((lp[i] > lp[i, tokens[i]]).sum()) + 1
        top_v, top_i = lp[i].topk(n) if n else (torch.empty(0), torch.empty(0, dtype=torch.int64))
        assert got.top == list(zip(top_i.tolist(), top_v.tolist(), strict=True))
    assert logprobs[3].top[0][0] == tokens[3]  # a greedy row's token is its best


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_noise_equals_cpu_noise() -> None:
    """The integer hash is exact everywhere; -log of the same float32 agrees to an ulp or two."""
    keys = torch.tensor([_position_seed(s, p) for s in (1, 2) for p in range(8)], dtype=torch.int64)
    cpu = exponential_noise(keys, 151_936)
    gpu = exponential_noise(keys.cuda(), 151_936).cpu()
    assert torch.allclose(cpu, gpu, rtol=1e-6, atol=0)


def _filtered_row(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """One row, filtered the textbook way: top-k on the logits, then top-p and min-p on the probabilities."""
    if p.top_k > 0:
        kth = logits.sort(descending=True).values[min(p.top_k, logits.numel()) - 1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs
        probs = probs.clone()
        probs[order[before >= p.top_p]] = 0.0
    if p.min_p > 0:
        probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
    return probs


def test_mixed_top_k_top_p_min_p_batch_filters_each_row_like_the_textbook() -> None:
    """Rows with top-k, top-p, both, min-p and none in one batch (one shared sort) keep exactly the
    tokens each row's own filter keeps, with the same probabilities."""
    from engine.sampler import _row_values
    from kernels.sampling import min_p_filter, top_k_top_p_probs

    torch.manual_seed(3)
    params = [
        SamplingParams(temperature=1.0, top_k=5),
        SamplingParams(temperature=1.0, top_p=0.7),
        SamplingParams(temperature=1.0, top_k=40, top_p=0.5),
        SamplingParams(temperature=1.0, min_p=0.05),
        SamplingParams(temperature=1.0, top_k=3, top_p=0.95, min_p=0.2),
        SamplingParams(temperature=1.0),
    ]
    logits = torch.randn(len(params), 512) * 3
    rows = _row_values(params, logits.shape[1])
    got = min_p_filter(top_k_top_p_probs(logits, rows[:, 3], rows[:, 2]), rows[:, 1])  # as the race filters
    for i, p in enumerate(params):
        want = _filtered_row(logits[i], p)
        assert torch.equal(got[i] > 0, want > 0), i
        assert torch.allclose(got[i], want, atol=1e-6), i
    kept = (got > 0).sum(dim=1).tolist()
    assert kept[0] == 5 and kept[4] <= 3 and kept[5] == 512 and 1 <= kept[1] < 512


def test_top_k_row_beside_a_top_p_row_keeps_its_whole_top_k() -> None:
    """The shared sort runs top-p over every row; a row with top-p off must lose nothing to it, though in
    float32 its running mass reaches 1 long before a 128k vocabulary's tail."""
    from engine.sampler import _row_values
    from kernels.sampling import top_k_top_p_probs

    torch.manual_seed(4)
    k = 128_000
    params = [SamplingParams(temperature=1.0, top_k=k), SamplingParams(temperature=1.0, top_p=0.9)]
    logits = torch.randn(2, 128_256) * 3
    kept = torch.softmax(logits[0].sort(descending=True).values[:k], dim=0)
    assert float((kept.cumsum(0) - kept)[-1]) >= 1.0  # the rounding this test is about
    rows = _row_values(params, logits.shape[1])
    got = top_k_top_p_probs(logits, rows[:, 3], rows[:, 2])
    assert int((got[0] > 0).sum()) == k
    assert torch.equal(got[0] > 0, _filtered_row(logits[0], params[0]) > 0)
