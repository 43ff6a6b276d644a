"""The router's public API without workers: request parsing and validation, the OpenAI error shape over
real HTTP, gRPC statuses, text assembly with stop strings, and the command line.

Routers here point at addresses where nothing listens, so every valid request ends in 503/UNAVAILABLE
and every invalid one in 400/INVALID_ARGUMENT before any worker is asked.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import threading
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import grpc
import pytest

from engine.tokenizer import ByteTokenizer, render_chat
from protos.pdmesh.v1 import common_pb2, router_pb2, router_pb2_grpc
from router.__main__ import parse_config
from router.config import RouterConfig
from router.errors import InvalidRequestError, ModelNotFoundError
from router.openai_protocol import parse_chat, parse_completion, parse_json_body
from router.served_model import INLINE_ENCODE_MAX_CHARS, SamplingInput, ServedModel
from router.service import RouterService
from router.text_stream import TextStream

NOWHERE = "127.0.0.1:1"  # nothing listens on port 1


# ---- parsing ----------------------------------------------------------------------------------------


def test_completion_request_fields_are_parsed() -> None:
    req = parse_completion(
        {
            "model": "tiny-dense",
            "prompt": "hi",
            "max_tokens": 7,
            "temperature": 0,
            "top_p": 0.5,
            "stop": "x",
            "seed": -3,
            "logprobs": 2,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
            "top_k": 5,
            "min_p": 0.1,
            "stop_token_ids": [7],
            "skip_special_tokens": False,
            "session_id": "s1",
            "user": "u",
        }
    )
    s = req.sampling
    assert (req.prompts, req.stream, req.include_usage, req.session_id, req.user) == (
        ["hi"],
        True,
        True,
        "s1",
        "u",
    )
    assert (s.max_tokens, s.temperature, s.top_p, s.stop, s.seed, s.logprobs) == (7, 0.0, 0.5, ["x"], -3, 2)
    assert (s.ignore_eos, s.top_k, s.min_p, s.stop_token_ids, s.skip_special_tokens) == (
        True,
        5,
        0.1,
        [7],
        False,
    )


def test_prompt_forms() -> None:
    assert parse_completion({"prompt": [1, 2, 3]}).prompts == [[1, 2, 3]]
    assert parse_completion({"prompt": ["one"]}).prompts == ["one"]
    assert parse_completion({"prompt": [[4, 5]]}).prompts == [[4, 5]]
    assert parse_completion({"prompt": ["a", [6], "b"], "n": 2}).prompts == ["a", [6], "b"]
    assert parse_completion({"prompt": []}).prompts == [[]]  # the length check names it empty
    with pytest.raises(InvalidRequestError, match="'prompt' is required") as err:
        parse_completion({})
    assert err.value.param == "prompt"
    with pytest.raises(InvalidRequestError, match="'prompt' must be"):
        parse_completion({"prompt": 5})
    with pytest.raises(InvalidRequestError, match=r"prompt\[1\] must be a string or an array of token ids"):
        parse_completion({"prompt": ["a", 5]})
    with pytest.raises(InvalidRequestError, match=r"prompt\[0\] must be"):
        parse_completion({"prompt": [["a"]]})
    with pytest.raises(InvalidRequestError, match="30 prompts x n=100 is 3000 choices; at most 2048"):
        parse_completion({"prompt": ["a"] * 30, "n": 100})
    with pytest.raises(InvalidRequestError, match="1024 prompts x n=3 is 3072 choices"):
        parse_completion({"prompt": ["a"] * 1024, "n": 3})


def test_logit_bias_is_parsed_and_checked(model: ServedModel) -> None:
    parsed = parse_completion({"prompt": "x", "logit_bias": {"5": 1.5, " 7": -100, "9": 0}})
    assert parsed.sampling.logit_bias == {5: 1.5, 7: -100.0, 9: 0.0}
    sent = model.sampling_params(parsed.sampling, 4)
    assert dict(sent.logit_bias) == {5: 1.5, 7: -100.0, 9: 0.0}
    assert not model.sampling_params(SamplingInput(), 4).logit_bias
    for body, message in [
        ({"logit_bias": [1]}, "'logit_bias' must be an object mapping token ids to numbers, got array"),
        ({"logit_bias": {"a": 1}}, "logit_bias keys must be token ids, got 'a'"),
        ({"logit_bias": {"5": "x"}}, r"logit_bias\['5'\] must be a finite number, got string"),
    ]:
        with pytest.raises(InvalidRequestError, match=message) as err:
            parse_completion({"prompt": "x", **body})
        assert err.value.param == "logit_bias"
    for bias, message in [
        ({5: 150.0}, r"logit_bias values must be in \[-100, 100\]"),
        ({-1: 1.0}, r"logit_bias token ids \[-1\] are outside the vocabulary"),
        ({600: 1.0}, r"logit_bias token ids \[600\] are outside the vocabulary"),
    ]:
        with pytest.raises(InvalidRequestError, match=message) as err:
            model.sampling_params(SamplingInput(logit_bias=bias), 4)
        assert err.value.param == "logit_bias"


def test_min_tokens_and_allowed_token_ids_are_parsed_and_checked(model: ServedModel) -> None:
    parsed = parse_completion({"prompt": "x", "min_tokens": 3, "allowed_token_ids": [5, 6]})
    assert (parsed.sampling.min_tokens, parsed.sampling.allowed_token_ids) == (3, [5, 6])
    sent = model.sampling_params(parsed.sampling, 4)
    assert (sent.min_tokens, list(sent.allowed_token_ids)) == (3, [5, 6])
    unset = model.sampling_params(SamplingInput(), 4)
    assert (unset.min_tokens, list(unset.allowed_token_ids)) == (0, [])
    with pytest.raises(
        InvalidRequestError, match=r"min_tokens must be between 0 and max_tokens \(4\), got 9"
    ) as err:
        model.sampling_params(SamplingInput(min_tokens=9), 4)
    assert err.value.param == "min_tokens"
    with pytest.raises(InvalidRequestError, match="allowed_token_ids must not be empty") as err:
        model.sampling_params(parse_completion({"prompt": "x", "allowed_token_ids": []}).sampling, 4)
    assert err.value.param == "allowed_token_ids"
    with pytest.raises(InvalidRequestError, match="'allowed_token_ids' must be an array of integers"):
        parse_completion({"prompt": "x", "allowed_token_ids": ["a"]})


def test_n_and_echo() -> None:
    assert parse_completion({"prompt": "x"}).n == 1
    assert parse_completion({"prompt": "x", "n": 128}).n == 128
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "n": 3}).n == 3
    assert parse_completion({"prompt": "x", "echo": True}).echo
    assert not parse_completion({"prompt": "x"}).echo
    assert parse_chat({"messages": [{"role": "user", "content": "x"}], "echo": True}).echo  # vLLM's chat echo


def test_echo_with_logprobs_asks_the_workers_for_prompt_logprobs() -> None:
    """The echoed prompt's logprobs come from the workers' prompt logprobs: as many alternatives as the
    larger of logprobs and an explicit prompt_logprobs; the reply's prompt_logprobs field only when asked."""
    echoed = parse_completion({"prompt": "x", "echo": True, "logprobs": 3})
    assert echoed.sampling.prompt_logprobs == 3 and echoed.prompt_logprobs is None
    both = parse_completion({"prompt": "x", "echo": True, "logprobs": 1, "prompt_logprobs": 4})
    assert both.sampling.prompt_logprobs == 4 and both.prompt_logprobs == 4
    assert parse_completion({"prompt": "x", "logprobs": 3}).sampling.prompt_logprobs is None
    assert parse_completion({"prompt": "x", "echo": True}).sampling.prompt_logprobs is None


