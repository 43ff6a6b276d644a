"""DeepSeek-V3's multi-token-prediction layer as a speculative draft (engine/models/mtp.py,
``--speculative-config '{"method": "mtp"}'``): each draft is transformers' computation of the checkpoint's
MTP layer (``tests.checkpoints.mtp_reference_logits``), the output is transformers' greedy output and
plain decoding's, drafts are kept as often as the reference says they should be, and the layer's KV moves
with the decoder's (prefix cache, disaggregation over NIXL, the KV offload store's layout)."""

from __future__ import annotations

import faulthandler
import json
import random
import re
import urllib.request
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.errors import UnsupportedModelError
from engine.kv_offload import layout_for_model
from tests.checkpoints import VOCAB, add_mtp_layer, hf_greedy, make_checkpoint, mtp_reference_logits
from tests.kernel_testing import needs_gpu

MTP = '{"method": "mtp"}'
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("deepseek_v3", tmp_path_factory.mktemp("mtp") / "base", seed=7)


@pytest.fixture(scope="module")
def mtp_model(base: Path) -> Path:
    """Random MTP weights: its drafts are mostly wrong, but each is exactly the layer's prediction."""
    return add_mtp_layer(base, base.parent / "mtp", seed=11)


@pytest.fixture(scope="module")
def predictive(base: Path) -> Path:
    """Layers that add little to their input and an MTP layer that reads its token: most drafts kept."""
    return add_mtp_layer(base, base.parent / "predictive", seed=11, predictive=True)


def _prompts(n: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 30))] for _ in range(n)]


def _recording(llm: LLM) -> list[tuple[str, int, list[int]]]:
    """The engine's drafts as they are made: (request id, its token count then, the draft tokens). Only
    observes ``_mtp_pass``: the step runs as it would."""
    engine = llm.engine
    made: list[tuple[str, int, list[int]]] = []
    run = engine._mtp_pass

    def observed(batch, step) -> None:  # type: ignore[no-untyped-def]
        run(batch, step)
        for seq in batch.seqs:
            draft = engine._mtp_drafts.get(seq)
            if draft is not None and draft[0] == seq.num_tokens:
                made.append((seq.request_id, draft[0], list(draft[1])))

    engine._mtp_pass = observed  # type: ignore[method-assign]
    return made


def _check_drafts(path: Path, made: list[tuple[str, int, list[int]]], rid: str, tokens: list[int]) -> int:
    """Every draft of request ``rid`` (whose tokens are ``tokens`` in the end) is transformers' MTP
    prediction: a draft made when the request had n tokens comes from position n - 2 (its last computed
    row), its later tokens from the layer run again on the one before (``mtp_reference_logits``'s chain).
    Returns the drafts checked."""
    drafts = [(n, draft) for r, n, draft in made if r == rid]
    whole = mtp_reference_logits(path, tokens).argmax(dim=-1)
    for n, draft in drafts:
        if len(draft) == 1:
            assert draft == [int(whole[n - 2])], (n, draft)
        else:
            chain = mtp_reference_logits(path, tokens[:n], chain=len(draft)).argmax(dim=-1)
            assert draft == chain[n - 2 :].tolist(), (n, draft)
    return len(drafts)


