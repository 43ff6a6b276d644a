"""Embedding throughput (engine/pooling.py): ``LLM.embed`` of a batch of prompts against transformers'
``AutoModel`` forward with last-token pooling on weights of the same shapes, side by side in one run on one
device, with the matmul roofline of the prompt tokens.

    python benchmarks/embedding_bench.py [--shape dense] [--prompts 64] [--prompt-len 512]
    python benchmarks/embedding_bench.py --smoke            # gpu_bench's small shapes, on the CPU

Random-weight models of gpu_bench.py's shapes (``load_format="dummy"``; transformers builds its own random
weights from the same config). Each row: the median over ``--repeats`` of embedding ``--prompts`` random
prompts of ``--prompt-len`` tokens (prefix caching off, so every prompt is computed), as prompts/s and prompt
tokens/s. transformers runs the whole batch in one padded forward (equal lengths: no padding), float32 on the
CPU and bf16 on a GPU, as the engine. The roofline: 2 x matmul parameters x tokens, plus causal attention, over
the measured bf16 matmul rate (GPU only).
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine import LLM, PoolingParams  # noqa: E402
from engine.models.model_config import ModelConfig  # noqa: E402


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def engine_seconds(llm: LLM, prompts: list[list[int]], repeats: int) -> float:
    llm.embed(prompts[:2], PoolingParams())  # warm-up: compiles what the graphs left
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = llm.embed(prompts, PoolingParams(pooling_type="last"))
        times.append(time.perf_counter() - start)
        assert len(out) == len(prompts) and all(
            len(o.embedding) == llm.engine.model_config.hidden_size for o in out
        )
    return statistics.median(times)


def hf_seconds(raw: dict, prompts: list[list[int]], device: str, dtype: torch.dtype, repeats: int) -> float:
    import transformers

    raw = dict(raw)
    model_type = raw.pop("model_type")
    raw.pop("architectures", None)
    cfg = transformers.AutoConfig.for_model(model_type, **raw)
    with torch.device(device):
        model = transformers.AutoModel.from_config(cfg, dtype=dtype).eval()
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    times = []
    for i in range(repeats + 1):  # the first: warm-up
        _sync(device)
        start = time.perf_counter()
        with torch.no_grad():
            states = model(input_ids=ids, attention_mask=mask).last_hidden_state
            torch.nn.functional.normalize(states[:, -1].float(), dim=-1)
        _sync(device)
        if i:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=("moe", "dense"), default="dense")
    ap.add_argument("--smoke", action="store_true", help="gpu_bench's small shapes, on the CPU")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from benchmarks.gpu_bench import (
        SHAPES,
        SMOKE_OVERRIDES,
        _matmul_tflops,
        attention_flops,
        count_weights,
        write_config,
    )

    name, raw = SHAPES[args.shape]
    if args.smoke:
        raw = {**raw, **{k: v for k, v in SMOKE_OVERRIDES.items() if k in raw}}
    model_dir = write_config(raw, smoke=False)
    cfg = ModelConfig.from_hf_dict(json.loads((model_dir / "config.json").read_text()))
    gpu = not args.smoke and torch.cuda.is_available()
    device = "cuda" if gpu else "cpu"
    dtype = torch.bfloat16 if gpu else torch.float32
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, cfg.vocab_size) for _ in range(args.prompt_len)] for _ in range(args.prompts)
    ]
    tokens = args.prompts * args.prompt_len
    blocks = args.prompts * (-(-args.prompt_len // 16) + 1)
    llm = LLM(str(model_dir), device=device, dtype="bfloat16" if gpu else "float32",
              kernel_backend="triton" if gpu else "torch", load_format="dummy", num_kv_blocks=blocks,
              max_num_seqs=args.prompts, enable_prefix_caching=False)  # fmt: skip
    ours = engine_seconds(llm, prompts, args.repeats)
    del llm
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    theirs = hf_seconds(raw, prompts, device, dtype, args.repeats)
    label = f"{name}{' (smoke)' if args.smoke else ''} on {torch.cuda.get_device_name() if gpu else 'cpu'}"
    print(
        f"{label}: {args.prompts} prompts of {args.prompt_len} tokens, last-token pooling, median of {args.repeats}"
    )
    print(f"{'engine':<24} {'seconds':>9} {'prompts/s':>10} {'tokens/s':>10}")
    for who, s in (("pdmesh LLM.embed", ours), ("transformers AutoModel", theirs)):
        print(f"{who:<24} {s:>9.3f} {args.prompts / s:>10.1f} {tokens / s:>10.0f}")
    if gpu:
        wb = count_weights(cfg, 2)
        flops = 2 * wb.matmul_params * tokens + args.prompts * attention_flops(cfg, args.prompt_len)
        roof = flops / (_matmul_tflops() * 1e12)
        print(f"{'matmul roofline':<24} {roof:>9.3f} {args.prompts / roof:>10.1f} {tokens / roof:>10.0f}"
              f"  (pdmesh at {roof / ours:.0%})")  # fmt: skip


if __name__ == "__main__":
    main()
