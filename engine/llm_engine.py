"""The engine: requests in, token outputs out, one ``step()`` at a time.

Owns the model, the KV pool, the block pool, the scheduler and the sampler. Single-threaded: callers
on other threads go through ``engine.async_engine``. In the prefill role a request can hold its prompt's
KV blocks after its first token (``hold_kv``) until ``release_held``; in the decode role a request can
arrive with its prompt's KV imported into reserved blocks (``reserve_import`` / ``commit_import``).

With ``async_scheduling`` a steady pure decode batch runs one step ahead: ``step()`` launches the next
decode step on the previous step's sampled tokens, still on the device, and only then reads those tokens
and processes them (stop checks, outputs) while the device computes. Anything else drains the step in
flight first and runs synchronously, so the outputs are those of the synchronous engine
(docs/architecture.md, "Asynchronous scheduling").
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from engine.block_pool import BlockPool
from engine.config import EngineConfig
from engine.device_copy import host_to_device
from engine.errors import CapacityError, InvalidRequestError
from engine.kv_cache import allocate_pool, kv_dtype_name, make_layout, num_blocks_for
from engine.kv_offload import KVOffload
from engine.loader import load_model, resolve_dtype
from engine.lora import LoRAError, LoRASlots, parse_lora_modules
from engine.memory_profile import (
    GIB,
    DeviceMemory,
    MemoryProfile,
    check_free,
    kv_blocks_within,
    profile_memory,
)
from engine.model_runner import ModelRunner, block_table_array
from engine.models.decoder import DecoderModel
from engine.models.mtp import MTPStep, chain_step
from engine.moe.dispatch import TokenDispatcher
from engine.moe.rebalance import move_experts
from engine.pooling import ModelPooling, PoolingParams
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.sequence import Sequence, SequenceStatus, TokenLogprobs
from engine.speculative import MtpSpec, parse_speculative_config, propose
from engine.structured_outputs import GrammarCompiler, apply_grammar_masks
from engine.tokenizer import IncrementalDetokenizer, find_stop
from kernels import get_ops
from kernels.kv_cache import FP8_KV_DTYPES
from mesh.block_hash import root_hash, salted_fingerprint
from mesh.expert_placement import MoELayout, PlacementError, check_placement
from mesh.kv_events import KVEventSink
from mesh.kv_layout import KVLayout

log = logging.getLogger(__name__)

PREFILL_DONE = "prefill_done"  # finish reason of a hold_kv request whose decode continues elsewhere
# Prefill sizes run once at start on GPUs (besides the step budget): one per size class of the Triton
# kernels' launch choices (MoE tiles by pairs per expert, routing tiles, the single- and multi-program
# MoE alignments: 16 tokens take the single program at top-8, 128 and up the multi-program one).
WARM_UP_TOKENS = (16, 128, 256, 512, 1024)
CPU_KV_CACHE_GB = 0.5  # the KV pool on the CPU when no size is given


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # With SamplingParams.prompt_logprobs, on the output that carries the first token: one entry per prompt
    # token, None for the first.
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0
    text: str | None = None  # full text, set when finished (truncated before a matched stop string)
    arrival_time_ns: int = 0
    first_scheduled_ns: int = 0
    first_token_ns: int = 0
    # An embedding request's (engine.pooling): its pooled hidden states, on the output that finishes it.
    embedding: list[float] | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_held: int
    running_tokens: int
    queued_tokens: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    num_preemptions: int
    prompt_tokens_total: int
    cached_prompt_tokens_total: int
    generated_tokens_total: int
    lookahead_steps: int = 0  # steps launched before the previous step's tokens were read
    lookahead_drains: int = 0  # steps in flight read out first because the next step could not overlap
    lookahead_late_waits: int = 0  # waits for a step in flight to reach its last piece (serving loops)
    lookahead_joins: int = 0  # waiting requests (imports, new prompts) a lookahead step took in, no drain
    # With several expert-parallel ranks: passes of padding only run to join the others' steps, and the
    # host time spent agreeing with them on each step (engine.data_parallel).
    idle_passes: int = 0
    group_sync_seconds: float = 0.0
    # Forward passes by how they ran: a decode CUDA graph, the piecewise prefill graphs, or eagerly.
    decode_graph_passes: int = 0
    prefill_graph_passes: int = 0
    eager_passes: int = 0
    # Speculative decoding (engine.speculative): draft tokens computed, and those the sampling kept; drafts
    # verified (one a drafting request a step), and of them those whose i-th token was kept, by i.
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_drafts: int = 0
    spec_accepted_per_pos: tuple[int, ...] = ()


@dataclass
class _InFlight:
    """A launched step whose sampled tokens the host has not read yet (asynchronous scheduling).

    Each of ``seqs`` has ``num_computed_tokens == num_tokens``: its next token exists on the device only,
    so nothing on the host (stop checks, block hashes) has seen it."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [n] int64 on the device: the next lookahead step's input ids
    host_tokens: torch.Tensor  # their copy on the host, complete once ``copied`` has fired
    copied: torch.cuda.Event | None  # None on the CPU, where host_tokens is tokens
    late_point: torch.cuda.Event | None = None  # before the step's last decode-graph piece, if it has one

    @classmethod
    def start(
        cls, seqs: list[Sequence], tokens: torch.Tensor, late_point: torch.cuda.Event | None = None
    ) -> _InFlight:
        """Queue the tokens' copy to the host now, before the next step's work is queued behind it."""
        if not tokens.is_cuda:
            return cls(seqs, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(seqs, tokens, host, copied, late_point)

    def read(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host_tokens.tolist()


def _join_expert_parallel_group(config: EngineConfig) -> tuple[TokenDispatcher, bool]:
    """This process's rank of the expert-parallel group the config describes (torch.distributed, NCCL on
    CUDA with one GPU a rank, gloo on the CPU; joined here unless the caller already did): the dispatcher
    over it, and whether this call joined the group."""
    import torch.distributed as dist

    from engine.moe.dispatch import AllGatherDispatcher

    joined = not dist.is_initialized()
    if joined:
        cuda = config.device == "cuda"
        if cuda:
            torch.cuda.set_device(config.expert_parallel_rank % torch.cuda.device_count())
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method=config.distributed_init_method,
            rank=config.expert_parallel_rank,
            world_size=config.expert_parallel_size,
            timeout=datetime.timedelta(seconds=config.distributed_timeout_s),
        )
    if dist.get_world_size() != config.expert_parallel_size:
        raise ValueError(
            f"expert_parallel_size={config.expert_parallel_size} but the process group has "
            f"{dist.get_world_size()} ranks"
        )
    log.info("expert-parallel rank %d of %d (%s)", dist.get_rank(), dist.get_world_size(), dist.get_backend())
    return AllGatherDispatcher(), joined


class LLMEngine:
    # Offloading to, and loading from, the KV offload store (``engine.kv_offload``); a worker that uses a
    # store sets it. None: finished requests' blocks just stay in the prefix cache.
    kv_offload: KVOffload | None = None

    def __init__(
        self,
        config: EngineConfig,
        event_sink: KVEventSink | None = None,
        dispatcher: TokenDispatcher | None = None,
    ) -> None:
        # Whether this engine joined the expert-parallel process group itself (``close`` then leaves it).
        self._owns_group = False
        if dispatcher is None and config.expert_parallel_size > 1:
            dispatcher, self._owns_group = _join_expert_parallel_group(config)
        multi_rank = dispatcher is not None and dispatcher.ep_size > 1
        if multi_rank and config.async_scheduling and not config.expert_parallel_async_scheduling:
            log.info(
                "asynchronous scheduling is off with several expert-parallel ranks "
                "(expert_parallel_async_scheduling keeps it)"
            )
            config = dataclasses.replace(config, async_scheduling=False)
        if config.speculative_config and config.async_scheduling:
            log.info(
                "asynchronous scheduling is off with speculative decoding (a draft needs the host's tokens)"
            )
            config = dataclasses.replace(config, async_scheduling=False)
        if config.dtype == "auto":
            config = dataclasses.replace(config, dtype=resolve_dtype(config.model, config.dtype))
        self.config = config
        if config.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device='cuda' was asked for but no CUDA GPU is visible; use device='cpu'")
        if config.device == "cpu" and config.dtype == "float16":
            log.warning("float16 on the CPU is slow; float32 or bfloat16 is recommended")
        self.device = torch.device(config.device)
        self.ops = get_ops(config.kernel_backend)
        # Sizing the KV pool by gpu_memory_utilization measures the load and a profiling pass against
        # this reading (engine.memory_profile).
        by_utilization = (
            self.device.type == "cuda" and config.num_kv_blocks is None and config.kv_cache_memory_gb is None
        )
        start_memory = DeviceMemory.read(self.device) if by_utilization else None
        if start_memory is not None:
            check_free(start_memory, config.gpu_memory_utilization)
        self.spec = parse_speculative_config(config.speculative_config)
        loaded = load_model(
            config.model,
            config.dtype,
            self.device,
            self.ops,
            config.max_model_len,
            load_format=config.load_format,
            seed=config.seed,
            dispatcher=dispatcher,
            quantization=config.quantization,
            num_redundant_experts=config.num_redundant_experts,
            mtp=self.mtp,  # the checkpoint's MTP layer loaded (engine.models.mtp), its KV a pool layer more
        )
        if config.enable_eplb and not loaded.cfg.is_moe:
            raise ValueError(f"enable_eplb: {config.model} has no MoE layers")
        prefill_graph_tokens = min(config.prefill_graph_tokens, config.max_num_batched_tokens)
        # DeepSeek (engine.models.mla): a float8 latent pool holds the latents unscaled
        if loaded.cfg.mla is not None and config.kv_cache_dtype != "auto" and _kv_scaled_layers(loaded.model):
            raise ValueError(
                f"kv_cache_dtype {config.kv_cache_dtype}: {loaded.cfg.architecture}'s latent KV is stored "
                "unscaled in a float8 pool; calibrated KV scales (k_scale, v_scale) for latent attention "
                "are not served"
            )
        self.placement_version = 0  # the expert placement the MoE layers run (0: the initial one)
        # With several ranks, a newer placement waiting for every rank (version, physical -> logical).
        self.staged_placement: tuple[int, list[list[int]]] | None = None
        self.max_model_len = config.max_model_len or loaded.cfg.max_position_embeddings
        self.model_config = loaded.cfg
        self.pooling = ModelPooling.of(loaded.path, loaded.cfg.hidden_size, loaded.cfg.num_labels)
        self.model = loaded.model
        # False: a base model's checkpoint, which only embeds, or a classifier's, which classifies or embeds
        self.generates = loaded.has_lm_head
        self.lora = self._serve_loras(config, loaded.model) if config.enable_lora else None
        self.tokenizer = loaded.tokenizer
        # With an engine-wide cache salt the engine is its own cache domain (mesh.block_hash).
        self.model_fingerprint = salted_fingerprint(loaded.fingerprint, config.cache_salt)
        self.eos_token_ids = frozenset(loaded.cfg.eos_token_ids)
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.cfg.vocab_size, self.eos_token_ids)
        kv_dtype = kv_dtype_name(config.kv_cache_dtype, config.dtype)
        self.layout: KVLayout = make_layout(
            loaded.cfg, loaded.fingerprint, kv_dtype, config.block_size, draft_layers=int(self.mtp)
        )
        self.sampler = Sampler(config.seed, config.kernel_backend)
        self.memory_profile: MemoryProfile | None = None
        self.graph_memory_bytes: int | None = None  # measured when the pool is sized by utilization
        if config.num_kv_blocks is not None:
            num_blocks = config.num_kv_blocks
        elif start_memory is None:
            num_blocks = num_blocks_for(self.layout, config.kv_cache_memory_gb or CPU_KV_CACHE_GB)
        else:
            num_blocks = self._profile_kv_blocks(start_memory)
        self.kv_pool = allocate_pool(self.layout, num_blocks, self.device)
        before_graphs = DeviceMemory.read(self.device) if start_memory is not None else None
        self.kv_scaled_layers = _kv_scales_in_use(self.model, self.kv_pool.dtype)
        self.root_hash = root_hash(self.model_fingerprint)
        self.block_pool = BlockPool(
            num_blocks, config.block_size, self.root_hash, config.enable_prefix_caching, event_sink
        )
        self.scheduler = Scheduler(
            self.block_pool, config.max_num_seqs, config.max_num_batched_tokens, config.scheduling_policy,
            self.lora,
        )  # fmt: skip
        self.runner = ModelRunner(
            self.model,
            self.kv_pool,
            config.block_size,
            self.device,
            cuda_graphs=config.cuda_graphs,
            prefill_graph_tokens=prefill_graph_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            decode_megakernel=config.decode_megakernel,
            specialize_lora=config.cudagraph_specialize_lora,
            keep_hidden=self.mtp,
            draft_tokens=self.spec.num_tokens if self.spec is not None else 1,
        )
        if start_memory is not None and before_graphs is not None:
            self._log_memory(num_blocks, start_memory, before_graphs)
        if self.runner.compiles_kernels:  # compile the prefill and sampling variants now, graphs or not
            cap = min(config.max_num_batched_tokens, self.max_model_len - 1)
            sizes = sorted({min(n, cap) for n in (*WARM_UP_TOKENS, cap)} - {0})
            seconds = self.runner.warm_up(sizes, self.sampler)
            log.info(
                "warmed up the eager prefill kernels for %s tokens (less those the prefill graphs cover) "
                "and the sampling kernels in %.1f s",
                sizes,
                seconds,
            )
        self._seqs: dict[str, Sequence] = {}  # unfinished, by request id
        self._held: dict[str, Sequence] = {}  # finished prefill requests still holding their KV blocks
        self._imports: dict[str, Sequence] = {}  # decode-side requests whose KV is being pulled
        self._detok: dict[str, IncrementalDetokenizer] = {}
        self._pending: list[RequestOutput] = []
        # Unfinished requests with prompt logprobs still to compute (most steps have none: no scan then).
        self._scoring: set[str] = set()
        # Unfinished requests held to a grammar (structured outputs): steps look for their rows only then.
        self._constrained: set[str] = set()
        self._inflight: _InFlight | None = None  # async_scheduling: the step whose tokens are unread
        self._after_inflight: list[Callable[[], None]] = []  # run once that step is processed
        self.lookahead_steps = 0
        self.lookahead_drains = 0
        self.lookahead_late_waits = 0
        self.lookahead_joins = 0
        # New prompts may join a lookahead step (``_joining``); benchmarks turn it off to compare with the
        # behaviour before it, in which a waiting prompt drained the step in flight.
        self.lookahead_join_prompts = True
        # Recorded after a lookahead step whose sequences finished (and freed their blocks) while its
        # kernels may still write their KV; a KV transfer into freed blocks waits for it.
        self._freed_while_running: torch.cuda.Event | None = None
        self.prompt_tokens_total = 0
        self.cached_prompt_tokens_total = 0
        self.generated_tokens_total = 0
        self._spec_prompts: weakref.WeakKeyDictionary[Sequence, np.ndarray] = weakref.WeakKeyDictionary()
        # MTP drafts for the next step: (the request's token count when drafted, the draft tokens).
        self._mtp_drafts: weakref.WeakKeyDictionary[Sequence, tuple[int, list[int]]] = (
            weakref.WeakKeyDictionary()
        )
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_drafts = 0
        self.spec_accepted_per_pos = [0] * (self.spec.num_tokens if self.spec is not None else 0)

    def _serve_loras(self, config: EngineConfig, model: DecoderModel) -> LoRASlots:
        """The adapters' device slots, given to every decoder layer (before any graph is captured), with
        the adapters of ``lora_modules`` registered."""
        slots = LoRASlots(
            model.cfg, config.max_loras, config.max_lora_rank,
            max(config.max_num_batched_tokens, config.max_num_seqs), model.embed_tokens.dtype, self.device,
            self.ops,
        )  # fmt: skip
        for layer, layer_lora in zip(model.layers, slots.layers, strict=True):
            layer.lora = layer_lora
        model.lora_slots = slots
        for name, path in parse_lora_modules(config.lora_modules):
            slots.add(slots.load(name, path))
        log.info(
            "LoRA: %d slots of rank %d; adapters %s", config.max_loras, config.max_lora_rank,
            sorted(slots.adapters) or "none yet",
        )  # fmt: skip
        return slots

    def add_lora(self, name: str, path: str) -> None:
        """Register the PEFT adapter at ``path`` under ``name`` (vLLM's load_lora_adapter); it takes a
        device slot when a request first runs with it. Raises ``LoRAError`` for an adapter this engine
        cannot serve, and when LoRA is not enabled. Registering a name again replaces its adapter when no
        request uses it; the prefix cache is then emptied of what was not in use (its blocks are keyed by
        the adapter's name, and the old adapter's KV must not serve the new one's requests)."""
        if self.lora is None:
            raise LoRAError("this engine serves no LoRA adapters (enable_lora)")
        adapter = self.lora.load(name, path)
        replacing = name in self.lora.adapters
        if replacing:
            self._check_unused(name)
        self.lora.add(adapter)
        if replacing:
            self.reset_prefix_cache()

    def remove_lora(self, name: str) -> None:
        """Unregister an adapter no request uses (vLLM's unload_lora_adapter); empties the prefix cache of
        unused blocks, as ``add_lora`` does when it replaces one."""
        if self.lora is None:
            raise LoRAError("this engine serves no LoRA adapters (enable_lora)")
        self._drain_inflight()
        self._check_unused(name)
        self.lora.remove(name)
        self.reset_prefix_cache()

    def _check_unused(self, name: str) -> None:
        users = [
            rid
            for group in (self._seqs, self._imports)
            for rid, seq in group.items()
            if seq.lora_name == name
        ]
        if users:
            raise LoRAError(
                f"LoRA adapter {name!r} is in use by {len(users)} unfinished request(s) ({users[0]}, ...); "
                "it cannot be replaced or removed now"
            )

    def list_loras(self) -> list[str]:
        return sorted(self.lora.adapters) if self.lora is not None else []

    def _profile_kv_blocks(self, start: DeviceMemory) -> int:
        """The pool's blocks within ``gpu_memory_utilization`` of the GPU, from a profiling pass."""
        config = self.config
        spec = parse_speculative_config(config.speculative_config)
        rows = config.max_num_seqs * (1 + (spec.num_tokens if spec else 0))
        tokens = min(config.max_num_batched_tokens, self.max_model_len)
        self.memory_profile = profile_memory(
            start, config.gpu_memory_utilization, self.model, self.layout, self.sampler, tokens,
            min(rows, tokens),
        )  # fmt: skip
        return kv_blocks_within(
            self.memory_profile, self.layout, self.max_model_len, config.gpu_memory_utilization
        )

    def _log_memory(self, num_blocks: int, start: DeviceMemory, before_graphs: DeviceMemory) -> None:
        """After the graphs' capture: the profile, what the graphs took, and a warning when the engine's
        memory has passed its budget (the graphs come out of the fraction left over)."""
        profile = self.memory_profile
        assert profile is not None
        now = DeviceMemory.read(self.device)
        self.graph_memory_bytes = before_graphs.free - now.free
        used = start.free - now.free
        log.info(
            "KV pool sized by gpu_memory_utilization=%s: %d blocks (%d tokens); %s; CUDA graphs then took "
            "%.2f GiB; the engine uses %.2f GiB",
            self.config.gpu_memory_utilization, num_blocks, num_blocks * self.config.block_size,
            profile.describe(), self.graph_memory_bytes / GIB, used / GIB,
        )  # fmt: skip
        if used > profile.budget:
            log.warning(
                "the engine uses %.2f GiB, more than gpu_memory_utilization=%s allows (%.2f GiB): CUDA "
                "graphs took %.2f GiB of the fraction left over",
                used / GIB, self.config.gpu_memory_utilization, profile.budget / GIB,
                self.graph_memory_bytes / GIB,
            )  # fmt: skip

    # ---- requests ------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def validate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        lora_name: str | None = None,
        pooling: bool = False,
    ) -> None:
        """``pooling``: an embedding request, which generates nothing, so its prompt may fill
        ``max_model_len``."""
        if request_id in self._seqs or request_id in self._held or request_id in self._imports:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        if not pooling and not self.generates:
            raise InvalidRequestError(
                "this model's checkpoint has no LM head (a classifier's or a base model's weights): it "
                "serves embeddings"
                + (" and classification" if self.model_config.num_labels else "")
                + " only"
            )
        if lora_name is not None:
            if self.lora is None:
                raise InvalidRequestError(
                    f"LoRA adapter {lora_name!r} asked for, but this engine serves none (enable_lora)"
                )
            self.lora.check(lora_name)
        if not prompt_token_ids:
            raise InvalidRequestError("prompt is empty: it must have at least one token")
        n = len(prompt_token_ids)
        if pooling and n > self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens, more than max_model_len ({self.max_model_len})"
            )
        if not pooling and n >= self.max_model_len:
            raise InvalidRequestError(
                f"prompt has {n} tokens, max_model_len is {self.max_model_len}: it must be shorter to leave "
                "room for at least one generated token"
            )
        bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)]
        if bad:
            raise InvalidRequestError(
                f"prompt token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})"
            )
        params.validate(self.vocab_size)
        params.tokenize_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        outside = [t for ids in params.bad_words_token_ids for t in ids if not 0 <= t < self.vocab_size]
        if outside:
            raise InvalidRequestError(
                f"bad_words tokenize to ids {outside[:5]} outside the model's vocabulary"
            )
        if params.priority and self.config.scheduling_policy != "priority":
            raise InvalidRequestError(
                f"priority {params.priority} needs the priority scheduling policy; this engine schedules "
                f"{self.config.scheduling_policy} (--scheduling-policy priority)"
            )
        if params.structured_outputs is not None:  # compiled once: serving code does it off this thread
            self.grammars.compile(params.structured_outputs)
        need = -(-(n + 1) // self.config.block_size)
        if need > self.block_pool.num_blocks:
            raise InvalidRequestError(
                f"prompt needs {need} KV blocks but the pool has only {self.block_pool.num_blocks}"
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_kv: bool = False,
        cache_salt: str | None = None,
        lora_name: str | None = None,
        pooling: PoolingParams | None = None,
    ) -> None:
        """``lora_name``: the registered LoRA adapter the request runs with (``add_lora``), None for the
        base model. ``pooling``: an embedding request (``engine.pooling``): it computes its prompt and
        finishes with ``RequestOutput.embedding`` instead of sampling (``params`` then counts only for its
        priority)."""
        prompt_token_ids = list(prompt_token_ids)
        if pooling is not None:
            if hold_kv:
                raise ValueError("an embedding request has no KV to hold for a decode worker")
            pooling = self.pooling.resolve(pooling)
            params = SamplingParams(max_tokens=1, priority=params.priority)
        self.validate(request_id, prompt_token_ids, params, lora_name, pooling is not None)
        seq = Sequence(
            request_id,
            prompt_token_ids,
            params,
            hold_kv=hold_kv,
            arrival_time_ns=time.time_ns(),
            root_hash=self._salted_root(cache_salt, lora_name),
            lora_name=lora_name,
            pooling=pooling,
        )
        self._start_grammar(seq)
        if seq.grammar is not None:
            self._constrained.add(request_id)
        self._seqs[request_id] = seq
        if params.stop:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens)
        if seq.wants_prompt_logprobs:
            self._scoring.add(request_id)
        self.scheduler.add(seq)

    def _salted_root(self, cache_salt: str | None, lora_name: str | None = None) -> int | None:
        """A request's own cache salt, and its LoRA adapter, isolate its prefix cache entries within the
        engine's domain (None: the engine's root)."""
        if not cache_salt and not lora_name:
            return None
        return root_hash(self.model_fingerprint, cache_salt, lora_name)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is; its blocks go back to the pool. Returns whether it existed."""
        if request_id in self._held:
            self.release_held(request_id)
            return True
        if request_id in self._imports:
            self.cancel_import(request_id)
            return True
        self._drain_inflight()  # the synchronous engine would have processed that step already
        seq = self._seqs.get(request_id)
        if seq is None:
            return False
        seq.hold_kv = False
        self.scheduler.finish(seq, "abort")
        self._finalize(seq)
        self._pending.append(self._output(seq, []))
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self._pending)

    # ---- prefill role: holding KV for a decode worker --------------------------------------------
    def held_blocks(self, request_id: str) -> list[int]:
        """Blocks holding the prompt's KV of a finished ``hold_kv`` request."""
        seq = self._held[request_id]
        n = -(-len(seq.prompt_token_ids) // self.config.block_size)
        return seq.block_table[:n]

    def release_held(self, request_id: str) -> bool:
        if request_id not in self._held:
            self._drain_inflight()  # the step in flight may be the one that finishes it
        seq = self._held.pop(request_id, None)
        if seq is None:
            return False

        def free() -> None:
            self.block_pool.free(seq)
            if self.kv_offload is not None:
                self.kv_offload.collect(seq)
            self.block_pool.flush_events()

        self.after_inflight(free)
        return True

    def after_inflight(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (a free of blocks no step uses) where the synchronous engine would have run it: now
        without a step in flight, else right after that step's tokens are processed. The prefix cache's LRU
        order and its KV events then stay the synchronous engine's without reading the step out early (a
        host wait, which freeing at once would need)."""
        if self._inflight is None:
            fn()
        else:
            self._after_inflight.append(fn)

    def _run_after_inflight(self) -> None:
        while self._after_inflight:
            fns, self._after_inflight = self._after_inflight, []
            for fn in fns:
                fn()

    # ---- decode role: importing KV from a prefill worker -----------------------------------------
    def reserve_import(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None = None,
        lora_name: str | None = None,
    ) -> list[int]:
        """Validate and allocate blocks for a prompt whose KV will be pulled in; returns their ids. The
        prompt is not computed here, so neither are its logprobs (the prefill worker's reply has them)."""
        prompt_token_ids = list(prompt_token_ids)
        self.validate(request_id, prompt_token_ids, params, lora_name)
        if params.prompt_logprobs is not None:
            params = dataclasses.replace(params, prompt_logprobs=None)
        n_blocks = -(-len(prompt_token_ids) // self.config.block_size)
        blocks = self.take_transfer_blocks(n_blocks)
        if blocks is None:
            raise CapacityError(f"no room for {n_blocks} KV blocks ({self.block_pool.num_free_blocks} free)")
        seq = Sequence(
            request_id,
            prompt_token_ids,
            params,
            root_hash=self._salted_root(cache_salt, lora_name),
            lora_name=lora_name,
        )
        seq.block_table = blocks
        seq.kv_imported = True
        self._start_grammar(seq)
        self._imports[request_id] = seq
        return blocks

    def take_transfer_blocks(self, n_blocks: int) -> list[int] | None:
        """``n_blocks`` fresh blocks, one reference each, for KV a transfer will write (a KV import, a load
        from the KV offload store); None when they do not fit."""
        # With a step in flight, blocks that are free now and hold no cached content are taken without
        # reading that step: what it finishes frees more blocks but cannot take these, and taking them
        # evicts nothing, so outputs and KV events stay the synchronous engine's (only block ids differ,
        # which nothing observes). Where an eviction would be needed, the step is read first, as the
        # synchronous engine would have: which block is evicted depends on the requests it finishes.
        if n_blocks > self.block_pool.num_uncached_free_blocks:
            self._drain_inflight()
        self.wait_freed_kv_writes()
        blocks = self.block_pool.allocate_blocks(n_blocks)
        self.block_pool.flush_events()
        return blocks

    def wait_freed_kv_writes(self) -> None:
        """Wait for the device where a request that finished on content during a lookahead step freed
        blocks while that step's kernels may still write its last KV slot: a KV transfer into (or out of)
        those blocks is not ordered after them."""
        if self._freed_while_running is not None:  # also when no step is in flight any more
            self._freed_while_running.synchronize()
            self._freed_while_running = None

    def enable_kv_offload(self, max_held_blocks: int, at_prefill: bool = False) -> KVOffload:
        """Offer requests' blocks to a KV offload store and accept blocks loaded from it (``engine.kv_offload``):
        when they finish, and with ``at_prefill`` also their prompt's blocks as soon as it is computed (at
        the first token); returns the engine's ``KVOffload``."""
        if self.kv_offload is None:
            self.kv_offload = KVOffload(self, max_held_blocks)
        self.kv_offload.at_prefill = at_prefill
        return self.kv_offload

    def _start_grammar(self, seq: Sequence) -> None:
        if seq.params.structured_outputs is not None:
            seq.grammar = self.grammars.matcher(seq.params.structured_outputs, seq.prompt_token_ids)

    def commit_import(
        self,
        request_id: str,
        first_token_id: int,
        first_logprobs: TokenLogprobs | None = None,
        num_cached_tokens: int = 0,
    ) -> None:
        """The reserved blocks now hold the prompt's KV: the request joins the batch with its first token
        (with a step in flight, the next lookahead step takes it in; see ``_joining``)."""
        seq = self._imports.pop(request_id)
        if not 0 <= first_token_id < self.vocab_size:
            self.block_pool.free(seq)
            raise InvalidRequestError(f"first token id {first_token_id} is outside the vocabulary")
        if seq.grammar is not None and not seq.grammar.allows(first_token_id):
            self.block_pool.free(seq)
            raise InvalidRequestError(
                f"first token id {first_token_id} is not allowed by the request's structured_outputs "
                "(was it sampled without the constraint?)"
            )
        seq.num_computed_tokens = len(seq.prompt_token_ids)
        seq.num_cached_tokens = num_cached_tokens
        self._seqs[request_id] = seq
        if seq.grammar is not None:
            self._constrained.add(request_id)
        if seq.params.stop:
            self._detok[request_id] = IncrementalDetokenizer(self.tokenizer, seq.params.skip_special_tokens)
        self._count_prompt(seq)
        self.block_pool.cache_full_blocks(seq)
        self._append_token(seq, first_token_id, first_logprobs)
        if seq.is_finished:
            self._pending.append(
                self._output(seq, [first_token_id], [first_logprobs] if first_logprobs else [])
            )
        else:
            seq._emitted = 1  # the caller already has the first token
            self.scheduler.add_imported(seq)
        self.block_pool.flush_events()

    def cancel_import(self, request_id: str) -> None:
        seq = self._imports.pop(request_id, None)
        if seq is not None:
            self.after_inflight(lambda: self.block_pool.free(seq))

    # ---- stepping ------------------------------------------------------------------------------
    def wait_for_lookahead_point(self) -> None:
        """For a serving loop, before it admits what arrived and calls ``step``: with a step in flight
        (asynchronous scheduling) that replays decode graphs, and ``lookahead_late_launch``, wait until
        the device reaches that step's last graph piece. ``step`` launches the next step as soon as it is
        called, behind the one in flight, so a request admitted after it would wait a whole step more;
        called here, it launches while the last piece still runs, with what arrived until then. The
        outputs are the same either way; only when requests are admitted changes."""
        inflight = self._inflight
        if inflight is None or inflight.late_point is None or not self.config.lookahead_late_launch:
            return
        inflight.late_point.synchronize()
        self.lookahead_late_waits += 1

    @property
    def mtp(self) -> bool:
        """Whether the checkpoint's multi-token-prediction layer drafts (engine.models.mtp): then every step
        keeps its hidden states for the layer's pass after it."""
        return isinstance(self.spec, MtpSpec)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending = self._pending, []
        if self._inflight is None:
            self._step_sync(outputs)
        elif not self._step_lookahead(outputs):
            self._drain_inflight(outputs)
            self._step_sync(outputs)
        self.block_pool.flush_events()
        return outputs

    def _step_sync(self, outputs: list[RequestOutput]) -> None:
        drafts = self._propose_drafts() if self.spec is not None else {}
        batch = self.scheduler.schedule()
        spec = self._settle_drafts(batch, drafts) if drafts else {}
        if not batch.seqs:
            return
        # Grammar masks depend only on tokens the host has: computed while the device runs the forward.
        grammar_masks = self._grammar_masks(batch.seqs) if self._constrained else None
        sample_seqs, logits, prompt_logprobs, spec_logits, pooled, mtp_step = self.runner.execute(
            batch, bool(self._scoring), {s: len(d) for s, d in spec.items()}, keep_hidden=self.mtp
        )
        for seq, found in prompt_logprobs:
            seq.prompt_logprobs += found
            if not seq.wants_prompt_logprobs:
                self._scoring.discard(seq.request_id)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            if seq in spec:  # only the last token is known to be the request's: the draft's KV waits
                n -= len(spec[seq])
                del seq.output_token_ids[-len(spec[seq]) :]
            seq.num_computed_tokens += n
            self.block_pool.cache_full_blocks(seq)
        if pooled:  # every embedding of the step read in one copy to the host
            values = torch.cat(list(pooled.values())).tolist()
            start = 0
            for seq, vec in pooled.items():
                self._finish_pooling(seq, values[start : start + vec.shape[0]], outputs)
                start += vec.shape[0]
        if spec:
            self._verify_drafts(spec, spec_logits, outputs)
            keep = [i for i, s in enumerate(sample_seqs) if s not in spec]
            if len(keep) < len(sample_seqs):
                index = torch.tensor(keep, dtype=torch.long, device=logits.device)
                sample_seqs, logits = [sample_seqs[i] for i in keep], logits.index_select(0, index)
        if sample_seqs:
            self._sample(batch, sample_seqs, logits, grammar_masks, outputs)
        if mtp_step is not None:
            self._mtp_pass(batch, mtp_step)

    def _sample(
        self,
        batch: ScheduledBatch,
        sample_seqs: list[Sequence],
        logits: torch.Tensor,
        grammar_masks: tuple[dict[Sequence, int], torch.Tensor] | None,
        outputs: list[RequestOutput],
    ) -> None:
        """Sample a step's rows (those without a draft) and append their tokens, or, with asynchronous
        scheduling where it can, leave the tokens on the device for the step launched next."""
        positions = [len(s.output_token_ids) for s in sample_seqs]
        params = [s.params for s in sample_seqs]
        if grammar_masks is not None:
            logits = self._apply_grammars(logits, sample_seqs, params, *grammar_masks)
        if self.config.async_scheduling and self._can_run_ahead(batch.seqs, sample_seqs):
            tokens = self.sampler.sample(logits, params, positions, eos_token_ids=self.eos_token_ids)
            self._inflight = _InFlight.start(sample_seqs, tokens, self.runner.late_point)
            return
        histories = (
            [(s.prompt_token_ids, s.output_token_ids) for s in sample_seqs]
            if any(p.has_penalties or p.bad_words_need_history for p in params)
            else None
        )
        token_list, logprobs = self.sampler(logits, params, positions, histories, self.eos_token_ids)
        for seq, tok, lp in zip(sample_seqs, token_list, logprobs, strict=True):
            self._count_prompt(seq)
            self._append_token(seq, tok, lp)
            outputs.append(self._output(seq))

    # ---- speculative decoding (engine.speculative) -----------------------------------------------
    def _propose_drafts(self) -> dict[Sequence, list[int]]:
        """Drafts for the decoding requests whose positions can be sampled from the logits alone (no
        penalties, bad words of several tokens, grammar, or KV to hold), appended to their outputs for the
        scheduler to see (``_settle_drafts`` takes back what it does not schedule). Only as many as the free
        blocks hold beyond what the running requests need without drafts, so a draft never preempts a
        request nor evicts a cached block."""
        spec = self.spec
        assert spec is not None
        pool, running = self.block_pool, self.scheduler.running
        # What the running requests need this step without drafts (a prompt's chunks, a decode's next
        # token) stays theirs.
        room = pool.num_uncached_free_blocks - sum(pool.blocks_needed(s, s.num_tokens + 1) for s in running)
        drafts: dict[Sequence, list[int]] = {}
        for seq in running:
            p = seq.params
            # (a penalty or a bad word of several tokens reads the output before each position: not drafted)
            if (
                seq.num_uncomputed_tokens != 1
                or seq.hold_kv
                or seq.grammar is not None
                or p.has_penalties
                or p.bad_words_need_history
            ):
                continue
            limit = min(p.max_tokens - len(seq.output_token_ids), self.max_model_len - seq.num_tokens) - 1
            if limit <= 0:
                continue
            if isinstance(spec, MtpSpec):  # what the MTP layer predicted after the last step, if it did
                drafted = self._mtp_drafts.get(seq)
                draft = drafted[1][:limit] if drafted is not None and drafted[0] == seq.num_tokens else []
            else:
                prompt = self._spec_prompts.get(seq)
                if prompt is None:  # the prompt as an array once, not its Python list every step
                    prompt = self._spec_prompts[seq] = np.asarray(seq.prompt_token_ids, dtype=np.int64)
                draft = propose(
                    np.concatenate([prompt, np.asarray(seq.output_token_ids, dtype=np.int64)]), spec, limit
                )
            if not draft:
                continue
            extra = pool.blocks_needed(seq, seq.num_tokens + len(draft)) - pool.blocks_needed(
                seq, seq.num_tokens
            )
            if extra > room:
                continue
            room -= extra
            seq.output_token_ids += draft
            drafts[seq] = draft
        return drafts

    def _mtp_pass(self, batch: ScheduledBatch, step: MTPStep) -> None:
        """After a step: the MTP layer over every row whose next token is now known (its KV for those
        positions; a prompt chunk's every row, a decoding request's kept rows), then each request that
        decodes next gets the layer's prediction at its last such row as its next draft (``engine.models.mtp``).
        Finished requests' rows count too: their blocks may serve later prompts from the prefix cache."""
        count = len(batch.seqs)
        kept = np.zeros(count, dtype=np.int64)
        next_ids: list[int] = []
        drafting: list[int] = []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            if seq.pooling is not None:
                continue
            start = int(step.starts[i])
            total = seq.num_tokens
            k = min(n, total - start - 1)  # rows whose next token is known now
            if k <= 0:
                continue
            kept[i] = k
            next_ids += seq.tokens(start + 1, start + k + 1)
            if not seq.is_finished and start + k == total - 1:  # its last token is the next to compute
                drafting.append(i)
        if not kept.any():
            return
        spec = self.spec
        assert isinstance(spec, MtpSpec)
        graphs = self.runner.mtp_graphs
        tokens, hidden = step.draft(
            self.model, self.kv_pool, kept, np.asarray(next_ids), np.asarray(drafting, dtype=np.int64), graphs,
            decode_rows=1 + spec.num_tokens,
        )  # fmt: skip
        seqs = [batch.seqs[i] for i in drafting]
        if not seqs:
            return
        depth = np.ones(len(seqs), dtype=np.int64)
        if spec.num_tokens > 1:
            tokens, depth = self._chain_drafts(seqs, tokens, hidden, spec.num_tokens)
        for seq, draft, n in zip(seqs, tokens.view(len(seqs), -1).tolist(), depth, strict=True):  # one read
            self._mtp_drafts[seq] = (seq.num_tokens, draft[:n])

    def _chain_drafts(
        self, seqs: list[Sequence], tokens: torch.Tensor, hidden: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, np.ndarray]:
        """Drafts of up to ``k`` tokens (vLLM's ``num_speculative_tokens`` with one MTP layer) from each
        sequence's first draft token ``tokens`` and the layer's output ``hidden``: the layer run again on
        each draft token and its own output, one position further each time (``chain_step``). Its KV at
        those positions needs blocks: a sequence's table is extended where free blocks allow without
        evicting a cached one (the next step would take them anyway), and a sequence whose table ends first
        drafts fewer tokens. Returns the drafts [n, k] (on the device, unread) and each one's length."""
        bs, pool = self.config.block_size, self.block_pool
        rows = np.array([s.num_tokens - 2 for s in seqs], dtype=np.int64)  # the first draft's row
        room = pool.num_uncached_free_blocks
        depth = np.empty(len(seqs), dtype=np.int64)
        for r, seq in enumerate(seqs):
            cover = min(int(rows[r]) + k, self.max_model_len)  # tokens its table should cover
            need = pool.blocks_needed(seq, cover)
            if need and need <= room and pool.append_slots(seq, cover):
                room -= need
            depth[r] = min(k, len(seq.block_table) * bs - int(rows[r]), self.max_model_len - int(rows[r]))
        drafts = tokens.new_zeros((len(seqs), k))
        drafts[:, 0] = tokens
        hidden = hidden.clone()  # a graph's outputs are its static buffers
        for j in range(1, k):
            active = np.flatnonzero(depth > j)
            if not len(active):
                break
            index = torch.from_numpy(active).to(tokens.device)
            new_tokens, new_hidden = chain_step(
                self.model, self.kv_pool, bs, block_table_array([seqs[r] for r in active]), rows[active] + j,
                drafts[index, j - 1], hidden[index], self.runner.mtp_graphs,
            )  # fmt: skip
            drafts[index, j], hidden[index] = new_tokens, new_hidden
        return drafts, depth

    def _settle_drafts(
        self, batch: ScheduledBatch, drafts: dict[Sequence, list[int]]
    ) -> dict[Sequence, list[int]]:
        """The drafts the step computes: a request's whole draft when the scheduler gave it every token of
        it, the part it gave otherwise; the rest comes off the outputs again (preempted or left out)."""
        row = {seq: i for i, seq in enumerate(batch.seqs)}  # a preempted request is not in the batch
        spec: dict[Sequence, list[int]] = {}
        for seq, draft in drafts.items():
            i = row.get(seq)
            kept = 0 if i is None else min(len(draft), batch.num_new_tokens[i] - 1)
            if kept < len(draft):
                del seq.output_token_ids[len(seq.output_token_ids) - (len(draft) - kept) :]
                if i is not None:
                    batch.num_new_tokens[i] = kept + 1
            if kept:
                spec[seq] = draft[:kept]
        return spec

    def _verify_drafts(
        self,
        spec: dict[Sequence, list[int]],
        spec_logits: dict[Sequence, torch.Tensor],
        outputs: list[RequestOutput],
    ) -> None:
        """Sample every position of each draft as the request samples (its seed and output positions; one
        sampler call for all of them), keep the samples while they equal the draft, then the first that
        does not (or the one after the draft)."""
        seqs = list(spec)
        params, positions = [], []
        for seq in seqs:
            start = len(seq.output_token_ids)
            params += [seq.params] * (len(spec[seq]) + 1)
            positions += range(start, start + len(spec[seq]) + 1)
        rows = torch.cat([spec_logits[seq] for seq in seqs]) if len(seqs) > 1 else spec_logits[seqs[0]]
        if any(p.logprobs is not None for p in params):  # each position's logprobs, as plain decoding's
            sampled, row_logprobs = self.sampler(rows, params, positions, None, self.eos_token_ids)
        else:
            sampled = self.sampler.sample(rows, params, positions, eos_token_ids=self.eos_token_ids).tolist()
            row_logprobs = [None] * len(sampled)
        first = 0
        for seq in seqs:
            draft = spec[seq]
            end = first + len(draft) + 1
            tokens, logprobs, first = sampled[first:end], row_logprobs[first:end], end
            self._count_prompt(seq)
            accepted = 0
            for j, (token, lp) in enumerate(zip(tokens, logprobs, strict=True)):
                self._append_token(seq, token, lp)
                if seq.is_finished or j == len(draft) or token != draft[j]:
                    break
                accepted += 1
            self.spec_draft_tokens += len(draft)
            self.spec_accepted_tokens += accepted
            self.spec_drafts += 1
            for pos in range(accepted):  # the kept tokens are a draft's first ones
                self.spec_accepted_per_pos[pos] += 1
            if not seq.is_finished:  # the KV of the draft tokens kept is the request's now
                seq.num_computed_tokens += accepted
                self.block_pool.cache_full_blocks(seq)
            outputs.append(self._output(seq))

    def _grammar_masks(self, seqs: list[Sequence]) -> tuple[dict[Sequence, int], torch.Tensor] | None:
        """The next-token bitmasks of the constrained ones of ``seqs`` (each sequence's row in them), or
        None when none is constrained."""
        constrained = [s for s in seqs if s.grammar is not None and s.grammar.phase != "reasoning"]
        if not constrained:
            return None
        masks = self.grammars.fill_masks([s.grammar for s in constrained])  # type: ignore[misc]
        return {s: i for i, s in enumerate(constrained)}, masks

    def _apply_grammars(
        self,
        logits: torch.Tensor,
        seqs: list[Sequence],
        params: list[SamplingParams],
        mask_rows: dict[Sequence, int],
        masks: torch.Tensor,
    ) -> torch.Tensor:
        """``logits`` with each constrained row held to its grammar (structured outputs). A row whose
        grammar is complete allows only end-of-sequence tokens, which its ``min_tokens`` would also forbid:
        its entry of ``params`` becomes a copy without ``min_tokens``, so that the row keeps them rather
        than sample from -inf (the request's own parameters are not changed)."""
        rows = [i for i, s in enumerate(seqs) if s in mask_rows]
        if not rows:  # the constrained ones only computed prompt chunks
            return logits
        for i in rows:
            if params[i].min_tokens and seqs[i].grammar.is_stopped:  # type: ignore[union-attr]
                params[i] = dataclasses.replace(params[i], min_tokens=0)
        taken = [mask_rows[seqs[i]] for i in rows]
        if taken != list(range(masks.shape[0])):
            masks = masks[taken]
        return apply_grammar_masks(logits, rows, masks)

    # ---- asynchronous scheduling: one decode step of lookahead ------------------------------------
    @staticmethod
    def _can_run_ahead(seqs: list[Sequence], sample_seqs: list[Sequence]) -> bool:
        """A batch whose tokens may stay on the device: every sequence samples (decodes, or ends its
        prompt), none that needs the host's tokens (logprobs, penalties), no KV to hold for a transfer.
        The next step is then a pure decode of (some of) the same sequences, unless requests wait."""
        return len(sample_seqs) == len(seqs) and all(
            not s.params.needs_host_step and not s.hold_kv for s in sample_seqs
        )

    def _joining(self) -> list[Sequence] | None:
        """The waiting requests the next lookahead step can take in: all of them, when every one could run
        ahead (no logprobs, prompt logprobs or penalties, no KV to hold) and is either an imported request
        ready to decode its first token (KV in place, one token to compute) or a new prompt (none computed,
        no output: not a preempted one); None when any other request waits. Whether their tokens fit the step is
        ``_step_lookahead``'s to check."""
        waiting = list(self.scheduler.waiting)
        if self.lora is not None and not self.lora.can_admit([s.lora_name for s in waiting]):
            return None
        if all(
            not s.params.needs_host_step
            and not s.wants_prompt_logprobs
            and not s.hold_kv
            and s.pooling is None
            and (
                (s.block_table and s.num_uncomputed_tokens == 1)
                or (
                    self.lookahead_join_prompts
                    and not s.block_table
                    and s.num_computed_tokens == 0
                    and not s.output_token_ids
                )
            )
            for s in waiting
        ):
            return waiting
        return None

    def _ends_at_next_token(self, seq: Sequence) -> bool:
        """Whether the token in flight is ``seq``'s last whatever its value (lengths known in advance)."""
        return self._at_length_limit(seq, len(seq.output_token_ids) + 1, seq.num_tokens + 1)

    def _at_length_limit(self, seq: Sequence, num_output: int, num_tokens: int) -> bool:
        """The length stops (max_tokens, max_model_len), one rule for ``_check_stop`` and the lookahead."""
        return num_output >= seq.params.max_tokens or num_tokens >= self.max_model_len

    def _step_lookahead(self, outputs: list[RequestOutput]) -> bool:
        """Launch the next step of the sequences in flight on their sampled tokens, still on the device,
        with the waiting requests the synchronous scheduler would admit after them (``_joining``: imported
        requests ready to decode, and new prompts, each whole), then read and process those tokens while
        it runs. Returns False, having changed nothing, when the synchronous engine's next step could
        differ from that step: other requests waiting (preempted, or with logprobs or KV to hold), a
        prompt that would be split into chunks, a batch that is not all running sequences, the token
        budget or ``max_num_seqs`` exceeded, or blocks that would have to come from evicting cached blocks
        or preempting.

        Why the synchronous scheduler admits the same requests with the same tokens: it runs after the
        tokens in flight are processed, so sequences that stop on their token (unknown here) are gone.
        That leaves it at least this step's token budget, sequence slots and uncached free blocks; so when
        every waiting request fits here whole, it admits them all, whole, in the same order. Prefix
        matches are the same too: a block is hashed only once its KV is computed, and the block the token
        in flight completes is computed by this step in both engines."""
        prev = self._inflight
        assert prev is not None
        sched, pool = self.scheduler, self.block_pool
        running = sched.running
        joining = self._joining()
        if (
            joining is None
            or len(running) != len(prev.seqs)
            or any(a is not b for a, b in zip(running, prev.seqs, strict=True))
        ):
            return False
        keep = [i for i, s in enumerate(prev.seqs) if not self._ends_at_next_token(s)]
        if not keep or len(running) + len(joining) > sched.max_num_seqs:
            return False
        kept = [prev.seqs[i] for i in keep] if len(keep) < len(prev.seqs) else prev.seqs
        # Each joining request's tokens this step and its cached prefix (new prompts only).
        hits = [pool.match_prefix(s) if not s.block_table else [] for s in joining]
        counts = [
            1 if s.block_table else s.num_tokens - len(h) * pool.block_size
            for s, h in zip(joining, hits, strict=True)
        ]
        if len(keep) + sum(counts) > sched.max_num_batched_tokens:
            return False
        # The synchronous step allocates after the finished requests freed their blocks: taking only
        # uncached free blocks here keeps the prefix cache, its events and its LRU order the same.
        needed = sum(pool.blocks_needed(s, s.num_tokens + 1) for s in kept)
        for s, h in zip(joining, hits, strict=True):
            needed += pool.blocks_needed(s, s.num_tokens) - len(h)
        if needed > pool.num_uncached_free_blocks:
            return False
        for s in kept:
            pool.append_slots(s, s.num_tokens + 1)
        input_ids = prev.tokens if kept is prev.seqs else prev.tokens[self._device_index(keep)]
        seqs = kept
        if joining:  # admitted as the synchronous scheduler would: after the running ones, in queue order
            for s, h, n in zip(joining, hits, counts, strict=True):
                if s.block_table:
                    pool.append_slots(s, s.num_tokens)
                else:
                    assert sched.allocate_prompt(s, h, n)
                sched.admit_next()
            seqs = [*kept, *joining]
            self.lookahead_joins += len(joining)
        self._inflight = None
        num_new = [1] * len(kept) + counts  # tokens each row computes, in ``seqs`` order
        if all(c == 1 for c in counts):  # a decode step: the imports' first tokens follow on the device
            if joining:
                first = torch.tensor([s.token_at(s.num_computed_tokens) for s in joining], dtype=torch.int64)
                input_ids = torch.cat([input_ids, host_to_device(first, self.device)])
            logits = self.runner.execute_lookahead(seqs, input_ids)
        else:
            logits = self.runner.execute_lookahead_mixed(seqs, num_new, input_ids)
        self.lookahead_steps += 1
        self._process_inflight(prev, outputs)  # the host's work, while the device computes
        self._run_after_inflight()
        # A sequence that finished on the token just read drops its row: its next token never existed.
        live = [i for i, s in enumerate(seqs) if not s.is_finished]
        if len(live) < len(seqs) and self.device.type == "cuda":
            self._freed_while_running = torch.cuda.Event()
            self._freed_while_running.record()  # after the step's forward, which writes their KV slots
        if not live:
            return True
        if len(live) < len(seqs):
            seqs = [seqs[i] for i in live]
            num_new = [num_new[i] for i in live]
            logits = logits[self._device_index(live)]
        for seq, n in zip(seqs, num_new, strict=True):  # KV computed, tokens real: blocks may be hashed
            seq.num_computed_tokens += n
            pool.cache_full_blocks(seq)
        positions = [len(s.output_token_ids) for s in seqs]
        params = [s.params for s in seqs]
        # The tokens just read have advanced every grammar: its masks for this step are known now, on
        # the host, while the device still runs this step's forward.
        grammar_masks = self._grammar_masks(seqs) if self._constrained else None
        if grammar_masks is not None:
            logits = self._apply_grammars(logits, seqs, params, *grammar_masks)
        tokens = self.sampler.sample(logits, params, positions, eos_token_ids=self.eos_token_ids)
        self._inflight = _InFlight.start(seqs, tokens, self.runner.late_point)
        return True

    def _drain_inflight(self, outputs: list[RequestOutput] | None = None) -> None:
        """Read and process the step in flight, if any; its outputs go to ``outputs`` (default: the next
        ``step()``'s)."""
        prev = self._inflight
        if prev is None:
            return
        self._inflight = None
        self.lookahead_drains += 1
        self._process_inflight(prev, self._pending if outputs is None else outputs)
        self._run_after_inflight()

    def _process_inflight(self, prev: _InFlight, outputs: list[RequestOutput]) -> None:
        for seq, tok in zip(prev.seqs, prev.read(), strict=True):
            self._count_prompt(seq)
            self._append_token(seq, tok, None)
            outputs.append(self._output(seq))

    def _device_index(self, rows: list[int]) -> torch.Tensor:
        return host_to_device(torch.tensor(rows, dtype=torch.int64), self.device)

    def _count_prompt(self, seq: Sequence) -> None:
        if not seq.prompt_counted:
            seq.prompt_counted = True
            self.prompt_tokens_total += len(seq.prompt_token_ids)
            self.cached_prompt_tokens_total += max(0, seq.num_cached_tokens)

    def _append_token(self, seq: Sequence, token: int, logprobs: TokenLogprobs | None) -> None:
        if not seq.output_token_ids:
            seq.first_token_ns = time.time_ns()
            offload = self.kv_offload
            if offload is not None and offload.at_prefill and not seq.kv_imported and not seq.hold_kv:
                # The prompt's KV is computed (its first token is being read): its blocks may go to the
                # store now, while the request decodes; at the finish only the rest is offered.
                offload.collect(seq)
        seq.output_token_ids.append(token)
        if logprobs is not None:
            seq.output_logprobs.append(logprobs)
        self.generated_tokens_total += 1
        if seq.grammar is not None and not seq.grammar.consume(token):
            # Only a token sampled with every token masked gets here (allowed_token_ids and the grammar
            # leaving none in common): the output can no longer match, so the request ends.
            log.warning(
                "request %s: token %d is outside its structured_outputs grammar (%s); aborting it",
                seq.request_id,
                token,
                seq.grammar.error,
            )
            reason, stop_reason = "abort", None
        else:
            reason, stop_reason = self._check_stop(seq, token)
        if reason is None and seq.hold_kv:
            reason = PREFILL_DONE
        elif reason is not None:
            seq.hold_kv = False  # really finished: nothing to hand over, free the blocks now
        if reason is not None:
            seq.stop_reason = stop_reason
            if seq.status is not SequenceStatus.FINISHED:
                self.scheduler.finish(seq, reason)
            else:
                seq.finish_reason = reason
            self._finalize(seq)

    def _finish_pooling(self, seq: Sequence, embedding: list[float], outputs: list[RequestOutput]) -> None:
        """An embedding request's prompt is computed: it finishes with its embedding."""
        seq.first_token_ns = time.time_ns()
        self._count_prompt(seq)
        self.scheduler.finish(seq, "stop")
        self._finalize(seq)
        out = self._output(seq, [])
        out.embedding = embedding
        outputs.append(out)

    def _check_stop(self, seq: Sequence, token: int) -> tuple[str | None, str | int | None]:
        p = seq.params
        if not p.ignore_eos and token in self.eos_token_ids:
            return "stop", None
        if token in p.stop_token_ids:
            return "stop", token
        detok = self._detok.get(seq.request_id)
        if detok is not None:
            checked = len(detok.text)  # holds no stop string, or the request would have stopped
            detok.add([token])
            found = find_stop(detok.text, p.stop, checked)  # type: ignore[arg-type]
            if found is not None:
                end = found[0] + (len(found[1]) if p.include_stop_str_in_output else 0)
                seq.output_text = detok.text[:end]
                return "stop", found[1]
        if self._at_length_limit(seq, len(seq.output_token_ids), seq.num_tokens):
            return "length", None
        return None, None

    def _finalize(self, seq: Sequence) -> None:
        self._seqs.pop(seq.request_id, None)
        self._scoring.discard(seq.request_id)
        self._constrained.discard(seq.request_id)
        if seq.hold_kv and seq.finish_reason is not None:
            self._held[seq.request_id] = seq
        elif self.kv_offload is not None:
            self.kv_offload.collect(seq)
        self._detok.pop(seq.request_id, None)

    def _output(
        self,
        seq: Sequence,
        new_tokens: list[int] | None = None,
        new_logprobs: list[TokenLogprobs] | None = None,
    ) -> RequestOutput:
        # The prompt's logprobs go out with the first token (they are complete once it is sampled).
        prompt_logprobs = (
            list(seq.prompt_logprobs)
            if seq.params.prompt_logprobs is not None and seq._emitted == 0
            else None
        )
        if new_tokens is None:
            new_tokens = seq.output_token_ids[seq._emitted :]
            new_logprobs = seq.output_logprobs[seq._emitted :] if seq.params.logprobs is not None else []
            seq._emitted = len(seq.output_token_ids)
        text = None
        if seq.is_finished:
            if isinstance(seq.stop_reason, str):
                text = seq.output_text
            else:
                # A stop token (EOS, or one of stop_token_ids) that ended the request is not in the text
                # (vLLM's rule), unless include_stop_str_in_output.
                ids = seq.output_token_ids
                if seq.finish_reason == "stop" and not seq.params.include_stop_str_in_output:
                    ids = ids[:-1]
                text = self.tokenizer.decode(ids, seq.params.skip_special_tokens)
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=list(new_tokens),
            new_logprobs=list(new_logprobs or []),
            prompt_logprobs=prompt_logprobs if new_tokens else None,
            finished=seq.is_finished,
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason,
            num_prompt_tokens=len(seq.prompt_token_ids),
            num_cached_tokens=max(0, seq.num_cached_tokens),
            num_output_tokens=len(seq.output_token_ids),
            text=text,
            arrival_time_ns=seq.arrival_time_ns,
            first_scheduled_ns=seq.first_scheduled_ns,
            first_token_ns=seq.first_token_ns,
        )

    # ---- introspection -------------------------------------------------------------------------
    def close(self) -> None:
        """Release what outlives the engine's requests: its CUDA graphs, and the expert-parallel process
        group if the engine joined it (a collective: every rank closes). Nothing may step it afterwards."""
        self.runner.release_graphs()
        if self._owns_group:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
            self._owns_group = False

    def cache_info(self) -> dict[str, str]:
        """The KV cache's configuration as strings: the labels of the workers' ``cache_config_info``
        metric (vLLM's ``cache_config_info`` has the same role)."""
        return {
            "block_size": str(self.config.block_size),
            "cache_dtype": self.layout.dtype,
            "num_blocks": str(self.kv_pool.shape[0]),
            "kv_scales": "checkpoint" if self.kv_scaled_layers else "none",
            "prefix_caching": "true" if self.config.enable_prefix_caching else "false",
            # The fraction the pool was sized by; empty where a size was given or off a GPU.
            "gpu_memory_utilization": (
                str(self.config.gpu_memory_utilization) if self.memory_profile is not None else ""
            ),
        }

    def stats(self) -> EngineStats:
        s = self.scheduler
        return EngineStats(
            num_running=len(s.running),
            num_waiting=len(s.waiting),
            num_held=len(self._held),
            running_tokens=s.num_running_tokens,
            queued_tokens=s.num_queued_tokens,
            num_kv_blocks_total=self.block_pool.num_blocks,
            num_kv_blocks_free=self.block_pool.num_free_blocks,
            num_preemptions=s.num_preemptions,
            prompt_tokens_total=self.prompt_tokens_total,
            cached_prompt_tokens_total=self.cached_prompt_tokens_total,
            generated_tokens_total=self.generated_tokens_total,
            lookahead_steps=self.lookahead_steps,
            lookahead_drains=self.lookahead_drains,
            lookahead_late_waits=self.lookahead_late_waits,
            lookahead_joins=self.lookahead_joins,
            idle_passes=self.runner.idle_passes,
            group_sync_seconds=self.runner.group_sync_seconds,
            decode_graph_passes=self.runner.pass_kinds["decode_graph"],
            prefill_graph_passes=self.runner.pass_kinds["prefill_graph"],
            eager_passes=self.runner.pass_kinds["eager"],
            spec_draft_tokens=self.spec_draft_tokens,
            spec_accepted_tokens=self.spec_accepted_tokens,
            spec_drafts=self.spec_drafts,
            spec_accepted_per_pos=tuple(self.spec_accepted_per_pos),
        )

    def reset_prefix_cache(self) -> int:
        """Evict every cached prefix block no request holds, as vLLM's ``reset_prefix_cache`` does (for
        benchmarks that must start cold, and after weights change); blocks of running requests stay. The
        removals are published as KV events at once. Returns how many blocks were evicted. Not thread-safe,
        like every engine method: on an ``AsyncEngine`` run it through ``AsyncEngine.call``."""
        evicted = self.block_pool.reset_prefix_cache()
        self.block_pool.flush_events()
        return evicted

    def take_expert_counts(self) -> torch.Tensor | None:
        """Tokens per physical expert per MoE layer since the last call (or the last placement change),
        [moe_layers, physical] int64 on the host, or None without MoE layers."""
        blocks = self.model.moe_blocks()
        if not blocks:
            return None
        return torch.stack([b.take_counts() for b in blocks]).cpu()

    def moe_layout(self) -> MoELayout | None:
        """The MoE layers' expert layout (what a placement must fit), or None for a dense model."""
        blocks = self.model.moe_blocks()
        if not blocks:
            return None
        d = blocks[0].dispatcher
        return MoELayout(len(blocks), blocks[0].num_logical, blocks[0].num_physical, d.ep_size, d.ep_rank)

    def expert_placement(self) -> list[list[int]] | None:
        """The placement the MoE layers run (physical -> logical per MoE layer), or None for a dense model."""
        blocks = self.model.moe_blocks()
        return [list(b.placement.host) for b in blocks] if blocks else None

    def set_expert_placement(self, version: int, physical_to_logical: list[list[int]]) -> None:
        """Run placement ``version`` (the EPLB controller's; newer than the one running, else ignored). With
        one rank it is applied now: expert weights move in place, the routing tables are rewritten and the
        counters restart. With several ranks it is staged: the
        group applies it together at the start of a later step, once every rank has staged it
        (``engine.data_parallel.Lockstep``). Raises ``PlacementError`` for a placement that does not fit."""
        layout = self.moe_layout()
        if layout is None:
            raise PlacementError("the model has no MoE layers")
        check_placement(physical_to_logical, layout.num_layers, layout.num_logical, layout.num_physical)
        staged = self.staged_placement
        if version <= self.placement_version or (staged is not None and version <= staged[0]):
            return
        if layout.num_ranks > 1:
            self.staged_placement = (version, [list(row) for row in physical_to_logical])
            return
        self.apply_expert_placement(version, physical_to_logical)

    def apply_expert_placement(self, version: int, physical_to_logical: list[list[int]]) -> int:
        """Move the experts to ``physical_to_logical`` now (collective with several ranks: every rank calls it
        with the same placement in the same step). Returns how many local expert slots were rewritten."""
        moved = 0
        for block, row in zip(self.model.moe_blocks(), physical_to_logical, strict=True):
            moved += move_experts(block, row)
        self.placement_version = version
        if self.staged_placement is not None and self.staged_placement[0] <= version:
            self.staged_placement = None
        log.info("expert placement %d applied: %d expert slots rewritten on this rank", version, moved)
        return moved


def _kv_scaled_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The attention modules to which the checkpoint gave calibrated KV scales other than 1.0."""
    return [
        m for m in model.modules() if getattr(m, "k_scale", 1.0) != 1.0 or getattr(m, "v_scale", 1.0) != 1.0
    ]


def _kv_scales_in_use(model: torch.nn.Module, pool_dtype: torch.dtype) -> int:
    """How many layers' calibrated KV scales from the checkpoint the pool uses (a float8 pool uses them,
    a 16-bit one does not), said in the log where the checkpoint has any."""
    scaled = _kv_scaled_layers(model)
    if not scaled:
        return 0
    if pool_dtype in FP8_KV_DTYPES:
        log.info("KV cache %s with the checkpoint's KV scales (%d layers)", pool_dtype, len(scaled))
        return len(scaled)
    log.info(
        "the checkpoint's KV scales (%d layers) are not used: the KV cache is %s", len(scaled), pool_dtype
    )
    return 0
