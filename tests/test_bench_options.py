"""Options of the benchmark scripts that decide what they measure (``benchmarks/gpu_bench.py``), and the
benchmarks that run without a GPU."""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_gpu_bench():  # noqa: ANN201 (a module)
    spec = importlib.util.spec_from_file_location(
        "gpu_bench_under_test", ROOT / "benchmarks" / "gpu_bench.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_decode_sampling_takes_sampling_params_fields() -> None:
    """``--decode-sampling``: the sampling fields of SamplingParams with numbers (top_k and seed ints);
    anything else is refused with the item named, and the summary's label says what the decode rows
    sampled with."""
    gpu_bench = load_gpu_bench()
    fields = gpu_bench.parse_sampling("temperature=0.6,top_k=20,top_p=0.95")
    assert fields == {"temperature": 0.6, "top_k": 20, "top_p": 0.95}
    assert isinstance(fields["top_k"], int)
    assert gpu_bench.parse_sampling("") == {}
    assert gpu_bench.parse_sampling("seed=7") == {"seed": 7}
    # Unknown fields, missing or non-numeric values, and the fields the decode section sets itself.
    for bad in ("tempreature=0.8", "top_p", "top_p=", "top_k=2.5", "seed", "max_tokens=4", "ignore_eos=1"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad.split("=")[0]):
            gpu_bench.parse_sampling(bad)
    plan = gpu_bench.Plan(decode_sampling=fields)
    assert gpu_bench.sampling_label(plan) == "temperature 0.6, top_k 20, top_p 0.95"
    assert gpu_bench.sampling_label(gpu_bench.Plan()) == "greedy"


def test_megakernel_variants_take_labels_timing_marks_and_known_switches() -> None:
    gpu_bench = load_gpu_bench()
    got = gpu_bench.parse_megakernel_variants("two:TPS=2; all+t:TPS=0;plain:")
    assert got == (("two", {"TPS": 2}, False), ("all", {"TPS": 0}, True), ("plain", {}, False))
    assert gpu_bench.parse_megakernel_variants("") == ()
    for bad in ("x:NOPE=1", "x:TPS=on", "x:TPS", ":TPS=1"):
        with pytest.raises(argparse.ArgumentTypeError):
            gpu_bench.parse_megakernel_variants(bad)


@pytest.mark.slow
def test_ep_bench_smoke_steps_two_ranks_through_every_mode(tmp_path: Path) -> None:
    """``benchmarks/ep_bench.py --smoke``: two gloo ranks on the CPU run every mode at every batch (their
    locksteps, the drains between rows, the close at the end) and write a row for each; in prefill-join
    rows every timed step answers one new prompt on rank 0, and only graphs-async runs ahead; ``--profile``
    writes rank 0's op tables for the modes it names."""
    import json
    import subprocess

    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "ep_bench.py"), "--smoke", "--world", "2",
         "--batches", "1,2", "--warmup", "1", "--steps", "2", "--watchdog", "120", "--out", str(tmp_path),
         "--modes", "graphs,graphs-async,device-flags,eager,prefill-join,prefill-join-eager",
         "--join-tokens", "24", "--profile", "eager"],
        capture_output=True, text=True, timeout=240, cwd=ROOT,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads((tmp_path / "ep_bench_w2.json").read_text())["rows"]
    modes = ("graphs", "graphs-async", "device-flags", "eager", "prefill-join", "prefill-join-eager")
    assert [(r["batch_per_rank"], r["mode"]) for r in rows] == [(b, m) for b in (1, 2) for m in modes]
    for r in rows:
        assert r["world"] == 2 and r["step_ms"] > 0 and r["sync_ms"] > 0
        assert r["tok_s"] == pytest.approx(2 * r["batch_per_rank"] / r["step_ms"] * 1e3)
        assert r["joined"] == (2 if r["mode"].startswith("prefill-join") else 0)
        assert (r["lookahead"] > 0) is (r["mode"] == "graphs-async")  # only that mode runs ahead
    assert "| ranks | batch/rank | mode |" in proc.stdout
    for b in (1, 2):  # per step: the ops rank 0 launched, by host time
        assert "Self CPU" in (tmp_path / f"profile_w2_b{b}_eager.txt").read_text()
    assert not list(tmp_path.glob("profile_*_graphs.txt"))