@pytest.mark.parametrize("k", [1, 3])
def test_every_draft_is_the_mtp_layers_prediction_and_the_output_is_transformers(
    mtp_model: Path, k: int
) -> None:
    """Three prompts at once, then one that shares a prompt's first 17 tokens (its first block from the
    prefix cache, the MTP layer's KV with it): each draft made after a step is the argmax of transformers'
    MTP computation at the request's last computed position (and, with k tokens a draft, the layer run
    again on its own output for the rest, as vLLM's ``num_speculative_tokens`` does), and every output is
    transformers' greedy one."""
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": k})
    llm = LLM(str(mtp_model), dtype="float32", num_kv_blocks=64, speculative_config=spec)
    made = _recording(llm)
    prompts = _prompts(3, seed=1)
    prompts[0] = (prompts[0] + [7] * 20)[:20]
    outputs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    cached = llm.engine.cached_prompt_tokens_total
    shared = prompts[0][:17] + [9, 9, 4]
    outputs.append(llm.generate([shared], GREEDY)[0].token_ids)
    assert llm.engine.cached_prompt_tokens_total - cached == 16  # its first block from the prefix cache
    prompts.append(shared)
    ids = list(dict.fromkeys(rid for rid, _, _ in made))  # in the order the requests came
    assert len(ids) == 4
    for rid, prompt, out in zip(ids, prompts, outputs, strict=True):
        assert out == hf_greedy(mtp_model, prompt, GREEDY.max_tokens)
        assert _check_drafts(mtp_model, made, rid, prompt + out) >= 5
    assert all(len(draft) == k for _, _, draft in made)


def test_the_layers_logits_equal_transformers(mtp_model: Path) -> None:
    """The MTP layer's logits (latent attention over its own KV in the pool, its MoE, the shared head),
    step after step, equal transformers' computation over the whole sequence."""
    llm = LLM(str(mtp_model), dtype="float32", num_kv_blocks=64, speculative_config=MTP)
    mtp = llm.engine.model.mtp
    seen: list[torch.Tensor] = []
    logits = mtp.logits

    def observed(h: torch.Tensor) -> torch.Tensor:
        out = logits(h)
        seen.append(out.clone())
        return out

    mtp.logits = observed  # type: ignore[method-assign]
    made = _recording(llm)
    prompt = _prompts(1, seed=2)[0] + [5, 6, 7]
    out = llm.generate([prompt], GREEDY)[0].token_ids
    reference = mtp_reference_logits(mtp_model, prompt + out)
    seen = [rows for rows in seen if rows.shape[0]]  # the last pass drafts for no one
    assert len(seen) == len(made) >= 8
    for (_, n, _), got in zip(made, seen, strict=True):
        torch.testing.assert_close(got[0], reference[n - 2], atol=2e-4, rtol=1e-4)


def test_drafts_are_kept_as_often_as_the_reference_predicts(predictive: Path) -> None:
    """With a predictive MTP layer most drafts are kept: the count kept equals what transformers' MTP
    predictions and greedy output give, step by step (a draft from row q, kept, makes the next from row
    q + 2; refused, from q + 1), and the output is still transformers'."""
    prompt = _prompts(1, seed=3)[0] + [11, 12]
    max_tokens = 24
    llm = LLM(str(predictive), dtype="float32", num_kv_blocks=64, speculative_config=MTP)
    steps = []
    step = llm.engine.step

    def counted():  # type: ignore[no-untyped-def]
        steps.append(1)
        return step()

    llm.engine.step = counted  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    out = llm.generate([prompt], params)[0].token_ids
    assert out == hf_greedy(predictive, prompt, max_tokens)
    tokens = prompt + out
    reference = mtp_reference_logits(predictive, tokens).argmax(dim=-1).tolist()
    drafted = kept = 0
    row = len(prompt) - 1  # the prefill step drafts from the prompt's last row
    while True:
        generated = row + 2 - len(prompt)  # tokens out when that draft is made
        if max_tokens - generated - 1 <= 0:  # no room left for a draft
            break
        drafted += 1
        if reference[row] == tokens[row + 2]:
            kept += 1
            row += 2
        else:
            row += 1
    engine = llm.engine
    assert (engine.spec_draft_tokens, engine.spec_accepted_tokens) == (drafted, kept)
    assert kept > drafted * 0.6
    assert len(steps) <= max_tokens - kept + 1


