"""Placements kept in Redis, so that a restarted controller goes on from each group's current version.

Layout (``<prefix>`` defaults to ``pdmesh:eplb``):

- ``<prefix>:group:<digest>``: one group's key, version and placement as JSON (``digest``: a hash of the
  group's name, ``GroupKey.digest``).
- ``<prefix>:groups``: the set of those digests, read once at start.

Only published (and adopted) placements are written, one SET per version; load windows stay in memory
(a restart begins a new window). A Redis error is the caller's to log and count: the controller goes on in
memory and writes the next version.
"""

from __future__ import annotations

import json

import redis.asyncio as aioredis

from eplb_svc.placement_groups import GroupKey, Placement

DEFAULT_PREFIX = "pdmesh:eplb"


class PlacementStore:
    def __init__(self, url: str, prefix: str = DEFAULT_PREFIX) -> None:
        self._redis: aioredis.Redis = aioredis.from_url(url)
        self.prefix = prefix

    def group_key(self, key: GroupKey) -> str:
        return f"{self.prefix}:group:{key.digest}"

    @property
    def groups_key(self) -> str:
        return f"{self.prefix}:groups"

    async def save(self, key: GroupKey, placement: Placement) -> None:
        record = {
            "key": key.__dict__,
            "version": placement.version,
            "physical_to_logical": placement.physical_to_logical,
            "balancedness_before": placement.balancedness_before,
            "balancedness_after": placement.balancedness_after,
        }
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.set(self.group_key(key), json.dumps(record, separators=(",", ":")))
            pipe.sadd(self.groups_key, key.digest)
            await pipe.execute()

    async def load_all(self) -> list[tuple[GroupKey, Placement]]:
        digests = sorted(
            d.decode() if isinstance(d, bytes) else d for d in await self._redis.smembers(self.groups_key)
        )
        if not digests:
            return []
        raws = await self._redis.mget([f"{self.prefix}:group:{d}" for d in digests])
        out = []
        for raw in raws:
            if raw is None:
                continue
            record = json.loads(raw)
            out.append(
                (
                    GroupKey(**record["key"]),
                    Placement(
                        record["version"],
                        record["physical_to_logical"],
                        record.get("balancedness_before", 0.0),
                        record.get("balancedness_after", 0.0),
                    ),
                )
            )
        return out

    async def aclose(self) -> None:
        await self._redis.aclose()