def test_decode_sass_gives_the_float8_values_dot_bf16s_operand_layout() -> None:
    """``benchmarks/decode_sass.py`` compiles the decode split kernel for sm_90 with no GPU (Triton's
    bundled ptxas) and reports each loop's instructions and its dots' operand layouts. Over a float8 pool
    (either format, either path) the p.v dot must get ``kWidth = 2``, a 16-bit pool's: values widened
    from float8 are otherwise taken for 8-bit data (``kWidth = 4``), p goes through shared memory and the
    steps were 6% slower at 64-256 x 4k (docs/kernels.md, "A float8 KV pool"). A Triton upgrade that
    sees through ``_opaque`` fails this."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "decode_sass.py"), "--batch", "8", "--context", "1024"],
        capture_output=True, text=True, env=env, timeout=300, check=True,
    ).stdout  # fmt: skip
    rows = {
        m.group(1): (int(m.group(2)), m.group(3))
        for m in re.finditer(r"^\| ([^|]+?) \| [^|]+ \| (\d+) \| ([\d/]+) \|", out, re.M)
    }
    pools = ("float8 pool", "float8 e5m2 pool")
    assert set(rows) == {"bfloat16 pool"} | {f"{p}, {way}" for p in pools for way in ("cast", "words")}, out
    assert rows["bfloat16 pool"][1] == "2/2", out
    for pool in pools:
        for way in ("cast", "words"):
            assert rows[f"{pool}, {way}"][1].split("/")[1] == "2", out
    loops = {name: length for name, (length, _) in rows.items()}
    assert min(loops.values()) > 100, loops  # a loop was found, not a stray branch


def test_lora_bench_smoke_prints_every_row() -> None:
    """``benchmarks/lora_bench.py --smoke``: random PEFT-format adapters of the model's shape load, and each
    batch's row has the engine without LoRA and the three LoRA cases."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "lora_bench.py"), "--smoke", "--batches", "1,2",
         "--max-tokens", "4", "--repeats", "1", "--adapters", "2"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[12] ", line)]
    assert [r[0] for r in rows] == ["1", "2"] and all(len(r) == 8 for r in rows), out


def test_deepseek_bench_smoke_times_both_engines() -> None:
    """``benchmarks/deepseek_bench.py --smoke``: the engine and transformers decode the DeepSeek-V3-shaped
    model (small), a row a batch with both rates (a rate is the time of 17 tokens less that of one: 16 new
    tokens and medians of 3, since a loaded CPU's noise turned single timings of 4 tokens negative)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "deepseek_bench.py"), "--smoke", "--batches", "1,2",
         "--prompt", "16", "--new", "16", "--repeats", "3"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[12] ", line)]
    assert [r[0] for r in rows] == ["1", "2"], out
    assert all(float(r[1]) > 0 and float(r[2]) > 0 for r in rows), out


def test_mtp_bench_smoke_drafts_and_keeps_with_the_predictive_weights() -> None:
    """``benchmarks/mtp_bench.py --smoke``: both weight sets, with and without the draft; the predictive
    weights' drafts are mostly kept, the random ones' mostly not."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "mtp_bench.py"), "--smoke", "--batches", "1,2",
         "--prompt", "16", "--new", "16", "--repeats", "3"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    rows = [line.split() for line in out.splitlines() if re.match(r"\s*(random|predictive) ", line)]
    assert len(rows) == 8 and all(float(r[3]) > 0 for r in rows), out
    kept = {(r[0], r[1]): float(r[4].rstrip("%")) for r in rows if r[2] == "mtp1"}
    assert kept["predictive", "1"] > 50 and kept["random", "1"] < 50, out


