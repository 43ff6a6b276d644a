"""The router as a real process in front of real prefill and decode worker processes (real gRPC, real
NIXL on host memory), driven by the official ``openai`` client and by the gRPC ``Generate`` API.

What comes out must equal the offline engine's output, for greedy and for seeded sampling; bad
requests get the OpenAI error shape; a client that disconnects leaves no KV block held on any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest

from engine import LLM, SamplingParams
from engine.tokenizer import render_chat
from mesh.telemetry import read_spans_jsonl
from protos.pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from router.text_stream import token_text
from router.tool_calls import parse_tools
from tests.mesh_fixtures import REDIS_URL, ServiceProcess, needs_redis, pd_workers, wait_until, worker_args  # noqa: F401

pytestmark = pytest.mark.e2e

MODEL = "tiny-dense"
KV_BLOCKS = 256  # what mesh_fixtures.worker_args gives each worker
GREEDY = {"temperature": 0.0}
SEEDED = {"temperature": 0.8, "top_p": 0.9, "seed": 1234}


class Router:
    def __init__(self, proc: ServiceProcess, trace_file: Path) -> None:
        self.proc = proc
        self.trace_file = trace_file
        match = re.search(r"http=(\S+)", next(line for line in proc.lines if "ready:" in line))
        assert match is not None
        self.http = match.group(1)
        self.grpc = proc.address
        self.client = openai.OpenAI(base_url=f"http://{self.http}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def router(pd_workers, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Router]:  # noqa: F811
    prefill, decode = pd_workers
    trace_file = tmp_path_factory.mktemp("router") / "spans.jsonl"
    proc = ServiceProcess.start(
        "router", "--model", MODEL, "--http-port", "0", "--prefill-workers", prefill.address,
        "--decode-workers", decode.address, "--trace-file", str(trace_file),
        "--pd-threshold-tokens", "0",  # prefix routing, every prompt through the prefill worker
    )  # fmt: skip
    try:
        yield Router(proc, trace_file)
    finally:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(MODEL, num_kv_blocks=KV_BLOCKS)


def _offline(llm: LLM, prompt: str | list[int], max_tokens: int, **sampling: Any) -> Any:
    return llm.generate([prompt], SamplingParams(max_tokens=max_tokens, **sampling))[0]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_streamed_completion_equals_offline(router: Router, llm: LLM, sampling: dict[str, Any]) -> None:
    prompt = "The mesh routes each request to a prefill worker, then"
    stream = router.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True}, **sampling,
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = chunks[-1].usage
    expected = _offline(llm, prompt, 24, ignore_eos=True, **sampling)
    assert text == expected.text and finish == ["length"]
    assert (
        usage is not None
        and usage.completion_tokens == 24
        and usage.prompt_tokens == len(expected.prompt_token_ids)
    )


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_streamed_chat_equals_offline(router: Router, llm: LLM, sampling: dict[str, Any]) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    stream = router.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        max_tokens=20,
        stream=True,
        extra_body={"ignore_eos": True},
        **sampling,
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    prompt_ids = llm.tokenizer.encode(render_chat(llm.tokenizer, messages), add_special_tokens=False)
    assert text == _offline(llm, prompt_ids, 20, ignore_eos=True, **sampling).text
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_logprobs_and_stop_string_equal_offline(router: Router, llm: LLM) -> None:
    prompt = "Tokens and their log-probabilities:"
    reply = router.client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=16,
        temperature=0.0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    expected = _offline(llm, prompt, 16, temperature=0.0, ignore_eos=True, logprobs=2)
    lp = reply.choices[0].logprobs
    assert reply.choices[0].text == expected.text
    assert lp.token_logprobs == pytest.approx([e.logprob for e in expected.logprobs], abs=1e-4)
    for top, e in zip(lp.top_logprobs, expected.logprobs, strict=True):  # keyed by token text
        assert 1 <= len(top) <= 2
        assert all(any(abs(v - w) < 1e-4 for _, w in e.top) for v in top.values())
    # A stop string taken from the greedy text itself, so it certainly occurs.
    stop = expected.text[5:7]
    stopped = router.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0, stop=[stop]
    )
    offline_stopped = _offline(llm, prompt, 16, temperature=0.0, stop=[stop])
    assert stopped.choices[0].text == offline_stopped.text and stopped.choices[0].finish_reason == "stop"
    # vLLM's include_stop_str_in_output: the text keeps the stop string, streamed or not, as offline.
    kept = _offline(llm, prompt, 16, temperature=0.0, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == offline_stopped.text + stop
    extra = {"include_stop_str_in_output": True}
    whole = router.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0, stop=[stop], extra_body=extra
    )
    streamed = router.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0, stop=[stop], extra_body=extra, stream=True
    )
    assert whole.choices[0].text == "".join(c.choices[0].text for c in streamed if c.choices) == kept.text
    assert whole.choices[0].stop_reason == stop  # type: ignore[attr-defined]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_penalties_and_logit_bias_over_the_mesh_equal_offline(
    router: Router, llm: LLM, sampling: dict[str, Any]
) -> None:
    """The prefill worker samples the first token with the prompt as history, the decode worker the rest
    with the output so far (the first token included): the offline engine's tokens."""
    prompt = "Say it again and again and again and again:"
    penalties = {"frequency_penalty": 0.6, "presence_penalty": 0.4}
    bias = {65: 4.0, 97: -100.0}  # 'A' up, 'a' banned
    reply = router.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, extra_body={"ignore_eos": True, "repetition_penalty": 1.4},
        logit_bias={str(t): b for t, b in bias.items()}, **penalties, **sampling,
    )  # fmt: skip
    expected = _offline(
        llm, prompt, 24, ignore_eos=True, repetition_penalty=1.4, logit_bias=bias, **penalties, **sampling
    )
    assert reply.choices[0].text == expected.text
    assert expected.text != _offline(llm, prompt, 24, ignore_eos=True, **sampling).text  # they matter here


def test_min_tokens_and_allowed_token_ids_over_the_mesh_equal_offline(router: Router, llm: LLM) -> None:
    prompt = "Short answers end early:"
    plain = _offline(llm, prompt, 30, temperature=0.0)
    stop = plain.token_ids[1]
    sampling = {"temperature": 0.0, "stop_token_ids": [stop], "min_tokens": 12}
    reply = router.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=30, temperature=0.0,
        extra_body={"stop_token_ids": [stop], "min_tokens": 12},
    )  # fmt: skip
    expected = _offline(llm, prompt, 30, **sampling)
    assert reply.usage is not None and reply.usage.completion_tokens == len(expected.token_ids) >= 12
    assert reply.choices[0].text == expected.text
    allowed = sorted(set(plain.token_ids[3:12]))
    reply = router.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=20, temperature=0.0, extra_body={"allowed_token_ids": allowed}
    )
    expected = _offline(llm, prompt, 20, temperature=0.0, allowed_token_ids=allowed)
    assert reply.choices[0].text == expected.text and set(expected.token_ids) <= set(allowed)
    assert expected.token_ids != plain.token_ids[:20]  # the restriction shows: ignored, the text would differ


def test_a_stop_token_is_left_out_of_the_text_as_offline(router: Router, llm: LLM) -> None:
    """The token that ends a request (one of stop_token_ids, or EOS) is in its tokens but not its text,
    unless include_stop_str_in_output (vLLM's rule): whole, streamed and over gRPC, as offline."""
    prompt = "Stop tokens end the text before them:"
    plain = _offline(llm, prompt, 30, temperature=0.0, ignore_eos=True)
    stop = plain.token_ids[4]
    for include in (False, True):
        sampling = {"temperature": 0.0, "stop_token_ids": [stop], "include_stop_str_in_output": include}
        expected = _offline(llm, prompt, 30, **sampling)
        ids = expected.token_ids
        assert ids[-1] == stop and expected.stop_reason == stop
        assert expected.text == llm.tokenizer.decode(ids if include else ids[:-1])
        assert llm.tokenizer.decode(ids[-1:])  # the stop token has text: leaving it out shows
        extra = {"stop_token_ids": [stop], "include_stop_str_in_output": include}
        whole = router.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=30, temperature=0.0, extra_body=extra
        )
        streamed = router.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=30, temperature=0.0, extra_body=extra, stream=True
        )
        text = "".join(c.choices[0].text for c in streamed if c.choices)
        assert whole.choices[0].text == text == expected.text and whole.choices[0].finish_reason == "stop"

        async def run(include: bool = include) -> str:
            params = common_pb2.SamplingParams(
                max_tokens=30, temperature=0.0, stop_token_ids=[stop], include_stop_str_in_output=include
            )
            request = router_pb2.GenerateRequest(text=prompt, sampling_params=params, return_text=True)
            out = ""
            async with grpc.aio.insecure_channel(router.grpc) as channel:
                async for msg in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60):
                    out += msg.text
            return out

        assert asyncio.run(run()) == expected.text


def test_grpc_generate_streams_the_offline_tokens(router: Router, llm: LLM) -> None:
    prompt = list(b"gRPC clients send token ids")

    async def run(sampling: dict[str, Any]) -> tuple[list[int], str, common_pb2.Usage]:
        params = common_pb2.SamplingParams(max_tokens=20, ignore_eos=True, **sampling)
        request = router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=prompt), sampling_params=params,
                                             return_text=True)  # fmt: skip
        tokens, text, usage = [], "", common_pb2.Usage()
        async with grpc.aio.insecure_channel(router.grpc) as channel:
            async for msg in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60):
                tokens += list(msg.token_ids)
                text += msg.text
                if msg.finish_reason:
                    usage = msg.usage
                    assert msg.finish_reason == common_pb2.FINISH_REASON_LENGTH and msg.decode_worker
        return tokens, text, usage

    for sampling in (GREEDY, SEEDED):
        tokens, text, usage = asyncio.run(run(sampling))
        expected = _offline(llm, prompt, 20, ignore_eos=True, **sampling)
        assert tokens == expected.token_ids and text == expected.text
        assert usage.prompt_tokens == len(prompt) and usage.completion_tokens == 20


def _post(router: Router, path: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(
        f"http://{router.http}{path}", data=json.dumps(body).encode(), method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.loads(resp.read())


async def grpc_prompt_logprobs(address: str, prompt: list[int]) -> list[common_pb2.Logprobs]:
    """The prompt logprobs (top 3) of a Generate call: on its first message only."""
    params = common_pb2.SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    found: list[list[common_pb2.Logprobs]] = []
    async with grpc.aio.insecure_channel(address) as channel:
        request = router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=prompt), sampling_params=params
        )
        async for msg in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60):
            found.append(list(msg.prompt_logprobs))
    assert all(not f for f in found[1:])
    return found[0]


