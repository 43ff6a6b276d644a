"""The whole engine on the Triton op table gives the same greedy tokens as on the PyTorch reference ops.

Without a GPU the Triton kernels run under the interpreter (``TRITON_INTERPRET=1``, set by
tests/conftest.py when CUDA is absent), in float32: the interpreter mishandles bf16 dots.
With a GPU the same test runs compiled (float32; pure decode steps as CUDA graphs, the default). A small token budget makes the steps mix
chunked prefill (extend attention over a cached prefix) with decode rows, so both attention kernels, the
MoE path and every row op take part.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import UnsupportedModelError
from tests.checkpoints import make_checkpoint

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on the CPU


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(0, 256) for _ in range(n)] for n in (5, 17, 33)]


def _generate(model: str, backend: str, **kw: str) -> list[list[int]]:
    llm = LLM(
        model,
        device=DEVICE,
        dtype="float32",
        kernel_backend=backend,
        num_kv_blocks=64,
        max_num_batched_tokens=24,
        **kw,
    )
    return [o.token_ids for o in llm.generate(_prompts(), GREEDY)]


@pytest.mark.parametrize("model", ["tiny-dense", "tiny-moe"])
def test_triton_backend_gives_the_reference_tokens(model: str) -> None:
    expected = _generate(model, "torch")
    assert len({t for e in expected for t in e}) > 8, expected  # varied output: a real check
    assert _generate(model, "triton") == expected


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_kv_cache_on_the_triton_backend_gives_the_reference_tokens(kv_cache_dtype: str) -> None:
    """kv_cache_dtype fp8 and fp8_e5m2: every kernel that writes the pool (the prologue, folded into decode
    attention or not) rounds to float8 e4m3 or e5m2 as the reference does, and both attention kernels read
    it back alike."""
    expected = _generate("tiny-dense", "torch", kv_cache_dtype=kv_cache_dtype)
    assert len({t for e in expected for t in e}) > 8, expected
    assert expected != _generate("tiny-dense", "torch")  # the pool's rounding shows in these tokens
    assert _generate("tiny-dense", "triton", kv_cache_dtype=kv_cache_dtype) == expected


def _add_kv_scales(path: Path, scales: dict[str, float]) -> None:
    """Calibrated KV scales into a checkpoint, as quantisation tools store them (one float32 a layer)."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    tensors.update({name: torch.tensor(value, dtype=torch.float32) for name, value in scales.items()})
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_fp8_kv_cache_uses_the_checkpoints_kv_scales(tmp_path: Path) -> None:
    """A checkpoint with calibrated KV scales (llm-compressor's self_attn.k_scale / v_scale, and the older
    kv_scale for both): with kv_cache_dtype fp8 the layers take them, the pool holds k / k_scale, and the
    greedy tokens on the Triton ops equal the reference ops'. With a 16-bit cache they are not used."""
    plain = make_checkpoint("qwen3", tmp_path / "plain")
    scaled = make_checkpoint("qwen3", tmp_path / "scaled")
    _add_kv_scales(scaled, {"model.layers.0.self_attn.k_scale": 0.0625, "model.layers.0.self_attn.v_scale": 4.0,
                            "model.layers.1.self_attn.k_scale": 2.0, "model.layers.1.self_attn.v_scale": 0.5,
                            "model.layers.2.self_attn.kv_scale": 0.375})  # fmt: skip

    def run(path: Path, backend: str, kv_cache_dtype: str) -> tuple[LLM, list[list[int]]]:
        llm = LLM(str(path), device=DEVICE, dtype="float32", kernel_backend=backend, num_kv_blocks=64,
                  max_num_batched_tokens=24, kv_cache_dtype=kv_cache_dtype)  # fmt: skip
        return llm, [o.token_ids for o in llm.generate(_prompts(), GREEDY)]

    llm, expected = run(scaled, "torch", "fp8")
    layers = [layer.self_attn for layer in llm.engine.model.layers]
    assert [(a.k_scale, a.v_scale) for a in layers] == [(0.0625, 4.0), (2.0, 0.5), (0.375, 0.375)]
    assert llm.engine.cache_info()["kv_scales"] == "checkpoint"
    assert len({t for e in expected for t in e}) > 8, expected
    unscaled, _ = run(plain, "torch", "fp8")
    keys, plain_keys = llm.engine.kv_pool[:, 0, 0].float(), unscaled.engine.kv_pool[:, 0, 0].float()
    written = plain_keys != 0
    assert int(written.sum()) > 100
    assert not torch.equal(keys[written], plain_keys[written])  # stored 16 times larger
    torch.testing.assert_close(keys[written] * 0.0625, plain_keys[written], rtol=0.15, atol=0.02)
    assert run(scaled, "triton", "fp8")[1] == expected
    auto, tokens = run(scaled, "torch", "auto")
    assert tokens == run(plain, "torch", "auto")[1]  # a 16-bit cache ignores them
    assert auto.engine.cache_info()["kv_scales"] == "none"


def test_kv_scales_of_more_than_one_value_are_refused(tmp_path: Path) -> None:
    """Per-head KV scales (some formats have them) are not supported: a clear error, not a silent 1.0."""
    path = make_checkpoint("qwen3", tmp_path / "ckpt")
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.k_scale"] = torch.ones(4)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(UnsupportedModelError, match="per head or channel"):
        LLM(str(path), device="cpu", dtype="float32", kv_cache_dtype="fp8", num_kv_blocks=16)


def test_drafted_steps_on_the_triton_backend_give_the_reference_tokens() -> None:
    """Speculative decoding's steps (a decoding row of its last token and its draft: extend attention over
    the row's cached context, logits at every row position) on the Triton ops: the reference tokens.
    Compiled on a GPU, with decode graphs for the steps without drafts."""
    import json

    spec = json.dumps(
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
    )
    expected = _generate("tiny-dense", "torch")
    llm = LLM("tiny-dense", device=DEVICE, dtype="float32", kernel_backend="triton", num_kv_blocks=64,
              max_num_batched_tokens=24, speculative_config=spec)  # fmt: skip
    assert [o.token_ids for o in llm.generate(_prompts(), GREEDY)] == expected
    assert llm.engine.stats().spec_draft_tokens > 0
