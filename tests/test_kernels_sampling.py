"""The Triton sampler (``kernels/triton_sampling.py``: temperature, min-p, and top-k/top-p without a sort)
against the torch race.

Without a GPU the kernel runs in the Triton interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py) on small vocabularies spread over several chunks; the ``gpu`` tests use a 128k vocabulary.
The reference is ``Sampler`` with the torch backend (the production path on the CPU) given seeded
parameters, or the op table's torch race (``kernels.sampling.gumbel_sample_torch``, which sorts for top-k
and top-p): the per-row keys are ``_position_seed(seed, position)``, which the kernel is handed too, so on
fresh random logits both pick the same tokens.
"""

from __future__ import annotations

import pytest
import torch

from engine.sampler import Sampler, _position_seed
from engine.sampling_params import SamplingParams
from kernels import triton_sampling
from kernels.sampling import gumbel_sample_torch, top_k_top_p_probs
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


def filter_values(rows: int, vocab: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row top-k (a third off, i.e. the vocabulary size; the rest 1 .. vocab) and top-p (a third off,
    i.e. 1; the rest in (0.02, 1))."""
    top_k = torch.randint(1, vocab + 1, (rows,), generator=gen)
    top_k[torch.rand(rows, generator=gen) < 1 / 3] = vocab
    top_k[: rows // 8] = torch.randint(1, 4, (rows // 8,), generator=gen)  # tiny k: one or two radix bins
    top_p = torch.rand(rows, generator=gen) * 0.98 + 0.02
    top_p[torch.rand(rows, generator=gen) < 1 / 3] = 1.0
    return top_k.to(DEVICE), top_p.to(DEVICE)


@pytest.mark.parametrize("vocab", [7, 64, 300])
@pytest.mark.parametrize("with_min_p", [False, True])
def test_top_k_top_p_kernel_picks_the_sorting_races_token(vocab: int, with_min_p: bool) -> None:
    """Rows with top-k, top-p, both or neither (and min-p): the kernel's radix select and rejection race
    draw the token the sort-based torch race draws, and that token is one the filters keep."""
    gen = torch.Generator().manual_seed(vocab + with_min_p)
    rows = 48
    logits = (torch.randn(rows, vocab, generator=gen) * 2.5).to(DEVICE)
    logits[::5] -= 40.0  # rows of negative logits only: the ordered keys' other half
    temps = (torch.rand(rows, generator=gen) * 1.5 + 0.3).to(DEVICE)
    min_p = (torch.rand(rows, generator=gen) * 0.3).to(DEVICE) if with_min_p else None
    top_k, top_p = filter_values(rows, vocab, gen)
    keys = row_keys(17, rows)
    got = gumbel_sample_triton(logits, temps, keys, min_p, top_k, top_p)
    want = gumbel_sample_torch(logits, temps, keys, min_p, top_k, top_p)
    assert torch.equal(got, want)
    kept = top_k_top_p_probs(logits / temps.unsqueeze(1), top_k, top_p)
    assert bool((kept.gather(1, got.unsqueeze(1)) > 0).all())
    assert not torch.equal(got, logits.argmax(-1)), "these rows should sample away from argmax"


def test_small_top_p_on_flat_rows_rejects_the_first_winners() -> None:
    """Nearly flat rows with top-p 0.05 keep a few percent of the vocabulary, so the race's winner over
    the whole row is almost never kept: the kernel must reject and race again above it, pass after pass."""
    gen = torch.Generator().manual_seed(8)
    rows, vocab = 32, 300
    logits = (torch.randn(rows, vocab, generator=gen) * 0.1).to(DEVICE)
    temps = torch.ones(rows, device=DEVICE)
    top_k = torch.full((rows,), vocab, device=DEVICE)
    top_p = torch.full((rows,), 0.05, device=DEVICE)
    keys = row_keys(3, rows)
    unfiltered = gumbel_sample_torch(logits, temps, keys, None)
    got = gumbel_sample_triton(logits, temps, keys, None, top_k, top_p)
    kept = top_k_top_p_probs(logits, top_k, top_p) > 0
    assert int(kept.gather(1, unfiltered.unsqueeze(1)).sum()) <= 4  # the first winners, mostly dropped
    assert torch.equal(got, gumbel_sample_torch(logits, temps, keys, None, top_k, top_p))
    assert bool(kept.gather(1, got.unsqueeze(1)).all())


def test_top_k_keeps_ties_and_top_k_one_is_greedy() -> None:
    """Integer logits tie often: top-k keeps every token tied with the k-th largest (as the torch race
    does), and top-k 1 (or a vanishing top-p) leaves only the argmax; -inf logits (masked tokens) never win."""
    gen = torch.Generator().manual_seed(9)
    rows, vocab = 24, 200
    logits = torch.randint(-3, 4, (rows, vocab), generator=gen).float().to(DEVICE)
    logits[:, 150:] = float("-inf")
    temps = torch.full((rows,), 2.0, device=DEVICE)
    keys = row_keys(4, rows)
    top_k = torch.randint(1, 40, (rows,), generator=gen).to(DEVICE)
    got = gumbel_sample_triton(logits, temps, keys, None, top_k, None)
    assert torch.equal(got, gumbel_sample_torch(logits, temps, keys, None, top_k, None))
    kth = logits.sort(dim=1, descending=True).values.gather(1, top_k.long().unsqueeze(1) - 1)
    assert bool((logits.gather(1, got.unsqueeze(1)) >= kth).all())
    ones = torch.ones(rows, device=DEVICE)
    greedy = gumbel_sample_triton(
        logits + torch.arange(vocab, device=DEVICE) * 1e-4, ones, keys, None, ones, None
    )
    assert torch.equal(greedy, (logits + torch.arange(vocab, device=DEVICE) * 1e-4).argmax(-1))
    tiny_p = gumbel_sample_triton(logits, ones, keys, None, None, ones * 1e-6)
    assert bool((logits.gather(1, tiny_p.unsqueeze(1)).squeeze(1) == logits.max(dim=1).values).all())


def ones_k(rows: int, k: int) -> torch.Tensor:
    return torch.full((rows,), k, device=DEVICE)


def test_small_top_k_draws_from_each_chunks_top_k() -> None:
    """Rows with top-k of at most the candidate slots (16 in the interpreter) draw from each chunk's own
    top k instead of passes over the row: the same tokens as the passes and the sort-based race, with
    top-p and min-p on top. Where ties at a chunk's k-th logit overflow its slots (the integer rows: a
    chunk of 64 holds ~9 of each value), the row must fall back to the passes: a draw from the truncated
    candidates would miss tokens of the top-k set."""
    gen = torch.Generator().manual_seed(21)
    rows, vocab = 24, 300  # five chunks of 64
    logits = (torch.randn(rows, vocab, generator=gen) * 2.0).to(DEVICE)
    logits[1::4] *= 0.05  # nearly flat: top-p rejects within the top k
    logits[2::4] = torch.randint(-3, 4, (rows // 4, vocab), generator=gen).float().to(DEVICE)
    logits[3::8, 200:] = float("-inf")  # masked tokens: the last chunks hold fewer than k finite logits
    temps = (torch.rand(rows, generator=gen) * 1.5 + 0.3).to(DEVICE)
    top_k = torch.randint(1, 17, (rows,), generator=gen).to(DEVICE)
    top_p = (torch.rand(rows, generator=gen) * 0.9 + 0.1).to(DEVICE)
    top_p[::3] = 1.0
    top_p[2::4] = 1.0  # top-p over ties: the sort's order among tied tokens decides there (module docstring)
    min_p = (torch.rand(rows, generator=gen) * 0.2).to(DEVICE)
    keys = row_keys(21, rows)
    for mp in (None, min_p):
        got = gumbel_sample_triton(logits, temps, keys, mp, top_k, top_p)
        passes = gumbel_sample_triton(logits, temps, keys, mp, top_k, top_p, candidates=False)
        assert torch.equal(got, passes)
        # The sampler's hint of a smallest top-k above the slots: the variant without candidates, same draw.
        hinted = gumbel_sample_triton(logits, temps, keys, mp, top_k, top_p, smallest_top_k=17)
        assert torch.equal(got, hinted)
        assert torch.equal(got, gumbel_sample_torch(logits, temps, keys, mp, top_k, top_p))
    kth = logits.sort(dim=1, descending=True).values.gather(1, top_k.long().unsqueeze(1) - 1)
    assert bool((logits.gather(1, got.unsqueeze(1)) >= kth).all())
    # Every row tied: each chunk's k-th logit ties with all 64 of its tokens, so every chunk overflows.
    flat, ones, small_k = torch.zeros(8, vocab, device=DEVICE), torch.ones(8, device=DEVICE), ones_k(8, 5)
    tied = gumbel_sample_triton(flat, ones, keys[:8], None, small_k, None)
    assert torch.equal(tied, gumbel_sample_torch(flat, ones, keys[:8], None, small_k, None))
    assert len(set(tied.tolist())) > 4, "every tied token is in the top-k set: draws spread over the row"


def test_only_a_batch_that_may_use_them_compiles_the_chunks_top_k(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op builds the chunks' top k into a batch's kernels only where a row may draw from them: given a
    top-k tensor, and the sampler's smallest top-k (where it gives one) at most the slots (16 in the
    interpreter). The draws do not depend on the variant."""
    race = triton_sampling._race_kernel
    variants: list[bool] = []

    class Recorded:
        def __getitem__(self, grid: tuple[int, ...]):  # noqa: ANN204 (a launcher)
            def launch(*args: object, **kwargs: object) -> None:
                variants.append(bool(kwargs["CANDIDATES"]))
                race[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(triton_sampling, "_race_kernel", Recorded())
    gen = torch.Generator().manual_seed(12)
    rows, vocab = 4, 100
    logits = (torch.randn(rows, vocab, generator=gen) * 2.0).to(DEVICE)
    temps, keys = torch.ones(rows, device=DEVICE), row_keys(12, rows)
    top_k, top_p = torch.tensor([3, 16, 40, 100], device=DEVICE), torch.full((rows,), 0.9, device=DEVICE)
    draws = []
    for k, hint, want in ((top_k, None, True), (top_k, 3, True), (top_k, 16, True), (top_k, 17, False)):
        variants.clear()
        draws.append(gumbel_sample_triton(logits, temps, keys, None, k, top_p, smallest_top_k=hint))
        assert variants == [want], (hint, variants)
    assert all(torch.equal(d, draws[0]) for d in draws)
    variants.clear()
    gumbel_sample_triton(logits, temps, keys, None, None, top_p)  # top-p alone
    assert variants == [False]


def test_top_p_at_the_edge_of_float_rounding_is_decided_on_exact_sums() -> None:
    """Two tokens of note, logits 1 and 0 (the rest below -30), top-k 2, and top-p set to the larger one's
    share: when the race picks the smaller token, the mass above it (1) against top-p of the top-k mass
    (1 + e**-1) is a tie up to float rounding.
    The passes see it within their float sums' margin and take the test again on fixed-point sums, which
    the candidates use throughout: both ways of drawing the row agree, whichever wins the rounding."""
    rows, vocab = 32, 130
    logits = -30.0 - torch.arange(vocab, device=DEVICE).repeat(rows, 1) * 0.01  # distinct: no tied chunk
    logits[:, 70], logits[:, 71] = 1.0, 0.0  # in the second chunk of 64
    ones = torch.ones(rows, device=DEVICE)
    share = 1.0 / (1.0 + torch.exp(torch.tensor(-1.0))).item()
    keys = row_keys(5, rows)
    unfiltered = gumbel_sample_triton(logits, ones, keys, None)
    assert 3 <= int((unfiltered == 71).sum()) <= 29, "the race should pick the smaller token in some rows"
    for top_p in (share, share * (1 + 2**-20), share * (1 - 2**-20)):
        p = torch.full((rows,), top_p, device=DEVICE)
        candidates = gumbel_sample_triton(logits, ones, keys, None, ones_k(rows, 2), p)
        passes = gumbel_sample_triton(logits, ones, keys, None, ones_k(rows, 2), p, candidates=False)
        assert torch.equal(candidates, passes), top_p
        assert bool(((candidates == 70) | (candidates == 71)).all())
        assert bool((candidates[unfiltered == 70] == 70).all())  # nothing above the larger token


def draw_with_parts(
    chunks: list[int | None], vocab: int, rows: int, seed: int, first: int | None = None
) -> list[torch.Tensor]:
    """The tokens drawn for one set of rows (every kind: plain, min-p, top-k, top-p, both) with the hashing
    pass split at each of ``chunks`` tokens per part (None: ``race_parts``'s choice); [4, rows] each.
    ``first``: only the first rows of the set are sampled, as a batch of their own."""
    gen = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=gen) * 2.5).to(DEVICE)
    logits[1::7] *= 0.05  # nearly flat rows: top-p rejects pass after pass
    temps = (torch.rand(rows, generator=gen) * 1.5 + 0.3).to(DEVICE)
    min_p = (torch.rand(rows, generator=gen) * 0.2).to(DEVICE)
    top_k, top_p = filter_values(rows, vocab, gen)
    keys = row_keys(seed, rows)
    if first is not None:
        logits, temps, min_p, top_k, top_p, keys = (
            x[:first] for x in (logits, temps, min_p, top_k, top_p, keys)
        )
    draws = []
    for chunk in chunks:
        plain = gumbel_sample_triton(logits, temps, keys, None, chunk=chunk)
        with_min_p = gumbel_sample_triton(logits, temps, keys, min_p, chunk=chunk)
        filtered = gumbel_sample_triton(logits, temps, keys, None, top_k, top_p, chunk=chunk)
        both = gumbel_sample_triton(logits, temps, keys, min_p, top_k, top_p, chunk=chunk)
        draws.append(torch.stack([plain, with_min_p, filtered, both]))
    return draws