def _assert_vllm_prompt_logprobs(got: list[Any], expected: list[Any], top_n: int, llm: LLM) -> None:
    """vLLM's ``prompt_logprobs`` shape against the offline engine's prompt logprobs."""
    assert len(got) == len(expected) and got[0] is None
    for entry, e in zip(got[1:], expected[1:], strict=True):
        own = entry[str(e.token_id)]
        assert own["logprob"] == pytest.approx(e.logprob, abs=1e-4) and own["rank"] == e.rank
        assert own["decoded_token"] == token_text(llm.tokenizer, e.token_id)
        for rank, (token, value) in enumerate(e.top[:top_n], start=1):
            assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)
            assert entry[str(token)]["rank"] == (e.rank if token == e.token_id else rank)
        assert set(entry) == {str(e.token_id)} | {str(t) for t, _ in e.top[:top_n]}


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_echo_with_logprobs_scores_the_prompt_as_offline(router: Router, llm: LLM, stream: bool) -> None:
    """lm-evaluation-harness's loglikelihood request: echo, logprobs, a token or two. The reply's
    logprobs cover the prompt (its first token null) and then the generated tokens."""
    prompt = "The capital of France is"
    reply = router.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=2, temperature=0.0, echo=True, logprobs=2, stream=stream,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    if stream:
        events = [c for c in reply if c.choices]
        text = "".join(c.choices[0].text for c in events)
        parts = [c.choices[0].logprobs for c in events if c.choices[0].logprobs]
        tokens = [t for p in parts for t in p.tokens]
        token_logprobs = [v for p in parts for v in p.token_logprobs]
        top = [t for p in parts for t in p.top_logprobs]
        offsets = [o for p in parts for o in p.text_offset]
    else:
        text = reply.choices[0].text
        lp = reply.choices[0].logprobs
        tokens, token_logprobs, top, offsets = lp.tokens, lp.token_logprobs, lp.top_logprobs, lp.text_offset
    expected = _offline(llm, prompt, 2, temperature=0.0, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    ids = expected.prompt_token_ids + expected.token_ids
    piece = lambda t: token_text(llm.tokenizer, t)  # noqa: E731
    assert text == prompt + expected.text
    assert tokens == [piece(t) for t in ids]
    assert offsets == [sum(len(piece(t)) for t in ids[:i]) for i in range(len(ids))]
    assert token_logprobs[0] is None and top[0] is None
    entries = expected.prompt_logprobs[1:] + expected.logprobs
    assert token_logprobs[1:] == pytest.approx([e.logprob for e in entries], abs=1e-4)
    for got, e in zip(top[1:], entries, strict=True):
        assert got == pytest.approx({piece(t): v for t, v in e.top}, abs=1e-4)


def test_a_one_token_prompt_echoes_with_a_null_logprob(router: Router, llm: LLM) -> None:
    body = {"model": MODEL, "prompt": [65], "max_tokens": 2, "temperature": 0.0, "ignore_eos": True,
            "echo": True, "logprobs": 1, "prompt_logprobs": 1}  # fmt: skip
    choice = _post(router, "/v1/completions", body)["choices"][0]
    expected = _offline(llm, [65], 2, temperature=0.0, ignore_eos=True, logprobs=1)
    assert choice["prompt_logprobs"] == [None]
    assert choice["logprobs"]["tokens"] == [token_text(llm.tokenizer, t) for t in [65, *expected.token_ids]]
    assert choice["logprobs"]["token_logprobs"][0] is None and choice["logprobs"]["top_logprobs"][0] is None
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx([e.logprob for e in expected.logprobs])


def test_prompt_logprobs_in_completions_chat_and_grpc_equal_offline(router: Router, llm: LLM) -> None:
    prompt = "Score every token of this prompt"
    expected = _offline(llm, prompt, 3, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 3, "temperature": 0.0, "ignore_eos": True}
    reply = _post(router, "/v1/completions", {**body, "prompt_logprobs": 2})
    _assert_vllm_prompt_logprobs(reply["choices"][0]["prompt_logprobs"], expected.prompt_logprobs, 2, llm)
    assert reply["choices"][0]["text"] == expected.text  # prompt logprobs do not change the tokens
    # Chat: beside the choices, as vLLM puts them.
    messages = [{"role": "user", "content": "Hi there"}]
    chat = _post(router, "/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2,
                                                    "temperature": 0.0, "prompt_logprobs": 0})  # fmt: skip
    chat_ids = llm.tokenizer.encode(render_chat(llm.tokenizer, messages), add_special_tokens=False)
    chat_expected = _offline(llm, chat_ids, 2, temperature=0.0, prompt_logprobs=0)
    _assert_vllm_prompt_logprobs(chat["prompt_logprobs"], chat_expected.prompt_logprobs, 0, llm)
    # Streaming: refused, as vLLM refuses it.
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(router, "/v1/completions", {**body, "prompt_logprobs": 1, "stream": True})
    assert err.value.code == 400 and json.loads(err.value.read())["error"]["param"] == "prompt_logprobs"
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(router, "/v1/completions", {**body, "prompt_logprobs": 21})
    assert err.value.code == 400 and "prompt_logprobs must be between 0 and 20" in err.value.read().decode()

    got = asyncio.run(grpc_prompt_logprobs(router.grpc, expected.prompt_token_ids))
    _assert_proto_prompt_logprobs(got, expected.prompt_logprobs)


def _assert_proto_prompt_logprobs(got: list[common_pb2.Logprobs], expected: list[Any]) -> None:
    assert [(e.token_id, e.rank) for e in got] == [(e.token_id, e.rank) for e in expected[1:]]
    assert [e.logprob for e in got] == pytest.approx([e.logprob for e in expected[1:]], abs=1e-4)
    assert [[t.token_id for t in e.top_logprobs] for e in got] == [
        [t for t, _ in e.top] for e in expected[1:]
    ]


def test_prompt_logprobs_of_a_decode_worker_that_prefills_equal_offline(pd_workers, llm: LLM) -> None:  # noqa: F811
    """No prefill worker: the decode worker computes the prompt, and its first message carries them."""
    _, decode = pd_workers
    proc = ServiceProcess.start(
        "router", "--model", MODEL, "--http-port", "0", "--decode-workers", decode.address
    )
    try:
        prompt = list(b"decode-only prompt")
        expected = _offline(llm, prompt, 3, temperature=0.0, ignore_eos=True, prompt_logprobs=3)
        _assert_proto_prompt_logprobs(
            asyncio.run(grpc_prompt_logprobs(proc.address, prompt)), expected.prompt_logprobs
        )
    finally:
        assert proc.stop() == 0, proc.log()


def test_bad_requests_get_the_openai_error_shape(router: Router) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        router.client.completions.create(model=MODEL, prompt="x", temperature=-1.0)
    assert err.value.status_code == 400 and "temperature must be >= 0" in err.value.message
    with pytest.raises(openai.NotFoundError):
        router.client.completions.create(model="no-such-model", prompt="x")
    request = urllib.request.Request(
        f"http://{router.http}/v1/chat/completions", data=b'{"messages": [', method="POST",
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as http_err:
        urllib.request.urlopen(request, timeout=10)
    assert http_err.value.code == 400
    body = json.loads(http_err.value.read())
    assert body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
    assert "not valid JSON" in body["error"]["message"]


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
    },
    "required": ["city", "n"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_structured_outputs_over_the_mesh_equal_offline(
    router: Router, llm: LLM, sampling: dict[str, Any]
) -> None:
    """Each way of asking (OpenAI's response_format, vLLM's structured_outputs and guided_* fields, the
    gRPC field), through a prefill worker (which samples the first token under the grammar) and a decode
    worker (which goes on from it), gives the offline engine's constrained output."""
    prompt = "Weather report:"
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": SCHEMA}}},
         {"json": SCHEMA}),
        ({"structured_outputs": compact}, compact),
        ({"structured_outputs": {"choice": ["sunny", "rain", "fog"]}}, {"choice": ["sunny", "rain", "fog"]}),
        ({"guided_regex": "[0-9]{2}C, wind [NESW]"}, {"regex": "[0-9]{2}C, wind [NESW]"}),
    ]  # fmt: skip
    free = _offline(llm, prompt, 40, **sampling).text
    for body, spec in cases:
        reply = router.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=40, extra_body=body, **sampling
        )
        expected = _offline(llm, prompt, 40, structured_outputs=spec, **sampling)
        assert reply.choices[0].text == expected.text != free, body
        assert reply.choices[0].finish_reason == expected.finish_reason
    obj = json.loads(_offline(llm, prompt, 40, structured_outputs=compact, **sampling).text)
    assert set(obj) == {"city", "n"} and isinstance(obj["n"], int)
    # Chat, streamed, any JSON object.
    messages = [{"role": "user", "content": "Reply in JSON."}]
    stream = router.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=30, stream=True,
        response_format={"type": "json_object"}, **sampling,
    )  # fmt: skip
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    prompt_ids = llm.tokenizer.encode(render_chat(llm.tokenizer, messages), add_special_tokens=False)
    assert text == _offline(llm, prompt_ids, 30, structured_outputs={"json_object": True}, **sampling).text
    assert text.startswith("{")

    async def grpc_text() -> str:
        params = common_pb2.SamplingParams(
            max_tokens=40,
            structured_outputs=common_pb2.StructuredOutputs(regex="[a-z]{1,6} [0-9]{1,3}"),
            **sampling,
        )
        request = router_pb2.GenerateRequest(
            token_ids=common_pb2.TokenIds(ids=list(prompt.encode())), sampling_params=params, return_text=True
        )
        async with grpc.aio.insecure_channel(router.grpc) as channel:
            return "".join(
                [m.text async for m in router_pb2_grpc.RouterStub(channel).Generate(request, timeout=60)]
            )

    expected = _offline(
        llm, list(prompt.encode()), 40, structured_outputs={"regex": "[a-z]{1,6} [0-9]{1,3}"}, **sampling
    )
    assert asyncio.run(grpc_text()) == expected.text and re.fullmatch("[a-z]{1,6} [0-9]{1,3}", expected.text)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "maximum": 9},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}


