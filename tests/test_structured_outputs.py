"""Structured outputs (engine/structured_outputs.py): outputs held to a JSON schema, any JSON object, a regex,
a list of choices or a grammar.

Greedy tokens must equal transformers' greedy decoding with the grammar's mask applied to its logits by
llguidance directly (its own bitmask, unpacked here, not the engine's code), token for token, batched with
an unconstrained request that must keep its own tokens. Sampled outputs must parse and match their
schema. Bad constraints are refused before anything is allocated; a decode worker refuses an imported
first token its grammar forbids; a request whose grammar and allowed tokens leave nothing to sample ends,
with every block back in the pool.
"""

from __future__ import annotations

import json
import re

import llguidance
import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import InvalidRequestError
from engine.structured_outputs import StructuredOutputs
from mesh.structured_outputs_proto import structured_outputs_from_proto, structured_outputs_to_proto
from tests.checkpoints import make_checkpoint
from tests.kernel_testing import needs_gpu

EOS = 257  # the checkpoints' tokenizer's </s>: a special token, as a real model's EOS is
NEW_TOKENS = 48
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "ok"],
    "additionalProperties": False,
}
CONSTRAINTS = {
    "json": StructuredOutputs(json=json.dumps(SCHEMA), disable_any_whitespace=True),
    "regex": StructuredOutputs(regex=r"[a-f]{2,5}-[0-9]{3}"),
    "choice": StructuredOutputs(choice=("north", "south", "east")),
    "grammar": StructuredOutputs(grammar='start: "(" item ("," item)* ")"\nitem: /[xyz]/ | start'),
}


def _matches(kind: str, text: str) -> bool:
    if kind == "json":
        try:
            obj = json.loads(text)
        except ValueError:
            return False
        return (
            isinstance(obj, dict)
            and set(obj) == {"name", "age", "ok"}
            and isinstance(obj["name"], str)
            and len(obj["name"]) <= 6
            and type(obj["age"]) is int
            and 0 <= obj["age"] <= 150
            and isinstance(obj["ok"], bool)
        )
    if kind == "regex":
        return re.fullmatch(r"[a-f]{2,5}-[0-9]{3}", text) is not None
    if kind == "choice":
        return text in ("north", "south", "east")
    depth = 0  # the grammar: balanced parentheses of comma-separated x, y, z
    for prev, ch in zip(" " + text, text, strict=False):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth < 0 or ch not in "(),xyz" or (prev in "(," and ch in ",)"):
            return False
    return depth == 0 and text.startswith("(")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3"), seed=7, eos_token_id=EOS)


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=128)