def test_session_id_from_header() -> None:
    assert parse_completion({"prompt": "x"}, {"X-Session-ID": "abc"}).session_id == "abc"
    assert parse_completion({"prompt": "x", "session_id": "body"}, {"X-Session-ID": "h"}).session_id == "body"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"prompt": "x", "temperature": "hot"},
            "temperature",
            "'temperature' must be a finite number, got string",
        ),
        ({"prompt": "x", "max_tokens": 1.5}, "max_tokens", "'max_tokens' must be an integer"),
        ({"prompt": "x", "max_tokens": True}, "max_tokens", "'max_tokens' must be an integer, got boolean"),
        ({"prompt": "x", "stop": [1]}, "stop", "'stop' must be a string or an array of strings"),
        ({"prompt": "x", "stream": "yes"}, "stream", "'stream' must be a boolean"),
        ({"prompt": "x", "n": 0}, "n", "n must be between 1 and 128, got 0"),
        ({"prompt": "x", "n": 129}, "n", "n must be between 1 and 128, got 129"),
        ({"prompt": "x", "n": 1.5}, "n", "'n' must be an integer"),
        ({"prompt": "x", "best_of": 2}, "best_of", "best_of must be 1"),
        ({"prompt": "x", "logprobs": 21}, "logprobs", "logprobs must be between 0 and 20"),
        (
            {"prompt": "x", "stream_options": {"include_usage": True}},
            "stream_options",
            "only allowed when stream",
        ),
        (
            {"prompt": "x", "prompt_logprobs": 1, "stream": True},
            "prompt_logprobs",
            "prompt_logprobs is not available when stream is true",
        ),
        ({"prompt": "x", "prompt_logprobs": "2"}, "prompt_logprobs", "'prompt_logprobs' must be an integer"),
        ({"prompt": "x", "echo": "yes"}, "echo", "'echo' must be a boolean"),
    ],
)
def test_completion_type_errors_name_the_field(body: dict[str, Any], param: str, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message) as err:
        parse_completion(body)
    assert err.value.param == param


