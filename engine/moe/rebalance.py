"""Applying a new expert placement to a MoE block: its expert weights moved in place, its tables rewritten.

Every rank of the expert-parallel group computes the same plan from the old and the new placement (both
global): each of this rank's physical slots whose logical expert changes takes it from a slot of its own
that held that expert, else from the first slot of the old placement that held it, on the rank that owns
that slot, by point-to-point messages over the dispatcher's group (one batch a layer, raw bytes, so float8
weights and their scales travel as they are). Slots whose expert stays are not touched (the controller
keeps an expert in its old slot on a rank where it stays). Weights are written in place and the routing
tables through ``ExpertPlacement.update``, so captured CUDA graphs stay valid. vLLM rearranges expert
weights the same way (``rearrange_expert_weights_inplace``).

Collective with several ranks: every rank calls ``move_experts`` for the same layers in the same order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine.moe.layer import MoEBlock
from kernels.fp8_weight import Fp8Weight


@dataclass
class MovePlan:
    """One rank's share of a layer's move. Local slot indexes throughout."""

    # dst slot -> local slot that held the expert before (copied from a snapshot)
    local: dict[int, int] = field(default_factory=dict)
    # (peer rank, logical expert) received, in the order both sides post them; dst slots each fills
    recv: list[tuple[int, int, list[int]]] = field(default_factory=list)
    # (peer rank, local slot) sent, in the order both sides post them
    send: list[tuple[int, int]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not (self.local or self.recv or self.send)


def plan_moves(old: list[int], new: list[int], num_ranks: int, rank: int) -> MovePlan:
    """This rank's part of moving one layer from placement ``old`` to ``new`` (physical -> logical, global).
    Every rank derives its sends from the others' receives with the same rule, so the messages match."""
    per = len(old) // num_ranks
    first_holder: dict[int, int] = {}
    for slot, logical in enumerate(old):
        first_holder.setdefault(logical, slot)
    plan = MovePlan()
    for r in range(num_ranks):
        lo = r * per
        held = {}
        for j in range(per):
            held.setdefault(old[lo + j], j)
        wanted: dict[int, list[int]] = {}
        for j in range(per):
            logical = new[lo + j]
            if logical == old[lo + j]:
                continue
            if logical in held:
                if r == rank:
                    plan.local[j] = held[logical]
                continue
            wanted.setdefault(logical, []).append(j)
        for logical in sorted(wanted):
            src_slot = first_holder[logical]
            src_rank = src_slot // per
            if r == rank:
                plan.recv.append((src_rank, logical, wanted[logical]))
            elif src_rank == rank:
                plan.send.append((r, src_slot - rank * per))
    return plan


def expert_tensors(block: MoEBlock) -> list[torch.Tensor]:
    """The block's per-expert tensors, local slot first: expert weights, or a float8 weight's values and
    scales."""
    out = []
    for w in (block.w13, block.w2):
        if isinstance(w, Fp8Weight):
            out += [w.weight.data, w.weight_scale.data]
        else:
            out.append(w.data)
    return out


def move_experts(block: MoEBlock, new: list[int]) -> int:
    """Move ``block``'s experts to placement ``new`` (its layer's physical -> logical) and take it as the
    block's placement. Returns how many local slots were rewritten. Collective over the block's
    dispatcher's group."""
    dispatcher = block.dispatcher
    ranks, rank = dispatcher.ep_size, dispatcher.ep_rank
    plan = plan_moves(block.placement.host, new, ranks, rank)
    tensors = expert_tensors(block)
    copy_rows = block.ops.copy_rows
    received: list[torch.Tensor] = []
    if plan.send or plan.recv:
        import torch.distributed as dist

        ops = []
        for peer, src in plan.send:
            for t in tensors:
                ops.append(dist.P2POp(dist.isend, _bytes(t[src].contiguous()), peer, dispatcher.group))
        # Each tensor's received experts in one buffer, row i for the i-th receive.
        received = [t.new_empty((len(plan.recv), *t.shape[1:])) for t in tensors]
        for i, (peer, _logical, _dst) in enumerate(plan.recv):
            ops += [dist.P2POp(dist.irecv, _bytes(buf[i]), peer, dispatcher.group) for buf in received]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    # A tensor's local copies in at most three calls of the op (one kernel each on a GPU), reading every old
    # slot before any slot is written: the old slots that are also rewritten are saved first; the other
    # sources are read in place. Copied slot by slot (a snapshot, then a copy: four launches a slot) an H100
    # moved experts at 11-17% of its copy rate (performance.md).
    saved = sorted(set(plan.local.values()) & set(plan.local))
    saved_row = {slot: i for i, slot in enumerate(saved)}
    direct = [(dst, src) for dst, src in sorted(plan.local.items()) if src not in saved_row]
    from_saved = [(dst, saved_row[src]) for dst, src in sorted(plan.local.items()) if src in saved_row]
    from_peers = [(dst, i) for i, (_peer, _logical, dsts) in enumerate(plan.recv) for dst in dsts]
    # Every index list of the layer in one host-to-device copy from page-locked memory, which the host does
    # not wait for (one from pageable memory per list can hold it until the copies queued before have run).
    lists = [saved, list(range(len(saved)))]
    calls = []  # (source: "saved", "self" or "peers", index of its source rows, of its destination rows)
    for source, pairs in (("self", direct), ("saved", from_saved), ("peers", from_peers)):
        if pairs:
            calls.append((source, len(lists), len(lists) + 1))
            lists += [[s for _d, s in pairs], [d for d, _s in pairs]]
    index = to_device([i for values in lists for i in values], tensors[0].device)
    bounds = [0]
    for values in lists:
        bounds.append(bounds[-1] + len(values))
    views = [index[bounds[i] : bounds[i + 1]] for i in range(len(lists))]
    saved_rows = views[0] if saved else None
    for k, t in enumerate(tensors):
        keep = None
        if saved_rows is not None:
            keep = t.new_empty((len(saved), *t.shape[1:]))
            copy_rows(t, saved_rows, keep, views[1])
        sources = {"self": t, "saved": keep, "peers": received[k] if received else None}
        for source, src_list, dst_list in calls:
            copy_rows(sources[source], views[src_list], t, views[dst_list])
    block.placement.update(new)
    block.expert_counts.zero_()
    return len(plan.local) + len(from_peers)


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """An int64 tensor of ``values`` on ``device``; to a GPU from page-locked memory, not waited for."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's storage as bytes (gloo and NCCL move any dtype so, float8 included)."""
    return t.reshape(-1).view(torch.uint8)