def _transformers_constrained_greedy(checkpoint, prompt: list[int], spec: StructuredOutputs) -> list[int]:
    """transformers' forward, the mask from llguidance's own ``compute_bitmask``, argmax; until EOS."""
    import transformers
    from tokenizers import Tokenizer

    model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    vocab = model.config.vocab_size
    tok = llguidance.LLTokenizer(
        Tokenizer.from_file(str(checkpoint / "tokenizer.json")).to_str(), n_vocab=vocab, eos_token=EOS
    )
    matcher = llguidance.LLMatcher(tok, spec.grammar_source())
    ids = list(prompt)
    out: list[int] = []
    while len(out) < NEW_TOKENS:
        words = torch.frombuffer(bytearray(matcher.compute_bitmask()), dtype=torch.int32)
        allowed = [(int(words[t // 32]) >> (t % 32)) & 1 for t in range(vocab)]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        logits[torch.tensor(allowed) == 0] = float("-inf")
        token = int(logits.argmax())
        out.append(token)
        if token == EOS:
            break
        assert matcher.consume_token(token)
        ids.append(token)
    return out


@pytest.mark.parametrize("kind", list(CONSTRAINTS))
def test_greedy_constrained_tokens_equal_transformers_with_the_mask(checkpoint, llm: LLM, kind: str) -> None:
    spec = CONSTRAINTS[kind]
    prompts = [[5, 17, 99, 31], [200, 7, 7, 64, 12, 3]]
    expected = [_transformers_constrained_greedy(checkpoint, p, spec) for p in prompts]
    constrained = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, structured_outputs=spec)
    plain = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0)
    alone = llm.generate(prompts, plain)
    outs = llm.generate([*prompts, prompts[0]], [constrained, constrained, plain])
    assert [o.token_ids for o in outs[:2]] == expected
    assert outs[2].token_ids == alone[0].token_ids  # the unconstrained row keeps its own tokens
    for o, a in zip(outs[:2], alone, strict=True):
        assert o.finish_reason == "stop" and o.token_ids[-1] == EOS  # the grammar completed, then EOS
        assert _matches(kind, o.text), o.text
        assert not _matches(kind, a.text)  # unconstrained, the model writes something else


def test_sampled_json_matches_the_schema_with_asynchronous_scheduling() -> None:
    """The built-in model (byte tokenizer), sampling, several seeds, constrained and free rows together."""
    llm = LLM("tiny-dense", num_kv_blocks=256, async_scheduling=True)
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    params = [
        SamplingParams(max_tokens=120, temperature=1.0, seed=s, structured_outputs=spec) for s in range(6)
    ]
    free = SamplingParams(max_tokens=30, temperature=1.0, seed=1, ignore_eos=True)
    outs = llm.generate(["Person:"] * 6 + ["free text"], [*params, free])
    for o in outs[:6]:
        assert o.finish_reason == "stop" and _matches("json", o.text), o.text
    assert len({o.text for o in outs[:6]}) > 1  # sampled, not one forced string
    assert outs[6].token_ids == llm.generate(["free text"], free)[0].token_ids
    assert llm.engine.block_pool.num_free_blocks == llm.engine.block_pool.num_blocks


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"json": '{"type": "nope"}'}, "structured_outputs json"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"regex": "a(b"}, "unclosed group"),
        ({"grammar": "start: missing_rule"}, "structured_outputs grammar"),
        ({"choice": []}, "non-empty strings"),
        ({"regex": "a", "choice": ["b"]}, "exactly one"),
        ({}, "exactly one"),
    ],
)
def test_bad_constraints_are_refused_before_anything_is_allocated(llm: LLM, spec, message: str) -> None:
    engine = llm.engine
    with pytest.raises(InvalidRequestError, match=message):
        engine.add_request("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
    with pytest.raises(InvalidRequestError, match=message):
        engine.reserve_import("bad", [1, 2, 3], SamplingParams(structured_outputs=spec))
    assert not engine.has_unfinished() and not engine._imports
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_logprobs_are_those_of_the_masked_logits(llm: LLM) -> None:
    """As vLLM's: a constrained token's alternatives are only tokens its grammar allowed there."""
    spec = StructuredOutputs(choice=("north", "south"))
    out = llm.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=10, temperature=0.0, logprobs=3, structured_outputs=spec)
    )[0]
    first = out.logprobs[0]
    assert {t for t, _ in first.top if _ > float("-inf")} == {ord("n") - 33, ord("s") - 33}  # byte-level ids
    assert first.rank == 1 and all(lp.logprob > float("-inf") for lp in out.logprobs)


def test_a_whitespace_pattern_holds_the_whitespace_between_json_tokens() -> None:
    """vLLM's guided_whitespace_pattern: the built-in model, which left to itself writes runs of newlines
    and tabs between JSON tokens, writes at most single spaces there."""
    llm = LLM("tiny-dense", num_kv_blocks=256)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
              "required": ["a", "b"], "additionalProperties": False}  # fmt: skip
    free_ws, held_ws = set(), set()
    for seed in range(4):
        params = {"max_tokens": 60, "temperature": 1.0, "seed": seed}
        free = llm.generate(["x"], SamplingParams(**params, structured_outputs={"json": schema}))[0].text
        held = llm.generate(
            ["x"], SamplingParams(**params, structured_outputs={"json": schema, "whitespace_pattern": " ?"})
        )[0]
        free_ws |= set(re.findall(r"\s+", free))
        held_ws |= set(re.findall(r"\s+", held.text))
        if held.finish_reason == "stop":
            assert set(json.loads(held.text)) == {"a", "b"}
    assert held_ws <= {" "} and free_ws - {" "}  # without the pattern the model does write other runs
    with pytest.raises(InvalidRequestError, match="not both"):
        StructuredOutputs(
            json=json.dumps(schema), whitespace_pattern="", disable_any_whitespace=True
        ).validate()