def test_eplb_bench_smoke_moves_every_share_of_slots() -> None:
    """``benchmarks/eplb_bench.py --smoke``: the engines with and without redundant slots decode, and each
    share's placements rewrite slots, more for a larger share (2 MoE layers of 12 slots: at most 2, 6 and
    12 a layer; replicas of one expert trading places change nothing)."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "eplb_bench.py"), "--smoke", "--redundant", "4",
         "--batches", "1,2", "--max-tokens", "4", "--repeats", "1", "--shares", "0.1,0.5,1.0"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout  # fmt: skip
    decode = [line.split() for line in out.splitlines() if re.match(r"\s+[12] ", line)]
    assert [r[0] for r in decode] == ["1", "2"] and all(len(r) == 6 for r in decode), out
    moves = [line.split() for line in out.splitlines() if re.match(r"\s+[01]\.\d\d ", line)]
    # Each share with the engine's copy op, then the reference's (--move-ops engine,torch).
    assert [(m[0], m[1]) for m in moves] == [(share, op) for share in ("0.10", "0.50", "1.00")
                                             for op in ("engine", "torch")], out  # fmt: skip
    slots = [int(m[2]) for m in moves[::2]]
    assert 0 < slots[0] <= 4 and slots[0] < slots[1] <= 12 and slots[1] < slots[2] <= 24, out


@pytest.mark.e2e
def test_kv_offload_bench_smoke_loads_the_prompt_from_the_store(tmp_path: Path) -> None:
    """``benchmarks/kv_offload_bench.py --smoke``: a store and a decode worker on the CPU; the table has the
    computed, loaded and local-hit rows, the computed one with no cached tokens and the loaded one with the
    prompt's full blocks (all but the last token's) from the store."""
    import json

    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kv_offload_bench.py"), "--smoke", "--prompt-len", "256",
         "--reps", "2", "--warmup", "1", "--num-kv-blocks", "128", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    rows = {
        m.group(1): (float(m.group(2)), int(m.group(3)))
        for m in re.finditer(r"^\| (computed|loaded|local hit) \| ([\d.]+) \| (\d+) \|", out, re.M)
    }
    assert set(rows) == {"computed", "loaded", "local hit"}, out
    assert rows["computed"][1] == 0, out
    assert rows["loaded"][1] > 0 and rows["loaded"][1] == (256 - 1) // 16 * 16, out
    assert rows["local hit"][1] == rows["loaded"][1], out
    assert all(ttft > 0 for ttft, _ in rows.values()), out
    assert re.search(r"greedy tokens \(4\), loaded equal to local hit .*: 3 of 3 rounds", out), out
    assert re.search(r"greedy tokens, computed equal to local hit .*: 3 of 3 rounds", out), out  # float32
    report = json.loads((tmp_path / "kv_offload_bench.json").read_text())
    assert report["store"]["num_fetches"] == 3  # one load per round, warm-up included


def test_embedding_bench_smoke_times_both_engines() -> None:
    """``embedding_bench.py --smoke``: the engine's embeddings (checked for their size in the script) and
    transformers' forward, each a row with its throughput."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "embedding_bench.py"), "--smoke", "--prompts", "8",
         "--prompt-len", "64", "--repeats", "1"],
        capture_output=True, text=True, timeout=300, check=True, cwd=ROOT,
    ).stdout  # fmt: skip
    rows = re.findall(
        r"^(pdmesh LLM\.embed|transformers AutoModel)\s+([\d.]+)\s+([\d.]+)\s+(\d+)$", out, re.M
    )
    assert [r[0] for r in rows] == ["pdmesh LLM.embed", "transformers AutoModel"], out
    assert all(float(r[1]) > 0 and int(r[3]) > 0 for r in rows), out
