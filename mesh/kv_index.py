"""The KV index: which worker holds which KV block in which tier, and how long a prompt's cached prefix is.

It owns the index's data structures and their two homes: ``InProcessKVIndex`` for a single-machine mesh
and ``RedisKVIndex`` for a shared one; both pass the same tests. It consumes the events of
``mesh.kv_events`` and answers prefix lookups; block identity comes from ``mesh.block_hash`` alone. It
must not score or pick workers (``router/scoring`` does) and must not know how events travel.

Layout (both implementations). Each worker gets a small integer *slot*. A block maps to three bitsets
over slots, one per tier (gpu, cpu, disk): bit ``s`` of the gpu bitset says worker ``s`` holds the block
in gpu memory. A lookup walks the chain once, AND-ing the set of workers still matching with each block's
holders, and skips a block whose bitsets equal the previous block's, so its cost per block does not grow
with the number of workers; per-worker work happens only where a worker's match or best tier changes.
Per-worker sets of held hashes serve ``remove_worker`` and ``AllBlocksCleared``. In Redis, the slot table
names every worker the index holds anything for (``RedisKVIndex.worker_ids``, O(workers)): a shared index is
written by the workers themselves, so a router sweeps it of the ids no worker is behind any more; the
in-process index is written by one router, which forgets each worker as it leaves, and needs no listing.

Costs, measured by ``python benchmarks/router_decision_bench.py`` on CPU, 2 cores, Redis 7.0 on loopback,
2026-11-29 (13:36 UTC, quiet machine); the full table is in docs/routing.md, "KV index costs":

- ``InProcessKVIndex``: ``dict[hash, [gpu, cpu, disk] slot bitsets (Python ints)]`` and
  ``dict[worker, set[hash]]``. ``apply``: O(blocks), ~180k blocks/s. ``lookup`` of N blocks: O(N) up to
  the first block no worker holds; 512-block prompts, realistic overlap: ~0.1 ms p50; all 64 workers
  holding all 512 blocks: ~0.12 ms. Memory: ~160 B per (block, worker) pair.
  ``apply_sync``/``lookup_sync`` are the same without a coroutine.
- ``RedisKVIndex``: ``<prefix>:<fp>:blk:<hash hex>`` is a string bitmap (SETBIT offset
  ``(slot // 32) * 96 + tier * 32 + slot % 32``: 12 bytes per 32 slots), ``<prefix>:<fp>:wblk:<worker>`` a
  set of the worker's hashes, ``kvslot`` / ``kvslotworker`` / ``kvslotnext`` / ``kvslotfree`` the slot
  table. A lookup is one round trip, ``MULTI; MGET <the chain's block keys>; HGETALL kvslotworker; EXEC``
  (a consistent snapshot), and the walk runs here on the bitmaps, decoding each distinct bitmap once.
  Redis time per 512-block lookup: ~0.1-0.25 ms (the MGET's key lookups; the same walk as a Lua script
  cost ~0.45 ms of Redis time, ~1 us per matched block, which every other client waited on); wall p50
  ~0.5-0.65 ms from redis-py with hiredis. A batch of events is one pipeline of EVALSHAs (512 blocks per
  script call), ~150-190k blocks/s. Memory (46-character fingerprint): ~165 B per (block, worker) pair.

A lookup raises ``redis.RedisError`` when Redis is unreachable; the router then routes by load alone.
One worker's events must be applied in order by one writer (the worker's event stream gives that order).
"""

from __future__ import annotations

import heapq
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError

from mesh.kv_events import AllBlocksCleared, BlocksRemoved, BlocksStored, KVEvent, Tier

TIERS_BEST_FIRST: tuple[Tier, ...] = (Tier.GPU, Tier.CPU, Tier.DISK)
_GPU, _CPU, _DISK = TIERS_BEST_FIRST
TIER_INDEX: dict[Tier, int] = {t: i for i, t in enumerate(TIERS_BEST_FIRST)}
ALL_TIERS_MASK = 0b111  # a mask over tier indexes: bit i = TIERS_BEST_FIRST[i]

# Blocks per Lua call when applying events: bounds how long one script holds Redis.
_APPLY_CHUNK = 512