def _chat_ids(llm: LLM, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
    text = render_chat(llm.tokenizer, messages, tools=tools)
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _streamed_tool_calls(stream: Any) -> tuple[str, dict[int, dict[str, str]], str | None]:
    """Content, each call (by index) assembled from its deltas, and the finish reason of a streamed chat."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or []:
            call = calls.setdefault(d.index, {"name": "", "arguments": ""})
            call["name"] += d.function.name or "" if d.function else ""
            call["arguments"] += d.function.arguments or "" if d.function else ""
        finish = chunk.choices[0].finish_reason or finish
    return content, calls, finish


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_tool_calls_over_the_mesh_equal_offline(router: Router, llm: LLM, sampling: dict[str, Any]) -> None:
    """A named function and "required" constrain the output (their arguments are the offline engine's
    constrained output); "auto" reads hermes <tool_call> blocks from the text, here forced by a regex."""
    messages = [{"role": "user", "content": "Weather in Oslo for two days?"}]
    tools = [WEATHER_TOOL]
    ids = _chat_ids(llm, messages, tools)
    named = {"type": "function", "function": {"name": "get_weather"}}
    schema = WEATHER_TOOL["function"]["parameters"]
    expected = _offline(
        llm, ids, 60, structured_outputs={"json": schema, "disable_any_whitespace": True}, **sampling
    )
    reply = router.client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, tool_choice=named, max_tokens=60, **sampling
    )
    message = reply.choices[0].message
    assert message.tool_calls and message.tool_calls[0].function.name == "get_weather"
    assert message.tool_calls[0].function.arguments == expected.text and not message.content
    assert set(json.loads(expected.text)) == {"city", "days"} and reply.choices[0].finish_reason == "stop"
    content, calls, finish = _streamed_tool_calls(
        router.client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=tools,
            tool_choice=named,
            max_tokens=60,
            stream=True,
            **sampling,
        )
    )
    assert (
        content == ""
        and calls == {0: {"name": "get_weather", "arguments": expected.text}}
        and finish == "stop"
    )

    reply = router.client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=tools,
        tool_choice="required",
        max_tokens=80,
        parallel_tool_calls=False,
        **sampling,
    )
    required = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and required and len(required) == 1
    constraint = parse_tools(
        {"tools": tools, "tool_choice": "required", "parallel_tool_calls": False}, "hermes"
    )
    offline = json.loads(_offline(llm, ids, 80, structured_outputs=constraint.constraint(), **sampling).text)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in required] == [
        (item["name"], item["parameters"]) for item in offline
    ]
    assert all(c.function.name == "get_weather" and set(json.loads(c.function.arguments)) == {"city", "days"}
               for c in required)  # fmt: skip
    content, calls, finish = _streamed_tool_calls(
        router.client.chat.completions.create(
            model=MODEL, messages=messages, tools=tools, tool_choice="required", max_tokens=80, stream=True, parallel_tool_calls=False,
            **sampling,
        )
    )  # fmt: skip
    assert finish == "tool_calls" and [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in required
    ]

    forced = 'Checking\\.<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{2,6}", "days": [1-5]\\}\\}</tool_call>'
    extra = {"guided_regex": forced}
    reply = router.client.chat.completions.create(
        model=MODEL, messages=messages, tools=tools, max_tokens=140, extra_body=extra, **sampling
    )
    text = _offline(llm, ids, 140, structured_outputs={"regex": forced}, **sampling).text
    args = json.loads(text[text.index("{") :].removesuffix("</tool_call>"))["arguments"]
    message = reply.choices[0].message
    assert message.content == "Checking." and reply.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []] == [
        ("get_weather", args)
    ]
    content, calls, finish = _streamed_tool_calls(
        router.client.chat.completions.create(
            model=MODEL,
            messages=messages,
            tools=tools,
            max_tokens=140,
            extra_body=extra,
            stream=True,
            **sampling,
        )
    )
    assert content == "Checking." and finish == "tool_calls"
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_weather", args)]


def test_reasoning_parser_splits_thinking_from_content_and_tool_calls(pd_workers, llm: LLM) -> None:  # noqa: F811
    """A router with --reasoning-parser qwen3: the <think> block goes to reasoning_content (whole and
    streamed alike), the rest is content, whose hermes tool call is still read; include_reasoning false
    drops it. The text is forced by a regex so that the random-weight model writes such a reply."""
    prefill, decode = pd_workers
    proc = ServiceProcess.start(
        "router", "--model", MODEL, "--http-port", "0", "--prefill-workers", prefill.address,
        "--decode-workers", decode.address, "--reasoning-parser", "qwen3",
    )  # fmt: skip
    try:
        client = Router(proc, Path("unused")).client
        messages = [{"role": "user", "content": "Think, then call."}]
        forced = '<think>[a-z ]{3,12}</think>\n\nSure<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{2,5}", "days": 1\\}\\}</tool_call>'
        ids = _chat_ids(llm, messages, [WEATHER_TOOL])
        text = _offline(llm, ids, 160, temperature=0.0, structured_outputs={"regex": forced}).text
        thought = text[len("<think>") : text.index("</think>")]
        args = json.loads(text[text.index("{") :].removesuffix("</tool_call>"))["arguments"]
        body = {
            "model": MODEL,
            "messages": messages,
            "tools": [WEATHER_TOOL],
            "max_tokens": 160,
            "temperature": 0.0,
        }
        extra = {"guided_regex": forced}
        message = client.chat.completions.create(**body, extra_body=extra).choices[0].message.model_dump()
        assert message["reasoning_content"] == thought and message["content"] == "Sure"
        assert [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
        ] == [("get_weather", args)]
        reasoning, content, calls = "", "", []
        for chunk in client.chat.completions.create(**body, extra_body=extra, stream=True):
            delta = chunk.choices[0].delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
            calls += delta.get("tool_calls") or []
        streamed: dict[int, dict[str, str]] = {}
        for c in calls:  # the call opens with its name, then its arguments grow delta by delta
            call = streamed.setdefault(c["index"], {"name": "", "arguments": ""})
            call["name"] += c["function"]["name"] or ""
            call["arguments"] += c["function"]["arguments"] or ""
        assert reasoning == thought and content == "Sure" and len(calls) > 1
        assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == [("get_weather", args)]
        hidden = client.chat.completions.create(**body, extra_body={**extra, "include_reasoning": False})
        assert "reasoning_content" not in hidden.choices[0].message.model_dump()
        assert hidden.choices[0].message.content == "Sure"
        deltas = [
            chunk.choices[0].delta.model_dump()
            for chunk in client.chat.completions.create(
                **body, extra_body={**extra, "include_reasoning": False}, stream=True
            )
        ]
        assert not any(d.get("reasoning_content") for d in deltas)
        assert "".join(d.get("content") or "" for d in deltas) == "Sure"
    finally:
        assert proc.stop() == 0, proc.log()


def test_bad_tool_requests_get_a_400(router: Router) -> None:
    messages = [{"role": "user", "content": "x"}]
    cases = [
        ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
         "not among the tools"),
        ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
         "constrains the output itself"),
        ({"tool_choice": "required"}, "tool_choice needs tools"),
    ]  # fmt: skip
    for body, message in cases:
        with pytest.raises(openai.BadRequestError) as err:
            router.client.chat.completions.create(
                model=MODEL, messages=messages, max_tokens=5, extra_body=body
            )
        assert message in err.value.message, err.value.message
    with pytest.raises(openai.BadRequestError, match="chat completions field"):
        router.client.completions.create(
            model=MODEL, prompt="x", max_tokens=5, extra_body={"tools": [WEATHER_TOOL]}
        )


def _metric(svc: ServiceProcess, name: str, labels: str = "") -> float:
    with urllib.request.urlopen(f"http://{svc.metrics_address}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{name}{re.escape(labels)} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_structured_outputs_are_counted_on_the_workers(router: Router, pd_workers) -> None:  # noqa: F811
    """Each worker counts the constrained requests it takes, by kind, and times their compiles."""
    counted = [
        (svc, f"pdmesh_{role}_structured_output_requests_total", '{kind="choice"}')
        for svc, role in zip(pd_workers, ("prefill", "decode"), strict=True)
    ]
    before = [_metric(*c) for c in counted]
    compiles = _metric(pd_workers[0], "pdmesh_prefill_grammar_compile_time_seconds_count")
    router.client.completions.create(
        model=MODEL,
        prompt="Pick:",
        max_tokens=8,
        extra_body={"structured_outputs": {"choice": ["up", "down"]}},
    )
    assert [_metric(*c) for c in counted] == [b + 1 for b in before]
    assert _metric(pd_workers[0], "pdmesh_prefill_grammar_compile_time_seconds_count") == compiles + 1


def test_bad_structured_outputs_get_a_400_and_hold_nothing(router: Router, pd_workers) -> None:  # noqa: F811
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
         "nope"),  # compiled by the worker: its INVALID_ARGUMENT
        ({"guided_regex": "a(b"}, "unclosed group"),
        ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "only one output constraint"),
        ({"response_format": {"type": "xml"}}, "json_schema"),
    ]  # fmt: skip
    for body, message in cases:
        for stream in (False, True):
            with pytest.raises(openai.BadRequestError) as err:
                reply = router.client.completions.create(
                    model=MODEL, prompt="x", max_tokens=5, stream=stream, extra_body=body
                )
                if stream:
                    list(reply)
            assert err.value.status_code == 400 and message in err.value.message, (body, err.value.message)
    wait_until(lambda: _running(pd_workers) == 0, timeout=10)


def test_n_choices_of_a_batch_of_prompts_equal_offline(router: Router, llm: LLM) -> None:
    """n choices of each of a batch of prompts, as vLLM numbers and seeds them: choice i * n + j is sample
    j of prompt i, seeded seed + j. Each equals the offline engine's output for that prompt and seed."""
    prompts = ["Fan out a prompt into", [70, 97, 110, 32, 111, 117, 116]]  # a text and token ids
    reply = router.client.completions.create(
        model=MODEL, prompt=prompts, n=3, max_tokens=12, extra_body={"ignore_eos": True}, **SEEDED
    )
    assert [c.index for c in reply.choices] == list(range(6))
    expected = [
        _offline(llm, p, 12, ignore_eos=True, **{**SEEDED, "seed": SEEDED["seed"] + j})
        for p in prompts
        for j in range(3)
    ]
    assert [c.text for c in reply.choices] == [e.text for e in expected]
    assert len({c.text for c in reply.choices[:3]}) > 1  # the samples differ: not one request three times
    assert all(c.finish_reason == "length" for c in reply.choices)
    prompt_tokens = len(expected[0].prompt_token_ids) + len(expected[3].prompt_token_ids)
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt_tokens, 6 * 12)
    # echo: each choice's text starts with its prompt (the token ids' decoded text).
    echoed = router.client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=5, temperature=0.0, echo=True, extra_body={"ignore_eos": True}
    )
    greedy = [_offline(llm, p, 5, temperature=0.0, ignore_eos=True).text for p in prompts]
    assert [c.text for c in echoed.choices] == [prompts[0] + greedy[0], "Fan out" + greedy[1]]


