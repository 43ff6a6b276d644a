"""The engine's start-up warm-up samples through each of the sampler's paths, and changes nothing.

``ModelRunner.warm_up`` runs one prefill forward per size class, then samples a plain row, a min-p row, a
top-k/top-p row, a top-p row, and a min-p row beside each of the last two (the Triton kernels' six
variants; without them, the torch race without and with a sort), all seeded, so that no Triton compile
waits for the first sampled request and the sampler's generator does not move. The engine warms up where
kernels compile: the Triton ops on a GPU, with or without CUDA graphs. Without a GPU the kernel runs in the Triton interpreter
(``TRITON_INTERPRET=1``, set before triton is imported) through the sampler's ``kernel_on_cpu`` option.
"""

from __future__ import annotations

import pytest
import torch

import kernels.sampling as race_module
from engine import LLM, SamplingParams
from engine.model_runner import ModelRunner
from engine.sampler import Sampler
from kernels.sampling import exponential_noise

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_warm_up_samples_every_path_and_changes_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    llm = LLM("tiny-moe", device=DEVICE, num_kv_blocks=64)
    engine = llm.engine
    llm.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=3, temperature=0.0))
    pool = engine.kv_pool.clone()
    counts = [b.expert_counts.clone() for b in engine.model.moe_blocks()]
    sampler = Sampler(7, "triton", kernel_on_cpu=DEVICE == "cpu")
    state = sampler._unseeded.get_state()
    kernel = sampler._gumbel_sample
    kernel_calls: list[tuple[bool, bool, bool]] = []  # (min-p, top-k, top-p): the compiled variants
    noise_rows: list[int] = []  # rows of each torch race

    def counted_kernel(*args: torch.Tensor | None, **hint: int | None) -> torch.Tensor:
        kernel_calls.append((args[3] is not None, args[4] is not None, args[5] is not None))
        return kernel(*args, **hint)

    def counted_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
        noise_rows.append(keys.shape[0])
        return exponential_noise(keys, vocab)

    sampler._gumbel_sample = counted_kernel
    monkeypatch.setattr(race_module, "exponential_noise", counted_noise)
    engine.runner.warm_up([1, 9], sampler)
    no, yes = False, True
    want = [(no, no, no), (yes, no, no), (no, yes, yes), (no, no, yes), (yes, yes, yes), (yes, no, yes)]
    assert kernel_calls == want
    assert noise_rows == []  # no torch race: the kernel takes top-k and top-p too
    assert torch.equal(sampler._unseeded.get_state(), state)
    assert torch.equal(engine.kv_pool, pool)
    assert all(
        torch.equal(b.expert_counts, c) for b, c in zip(engine.model.moe_blocks(), counts, strict=True)
    )
    # Without a kernel every row takes the torch race: the rows without top-k/top-p apart, unsorted.
    noise_rows.clear()
    engine.runner.warm_up([], Sampler(7, "torch"))
    assert noise_rows == [1] * 8  # the mixed batches race twice: the plain row apart


def test_engine_warms_up_where_kernels_compile_with_or_without_graphs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On the CPU nothing compiles (the interpreter runs the Triton ops), so there is no warm-up, which
    would cost the tests interpreted forwards; where kernels compile the engine warms up its own sampler,
    graphs or not (here on the CPU, by saying the kernels compile)."""
    calls: list[tuple[list[int], Sampler | None]] = []
    warm_up = ModelRunner.warm_up

    def recorded(self: ModelRunner, token_counts: list[int], sampler: Sampler | None = None) -> float:
        calls.append((list(token_counts), sampler))
        return warm_up(self, token_counts, sampler)

    monkeypatch.setattr(ModelRunner, "warm_up", recorded)
    for backend in ("torch", "triton"):
        llm = LLM("tiny-dense", num_kv_blocks=32, kernel_backend=backend, max_num_batched_tokens=48)
        assert not llm.engine.runner.compiles_kernels
    assert calls == []
    monkeypatch.setattr(ModelRunner, "compiles_kernels", property(lambda self: True))
    llm = LLM("tiny-dense", num_kv_blocks=32, max_num_batched_tokens=48, cuda_graphs=False)
    assert llm.engine.runner.graphs is None
    assert calls == [([16, 48], llm.engine.sampler)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_first_sampled_requests_compile_no_sampling_kernel() -> None:
    """After start-up, requests with temperature, min-p, top-k and top-p find every variant of the
    sampling kernel compiled (the JIT's per-device cache gains no entry), with CUDA graphs and without."""
    from kernels.triton_sampling import _race_kernel, _sample_kernel

    prompts = [[5, 6, 7, 8, 9], [3, 1, 4, 1, 5, 9, 2, 6]]
    requests = [
        SamplingParams(max_tokens=4, temperature=0.8),
        SamplingParams(max_tokens=4, temperature=0.8, min_p=0.05),
        SamplingParams(max_tokens=4, temperature=0.8, top_k=20),
        SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, min_p=0.05),
        SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9),
        SamplingParams(max_tokens=4, temperature=0.8, top_k=20, top_p=0.95, min_p=0.05),
        SamplingParams(max_tokens=4, temperature=0.8, top_k=100),  # above the slots: top-p's variant
    ]
    device = torch.cuda.current_device()
    for graphs in (True, False):
        _sample_kernel.device_caches.clear()  # compiled again from Triton's disk cache
        _race_kernel.device_caches.clear()
        llm = LLM("tiny-moe", device="cuda", kernel_backend="triton", num_kv_blocks=64, cuda_graphs=graphs)
        compiled = dict(_sample_kernel.device_caches[device][0])
        assert len(compiled) == 6, compiled.keys()  # min-p or not; no filter, top-p alone, or top-k
        # The hashing pass: plain rows, min-p rows (scores kept), top-p rows (scores kept), top-k rows (scores
        # kept, digits counted, each chunk's top k).
        compiled_race = dict(_race_kernel.device_caches[device][0])
        assert len(compiled_race) == 4, compiled_race.keys()
        for params in requests:
            llm.generate(prompts, params)
        assert _sample_kernel.device_caches[device][0].keys() == compiled.keys()
        assert _race_kernel.device_caches[device][0].keys() == compiled_race.keys()