def test_a_float8_checkpoints_mtp_layer_drafts_as_its_widened_weights_do(
    predictive: Path, tmp_path: Path
) -> None:
    """A float8 copy of the predictive checkpoint (DeepSeek-V3's kind, 16 x 128 blocks, the MTP layer's
    projections included): the MTP layer's decoder layer keeps its projections and experts in float8 and
    ``eh_proj`` is widened (vLLM keeps it unquantised too); the drafts made and kept, and the output, are
    those of the same checkpoint widened at load (``quantization="none"``: the weights the float8 ones stand
    for; float32, so the same arithmetic), and the output is plain decoding's."""
    from kernels.fp8_weight import Fp8Weight
    from tests.checkpoints import quantize_checkpoint

    quantize_checkpoint(predictive, tmp_path / "fp8", "fp8", block=(16, 128))
    prompts = _prompts(3, seed=6)
    kw = dict(dtype="float32", num_kv_blocks=64)
    runs = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(tmp_path / "fp8"), speculative_config=MTP, quantization=quantization, **kw)
        made = _recording(llm)
        outputs = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        order = list(dict.fromkeys(rid for rid, _, _ in made))  # request ids differ run to run
        drafts = [(order.index(rid), n, draft) for rid, n, draft in made]
        runs[quantization] = (outputs, drafts, llm.engine.spec_accepted_tokens)
        block = llm.engine.model.mtp.block
        float8 = [block.self_attn.qkv_a_proj, block.self_attn.o_proj, block.mlp.w13]
        assert [isinstance(w, Fp8Weight) for w in float8] == [quantization == "auto"] * 3
        assert not isinstance(llm.engine.model.mtp.eh_proj, Fp8Weight)
    outputs, made, kept = runs["auto"]
    assert runs["none"] == runs["auto"]
    assert len(made) >= 10 and kept > len(made) * 0.5
    plain = LLM(str(tmp_path / "fp8"), **kw)
    assert outputs == [o.token_ids for o in plain.generate(prompts, GREEDY)]


def test_a_float8_kv_cache_keeps_plain_decodings_tokens(predictive: Path) -> None:
    """With a float8 latent pool (``kv_cache_dtype="fp8"``; the MTP layer's KV a layer of it) drafting
    keeps plain decoding's tokens over the same pool, and most drafts are still kept."""
    prompts = _prompts(3, seed=7)
    kw = dict(dtype="float32", num_kv_blocks=64, kv_cache_dtype="fp8")
    want = [o.token_ids for o in LLM(str(predictive), **kw).generate(prompts, GREEDY)]
    llm = LLM(str(predictive), speculative_config=MTP, **kw)
    assert llm.engine.kv_pool.dtype == torch.float8_e4m3fn
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    stats = llm.engine.stats()
    assert stats.spec_accepted_tokens > stats.spec_draft_tokens * 0.5


def _ep_rank(rank: int, world: int, port: int, path: str, prompts: list, params: list, out: dict) -> None:
    faulthandler.dump_traceback_later(240, exit=True)
    torch.set_num_threads(1)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    llm = LLM(path, dtype="float32", num_kv_blocks=64, expert_parallel_size=world, expert_parallel_rank=rank,
              distributed_init_method=f"tcp://127.0.0.1:{port}", speculative_config=spec)  # fmt: skip
    model = llm.engine.model
    out[f"experts{rank}"] = (model.moe_blocks()[0].w13.shape[0], model.mtp.block.mlp.w13.shape[0])
    out[rank] = [o.token_ids for o in llm.generate(prompts[rank], params[rank])]
    out[f"kept{rank}"] = llm.engine.spec_accepted_tokens
    llm.close()


