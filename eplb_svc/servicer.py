"""The ``pdmesh.v1.EPLB`` servicer: load reports in, placements out, and the controller's metrics.

It validates what workers send (shapes, ranks, placements: ``INVALID_ARGUMENT`` saying what is wrong),
finds or makes the report's placement group (``placement_groups``), and streams placements to watchers.
Each group's rebalance (``rebalance_once``) runs from the service's loop, not from an RPC.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
from redis.exceptions import RedisError

from eplb_svc.config import EPLBSettings
from eplb_svc.placement_groups import Decision, GroupKey, Placement, PlacementGroup
from eplb_svc.placement_store import PlacementStore
from mesh.expert_placement import PlacementError, check_placement
from mesh.grpc_server import StatusError, abort_with
from mesh.telemetry import ServiceMetrics
from protos.pdmesh.v1 import eplb_pb2, eplb_pb2_grpc

log = logging.getLogger(__name__)


class EPLBMetrics:
    """``pdmesh_eplb_*``, each labelled with the group's name (``GroupKey.name``)."""

    def __init__(self) -> None:
        m = ServiceMetrics("eplb")
        self.registry = m.registry
        self.reports = m.counter(
            "reports", "total", "Load reports by outcome: accepted, or dropped (an older placement's).",
            ["group", "outcome"],
        )  # fmt: skip
        self.tokens = m.counter(
            "reported", "tokens", "Tokens routed to experts in accepted reports, per layer.", ["group"]
        )
        self.rebalances = m.counter(
            "rebalances",
            "total",
            "Rebalances by outcome: published, too_few_tokens, no_gain, unchanged, error.",
            ["group", "outcome"],
        )
        self.balancedness = m.gauge(
            "balancedness",
            "ratio",
            "Mean over max tokens per expert-parallel rank over the last weighed window, under the current "
            "placement (before) and the proposed one (after).",
            ["group", "placement"],
        )
        self.version = m.gauge("placement", "version", "The group's current placement version.", ["group"])
        self.moved = m.counter(
            "moved_slots", "total", "Physical expert slots whose expert changed in published placements.",
            ["group"],
        )  # fmt: skip
        self.watchers = m.gauge("watchers", "streams", "Open WatchPlacement streams.", ["group"])
        self.store_errors = m.counter(
            "store_errors", "total", "Failed Redis reads or writes of placements (kept in memory meanwhile)."
        )


def _bad(message: str) -> StatusError:
    return StatusError(grpc.StatusCode.INVALID_ARGUMENT, message)


def report_key(r: eplb_pb2.ExpertLoadReport) -> GroupKey:
    """The report's group, its shape checked (``StatusError`` INVALID_ARGUMENT)."""
    if not r.model_fingerprint:
        raise _bad("model_fingerprint is required")
    if r.num_layers <= 0 or r.num_physical_experts <= 0:
        raise _bad(
            f"num_layers ({r.num_layers}) and num_physical_experts ({r.num_physical_experts}) must be > 0"
        )
    return _key(
        r.model_fingerprint, r.pool, r.num_layers, r.num_logical_experts or r.num_physical_experts,
        r.num_physical_experts, r.num_ranks or 1,
    )  # fmt: skip


def _key(fp: str, pool: str, layers: int, logical: int, physical: int, ranks: int) -> GroupKey:
    if logical > physical:
        raise _bad(f"{physical} physical experts cannot hold {logical} logical experts")
    if physical % ranks:
        raise _bad(f"{physical} physical experts do not divide over {ranks} expert-parallel ranks")
    return GroupKey(fp, pool, layers, logical, physical, ranks)


def _rows(flat: list[int], key: GroupKey) -> list[list[int]]:
    n = key.num_physical
    return [list(flat[i * n : (i + 1) * n]) for i in range(key.num_layers)]


def placement_proto(key: GroupKey, p: Placement) -> eplb_pb2.Placement:
    return eplb_pb2.Placement(
        version=p.version,
        num_layers=key.num_layers,
        num_physical_experts=key.num_physical,
        num_logical_experts=key.num_logical,
        physical_to_logical=[e for row in p.physical_to_logical for e in row],
        model_fingerprint=key.model_fingerprint,
        num_ranks=key.num_ranks,
        pool=key.pool,
        balancedness_before=p.balancedness_before,
        balancedness_after=p.balancedness_after,
    )


