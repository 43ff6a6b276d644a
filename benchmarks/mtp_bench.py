"""Speculative decoding with DeepSeek-V3's multi-token-prediction layer (``--speculative-config
'{"method": "mtp"}'``, engine/models/mtp.py) on one GPU: decode tok/s with and without the draft, side by
side in one engine, on a Moonlight-16B-A3B-shaped model (benchmarks/deepseek_bench.py) given one MTP layer of
DeepSeek-V3's kind, random weights.

    python benchmarks/mtp_bench.py [--batches 1,16] [--prompt 512] [--new 64]
    python benchmarks/mtp_bench.py --smoke          # small shapes, on the CPU

Two sets of weights, both random (``load_format="dummy"``):
- ``random``: the drafts are almost never right, so this measures what drafting costs: a step verifies two
  tokens a sequence (the decode graph of twice the rows) and runs the MTP layer after it.
- ``predictive``: the same weights with the embeddings scaled to an rms of 1, every layer's output
  projections (attention, dense and shared MLPs, experts; the MTP layer's too) scaled by 0.05 and the MTP
  layer's ``eh_proj`` an identity on its token's embedding, so each layer adds little and the MTP layer predicts what the model will: most drafts
  are kept (the kept share is measured and printed). Step costs do not depend on the values (the routed
  experts a step reads do, a little).

Plain decoding is the same engine with drafting switched off (``engine.spec`` None): the same graphs, which
then also copy out each row's final hidden state ([batch, hidden], a few KB). Decode tok/s as
deepseek_bench's: ``batch x new`` tokens over the time of a ``new``-token generation less a one-token one,
medians of ``--repeats``. Roofline per generated token: the bytes a step must read (deepseek_bench's
``step_bytes`` for the step's rows, plus the MTP layer and its head when drafting) over the measured copy
bandwidth, divided by the tokens a step gives (1 + the kept share).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.deepseek_bench import MOONLIGHT, SMOKE, copy_gbps, decode_rate, step_bytes  # noqa: E402
from engine import LLM, SamplingParams  # noqa: E402
from engine.models.mtp import MTPLayer  # noqa: E402
from engine.speculative import MtpSpec  # noqa: E402


@torch.inference_mode()
def make_predictive(llm: LLM) -> None:
    """Scale every layer's output projections by 0.05 and make the MTP layer read its token (the
    docstring's ``predictive`` weights), in place."""
    model = llm.engine.model
    mtp = model.mtp
    assert isinstance(mtp, MTPLayer)
    model.embed_tokens.mul_(
        1.0 / model.embed_tokens.float().pow(2).mean().sqrt().item()
    )  # rms 1 (the MTP's too)
    for layer in [*model.layers, mtp.block]:
        layer.self_attn.o_proj.mul_(0.05)
        mlp = layer.mlp
        if hasattr(mlp, "w2"):
            mlp.w2.mul_(0.05)
            if getattr(mlp, "shared_experts", None) is not None:
                mlp.shared_experts.down_proj.mul_(0.05)
        else:
            mlp.down_proj.mul_(0.05)
    h = model.cfg.hidden_size
    mtp.eh_proj.mul_(0.05)
    mtp.eh_proj[:, :h] += torch.eye(h, dtype=mtp.eh_proj.dtype, device=mtp.eh_proj.device)
    mtp.enorm.fill_(1.0)
    mtp.head_norm.copy_(model.norm)


