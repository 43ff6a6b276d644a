"""Engine settings, declared once with ``mesh.config.setting`` (flags, ``PDMESH_*`` variables and docs follow)."""

from __future__ import annotations

from dataclasses import dataclass

from mesh.config import dtype_setting, quantization_setting, setting
from mesh.kv_layout import KV_CACHE_DTYPES


@dataclass
class EngineConfig:
    model: str = setting(
        "tiny-dense",
        "Built-in model name (tiny-dense, tiny-moe, tiny-deepseek) or a Hugging Face checkpoint directory.",
    )
    device: str = setting("cpu", "Device the model runs on.", choices=("cpu", "cuda"))
    dtype: str = dtype_setting()
    quantization: str = quantization_setting()
    kv_cache_dtype: str = setting(
        "auto",
        "KV cache dtype. auto: the weights' dtype. fp8 (or fp8_e4m3): float8 e4m3, one byte a value, so the "
        "pool holds twice the tokens of a 16-bit one and decode reads half the KV bytes; values are stored "
        "divided by the checkpoint's calibrated KV scales where it has them (k_scale / v_scale, else 1.0, as "
        "vLLM; DeepSeek's latent KV is stored unscaled), saturating at +-448. fp8_e5m2: float8 e5m2, the "
        "same size with 2 mantissa bits instead of 3 and a range to +-57344 (SGLang's and vLLM's fp8_e5m2). Every worker that exchanges KV must use the "
        "same.",
        choices=tuple(KV_CACHE_DTYPES),
    )
    block_size: int = setting(16, "Tokens per KV block (a deployment-wide setting; the router checks it).")
    max_model_len: int | None = setting(
        None, "Longest prompt plus output, in tokens; default: the model's own limit."
    )
    max_num_seqs: int = setting(64, "Most requests in one running batch.")
    scheduling_policy: str = setting(
        "fcfs",
        "Which waiting request runs first (vLLM's --scheduling-policy): fcfs (arrival order; a request with "
        "a priority other than 0 is refused), or priority (lowest priority value first, then arrival; when "
        "KV blocks run out, the running request with the highest value, latest arrival, is preempted).",
        choices=("fcfs", "priority"),
    )
    max_num_batched_tokens: int = setting(
        2048, "Token budget of one engine step (chunked prefill cuts prompts to fit)."
    )
    num_kv_blocks: int | None = setting(
        None,
        "KV pool size in blocks; default: from kv_cache_memory_gb, else gpu_memory_utilization on a GPU, "
        "else 0.5 GiB of blocks on the CPU.",
    )
    kv_cache_memory_gb: float | None = setting(
        None,
        "Memory for the KV pool, in GiB (vLLM's --kv-cache-memory-bytes, in GiB), when num_kv_blocks is not "
        "given; it takes precedence over gpu_memory_utilization. Default: on a GPU sized by "
        "gpu_memory_utilization, on the CPU 0.5 GiB.",
    )
    gpu_memory_utilization: float = setting(
        0.9,
        "On a GPU, when neither num_kv_blocks nor kv_cache_memory_gb is given: the fraction of the GPU's "
        "memory this engine may use (vLLM's --gpu-memory-utilization). The weights, the peak of a profiling "
        "pass at the full step budget (max_num_batched_tokens tokens, max_num_seqs rows sampled) and memory "
        "outside torch are measured at start-up, and the KV pool takes the rest; CUDA graphs come out of the "
        "remaining fraction. That fraction must be free at start-up (other processes' memory is not "
        "counted), so engines sharing a GPU each take their part.",
    )
    enable_prefix_caching: bool = setting(True, "Reuse cached KV blocks of identical prompt prefixes.")
    kernel_backend: str = setting(
        "torch", "Which implementation of the ops runs the model.", choices=("torch", "triton")
    )
    load_format: str = setting(
        "auto",
        "auto: read the checkpoint; dummy: random weights of the checkpoint's shapes.",
        choices=("auto", "dummy"),
    )
    seed: int = setting(0, "Seed for dummy weights and for unseeded sampling.")
    cuda_graphs: bool = setting(
        True,
        "Capture decode steps as CUDA graphs on GPUs (off: --no-cuda-graphs, or vLLM's --enforce-eager).",
        negated_by="enforce_eager",
    )
    prefill_graph_tokens: int = setting(
        2048,
        "With cuda_graphs: the largest step, in tokens, that runs as piecewise CUDA graphs (prefill and "
        "mixed steps; attention stays eager between the pieces); 0: those steps run eagerly. Capped by "
        "max_num_batched_tokens.",
    )
    decode_megakernel: bool = setting(
        False,
        "Experimental, with cuda_graphs: run a decode step of one sequence as one persistent CUDA kernel "
        "for every decoder layer (kernels/decode_megakernel.py), where the model fits it: MoE layers like "
        "Qwen3-30B-A3B's, bf16, one GPU of compute capability 9.0+. Off by default: on an H200 it is "
        "correct but slower than the op-by-op graphs so far (docs/gpu.md).",
    )
    async_scheduling: bool | None = setting(
        None,
        "Overlap the host's scheduling and output processing with the next decode step (one step of "
        "lookahead): lower time per output token and higher throughput. A new request joins the step after "
        "the one already queued, so time to first token rises by up to a step; lookahead_late_launch "
        "narrows that. Unset: on for CUDA devices, off on the CPU (where host and device work do not "
        "overlap).",
    )
    lookahead_late_launch: bool = setting(
        True,
        "With async_scheduling and decode CUDA graphs: the serving loop launches the next step once the "
        "step in flight has reached its last graph piece, not as soon as it runs, so requests that arrive "
        "meanwhile join the next step rather than the one after, while the host still prepares each step "
        "during the previous one (on an H200: time to first token 6-25% lower, time per output token "
        "within 1.5%).",
    )
    cache_salt: str | None = setting(
        None,
        "Engine-wide cache salt: the worker publishes a salted model fingerprint, so its prefix cache "
        "and KV index entries form their own domain; a request's cache_salt narrows it further.",
    )
    expert_parallel_size: int = setting(
        1,
        "Expert-parallel ranks, one process each (one GPU each on CUDA): every rank holds 1/N of the MoE "
        "experts and serves its own requests (data-parallel attention); the ranks exchange tokens in each "
        "MoE layer and step together. 1: one rank, all experts.",
    )
    expert_parallel_rank: int = setting(
        0, "This process's expert-parallel rank, 0 .. expert_parallel_size-1."
    )
    distributed_init_method: str = setting(
        "tcp://127.0.0.1:29511",
        "With expert_parallel_size > 1: where the ranks meet (torch.distributed init_method, the same on "
        "every rank).",
    )
    distributed_timeout_s: float = setting(
        600.0,
        "With expert_parallel_size > 1: the longest one rank waits for the others in a collective (a rank "
        "that hangs fails the others' step after it).",
    )
    expert_parallel_async_scheduling: bool = setting(
        True,
        "With several expert-parallel ranks: keep async_scheduling (the ranks agree on each lookahead "
        "step's pass as on any other, while the step before it still runs; on two H200s decode steps "
        "5-16% shorter). Off: such engines step synchronously.",
    )

    enable_eplb: bool = setting(
        False,
        "Expert-parallel load balancing (vLLM's --enable-eplb): a MoE engine counts tokens per physical expert "
        "and takes new expert placements (from the EPLB controller, eplb_svc) at run time, moving expert "
        "weights in place between steps; the output does not change (replicas are copies).",
    )
    num_redundant_experts: int = setting(
        0,
        "With enable_eplb: physical expert slots beyond the model's experts in each MoE layer (vLLM's "
        "num_redundant_experts), for replicas of hot experts; experts plus these must divide over "
        "expert_parallel_size.",
    )

    speculative_config: str | None = setting(
        None,
        'Speculative decoding (vLLM\'s --speculative-config, JSON): {"method": "ngram", '
        '"num_speculative_tokens": K, "prompt_lookup_max": 4, "prompt_lookup_min": 2} drafts up to K '
        "tokens a step from the request's own context and keeps those its sampling confirms (the output is "
        'unchanged; engine/speculative.py); {"method": "mtp", "num_speculative_tokens": K} (or "deepseek_mtp"; K '
        "1 by default) drafts K tokens a step with a DeepSeek-V3 checkpoint's own multi-token-prediction layer, "
        "run again on its own output for each token after the first (engine/models/mtp.py; its KV is one "
        "pool layer more, so a worker's peers and KV offload store need the same setting). Other methods are "
        "refused.",
    )

    enable_lora: bool = setting(
        False,
        "Serve LoRA adapters (vLLM's --enable-lora): PEFT adapters of the decoder layers' attention and dense "
        "MLP projections, several in one batch (engine/lora.py); a request names its adapter.",
    )
    max_loras: int = setting(1, "With enable_lora: adapters in device slots at once (vLLM's --max-loras).")
    max_lora_rank: int = setting(
        16, "With enable_lora: the highest adapter rank served (vLLM's --max-lora-rank)."
    )
    lora_modules: list[str] = setting(
        [],
        "With enable_lora: adapters to register at start (vLLM's --lora-modules): each name=path to a PEFT "
        'directory, or JSON {"name": ..., "path": ...}; a request selects one by name (the model field).',
    )
    cudagraph_specialize_lora: bool = setting(
        True,
        "With enable_lora and cuda_graphs: capture every CUDA graph twice, with the LoRA ops and without, and "
        "replay the second for steps in which no request has an adapter (vLLM's compilation-config field of "
        "that name), so base-model requests run at the plain engine's speed; twice the graphs' capture time.",
    )

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            from engine.speculative import parse_speculative_config

            parse_speculative_config(self.speculative_config)  # a bad value stops the start
        if self.async_scheduling is None:  # measured on an H200: docs/gpu.md, "What is left", item 3
            self.async_scheduling = self.device == "cuda"
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory_gb is not None and self.kv_cache_memory_gb <= 0:
            raise ValueError(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        if self.enable_lora:
            if self.max_loras < 1 or self.max_lora_rank < 1:
                raise ValueError(
                    f"max_loras and max_lora_rank must be >= 1, got {self.max_loras} and {self.max_lora_rank}"
                )
        elif self.lora_modules:
            raise ValueError("lora_modules needs enable_lora")
        if self.num_redundant_experts < 0:
            raise ValueError(f"num_redundant_experts must be >= 0, got {self.num_redundant_experts}")
        if self.num_redundant_experts and not self.enable_eplb:
            raise ValueError("num_redundant_experts needs enable_eplb")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.prefill_graph_tokens < 0:
            raise ValueError(f"prefill_graph_tokens must be >= 0, got {self.prefill_graph_tokens}")
        if self.distributed_timeout_s <= 0:
            raise ValueError(f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        if not 0 <= self.expert_parallel_rank < self.expert_parallel_size:
            raise ValueError(
                f"expert_parallel_rank must be in [0, {self.expert_parallel_size}), "
                f"got {self.expert_parallel_rank}"
            )
