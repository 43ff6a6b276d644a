"""What structured outputs cost (engine/structured_outputs.py): compiling a constraint, the host's mask per
row, applying masks to the logits, and decode throughput with and without a constraint.

    python benchmarks/structured_outputs_bench.py [--vocab 32000] [--batches 1,8,32] [--device cpu]

The tokenizer: a byte-level BPE of ``--vocab`` tokens trained here on the repository's own text (no
download; real checkpoints' vocabularies are 32k-150k tokens), given to llguidance as a worker gives it a
checkpoint's ``tokenizer.json``. Rows: the LLTokenizer build (once per worker), a JSON schema's compile
(once per distinct schema), a matcher's copy (once per request), ``fill_masks`` for a batch of rows at
each position of a JSON document that matches the schema (every constrained step, on the host; mean and
worst over the positions, each state's mask computed once), ``apply_grammar_masks`` on [batch,
vocab] float32 logits on ``--device``. Last, the built-in model's decode on the CPU: 8 requests of 64
tokens, unconstrained (``ignore_eos``) against held to the schema (whitespace-free JSON), tokens/s. The
peer of every row is the unconstrained path: nothing (a mask costs what it adds). Medians of 20.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from engine.structured_outputs import GrammarCompiler, StructuredOutputs, apply_grammar_masks  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },
    },
    "required": ["name", "age", "tags", "address"],
}
# The document whose every position's mask is timed (each mask computed once: no state repeats).
DOCUMENT = (
    '{"name": "Ada Lovelace", "age": 36, "tags": ["mathematics", "analytical engine", "notes"], '
    '"address": {"city": "London", "zip": "12345"}}'
)


def _median_ms(fn: Callable[[], object], reps: int = 20, warm: int = 3) -> float:
    for _ in range(warm):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def _trained_tokenizer(vocab: int) -> object:
    """An HFTokenizer over a byte-level BPE trained on this repository's and Python's standard library's
    Python and Markdown files."""
    from engine.tokenizer import HFTokenizer

    folder, eos, size = _train_tokenizer_json(vocab)
    return HFTokenizer(folder, eos_token_ids=[eos], vocab_size=size)


def _train_tokenizer_json(vocab: int) -> tuple[Path, int, int]:
    """The BPE of ``_trained_tokenizer`` saved as tokenizer.json in a new folder: (folder, EOS id, size)."""
    import tempfile

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(json.__file__).resolve().parent.parent
    files = sorted(str(p) for p in ROOT.rglob("*") if p.suffix in (".py", ".md") and ".git" not in p.parts)
    files += sorted(str(p) for p in stdlib.glob("*.py"))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    folder = Path(tempfile.mkdtemp())
    tok.save(str(folder / "tokenizer.json"))
    return folder, tok.token_to_id("</s>"), tok.get_vocab_size()


def grammar_rows(vocab: int, batches: list[int], device: str) -> list[tuple[str, str]]:
    tokenizer = _trained_tokenizer(vocab)
    size = tokenizer.vocab_size  # type: ignore[attr-defined]
    eos = tokenizer.eos_token_ids  # type: ignore[attr-defined]
    rows = [("tokenizer", f"{size} tokens")]
    compiler = GrammarCompiler(tokenizer, size, eos)
    start = time.perf_counter()
    compiler._ll_tokenizer()
    rows.append(("LLTokenizer build (once per worker)", f"{(time.perf_counter() - start) * 1e3:.1f} ms"))
    spec = StructuredOutputs(json=json.dumps(SCHEMA))
    start = time.perf_counter()
    compiler.compile(spec)
    rows.append(("schema compile (once per schema)", f"{(time.perf_counter() - start) * 1e3:.2f} ms"))
    rows.append(
        ("matcher copy (once per request)", f"{_median_ms(lambda: compiler.matcher(spec)) * 1e3:.1f} us")
    )
    document = tokenizer.encode(DOCUMENT, add_special_tokens=False)  # type: ignore[attr-defined]
    rows.append(("document", f"{len(document)} tokens"))
    for batch in batches:
        # Every position of the document, a batch of matchers there, each mask computed once.
        matchers = [compiler.matcher(spec) for _ in range(batch)]
        compiler.fill_masks([compiler.matcher(spec)])  # llguidance's first mask builds its tables (~0.3 s)
        fills, allowed = [], []
        for token in document:
            start = time.perf_counter()
            masks = compiler.fill_masks(matchers)
            fills.append(time.perf_counter() - start)
            allowed.append(int(((masks[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).sum()))
            for m in matchers:
                assert m.consume(token), "the document must match the schema"
        fill = statistics.mean(fills) * 1e3
        logits = torch.randn(batch, size, device=device)
        rows_idx = list(range(batch))

        def apply(lg=logits, mk=masks, r=rows_idx) -> None:
            apply_grammar_masks(lg, r, mk)
            if lg.is_cuda:
                torch.cuda.synchronize()

        rows.append(
            (
                f"batch {batch}: fill_masks (mean, max) / apply ({device})",
                f"{fill:.3f} ms, {max(fills) * 1e3:.3f} ms ({fill / batch * 1e3:.0f} us a row) / "
                f"{_median_ms(apply):.3f} ms; {min(allowed)}-{max(allowed)} tokens allowed",
            )
        )
    return rows


def decode_rows() -> list[tuple[str, str]]:
    from engine import LLM, SamplingParams

    llm = LLM("tiny-dense", num_kv_blocks=512)
    prompts = [f"Record {i}:" for i in range(8)]
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    out = []
    for label, params in (
        ("free", SamplingParams(max_tokens=64, temperature=0.8, seed=1, ignore_eos=True)),
        ("JSON schema", SamplingParams(max_tokens=64, temperature=0.8, seed=1, structured_outputs=compact)),
    ):
        llm.generate(prompts[:1], params)  # warm: the schema compiles here, not in the timing
        start = time.perf_counter()
        results = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        tokens = sum(len(r.token_ids) for r in results)
        out.append(
            (f"tiny-dense decode, 8 requests, {label}", f"{tokens / seconds:.0f} tok/s ({tokens} tokens)")
        )
    return out


def engine_rows(
    shape: str, vocab: int, batches: list[int], new_tokens: int = 48, smoke: bool = False
) -> list[tuple[str, str]]:
    """A GPU engine on random weights shaped like ``shape`` (benchmarks/gpu_bench.py's), with the trained
    tokenizer in its folder: the median step time of ``batch`` 512-token prompts decoding free
    (``ignore_eos``) against held to the schema (whitespace-free JSON). Steps run as served (asynchronous
    scheduling, CUDA graphs); the masks are computed on the host while the step before runs. ``smoke``:
    gpu_bench's small shapes on the CPU (a check of this code, not a figure)."""
    import shutil

    import numpy as np

    from benchmarks.gpu_bench import SHAPES, Plan, blocks_needed, build_engine, write_config
    from engine import SamplingParams

    label, cfg = SHAPES[shape]
    folder, eos, size = _train_tokenizer_json(vocab)
    model_dir = write_config({**cfg, "eos_token_id": eos}, smoke=smoke)
    shutil.copy(folder / "tokenizer.json", model_dir / "tokenizer.json")
    plan = Plan(batches=tuple(batches), max_model_len=2048)
    if smoke:
        plan = Plan(
            batches=tuple(batches), max_model_len=2048, device="cpu", dtype="float32", backend="torch"
        )
    engine = build_engine(model_dir, plan, blocks_needed(max(batches), 512 + new_tokens, plan))
    compact = {"json": SCHEMA, "disable_any_whitespace": True}
    rng = np.random.default_rng(0)
    rows: list[tuple[str, str]] = []
    try:
        for batch in batches:
            for kind, params in (
                ("free", SamplingParams(max_tokens=new_tokens, temperature=0.8, seed=1, ignore_eos=True)),
                (
                    "JSON schema",
                    SamplingParams(
                        max_tokens=new_tokens, temperature=0.8, seed=1, structured_outputs=compact
                    ),
                ),
            ):
                for rep in range(2):  # the first compiles and warms up; the second is timed
                    for i in range(batch):
                        prompt = rng.integers(0, min(size, engine.vocab_size), 512).tolist()
                        engine.add_request(f"{kind}-{batch}-{rep}-{i}", prompt, params)
                    steps, tokens = [], 0
                    while engine.has_unfinished():
                        start = time.perf_counter()
                        outs = engine.step()
                        steps.append(time.perf_counter() - start)
                        tokens += sum(len(o.new_token_ids) for o in outs)
                decode = steps[-(new_tokens // 2) :]  # every row decoding (the prompts' steps are first)
                rows.append(
                    (
                        f"{label}, batch {batch}, {kind}: median decode step",
                        f"{statistics.median(decode) * 1e3:.2f} ms ({tokens} tokens in {len(steps)} steps)",
                    )
                )
    finally:
        engine.close()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument(
        "--smoke", action="store_true", help="--engine on small shapes on the CPU (checks the code)"
    )
    ap.add_argument(
        "--engine",
        choices=["moe", "dense"],
        help="also a GPU engine of this shape (gpu_bench.py's random weights): decode steps free and held to the schema",
    )
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = grammar_rows(args.vocab, batches, args.device)
    if not args.skip_decode:
        rows += decode_rows()
    if args.engine:
        rows += engine_rows(args.engine, args.vocab, batches, smoke=args.smoke)
    width = max(len(r[0]) for r in rows)
    print(f"| {'what'.ljust(width)} | result |\n|{'-' * (width + 2)}|---|")
    for what, result in rows:
        print(f"| {what.ljust(width)} | {result} |")


if __name__ == "__main__":
    main()
