"""Logit bias and repetition, frequency and presence penalties (engine/logits_processors.py) against
transformers.

The logit bias is transformers' ``sequence_bias`` on one-token sequences; the repetition penalty is its
``repetition_penalty``; frequency and presence penalties (the OpenAI API's, which transformers lacks) are
given to transformers' ``generate`` as a logits processor written here from the OpenAI definition, run
after its repetition penalty as vLLM orders them. Greedy tokens must equal transformers' token for token,
batched and alone.
"""

from __future__ import annotations

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.logits_processors import apply_logit_bias, apply_penalties, process_logits
from tests.checkpoints import VOCAB, hf_greedy, make_checkpoint
from tests.kernel_testing import needs_gpu

NEW_TOKENS = 40


class _OpenAIPenalties:
    """``logits -= frequency * count + presence * (count > 0)`` over the tokens generated so far."""

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self.prompt_len, self.frequency, self.presence = prompt_len, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = scores.clone()
        for row in range(scores.shape[0]):
            tokens, counts = torch.unique(input_ids[row, self.prompt_len :], return_counts=True)
            for token, count in zip(tokens.tolist(), counts.tolist(), strict=True):
                out[row, token] -= self.frequency * count + self.presence
        return out


def _prompts() -> list[list[int]]:
    rng = random.Random(11)
    # Prompts that repeat themselves, so the repetition penalty has prompt tokens to act on.
    return [[rng.randrange(3, 40) for _ in range(n)] * 2 for n in (3, 9, 20)]


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def checkpoint(request, tmp_path_factory):
    return make_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=5)


@pytest.mark.parametrize(
    ("repetition", "frequency", "presence"),
    [(1.8, 0.0, 0.0), (1.0, 0.9, 0.0), (1.0, 0.0, 1.5), (1.3, 0.4, -0.6)],
    ids=["repetition", "frequency", "presence", "all-three"],
)
def test_greedy_with_penalties_matches_transformers(checkpoint, repetition, frequency, presence) -> None:
    import transformers

    prompts = _prompts()
    expected = []
    for p in prompts:
        processors = transformers.LogitsProcessorList([_OpenAIPenalties(len(p), frequency, presence)])
        expected.append(
            hf_greedy(
                checkpoint, p, NEW_TOKENS, {"repetition_penalty": repetition, "logits_processor": processors}
            )
        )
    plain = [hf_greedy(checkpoint, p, NEW_TOKENS) for p in prompts]
    assert expected != plain  # the penalties change these outputs: the comparison below tests them
    llm = LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=128)
    params = SamplingParams(
        max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, repetition_penalty=repetition,
        frequency_penalty=frequency, presence_penalty=presence,
    )  # fmt: skip
    assert [o.token_ids for o in llm.generate(prompts, params)] == expected
    # In a batch with unpenalised rows (which must keep their own tokens) and alone.
    plain_params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    mixed = llm.generate(prompts + prompts, [params] * 3 + [plain_params] * 3)
    assert [o.token_ids for o in mixed] == expected + plain
    assert llm.generate([prompts[1]], params)[0].token_ids == expected[1]


def test_penalties_touch_only_penalised_rows_and_seen_tokens() -> None:
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 4
    params = [
        SamplingParams(),
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        SamplingParams(presence_penalty=-1.0),
    ]
    histories = [([1, 2], [3]), ([5, 6], [7, 7, 8, 5]), ([], [9, 9])]
    out = apply_penalties(logits, params, histories)
    assert torch.equal(out[0], logits[0])  # no penalty: the row's bits unchanged
    row, ref = out[1], logits[1].clone()
    for t in (5, 6, 7, 8):  # seen in the prompt or the output: repetition
        ref[t] = ref[t] / 2.0 if ref[t] > 0 else ref[t] * 2.0
    ref[7] -= 0.5 * 2 + 0.25
    ref[8] -= 0.5 + 0.25
    ref[5] -= 0.5 + 0.25  # in the prompt and once in the output
    torch.testing.assert_close(row, ref, rtol=0, atol=1e-6)
    assert torch.equal(out[2][torch.arange(VOCAB) != 9], logits[2][torch.arange(VOCAB) != 9])
    assert out[2][9] == logits[2][9] + 1.0
    assert apply_penalties(logits, [SamplingParams()] * 3, None) is logits  # nothing computed
    with pytest.raises(ValueError, match="penalties need"):
        apply_penalties(logits, params, None)


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("presence_penalty", 2.5, r"presence_penalty must be in \[-2, 2\], got 2.5"),
        ("frequency_penalty", float("nan"), r"frequency_penalty must be in \[-2, 2\]"),
        ("repetition_penalty", 0.0, "repetition_penalty must be a finite number > 0, got 0.0"),
        ("repetition_penalty", float("inf"), "repetition_penalty must be a finite number > 0"),
    ],
)
def test_penalty_values_are_checked(field: str, value: float, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**{field: value}).validate()


def test_greedy_with_logit_bias_matches_transformers(checkpoint) -> None:
    prompts = _prompts()
    plain = [hf_greedy(checkpoint, p, NEW_TOKENS) for p in prompts]
    favourite = max(set(plain[0]), key=plain[0].count)  # banned below: the plain output's commonest token
    bias = {favourite: -100.0, 17: 4.0, 23: 2.5}
    expected = [
        hf_greedy(checkpoint, p, NEW_TOKENS, {"sequence_bias": {(t,): b for t, b in bias.items()}})
        for p in prompts
    ]
    assert expected != plain and all(favourite not in e for e in expected)
    llm = LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=128)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True, logit_bias=bias)
    plain_params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    mixed = llm.generate(prompts + prompts, [params] * 3 + [plain_params] * 3)
    assert [o.token_ids for o in mixed] == expected + plain