def test_chat_request_fields() -> None:
    req = parse_chat(
        {
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
            ],
            "max_completion_tokens": 9,
            "max_tokens": 3,
            "logprobs": True,
            "top_logprobs": 4,
        }
    )
    assert req.messages == [{"role": "user", "content": "a\nb"}]
    assert (req.sampling.max_tokens, req.sampling.logprobs, req.add_special_tokens) == (9, 4, False)
    assert (
        parse_chat({"messages": [{"role": "user", "content": "x"}], "logprobs": True}).sampling.logprobs == 0
    )
    assert parse_chat({"messages": [{"role": "user", "content": "x"}]}).sampling.logprobs is None


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        (None, "'messages' is required"),
        ([], "non-empty array"),
        (["hi"], r"messages\[0\] must be an object"),
        ([{"role": "wizard", "content": "x"}], r"messages\[0\].role must be one of"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], "only text parts"),
        ([{"role": "user", "content": 5}], "must be a string or an array of text parts"),
    ],
)
def test_chat_message_errors(messages: Any, message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        parse_chat({"messages": messages} if messages is not None else {})


def test_json_body_errors() -> None:
    with pytest.raises(InvalidRequestError, match="not valid JSON"):
        parse_json_body(b"{nope")
    with pytest.raises(InvalidRequestError, match="must be a JSON object, got array"):
        parse_json_body(b"[1]")


# ---- value checks (the engine's own rules) ----------------------------------------------------------


@pytest.fixture(scope="module")
def model() -> ServedModel:
    return ServedModel("tiny-dense", None, max_model_len=64)


def test_sampling_values_are_checked_with_the_engine_messages(model: ServedModel) -> None:
    with pytest.raises(InvalidRequestError, match=r"top_p must be in \(0, 1\], got 1.5") as err:
        model.sampling_params(SamplingInput(top_p=1.5), 4)
    assert err.value.param == "top_p"
    with pytest.raises(InvalidRequestError, match="temperature must be >= 0"):
        model.sampling_params(SamplingInput(temperature=-0.1), 4)
    with pytest.raises(InvalidRequestError, match=r"stop_token_ids \[600\] are outside the vocabulary"):
        model.sampling_params(SamplingInput(stop_token_ids=[600]), 4)
    with pytest.raises(InvalidRequestError, match=r"presence_penalty must be in \[-2, 2\], got 2.5") as err:
        model.sampling_params(SamplingInput(penalties={"presence_penalty": 2.5}), 4)
    assert err.value.param == "presence_penalty"
    with pytest.raises(InvalidRequestError, match="frequency_penalty must be in"):
        model.sampling_params(SamplingInput(penalties={"frequency_penalty": -3.0}), 4)
    with pytest.raises(InvalidRequestError, match="repetition_penalty must be a finite number > 0, got 0"):
        model.sampling_params(SamplingInput(penalties={"repetition_penalty": 0.0}), 4)
    # Neutral values are not sent; others are, as given.
    neutral = model.sampling_params(
        SamplingInput(penalties={"presence_penalty": 0.0, "repetition_penalty": 1.0}), 4
    )
    assert not any(
        neutral.HasField(n) for n in ("presence_penalty", "frequency_penalty", "repetition_penalty")
    )
    sent = model.sampling_params(
        SamplingInput(penalties={"frequency_penalty": 0.5, "repetition_penalty": 1.25}), 4
    )
    assert (sent.frequency_penalty, sent.repetition_penalty) == (0.5, 1.25) and not sent.HasField(
        "presence_penalty"
    )


def test_sampling_message_fields(model: ServedModel) -> None:
    p = model.sampling_params(SamplingInput(temperature=0.0, seed=-1, stop=["a"], logprobs=0, top_k=-1), 5)
    assert p.max_tokens == 5 and p.HasField("temperature") and p.temperature == 0.0
    assert p.seed == 2**64 - 1 and list(p.stop) == ["a"] and p.HasField("logprobs") and p.logprobs == 0
    assert p.top_k == 0
    unset = model.sampling_params(SamplingInput(), 5)
    assert not unset.HasField("seed") and not unset.HasField("logprobs") and unset.temperature == 1.0


def test_prompt_length_and_max_tokens(model: ServedModel) -> None:
    with pytest.raises(InvalidRequestError, match="prompt has 64 tokens, max_model_len is 64"):
        model.check_prompt(list(range(64)))
    with pytest.raises(InvalidRequestError, match="prompt is empty"):
        model.check_prompt([])
    with pytest.raises(InvalidRequestError, match=r"prompt token ids \[512\] are outside"):
        model.check_prompt([1, 512])
    assert model.resolve_max_tokens(None, 60, 16) == 4  # the default is clamped to the context
    assert model.resolve_max_tokens(None, 10, None) == 54  # chat: the rest of the context
    with pytest.raises(
        InvalidRequestError, match=r"maximum context length is 64 tokens.*70 tokens \(10 in the"
    ):
        model.resolve_max_tokens(60, 10, 16)


def test_unknown_model_is_not_found(model: ServedModel) -> None:
    model.check_model(None)
    model.check_model("tiny-dense")
    with pytest.raises(ModelNotFoundError, match="`gpt-4` does not exist"):
        model.check_model("gpt-4")


# ---- tokenization off the event loop ----------------------------------------------------------------


class GatedTokenizer:
    """The model's own tokenizer, whose ``encode`` first waits (up to 5 s) for ``gate``, which only a
    coroutine on the event loop opens: it returns at once if the loop runs while it encodes, and records
    whether it did. Deterministic: no timing, no sleep-based race."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.started = threading.Event()
        self.gate = threading.Event()
        self.loop_ran_meanwhile: list[bool] = []
        self.threads: list[str] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.current_thread().name)
        self.started.set()
        opened = self.gate.wait(timeout=5)
        self.gate.clear()
        self.loop_ran_meanwhile.append(opened)
        return self.inner.encode(text, add_special_tokens=add_special_tokens)

    async def open_gate_once_encoding(self) -> None:
        """What any other request would do meanwhile: run on the loop. One call per encode."""
        for _ in range(10_000):  # 10 s at most: a test that fails must not hang
            if self.started.is_set():
                break
            await asyncio.sleep(0.001)
        self.started.clear()
        self.gate.set()


def test_long_prompts_and_chats_are_tokenized_off_the_event_loop() -> None:
    async def run() -> None:
        model = ServedModel("tiny-dense", None, max_model_len=64)
        plain = ByteTokenizer()
        gated = GatedTokenizer(model.tokenizer)
        model.tokenizer = gated
        text = "y" * INLINE_ENCODE_MAX_CHARS
        ids, _ = await asyncio.gather(model.tokenize(text), gated.open_gate_once_encoding())
        assert ids == plain.encode(text)
        long_chat = [{"role": "user", "content": "x" * INLINE_ENCODE_MAX_CHARS}]
        ids, _ = await asyncio.gather(
            model.tokenize_chat(long_chat, True, False), gated.open_gate_once_encoding()
        )
        assert ids == plain.encode(render_chat(plain, long_chat, True), add_special_tokens=False)
        assert gated.loop_ran_meanwhile == [True, True]
        # A short text, or a short chat (rendered on the loop: ~11 us), costs less than the hop to a
        # thread: encoded on the loop's thread, same ids.
        gated.gate.set()
        assert await model.tokenize("hi") == plain.encode("hi")
        messages = [{"role": "user", "content": "hi"}]
        gated.gate.set()
        ids = await model.tokenize_chat(messages, True, False)
        assert ids == plain.encode(render_chat(plain, messages, True), add_special_tokens=False)
        on_loop = threading.current_thread().name
        assert [t.startswith("router-tokenize") for t in gated.threads] == [True, True, False, False]
        assert gated.threads[-2:] == [on_loop, on_loop]
        # A template error is still a 400 naming the messages, raised from the thread.
        with pytest.raises(InvalidRequestError, match="chat template rejected") as err:
            model.tokenizer = plain
            plain.chat_template = "{{ raise_exception('no system role') }}"
            await model.tokenize_chat(messages, True, False)
        assert err.value.param == "messages"
        model.close()

    asyncio.run(run())


def test_the_front_ends_tokenize_off_the_event_loop() -> None:
    """Over real HTTP and gRPC, in the router's own loop: the request's tokenization waits for a coroutine
    of that loop, so it completes only if tokenizing leaves the loop free; then the usual checks answer."""

    async def run() -> None:
        async with running_router() as svc, aiohttp.ClientSession() as session:
            gated = GatedTokenizer(svc.model.tokenizer)
            svc.model.tokenizer = gated
            base = f"http://127.0.0.1:{svc.http_port}"
            long_text = "z" * INLINE_ENCODE_MAX_CHARS
            cases = [  # past tokenization: a prompt or chat over max_model_len (400)
                ("/v1/completions", {"prompt": long_text, "max_tokens": 1}, 400, "prompt has 513 tokens"),
                (
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": long_text}]},
                    400,
                    "prompt has",
                ),
            ]
            for path, body, status, fragment in cases:
                (got_status, got), _ = await asyncio.gather(
                    _post(session, base + path, body), gated.open_gate_once_encoding()
                )
                assert got_status == status and fragment in got["error"]["message"], got
            async with grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}") as channel:
                stub = router_pb2_grpc.RouterStub(channel)

                async def generate() -> tuple[grpc.StatusCode, str]:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        async for _ in stub.Generate(router_pb2.GenerateRequest(text=long_text), timeout=10):
                            pass
                    return err.value.code(), err.value.details() or ""

                (code, details), _ = await asyncio.gather(generate(), gated.open_gate_once_encoding())
                assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt has 513 tokens" in details
            assert gated.loop_ran_meanwhile == [True, True, True]

    asyncio.run(run())


# ---- text assembly ----------------------------------------------------------------------------------


def _ids(text: str) -> list[int]:
    return list(text.encode())


def test_text_stream_cuts_at_stop_string_and_holds_back_its_prefix() -> None:
    ts = TextStream(ByteTokenizer(), stop=["STOP"])
    out = [ts.add(_ids(c)) for c in "abcST"]
    assert "".join(out) == "ab"  # "cST" may begin "STOP": the last len("STOP") - 1 characters wait
    assert ts.add(_ids("O")) == "c"
    assert ts.add(_ids("P")) == ""
    assert ts.stopped_on == "STOP"
    assert ts.add(_ids("zzz")) == "" and ts.finish() == "" and ts.text == "abc"


def test_text_stream_can_keep_the_stop_string() -> None:
    ts = TextStream(ByteTokenizer(), stop=["STOP"], include_stop=True)
    out = [ts.add(_ids(c)) for c in "abcSTOPzz"]
    assert "".join(out) + ts.finish() == ts.text == "abcSTOP" and ts.stopped_on == "STOP"


def test_text_stream_without_match_flushes_on_finish() -> None:
    ts = TextStream(ByteTokenizer(), stop=["xyz"])
    assert ts.add(_ids("hello x")) == "hello"
    assert ts.finish() == " x" and ts.stopped_on is None


def test_text_stream_first_stop_in_request_order_wins_like_the_engine() -> None:
    ts = TextStream(ByteTokenizer(), stop=["bc", "abc"])
    ts.add(_ids("xabc"))
    ts.finish()
    assert ts.text == "xa" and ts.stopped_on == "bc"


def test_text_stream_holds_half_utf8_characters() -> None:
    ts = TextStream(ByteTokenizer())
    snow = "é".encode()
    assert ts.add([snow[0]]) == ""
    assert ts.add([snow[1], ByteTokenizer.EOS]) == "é"


# ---- over real HTTP and gRPC, no workers ------------------------------------------------------------


@contextlib.asynccontextmanager
async def running_router(**overrides: Any) -> AsyncIterator[RouterService]:
    settings: dict[str, Any] = {
        "port": 0,
        "http_port": 0,
        "prefill_workers": [NOWHERE],
        "decode_workers": [NOWHERE],
        "control_timeout_s": 1.0,
        "max_model_len": 128,
    }
    settings.update(overrides)
    service = RouterService(RouterConfig(**settings))
    await service.start()
    try:
        yield service
    finally:
        await service.stop(grace_s=0)


async def _post(session: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, dict[str, Any]]:
    data = body if isinstance(body, (bytes, str)) else json.dumps(body)
    async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
        return resp.status, await resp.json()


def _assert_error_shape(body: dict[str, Any], status: int, kind: str) -> str:
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == status and err["type"] == kind and err["message"]
    return err["message"]


def test_http_errors_have_the_openai_shape() -> None:
    async def run() -> None:
        async with running_router() as svc, aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{svc.http_port}"
            cases: list[tuple[str, Any, int, str, str]] = [
                ("/v1/completions", b"{not json", 400, "BadRequestError", "not valid JSON"),
                ("/v1/completions", {"max_tokens": 3}, 400, "BadRequestError", "'prompt' is required"),
                ("/v1/completions", {"prompt": "x", "top_p": 0}, 400, "BadRequestError", "top_p must be in"),
                ("/v1/completions", {"prompt": "x" * 200}, 400, "BadRequestError", "prompt has 201 tokens"),
                (  # echo of token ids outside the vocabulary: the length and vocabulary check, not a decode error
                    "/v1/completions",
                    {"prompt": [[1, 999]], "echo": True},
                    400,
                    "BadRequestError",
                    "prompt token ids [999] are outside the vocabulary",
                ),
                (  # every prompt of a batch is checked before any is sent
                    "/v1/completions",
                    {"prompt": ["x", "x" * 200], "n": 2},
                    400,
                    "BadRequestError",
                    "prompt has 201 tokens",
                ),
                (
                    "/v1/completions",
                    {"prompt": "x", "max_tokens": 500},
                    400,
                    "BadRequestError",
                    "context length",
                ),
                (
                    "/v1/completions",
                    {"prompt": "x", "model": "other"},
                    404,
                    "NotFoundError",
                    "does not exist",
                ),
                ("/v1/chat/completions", {"messages": "hi"}, 400, "BadRequestError", "'messages' must be"),
                ("/v1/completions", {"prompt": "x"}, 503, "ServiceUnavailableError", "no decode worker"),
                (
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "x"}], "n": 3},
                    503,
                    "ServiceUnavailableError",
                    "no decode worker",
                ),
                (
                    "/v1/chat/completions",
                    {"messages": [{"role": "user", "content": "x"}], "stream": True},
                    503,
                    "ServiceUnavailableError",
                    "no decode worker",
                ),
            ]
            for path, body, status, kind, fragment in cases:
                got_status, got = await _post(session, base + path, body)
                assert got_status == status, (path, body, got)
                assert fragment in _assert_error_shape(got, status, kind)
            async with session.get(base + "/metrics") as resp:
                text = await resp.text()
            assert 'pdmesh_router_requests_total{endpoint="completions",status="invalid"} 7.0' in text
            assert 'pdmesh_router_requests_total{endpoint="completions",status="unavailable"} 1.0' in text

    asyncio.run(run())


def test_tokenize_and_detokenize_endpoints() -> None:
    """vLLM's /tokenize and /detokenize: the served tokenizer, the chat template, the OpenAI error shape."""

    async def run() -> None:
        async with running_router() as svc, aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{svc.http_port}"
            tokenizer = ByteTokenizer()
            status, got = await _post(
                session, base + "/tokenize", {"prompt": "héllo", "return_token_strs": True}
            )
            ids = tokenizer.encode("héllo", add_special_tokens=True)
            assert status == 200 and got["tokens"] == ids and got["count"] == len(ids)
            assert got["max_model_len"] == 128 and len(got["token_strs"]) == len(ids)
            messages = [{"role": "user", "content": "hi"}]
            status, chat = await _post(session, base + "/tokenize", {"messages": messages})
            rendered = tokenizer.encode(render_chat(tokenizer, messages), add_special_tokens=False)
            assert status == 200 and chat["tokens"] == rendered and chat["token_strs"] is None
            status, text = await _post(session, base + "/detokenize", {"tokens": ids})
            assert status == 200 and text["prompt"] == tokenizer.decode(ids, skip_special_tokens=False)
            for path, body, code, fragment in [
                ("/tokenize", {}, 400, "'prompt' (a string) or 'messages' is required"),
                ("/tokenize", {"prompt": "x", "model": "other"}, 404, "does not exist"),
                ("/tokenize", {"messages": "x"}, 400, "'messages' must be"),
                ("/detokenize", {"tokens": [1, 999]}, 400, "token ids [999] are outside the vocabulary"),
                ("/detokenize", {"tokens": "x"}, 400, "'tokens' must be an array of integers"),
                ("/detokenize", {}, 400, "'tokens' is required"),
            ]:
                status, err = await _post(session, base + path, body)
                assert status == code, (path, body, err)
                assert fragment in _assert_error_shape(err, code, err["error"]["type"])

    asyncio.run(run())


def test_models_and_health_endpoints() -> None:
    async def run() -> None:
        async with running_router(served_model_name="tiny") as svc, aiohttp.ClientSession() as session:
            base = f"http://127.0.0.1:{svc.http_port}"
            async with session.get(base + "/v1/models") as resp:
                models = await resp.json()
            assert models["object"] == "list"
            assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == 128
            async with session.get(base + "/v1/models/tiny") as resp:  # OpenAI's models.retrieve
                assert resp.status == 200 and await resp.json() == models["data"][0]
            async with session.get(base + "/v1/models/other") as resp:
                assert resp.status == 404 and "does not exist" in (await resp.json())["error"]["message"]
            async with session.get(base + "/version") as resp:
                assert (await resp.json())["version"] == importlib.metadata.version("pdmesh")
            async with session.get(base + "/health") as resp:
                assert resp.status == 503
                health = await resp.json()
            assert health["status"] == "unavailable" and health["workers"][NOWHERE]["health"] == "down"

    asyncio.run(run())


def test_grpc_generate_statuses() -> None:
    async def run() -> None:
        async with (
            running_router() as svc,
            grpc.aio.insecure_channel(f"127.0.0.1:{svc.grpc_port}") as channel,
        ):
            stub = router_pb2_grpc.RouterStub(channel)

            async def status_of(request: router_pb2.GenerateRequest) -> tuple[grpc.StatusCode, str]:
                with pytest.raises(grpc.aio.AioRpcError) as err:
                    async for _ in stub.Generate(request, timeout=10):
                        pass
                return err.value.code(), err.value.details() or ""

            bad = common_pb2.SamplingParams(top_p=2.0)
            code, details = await status_of(router_pb2.GenerateRequest(text="hi", sampling_params=bad))
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "top_p must be in (0, 1]" in details
            code, details = await status_of(router_pb2.GenerateRequest())
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "needs a prompt" in details
            code, _ = await status_of(router_pb2.GenerateRequest(text="hi", model="nope"))
            assert code == grpc.StatusCode.NOT_FOUND
            long_prompt = router_pb2.GenerateRequest(token_ids=common_pb2.TokenIds(ids=[1] * 128))
            code, details = await status_of(long_prompt)
            assert code == grpc.StatusCode.INVALID_ARGUMENT and "prompt has 128 tokens" in details
            code, _ = await status_of(router_pb2.GenerateRequest(text="hi"))
            assert code == grpc.StatusCode.UNAVAILABLE
            models = await stub.ListModels(router_pb2.ListModelsRequest())
            assert models.models[0].id == "tiny-dense" and models.models[0].num_decode_workers == 0

    asyncio.run(run())


def test_command_line_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDMESH_REQUEST_TIMEOUT_S", "30")
    cfg = parse_config(
        [
            "--model", "tiny-moe", "--port", "0", "--http-port", "0",
            "--prefill-workers", "a:1", "b:2", "--decode-workers", "c:3",
            "--routing", "round_robin", "--redis-url", "redis://x", "--trace-file", "/tmp/t.jsonl",
        ]
    )  # fmt: skip
    assert cfg.prefill_workers == ["a:1", "b:2"] and cfg.decode_workers == ["c:3"]
    assert cfg.model == "tiny-moe" and cfg.request_timeout_s == 30.0 and cfg.trace_file == "/tmp/t.jsonl"
    with pytest.raises(SystemExit):
        parse_config(["--routing", "telepathy"])


def test_chat_tools_constraints_and_template_kwargs_are_parsed() -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    body = {
        "messages": [{"role": "user", "content": "x"}],
        "tools": [tool],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
        "chat_template_kwargs": {"enable_thinking": False},
    }
    req = parse_chat(body)
    assert req.template_kwargs == {"enable_thinking": False, "tools": [tool]}
    assert req.tools is not None and req.tools.function == "f"
    assert req.sampling.structured_outputs == req.tools.constraint()  # the named function's schema
    plain = parse_chat({"messages": body["messages"], "response_format": {"type": "json_object"}})
    assert plain.sampling.structured_outputs is not None and plain.sampling.structured_outputs.json_object
    assert plain.tools is None and plain.template_kwargs == {}
    with pytest.raises(InvalidRequestError, match="may not set") as err:
        parse_chat({**body, "chat_template_kwargs": {"messages": []}})
    assert err.value.param == "chat_template_kwargs"
    with pytest.raises(InvalidRequestError, match="parser"):
        parse_chat({"messages": body["messages"], "tools": [tool]}, tool_call_parser="none")
    llama = parse_chat({"messages": body["messages"], "tools": [tool]}, tool_call_parser="llama3_json")
    assert llama.tools is not None and llama.tools.parser == "llama3_json" and llama.tools.choice == "auto"
    guided = parse_chat(
        {"messages": body["messages"], "guided_json": {"type": "object"}, "guided_whitespace_pattern": " ?"}
    )
    assert guided.sampling.structured_outputs is not None
    assert guided.sampling.structured_outputs.whitespace_pattern == " ?"
    with pytest.raises(InvalidRequestError, match="not both"):
        parse_chat({"messages": body["messages"],
                    "structured_outputs": {"json_object": True, "whitespace_pattern": "", "disable_any_whitespace": True}})  # fmt: skip


def test_chat_template_values_are_files_or_templates(tmp_path) -> None:
    """vLLM's --chat-template rule: a file is read, text with template marks is the template, a path that
    names nothing or a template that does not compile stops the router at start (a parser error)."""
    from router.chat_template import load_chat_template
    from router.config import RouterConfig

    path = tmp_path / "t.jinja"
    path.write_text("{{ messages[0].content }}")
    assert load_chat_template(str(path)) == "{{ messages[0].content }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}").startswith("{% for")
    for bad, message in (
        (str(tmp_path / "missing.jinja"), "neither a file"),
        ("{% if x %}", "does not compile"),
    ):
        with pytest.raises(ValueError, match=message):
            RouterConfig(chat_template=bad)