def test_a_complete_grammar_ends_the_request_despite_min_tokens(llm: LLM) -> None:
    spec = StructuredOutputs(choice=("ab",))
    out = llm.generate([[9, 8, 7]], SamplingParams(max_tokens=20, min_tokens=10, structured_outputs=spec))[0]
    assert out.text == "ab" and out.finish_reason == "stop" and out.token_ids[-1] == EOS


def test_no_token_left_to_sample_aborts_the_request_and_frees_its_blocks(llm: LLM) -> None:
    spec = StructuredOutputs(regex="[0-9]+")
    letters = list(range(ord("a") - 33, ord("z") - 32))  # byte-level ids of letters: no digit among them
    outs = llm.generate(
        [[1, 2, 3], [4, 5, 6]],
        [
            SamplingParams(
                max_tokens=10, temperature=0.0, allowed_token_ids=letters, structured_outputs=spec
            ),
            SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
        ],
    )
    assert outs[0].finish_reason == "abort" and len(outs[0].token_ids) == 1
    assert outs[1].finish_reason == "length" and len(outs[1].token_ids) == 10
    engine = llm.engine
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks and not engine._constrained


def test_an_aborted_constrained_request_leaves_nothing_behind(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=CONSTRAINTS["grammar"])
    engine.add_request("a", [3, 4, 5], params)
    engine.add_request("b", [6, 7, 8], params)
    engine.step()
    assert engine._constrained == {"a", "b"}
    engine.abort("a")
    engine.step()
    assert engine._constrained == {"b"}
    while engine.has_unfinished():
        engine.step()
    assert not engine._constrained and engine.block_pool.num_free_blocks == engine.block_pool.num_blocks


def test_an_imported_first_token_the_grammar_forbids_is_refused(llm: LLM) -> None:
    """A decode worker continues a prefill worker's request: the first token must be the grammar's."""
    engine = llm.engine
    params = SamplingParams(max_tokens=8, temperature=0.0, structured_outputs={"choice": ["xy"]})
    x, q = engine.tokenizer.encode("x", add_special_tokens=False)[0], engine.tokenizer.encode("q")[-1]
    engine.reserve_import("imp", [1, 2, 3, 4], params)
    with pytest.raises(InvalidRequestError, match="not allowed by the request's structured_outputs"):
        engine.commit_import("imp", q)
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
    engine.reserve_import("imp", [1, 2, 3, 4], params)
    engine.commit_import("imp", x)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            text = out.text
    assert text == "xy" and tokens[-1] == EOS
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks and not engine._constrained


def test_preemption_keeps_each_output_where_it_was_in_its_grammar(checkpoint) -> None:
    """A pool too small for every request at once preempts some mid-output; their outputs are those of a
    pool with room for all (the grammar state follows the tokens, which preemption keeps)."""
    spec = CONSTRAINTS["grammar"]
    prompts = [[i, i + 1, i + 2, i + 3] * 4 for i in range(10, 16)]
    params = SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec)
    roomy = LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=128)
    tight = LLM(model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=14, block_size=4)
    expected = roomy.generate(prompts, params)
    got = tight.generate(prompts, params)
    assert tight.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]


def test_prompts_in_chunks_beside_constrained_decodes_equal_whole_prompts(checkpoint, llm: LLM) -> None:
    """A step budget of 8 tokens: constrained prompts are computed in chunks that sample nothing (their
    masks computed before the forward go unused), beside rows that decode; the tokens are unchanged."""
    prompts = [[i % 200 + 3 for i in range(start, start + 21)] for start in (0, 50, 90)]
    params = [
        SamplingParams(max_tokens=30, temperature=0.0, structured_outputs=CONSTRAINTS[k])
        for k in ("json", "grammar", "regex")
    ]
    chunked = LLM(
        model=str(checkpoint), device="cpu", dtype="float32", num_kv_blocks=128, max_num_batched_tokens=8
    )
    expected = llm.generate(prompts, params)
    got = chunked.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    plain = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0))
    assert all(o.token_ids != p.token_ids for o, p in zip(got, plain, strict=True))  # the masks acted