def test_streamed_chat_with_n_choices_equals_offline(router: Router, llm: LLM) -> None:
    messages = [{"role": "user", "content": "Give me two answers."}]
    stream = router.client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=10, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}, **SEEDED,
    )  # fmt: skip
    chunks = list(stream)
    assert [c.choices[0].delta.role for c in chunks[:2]] == ["assistant", "assistant"]
    assert sorted(c.choices[0].index for c in chunks[:2]) == [0, 1]
    assert all(len(c.choices) == 1 for c in chunks[:-1])  # one choice an event, as vLLM streams
    text = {0: "", 1: ""}
    finish: dict[int, str] = {}
    for c in chunks[:-1]:
        choice = c.choices[0]
        text[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    prompt_ids = llm.tokenizer.encode(render_chat(llm.tokenizer, messages), add_special_tokens=False)
    expected = [
        _offline(llm, prompt_ids, 10, ignore_eos=True, **{**SEEDED, "seed": SEEDED["seed"] + j})
        for j in range(2)
    ]
    assert [text[0], text[1]] == [e.text for e in expected] and finish == {0: "length", 1: "length"}
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (len(prompt_ids), 20)


@pytest.mark.parametrize("n", [1, 3])
def test_client_disconnect_leaves_no_block_held(router: Router, pd_workers, n: int) -> None:  # noqa: F811
    async def free_blocks() -> list[int]:
        out = []
        for svc in pd_workers:
            async with grpc.aio.insecure_channel(svc.address) as channel:
                stats = await worker_pb2_grpc.WorkerStub(channel).GetStats(
                    worker_pb2.StatsRequest(), timeout=5
                )
                out.append(stats.num_kv_blocks_free)  # cached but unused blocks count as free
        return out

    stream = router.client.completions.create(
        model=MODEL, prompt="A long answer " * 20, max_tokens=3000, temperature=0.0, stream=True, n=n,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    for i, _chunk in enumerate(stream):
        if i == 3:
            break
    assert asyncio.run(free_blocks())[1] < KV_BLOCKS  # the decode worker holds the request's blocks
    stream.close()
    assert wait_until(lambda: asyncio.run(free_blocks()) == [KV_BLOCKS, KV_BLOCKS], timeout=15)
    assert wait_until(lambda: _running(pd_workers) == 0, timeout=5)


def _running(workers: Any) -> int:
    async def run() -> int:
        total = 0
        for svc in workers:
            async with grpc.aio.insecure_channel(svc.address) as channel:
                stats = await worker_pb2_grpc.WorkerStub(channel).GetStats(
                    worker_pb2.StatsRequest(), timeout=5
                )
                total += stats.num_running + stats.num_waiting
        return total

    return asyncio.run(run())


def test_metrics_and_one_trace_per_request(router: Router) -> None:
    router.client.completions.create(model=MODEL, prompt="traced", max_tokens=4, temperature=0.0)
    with urllib.request.urlopen(f"http://{router.http}/health", timeout=10) as resp:
        health = json.loads(resp.read())
    assert resp.status == 200 and health["status"] == "ok"
    assert {w["health"] for w in health["workers"].values()} == {"up"}
    with urllib.request.urlopen(f"http://{router.http}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    ttft = re.search(r"^pdmesh_router_ttft_seconds_count (\S+)$", text, re.M)
    assert ttft is not None and float(ttft.group(1)) >= 1
    assert re.search(r'^pdmesh_router_requests_total\{endpoint="completions",status="ok"\} ', text, re.M)
    deadline = time.monotonic() + 5
    while True:
        spans = read_spans_jsonl(router.trace_file)
        by_trace: dict[str, set[str]] = {}
        for s in spans:
            by_trace.setdefault(s["trace_id"], set()).add(s["name"])
        if any({"generate", "route", "prefill", "decode"} <= names for names in by_trace.values()):
            break
        assert time.monotonic() < deadline, by_trace
        time.sleep(0.1)


def test_concurrent_requests_equal_offline(router: Router, llm: LLM) -> None:
    prompts = [f"Request number {i} asks for" + " more" * i for i in range(8)]
    samplings = [GREEDY if i % 2 else {**SEEDED, "seed": 100 + i} for i in range(8)]

    async def run() -> list[str]:
        client = openai.AsyncOpenAI(base_url=f"http://{router.http}/v1", api_key="unused", max_retries=0)
        async with client:
            replies = await asyncio.gather(*[
                client.completions.create(model=MODEL, prompt=p, max_tokens=12, extra_body={"ignore_eos": True}, **s)
                for p, s in zip(prompts, samplings, strict=True)
            ])  # fmt: skip
        return [r.choices[0].text for r in replies]

    expected = [
        _offline(llm, p, 12, ignore_eos=True, **s).text for p, s in zip(prompts, samplings, strict=True)
    ]
    assert asyncio.run(run()) == expected


@contextlib.contextmanager
def _doomed_decode_worker(pd_workers, tmp_path: Path) -> Iterator[tuple[Router, ServiceProcess]]:  # noqa: F811
    """A router over the fixture's workers and one more decode worker, for the test to kill; round robin
    between the two decode workers."""
    prefill, decode = pd_workers
    doomed = ServiceProcess.start("decode_svc", *worker_args())
    proc = ServiceProcess.start(
        "router", "--model", MODEL, "--http-port", "0", "--prefill-workers", prefill.address,
        "--decode-workers", decode.address, doomed.address, "--stats-interval-s", "60",
        "--routing", "round_robin",
    )  # fmt: skip
    try:
        yield Router(proc, tmp_path / "unused.jsonl"), doomed
        assert proc.alive
    finally:
        doomed.kill()
        assert proc.stop() == 0, proc.log()


def test_a_choice_failing_mid_stream_cancels_the_others(pd_workers, tmp_path: Path) -> None:  # noqa: F811
    """n=2 over two decode workers in round robin: one choice each. Killing one worker mid-stream ends the
    streamed reply with an error event, and the other choice is cancelled on its worker: nothing left
    running, every block free."""
    prefill, decode = pd_workers
    with _doomed_decode_worker(pd_workers, tmp_path) as (router, doomed):
        # 4000 tokens: the surviving choice, left running, would take many times the 5 s allowed below.
        body = {"model": MODEL, "prompt": "Two choices, one doomed", "n": 2, "max_tokens": 4000,
                "temperature": 0.0, "ignore_eos": True, "stream": True}  # fmt: skip
        request = urllib.request.Request(
            f"http://{router.http}/v1/completions", data=json.dumps(body).encode(), method="POST",
            headers={"Content-Type": "application/json"},
        )  # fmt: skip

        def stream(request: urllib.request.Request) -> list[dict[str, Any]]:
            """The reply's events; once both choices stream from their decode workers, kills `doomed` if it
            runs one of them, else returns at once (the client leaves). A choice's first token comes from the
            prefill worker, before its decode worker has taken it: only its second shows where it runs."""
            events: list[dict[str, Any]] = []
            with urllib.request.urlopen(request, timeout=60) as resp:
                for raw in resp:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(json.loads(line[len("data: ") :]))
                    per_choice = Counter(e["choices"][0]["index"] for e in events if e.get("choices"))
                    if min(per_choice[0], per_choice[1]) >= 2 and doomed.alive:
                        if _running([doomed]) != 1:
                            return []  # both on the survivor: leave, and try again
                        doomed.kill()
            return events

        for _attempt in range(4):
            events = stream(request)
            if events:
                break
        else:
            raise AssertionError("the two choices never ran on the two decode workers")
        assert "error" in events[-1], events[-1]
        assert not any(e["choices"][0]["finish_reason"] for e in events[:-1])  # neither choice finished
        assert wait_until(lambda: _running([decode, prefill]) == 0, timeout=5)  # cancelled, not finished


def test_a_decode_worker_killed_mid_stream_does_not_take_the_router_down(pd_workers, tmp_path: Path) -> None:  # noqa: F811
    with _doomed_decode_worker(pd_workers, tmp_path) as (router, doomed):
        doomed_id = re.search(r"worker_id=(\S+)", "\n".join(doomed.lines)).group(1)  # type: ignore[union-attr]
        params = common_pb2.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)

        async def stream_until_killed() -> grpc.StatusCode:
            async with grpc.aio.insecure_channel(router.grpc) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                for attempt in range(4):  # round robin: one of the first two lands on `doomed`
                    call = stub.Generate(
                        router_pb2.GenerateRequest(text=f"doomed {attempt}", sampling_params=params)
                    )
                    async for msg in call:
                        if msg.decode_worker:
                            break
                    if msg.decode_worker == doomed_id:
                        doomed.kill()
                        with pytest.raises(grpc.aio.AioRpcError) as err:
                            async for _ in call:
                                pass
                        return err.value.code()
                    call.cancel()
            raise AssertionError("no request landed on the doomed decode worker")

        code = asyncio.run(stream_until_killed())
        assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN)
        assert router.proc.alive
        for i in range(3):  # the dead worker is still "up" for the poller: the router retries elsewhere
            reply = router.client.completions.create(
                model=MODEL, prompt=f"after {i}", max_tokens=4, temperature=0.0
            )
            assert reply.choices[0].finish_reason in ("length", "stop")


def _response_events(stream: Any) -> tuple[list[str], str, list[tuple[str, str]], Any]:
    """A streamed response's event types, its output text deltas joined, its calls (name, arguments from
    the argument deltas) and its last event's response."""
    types, text, calls, last = [], "", [], None
    for event in stream:
        types.append(event.type)
        if event.type == "response.output_text.delta":
            text += event.delta
        elif event.type == "response.output_item.added" and event.item.type == "function_call":
            calls.append([event.item.name, event.item.arguments])
        elif event.type == "response.function_call_arguments.delta":
            calls[-1][1] += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            last = event.response
    assert [e for e in types if e.startswith("response.")] == types
    assert types[:2] == ["response.created", "response.in_progress"]
    return types, text, [tuple(c) for c in calls], last


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_responses_api_equals_chat_whole_and_streamed(
    router: Router, llm: LLM, sampling: dict[str, Any]
) -> None:
    """POST /v1/responses runs the chat pipeline: instructions + input give the chat's text and usage;
    max_output_tokens cuts it (status incomplete); the stream's deltas make the whole response's text."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    chat = router.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=20, extra_body={"ignore_eos": True}, **sampling
    )
    extra = {
        "ignore_eos": True,
        **({"seed": sampling["seed"]} if "seed" in sampling else {}),
    }  # a vLLM extra here
    plain = {k: v for k, v in sampling.items() if k != "seed"}
    args = dict(model=MODEL, instructions="Be brief.", input="Name a colour.", max_output_tokens=20,
                extra_body=extra, **plain)  # fmt: skip
    whole = router.client.responses.create(**args)
    assert whole.id.startswith("resp_") and whole.object == "response" and whole.model == MODEL
    assert whole.output_text == chat.choices[0].message.content
    assert whole.status == "incomplete" and whole.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in whole.output] == ["message"] and whole.output[0].status == "incomplete"
    assert whole.usage.input_tokens == chat.usage.prompt_tokens and whole.usage.output_tokens == 20
    assert whole.instructions == "Be brief." and whole.max_output_tokens == 20 and whole.store is True
    types, text, calls, last = _response_events(router.client.responses.create(**args, stream=True))
    assert text == whole.output_text and not calls and types[-1] == "response.incomplete"
    assert last.output[0].content[0].text == whole.output_text and last.usage.output_tokens == 20
    assert types.index("response.output_item.added") < types.index("response.output_text.delta")
    assert types[-4:-1] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]


def test_responses_api_tools_and_conversation_items(router: Router, llm: LLM) -> None:
    """Function tools (flat, the Responses shape) become chat tools; a hermes call in the text is a
    function_call item, whole and streamed; a conversation's function_call and function_call_output items
    become the chat's assistant tool calls and tool message (the same prompt as chat's)."""
    tool = {"type": "function", **WEATHER_TOOL["function"]}
    forced = 'Checking\\.<tool_call>\\{"name": "get_weather", "arguments": \\{"city": "[a-z]{2,6}", "days": [1-5]\\}\\}</tool_call>'
    args = dict(model=MODEL, input="Weather in Oslo?", tools=[tool], max_output_tokens=140, temperature=0.0,
                extra_body={"structured_outputs": {"regex": forced}})  # fmt: skip
    whole = router.client.responses.create(**args)
    assert [item.type for item in whole.output] == [
        "message",
        "function_call",
    ] and whole.status == "completed"
    message, call = whole.output
    assert message.content[0].text == "Checking." and call.name == "get_weather"
    assert call.call_id.startswith("chatcmpl-tool-") and call.id.startswith("fc_")
    assert set(json.loads(call.arguments)) == {"city", "days"}
    types, text, calls, last = _response_events(router.client.responses.create(**args, stream=True))
    assert text == "Checking." and calls == [("get_weather", call.arguments)]
    assert "response.function_call_arguments.done" in types and last.output[1].arguments == call.arguments
    conversation = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Oslo?"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "oslo", "days": 1}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]  # fmt: skip
    follow = router.client.responses.create(
        model=MODEL, input=conversation, tools=[tool], max_output_tokens=8, temperature=0.0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chat = router.client.chat.completions.create(
        model=MODEL, tools=[WEATHER_TOOL], max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True},
        messages=[
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "oslo", "days": 1}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ],
    )  # fmt: skip
    assert (
        follow.usage.input_tokens == chat.usage.prompt_tokens
        and follow.output_text == chat.choices[0].message.content
    )


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "hi", "background": True, "store": False}, "background"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "tools"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input"),
        ({"input": []}, "input"),
        ({"input": "hi", "text": {"format": {"type": "yaml"}}}, "text.format"),
        ({"input": "hi", "tool_choice": {"type": "web_search"}}, "tool_choice"),
    ],
)  # fmt: skip
def test_responses_api_refuses_what_it_does_not_serve(
    router: Router, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(urllib.error.HTTPError) as err:
        _post(router, "/v1/responses", {"model": MODEL, **body})
    assert err.value.code == 400
    assert json.loads(err.value.read())["error"]["param"] == param


def test_api_keys_guard_the_openai_and_router_apis(pd_workers) -> None:  # noqa: F811
    """A router started with --api-key (two keys): /v1 requests and pdmesh.v1.Router calls need one of them
    as a Bearer token (401 in OpenAI's shape / UNAUTHENTICATED otherwise); probes, metrics, tokenize and
    gRPC health stay open; a request with a key is served."""
    prefill, decode = pd_workers
    proc = ServiceProcess.start(
        "router", "--model", MODEL, "--http-port", "0", "--prefill-workers", prefill.address,
        "--decode-workers", decode.address, "--api-key", "key-one", "key-two",
    )  # fmt: skip
    try:
        http = Router(proc, Path("unused")).http
        body = json.dumps({"model": MODEL, "prompt": "Hi", "max_tokens": 2}).encode()
        bare = urllib.request.Request(f"http://{http}/v1/completions", data=body)  # no Authorization header
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(bare, timeout=10)
        assert missing.value.code == 401 and missing.value.headers["WWW-Authenticate"] == "Bearer"
        assert json.loads(missing.value.read())["error"]["type"] == "authentication_error"
        for key in ("wrong", "key-one-and-more", "key-on"):
            client = openai.OpenAI(base_url=f"http://{http}/v1", api_key=key, max_retries=0)
            with pytest.raises(openai.AuthenticationError) as refused:
                client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
            assert refused.value.status_code == 401 and refused.value.body["code"] == "invalid_api_key"
            with pytest.raises(openai.AuthenticationError):
                client.models.list()
        for key in ("key-one", "key-two"):
            client = openai.OpenAI(base_url=f"http://{http}/v1", api_key=key, max_retries=0)
            reply = client.completions.create(model=MODEL, prompt="Hi", max_tokens=3, temperature=0.0)
            assert reply.usage is not None and reply.usage.completion_tokens == 3
            assert [m.id for m in client.models.list()] == [MODEL]
        for path, body in (
            ("/health", None),
            ("/metrics", None),
            ("/version", None),
            ("/ping", None),
            ("/tokenize", {"prompt": "Hi"}),
        ):
            data = json.dumps(body).encode() if body is not None else None
            with urllib.request.urlopen(
                urllib.request.Request(f"http://{http}{path}", data=data), timeout=10
            ) as r:
                assert r.status == 200, path
        invocation = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}  # the same API as /v1: a key too
        assert _http(f"http://{http}/invocations", "POST", {}, invocation)[0] == 401
        assert (
            _http(f"http://{http}/invocations", "POST", {"Authorization": "Bearer key-one"}, invocation)[0]
            == 200
        )
        for path, body in (
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/rerank", {"query": "q", "documents": ["d"]}),
        ):
            assert _http(f"http://{http}{path}", "POST", {}, body)[0] == 401, path  # they run the model too
            assert (
                _http(f"http://{http}{path}", "POST", {"Authorization": "Bearer key-one"}, body)[0] == 200
            ), path
        assert client.embeddings.create(model=MODEL, input="Hi").usage.prompt_tokens > 0
        for path in ("/classify", "/pooling"):
            assert _http(f"http://{http}{path}", "POST", {}, {"input": "Hi"})[0] == 401, path

        async def generate(metadata: tuple[tuple[str, str], ...]) -> str:
            params = common_pb2.SamplingParams(max_tokens=3, temperature=0.0)
            request = router_pb2.GenerateRequest(text="Hi", sampling_params=params, return_text=True)
            async with grpc.aio.insecure_channel(proc.address) as channel:
                stub = router_pb2_grpc.RouterStub(channel)
                return "".join([m.text async for m in stub.Generate(request, timeout=30, metadata=metadata)])

        for metadata in ((), (("authorization", "Bearer nope"),), (("authorization", "key-one"),)):
            with pytest.raises(grpc.aio.AioRpcError) as denied:
                asyncio.run(generate(metadata))
            assert (
                denied.value.code() == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in denied.value.details()
            )
        assert asyncio.run(generate((("authorization", "Bearer key-two"),)))

        async def health() -> int:
            from grpc_health.v1 import health_pb2, health_pb2_grpc

            async with grpc.aio.insecure_channel(proc.address) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=10
                )
                return reply.status

        assert asyncio.run(health()) == 1  # SERVING, without a key
    finally:
        assert proc.stop() == 0, proc.log()


def test_continue_final_message_goes_on_with_the_last_message(router: Router, llm: LLM) -> None:
    """vLLM's continue_final_message: the prompt ends with the assistant's partial message (no end of turn,
    no new turn) and the reply continues it, as the offline engine does from that text; /tokenize gives the
    same ids; with add_generation_prompt left true it is a 400."""
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    text = render_chat(llm.tokenizer, messages, False, continue_final_message=True)
    assert text.endswith("One, two,") and text != render_chat(llm.tokenizer, messages, False)
    ids = llm.tokenizer.encode(text, add_special_tokens=False)
    expected = _offline(llm, ids, 12, temperature=0.0)
    extra = {"continue_final_message": True, "add_generation_prompt": False}
    reply = router.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0.0, extra_body=extra
    )
    assert reply.choices[0].message.content == expected.text and reply.usage.prompt_tokens == len(ids)
    assert _post(router, "/tokenize", {"messages": messages, **extra})["tokens"] == ids
    with pytest.raises(openai.BadRequestError) as bad:  # add_generation_prompt is true unless set false
        router.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=4, extra_body={"continue_final_message": True}
        )
    assert bad.value.status_code == 400 and "cannot both be true" in bad.value.message


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(router: Router, llm: LLM) -> None:
    """vLLM's truncate_prompt_tokens: the prompt's last k tokens are the prompt (usage, echo and output as
    the offline engine's from them); -1 keeps as many as the context takes; 0 or more than max_model_len
    is a 400."""
    prompt = [(7 * i) % 250 + 3 for i in range(60)]
    expected = _offline(llm, prompt[-10:], 8, temperature=0.0, ignore_eos=True)
    extra = {"truncate_prompt_tokens": 10, "ignore_eos": True}
    reply = router.client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0, echo=True, extra_body=extra
    )
    echoed = llm.tokenizer.decode(prompt[-10:], skip_special_tokens=False)
    assert reply.choices[0].text == echoed + expected.text and reply.usage.prompt_tokens == 10
    text = "Tell me everything about disaggregated serving, from the router to the KV transfer."
    chat = router.client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=4, extra_body=extra
    )
    assert chat.usage.prompt_tokens == 10
    limit = router.client.models.list().data[0].model_extra["max_model_len"]
    long = (prompt * (limit // len(prompt) + 2))[: limit + 40]
    reply = router.client.completions.create(
        model=MODEL, prompt=long, max_tokens=1, extra_body={"truncate_prompt_tokens": -1}
    )
    assert reply.usage.prompt_tokens == limit - 1
    for value, message in ((0, "at least 1"), (limit + 1, "greater than max_model_len")):
        with pytest.raises(openai.BadRequestError) as bad:
            router.client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=1, extra_body={"truncate_prompt_tokens": value}
            )
        assert bad.value.status_code == 400 and message in bad.value.message


def _families(svc: ServiceProcess) -> dict[str, Any]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://{svc.metrics_address}/metrics", timeout=10) as resp:
        return {f.name: f for f in text_string_to_metric_families(resp.read().decode())}


def _value(families: dict[str, Any], family: str, sample: str, **labels: str) -> float:
    return sum(
        s.value for s in families[family].samples if s.name == sample and labels.items() <= s.labels.items()
    )


def test_workers_expose_vllms_metric_names_beside_their_own(router: Router, pd_workers) -> None:  # noqa: F811
    """vLLM's names (vllm:num_requests_waiting, vllm:kv_cache_usage_perc, ...) on each worker's /metrics,
    labelled model_name, each the same figure as its pdmesh twin, so that what reads vLLM reads pdmesh."""
    for i in range(3):
        router.client.completions.create(
            model=MODEL, prompt=f"Count the metrics {i}", max_tokens=6, temperature=0.0
        )
    for svc, role in zip(pd_workers, ("prefill", "decode"), strict=True):
        fam = _families(svc)
        ours = f"pdmesh_{role}_"
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"):
            (sample,) = fam[name].samples
            assert sample.labels == {"model_name": MODEL, "engine": "0"}
        assert _value(fam, "vllm:num_requests_running", "vllm:num_requests_running") == _value(
            fam, f"{ours}running_requests", f"{ours}running_requests"
        )
        used = _value(fam, f"{ours}kv_blocks_used_blocks", f"{ours}kv_blocks_used_blocks")
        free = _value(fam, f"{ours}kv_blocks_free_blocks", f"{ours}kv_blocks_free_blocks")
        assert _value(fam, "vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc") == pytest.approx(
            used / (used + free)
        )
        for vllm, twin in (
            ("prompt_tokens", "prompt_tokens_tokens"),
            ("generation_tokens", "generation_tokens_tokens"),
        ):
            value = _value(fam, f"vllm:{vllm}", f"vllm:{vllm}_total")
            assert value > 0 and value == _value(fam, f"{ours}{twin}", f"{ours}{twin}_total")
        hits = _value(fam, "vllm:prefix_cache_hits", "vllm:prefix_cache_hits_total")
        assert hits == _value(
            fam, f"{ours}prompt_tokens_cached_tokens", f"{ours}prompt_tokens_cached_tokens_total"
        )
        assert _value(fam, "vllm:prefix_cache_queries", "vllm:prefix_cache_queries_total") == _value(
            fam, "vllm:prompt_tokens", "vllm:prompt_tokens_total"
        )
        ttft = _value(fam, "vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count")
        assert ttft == _value(
            fam, f"{ours}time_to_first_token_seconds", f"{ours}time_to_first_token_seconds_count"
        )
        assert ttft > 0 or role == "decode"  # every prompt went through the prefill worker
        ended = sum(
            _value(fam, f"{ours}requests", f"{ours}requests_total", outcome=o)
            for o in (("handed_off", "finished") if role == "prefill" else ("stop", "length", "abort"))
        )
        assert _value(fam, "vllm:request_success", "vllm:request_success_total") == ended > 0
        assert (
            _value(fam, "vllm:e2e_request_latency_seconds", "vllm:e2e_request_latency_seconds_count") == ended
        )
        for name in ("vllm:request_prompt_tokens", "vllm:request_generation_tokens"):
            assert _value(fam, name, f"{name}_count") == ended and _value(fam, name, f"{name}_sum") > 0
        # The phases: the prefill worker prefills every request it ends; the decode worker decodes those
        # that go on past their first token (one that ends on it, imported, was never scheduled here).
        inference = _value(
            fam, "vllm:request_inference_time_seconds", "vllm:request_inference_time_seconds_count"
        )
        if role == "prefill":
            prefill = _value(
                fam, "vllm:request_prefill_time_seconds", "vllm:request_prefill_time_seconds_count"
            )
            assert prefill == inference == ended
        else:
            decode = _value(fam, "vllm:request_decode_time_seconds", "vllm:request_decode_time_seconds_count")
            assert 0 < decode <= ended and 0 < inference <= ended
        assert "vllm:num_preemptions" in fam
        (info,) = fam["vllm:cache_config_info"].samples
        assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == str(KV_BLOCKS)
    decode = _families(pd_workers[1])
    itl = _value(decode, "vllm:inter_token_latency_seconds", "vllm:inter_token_latency_seconds_count")
    assert itl > 0 and itl == _value(
        decode,
        "pdmesh_decode_time_per_output_token_seconds",
        "pdmesh_decode_time_per_output_token_seconds_count",
    )


def test_continuous_usage_stats_put_usage_so_far_in_every_chunk(router: Router) -> None:
    """vLLM's stream_options.continuous_usage_stats (with include_usage): every event carries its choice's
    usage so far, growing with the tokens, ending at the whole request's; without it, only the last one."""
    messages = [{"role": "user", "content": "Two answers, streamed."}]
    stream = router.client.chat.completions.create(
        model=MODEL, messages=messages, n=2, max_tokens=7, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
    )  # fmt: skip
    chunks = list(stream)
    *events, last = chunks
    assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 14
    prompt = last.usage.prompt_tokens
    counts: dict[int, list[int]] = {0: [], 1: []}
    for event in events:
        assert event.usage is not None and event.usage.prompt_tokens == prompt
        assert event.usage.total_tokens == prompt + event.usage.completion_tokens
        counts[event.choices[0].index].append(event.usage.completion_tokens)
    for seen in counts.values():
        assert seen[0] == 0 and seen == sorted(seen) and seen[-1] == 7  # the role event, then growing
    plain = router.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=3, stream=True, stream_options={"include_usage": True}
    )
    assert [c.usage is not None for c in plain][-2:] == [False, True]


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(router: Router, llm: LLM) -> None:
    """vLLM's return_tokens_as_token_ids: every token of the logprobs (sampled and alternatives, completions
    and chat) is written token_id:<id>; the logprobs, offsets and text are those of the same request
    without it."""
    prompt = "Name tokens by their ids"
    expected = _offline(llm, prompt, 6, temperature=0.0, logprobs=2)
    ids = expected.token_ids
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": 2}
    plain = router.client.completions.create(**args).choices[0]
    named = router.client.completions.create(**args, extra_body={"return_tokens_as_token_ids": True}).choices[
        0
    ]
    assert named.text == plain.text and named.logprobs.tokens == [f"token_id:{t}" for t in ids]
    # (the second request finds the prompt cached: its logprobs may differ in the last bits)
    assert named.logprobs.token_logprobs == pytest.approx(plain.logprobs.token_logprobs, abs=1e-4)
    assert named.logprobs.text_offset == plain.logprobs.text_offset
    for top in named.logprobs.top_logprobs:
        assert len(top) == 2 and all(re.fullmatch(r"token_id:\d+", k) for k in top)
    for n, p in zip(named.logprobs.top_logprobs, plain.logprobs.top_logprobs, strict=True):
        assert sorted(n.values()) == pytest.approx(sorted(p.values()), abs=1e-4)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": prompt}], "max_tokens": 4,
            "temperature": 0.0, "logprobs": True, "top_logprobs": 1}  # fmt: skip
    plain_chat = router.client.chat.completions.create(**chat).choices[0].logprobs.content
    named_chat = (
        router.client.chat.completions.create(**chat, extra_body={"return_tokens_as_token_ids": True})
        .choices[0]
        .logprobs.content
    )
    for p, n in zip(plain_chat, named_chat, strict=True):
        assert re.fullmatch(r"token_id:\d+", n.token) and n.bytes == p.bytes
        assert [n.logprob, *(a.logprob for a in n.top_logprobs)] == pytest.approx(
            [p.logprob, *(a.logprob for a in p.top_logprobs)], abs=1e-4
        )
        assert all(re.fullmatch(r"token_id:\d+", a.token) for a in n.top_logprobs)