def test_no_enable_auto_tool_choice_refuses_auto_as_vllm_does() -> None:
    """vLLM's --enable-auto-tool-choice, turned off: tool_choice "auto" is a 400 whatever the parser; a
    named function still works up to the workers."""

    async def run() -> None:
        async with running_router(enable_auto_tool_choice=False) as svc, aiohttp.ClientSession() as session:
            tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
            body = {"messages": [{"role": "user", "content": "x"}], "tools": [tool], "max_tokens": 2}
            status, err = await _post(session, f"http://127.0.0.1:{svc.http_port}/v1/chat/completions", body)
            assert status == 400 and "--no-enable-auto-tool-choice" in err["error"]["message"]
            named = {**body, "tool_choice": {"type": "function", "function": {"name": "f"}}}
            status, _ = await _post(session, f"http://127.0.0.1:{svc.http_port}/v1/chat/completions", named)
            assert status == 503  # past the checks: no worker answers here

    asyncio.run(run())


def test_the_checkpoints_generation_config_sets_the_default_sampling(tmp_path) -> None:
    """vLLM's --generation-config auto: the checkpoint's recommended sampling (Qwen3 ships temperature 0.6,
    top_k 20, top_p 0.95) fills the fields a request leaves out; a request's own values win; vllm, or a
    file with do_sample false, leaves OpenAI's defaults."""
    import json as _json

    from router.served_model import SamplingInput
    from tests.checkpoints import make_checkpoint

    path = make_checkpoint("qwen3", tmp_path / "ckpt")
    recommended = {
        "do_sample": True,
        "temperature": 0.6,
        "top_k": 20,
        "top_p": 0.95,
        "repetition_penalty": 1.1,
    }
    (path / "generation_config.json").write_text(_json.dumps({**recommended, "eos_token_id": 2}))
    model = ServedModel(str(path), None, max_model_len=64)
    p = model.sampling_params(SamplingInput(), 8)
    assert (round(p.temperature, 6), p.top_k, round(p.top_p, 6), round(p.repetition_penalty, 6)) == (
        0.6,
        20,
        0.95,
        1.1,
    )
    own = model.sampling_params(
        SamplingInput(temperature=0.0, top_k=-1, penalties={"repetition_penalty": 1.0}), 8
    )
    assert (own.temperature, own.top_k, own.HasField("repetition_penalty")) == (0.0, 0, False)
    plain = ServedModel(str(path), None, max_model_len=64, generation_config="vllm").sampling_params(
        SamplingInput(), 8
    )
    assert (plain.temperature, plain.top_k, plain.top_p) == (1.0, 0, 1.0)
    (path / "generation_config.json").write_text(_json.dumps({**recommended, "do_sample": False}))
    greedy_file = ServedModel(str(path), None, max_model_len=64).sampling_params(SamplingInput(), 8)
    assert greedy_file.temperature == 1.0