def mtp_bytes(cfg: dict, itemsize: int) -> float:
    """The MTP layer's weights a pass reads at one token a sequence: eh_proj, a MoE layer's attention, shared
    and routed experts (k of them), and the head (its embeddings and head are the model's)."""
    one_layer = dict(cfg, num_hidden_layers=1, first_k_dense_replace=0, vocab_size=0)
    h = cfg["hidden_size"]
    return step_bytes(one_layer, 1, 0, itemsize) + (2 * h * h + cfg["vocab_size"] * h) * itemsize


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--draft-tokens", default="1", help="num_speculative_tokens values, comma-separated")
    ap.add_argument("--smoke", action="store_true")
    args = ap.parse_args()
    ks = [int(k) for k in args.draft_tokens.split(",")]
    cfg = dict(MOONLIGHT, **(SMOKE if args.smoke else {}), num_nextn_predict_layers=1)
    gpu = torch.cuda.is_available() and not args.smoke
    path = Path(tempfile.mkdtemp(prefix="pdmesh-mtp-"))
    (path / "config.json").write_text(json.dumps(cfg))
    batches = [int(b) for b in args.batches.split(",")]
    rng = random.Random(0)
    prompts = {
        b: [[rng.randrange(3, cfg["vocab_size"]) for _ in range(args.prompt)] for _ in range(b)]
        for b in batches
    }
    span = args.prompt + args.new + 16
    llm = LLM(str(path), load_format="dummy", device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
              kernel_backend="triton" if gpu else "torch", max_num_seqs=max(batches), enable_prefix_caching=False,
              max_num_batched_tokens=max(batches) * args.prompt, max_model_len=span,
              num_kv_blocks=max(batches) * (-(-span // 16)) + 8,
              speculative_config=json.dumps({"method": "mtp", "num_speculative_tokens": max(ks)}))  # fmt: skip
    engine = llm.engine
    spec = engine.spec
    rows = []
    modes = [0, *ks]  # 0: plain decoding
    for weights in ("random", "predictive"):
        if weights == "predictive":
            make_predictive(llm)
        for b in batches:
            for drafting in modes:  # the draft's length: 0 plain, else num_speculative_tokens
                engine.spec = MtpSpec(drafting) if drafting else None
                drafts0, kept0 = engine.spec_draft_tokens, engine.spec_accepted_tokens
                passes0 = engine.runner.forward_passes

                def run(n: int, b: int = b) -> None:
                    llm.generate(prompts[b], SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))

                rate, _ = decode_rate(run, b, args.new, args.repeats)
                drafts = engine.spec_draft_tokens - drafts0
                kept = (engine.spec_accepted_tokens - kept0) / drafts if drafts else 0.0
                passes = engine.runner.forward_passes - passes0
                rows.append((weights, b, drafting, rate, kept, passes))
    engine.spec = spec
    bandwidth = copy_gbps() if gpu else 0.0
    name = torch.cuda.get_device_name() if gpu else "cpu"
    replays = sum(engine.runner.graphs.replays.values()) if engine.runner.graphs is not None else 0
    print(f"Moonlight-16B-A3B shape + one MTP layer{' (smoke)' if args.smoke else ''} on {name}: {args.prompt}-token "
          f"prompts, {args.new} new tokens, decode tok/s, medians of {args.repeats}; decode graph replays "
          f"{replays}; copy bandwidth {bandwidth:.0f} GB/s")  # fmt: skip
    print(f"{'weights':>10} {'batch':>5} {'draft':>5} {'tok/s':>9} {'kept':>6} {'passes':>7} {'vs plain':>9} "
          f"{'roofline':>9} {'of roof':>8}")  # fmt: skip
    plain = {(w, b): r for w, b, d, r, _, _ in rows if not d}
    ctx = args.prompt + args.new // 2
    for weights, b, drafting, rate, kept, passes in rows:
        if bandwidth:
            # A drafting step: the weights and experts of (1 + k) b rows, each sequence's KV once, k MTP passes.
            step_rows = (1 + drafting) * b
            kv_row = ctx * cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 2
            step = (
                step_bytes(cfg, step_rows, ctx, 2) - (step_rows - b) * kv_row + drafting * mtp_bytes(cfg, 2)
            )
            roof = b * (1 + kept * drafting) / (step / (bandwidth * 1e9))
        else:
            roof = 0.0
        print(f"{weights:>10} {b:>5} {f'mtp{drafting}' if drafting else '-':>5} {rate:>9.1f} {kept:>6.0%} {passes:>7} "
              f"{rate / plain[weights, b]:>8.2f}x {roof:>9.1f} {rate / roof if roof else 0:>7.0%}")  # fmt: skip


if __name__ == "__main__":
    main()
