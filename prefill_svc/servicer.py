"""The Prefill RPC and the KV lease keeper of the prefill role."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from engine.llm_engine import PREFILL_DONE
from mesh.telemetry import get_tracer
from mesh.worker_service import (
    FINISH_REASONS,
    WorkerServicerBase,
    logprobs_to_proto,
    prompt_logprobs_to_proto,
)
from protos.pdmesh.v1 import common_pb2, worker_pb2

log = logging.getLogger(__name__)


@dataclass
class Lease:
    request_id: str
    deadline: float  # time.monotonic()
    num_blocks: int


class PrefillServicer(WorkerServicerBase):
    role = common_pb2.WORKER_ROLE_PREFILL

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.leases: dict[str, Lease] = {}

    async def Prefill(
        self,
        request: worker_pb2.PrefillRequest,
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.PrefillResponse:
        rid = request.request_id
        with self.request_scope("Prefill", rid, context) as span:
            try:
                self.check_admission()
                params = await self.sampling_params(request.sampling_params)
                out = None
                prompt_logprobs = None  # on the output with the first token
                async for item in self.generate(  # loads what the KV offload store holds first
                    rid,
                    list(request.prompt_token_ids),
                    params,
                    hold_kv=True,
                    cache_salt=request.cache_salt or None,
                    lora_name=request.lora_name or None,
                ):
                    out = item
                    prompt_logprobs = item.prompt_logprobs or prompt_logprobs
                if out is None or not out.finished:
                    raise RuntimeError(f"the engine's stream for {rid} ended without a finished output")
            except Exception as exc:  # every failure leaves as a gRPC status
                await self.fail(context, span, exc)
            _record_phases(out, self.worker_id)
            self.metrics.first_token((out.first_token_ns - out.arrival_time_ns) / 1e9)
            self.metrics.phases(out, out.first_token_ns, prefilled_here=True)  # a prefill ends at its token
            self.metrics.queued(max(0, out.first_scheduled_ns - out.arrival_time_ns) / 1e9)
            resp = worker_pb2.PrefillResponse(
                request_id=rid,
                first_token_id=out.new_token_ids[0],
                num_cached_tokens=out.num_cached_tokens,
                prompt_logprobs=prompt_logprobs_to_proto(prompt_logprobs),
            )
            if out.new_logprobs:
                resp.first_token_logprobs.CopyFrom(logprobs_to_proto(out.new_logprobs[0]))
            if out.finish_reason != PREFILL_DONE:
                # Finished on its first token (EOS, stop, max_tokens=1, abort): nothing to hand over.
                resp.finish_reason = FINISH_REASONS.get(out.finish_reason, common_pb2.FINISH_REASON_ERROR)
                self.metrics.finished(
                    "finished",
                    out.finish_reason,
                    _since(out.arrival_time_ns),
                    (len(request.prompt_token_ids), out.num_output_tokens),
                )
                return resp
            lease_s = self.settings.kv_lease_s
            # The lease exists before any await: if this call is cancelled now, expiry still frees the blocks.
            lease = self.leases[rid] = Lease(rid, time.monotonic() + lease_s, 0)
            blocks = await self.aengine.call(lambda: self.engine.held_blocks(rid))
            lease.num_blocks = len(blocks)
            resp.kv_handle.CopyFrom(
                common_pb2.KVHandle(
                    worker_id=self.worker_id,
                    worker_address=self.address,
                    agent_name=self.transfer.agent_name,
                    block_ids=blocks,
                    layout_fingerprint=self.engine.layout.fingerprint,
                    num_tokens=len(request.prompt_token_ids),
                    request_id=rid,
                    lease_deadline_unix_ms=int((time.time() + lease_s) * 1000),
                )
            )
            self.metrics.finished(
                "handed_off", "length", _since(out.arrival_time_ns), (len(request.prompt_token_ids), 1)
            )
            span.set_attribute("pdmesh.kv_blocks", len(blocks))
            return resp

    def transfer_progress(self) -> None:
        pass  # the lease keeper polls (fast while the KV offload store reads): the notifications are its own

    async def ReleaseKV(
        self,
        request: worker_pb2.ReleaseKVRequest,
        context: grpc.aio.ServicerContext,
    ) -> worker_pb2.ReleaseKVResponse:
        lease = self.leases.get(request.request_id)
        released = await self.release(request.request_id)
        return worker_pb2.ReleaseKVResponse(
            released=released, num_blocks_freed=lease.num_blocks if released and lease else 0
        )

    async def release(self, request_id: str) -> bool:
        self.leases.pop(request_id, None)
        return await self.aengine.call(lambda: self.engine.release_held(request_id))

    async def background(self) -> None:
        """Free held blocks when the reader's notification arrives or the lease ends."""
        while True:
            try:
                notifs = self.transfer.get_notifications()
                for _peer, messages in notifs.items():
                    for msg in messages:
                        await self.release(msg.decode())
                now = time.monotonic()
                expired = [rid for rid, lease in self.leases.items() if lease.deadline <= now]
                for rid in expired:
                    log.warning("KV lease of %s expired without a pull; freeing its blocks", rid)
                    self.metrics.kv_leases_expired.inc()
                    await self.release(rid)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("lease keeper iteration failed")
            busy = self.leases or (self.kv_offload is not None and self.kv_offload.num_puts_in_flight)
            await asyncio.sleep(0.002 if busy else 0.02)


def _record_phases(out, worker_id: str) -> None:
    """Spans for the queue and compute phases, from the engine's own timestamps."""
    tracer = get_tracer("pdmesh.prefill")
    if out.first_scheduled_ns:
        tracer.start_span(
            "prefill.queue", start_time=out.arrival_time_ns, attributes={"pdmesh.worker_id": worker_id}
        ).end(end_time=out.first_scheduled_ns)
        tracer.start_span(
            "prefill.compute",
            start_time=out.first_scheduled_ns,
            attributes={"pdmesh.worker_id": worker_id, "pdmesh.cached_tokens": out.num_cached_tokens},
        ).end(end_time=out.first_token_ns or time.time_ns())


def _since(arrival_time_ns: int) -> float | None:
    """Seconds from a request's arrival (wall clock, as the engine stamps it) to now."""
    return (time.time_ns() - arrival_time_ns) / 1e9 if arrival_time_ns else None