def test_cors_with_credentials_names_the_origin() -> None:
    """--allow-credentials with any origin: browsers refuse '*' with credentials, so the origin itself is
    named, with Access-Control-Allow-Credentials, on preflights and replies; a method not allowed is a 400."""

    async def run() -> None:
        async with (
            running_router(allow_credentials=True, allowed_methods=["GET", "POST"]) as svc,
            aiohttp.ClientSession() as session,
        ):
            base = f"http://127.0.0.1:{svc.http_port}"
            origin = {"Origin": "https://ui.example"}
            async with session.options(
                base + "/v1/models", headers={**origin, "Access-Control-Request-Method": "GET"}
            ) as resp:
                assert (
                    resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "https://ui.example"
                )
                assert resp.headers["Access-Control-Allow-Credentials"] == "true"
                assert resp.headers["Access-Control-Allow-Methods"] == "GET, POST"
            async with session.options(
                base + "/v1/models", headers={**origin, "Access-Control-Request-Method": "DELETE"}
            ) as resp:
                assert resp.status == 400
            async with session.get(base + "/v1/models", headers=origin) as resp:
                assert (
                    resp.status == 200 and resp.headers["Access-Control-Allow-Origin"] == "https://ui.example"
                )
                assert (
                    resp.headers["Vary"] == "Origin"
                    and resp.headers["Access-Control-Allow-Credentials"] == "true"
                )
            async with session.get(base + "/v1/models") as resp:  # no Origin: not a cross-origin request
                assert "Access-Control-Allow-Origin" not in resp.headers

    asyncio.run(run())
