"""LoRA adapters (engine/lora.py) against transformers + PEFT: random-weight adapters written by PEFT
itself, each request's greedy tokens equal to PEFT's model with that adapter, several adapters and the base
model in one batch, adapters taking turns in fewer slots than there are adapters, the prefix cache kept
apart per adapter, and adapters the engine cannot serve refused with the reason."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch

from engine import LLM, LoRARequest, SamplingParams
from engine.errors import InvalidRequestError
from engine.lora import LoRAError, parse_lora_modules
from tests.checkpoints import make_checkpoint
from tests.kernel_testing import needs_gpu

NEW = 12
GREEDY = SamplingParams(max_tokens=NEW, temperature=0.0, ignore_eos=True)
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
ALL = [*ATTENTION, "gate_proj", "up_proj", "down_proj"]


def write_adapter(base: Path, path: Path, seed: int, rank: int, targets: list[str], **config: object) -> Path:
    """A PEFT adapter of ``base`` with random A and B (PEFT starts B at zero: an adapter that changes
    nothing would test nothing)."""
    import transformers
    from peft import LoraConfig, get_peft_model

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    peft_model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                                  lora_dropout=0.0, **config))  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    peft_model.save_pretrained(str(path))
    return path


def peft_greedy(base: Path, adapter: Path | None, prompt: list[int]) -> list[int]:
    import transformers
    from peft import PeftModel

    model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    if adapter is not None:
        model = PeftModel.from_pretrained(model, str(adapter)).eval()
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW,
                             min_new_tokens=NEW, do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("lora")
    base = make_checkpoint("qwen3", root / "base", seed=3)
    return {
        "base": base,
        "all": write_adapter(base, root / "all", seed=1, rank=8, targets=ALL),
        "attn": write_adapter(base, root / "attn", seed=2, rank=4, targets=ATTENTION, use_rslora=True),
        "mlp": write_adapter(base, root / "mlp", seed=5, rank=16, targets=["down_proj", "up_proj"]),
    }


def _prompts(n: int, seed: int, lengths: tuple[int, int] = (3, 40)) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(rng.randrange(*lengths))] for _ in range(n)]


def test_each_adapter_matches_peft_in_one_mixed_batch(dense: dict[str, Path]) -> None:
    names = ["all", "attn", "mlp", None]
    prompts = _prompts(8, seed=0)
    chosen = [names[i % len(names)] for i in range(len(prompts))]
    llm = LLM(str(dense["base"]), dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=3,
              lora_modules=[f"all={dense['all']}", json.dumps({"name": "attn", "path": str(dense["attn"])})])  # fmt: skip
    requests = [LoRARequest(n, i + 1, str(dense[n])) if n else None for i, n in enumerate(chosen)]
    got = llm.generate(prompts, GREEDY, lora_request=requests)
    assert sorted(llm.engine.list_loras()) == ["all", "attn", "mlp"]  # "mlp" loaded from its request
    for prompt, name, out in zip(prompts, chosen, got, strict=True):
        assert out.token_ids == peft_greedy(dense["base"], dense[name] if name else None, prompt), name
    # the adapters change the output (else the comparison above would prove little)
    base_out = peft_greedy(dense["base"], None, prompts[0])
    assert got[0].token_ids != base_out


def test_adapters_take_turns_in_one_slot_with_preemption(dense: dict[str, Path]) -> None:
    """Three adapters through one slot, a KV pool small enough to preempt: every request still gets its
    own adapter's tokens, and no slot or block is leaked."""
    prompts = _prompts(9, seed=1, lengths=(36, 44))  # 3 blocks each, 4 once decoding: 3 need 12 of 8
    names = ["all", "attn", "mlp"]
    chosen = [names[i % 3] for i in range(len(prompts))]
    llm = LLM(str(dense["base"]), dtype="float32", num_kv_blocks=8, max_num_batched_tokens=32, max_num_seqs=4,
              enable_lora=True, max_loras=1, enable_prefix_caching=False)  # fmt: skip
    reqs = [LoRARequest(n, 1, str(dense[n])) for n in chosen]
    got = llm.generate(prompts, GREEDY, lora_request=reqs)
    reference = LLM(str(dense["base"]), dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=3)
    want = reference.generate(prompts, GREEDY, lora_request=reqs)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_pool.num_free_blocks == 8
    assert all(slot.refs == 0 for slot in engine.lora.slots)
    assert peft_greedy(dense["base"], dense[chosen[4]], prompts[4]) == got[4].token_ids