def test_logit_bias_adds_to_its_tokens_only() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, VOCAB)
    params = [SamplingParams(logit_bias={3: 1.5, 200: -100.0}), SamplingParams()]
    out = apply_logit_bias(logits, params)
    expected = logits.clone()
    expected[0, 3] += 1.5
    expected[0, 200] -= 100.0
    assert torch.equal(out, expected) and not torch.equal(logits, expected)  # a new tensor
    assert apply_logit_bias(logits, [SamplingParams()] * 2) is logits
    with pytest.raises(InvalidRequestError, match=r"logit_bias values must be in \[-100, 100\]"):
        SamplingParams(logit_bias={3: 101.0}).validate()
    with pytest.raises(InvalidRequestError, match=r"logit_bias token ids \[400\] are outside the vocabulary"):
        SamplingParams(logit_bias={400: 1.0}).validate(VOCAB)


def test_min_tokens_and_allowed_token_ids_match_transformers(checkpoint) -> None:
    """min_tokens against transformers' MinNewTokensLengthLogitsProcessor (the stop token as its EOS), the
    stop applied to its output afterwards; allowed_token_ids against its suppress_tokens of the rest."""
    import transformers

    prompts = _prompts()
    plain = [hf_greedy(checkpoint, p, NEW_TOKENS) for p in prompts]
    llm = LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=128)
    base = {"max_tokens": NEW_TOKENS, "temperature": 0.0, "ignore_eos": True}
    for p, out in zip(prompts, plain, strict=True):
        stop = out[2]  # early in the plain output: without min_tokens the request ends by its third token
        assert len(llm.generate([p], SamplingParams(**base, stop_token_ids=[stop]))[0].token_ids) <= 3
        processor = transformers.MinNewTokensLengthLogitsProcessor(len(p), 10, [stop])
        ref = hf_greedy(
            checkpoint, p, NEW_TOKENS, {"logits_processor": transformers.LogitsProcessorList([processor])}
        )
        assert stop not in ref[:10]
        ends = [i for i, t in enumerate(ref) if t == stop]
        expected = ref[: ends[0] + 1] if ends else ref
        got = llm.generate([p], SamplingParams(**base, stop_token_ids=[stop], min_tokens=10))[0].token_ids
        assert got == expected
    allowed = sorted({t for out in plain for t in out[5:15]})  # tokens the model likes, not all of them
    suppressed = [t for t in range(VOCAB) if t not in allowed]
    expected = [hf_greedy(checkpoint, p, NEW_TOKENS, {"suppress_tokens": suppressed}) for p in prompts]
    assert expected != plain and all(set(e) <= set(allowed) for e in expected)
    got = llm.generate(prompts, SamplingParams(**base, allowed_token_ids=allowed))
    assert [o.token_ids for o in got] == expected


def test_min_tokens_spares_eos_with_ignore_eos_and_ends_at_its_length() -> None:
    logits = torch.zeros(3, 8)
    params = [
        SamplingParams(min_tokens=2, stop_token_ids=[5]),
        SamplingParams(min_tokens=2, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(min_tokens=2, stop_token_ids=[5]),
    ]
    out = process_logits(logits, params, None, positions=[1, 1, 2], eos_token_ids={7})
    inf = float("-inf")
    assert out[0].tolist() == [0, 0, 0, 0, 0, inf, 0, inf]  # EOS and the stop token, before 2 tokens
    assert out[1].tolist() == [0, 0, 0, 0, 0, inf, 0, 0]  # ignore_eos: EOS is not a stop
    assert out[2].tolist() == [0.0] * 8  # its third token: no minimum left
    with pytest.raises(
        InvalidRequestError, match=r"min_tokens must be between 0 and max_tokens \(4\), got 5"
    ):
        SamplingParams(max_tokens=4, min_tokens=5).validate()
    with pytest.raises(InvalidRequestError, match="allowed_token_ids must not be empty"):
        SamplingParams(allowed_token_ids=[]).validate()
    with pytest.raises(InvalidRequestError, match=r"allowed_token_ids \[400\] are outside the vocabulary"):
        SamplingParams(allowed_token_ids=[1, 400]).validate(VOCAB)


@needs_gpu
def test_gpu_engine_applies_bias_and_penalties_as_the_cpu_engine() -> None:
    """On a GPU (Triton ops, decode graphs, asynchronous scheduling on): greedy rows with a bias and
    penalties give the CPU reference engine's tokens, and a batch of biased rows still runs ahead."""
    prompts = _prompts()
    base = {"max_tokens": 32, "temperature": 0.0, "ignore_eos": True}
    params = [
        SamplingParams(**base, repetition_penalty=1.5, frequency_penalty=0.5, logit_bias={7: 3.0}),
        SamplingParams(**base, presence_penalty=1.2),
        SamplingParams(**base, logit_bias={20: 2.0, 30: -100.0}),
    ]
    cpu = LLM("tiny-dense", device="cpu", dtype="float32")
    gpu = LLM("tiny-dense", device="cuda", dtype="float32", num_kv_blocks=512)
    assert gpu.engine.config.async_scheduling
    expected = [o.token_ids for o in cpu.generate(prompts, params)]
    assert [o.token_ids for o in gpu.generate(prompts, params)] == expected
    before = gpu.engine.lookahead_steps
    biased = [params[2]] * 3
    assert [o.token_ids for o in gpu.generate(prompts, biased)] == [
        o.token_ids for o in cpu.generate(prompts, biased)
    ]
    assert gpu.engine.lookahead_steps > before