def _http(
    url: str, method: str = "GET", headers: dict[str, str] | None = None, body: Any = None
) -> tuple[int, Any, bytes]:
    data = json.dumps(body).encode() if body is not None else None
    request = urllib.request.Request(url, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


def test_cors_lets_allowed_origins_call_the_api_from_a_browser(router: Router, pd_workers) -> None:  # noqa: F811
    """CORS as vLLM configures it: by default any origin gets Access-Control-Allow-Origin: *; a router with
    --allowed-origins answers its origins' preflights (before the API key check, which preflights never
    pass), names them on replies, streams included, and gives other origins nothing."""
    status, headers, _ = _http(f"http://{router.http}/v1/models", headers={"Origin": "https://any.example"})
    assert status == 200 and headers["Access-Control-Allow-Origin"] == "*"
    prefill, decode = pd_workers
    proc = ServiceProcess.start(
        "router", "--model", MODEL, "--http-port", "0", "--prefill-workers", prefill.address,
        "--decode-workers", decode.address, "--api-key", "k", "--allowed-origins", "https://app.example",
    )  # fmt: skip
    try:
        url = f"http://{Router(proc, Path('unused')).http}/v1/chat/completions"
        asks = {
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        status, headers, _ = _http(url, "OPTIONS", {"Origin": "https://app.example", **asks})
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert headers["Access-Control-Allow-Headers"] == "authorization, content-type"
        assert "POST" in headers["Access-Control-Allow-Methods"] and headers["Vary"] == "Origin"
        status, headers, _ = _http(url, "OPTIONS", {"Origin": "https://evil.example", **asks})
        assert status == 400 and "Access-Control-Allow-Origin" not in headers
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "stream": True,
        }
        auth = {"Authorization": "Bearer k", "Content-Type": "application/json"}
        status, headers, events = _http(url, "POST", {"Origin": "https://app.example", **auth}, body)
        assert status == 200 and headers["Access-Control-Allow-Origin"] == "https://app.example"
        assert headers["Content-Type"].startswith("text/event-stream") and events.endswith(
            b"data: [DONE]\n\n"
        )
        status, headers, _ = _http(url, "POST", {"Origin": "https://evil.example", **auth}, body)
        assert status == 200 and "Access-Control-Allow-Origin" not in headers  # the browser will refuse it
        status, headers, _ = _http(url, "POST", {"Origin": "https://app.example"}, body)  # no key
        assert status == 401 and headers["Access-Control-Allow-Origin"] == "https://app.example"
    finally:
        assert proc.stop() == 0, proc.log()


def test_priority_reaches_the_workers(router: Router) -> None:
    """vLLM's priority travels with the request to the workers: these schedule first-come-first-served, so
    any priority but 0 is refused with their message, a 400; 0 is served."""
    messages = [{"role": "user", "content": "Urgent?"}]
    reply = router.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"priority": 0}
    )
    assert reply.choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError) as bad:
        router.client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, extra_body={"priority": -3}
        )
    assert bad.value.status_code == 400 and "--scheduling-policy priority" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad:
        router.client.completions.create(
            model=MODEL, prompt="x", max_tokens=2, extra_body={"priority": 2**31}
        )
    assert "32-bit" in bad.value.message