@pytest.mark.slow
def test_two_expert_parallel_ranks_draft_with_the_mtp_layer(predictive: Path) -> None:
    """Two expert-parallel ranks (gloo), each with its own requests (two prompts on one, one shorter
    generation on the other, so one rank idles through the other's last steps), drafting two tokens with
    the MTP layer: each rank holds half of the model's routed experts and the whole MTP layer (its pass is
    the rank's own, no exchange), and the tokens are the single engine's, greedy and seeded."""
    import torch.multiprocessing as mp

    from mesh.cli import free_port

    prompts = [_prompts(2, seed=8), _prompts(1, seed=9)]
    params = [
        [GREEDY, SamplingParams(max_tokens=16, temperature=0.8, seed=4, ignore_eos=True)],
        [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)],
    ]
    single = LLM(str(predictive), dtype="float32", num_kv_blocks=64, speculative_config=MTP)
    want = [[o.token_ids for o in single.generate(p, sp)] for p, sp in zip(prompts, params, strict=True)]
    out = mp.Manager().dict()
    mp.spawn(_ep_rank, args=(2, free_port(), str(predictive), prompts, params, out), nprocs=2, join=True)
    assert [out[0], out[1]] == want
    assert out["experts0"] == out["experts1"] == (4, 8)
    assert out["kept0"] > 0 and out["kept1"] > 0


@pytest.mark.parametrize("k", [1, 3])
def test_tight_pools_preemption_and_sampling_keep_plain_decodings_tokens(predictive: Path, k: int) -> None:
    """A pool small enough to preempt (and, with 3-token drafts, to leave some sequences' chains short of
    blocks), a small token budget (chunked prompts), greedy and seeded sampling: the tokens plain decoding
    gives, every block back."""
    prompts = _prompts(5, seed=4)
    config = dict(dtype="float32", num_kv_blocks=10, max_num_batched_tokens=8, max_num_seqs=4)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": k})
    for params in (
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, seed=3, ignore_eos=True),
    ):
        want = [o.token_ids for o in LLM(str(predictive), **config).generate(prompts, params)]
        llm = LLM(str(predictive), speculative_config=spec, **config)
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        stats = llm.engine.stats()
        assert stats.spec_accepted_tokens > 0
        # Kept tokens are a draft's first ones: position i counts no more than position i - 1.
        per_pos = stats.spec_accepted_per_pos
        assert len(per_pos) == k and sum(per_pos) == stats.spec_accepted_tokens
        assert (
            all(a >= b for a, b in zip(per_pos, per_pos[1:], strict=False))
            and per_pos[0] <= stats.spec_drafts
        )
        assert llm.engine.block_pool.num_free_blocks == config["num_kv_blocks"]


def test_the_pool_has_the_mtp_layer_and_the_store_knows_it(mtp_model: Path) -> None:
    llm = LLM(str(mtp_model), dtype="float32", num_kv_blocks=16, speculative_config=MTP)
    layout = llm.engine.layout
    assert layout.num_layers == 4 and llm.engine.kv_pool.shape[1] == 4  # three decoder layers and the MTP's
    assert (
        layout_for_model(str(mtp_model), "float32", speculative_config=MTP).fingerprint == layout.fingerprint
    )
    assert layout_for_model(str(mtp_model), "float32").fingerprint != layout.fingerprint
    # The checkpoint's MTP embeddings and head equal the model's: one tensor each.
    model = llm.engine.model
    assert model.mtp.embed_tokens is model.embed_tokens and model.mtp.head is model.lm_head
    # Without the draft, the same checkpoint loads without its MTP layer and gives the same tokens.
    plain = LLM(str(mtp_model), dtype="float32", num_kv_blocks=16)
    assert plain.engine.model.mtp is None and plain.engine.layout.num_layers == 3
    prompt = _prompts(1, seed=5)[0]
    assert plain.generate([prompt], GREEDY)[0].token_ids == llm.generate([prompt], GREEDY)[0].token_ids


@pytest.mark.parametrize(
    ("model", "text", "error", "message"),
    [
        ("tiny-moe", MTP, UnsupportedModelError, "no multi-token-prediction layer"),
        ("base", MTP, UnsupportedModelError, "lacks weights for: \\['mtp.block"),
        ("tiny-deepseek", '{"method": "mtp", "num_speculative_tokens": 0}', ValueError, "positive integer"),
        ("tiny-deepseek", '{"method": "deepseek_mtp", "prompt_lookup_max": 2}', ValueError, "no keys"),
        ("tiny-deepseek", '{"method": "eagle"}', ValueError, "'ngram' \\(prompt lookup\\) and 'mtp'"),
    ],
)
def test_what_mtp_refuses(base: Path, model: str, text: str, error: type, message: str) -> None:
    """A model without an MTP layer, a checkpoint that declares one but has no weights for it (the test
    checkpoints' config says num_nextn_predict_layers 1, as transformers writes it), more than one draft
    token, keys of other methods, unknown methods."""
    with pytest.raises(error, match=message):
        LLM(
            str(base) if model == "base" else model,
            dtype="float32",
            num_kv_blocks=16,
            speculative_config=text,
        )