@pytest.mark.parametrize("vocab", [100, 300])
def test_tokens_do_not_depend_on_how_the_hashing_pass_is_split(vocab: int) -> None:
    """The first pass runs in parts (``_race_kernel``) and the row's program combines them: a maximum, an
    argmax with the first token winning a tie, integer digit counts, scores kept per token. So one part or
    eight draw the same tokens, for every kind of row, and so does a row in a batch of any size."""
    chunks = [64 * n for n in (1, 3, -(-vocab // 64))]  # one chunk a part (5 or 2 parts) down to one part
    draws = draw_with_parts([*chunks, None], vocab, 16, vocab)
    for chunk, drawn in zip(chunks[1:] + [None], draws[1:], strict=True):
        assert torch.equal(drawn, draws[0]), f"tokens differ with {chunk} tokens per part"
    alone = draw_with_parts([None], vocab, 16, vocab, first=1)[0]  # race_parts splits a batch of one the most
    assert torch.equal(alone[:, 0], draws[0][:, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_sampler_uses_the_kernel_and_matches_the_torch_path() -> None:
    """A 128k vocabulary at batch 64, rows of every kind (plain, min-p, top-k, top-p, both, greedy): the
    Triton sampler takes the kernel once, and it and the torch sampler (which sorts) agree on (nearly) every
    row (float rounding may flip a near-tie), and the kernel runs without a host synchronisation."""
    torch.manual_seed(3)
    logits = torch.randn(64, 128_256, device="cuda") * 3
    params = [SamplingParams(temperature=0.8, seed=i) for i in range(16)]
    params += [SamplingParams(temperature=1.1, min_p=0.05) for _ in range(16)]
    params += [SamplingParams(temperature=0.9, top_k=50, seed=i) for i in range(8)]
    params += [SamplingParams(temperature=1.0, top_p=0.9, seed=i) for i in range(8)]
    params += [SamplingParams(temperature=1.2, top_k=1000, top_p=0.95, min_p=0.01) for _ in range(15)]
    params += [SamplingParams(temperature=0)]
    positions = list(range(64))
    fused, reference = Sampler(7, "triton"), Sampler(7, "torch")
    kernel_calls: list[int] = []
    kernel = fused._gumbel_sample
    assert kernel is gumbel_sample_triton
    fused._gumbel_sample = lambda *args, **hint: kernel_calls.append(1) or kernel(*args, **hint)
    a, _ = fused(logits, params, positions)
    assert kernel_calls == [1], "the Triton sampler did not take the kernel once"
    b, _ = reference(logits, params, positions)
    assert sum(x != y for x, y in zip(a, b, strict=True)) <= 2, (a, b)
    assert a[-1] == int(logits[-1].argmax())
    top_50 = logits[32:40].topk(50, dim=1).indices
    assert all(a[32 + i] in top_50[i].tolist() for i in range(8))
    temps, keys = torch.full((64,), 0.8, device="cuda"), torch.arange(64, dtype=torch.int64, device="cuda")
    top_k, top_p = torch.full_like(temps, 50), torch.full_like(temps, 0.9)
    gumbel_sample_triton(logits, temps, keys, None)
    gumbel_sample_triton(logits, temps, keys, None, top_k, top_p)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        gumbel_sample_triton(logits, temps, keys, None)
        gumbel_sample_triton(logits, temps, keys, None, top_k, top_p)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_gpu_tokens_do_not_depend_on_how_the_hashing_pass_is_split(rows: int) -> None:
    """A 151,936-token vocabulary (Qwen3's): the batch's own split (~2 programs per SM), one part per row
    and 9 chunks per part draw the same tokens for every kind of row, and the first row alone (split the
    most) draws what it draws in the batch."""
    vocab = 151_936
    block = triton_sampling.RACE_BLOCK_V
    draws = draw_with_parts([None, block * -(-vocab // block), block * 9], vocab, rows, 300 + rows)
    assert torch.equal(draws[1], draws[0]) and torch.equal(draws[2], draws[0])
    alone = draw_with_parts([None], vocab, rows, 300 + rows, first=1)[0]
    assert torch.equal(alone[:, 0], draws[0][:, 0])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("rows", [1, 7, 64])
def test_gpu_small_top_k_candidates_match_the_passes(rows: int) -> None:
    """On Qwen3's 151,936-token vocabulary (38 chunks): rows with top-k 1-64 drawn from the chunks' top k
    equal the passes over the row, with top-p and min-p, and bf16-rounded logits (ties) included."""
    gen = torch.Generator().manual_seed(rows)
    vocab = 151936
    logits = (torch.randn(rows, vocab, generator=gen) * 3.0).to(DEVICE)
    logits[1::3] = logits[1::3].bfloat16().float() * 0.1  # flat rows of bf16 values: many ties
    temps = (torch.rand(rows, generator=gen) * 1.5 + 0.3).to(DEVICE)
    top_k = torch.randint(1, 65, (rows,), generator=gen).to(DEVICE)
    top_p = (torch.rand(rows, generator=gen) * 0.9 + 0.1).to(DEVICE)
    top_p[::2] = 1.0
    min_p = (torch.rand(rows, generator=gen) * 0.2).to(DEVICE)
    keys = row_keys(rows, rows)
    for mp in (None, min_p):
        got = gumbel_sample_triton(logits, temps, keys, mp, top_k, top_p)
        assert torch.equal(got, gumbel_sample_triton(logits, temps, keys, mp, top_k, top_p, candidates=False))
    kth = logits.sort(dim=1, descending=True).values.gather(1, top_k.long().unsqueeze(1) - 1)
    assert bool((logits.gather(1, got.unsqueeze(1)) >= kth).all())