def test_triton_ops_in_the_interpreter(dense: dict[str, Path]) -> None:
    prompts = _prompts(3, seed=2)
    reqs = [LoRARequest("all", 1, str(dense["all"])), None, LoRARequest("attn", 2, str(dense["attn"]))]
    kw = dict(dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    torch_ops = LLM(str(dense["base"]), **kw).generate(prompts, GREEDY, lora_request=reqs)
    triton = LLM(str(dense["base"]), kernel_backend="triton", **kw)
    want = [o.token_ids for o in torch_ops]
    assert [o.token_ids for o in triton.generate(prompts, GREEDY, lora_request=reqs)] == want
    # kernels/triton_lora.py's two-kernel op (not yet the backend's choice) in the engine: the same tokens
    from kernels.triton_lora import lora_apply_triton

    for layer in triton.engine.lora.layers:
        layer.ops = dataclasses.replace(layer.ops, lora_apply=lora_apply_triton)
    assert [o.token_ids for o in triton.generate(prompts, GREEDY, lora_request=reqs)] == want


def test_prefix_cache_is_kept_apart_per_adapter(dense: dict[str, Path]) -> None:
    llm = LLM(str(dense["base"]), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    prompt = list(range(3, 60))
    first = llm.generate([prompt], GREEDY, lora_request=LoRARequest("all", 1, str(dense["all"])))[0]
    same = llm.generate([prompt], GREEDY, lora_request=LoRARequest("all", 1, str(dense["all"])))[0]
    base = llm.generate([prompt], GREEDY)[0]
    other = llm.generate([prompt], GREEDY, lora_request=LoRARequest("attn", 2, str(dense["attn"])))[0]
    assert first.num_cached_tokens == 0 and same.num_cached_tokens > 0  # its own cache, reused
    assert base.num_cached_tokens == 0 and other.num_cached_tokens == 0  # nobody else's
    assert same.token_ids == first.token_ids
    assert base.token_ids == peft_greedy(dense["base"], None, prompt)


def test_moe_attention_adapter_matches_peft(tmp_path: Path) -> None:
    base = make_checkpoint("qwen3_moe", tmp_path / "moe", seed=4)
    adapter = write_adapter(base, tmp_path / "a", seed=6, rank=8, targets=ATTENTION)
    prompts = _prompts(2, seed=3)
    llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True)
    got = llm.generate(prompts, GREEDY, lora_request=LoRARequest("a", 1, str(adapter)))
    assert [o.token_ids for o in got] == [peft_greedy(base, adapter, p) for p in prompts]
    # An adapter of the experts (as PEFT names transformers 5's fused ones) is refused, saying why.
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.0.mlp.experts.gate_up_proj.lora_A.weight"] = torch.zeros(8, 64)
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match="adapts a module this engine cannot"):
        llm.engine.add_lora("e", str(adapter))