class EPLBServicer(eplb_pb2_grpc.EPLBServicer):
    def __init__(self, settings: EPLBSettings, metrics: EPLBMetrics, store: PlacementStore | None) -> None:
        self.settings = settings
        self.metrics = metrics
        self.store = store
        self.groups: dict[GroupKey, PlacementGroup] = {}

    # ---- groups ----------------------------------------------------------------------------------
    async def restore(self) -> None:
        """Load every group's placement from the store (at start)."""
        if self.store is None:
            return
        try:
            saved = await self.store.load_all()
        except (RedisError, OSError) as exc:
            self.metrics.store_errors.inc()
            log.warning("could not read placements from Redis (%s); starting every group at version 0", exc)
            return
        for key, placement in saved:
            try:
                self.groups[key] = PlacementGroup.new(key, placement)
            except PlacementError as exc:
                log.warning("ignoring the stored placement of %s: %s", key.name, exc)
                continue
            self.metrics.version.labels(group=key.name).set(placement.version)
            log.info("restored %s at placement version %d", key.name, placement.version)

    def group(self, key: GroupKey) -> PlacementGroup:
        """The group of ``key``, made at version 0 when new."""
        g = self.groups.get(key)
        if g is None:
            g = self.groups[key] = PlacementGroup.new(key)
            self.metrics.version.labels(group=key.name).set(0)
            log.info("new placement group %s", key.name)
        return g

    def find(self, r: eplb_pb2.PlacementRequest, create: bool) -> PlacementGroup:
        """The request's group: by its whole key, or the model's only group when it names just the model."""
        if not r.model_fingerprint:
            raise _bad("model_fingerprint is required")
        if r.num_layers or r.num_physical_experts:
            if r.num_layers <= 0 or r.num_physical_experts <= 0:
                raise _bad("num_layers and num_physical_experts must both be set, or neither")
            key = _key(
                r.model_fingerprint, r.pool, r.num_layers, r.num_logical_experts or r.num_physical_experts,
                r.num_physical_experts, r.num_ranks or 1,
            )  # fmt: skip
            if create:
                return self.group(key)
            if key not in self.groups:
                raise StatusError(
                    grpc.StatusCode.NOT_FOUND,
                    f"no placement group {key.name}: no worker of it has reported load or watched yet",
                )
            return self.groups[key]
        matches = [
            g for k, g in sorted(self.groups.items(), key=lambda kv: kv[0].name)
            if k.model_fingerprint == r.model_fingerprint and (not r.pool or k.pool == r.pool)
        ]  # fmt: skip
        if not matches:
            raise StatusError(
                grpc.StatusCode.NOT_FOUND,
                f"no placement group for model {r.model_fingerprint!r}"
                + (f" in pool {r.pool!r}" if r.pool else "")
                + f" (known: {', '.join(sorted(k.name for k in self.groups)) or 'none'})",
            )
        if len(matches) > 1:
            raise _bad(
                f"model {r.model_fingerprint!r} has {len(matches)} placement groups "
                f"({', '.join(g.key.name for g in matches)}); name the pool and shape"
            )
        return matches[0]

    async def persist(self, key: GroupKey, placement: Placement) -> None:
        if self.store is None:
            return
        try:
            await self.store.save(key, placement)
        except (RedisError, OSError) as exc:
            self.metrics.store_errors.inc()
            log.warning("could not save %s version %d to Redis (%s)", key.name, placement.version, exc)

    # ---- RPCs ------------------------------------------------------------------------------------
    async def ReportExpertLoad(
        self, request: eplb_pb2.ExpertLoadReport, context: grpc.aio.ServicerContext
    ) -> eplb_pb2.ExpertLoadAck:
        try:
            key = report_key(request)
            if request.ep_rank >= key.num_ranks:
                raise _bad(f"ep_rank {request.ep_rank} is not below num_ranks {key.num_ranks}")
            expected = key.num_layers * key.num_physical
            if len(request.counts) != expected:
                raise _bad(
                    f"counts has {len(request.counts)} values; num_layers x num_physical_experts is "
                    f"{key.num_layers} x {key.num_physical} = {expected}"
                )
            p2l = None
            if request.physical_to_logical:
                if len(request.physical_to_logical) != expected:
                    raise _bad(
                        f"physical_to_logical has {len(request.physical_to_logical)} values, expected {expected}"
                    )
                p2l = _rows(list(request.physical_to_logical), key)
                try:
                    check_placement(p2l, key.num_layers, key.num_logical, key.num_physical)
                except PlacementError as exc:
                    raise _bad(f"physical_to_logical: {exc}") from None
            elif request.placement_version > 0:
                raise _bad("physical_to_logical is required with a placement_version above 0")
        except StatusError as exc:
            await abort_with(context, exc.code, exc.message)
        group = self.group(key)
        accepted, adopted = group.add_report(request.placement_version, list(request.counts), p2l)
        label = key.name
        self.metrics.reports.labels(group=label, outcome="accepted" if accepted else "dropped").inc()
        if accepted:
            self.metrics.tokens.labels(group=label).inc(sum(request.counts) / key.num_layers)
        if adopted is not None:
            log.info("%s: adopted version %d from worker %s", label, adopted.version, request.worker_id)
            self.metrics.version.labels(group=label).set(adopted.version)
            await self.persist(key, adopted)
        return eplb_pb2.ExpertLoadAck(placement_version=group.placement.version, accepted=accepted)

    async def GetPlacement(
        self, request: eplb_pb2.PlacementRequest, context: grpc.aio.ServicerContext
    ) -> eplb_pb2.Placement:
        try:
            group = self.find(request, create=False)
        except StatusError as exc:
            await abort_with(context, exc.code, exc.message)
        return placement_proto(group.key, group.placement)

    async def WatchPlacement(
        self, request: eplb_pb2.PlacementRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[eplb_pb2.Placement]:
        try:
            group = self.find(request, create=True)
        except StatusError as exc:
            await abort_with(context, exc.code, exc.message)
        q: asyncio.Queue[Placement] = asyncio.Queue()
        group.watchers.add(q)
        gauge = self.metrics.watchers.labels(group=group.key.name)
        gauge.inc()
        try:
            sent = request.after_version if request.HasField("after_version") else -1
            current = group.placement
            while True:
                if current.version > sent:
                    yield placement_proto(group.key, current)
                    sent = current.version
                current = await q.get()
        finally:
            group.watchers.discard(q)
            gauge.dec()

    # ---- rebalancing -----------------------------------------------------------------------------
    async def rebalance_once(self) -> list[tuple[GroupKey, Decision]]:
        """Weigh every group's window; publish (and persist) the placements worth it."""
        s = self.settings
        out = []
        for key, group in list(self.groups.items()):
            group.prune(s.window_s)
            if not group.window:
                continue
            version = group.placement.version
            load, tokens = group.window_load()
            try:
                decision = await asyncio.to_thread(
                    group.propose, load, tokens, s.min_window_tokens, s.min_improvement, s.num_nodes,
                    s.num_expert_groups,
                )  # fmt: skip
            except PlacementError as exc:  # a shape the policy cannot place: the other groups go on
                self.metrics.rebalances.labels(group=key.name, outcome="error").inc()
                log.error("%s: no placement computed: %s", key.name, exc)
                continue
            if group.placement.version != version:
                continue  # a report adopted a newer version meanwhile: weigh again next time
            label = key.name
            self.metrics.rebalances.labels(group=label, outcome=decision.outcome).inc()
            if decision.outcome != "too_few_tokens":
                self.metrics.balancedness.labels(group=label, placement="before").set(
                    decision.balancedness_before
                )
                self.metrics.balancedness.labels(group=label, placement="after").set(
                    decision.balancedness_after
                )
            if decision.placement is not None:
                group.set_placement(decision.placement)
                self.metrics.version.labels(group=label).set(decision.placement.version)
                self.metrics.moved.labels(group=label).inc(decision.moved_slots)
                log.info(
                    "%s: published version %d: balancedness %.3f -> %.3f over %.0f tokens, %d slots move",
                    label, decision.placement.version, decision.balancedness_before,
                    decision.balancedness_after, decision.tokens, decision.moved_slots,
                )  # fmt: skip
                await self.persist(key, decision.placement)
            else:
                log.debug("%s: no new placement (%s)", label, decision.outcome)
            out.append((key, decision))
        return out
