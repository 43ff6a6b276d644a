"""LoRA adapters served beside the base model, several in one batch (vLLM's multi-LoRA serving).

An adapter is a PEFT directory: ``adapter_config.json`` (``r``, ``lora_alpha``, ``target_modules``,
``use_rslora``) and ``adapter_model.safetensors`` (or ``.bin``) with ``lora_A`` [r, in] and ``lora_B``
[out, r] for some of the decoder layers' projections: ``q_proj``, ``k_proj``, ``v_proj``, ``o_proj`` (for
DeepSeek's latent attention ``q_a_proj``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``o_proj``:
``parts``) and, in dense MLP layers, ``gate_proj``, ``up_proj``, ``down_proj``. A projection with an
adapter computes ``W x + scale * B (A x)``, ``scale = lora_alpha / r`` (``/ sqrt(r)`` with rsLoRA), as PEFT
does.

Registered adapters are kept in host memory; ``max_loras`` of them at a time sit in device slots. Per
projection the slots' matrices are stacked: ``A_all`` [S*R, in] and ``B_all`` [out, S*R], R =
``max_lora_rank`` (times 3 for the fused QKV, 2 for the fused gate-up), zero where an adapter has less, its
scale folded into B. A batch's LoRA is then two matmuls over every slot at once, the middle [T, S, R]
masked to each row's own slot (``row_slots``: one-hot [T, S], a zero row for none):

    t = x @ A_all.T;  t *= row_slots[:, :, None];  y += t @ B_all.T

Shapes are static, so CUDA graphs capture it; the runner writes each pass's rows into the one
``row_slots`` buffer before it launches. The op table's ``lora_apply`` computes it: three kernels, the
PyTorch reference (kernels/lora.py), on both backends for now; kernels/triton_lora.py's two (a split-K
shrink, then the expand with the mask and the add folded in) await their first GPU measurement. Rows are independent, so a padding row's stale slot changes
nothing but its own (dropped) output. Costs a projection ``S*R / in`` more FLOPs and ``S*R*(in+out)`` more
weight bytes a step (with S*R = 64 and a 4096-wide model, about 1.6% of its FLOPs).

A request's adapter takes a slot when the scheduler admits it (``acquire``) and gives it back when it
stops running (preempted or finished: ``release``); a slot whose adapter no running request uses may be
refilled with another, least recently used first. A request whose adapter finds no slot waits
(``can_admit``). Prefix-cache hashes of a request with an adapter start from its own root
(``mesh.block_hash.root_hash``'s ``lora_id``), so adapters never share KV blocks with each other or with the
base model. MoE expert weights, embeddings and the LM head take no adapter (refused at load).
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from engine.errors import InvalidRequestError
from engine.models.model_config import ModelConfig
from kernels import Ops

log = logging.getLogger(__name__)

# Our fused projections and the checkpoint's modules in them, in the order of their output rows.
PARTS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
         "down": ("down_proj",)}  # fmt: skip
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


def parts(cfg: ModelConfig) -> dict[str, tuple[str, ...]]:
    """The model's adaptable projections (``PARTS``'s kinds) and the checkpoint modules in each. DeepSeek's
    latent attention: the query's first projection (q_a_proj, or q_proj without a query rank) stacked with
    the latent's (``MLAttention.qkv_a_proj``), V3's q_b_proj, and o_proj; kv_b_proj, absorbed into the
    queries and the outputs, takes no adapter."""
    if cfg.mla is None:
        return PARTS
    query = "q_a_proj" if cfg.mla.q_lora_rank else "q_proj"
    attention = {"qkv_a": (query, "kv_a_proj_with_mqa"), "o": ("o_proj",)}
    if cfg.mla.q_lora_rank:
        attention["q_b"] = ("q_b_proj",)
    return {**attention, "gate_up": PARTS["gate_up"], "down": PARTS["down"]}


def module_to_projection(cfg: ModelConfig) -> dict[str, tuple[str, int]]:
    """Each adaptable checkpoint module's projection kind and its part's index in it."""
    return {module: (kind, i) for kind, mods in parts(cfg).items() for i, module in enumerate(mods)}


class LoRAError(ValueError):
    """An adapter that cannot be served (bad directory, shapes, rank, or modules this engine cannot adapt),
    or one in use that cannot be replaced or removed (INVALID_ARGUMENT, as the engine's typed errors say)."""

    status = "INVALID_ARGUMENT"


@dataclass(frozen=True)
class LoRARequest:
    """vLLM's offline handle for an adapter: a name, an id, and the PEFT directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


@dataclass
class LoRAAdapter:
    """One adapter in host memory: per layer, per module, (A [r, in], B [out, r] times its scale)."""

    name: str
    path: str
    rank: int
    weights: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @classmethod
    def load(
        cls, name: str, path: str | Path, cfg: ModelConfig, max_rank: int, dtype: torch.dtype
    ) -> LoRAAdapter:
        path = Path(path)
        config_file = path / "adapter_config.json"
        if not config_file.is_file():
            raise LoRAError(
                f"LoRA adapter {name!r}: {config_file} not found (a PEFT adapter directory is needed)"
            )
        conf = json.loads(config_file.read_text())
        rank, alpha = int(conf.get("r", 8)), float(conf.get("lora_alpha", 8))
        if rank > max_rank:
            raise LoRAError(f"LoRA adapter {name!r} has rank {rank}, more than max_lora_rank {max_rank}")
        for unsupported in ("use_dora", "fan_in_fan_out"):
            if conf.get(unsupported):
                raise LoRAError(f"LoRA adapter {name!r}: {unsupported} is not supported")
        if conf.get("bias", "none") != "none" or conf.get("modules_to_save"):
            raise LoRAError(f"LoRA adapter {name!r}: trained biases or modules_to_save are not supported")
        scale = alpha / math.sqrt(rank) if conf.get("use_rslora") else alpha / rank
        tensors = _read_tensors(path, name)
        # A per-module rank or alpha is not supported where it applies to an adapted module; PEFT also
        # writes patterns that match none (for transformers' fused experts), which change nothing.
        adapted = {key.split(".lora_")[0] for key in tensors}
        for pattern in ("rank_pattern", "alpha_pattern"):
            for key in conf.get(pattern) or {}:
                if any(re.match(rf"(.*\.)?({key})$", module) for module in adapted):
                    raise LoRAError(f"LoRA adapter {name!r}: a per-module {pattern} is not supported")
        weights: dict[int, dict[str, list[torch.Tensor | None]]] = {}
        projection_of = module_to_projection(cfg)
        for key, t in tensors.items():
            m = _KEY.search(key)
            if m is None or m.group(2) not in projection_of:
                raise LoRAError(
                    f"LoRA adapter {name!r}: {key} adapts a module this engine cannot (only the decoder "
                    f"layers' {', '.join(projection_of)})"
                )
            layer, module, which = int(m.group(1)), m.group(2), m.group(3)
            if layer >= cfg.num_layers:
                raise LoRAError(
                    f"LoRA adapter {name!r}: {key} names layer {layer}; the model has {cfg.num_layers}"
                )
            pair = weights.setdefault(layer, {}).setdefault(module, [None, None])
            pair[0 if which == "A" else 1] = t
        out: dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
        for layer, modules in weights.items():
            moe = bool(cfg.moe_layers and cfg.moe_layers[layer])
            for module, (a, b) in modules.items():
                if a is None or b is None:
                    raise LoRAError(f"LoRA adapter {name!r}: layer {layer} {module} lacks lora_A or lora_B")
                if moe and projection_of[module][0] in ("gate_up", "down"):
                    raise LoRAError(
                        f"LoRA adapter {name!r}: layer {layer} is a mixture-of-experts layer; its experts "
                        "take no adapter here (attention projections only)"
                    )
                in_dim, out_dim = module_shape(cfg, module)
                if a.shape != (rank, in_dim) or b.shape != (out_dim, rank):
                    raise LoRAError(
                        f"LoRA adapter {name!r}: layer {layer} {module} has A {tuple(a.shape)} and B "
                        f"{tuple(b.shape)}; this model needs [{rank}, {in_dim}] and [{out_dim}, {rank}]"
                    )
                order = rotary_rows(cfg, module)
                if order is not None:  # the model's rows are the checkpoint's reordered (loader)
                    b = b[order]
                out.setdefault(layer, {})[module] = (
                    a.to(dtype).contiguous(),
                    (b.float() * scale).to(dtype).contiguous(),
                )
        if not out:
            raise LoRAError(f"LoRA adapter {name!r} adapts no projection")
        return cls(name, str(path), rank, out)


def _read_tensors(path: Path, name: str) -> dict[str, torch.Tensor]:
    st = path / "adapter_model.safetensors"
    if st.is_file():
        from safetensors.torch import load_file

        return load_file(str(st))
    bin_file = path / "adapter_model.bin"
    if bin_file.is_file():
        return torch.load(bin_file, map_location="cpu", weights_only=True)
    raise LoRAError(f"LoRA adapter {name!r}: no adapter_model.safetensors or adapter_model.bin in {path}")


def module_shape(cfg: ModelConfig, module: str) -> tuple[int, int]:
    """(in, out) of a checkpoint module."""
    h, mla = cfg.hidden_size, cfg.mla
    mlp = {
        "gate_proj": (h, cfg.intermediate_size), "up_proj": (h, cfg.intermediate_size),
        "down_proj": (cfg.intermediate_size, h),
    }  # fmt: skip
    if mla is not None:
        heads_qk = cfg.num_heads * (mla.qk_nope_head_dim + mla.qk_rope_head_dim)
        attention = {
            "q_proj": (h, heads_qk), "q_a_proj": (h, mla.q_lora_rank or 0),
            "q_b_proj": (mla.q_lora_rank or 0, heads_qk), "kv_a_proj_with_mqa": (h, mla.latent_dim),
            "o_proj": (cfg.num_heads * mla.v_head_dim, h),
        }  # fmt: skip
    else:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        attention = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
    return {**attention, **mlp}[module]


def rotary_rows(cfg: ModelConfig, module: str) -> torch.Tensor | None:
    """The order of a DeepSeek module's output rows in the model (``engine.models.mla.rotary_row_order``:
    its rotary rows de-interleaved at load), for its adapter's B rows; None where rows stay in place."""
    if cfg.mla is None or not cfg.mla.rope_interleave:
        return None
    from engine.models.mla import rotary_row_order  # the models import this module

    if module in ("q_proj", "q_b_proj"):
        return rotary_row_order(cfg, "q")
    if module == "kv_a_proj_with_mqa":
        return rotary_row_order(cfg, "kv_a")
    return None