@pytest.mark.parametrize("kind", [*CONSTRAINTS, "json_object"])
def test_the_proto_carries_each_kind(kind: str) -> None:
    spec = CONSTRAINTS.get(kind) or StructuredOutputs(json_object=True, whitespace_pattern="[ ]?")
    assert structured_outputs_from_proto(structured_outputs_to_proto(spec)) == spec


@needs_gpu
def test_gpu_engine_holds_outputs_to_grammars_as_the_cpu_engine() -> None:
    """On a GPU (Triton ops, decode graphs, asynchronous scheduling on, the masks copied from pinned host
    memory): constrained greedy rows give the CPU engine's tokens, beside a free row, and once they are
    done a free batch runs ahead again."""
    prompts = [[5, 17, 99, 31], [200, 7, 7, 64, 12, 3], [9, 9, 9]]
    params = [
        SamplingParams(
            max_tokens=60,
            temperature=0.0,
            structured_outputs={"json": SCHEMA, "disable_any_whitespace": True},
        ),
        SamplingParams(max_tokens=60, temperature=0.0, structured_outputs={"regex": r"[a-f]{2,5}-[0-9]{3}"}),
        SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True),
    ]
    cpu = LLM("tiny-dense", device="cpu", dtype="float32")
    gpu = LLM("tiny-dense", device="cuda", dtype="float32", num_kv_blocks=512)
    assert gpu.engine.config.async_scheduling
    expected = cpu.generate(prompts, params)
    got = gpu.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert _matches("json", got[0].text) and _matches("regex", got[1].text)
    before = gpu.engine.lookahead_steps
    gpu.generate(prompts, [params[2]] * 3)
    assert gpu.engine.lookahead_steps > before and not gpu.engine._constrained


THINK, END_THINK = 300, 301  # two unused ids of the built-in byte tokenizer's vocabulary, as markers


@pytest.fixture(scope="module")
def tiny() -> LLM:
    return LLM("tiny-dense", num_kv_blocks=256)


def _thinking(regex: str) -> StructuredOutputs:
    return StructuredOutputs(regex=regex, reasoning=(THINK, END_THINK))


def test_the_constraint_starts_after_the_thinking(tiny: LLM) -> None:
    """A prompt that opens a think block: the output thinks unconstrained (here it is pushed to end its
    thinking at once, then again later by a smaller bias) and is held to the grammar after the end token."""
    regex = "[a-c]{4}"
    bias = {END_THINK: 100.0}
    out = tiny.generate([[104, 105, THINK]], SamplingParams(max_tokens=20, temperature=0.0, logit_bias=bias,
                                                            structured_outputs=_thinking(regex)))[0]  # fmt: skip
    assert out.token_ids[0] == END_THINK and re.fullmatch(regex, bytes(out.token_ids[1:-1]).decode())
    assert out.finish_reason == "stop"
    # Unconstrained thinking: without the bias the random model thinks until max_tokens, outside [a-c].
    free = tiny.generate([[104, 105, THINK]], SamplingParams(max_tokens=20, temperature=0.0,
                                                             structured_outputs=_thinking(regex)))[0]  # fmt: skip
    plain = tiny.generate([[104, 105, THINK]], SamplingParams(max_tokens=20, temperature=0.0))[0]
    assert free.token_ids == plain.token_ids and END_THINK not in free.token_ids


def test_a_closed_think_block_in_the_prompt_starts_the_constraint_at_once(tiny: LLM) -> None:
    """Thinking turned off (the template wrote an empty block): the grammar from the first token, and the
    think tokens are not allowed."""
    bias = {THINK: 100.0, END_THINK: 100.0}
    params = SamplingParams(
        max_tokens=20, temperature=0.0, logit_bias=bias, structured_outputs=_thinking("[a-c]{4}")
    )
    out = tiny.generate([[104, THINK, END_THINK, 10]], params)[0]
    assert (
        re.fullmatch("[a-c]{4}", out.text) and THINK not in out.token_ids and END_THINK not in out.token_ids
    )


