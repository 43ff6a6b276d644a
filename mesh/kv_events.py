"""KV cache events: what a worker's cache gained or lost, keyed by the shared block hash.

Workers publish them; the KV index consumes them. Plain data, no transport here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol


class Tier(StrEnum):
    GPU = "gpu"  # the worker's own KV pool (on a CPU worker too: "device" memory of the engine)
    CPU = "cpu"  # host-memory offload
    DISK = "disk"


@dataclass(frozen=True)
class BlocksStored:
    block_hashes: tuple[int, ...]
    tier: Tier = Tier.GPU
    parent_hash: int | None = None  # hash of the block before the first one, if any


@dataclass(frozen=True)
class BlocksRemoved:
    block_hashes: tuple[int, ...]
    tier: Tier = Tier.GPU


@dataclass(frozen=True)
class AllBlocksCleared:
    tier: Tier = Tier.GPU


KVEvent = BlocksStored | BlocksRemoved | AllBlocksCleared


class KVEventSink(Protocol):
    def publish(self, events: list[KVEvent]) -> None: ...


@dataclass
class ListEventSink:
    """Collects events in memory (tests, and the buffer a service drains to its publisher)."""

    events: list[KVEvent] = field(default_factory=list)

    def publish(self, events: list[KVEvent]) -> None:
        self.events.extend(events)

    def drain(self) -> list[KVEvent]:
        out, self.events = self.events, []
        return out