@dataclass(frozen=True, slots=True)  # slots: a lookup builds one per worker (0.7 us each, not 2 us)
class PrefixMatch:
    """One worker's cached prefix of a block chain: ``blocks`` leading blocks, from block 0, no gaps.

    ``blocks_by_tier`` counts each of those blocks once, at the best tier the worker holds it in
    (gpu > cpu > disk); it always has all three tiers.
    """

    blocks: int
    blocks_by_tier: dict[Tier, int] = field(default_factory=dict)

    @staticmethod
    def from_counts(gpu: int, cpu: int, disk: int) -> PrefixMatch:
        return PrefixMatch(gpu + cpu + disk, {_GPU: gpu, _CPU: cpu, _DISK: disk})


class KVIndex(Protocol):
    async def apply(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        """Apply one worker's KV events, in order."""
        ...

    async def lookup(self, block_hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        """Every worker holding block 0 of the chain, with its longest gap-free cached prefix."""
        ...

    async def remove_worker(self, worker_id: str) -> bool:
        """Forget everything a worker holds (it left the mesh). True when this call removed it; False when
        it held nothing, or another caller removed it first."""
        ...

    async def clear(self) -> None:
        """Forget everything."""
        ...


def _transition(
    counts: dict[int, list[int]],
    since: dict[int, list[int]],
    old: tuple[int, ...],
    new: tuple[int, ...],
    at: int,
) -> None:
    """Between (gpu, cpu, disk) best-tier slot bitsets ``old`` and ``new`` at block index ``at``: credit
    the tier runs that end there, start the ones that begin there. Work is per changed bit only."""
    for tier in range(3):
        changed = old[tier] ^ new[tier]
        while changed:
            low = changed & -changed
            changed ^= low
            slot = low.bit_length() - 1
            if old[tier] & low:
                c = counts.get(slot)
                if c is None:
                    counts[slot] = c = [0, 0, 0]
                c[tier] += at - since[slot][tier]
            else:
                since.setdefault(slot, [0, 0, 0])[tier] = at


def _walk(rows: Sequence[Sequence[int] | None]) -> dict[int, list[int]]:
    """The lookup walk both indexes share. ``rows[i]`` is block i's (gpu, cpu, disk) holder bitsets, or
    None where no worker holds it. Returns, per bit that holds block 0, its gap-free prefix's block
    counts by best tier. A row equal to the one before it changes nothing and costs one comparison."""
    if not rows or rows[0] is None:
        return {}
    prev = rows[0]
    g, c, d = prev
    active = g | c | d  # bits holding every block so far
    run = (g, c & ~g, d & ~(g | c))  # their best tier at the current block
    counts: dict[int, list[int]] = {}
    since: dict[int, list[int]] = {}
    _transition(counts, since, (0, 0, 0), run, 0)
    end = len(rows)
    for i in range(1, end):
        entry = rows[i]
        if entry is None:
            end = i
            break
        if entry == prev:  # same holders in the same tiers as the block before: nothing changes
            continue
        prev = entry
        g, c, d = entry
        active &= g | c | d
        if not active:
            end = i
            break
        new = (g & active, c & active & ~g, d & active & ~(g | c))
        if new != run:
            _transition(counts, since, run, new, i)
            run = new
    _transition(counts, since, run, (0, 0, 0), end)
    return counts


class InProcessKVIndex:
    """The index in this process's memory: a single-machine mesh's index, and the reference in tests."""

    def __init__(self) -> None:
        self._blocks: dict[int, list[int]] = {}  # hash -> [gpu, cpu, disk] slot bitsets
        self._worker_blocks: dict[str, set[int]] = {}
        self._slot_of: dict[str, int] = {}
        self._worker_of: dict[int, str] = {}
        self._free_slots: list[int] = []  # heap: reuse the lowest slot so bitsets stay short
        self._next_slot = 0

    def _slot(self, worker_id: str) -> int:
        slot = self._slot_of.get(worker_id)
        if slot is None:
            slot = heapq.heappop(self._free_slots) if self._free_slots else self._next_slot
            self._next_slot = max(self._next_slot, slot + 1)
            self._slot_of[worker_id] = slot
            self._worker_of[slot] = worker_id
        return slot

    async def apply(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        self.apply_sync(worker_id, events)

    def apply_sync(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        for event in events:
            if isinstance(event, BlocksStored):
                bit = 1 << self._slot(worker_id)
                tier = TIER_INDEX[event.tier]
                held = self._worker_blocks.setdefault(worker_id, set())
                for h in event.block_hashes:
                    entry = self._blocks.get(h)
                    if entry is None:
                        self._blocks[h] = entry = [0, 0, 0]
                    entry[tier] |= bit
                    held.add(h)
            elif isinstance(event, BlocksRemoved):
                self._drop(worker_id, event.block_hashes, 1 << TIER_INDEX[event.tier])
            elif isinstance(event, AllBlocksCleared):
                held_now = list(self._worker_blocks.get(worker_id, ()))
                self._drop(worker_id, held_now, 1 << TIER_INDEX[event.tier])
            else:
                raise TypeError(f"not a KV event: {event!r}")

    def _drop(self, worker_id: str, hashes: Sequence[int], tier_mask: int) -> None:
        slot = self._slot_of.get(worker_id)
        held = self._worker_blocks.get(worker_id)
        if slot is None or held is None:
            return
        bit = 1 << slot
        for h in hashes:
            entry = self._blocks.get(h)
            if entry is None:
                continue
            for tier in range(3):
                if tier_mask >> tier & 1:
                    entry[tier] &= ~bit
            if not (entry[0] | entry[1] | entry[2]) & bit:
                held.discard(h)
                if not (entry[0] or entry[1] or entry[2]):
                    del self._blocks[h]

    async def lookup(self, block_hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        return self.lookup_sync(block_hashes)

    def lookup_sync(self, block_hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        get = self._blocks.get
        if not block_hashes or get(block_hashes[0]) is None:
            return {}
        rows: list[list[int]] = []
        for lo in range(0, len(block_hashes), 64):  # in chunks: stop looking soon after the first miss
            chunk = list(map(get, block_hashes[lo : lo + 64]))
            if None in chunk:
                rows += chunk[: chunk.index(None)]
                break
            rows += chunk
        counts = _walk(rows)
        return {self._worker_of[s]: PrefixMatch.from_counts(*c) for s, c in counts.items()}

    async def remove_worker(self, worker_id: str) -> bool:
        held = self._worker_blocks.get(worker_id)
        if held is not None:
            self._drop(worker_id, list(held), ALL_TIERS_MASK)
            del self._worker_blocks[worker_id]
        slot = self._slot_of.pop(worker_id, None)
        if slot is None:
            return False
        del self._worker_of[slot]
        heapq.heappush(self._free_slots, slot)
        return True

    async def clear(self) -> None:
        self._blocks.clear()
        self._worker_blocks.clear()
        self._slot_of.clear()
        self._worker_of.clear()
        self._free_slots.clear()
        self._next_slot = 0

    def __len__(self) -> int:
        """Number of distinct blocks held by any worker."""
        return len(self._blocks)


# ---------------------------------------------------------------------------------------------------------
# Redis. Scripts run atomically; every key they touch is declared in KEYS.

# KEYS: kvslot, kvslotworker, kvslotnext, kvslotfree, the worker's hash set, block keys...
# ARGV: worker, tier index, the blocks' hash hex (set members), aligned with the block keys.
_STORE_LUA = """
local w, t = ARGV[1], tonumber(ARGV[2])
local s = redis.call('HGET', KEYS[1], w)
if s then
  s = tonumber(s)
else
  local free = redis.call('ZPOPMIN', KEYS[4])
  if #free > 0 then s = tonumber(free[1]) else s = redis.call('INCR', KEYS[3]) - 1 end
  redis.call('HSET', KEYS[1], w, s)
  redis.call('HSET', KEYS[2], s, w)
end
local off = math.floor(s / 32) * 96 + t * 32 + s % 32
for i = 6, #KEYS do redis.call('SETBIT', KEYS[i], off, 1) end
if #KEYS >= 6 then redis.call('SADD', KEYS[5], unpack(ARGV, 3)) end
return s
"""

# Clears the tier bits in mask ARGV[2] of slot ``s`` in block keys KEYS[@FIRST@..], whose hash hex are
# ARGV[@FIRST@ + @SHIFT@..]. A block the slot no longer holds in any tier leaves the set KEYS[@SET@]; an
# all-zero bitmap is deleted. The two scripts below differ only in how they find the slot.
_CLEAR_BODY = """
local m = tonumber(ARGV[2])
local base = math.floor(s / 32) * 96 + s % 32
local gone = {}
for i = @FIRST@, #KEYS do
  local k = KEYS[i]
  if redis.call('EXISTS', k) == 1 then
    for t = 0, 2 do
      if bit.band(m, bit.lshift(1, t)) ~= 0 then redis.call('SETBIT', k, base + t * 32, 0) end
    end
    local still = redis.call('GETBIT', k, base) + redis.call('GETBIT', k, base + 32)
      + redis.call('GETBIT', k, base + 64)
    if still == 0 then
      gone[#gone + 1] = ARGV[i + @SHIFT@]
      if redis.call('BITCOUNT', k) == 0 then redis.call('DEL', k) end
    end
  else
    gone[#gone + 1] = ARGV[i + @SHIFT@]
  end
end
if #gone > 0 then redis.call('SREM', KEYS[@SET@], unpack(gone)) end
return #gone
"""

# One worker's blocks. KEYS: kvslot, the worker's hash set, block keys... ARGV: worker, tier mask, hex...
_REMOVE_LUA = (
    "local s = redis.call('HGET', KEYS[1], ARGV[1])\nif not s then return 0 end\ns = tonumber(s)\n"
    + _CLEAR_BODY.replace("@FIRST@", "3").replace("@SHIFT@", "0").replace("@SET@", "2")
)

# One retiring slot's blocks. KEYS: the slot's retiring set, block keys... ARGV: slot, tier mask, hex...
_CLEAR_SLOT_LUA = "local s = tonumber(ARGV[1])\n" + _CLEAR_BODY.replace("@FIRST@", "2").replace(
    "@SHIFT@", "1"
).replace("@SET@", "1")

# Takes a slot from its worker so that no later event can write to it while its bits are cleared, records
# it among the retiring slots (so that a removal cut short can be finished by anyone later) and gives the
# caller the slot's clearing lease (so that no one else clears it meanwhile). Only one of several callers
# removing the same worker gets past the first line: the others have nothing to do.
# KEYS: kvslot, kvslotworker, the worker's hash set, the slot's retiring set, the retiring slots, the
# slot's lease. ARGV: worker, slot, lease holder, lease ms.
_RETIRE_LUA = """
if redis.call('HGET', KEYS[1], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[2])
if redis.call('EXISTS', KEYS[3]) == 1 then redis.call('RENAME', KEYS[3], KEYS[4]) end
redis.call('SADD', KEYS[5], ARGV[2])
redis.call('SET', KEYS[6], ARGV[3], 'PX', ARGV[4])
return 1
"""

# KEYS: the slot's retiring set, kvslotfree, the retiring slots, the slot's lease. ARGV: slot. Frees the
# slot once its bits are all cleared.
_FREE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('ZADD', KEYS[2], ARGV[1], ARGV[1])
redis.call('SREM', KEYS[3], ARGV[1])
redis.call('DEL', KEYS[4])
return 1
"""


def _glob_escape(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def _resp_bulk(data: bytes) -> bytes:
    return b"$%d\r\n%b\r\n" % (len(data), data)


_MULTI = b"*1\r\n$5\r\nMULTI\r\n"
_EXEC = b"*1\r\n$4\r\nEXEC\r\n"


def _decode_bitmap(raw: bytes) -> tuple[int, int, int]:
    """A block key's bitmap as (gpu, cpu, disk) bitsets. Group k (slots 32k..32k+31) is 12 bytes, one
    big-endian word per tier; SETBIT numbers bits from the most significant, so slot 32k+j is bit
    32k+31-j here (``_slot_of_bit`` maps back). A bitmap shorter than its last group is zero-padded."""
    if len(raw) % 12:
        raw += bytes(12 - len(raw) % 12)
    if len(raw) == 12:
        return (int.from_bytes(raw[0:4]), int.from_bytes(raw[4:8]), int.from_bytes(raw[8:12]))
    g = c = d = 0
    for k in range(len(raw) // 12):
        o, shift = 12 * k, 32 * k
        g |= int.from_bytes(raw[o : o + 4]) << shift
        c |= int.from_bytes(raw[o + 4 : o + 8]) << shift
        d |= int.from_bytes(raw[o + 8 : o + 12]) << shift
    return g, c, d


def _slot_of_bit(bit: int) -> int:
    return bit - bit % 32 + 31 - bit % 32


class _KeyPacker:
    """Packs the block keys of a lookup as RESP bulk strings, vectorised.

    redis-py's pure-Python packer costs ~1.4 us per argument (0.7 ms for a 512-block chain, more than the
    Redis time of the lookup); every block key has the same length, so numpy writes the hex digits of
    all hashes into copies of one template row at once (~30 us for 512 keys).
    """

    def __init__(self, key_prefix: bytes):
        key_len = len(key_prefix) + 16
        header = b"$%d\r\n" % key_len
        self._row = np.frombuffer(header + key_prefix + b"0" * 16 + b"\r\n", dtype=np.uint8)
        self._hex_at = len(header) + len(key_prefix)

    def pack(self, block_hashes: Sequence[int]) -> bytes:
        hexes = np.array(block_hashes, dtype=np.uint64).astype(">u8").tobytes().hex().encode()
        rows = np.tile(self._row, (len(block_hashes), 1))
        rows[:, self._hex_at : self._hex_at + 16] = np.frombuffer(hexes, dtype=np.uint8).reshape(-1, 16)
        return rows.tobytes()


class RedisKVIndex:
    """The index in Redis, shared by every router of one model.

    ``url_or_client``: a ``redis://`` URL (the index then owns its client; close it with ``aclose``) or a
    ``redis.asyncio.Redis``. Keys live under ``<prefix>:<model_fingerprint>:``.
    """

    def __init__(
        self,
        url_or_client: str | aioredis.Redis,
        model_fingerprint: str,
        prefix: str = "pdmesh",
        retire_lease_s: float = 10.0,
    ):
        if isinstance(url_or_client, str):
            self._redis: aioredis.Redis = aioredis.from_url(url_or_client)
            self._owns_client = True
        else:
            self._redis = url_or_client
            self._owns_client = False
        ns = f"{prefix}:{model_fingerprint}:"
        self.namespace = ns
        self._blk = ns + "blk:"
        self._slot_keys = [ns + "kvslot", ns + "kvslotworker", ns + "kvslotnext", ns + "kvslotfree"]
        self._retiring_slots = ns + "kvretiring:slots"  # matched by clear()'s kvretiring:* too
        self._packer = _KeyPacker(self._blk.encode())
        self._hgetall_slots = b"*2\r\n" + _resp_bulk(b"HGETALL") + _resp_bulk(self._slot_keys[1].encode())
        self._sha: dict[str, str] = {}
        # Clearing a removed worker's slot is leased (renewed at every chunk of blocks): routers sweeping the
        # same index skip a slot someone is clearing, and take over one whose clearer stopped for this long.
        self.retire_lease_s = retire_lease_s
        self._holder = uuid.uuid4().hex  # the lease's value: which index instance clears the slot

    def block_key(self, block_hash: int) -> str:
        return f"{self._blk}{block_hash:016x}"

    def worker_key(self, worker_id: str) -> str:
        return f"{self.namespace}wblk:{worker_id}"

    def _retiring_key(self, slot: int) -> str:
        return f"{self.namespace}kvretiring:{slot}"

    def _lease_key(self, slot: int) -> str:
        return f"{self.namespace}kvretiring:lease:{slot}"

    async def aclose(self) -> None:
        if self._owns_client:
            await self._redis.aclose()

    async def _sha_of(self, script: str, reload: bool = False) -> str:
        if reload or script not in self._sha:
            self._sha[script] = _text(await self._redis.script_load(script))
        return self._sha[script]

    async def _eval(self, script: str, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self._redis.evalsha(await self._sha_of(script), len(keys), *keys, *args)
        except NoScriptError:  # Redis restarted (it may keep nothing on disk): load the script again
            return await self._redis.evalsha(await self._sha_of(script, reload=True), len(keys), *keys, *args)

    async def lookup(self, block_hashes: Sequence[int]) -> dict[str, PrefixMatch]:
        """One round trip: ``MULTI; MGET <block keys>; HGETALL kvslotworker; EXEC`` (a consistent
        snapshot), then the walk here. Redis does ~0.06 us of work per key this way; the same walk in a
        Lua script cost ~1 us per matched block of Redis time, which every other client waits on."""
        if not block_hashes:
            return {}
        bitmaps, slot_names = await self._snapshot(block_hashes)
        rows: list[tuple[int, int, int] | None] = []
        prev_raw: bytes | None = None
        row: tuple[int, int, int] | None = None
        for raw in bitmaps:
            if raw is None:
                break
            if raw != prev_raw:  # most blocks repeat the bitmap before them: decode each distinct one once
                prev_raw, row = raw, _decode_bitmap(raw)
            rows.append(row)
        counts = _walk(rows)
        if not counts:
            return {}
        names = (
            slot_names
            if isinstance(slot_names, dict)
            else dict(zip(slot_names[::2], slot_names[1::2], strict=True))
        )
        out: dict[str, PrefixMatch] = {}
        for bit, c in counts.items():
            name = names.get(b"%d" % _slot_of_bit(bit))
            if name is not None:  # None: a slot being retired (its worker left) while bits are cleared
                out[name.decode()] = PrefixMatch.from_counts(*c)
        return out

    async def _snapshot(self, block_hashes: Sequence[int]) -> tuple[list[bytes | None], Any]:
        """The chain's bitmaps and the slot table, packed here (see ``_KeyPacker``) and sent on a pooled
        connection. Retried once when the connection had dropped (a lookup is read-only). The slot table
        comes back as a flat list (RESP2) or a dict (RESP3)."""
        command = (
            _MULTI
            + b"*%d\r\n" % (len(block_hashes) + 1)
            + _resp_bulk(b"MGET")
            + self._packer.pack(block_hashes)
            + self._hgetall_slots
            + _EXEC
        )
        for attempt in range(2):
            try:
                replies = await self._send_packed(command, 4)  # +OK, +QUEUED, +QUEUED, [bitmaps, slots]
                return replies[3][0], replies[3][1]
            except RedisConnectionError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    async def _send_packed(self, command: bytes, n_replies: int) -> list[Any]:
        pool = self._redis.connection_pool
        conn = await pool.get_connection()
        try:
            await conn.send_packed_command(command)
            return [await conn.read_response(disable_decoding=True) for _ in range(n_replies)]
        except BaseException:
            # A reply left unread (a cancelled lookup: the router's deadline) would be read by the next
            # user of this connection: drop the connection instead.
            await conn.disconnect()
            raise
        finally:
            await pool.release(conn)

    async def apply(self, worker_id: str, events: Sequence[KVEvent]) -> None:
        """One pipeline per batch. An ``AllBlocksCleared`` first flushes what precedes it and reads the
        worker's hash set (one more round trip), so that every key a script touches is declared."""
        pending: list[tuple[str, list[str], list[Any]]] = []
        wkey = self.worker_key(worker_id)
        for event in events:
            if isinstance(event, BlocksStored):
                for hexes in self._chunks(event.block_hashes):
                    keys = [*self._slot_keys, wkey, *(self._blk + x for x in hexes)]
                    pending.append((_STORE_LUA, keys, [worker_id, TIER_INDEX[event.tier], *hexes]))
            elif isinstance(event, (BlocksRemoved, AllBlocksCleared)):
                if isinstance(event, AllBlocksCleared):
                    await self._run(pending)
                    pending = []
                    hashes = [int(_text(m), 16) for m in await self._redis.smembers(wkey)]
                else:
                    hashes = list(event.block_hashes)
                mask = 1 << TIER_INDEX[event.tier]
                for hexes in self._chunks(hashes):
                    keys = [self._slot_keys[0], wkey, *(self._blk + x for x in hexes)]
                    pending.append((_REMOVE_LUA, keys, [worker_id, mask, *hexes]))
            else:
                raise TypeError(f"not a KV event: {event!r}")
        await self._run(pending)

    @staticmethod
    def _chunks(hashes: Sequence[int]) -> list[list[str]]:
        hexes = [f"{h:016x}" for h in hashes]
        return [hexes[i : i + _APPLY_CHUNK] for i in range(0, len(hexes), _APPLY_CHUNK)]

    async def _run(self, pending: list[tuple[str, list[str], list[Any]]]) -> None:
        if not pending:
            return
        for reload in (False, True):
            shas = {src: await self._sha_of(src, reload=reload) for src in {p[0] for p in pending}}
            pipe = self._redis.pipeline(transaction=False)
            for src, keys, args in pending:
                pipe.evalsha(shas[src], len(keys), *keys, *args)
            try:
                await pipe.execute()
                return
            except NoScriptError:
                # Redis lost its scripts (restart): reload and replay; setting and clearing bits is idempotent.
                if reload:
                    raise

    async def remove_worker(self, worker_id: str) -> bool:
        """Take the worker's slot, then clear its bits and free the slot. True when this call took the slot;
        False when the worker held none (never stored, or already removed), or another caller (another
        router's sweep, the worker itself) took it first and does the clearing."""
        wkey = self.worker_key(worker_id)
        slot_raw = await self._redis.hget(self._slot_keys[0], worker_id)
        if slot_raw is None:
            await self._redis.delete(wkey)
            return False
        slot = int(slot_raw)
        retiring = self._retiring_key(slot)
        keys = [
            self._slot_keys[0],
            self._slot_keys[1],
            wkey,
            retiring,
            self._retiring_slots,
            self._lease_key(slot),
        ]
        if not await self._eval(_RETIRE_LUA, keys, [worker_id, slot, self._holder, self._lease_ms]):
            return False  # removed concurrently
        await self._clear_retiring(slot)
        return True

    async def finish_retiring(self) -> int:
        """Finish the removals that were cut short (a process that died or was cancelled between retiring a
        worker's slot and freeing it): clear each retiring slot's bits and free it. Returns how many slots
        this call finished. A slot whose clearing lease is held (a removal still running, here or in another
        router) is left to its clearer; its lease expires ``retire_lease_s`` after the clearer stopped."""
        slots = [int(_text(s)) for s in await self._redis.smembers(self._retiring_slots)]
        finished = 0
        for slot in slots:
            if await self._redis.set(self._lease_key(slot), self._holder, nx=True, px=self._lease_ms):
                await self._clear_retiring(slot)
                finished += 1
        return finished

    @property
    def _lease_ms(self) -> int:
        return max(1, round(self.retire_lease_s * 1000))

    async def _clear_retiring(self, slot: int) -> None:
        """Clear a retiring slot's bits, chunk by chunk, then free it. The caller holds its lease."""
        retiring, lease = self._retiring_key(slot), self._lease_key(slot)
        while True:
            members = await self._redis.srandmember(retiring, _APPLY_CHUNK * 8)
            if not members:
                break
            pending = []
            for hexes in self._chunks([int(_text(m), 16) for m in members]):
                keys = [retiring, *(self._blk + x for x in hexes)]
                pending.append((_CLEAR_SLOT_LUA, keys, [slot, ALL_TIERS_MASK, *hexes]))
            await self._run(pending)
            await self._redis.pexpire(lease, self._lease_ms)
        await self._eval(_FREE_LUA, [retiring, self._slot_keys[3], self._retiring_slots, lease], [slot])

    async def worker_ids(self) -> set[str]:
        """``HKEYS kvslot``: one round trip, O(workers), whatever the number of blocks. The slot table is
        the complete list: a worker gets its slot with its first stored block (before its ``wblk:`` set
        exists) and loses it only in ``remove_worker`` (after which its set is gone), so it also names a
        worker whose set emptied, which a SCAN over ``wblk:*`` (O(keyspace)) would miss."""
        return {_text(w) for w in await self._redis.hkeys(self._slot_keys[0])}

    async def clear(self) -> None:
        """Delete every key of this model's index (SCAN over the keyspace: an administrative operation)."""
        for pattern in ("blk:*", "wblk:*", "kvretiring:*"):
            batch: list[Any] = []
            async for key in self._redis.scan_iter(match=_glob_escape(self.namespace) + pattern, count=1000):
                batch.append(key)
                if len(batch) >= 1000:
                    await self._redis.unlink(*batch)
                    batch = []
            if batch:
                await self._redis.unlink(*batch)
        await self._redis.unlink(*self._slot_keys)