def test_an_output_may_open_a_think_block_or_answer_at_once(tiny: LLM) -> None:
    """No marker in the prompt: the first token is the grammar's or the think start (Qwen3's rule)."""
    spec = _thinking("[a-c]{4}")
    opened = tiny.generate([[104, 105]], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=spec,
                                                        logit_bias={THINK: 100.0, END_THINK: 50.0},
                                                        repetition_penalty=3.0))[0]  # fmt: skip
    assert opened.token_ids[0] == THINK and END_THINK in opened.token_ids
    after = opened.token_ids[opened.token_ids.index(END_THINK) + 1 : -1]
    assert re.fullmatch("[a-c]{4}", bytes(after).decode()) and opened.finish_reason == "stop"
    direct = tiny.generate([[104, 105]], SamplingParams(max_tokens=20, temperature=0.0, structured_outputs=spec,
                                                        logit_bias={END_THINK: 100.0}))[0]  # fmt: skip
    assert re.fullmatch("[a-c]{4}", direct.text) and END_THINK not in direct.token_ids


def test_an_imported_request_resumes_its_thinking_phase(tiny: LLM) -> None:
    """A decode worker builds the matcher from the same prompt: a first token inside the think block is
    allowed whatever it is; the grammar then starts after the end token."""
    engine = tiny.engine
    params = SamplingParams(max_tokens=12, temperature=0.0, logit_bias={END_THINK: 100.0},
                            structured_outputs=_thinking("[a-c]{3}"))  # fmt: skip
    engine.reserve_import("think", [104, 105, THINK], params)
    engine.commit_import("think", ord("z"))  # thinking: not the grammar's, but allowed
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
    assert tokens[0] == END_THINK and re.fullmatch("[a-c]{3}", bytes(tokens[1:-1]).decode())
    assert engine.block_pool.num_free_blocks == engine.block_pool.num_blocks and not engine._constrained


def test_reasoning_markers_are_checked() -> None:
    with pytest.raises(InvalidRequestError, match="two different token ids"):
        SamplingParams(structured_outputs=StructuredOutputs(regex="a", reasoning=(5, 5))).validate()
    with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
        SamplingParams(structured_outputs=StructuredOutputs(regex="a", reasoning=(5, 9999))).validate(512)
    spec = _thinking("a+")
    assert structured_outputs_from_proto(structured_outputs_to_proto(spec)) == spec


def test_constrained_requests_run_ahead_with_asynchronous_scheduling() -> None:
    """Lookahead steps sample after the tokens in flight are read, so grammars (advanced by those tokens)
    mask them: constrained rows, beside free ones and joining while steps are in flight, give the tokens
    of the synchronous engine, and the steps do run ahead."""
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    params = [
        SamplingParams(max_tokens=80, temperature=0.0, structured_outputs=spec),
        SamplingParams(max_tokens=80, temperature=0.9, seed=4, structured_outputs=spec),
        SamplingParams(
            max_tokens=40, temperature=0.9, seed=5, structured_outputs={"regex": "[a-f]{2,9}-[0-9]{3}"}
        ),
        SamplingParams(max_tokens=40, temperature=0.9, seed=6, ignore_eos=True),
    ]
    prompts = [list(b"Person one:"), list(b"Person two:"), list(b"Code:"), list(b"free")]

    def run(async_scheduling: bool) -> tuple[dict[str, list[int]], int]:
        engine = LLM("tiny-dense", num_kv_blocks=256, async_scheduling=async_scheduling).engine
        tokens: dict[str, list[int]] = {}
        for i in (0, 3):
            engine.add_request(str(i), prompts[i], params[i])
        for step in range(200):
            if step == 3:  # joining while a step is in flight
                for i in (1, 2):
                    engine.add_request(str(i), prompts[i], params[i])
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if step > 3 and not engine.has_unfinished():
                break
        assert not engine._constrained and engine.block_pool.num_free_blocks == engine.block_pool.num_blocks
        return tokens, engine.lookahead_steps

    expected, _ = run(False)
    got, lookahead = run(True)
    assert got == expected and lookahead > 20
    for i in (0, 1):
        assert _matches("json", bytes(t for t in got[str(i)] if t < 256).decode())
