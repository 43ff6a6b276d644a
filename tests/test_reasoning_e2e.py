"""A chat reply's thinking and its structured output over the real mesh (router, prefill and decode worker
processes) on a checkpoint whose tokenizer has ``<think>`` and ``</think>`` tokens, with
``--reasoning-parser deepseek_r1``: the constraint starts after ``</think>``, and the thinking goes to
``reasoning_content``. The random-weight model is steered by a logit bias on ``</think>``."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from engine import LLM, SamplingParams
from engine.structured_outputs import StructuredOutputs
from engine.tokenizer import render_chat
from tests.checkpoints import make_checkpoint
from tests.mesh_fixtures import ServiceProcess, worker_pair

pytestmark = pytest.mark.e2e

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "required": ["n"], "additionalProperties": False}  # fmt: skip


@pytest.fixture(scope="module")
def thinking_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from tokenizers import AddedToken, Tokenizer

    path = make_checkpoint("qwen3", tmp_path_factory.mktemp("thinking"), seed=3, eos_token_id=257)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    # As Qwen3's: added, not special (the text keeps them, so the reasoning parser sees them).
    tok.add_tokens([AddedToken("<think>", special=False), AddedToken("</think>", special=False)])
    tok.save(str(path / "tokenizer.json"))
    return path


@pytest.fixture(scope="module")
def mesh(thinking_checkpoint: Path) -> Iterator[openai.OpenAI]:
    model = str(thinking_checkpoint)
    with worker_pair("--model", model) as (prefill, decode):
        proc = ServiceProcess.start(
            "router", "--model", model, "--http-port", "0", "--prefill-workers", prefill.address,
            "--decode-workers", decode.address, "--reasoning-parser", "deepseek_r1", "--pd-threshold-tokens", "0",
        )  # fmt: skip
        try:
            http = next(line for line in proc.lines if "ready:" in line).split("http=")[1].split()[0]
            yield openai.OpenAI(base_url=f"http://{http}/v1", api_key="unused", max_retries=0)
        finally:
            assert proc.stop() == 0, proc.log()


def test_the_constraint_holds_the_reply_after_its_thinking(
    thinking_checkpoint: Path, mesh: openai.OpenAI
) -> None:
    llm = LLM(model=str(thinking_checkpoint), device="cpu", dtype="float32", num_kv_blocks=64)
    think, end = (llm.tokenizer.encode(m, add_special_tokens=False) for m in ("<think>", "</think>"))
    assert len(think) == len(end) == 1
    messages = [{"role": "user", "content": "Count, thinking first.<think>"}]  # the prompt opens the block
    ids = llm.tokenizer.encode(render_chat(llm.tokenizer, messages), add_special_tokens=False)
    assert think[0] in ids and end[0] not in ids
    bias = {end[0]: 100.0}
    spec = {"json": SCHEMA, "disable_any_whitespace": True}
    expected = llm.generate([ids], SamplingParams(max_tokens=30, temperature=0.0, logit_bias=bias,
                            structured_outputs=StructuredOutputs(**spec, reasoning=(think[0], end[0]))))[0]  # fmt: skip
    assert expected.token_ids[0] == end[0] and expected.finish_reason == "stop"
    held = llm.generate([ids], SamplingParams(max_tokens=30, temperature=0.0, logit_bias=bias,
                        structured_outputs=StructuredOutputs(**spec)))[0]  # fmt: skip
    assert end[0] not in held.token_ids  # held from the first token, the model could not end its thinking
    reply = mesh.chat.completions.create(
        model=thinking_checkpoint.name, messages=messages, max_tokens=30, temperature=0.0,
        logit_bias={str(k): v for k, v in bias.items()}, extra_body={"structured_outputs": spec},
    )  # fmt: skip
    message = reply.choices[0].message.model_dump()
    answer = expected.text.split("</think>", 1)[1]
    assert message["content"] == answer and set(json.loads(answer)) == {"n"}
    assert not message["reasoning_content"] and reply.choices[0].finish_reason == "stop"


def test_the_responses_api_gives_the_thinking_as_a_reasoning_item(
    thinking_checkpoint: Path, mesh: openai.OpenAI
) -> None:
    """POST /v1/responses with a reasoning parser: the thinking is a reasoning item (reasoning_text) before
    the message, as chat's reasoning_content and content; streamed as response.reasoning_text.delta."""
    llm = LLM(model=str(thinking_checkpoint), device="cpu", dtype="float32", num_kv_blocks=64)
    (end,) = llm.tokenizer.encode("</think>", add_special_tokens=False)
    messages = [{"role": "user", "content": "Count, thinking first.<think>"}]
    for push in (3.0, 5.0, 7.0, 9.0, 12.0):  # a bias on </think> that ends the thinking after a few tokens
        bias = {str(end): push}
        chat = mesh.chat.completions.create(model=thinking_checkpoint.name, messages=messages, max_tokens=24,
                                            temperature=0.0, logit_bias=bias)  # fmt: skip
        message = chat.choices[0].message.model_dump()
        if message["reasoning_content"] and message["content"]:
            break
    else:
        pytest.fail("no bias gave both thinking and an answer")
    args = dict(model=thinking_checkpoint.name, input=messages[0]["content"], max_output_tokens=24,
                temperature=0.0, extra_body={"logit_bias": bias})  # fmt: skip
    whole = mesh.responses.create(**args)
    assert [item.type for item in whole.output] == ["reasoning", "message"]
    assert whole.output[0].content[0].text == message["reasoning_content"]
    assert whole.output_text == message["content"]
    reasoning, text, types = "", "", []
    for event in mesh.responses.create(**args, stream=True):
        types.append(event.type)
        if event.type == "response.reasoning_text.delta":
            reasoning += event.delta
        elif event.type == "response.output_text.delta":
            text += event.delta
    assert reasoning == message["reasoning_content"] and text == message["content"]
    assert types.index("response.reasoning_text.done") < types.index("response.output_text.delta")