@dataclass
class ProjectionLoRA:
    """One projection's slots: A_all [S*R*parts, in] and B_all [out, S*R*parts], slot-major columns."""

    a: torch.Tensor
    b: torch.Tensor
    part_rows: tuple[int, ...]  # where each part's output rows start (q, k, v / gate, up), then the end
    rank: int  # R: columns per part per slot

    def columns(self, slot: int, part: int) -> slice:
        width = self.rank * (len(self.part_rows) - 1)
        start = slot * width + part * self.rank
        return slice(start, start + self.rank)


@dataclass
class PassRows:
    """What the runner said of the next pass's rows: whether any runs with an adapter; and whether passes
    run now, captured as CUDA graphs too, may run the LoRA ops (not inside ``LoRASlots.without_lora``)."""

    any_adapter: bool = True  # until a pass is described, assume so (profiling counts LoRA's memory)
    lora_ops: bool = True


class LayerLoRA:
    """A decoder layer's adapters: ``apply(kind, x, y)`` is projection output ``y`` with what the batch's
    adapters add to it (the op table's ``lora_apply``: kernels/lora.py, kernels/triton_lora.py). An eager
    pass in which no row has an adapter skips it; a pass being captured as a CUDA graph does not (it is
    replayed for batches with adapters too), except inside ``LoRASlots.without_lora``, where every pass
    skips it."""

    def __init__(self, projections: dict[str, ProjectionLoRA], row_slots: torch.Tensor, ops: Ops,
                 rows: PassRows) -> None:  # fmt: skip
        self.projections = projections
        self.row_slots = row_slots  # [rows, S]: 1 in the column of each row's slot (LoRASlots.set_rows)
        self.ops = ops
        self.rows = rows

    def apply(self, kind: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if not self.rows.lora_ops:
            return y
        if not self.rows.any_adapter and not (x.is_cuda and torch.cuda.is_current_stream_capturing()):
            return y
        p = self.projections[kind]
        return self.ops.lora_apply(x, p.a, p.b, self.row_slots, y)


@dataclass
class _Slot:
    name: str | None = None
    refs: int = 0  # running requests using it


@dataclass
class LoRASlots:
    """The device slots, the adapters registered in host memory, and which request uses which slot."""

    cfg: ModelConfig
    max_loras: int
    max_rank: int
    max_rows: int
    dtype: torch.dtype
    device: torch.device
    ops: Ops
    adapters: dict[str, LoRAAdapter] = field(default_factory=dict)
    slots: list[_Slot] = field(default_factory=list)
    _lru: OrderedDict[int, None] = field(default_factory=OrderedDict)  # slots, least recently used first
    layers: list[LayerLoRA] = field(default_factory=list)
    row_slots: torch.Tensor = field(init=False)
    rows: PassRows = field(default_factory=PassRows)

    def __post_init__(self) -> None:
        self.slots = [_Slot() for _ in range(self.max_loras)]
        self._lru = OrderedDict((i, None) for i in range(self.max_loras))
        self.row_slots = torch.zeros((self.max_rows, self.max_loras), dtype=self.dtype, device=self.device)
        cfg, s, r = self.cfg, self.max_loras, self.max_rank
        for layer in range(cfg.num_layers):
            moe = bool(cfg.moe_layers and cfg.moe_layers[layer])
            projections = {}
            for kind, modules in parts(cfg).items():
                if moe and kind in ("gate_up", "down"):
                    continue
                shapes = [module_shape(cfg, m) for m in modules]
                in_dim = shapes[0][0]
                bounds = [0]
                for _, out_dim in shapes:
                    bounds.append(bounds[-1] + out_dim)
                width = s * r * len(modules)
                projections[kind] = ProjectionLoRA(
                    a=torch.zeros((width, in_dim), dtype=self.dtype, device=self.device),
                    b=torch.zeros((bounds[-1], width), dtype=self.dtype, device=self.device),
                    part_rows=tuple(bounds),
                    rank=r,
                )
            self.layers.append(LayerLoRA(projections, self.row_slots, self.ops, self.rows))

    # ---- adapters ------------------------------------------------------------------------------------
    def load(self, name: str, path: str | Path) -> LoRAAdapter:
        """Read the PEFT adapter at ``path`` for this model (``LoRAAdapter.load``), in pinned host memory on
        a GPU, so that a slot's fill is an asynchronous copy and does not wait for the step in flight."""
        adapter = LoRAAdapter.load(name, path, self.cfg, self.max_rank, self.dtype)
        if self.device.type == "cuda":
            adapter.weights = {
                layer: {m: (a.pin_memory(), b.pin_memory()) for m, (a, b) in modules.items()}
                for layer, modules in adapter.weights.items()
            }
        return adapter

    def add(self, adapter: LoRAAdapter) -> None:
        """Register (or replace, when no running request uses it) an adapter under its name."""
        slot = self._slot_of(adapter.name)
        if slot is not None:
            if self.slots[slot].refs:
                raise LoRAError(
                    f"LoRA adapter {adapter.name!r} is in use by running requests; it cannot be replaced now"
                )
            self.slots[slot].name = None
        self.adapters[adapter.name] = adapter

    def remove(self, name: str) -> None:
        if name not in self.adapters:
            raise LoRAError(f"no LoRA adapter named {name!r}")
        slot = self._slot_of(name)
        if slot is not None:
            if self.slots[slot].refs:
                raise LoRAError(
                    f"LoRA adapter {name!r} is in use by running requests; it cannot be removed now"
                )
            self.slots[slot].name = None
        del self.adapters[name]

    def check(self, name: str) -> None:
        if name not in self.adapters:
            known = ", ".join(sorted(self.adapters)) or "none"
            raise InvalidRequestError(f"LoRA adapter {name!r} is not loaded (loaded: {known})")

    # ---- slots -----------------------------------------------------------------------------------------
    def _slot_of(self, name: str) -> int | None:
        for i, slot in enumerate(self.slots):
            if slot.name == name:
                return i
        return None

    def _free_slot(self) -> int | None:
        """A slot that no running request uses, least recently used first (an empty one before any)."""
        for i, slot in enumerate(self.slots):
            if slot.name is None:
                return i
        for i in self._lru:
            if self.slots[i].refs == 0:
                return i
        return None

    def can_admit(self, names: list[str | None]) -> bool:
        """Whether requests with these adapters (None: none) could all take slots now: the adapters not
        in a slot are no more than the slots that hold nothing, or an adapter no running request and none
        of these uses."""
        wanted = {n for n in names if n is not None}
        missing = {n for n in wanted if self._slot_of(n) is None}
        if not missing:
            return True
        spare = sum(1 for s in self.slots if s.name is None or (s.refs == 0 and s.name not in wanted))
        return len(missing) <= spare

    def acquire(self, name: str) -> int:
        """The slot of ``name`` for one more running request, loading it into a free slot if needed."""
        slot = self._slot_of(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                raise RuntimeError(f"no free LoRA slot for {name!r} (can_admit was not asked)")
            self._fill(slot, self.adapters[name])
        self.slots[slot].refs += 1
        self._lru.move_to_end(slot)
        return slot

    def release(self, slot: int) -> None:
        self.slots[slot].refs -= 1
        assert self.slots[slot].refs >= 0

    def _fill(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write ``adapter`` into ``slot`` of every projection (zeros where it adapts nothing). Queued on
        the device after any step in flight, which reads this slot only for rows that are dropped (a
        slot is refilled only when no running request uses it)."""
        for layer, lora in enumerate(self.layers):
            modules = adapter.weights.get(layer, {})
            for kind, p in lora.projections.items():
                width = p.a.shape[0] // self.max_loras
                p.a[slot * width : (slot + 1) * width].zero_()
                p.b[:, slot * width : (slot + 1) * width].zero_()
                for part, module in enumerate(parts(self.cfg)[kind]):
                    if module not in modules:
                        continue
                    a, b = modules[module]
                    cols = p.columns(slot, part)
                    r = a.shape[0]
                    rows = slice(p.part_rows[part], p.part_rows[part + 1])
                    p.a[cols.start : cols.start + r].copy_(a, non_blocking=True)
                    p.b[rows, cols.start : cols.start + r].copy_(b, non_blocking=True)
        self.slots[slot].name = adapter.name
        log.info("LoRA adapter %r in slot %d", adapter.name, slot)

    @contextmanager
    def without_lora(self) -> Iterator[None]:
        """Passes run inside, and CUDA graphs captured inside, run no LoRA op: the graphs a runner replays
        for passes in which no row has an adapter (vLLM's ``cudagraph_specialize_lora``), so base-model
        requests on a LoRA engine pay nothing for it."""
        self.rows.lora_ops = False
        try:
            yield
        finally:
            self.rows.lora_ops = True

    def set_rows(self, row_slots: np.ndarray) -> None:
        """The slot of each row of the next pass (-1: no adapter), from the host, as the one-hot rows the
        projections multiply by."""
        n = row_slots.shape[0]
        if n > self.max_rows:
            raise ValueError(f"a pass of {n} rows; the LoRA row buffer holds {self.max_rows}")
        onehot = torch.zeros((n, self.max_loras), dtype=self.dtype)
        rows = np.flatnonzero(row_slots >= 0)
        self.rows.any_adapter = bool(len(rows))
        if len(rows):
            onehot[torch.from_numpy(rows), torch.from_numpy(row_slots[rows].astype(np.int64))] = 1
        if self.device.type == "cuda":
            onehot = onehot.pin_memory()
        self.row_slots[:n].copy_(onehot, non_blocking=True)


def parse_lora_modules(entries: list[str]) -> list[tuple[str, str]]:
    """vLLM's ``--lora-modules``: each ``name=path``, or JSON ``{"name": ..., "path": ...}``."""
    out = []
    for entry in entries:
        entry = entry.strip()
        if entry.startswith("{"):
            try:
                spec = json.loads(entry)
                out.append((str(spec["name"]), str(spec["path"])))
            except (ValueError, KeyError, TypeError) as exc:
                raise LoRAError(
                    f'lora_modules entry {entry!r}: JSON needs "name" and "path" ({exc})'
                ) from exc
            continue
        name, sep, path = entry.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise LoRAError(f"lora_modules entry {entry!r}: expected name=path or a JSON object")
        out.append((name.strip(), path.strip()))
    return out
