"""The Decode RPC: KV import over the transfer agent (one handshake per peer), then token streaming."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from engine import SamplingParams
from mesh.grpc_server import StatusError, insecure_channel
from mesh.kv_layout import LayoutMismatchError
from mesh.kv_transfer import KVTransferError
from mesh.kv_transfer_proto import metadata_from_proto
from mesh.telemetry import get_tracer, inject_metadata
from mesh.worker_service import (
    FINISH_REASONS,
    WorkerServicerBase,
    logprobs_from_proto,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
)
from protos.pdmesh.v1 import common_pb2, worker_pb2, worker_pb2_grpc

log = logging.getLogger(__name__)


class DecodeServicer(WorkerServicerBase):
    role = common_pb2.WORKER_ROLE_DECODE

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._handshakes: dict[str, asyncio.Lock] = {}

    async def Decode(
        self,
        request: worker_pb2.DecodeRequest,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        rid = request.request_id
        with self.request_scope("Decode", rid, context) as span:
            try:
                self.check_admission()
                params = await self.sampling_params(request.sampling_params)
                prompt = list(request.prompt_token_ids)
                if request.HasField("kv_handle"):
                    stream = self._decode_imported(request, params, prompt)
                else:
                    stream = self._decode_local(
                        rid, params, prompt, request.cache_salt or None, request.lora_name or None
                    )
                async for resp in stream:
                    yield resp
            except Exception as exc:  # every failure leaves as a gRPC status
                await self.fail(context, span, exc)

    async def _decode_local(
        self,
        rid: str,
        params: SamplingParams,
        prompt: list[int],
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        started_ns = time.time_ns()
        # With a KV offload store, the prompt's prefix blocks it holds are loaded first.
        stream = self.generate(rid, prompt, params, cache_salt=cache_salt, lora_name=lora_name)
        async for resp in self._stream(rid, stream, first_emitted=False, started_ns=started_ns):
            yield resp

    async def _decode_imported(
        self, request: worker_pb2.DecodeRequest, params: SamplingParams, prompt: list[int]
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        rid = request.request_id
        handle = request.kv_handle
        started_ns = time.time_ns()
        if not request.HasField("first_token_id"):
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT, "a DecodeRequest with a kv_handle needs first_token_id"
            )
        if handle.layout_fingerprint != self.engine.layout.fingerprint:
            raise LayoutMismatchError(
                f"KV layout fingerprint mismatch: prefill worker {handle.worker_id} has {handle.layout_fingerprint}, "
                f"this decode worker has {self.engine.layout.fingerprint}; both must serve the same model, dtype, "
                "block size and KV shape"
            )
        n_blocks = -(-len(prompt) // self.engine.config.block_size)
        if len(handle.block_ids) != n_blocks:
            raise StatusError(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"kv_handle has {len(handle.block_ids)} blocks; a {len(prompt)}-token prompt needs {n_blocks}",
            )
        tracer = get_tracer("pdmesh.decode")
        with tracer.start_as_current_span(
            "kv_transfer", attributes={"pdmesh.blocks": n_blocks, "pdmesh.peer": handle.worker_id}
        ):
            peer = await self._ensure_peer(handle)
            salt, lora = request.cache_salt or None, request.lora_name or None
            local = await self.aengine.call(
                lambda: self.engine.reserve_import(rid, prompt, params, salt, lora_name=lora)
            )
            committed = False
            try:
                started = time.monotonic()
                xfer = self.transfer.start_read(peer, list(handle.block_ids), local, rid.encode())
                try:
                    deadline = started + self.settings.kv_transfer_timeout_s
                    while self.transfer.poll(xfer) != "DONE":
                        if time.monotonic() > deadline:
                            raise StatusError(
                                grpc.StatusCode.DEADLINE_EXCEEDED,
                                f"KV pull of {n_blocks} blocks from {handle.worker_id} timed out",
                            )
                        await asyncio.sleep(0.0002)
                finally:
                    self.transfer.release(xfer)
                self.metrics.kv_bytes.inc(xfer.nbytes)
                self.metrics.kv_transfer_time.observe(time.monotonic() - started)
                q = self.aengine.open_stream(rid)
                first_lp = (
                    logprobs_from_proto(request.first_token_logprobs)
                    if request.HasField("first_token_logprobs")
                    else None
                )
                await self.aengine.call(
                    lambda: self.engine.commit_import(
                        rid, request.first_token_id, first_lp, request.num_cached_tokens
                    )
                )
                committed = True
            finally:
                if not committed:
                    self.aengine.close_stream(rid)
                    await asyncio.shield(self.aengine.call(lambda: self.engine.cancel_import(rid)))
        finished = False
        try:
            outputs = self.aengine.stream_outputs(rid, q)
            async for resp in self._stream(rid, outputs, first_emitted=True, started_ns=started_ns):
                finished = resp.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
                yield resp
        finally:
            if not finished:  # cancelled before the stream even started: the request must not linger
                await asyncio.shield(self.aengine.abort(rid))

    async def _stream(
        self,
        rid: str,
        outputs: AsyncIterator,
        first_emitted: bool,
        started_ns: int,
    ) -> AsyncIterator[worker_pb2.DecodeResponse]:
        """The engine's outputs as DecodeResponses; ``started_ns``: when the Decode call came (the start of
        the request's end-to-end latency here, its KV pull included)."""
        last_ns = 0
        async for out in outputs:
            now = time.time_ns()
            tokens = list(out.new_token_ids)
            logprobs = list(out.new_logprobs)
            if first_emitted and out.finished and out.num_output_tokens == 1:
                tokens, logprobs = [], []  # finished on the imported first token: the caller has it already
            if not first_emitted and out.first_token_ns and last_ns == 0:
                self.metrics.first_token((out.first_token_ns - out.arrival_time_ns) / 1e9)
            elif last_ns and tokens:
                self.metrics.inter_token((now - last_ns) / 1e9 / len(tokens))
            last_ns = now
            resp = worker_pb2.DecodeResponse(
                request_id=rid,
                token_ids=tokens,
                logprobs=[logprobs_to_proto(lp) for lp in logprobs],
                prompt_logprobs=prompt_logprobs_to_proto(out.prompt_logprobs),
            )
            if out.finished:
                resp.finish_reason = FINISH_REASONS.get(out.finish_reason, common_pb2.FINISH_REASON_ERROR)
                resp.num_cached_tokens = out.num_cached_tokens
                resp.usage.CopyFrom(
                    common_pb2.Usage(
                        prompt_tokens=out.num_prompt_tokens,
                        completion_tokens=out.num_output_tokens,
                        cached_prompt_tokens=out.num_cached_tokens,
                    )
                )
                self.metrics.phases(out, now, prefilled_here=not first_emitted)
                self.metrics.finished(
                    out.finish_reason or "finished",
                    out.finish_reason,
                    (now - started_ns) / 1e9,
                    (out.num_prompt_tokens, out.num_output_tokens),
                )
            yield resp

    async def _ensure_peer(self, handle: common_pb2.KVHandle) -> str:
        """One handshake per prefill worker: fetch its transfer metadata over gRPC, compare fingerprints."""
        if self.transfer.has_peer(handle.agent_name):
            return handle.agent_name
        lock = self._handshakes.setdefault(handle.agent_name, asyncio.Lock())
        async with lock:
            if self.transfer.has_peer(handle.agent_name):
                return handle.agent_name
            async with insecure_channel(handle.worker_address) as channel:
                stub = worker_pb2_grpc.WorkerStub(channel)
                try:
                    meta = await stub.GetTransferMetadata(
                        common_pb2.TransferMetadataRequest(
                            requester_agent_name=self.transfer.agent_name,
                            layout_fingerprint=self.engine.layout.fingerprint,
                        ),
                        timeout=10.0,
                        metadata=inject_metadata(),
                    )
                except grpc.aio.AioRpcError as exc:
                    code = exc.code()
                    if code == grpc.StatusCode.FAILED_PRECONDITION:
                        raise LayoutMismatchError(exc.details()) from exc
                    raise StatusError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"KV handshake with prefill worker {handle.worker_id} at "
                        f"{handle.worker_address} failed: {code.name} {exc.details()}",
                    ) from exc
            try:
                return self.transfer.add_peer(metadata_from_proto(meta))
            except KVTransferError as exc:
                raise StatusError(grpc.StatusCode.UNAVAILABLE, f"KV transfer setup failed: {exc}") from exc
