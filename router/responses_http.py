"""The Responses API's HTTP side: a response's run once ``router.http_api`` has parsed it as a chat request
(streamed as Responses events, or the Response object whole; in the background when asked), and the stored
responses' endpoints (``GET``/``DELETE /v1/responses/{id}``, ``.../input_items``, ``.../cancel``, a
background response's events again with ``?stream=true``).

It owns the response store's and background runs' use over HTTP; it must not parse requests
(``router.responses``), run choices' generation itself (``router.choices``), keep records
(``router.response_store``) or drive background runs (``router.background_responses``). Routes are added
in one place, ``HttpApi.app``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from aiohttp import web
from redis.exceptions import RedisError

from router.background_responses import BackgroundResponses, BackgroundRun
from router.choices import ChoiceRequest, merged_chunks
from router.errors import InvalidRequestError, NotFoundError, NoWorkerAvailableError, RouterError
from router.http_replies import SSE_HEADERS, error_response, failed_mid_stream, sse
from router.metrics import RouterMetrics
from router.orchestrator import Orchestrator
from router.reply_writer import ReplyWriter
from router.response_store import ResponseStore, StoredResponse
from router.responses import ResponsesRequest, ResponseStream, parse_responses
from router.served_model import ServedModel

log = logging.getLogger("router.http_api")  # the logger these lines were always written under


class ResponsesHttp:
    def __init__(
        self,
        model: ServedModel,
        orchestrator: Orchestrator,
        metrics: RouterMetrics,
        response_store: ResponseStore | None,
    ) -> None:
        self.model = model
        self.orchestrator = orchestrator
        self.metrics = metrics
        self.response_store = response_store  # None: responses are not stored (nor continued)
        self.background = (  # "background": true responses, run on after their POST answered
            BackgroundResponses(response_store, orchestrator, metrics) if response_store is not None else None
        )

    async def close(self, app: web.Application) -> None:
        if self.background is not None:
            await self.background.close()

    # ---- a response's run ----------------------------------------------------------------------------
    async def parse(self, body: dict[str, Any]) -> ResponsesRequest:
        """The request, continued from its ``previous_response_id``'s stored conversation if it names one."""
        responses = parse_responses(body)
        if responses.previous_id is not None:
            responses.continue_from(await self._stored(responses.previous_id, "previous_response_id"))
        return responses

    async def respond(
        self,
        request: web.Request,
        body: dict[str, Any],
        responses: ResponsesRequest,
        choices: list[ChoiceRequest],
        writer: ReplyWriter,
        outcome: dict[str, str],
    ) -> web.StreamResponse:
        """The parsed request's choices run as a response: in the background if it asks, else at once."""
        for name in (
            "temperature",
            "top_p",
        ):  # what sampled, the checkpoint's default where not given
            if body.get(name) is None and name in self.model.default_sampling:
                responses.echo[name] = self.model.default_sampling[name]
        out = ResponseStream(writer.request_id, writer.model_name, responses.echo)
        if self.response_store is None:
            out.echo["store"] = False
        keep = responses.record if out.echo["store"] else None
        if responses.background:
            if self.background is None:
                raise InvalidRequestError(
                    "background responses need the response store, which this router runs "
                    "without (--no-store-responses)",
                    param="background",
                )
            out.status = "queued"
            run = BackgroundRun(out, responses.record, choices, writer)
            return await self._respond_in_background(request, run)
        return await self._respond(request, choices, writer, out, outcome, keep)

    # ---- stored responses ----------------------------------------------------------------------------
    async def _stored(self, response_id: str, param: str | None = None) -> StoredResponse:
        if self.response_store is None:
            raise NotFoundError(f"Response with id '{response_id}' not found: this router stores none", param)
        try:
            record = await self.response_store.get(response_id)
        except RedisError as exc:
            raise NoWorkerAvailableError(f"the response store is unavailable: {exc}") from None
        if record is None:
            raise NotFoundError(
                f"Response with id '{response_id}' not found (never stored, or expired)", param
            )
        return record

    async def _keep(self, record: StoredResponse) -> None:
        """Store a finished response; a store that fails loses only the record (logged and counted)."""
        assert self.response_store is not None
        try:
            await self.response_store.put(record)
        except RedisError as exc:
            self.metrics.response_store_errors.inc()
            log.warning("response %s not stored: %s", record.response["id"], exc)

    async def get_response(self, request: web.Request) -> web.StreamResponse:
        """OpenAI's ``responses.retrieve``: a stored Response object; with ``stream=true`` a background
        response's events, again (router.background_responses)."""
        try:
            record = await self._stored(request.match_info["response_id"])
            if request.query.get("stream", "").lower() == "true":
                assert self.background is not None  # a router without a store has no records
                events = self.background.events(record, request.query.get("starting_after"))
                response = web.StreamResponse(headers=SSE_HEADERS)
                await response.prepare(request)
                try:
                    async for event in events:
                        await response.write(f"event: {event.type}\ndata: {event.data}\n\n".encode())
                except RedisError as exc:  # the client sees its stream end early: it can resume
                    self.metrics.response_store_errors.inc()
                    log.warning("response %s: events not read: %s", record.response["id"], exc)
                await response.write_eof()
                return response
        except RouterError as exc:
            return error_response(exc)
        return web.json_response(record.response)

    async def response_input_items(self, request: web.Request) -> web.Response:
        """OpenAI's ``responses.input_items.list``: a stored response's input items, newest first unless
        ``order=asc``, ``limit`` (1-100, default 20) a page, after the item ``after``."""
        query = request.query
        try:
            record = await self._stored(request.match_info["response_id"])
            order = query.get("order", "desc")
            if order not in ("asc", "desc"):
                raise InvalidRequestError("order must be asc or desc", param="order")
            try:
                limit = int(query.get("limit", "20"))
            except ValueError:
                limit = 0
            if not 1 <= limit <= 100:
                raise InvalidRequestError("limit must be an integer from 1 to 100", param="limit")
        except RouterError as exc:
            return error_response(exc)
        items = record.input_items if order == "asc" else record.input_items[::-1]
        after = query.get("after")
        if after is not None:
            ids = [item["id"] for item in items]
            items = items[ids.index(after) + 1 :] if after in ids else []
        page = items[:limit]
        return web.json_response({
            "object": "list", "data": page, "has_more": len(items) > limit,
            "first_id": page[0]["id"] if page else None, "last_id": page[-1]["id"] if page else None,
        })  # fmt: skip

    async def cancel_response(self, request: web.Request) -> web.Response:
        """OpenAI's ``responses.cancel``: a background response that is queued or in progress stops
        (router.background_responses)."""
        try:
            record = await self._stored(request.match_info["response_id"])
            assert self.background is not None  # a router without a store has no records
            response = await self.background.cancel(record)
        except RedisError as exc:
            return error_response(NoWorkerAvailableError(f"the response store is unavailable: {exc}"))
        except RouterError as exc:
            return error_response(exc)
        return web.json_response(response)

    async def _respond_in_background(self, request: web.Request, run: BackgroundRun) -> web.StreamResponse:
        """A background response: its queued record stored and its run started; the queued Response
        object at once, or (``stream``) the run's events as they come, for as long as the client listens."""
        assert self.background is not None
        if run.writer.parsed.stream:
            run.listener = asyncio.Queue()
        try:
            # Shielded: a client gone while its record is written still gets the run it was stored for.
            queued = await asyncio.shield(self.background.start(run))
        except RedisError as exc:
            raise NoWorkerAvailableError(f"the response store is unavailable: {exc}") from None
        if run.listener is None:
            return web.json_response(queued)
        response = web.StreamResponse(headers=SSE_HEADERS)
        try:
            await response.prepare(request)
            while (event := await run.listener.get()) is not None:
                await response.write(sse(event, event["type"]))
        finally:
            run.listener = None  # a client gone: the run goes on without it
        await response.write_eof()
        return response

    async def delete_response(self, request: web.Request) -> web.Response:
        """OpenAI's ``responses.delete``: the record goes (a follow-up can no longer continue it)."""
        response_id = request.match_info["response_id"]
        try:
            await self._stored(response_id)
            assert self.response_store is not None
            await self.response_store.delete(response_id)
        except RedisError as exc:
            return error_response(NoWorkerAvailableError(f"the response store is unavailable: {exc}"))
        except RouterError as exc:
            return error_response(exc)
        return web.json_response({"id": response_id, "object": "response", "deleted": True})

    async def _respond(
        self,
        request: web.Request,
        choices: list[ChoiceRequest],
        writer: ReplyWriter,
        out: ResponseStream,
        outcome: dict[str, str],
        keep: Callable[[dict[str, Any]], StoredResponse] | None = None,
    ) -> web.StreamResponse:
        """A Responses API request: its chat events turned into output items (router.responses); streamed
        as Responses events, or the Response object whole. ``keep``: the record to store once it is done,
        stored before the client hears it is (a follow-up sent at once finds it)."""
        response: web.StreamResponse | None = None
        events: list[dict[str, Any]] = out.start()
        async with contextlib.aclosing(merged_chunks(self.orchestrator, choices)) as chunks:
            try:
                async for index, chunk in chunks:
                    for event in writer.add(index, chunk):
                        events += out.add(event)
                    if writer.parsed.stream:
                        if response is None:
                            response = web.StreamResponse(headers=SSE_HEADERS)
                            await response.prepare(request)
                        for event in events:
                            await response.write(sse(event, event["type"]))
                        events = []
                events += out.finish(writer.usage())
                if keep is not None:
                    await self._keep(keep(out.response()))
            except ConnectionResetError:
                raise
            except Exception as exc:
                if response is None:
                    raise  # nothing streamed yet: HttpApi._generate answers with a status code
                error = failed_mid_stream(exc, writer.request_id, outcome)
                event = {
                    "type": "error",
                    "code": error.openai_type,
                    "message": error.message,
                    "param": error.param,
                }
                await response.write(sse(event, "error"))
                await response.write_eof()
                return response
        if response is None:
            return web.json_response(out.response())
        for event in events:
            await response.write(sse(event, event["type"]))
        await response.write_eof()
        return response