def test_bad_words_reach_the_workers(router: Router, llm: LLM) -> None:
    """vLLM's bad_words: the workers ban them as the offline engine does (prefill worker's first token and
    decode worker's rest alike), streamed and whole; a blank word is a 400."""
    prompt = "Words to avoid in the mesh"
    free = _offline(llm, prompt, 16, temperature=0.0, ignore_eos=True)
    words = [llm.tokenizer.decode(free.token_ids[0:1]), llm.tokenizer.decode(free.token_ids[5:8])]
    expected = _offline(llm, prompt, 16, temperature=0.0, ignore_eos=True, bad_words=words)
    assert expected.token_ids != free.token_ids
    extra = {"bad_words": words, "ignore_eos": True}
    reply = router.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0,
                                             extra_body=extra)  # fmt: skip
    assert reply.choices[0].text == expected.text
    stream = router.client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0.0,
                                              extra_body=extra, stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in stream if c.choices) == expected.text
    with pytest.raises(openai.BadRequestError, match="bad_words"):
        router.client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=2, extra_body={"bad_words": [" "]}
        )


def test_responses_api_gives_logprobs_as_chat_does(router: Router) -> None:
    """include ["message.output_text.logprobs"] with top_logprobs: the output text's logprobs, each token
    with its alternatives, are the chat request's; streamed, each text delta carries its tokens' and they
    add up to the whole response's."""
    messages = [{"role": "user", "content": "Give logprobs."}]
    chat = router.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=12, temperature=0.0, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    expected = [
        (e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs])
        for e in chat.choices[0].logprobs.content
    ]
    args = dict(model=MODEL, input="Give logprobs.", max_output_tokens=12, temperature=0.0, top_logprobs=2,
                include=["message.output_text.logprobs"], extra_body={"ignore_eos": True})  # fmt: skip

    def entries(logprobs: list[Any]) -> list[tuple[str, float, list[tuple[str, float]]]]:
        return [(e.token, e.logprob, [(a.token, a.logprob) for a in e.top_logprobs]) for e in logprobs]

    whole = router.client.responses.create(**args)
    part = whole.output[0].content[0]
    assert part.text == chat.choices[0].message.content and whole.top_logprobs == 2
    got = entries(part.logprobs)
    assert [t for t, _, _ in got] == [t for t, _, _ in expected]
    assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in expected], abs=1e-4)
    assert [len(top) for _, _, top in got] == [2] * len(expected) == [len(top) for _, _, top in expected]
    streamed, done = [], None
    for event in router.client.responses.create(**args, stream=True):
        if event.type == "response.output_text.delta":
            streamed += entries(event.logprobs)
        elif event.type == "response.output_text.done":
            done = entries(event.logprobs)
    assert [t for t, _, _ in streamed] == [t for t, _, _ in got] == [t for t, _, _ in done]
    plain = router.client.responses.create(model=MODEL, input="Give logprobs.", max_output_tokens=4)
    assert plain.output[0].content[0].logprobs == []  # not asked for: none