def test_the_built_in_deepseek_drafts_with_its_mtp_layer() -> None:
    """``tiny-deepseek`` has an MTP layer (random, as its other weights): drafts are made and checked, and
    the tokens are plain decoding's."""
    prompts = _prompts(3, seed=6)
    want = [o.token_ids for o in LLM("tiny-deepseek", num_kv_blocks=64).generate(prompts, GREEDY)]
    llm = LLM("tiny-deepseek", num_kv_blocks=64, speculative_config=json.dumps({"method": "deepseek_mtp"}))
    assert [o.token_ids for o in llm.generate(prompts, GREEDY)] == want
    assert llm.engine.spec_draft_tokens >= 3 * 10


@pytest.mark.parametrize("with_mtp_kv", [True, False])
def test_an_imported_prompts_blocks_carry_the_mtp_layers_kv(mtp_model: Path, with_mtp_kv: bool) -> None:
    """Disaggregation in one process: a prefill engine computes the prompt and holds its blocks, a decode
    engine imports them (copied whole, as a NIXL transfer moves them) and decodes; every draft it makes is
    transformers' MTP prediction, so its MTP layer read the prompt's MTP KV the prefill engine wrote. With
    that layer of the blocks left out of the copy, the drafts differ from the reference: the check sees it."""
    prompt = _prompts(1, seed=10)[0] + [30, 31, 32, 33]
    config = dict(dtype="float32", num_kv_blocks=64, speculative_config=MTP)
    prefill_llm = LLM(str(mtp_model), **config)
    prefill = prefill_llm.engine
    prefill.add_request("r", prompt, GREEDY, hold_kv=True)  # its first token, then its KV held
    first = None
    while first is None:
        first = next((o.new_token_ids[0] for o in prefill.step() if o.finished), None)
    decode_llm = LLM(str(mtp_model), **config)
    decode = decode_llm.engine
    made = _recording(decode_llm)
    src = torch.tensor(prefill.held_blocks("r"))
    dst = torch.tensor(decode.reserve_import("r", prompt, GREEDY))
    layers = decode.kv_pool.shape[1] if with_mtp_kv else decode.kv_pool.shape[1] - 1
    decode.kv_pool[dst, :layers] = prefill.kv_pool[src, :layers]
    prefill.release_held("r")
    decode.commit_import("r", first)
    tokens = [first]
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == hf_greedy(mtp_model, prompt, GREEDY.max_tokens)
    reference = mtp_reference_logits(mtp_model, prompt + tokens).argmax(dim=-1)
    drafts = [(n, draft) for _, n, draft in made]
    assert len(drafts) >= 10
    same = [draft == [int(reference[n - 2])] for n, draft in drafts]
    assert all(same) if with_mtp_kv else not all(same)