@pytest.mark.parametrize("arch", ["deepseek_v3", "deepseek_v2_lite"])
def test_deepseek_latent_attention_adapters_match_peft(arch: str, tmp_path: Path) -> None:
    """DeepSeek's latent attention takes adapters on its query projections (V3's q_a_proj and q_b_proj, or
    V2-Lite's q_proj), the latent's kv_a_proj_with_mqa (stacked with the query's first projection in one
    weight) and o_proj: the tokens are PEFT's on transformers' model, with the torch ops and the Triton
    ops in the interpreter, the rotary rows of the adapters' B taken into the model's order as the weights'
    are. kv_b_proj (absorbed) and the shared experts are refused by name, as is a per-module rank that
    applies to an adapted module (PEFT's own patterns for transformers' fused experts match none here)."""
    base = make_checkpoint(arch, tmp_path / "base", seed=7)
    query = ["q_a_proj", "q_b_proj"] if arch == "deepseek_v3" else ["q_proj"]
    adapter = write_adapter(
        base, tmp_path / "a", seed=8, rank=8, targets=[*query, "kv_a_proj_with_mqa", "o_proj"]
    )
    prompts = _prompts(3, seed=5)
    for backend in ("torch", "triton"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("TRITON_INTERPRET", "1")
            llm = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2,
                      kernel_backend=backend)  # fmt: skip
            reqs = [LoRARequest("a", 1, str(adapter)), None, LoRARequest("a", 1, str(adapter))]
            got = [o.token_ids for o in llm.generate(prompts, GREEDY, lora_request=reqs)]
            # One sequence alone: decode steps of one row (the Triton ops' fused norm-GEMV paths)
            alone = llm.generate(prompts[:1], GREEDY, lora_request=reqs[:1])[0].token_ids
        if backend == "torch":
            want = [peft_greedy(base, adapter if r else None, p) for p, r in zip(prompts, reqs, strict=True)]
            assert got[0] != peft_greedy(base, None, prompts[0])  # the adapter changes the tokens
        assert got == want and alone == want[0], backend
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    for module, words in (
        ("self_attn.kv_b_proj", "adapts a module this engine cannot"),
        ("mlp.shared_experts.gate_proj", "adapts a module this engine cannot"),
    ):
        bad = dict(tensors)
        bad[f"base_model.model.model.layers.1.{module}.lora_A.weight"] = torch.zeros(8, 32)
        save_file(bad, str(tmp_path / "a" / "adapter_model.safetensors"))
        with pytest.raises(LoRAError, match=words):
            llm.engine.add_lora("bad", str(tmp_path / "a"))
    save_file(tensors, str(tmp_path / "a" / "adapter_model.safetensors"))
    config = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    config["rank_pattern"] = {**(config.get("rank_pattern") or {}), r".*\.o_proj": 4}
    (tmp_path / "a" / "adapter_config.json").write_text(json.dumps(config))
    with pytest.raises(LoRAError, match="per-module rank_pattern"):
        llm.engine.add_lora("bad", str(tmp_path / "a"))


def _ep_rank(rank: int, world: int, port: int, base: str, adapter: str, prompts: list, out: dict) -> None:
    import faulthandler

    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    llm = LLM(base, dtype="float32", num_kv_blocks=64, expert_parallel_size=world, expert_parallel_rank=rank,
              distributed_init_method=f"tcp://127.0.0.1:{port}", enable_lora=True, max_loras=2)  # fmt: skip
    out[rank] = [
        o.token_ids for o in llm.generate(prompts[rank], GREEDY, lora_request=_ep_requests(rank, adapter))
    ]
    llm.close()


def _ep_requests(rank: int, adapter: str) -> list[LoRARequest | None]:
    """Rank 0: the adapter, no adapter, the adapter; rank 1: none at all (its passes skip the LoRA ops
    while rank 0's run them)."""
    return [LoRARequest("a", 1, adapter) if rank == 0 and i % 2 == 0 else None for i in range(3)]