def test_chat_template_flag_replaces_the_models_template(pd_workers, llm: LLM, tmp_path: Path) -> None:  # noqa: F811
    """--chat-template (a file, as vLLM's): chat requests and /tokenize render with it, and the reply is the
    offline engine's from that text."""
    template = "{% for m in messages %}[{{ m.role | upper }}] {{ m.content }}\n{% endfor %}[ASSISTANT] "
    path = tmp_path / "template.jinja"
    path.write_text(template)
    prefill, decode = pd_workers
    proc = ServiceProcess.start(
        "router", "--model", MODEL, "--http-port", "0", "--prefill-workers", prefill.address,
        "--decode-workers", decode.address, "--chat-template", str(path),
    )  # fmt: skip
    try:
        r = Router(proc, Path("unused"))
        messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hello?"}]
        ids = llm.tokenizer.encode(
            "[SYSTEM] Be terse.\n[USER] Hello?\n[ASSISTANT] ", add_special_tokens=False
        )
        assert _post(r, "/tokenize", {"messages": messages})["tokens"] == ids
        expected = _offline(llm, ids, 8, temperature=0.0, ignore_eos=True)
        reply = r.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0.0,
                                                 extra_body={"ignore_eos": True})  # fmt: skip
        assert reply.choices[0].message.content == expected.text and reply.usage.prompt_tokens == len(ids)
    finally:
        assert proc.stop() == 0, proc.log()


def test_sagemaker_ping_and_invocations(router: Router, llm: LLM) -> None:
    """/ping answers as /health (GET and POST); /invocations serves the API the body's shape names, with
    the same replies as the endpoint itself; a body of no known shape is a 400."""
    for method in ("GET", "POST"):
        status, _, body = _http(f"http://{router.http}/ping", method, body={} if method == "POST" else None)
        assert status == 200 and json.loads(body)["status"] == "ok"
    url = f"http://{router.http}/invocations"
    completion = {"model": MODEL, "prompt": "Invoke", "max_tokens": 6, "temperature": 0.0}
    status, _, body = _http(url, "POST", {"Content-Type": "application/json"}, completion)
    expected = _offline(llm, "Invoke", 6, temperature=0.0)
    assert status == 200 and json.loads(body)["choices"][0]["text"] == expected.text
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Invoke"}],
        "max_tokens": 4,
        "temperature": 0.0,
    }
    status, _, body = _http(url, "POST", {"Content-Type": "application/json"}, chat)
    direct = router.client.chat.completions.create(**chat)
    assert (
        status == 200
        and json.loads(body)["choices"][0]["message"]["content"] == direct.choices[0].message.content
    )
    status, _, body = _http(url, "POST", {"Content-Type": "application/json"}, {"model": MODEL, "input": "Invoke",
                                                                               "max_output_tokens": 3})  # fmt: skip
    assert status == 200 and json.loads(body)["object"] == "response"
    status, _, body = _http(url, "POST", {"Content-Type": "application/json"}, {"model": MODEL})
    assert status == 400 and "'messages'" in json.loads(body)["error"]["message"]


def test_a_model_served_under_several_names(pd_workers) -> None:  # noqa: F811
    """vLLM's --served-model-name with several names: each is accepted and listed, a reply names the one
    asked for (the first when none is), another name is a 404 naming them all."""
    prefill, decode = pd_workers
    proc = ServiceProcess.start(
        "router", "--model", MODEL, "--http-port", "0", "--prefill-workers", prefill.address,
        "--decode-workers", decode.address, "--served-model-name", "house-model", "alias",
    )  # fmt: skip
    try:
        client = Router(proc, Path("unused")).client
        assert [m.id for m in client.models.list()] == ["house-model", "alias"]
        assert client.models.retrieve("alias").id == "alias"
        for asked, named in (("alias", "alias"), ("house-model", "house-model")):
            reply = client.completions.create(model=asked, prompt="Hi", max_tokens=2)
            assert reply.model == named
            assert client.responses.create(model=asked, input="Hi", max_output_tokens=2).model == named
        with pytest.raises(openai.NotFoundError) as missing:
            client.completions.create(model=MODEL, prompt="Hi", max_tokens=2)
        assert "`house-model`, `alias`" in missing.value.message

        async def listed() -> list[str]:
            async with grpc.aio.insecure_channel(proc.address) as channel:
                reply = await router_pb2_grpc.RouterStub(channel).ListModels(router_pb2.ListModelsRequest())
                return [m.id for m in reply.models]

        assert asyncio.run(listed()) == ["house-model", "alias"]
    finally:
        assert proc.stop() == 0, proc.log()


def test_reset_prefix_cache_empties_every_workers_cache(router: Router) -> None:
    """POST /reset_prefix_cache (vLLM's, for the mesh): every worker evicts its unheld cached blocks, so the
    same prompt then finds nothing cached; it was cached before."""
    prompt = "A prompt long enough to fill a few blocks of KV cache. " * 3
    args = {"model": MODEL, "prompt": prompt, "max_tokens": 2}
    router.client.completions.create(**args)
    again = router.client.completions.create(**args)
    assert again.usage.prompt_tokens_details.cached_tokens >= 32
    status, _, body = _http(f"http://{router.http}/reset_prefix_cache", "POST")
    evicted = json.loads(body)["evicted_blocks"]
    assert status == 200 and len(evicted) == 2 and sum(evicted.values()) >= 2
    cold = router.client.completions.create(**args)
    assert cold.usage.prompt_tokens_details.cached_tokens == 0


def test_chat_echo_starts_the_reply_with_the_assistants_last_message(router: Router, llm: LLM) -> None:
    """vLLM's chat echo with continue_final_message: the reply's content is the partial assistant message,
    then what the model went on with; streamed, the message comes as an event of its own after the role.
    A last message of another role is not echoed."""
    messages = [{"role": "user", "content": "Count."}, {"role": "assistant", "content": "One, two,"}]
    extra = {"continue_final_message": True, "add_generation_prompt": False, "echo": True, "ignore_eos": True}
    text = render_chat(llm.tokenizer, messages, False, continue_final_message=True)
    expected = _offline(
        llm, llm.tokenizer.encode(text, add_special_tokens=False), 6, temperature=0.0, ignore_eos=True
    )
    reply = router.client.chat.completions.create(model=MODEL, messages=messages, max_tokens=6, temperature=0.0,
                                                  extra_body=extra)  # fmt: skip
    assert reply.choices[0].message.content == "One, two," + expected.text
    deltas = [c.choices[0].delta for c in router.client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=6, temperature=0.0, extra_body=extra, stream=True)]  # fmt: skip
    assert deltas[0].role == "assistant" and deltas[1].content == "One, two,"
    assert "".join(d.content or "" for d in deltas) == "One, two," + expected.text
    plain = router.client.chat.completions.create(model=MODEL, messages=messages[:1], max_tokens=3,
                                                  extra_body={"echo": True})  # fmt: skip
    assert not (plain.choices[0].message.content or "").startswith("Count.")


