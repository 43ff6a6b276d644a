"""KV events on the wire: ``mesh.kv_events`` dataclasses to and from ``pdmesh.v1.KVEvent``.

Workers encode (``StreamKVEvents``), routers decode (their in-process index feed); both directions live
here so that they stay each other's inverse.
"""

from __future__ import annotations

from mesh.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, Tier
from protos.pdmesh.v1 import common_pb2

_TO_PROTO = {Tier.GPU: common_pb2.TIER_GPU, Tier.CPU: common_pb2.TIER_CPU, Tier.DISK: common_pb2.TIER_DISK}
_FROM_PROTO = {v: k for k, v in _TO_PROTO.items()}


def events_to_proto(events: list[KVEvent]) -> list[common_pb2.KVEvent]:
    out = []
    for e in events:
        if isinstance(e, BlocksStored):
            msg = common_pb2.BlocksStored(block_hashes=list(e.block_hashes), tier=_TO_PROTO[e.tier])
            if e.parent_hash is not None:
                msg.parent_hash = e.parent_hash
            out.append(common_pb2.KVEvent(blocks_stored=msg))
        elif isinstance(e, BlocksRemoved):
            out.append(
                common_pb2.KVEvent(
                    blocks_removed=common_pb2.BlocksRemoved(
                        block_hashes=list(e.block_hashes), tier=_TO_PROTO[e.tier]
                    )
                )
            )
        elif isinstance(e, AllBlocksCleared):
            out.append(
                common_pb2.KVEvent(all_blocks_cleared=common_pb2.AllBlocksCleared(tier=_TO_PROTO[e.tier]))
            )
    return out


def events_from_proto(events: list[common_pb2.KVEvent]) -> list[KVEvent]:
    """``mesh.kv_events`` dataclasses from ``pdmesh.v1.KVEvent``s; an event with an unknown tier is an error."""
    out: list[KVEvent] = []
    for e in events:
        which = e.WhichOneof("event")
        if which is None:
            continue  # an event kind newer than this router: nothing it can apply
        msg = getattr(e, which)
        tier = _FROM_PROTO.get(msg.tier)
        if tier is None:
            raise ValueError(f"KV event {which} has tier {msg.tier}, which is not gpu, cpu or disk")
        if which == "blocks_stored":
            parent = msg.parent_hash if msg.HasField("parent_hash") else None
            out.append(BlocksStored(tuple(msg.block_hashes), tier, parent))
        elif which == "blocks_removed":
            out.append(BlocksRemoved(tuple(msg.block_hashes), tier))
        elif which == "all_blocks_cleared":
            out.append(AllBlocksCleared(tier))
    return out