@pytest.mark.slow
def test_two_expert_parallel_ranks_serve_adapters(tmp_path: Path) -> None:
    """Two expert-parallel ranks (gloo) of a Qwen3-MoE model, each with its own requests, one rank's with an
    adapter of the attention and the other's without: the single engine's tokens (an adapter's projections
    are the rank's own work; only the experts' exchange is shared, and it does not depend on them)."""
    import torch.multiprocessing as mp

    from mesh.cli import free_port

    base = make_checkpoint("qwen3_moe", tmp_path / "moe", seed=4)
    adapter = str(write_adapter(base, tmp_path / "a", seed=6, rank=8, targets=ATTENTION))
    prompts = [_prompts(3, seed=11), _prompts(3, seed=12)]
    single = LLM(str(base), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    want = [[o.token_ids for o in single.generate(p, GREEDY, lora_request=_ep_requests(r, adapter))]
            for r, p in enumerate(prompts)]  # fmt: skip
    assert want[0][0] != peft_greedy(base, None, prompts[0][0])  # the adapter changes the tokens
    out = mp.Manager().dict()
    mp.spawn(_ep_rank, args=(2, free_port(), str(base), adapter, prompts, out), nprocs=2, join=True)
    assert [out[0], out[1]] == want


def test_bad_adapters_and_requests_are_refused(dense: dict[str, Path], tmp_path: Path) -> None:
    llm = LLM(str(dense["base"]), dtype="float32", num_kv_blocks=64, enable_lora=True, max_lora_rank=8)
    with pytest.raises(LoRAError, match="rank 16, more than max_lora_rank 8"):
        llm.engine.add_lora("mlp", str(dense["mlp"]))
    with pytest.raises(LoRAError, match="not found"):
        llm.engine.add_lora("nowhere", str(tmp_path / "missing"))
    dora = write_adapter(dense["base"], tmp_path / "dora", seed=8, rank=4, targets=ATTENTION, use_dora=True)
    with pytest.raises(LoRAError, match="use_dora"):
        llm.engine.add_lora("dora", str(dora))
    with pytest.raises(InvalidRequestError, match="'nope' is not loaded"):
        llm.engine.add_request("r1", [5, 6, 7], GREEDY, lora_name="nope")
    plain = LLM(str(dense["base"]), dtype="float32", num_kv_blocks=64)
    with pytest.raises(InvalidRequestError, match="serves none"):
        plain.engine.add_request("r2", [5, 6, 7], GREEDY, lora_name="all")
    llm.engine.add_lora("all", str(dense["all"]))
    llm.engine.remove_lora("all")
    assert llm.engine.list_loras() == []
    assert parse_lora_modules(["a=/x", '{"name": "b", "path": "/y"}']) == [("a", "/x"), ("b", "/y")]
    with pytest.raises(LoRAError, match="name=path"):
        parse_lora_modules(["nopath"])


@needs_gpu
def test_gpu_graphs_with_adapters_match_the_eager_reference(dense: dict[str, Path]) -> None:
    """On a GPU: decode graphs, prefill graphs and asynchronous scheduling with adapters in and out of
    slots (two slots, three adapters) give the eager torch ops' tokens (float32: identical)."""
    prompts = _prompts(12, seed=4)
    names = ["all", None, "attn", "mlp"]
    reqs = [LoRARequest(n, 1, str(dense[n])) if n else None for n in (names[i % 4] for i in range(12))]
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=256, enable_lora=True, max_loras=2)
    fast = LLM(str(dense["base"]), kernel_backend="triton", **kw)
    assert fast.engine.runner.graphs is not None and fast.engine.config.async_scheduling
    eager = LLM(str(dense["base"]), kernel_backend="torch", cuda_graphs=False, **kw)
    got = fast.generate(prompts, GREEDY, lora_request=reqs)
    assert [o.token_ids for o in got] == [
        o.token_ids for o in eager.generate(prompts, GREEDY, lora_request=reqs)
    ]
    assert fast.engine.stats().decode_graph_passes > 0