def test_responses_are_stored_retrieved_continued_and_deleted(router: Router) -> None:
    """OpenAI's store (on by default): a response can be retrieved, continued with previous_response_id (the
    stored conversation and the previous output come first, the previous instructions do not: the reply is
    the chat of that conversation's), streamed or not, and deleted; store false keeps nothing; an unknown
    id is a 404."""
    client = router.client
    greedy = {"temperature": 0.0, "max_output_tokens": 8, "extra_body": {"ignore_eos": True}}
    first = client.responses.create(model=MODEL, instructions="Be brief.", input="My name is Ada.", **greedy)
    assert first.store is True and client.responses.retrieve(first.id).output_text == first.output_text
    second = client.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, **greedy
    )
    history = [{"role": "user", "content": "My name is Ada."}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "What is my name?"}]  # fmt: skip
    chat = client.chat.completions.create(model=MODEL, messages=history, max_tokens=8, temperature=0.0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens and second.previous_response_id == first.id
    events = list(client.responses.create(model=MODEL, input="And again?", previous_response_id=second.id,
                                          stream=True, **greedy))  # fmt: skip
    third = events[-1].response
    assert (
        events[-1].type == "response.incomplete"
        and client.responses.retrieve(third.id).output_text == third.output_text
    )
    chat = client.chat.completions.create(
        model=MODEL, max_tokens=8, temperature=0.0, extra_body={"ignore_eos": True},
        messages=[*history, {"role": "assistant", "content": second.output_text}, {"role": "user", "content": "And again?"}],
    )  # fmt: skip
    assert third.output_text == chat.choices[0].message.content
    items = client.responses.input_items.list(second.id)  # newest first, as OpenAI lists them
    assert [i.type for i in items.data] == ["message"] and items.data[0].content[0].text == "What is my name?"
    assert items.first_id == items.last_id == items.data[0].id and not items.has_more
    status, _, body = _http(f"http://{router.http}/v1/responses/{first.id}", "DELETE")
    assert status == 200 and json.loads(body) == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError) as missing:
        client.responses.create(model=MODEL, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert "not found" in missing.value.message
    unstored = client.responses.create(model=MODEL, input="Forget me.", store=False, max_output_tokens=2)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


@needs_redis
def test_responses_stored_in_redis_are_shared_by_every_router(pd_workers) -> None:  # noqa: F811
    """With --redis-url, a response one router stored is retrieved and continued through another (routers
    scale out statelessly); the records expire with --responses-ttl-s."""
    import redis

    url = f"{REDIS_URL}/11"  # a database of this test's own, emptied of its keys at the end
    prefill, decode = pd_workers
    routers = [
        ServiceProcess.start(
            "router",
            "--model",
            MODEL,
            "--http-port",
            "0",
            "--prefill-workers",
            prefill.address,
            "--decode-workers",
            decode.address,
            "--redis-url",
            url,
            "--responses-ttl-s",
            "30",
        )  # fmt: skip
        for _ in range(2)
    ]
    client = redis.Redis.from_url(url)
    try:
        a, b = (Router(p, Path("unused")).client for p in routers)
        first = a.responses.create(
            model=MODEL, input="Stored in Redis.", max_output_tokens=4, temperature=0.0
        )
        assert b.responses.retrieve(first.id).output_text == first.output_text
        assert 0 < client.pttl(f"pdmesh:response:{first.id}") <= 30_000
        follow = b.responses.create(model=MODEL, input="Next.", previous_response_id=first.id, max_output_tokens=4,
                                    temperature=0.0)  # fmt: skip
        chat = b.chat.completions.create(model=MODEL, max_tokens=4, temperature=0.0, messages=[
            {"role": "user", "content": "Stored in Redis."}, {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "Next."}])  # fmt: skip
        assert follow.output_text == chat.choices[0].message.content
        assert a.responses.retrieve(follow.id).previous_response_id == first.id
    finally:
        for p in routers:
            assert p.stop() == 0, p.log()
        for key in client.scan_iter("pdmesh:*"):
            client.delete(key)
        client.close()


def test_embeddings_over_the_mesh_equal_offline(router: Router, llm: LLM, pd_workers) -> None:  # noqa: F811
    """``/v1/embeddings`` through the ``openai`` client (which asks for base64) and as plain floats, from text
    and from token ids, equals the offline engine's ``LLM.embed``; the prefill worker computed them."""
    from engine import PoolingParams

    texts = ["The mesh embeds this sentence.", "and this one, a little longer than the first"]
    want = [o.embedding for o in llm.embed(texts)]
    reply = router.client.embeddings.create(model=MODEL, input=texts)
    assert [d.index for d in reply.data] == [0, 1]
    for got, expected in zip((d.embedding for d in reply.data), want, strict=True):
        assert got == pytest.approx(expected, abs=1e-5)
    assert (
        reply.usage.prompt_tokens
        == sum(len(llm.tokenizer.encode(t)) for t in texts)
        == reply.usage.total_tokens
    )
    ids = llm.tokenizer.encode(texts[0])
    body = _post(router, "/v1/embeddings", {"model": MODEL, "input": ids, "encoding_format": "float", "pooling_type": "mean", "normalize": False})  # fmt: skip
    mean = llm.embed([ids], PoolingParams(pooling_type="mean", normalize=False))[0].embedding
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["data"][0]["embedding"] == pytest.approx(mean, abs=1e-5)
    prefill, _ = pd_workers
    deadline = time.monotonic() + 5
    while True:  # the router's spans say which worker computed them: the prefill worker
        workers = {
            s["attributes"].get("pdmesh.worker")
            for s in read_spans_jsonl(router.trace_file)
            if s["name"] == "embed"
        }
        if len(workers) == 1 and None not in workers:
            break
        assert time.monotonic() < deadline, workers
        time.sleep(0.1)
    assert workers == {prefill.address}
    with urllib.request.urlopen(f"http://{router.http}/metrics", timeout=10) as resp:
        assert re.search(
            r'^pdmesh_router_requests_total\{endpoint="embeddings",status="ok"\} ', resp.read().decode(), re.M
        )


def test_chat_embeddings_render_the_messages_with_the_chat_template(router: Router, llm: LLM) -> None:
    """vLLM's chat form of ``/v1/embeddings``: ``messages`` rendered with the chat template (no generation
    prompt unless asked, no special tokens added) and embedded as the offline engine embeds those ids."""
    messages = [{"role": "system", "content": "Embed this."}, {"role": "user", "content": "a chat turn"}]
    for add_generation_prompt in (False, True):
        body = {"model": MODEL, "messages": messages, "add_generation_prompt": add_generation_prompt}
        got = _post(router, "/v1/embeddings", body)
        ids = llm.tokenizer.encode(
            render_chat(llm.tokenizer, messages, add_generation_prompt), add_special_tokens=False
        )
        assert got["usage"]["prompt_tokens"] == len(ids)
        assert got["data"][0]["embedding"] == pytest.approx(llm.embed([ids])[0].embedding, abs=1e-5)


def test_bad_embedding_requests_get_a_400(router: Router) -> None:
    for body, words in (
        ({"model": MODEL}, "'input' (or 'messages') is required"),
        ({"model": MODEL, "messages": []}, "'messages' must be"),
        ({"model": MODEL, "input": ""}, "empty"),
        ({"model": MODEL, "input": [[1, 2], "x"]}, "'input' must be"),
        ({"model": MODEL, "input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"model": MODEL, "input": "x", "dimensions": 8}, "not a Matryoshka model"),
        ({"model": MODEL, "input": "x", "pooling_type": "max"}, "pooling_type"),
        ({"model": MODEL, "input": [10**6]}, "outside the vocabulary"),
    ):
        with pytest.raises(urllib.error.HTTPError) as err:
            _post(router, "/v1/embeddings", body)
        assert err.value.code == 400, body
        assert words in json.loads(err.value.read())["error"]["message"], body
    with pytest.raises(openai.NotFoundError):
        router.client.embeddings.create(model="no-such-model", input="x")
    pooled = _post(router, "/pooling", {"model": MODEL, "input": "x", "normalize": False})
    plain = router.client.embeddings.create(model=MODEL, input="x", extra_body={"normalize": False})
    assert pooled["data"][0]["object"] == "pooling"
    assert pooled["data"][0]["data"] == pytest.approx(plain.data[0].embedding, abs=1e-5)
    for path in ("/classify", "/v1/classify"):  # tiny-dense has no classification head
        with pytest.raises(urllib.error.HTTPError) as err:
            _post(router, path, {"model": MODEL, "input": "x"})
        assert (
            err.value.code == 400
            and "no classification head" in json.loads(err.value.read())["error"]["message"]
        )


def test_grpc_embed_equals_offline(router: Router, llm: LLM) -> None:
    """``pdmesh.v1.Router/Embed``, from text and from token ids, gives the offline engine's embedding and
    usage; a bad request is INVALID_ARGUMENT, an unknown model NOT_FOUND."""
    text = "embedded over gRPC"
    ids = llm.tokenizer.encode(text)

    async def run() -> tuple[
        router_pb2.EmbeddingResponse, router_pb2.EmbeddingResponse, list[grpc.StatusCode]
    ]:
        async with grpc.aio.insecure_channel(router.grpc) as channel:
            stub = router_pb2_grpc.RouterStub(channel)
            by_text = await stub.Embed(router_pb2.EmbeddingRequest(text=text, model=MODEL), timeout=30)
            by_ids = await stub.Embed(
                router_pb2.EmbeddingRequest(token_ids=common_pb2.TokenIds(ids=ids), pooling_type="cls"),
                timeout=30,
            )
            codes = []
            for bad in (
                router_pb2.EmbeddingRequest(model=MODEL),
                router_pb2.EmbeddingRequest(text="x", dimensions=3),
                router_pb2.EmbeddingRequest(text="x", model="no-such-model"),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    await stub.Embed(bad, timeout=30)
                codes.append(err.value.code())
            return by_text, by_ids, codes

    by_text, by_ids, codes = asyncio.run(run())
    from engine import PoolingParams

    assert list(by_text.embedding) == pytest.approx(llm.embed([text])[0].embedding, abs=1e-5)
    assert list(by_ids.embedding) == pytest.approx(
        llm.embed([ids], PoolingParams(pooling_type="cls"))[0].embedding, abs=1e-5
    )
    assert by_text.usage.prompt_tokens == len(ids) and by_text.usage.completion_tokens == 0
    assert codes == [
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.INVALID_ARGUMENT,
        grpc.StatusCode.NOT_FOUND,
    ]


def _cosine(a: list[float], b: list[float]) -> float:
    import math

    return sum(x * y for x, y in zip(a, b, strict=True)) / math.sqrt(
        sum(x * x for x in a) * sum(y * y for y in b)
    )


def test_score_and_rerank_rank_by_the_offline_embeddings(router: Router, llm: LLM) -> None:
    """vLLM's ``/score`` (one text against several, and pairwise) and ``/rerank`` give the cosine
    similarities of the offline engine's embeddings, ``/rerank`` best first and cut to ``top_n``."""
    query = "where do the experts live"
    docs = ["the experts live on the ranks", "bananas are yellow", "experts move between ranks"]
    vec = {t: e.embedding for t, e in zip([query, *docs], llm.embed([query, *docs]), strict=True)}
    want = [_cosine(vec[query], vec[d]) for d in docs]
    one_to_many = _post(router, "/score", {"model": MODEL, "text_1": query, "text_2": docs})
    assert [d["index"] for d in one_to_many["data"]] == [0, 1, 2]
    assert [d["score"] for d in one_to_many["data"]] == pytest.approx(want, abs=1e-5)
    pairwise = _post(router, "/v1/score", {"text_1": docs[:2], "text_2": docs[1:]})
    assert [d["score"] for d in pairwise["data"]] == pytest.approx(
        [_cosine(vec[docs[0]], vec[docs[1]]), _cosine(vec[docs[1]], vec[docs[2]])], abs=1e-5
    )
    assert one_to_many["usage"]["prompt_tokens"] == sum(len(llm.tokenizer.encode(t)) for t in [query, *docs])
    reranked = _post(router, "/v1/rerank", {"model": MODEL, "query": query, "documents": [docs[0], {"text": docs[1]}, docs[2]], "top_n": 2})  # fmt: skip
    order = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r["index"] for r in reranked["results"]] == order
    assert [r["relevance_score"] for r in reranked["results"]] == pytest.approx(
        [want[i] for i in order], abs=1e-5
    )
    assert reranked["results"][0]["document"]["text"] == docs[order[0]]
    for path, body, words in (
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "give one text_1"),
        ("/score", {"text_1": "a"}, "'text_2'"),
        ("/rerank", {"query": "q", "documents": []}, "'documents'"),
        ("/v2/rerank", {"documents": ["d"]}, "'query'"),
    ):
        with pytest.raises(urllib.error.HTTPError) as err:
            _post(router, path, body)
        assert err.value.code == 400 and words in json.loads(err.value.read())["error"]["message"], body