@pytest.mark.e2e
def test_a_disaggregated_request_drafts_with_the_kv_it_imported(predictive: Path) -> None:
    """Prefill and decode workers with the MTP draft, the prompt's KV (the MTP layer's with it) moved over
    NIXL: the router's reply is the offline engine's, and the decode worker keeps drafts from its first
    decode step on (its MTP layer reads the prompt's MTP KV the prefill worker wrote)."""
    from tests.mesh_fixtures import ServiceProcess, router_generate, worker_pair

    model = str(predictive)
    prompt = _prompts(1, seed=7)[0] + [20, 21, 22]
    want = LLM(model, dtype="float32", num_kv_blocks=64).generate([prompt], GREEDY)[0].token_ids
    with worker_pair("--model", model, "--speculative-config", MTP) as (prefill, decode):
        router = ServiceProcess.start(
            "router", "--model", model, "--http-port", "0", "--prefill-workers", prefill.address,
            "--decode-workers", decode.address, "--pd-threshold-tokens", "0",
        )  # fmt: skip
        try:
            [(tokens, first, second)] = router_generate(router.address, [prompt], 16)
            assert tokens == want
            assert first and second and first != second
            with urllib.request.urlopen(f"http://{decode.metrics_address}/metrics", timeout=10) as resp:
                text = resp.read().decode()
            drafted = float(
                re.search(r"^pdmesh_decode_spec_decode_draft_tokens_tokens_total (\S+)$", text, re.M)[1]
            )
            kept = float(
                re.search(r"^pdmesh_decode_spec_decode_accepted_tokens_tokens_total (\S+)$", text, re.M)[1]
            )
            assert drafted > 0 and kept > drafted * 0.5
            # vLLM's draft count and per-position acceptance (one token a draft: position 0 only).
            drafts = float(re.search(r"^vllm:spec_decode_num_drafts_total\{[^}]*\} (\S+)$", text, re.M)[1])
            at0 = re.search(r'^vllm:spec_decode_num_accepted_tokens_per_pos_total\{[^}]*position="0"[^}]*\} (\S+)$',
                            text, re.M)  # fmt: skip
            assert drafts == drafted and float(at0[1]) == kept
        finally:
            assert router.stop() == 0, router.log()


@needs_gpu
def test_gpu_verification_replays_the_decode_graphs_and_keeps_the_tokens(predictive: Path) -> None:
    """On a GPU (Triton ops, decode CUDA graphs): an MTP draft's verification step replays the decode
    graphs, a row a token (with the final hidden states kept for the MTP pass), and the tokens are the CPU
    engine's and transformers' (float32); each draft is transformers' MTP prediction; most are kept."""
    prompts = _prompts(4, seed=9)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    want = [
        o.token_ids for o in LLM(str(predictive), dtype="float32", num_kv_blocks=64).generate(prompts, params)
    ]
    for k in (1, 3):
        spec = json.dumps({"method": "mtp", "num_speculative_tokens": k})
        fast = LLM(str(predictive), device="cuda", dtype="float32", kernel_backend="triton", num_kv_blocks=64,
                   speculative_config=spec)  # fmt: skip
        made = _recording(fast)
        runner = fast.engine.runner
        assert runner.graphs is not None and runner.graphs.hidden is not None
        outs = [o.token_ids for o in fast.generate(prompts, params)]
        assert outs == want
        assert outs[0] == hf_greedy(predictive, prompts[0], params.max_tokens)
        replays = sum(runner.graphs.replays.values())
        engine = fast.engine
        # A decode step gives up to k + 1 tokens: with most drafts kept, 23 tokens take at least 23 // (k + 1)
        # decode steps, each a graph replay (the first GPU run found 7 at k = 3, against 10 asked for k = 1).
        steps = (params.max_tokens - 1) // (k + 1)
        assert replays >= steps and engine.spec_accepted_tokens > engine.spec_draft_tokens * 0.5
        assert runner.mtp_graphs is not None and runner.mtp_graphs.replays >= k * steps  # MTP passes too
        ids = list(dict.fromkeys(rid for rid, _, _ in made))
        for rid, prompt, out in zip(ids, prompts, outs, strict=True):
            assert _check_drafts(predictive, made, rid, prompt + out) >= 3
        del fast
    half = LLM(str(predictive), device="cuda", dtype="bfloat16", kernel_backend="triton", num_kv_blocks=64,
               speculative_config=MTP)  # fmt: skip
    assert all(len(o.token_ids) == 24 for o in half.generate(prompts, params))
    assert half.engine.spec_accepted_tokens > 0