@needs_gpu
def test_gpu_deepseek_adapters_in_the_decode_graphs(tmp_path: Path) -> None:
    """On a GPU: a DeepSeek-V3 model's latent-attention adapters through the decode graphs (captured with
    and without the LoRA ops) and the Triton ops give the eager torch ops' tokens (float32: identical)."""
    base = make_checkpoint("deepseek_v3", tmp_path / "base", seed=7)
    adapter = write_adapter(base, tmp_path / "a", seed=8, rank=8,
                            targets=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj"])  # fmt: skip
    prompts = _prompts(6, seed=9)
    reqs = [LoRARequest("a", 1, str(adapter)) if i % 2 == 0 else None for i in range(6)]
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    fast = LLM(str(base), kernel_backend="triton", **kw)
    assert fast.engine.runner.graphs is not None
    eager = LLM(str(base), kernel_backend="torch", cuda_graphs=False, **kw)
    want = [o.token_ids for o in eager.generate(prompts, GREEDY, lora_request=reqs)]
    assert [o.token_ids for o in fast.generate(prompts, GREEDY, lora_request=reqs)] == want
    assert fast.engine.stats().decode_graph_passes > 0


@needs_gpu
def test_gpu_graphs_without_lora_ops_serve_steps_without_adapters(dense: dict[str, Path]) -> None:
    """On a GPU, with ``cudagraph_specialize_lora`` (the default): steps in which no request has an adapter
    replay decode and prefill graphs captured without the LoRA ops, with the plain engine's tokens (float32:
    identical); steps with an adapter row replay the graphs with them, and once the adapters' requests
    finish, the rest of the batch goes back to the graphs without."""
    kw = dict(device="cuda", dtype="float32", num_kv_blocks=256)
    lora = LLM(str(dense["base"]), kernel_backend="triton", enable_lora=True, max_loras=2, **kw)
    plain = LLM(str(dense["base"]), kernel_backend="triton", **kw)
    decode, prefill = lora.engine.runner.graphs, lora.engine.runner.prefill_graphs
    assert decode is not None and prefill is not None
    assert decode.graphs_without_lora.keys() == decode.graphs.keys()
    prompts = _prompts(6, seed=7)
    got = lora.generate(prompts, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain.generate(prompts, GREEDY)]
    for graphs in (decode, prefill):
        assert sum(graphs.replays_without_lora.values()) == sum(graphs.replays.values()) > 0
    # Two adapter requests of three tokens among four base ones of twelve.
    short = dataclasses.replace(GREEDY, max_tokens=3)
    params = [short, short, GREEDY, GREEDY, GREEDY, GREEDY]
    reqs = [LoRARequest("all", 1, str(dense["all"])), LoRARequest("attn", 2, str(dense["attn"]))] + [None] * 4
    before = dict(decode.replays), dict(decode.replays_without_lora)
    got = lora.generate(prompts, params, lora_request=reqs)
    eager = LLM(str(dense["base"]), kernel_backend="torch", cuda_graphs=False, enable_lora=True, max_loras=2,
                **kw)  # fmt: skip
    assert [o.token_ids for o in got] == [
        o.token_ids for o in eager.generate(prompts, params, lora_request=reqs)
    ]
    with_lora = sum(decode.replays.values()) - sum(before[0].values())
    without = sum(decode.replays_without_lora.values()) - sum(before[1].values())
    assert with_lora - without > 0 and without > 0  # both kinds in one generate


def test_prefill_pieces_without_lora_ops_for_steps_without_adapters(dense: dict[str, Path]) -> None:
    """CPU (the prefill graphs' pieces run eagerly, ``EagerPieces``): with ``cudagraph_specialize_lora`` a
    LoRA engine keeps a second set of pieces, without the LoRA ops: steps in which no row has an adapter go
    through it, running no LoRA op, the others through the set with them; the tokens are the plain
    engine's and the LoRA engine's without pieces. Turned off, every step goes through the set with them."""
    from tests.test_prefill_graphs import EagerPieces

    prompts = _prompts(4, seed=21)
    kw = dict(dtype="float32", num_kv_blocks=128, max_num_batched_tokens=48)
    plain = LLM(str(dense["base"]), **kw).generate(prompts, GREEDY)
    reqs = [LoRARequest("all", 1, str(dense["all"])) if i % 2 == 0 else None for i in range(len(prompts))]
    reference = LLM(str(dense["base"]), enable_lora=True, **kw).generate(prompts, GREEDY, lora_request=reqs)
    for specialize in (True, False):
        llm = LLM(str(dense["base"]), enable_lora=True, cudagraph_specialize_lora=specialize, **kw)
        runner = llm.engine.runner
        pieces = EagerPieces(runner.model, runner.kv_pool, 48, torch.device("cpu"), specialize)
        runner.prefill_graphs = pieces
        pieces.capture()
        calls = []
        for layer in llm.engine.lora.layers:
            op = layer.ops.lora_apply
            layer.ops = dataclasses.replace(
                layer.ops, lora_apply=lambda *a, op=op, c=calls: c.append(1) or op(*a)
            )
        base = llm.generate(prompts, GREEDY)
        assert [o.token_ids for o in base] == [o.token_ids for o in plain]
        assert not calls
        passes, without = sum(pieces.replays.values()), sum(pieces.replays_without_lora.values())
        assert passes > 0 and without == (passes if specialize else 0)
        mixed = llm.generate(prompts, GREEDY, lora_request=reqs)
        assert [o.token_ids for o in mixed] == [o.token_ids for o in reference]
        assert calls  # the adapter rows' steps ran the LoRA ops
        assert sum(pieces.replays.values()) - sum(pieces.replays_without_lora.values()) > passes - without


def test_an_adapter_in_use_stays_and_a_replaced_one_leaves_no_cache(dense: dict[str, Path]) -> None:
    llm = LLM(str(dense["base"]), dtype="float32", num_kv_blocks=64, enable_lora=True, max_loras=2)
    engine = llm.engine
    engine.add_lora("x", str(dense["all"]))
    engine.add_request("waiting", list(range(3, 40)), GREEDY, lora_name="x")
    with pytest.raises(LoRAError, match="in use by 1 unfinished"):
        engine.remove_lora("x")
    with pytest.raises(LoRAError, match="in use"):
        engine.add_lora("x", str(dense["attn"]))
    while engine.has_unfinished():
        engine.step()
    prompt = list(range(3, 60))
    first = llm.generate([prompt], GREEDY, lora_request=LoRARequest("x", 1, str(dense["all"])))[0]
    engine.add_lora("x", str(dense["attn"]))  # the same name, another adapter
    again = llm.generate([prompt], GREEDY, lora_request=LoRARequest("x", 1, str(dense["attn"])))[0]
    assert again.num_cached_tokens == 0  # the old adapter's KV is gone
    assert again.token_ids == peft_greedy(dense["base"], dense["attn"], prompt) != first.token_ids


def test_eager_passes_without_adapters_skip_lora(
    dense: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With LoRA on, an eager pass in which no row has an adapter runs no LoRA op (its tokens are the plain
    engine's); one with an adapter row runs it for every projection of every layer."""
    llm = LLM(str(dense["base"]), dtype="float32", num_kv_blocks=64, enable_lora=True)
    calls = []
    for layer in llm.engine.lora.layers:
        op = layer.ops.lora_apply
        layer.ops = dataclasses.replace(
            layer.ops, lora_apply=lambda *a, op=op, c=calls: c.append(1) or op(*a)
        )
    prompts = _prompts(3, seed=9)
    base = llm.generate(prompts, GREEDY)
    assert not calls
    plain = LLM(str(dense["base"]), dtype="float32", num_kv_blocks=64).generate(prompts, GREEDY)
    assert [o.token_ids for o in base] == [o.token_ids for o in plain]
    llm.generate(
        prompts[:1], SamplingParams(max_tokens=1), lora_request=LoRARequest("all", 1, str(dense["all"]))
    )
    layers = llm.engine.model_config.num_layers
    assert len(calls) == 4 * layers  # one pass (the prompt), every projection of every layer
