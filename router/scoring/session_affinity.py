"""Session affinity: which worker served a session last, in a bounded LRU map.

A multi-turn session's KV lives where its last turn ran; sending the next turn there reuses it even
before that worker's KV events reach the index. Bounded so that a router's memory does not grow with the
number of sessions ever seen: the least recently used session is forgotten first.
"""

from __future__ import annotations

from collections import OrderedDict


class SessionAffinity:
    def __init__(self, capacity: int = 100_000):
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._last: OrderedDict[str, str] = OrderedDict()

    def get(self, session_id: str) -> str | None:
        worker_id = self._last.get(session_id)
        if worker_id is not None:
            self._last.move_to_end(session_id)
        return worker_id

    def record(self, session_id: str, worker_id: str) -> None:
        self._last[session_id] = worker_id
        self._last.move_to_end(session_id)
        while len(self._last) > self.capacity:
            self._last.popitem(last=False)

    def __len__(self) -> int:
        return len(self._last)
