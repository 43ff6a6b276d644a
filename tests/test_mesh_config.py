"""Settings choices hold wherever a value comes from: flags (argparse), PDMESH_* variables, overrides handed
to ``from_sources`` and a settings class's own constructor, each with an error naming the setting."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from engine.config import EngineConfig
from mesh.config import check_choices, from_sources
from mesh.worker_service import WorkerSettings
from router.__main__ import parse_config
from router.config import RouterConfig


@pytest.mark.parametrize(
    ("cls", "field", "bad"),
    [
        (RouterConfig, "routing", "cache_aware"),
        (RouterConfig, "log_level", "verbose"),
        (WorkerSettings, "kv_transfer", "rdma"),
        (WorkerSettings, "nixl_progress_thread", "sometimes"),
    ],
)
def test_a_constructor_rejects_a_value_outside_the_choices(cls: type, field: str, bad: str) -> None:
    flag, env = "--" + field.replace("_", "-"), "PDMESH_" + field.upper()
    with pytest.raises(ValueError, match=f"{field} \\({flag}, {env}\\): '{bad}' is not one of"):
        cls(**{field: bad})


def test_from_sources_checks_overrides_as_it_checks_variables() -> None:
    """EngineConfig's constructor does not check choices itself: from_sources does, for every source."""
    with pytest.raises(ValueError, match="kernel_backend .*'cuda-magic' is not one of torch, triton"):
        from_sources(EngineConfig, None, env={}, kernel_backend="cuda-magic")
    with pytest.raises(ValueError, match="PDMESH_ROUTING: 'cache_aware' is not one of"):
        from_sources(RouterConfig, None, env={"PDMESH_ROUTING": "cache_aware"})
    with pytest.raises(ValueError, match="routing .*'cache_aware' is not one of"):
        from_sources(RouterConfig, None, env={}, routing="cache_aware")
    assert from_sources(RouterConfig, None, env={}, routing="random").routing == "random"


@pytest.mark.parametrize("source", ["flag", "env"])
def test_the_router_command_line_refuses_a_bad_choice_from_a_flag_or_a_variable(
    source: str, monkeypatch: pytest.MonkeyPatch, capsys: Any
) -> None:
    argv = ["--log-level", "verbose"] if source == "flag" else []
    if source == "env":
        monkeypatch.setenv("PDMESH_LOG_LEVEL", "verbose")
    with pytest.raises(SystemExit):
        parse_config(argv)
    assert "verbose" in capsys.readouterr().err


def test_check_choices_accepts_every_default() -> None:
    for obj in (RouterConfig(), WorkerSettings(), EngineConfig()):
        check_choices(obj)


def test_the_launcher_takes_its_defaults_from_variables_and_checks_them(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``pdmesh up`` / ``demo`` read their defaults from ``PDMESH_*`` variables; a value outside a flag's
    choices, or a number that is not one, is a usage error at once, not a service that fails to start."""
    from mesh.cli import parse_args

    monkeypatch.setenv("PDMESH_DEVICE", "cuda")
    monkeypatch.setenv("PDMESH_BLOCK_SIZE", "32")
    args, rest = parse_args(["up", "--dtype", "bfloat16"])
    assert (args.device, args.block_size, args.dtype, args.num_decode, rest) == (
        "cuda",
        32,
        "bfloat16",
        1,
        [],
    )
    for name, value, words in (
        ("PDMESH_DEVICE", "gpu", "PDMESH_DEVICE: 'gpu' is not one of cpu, cuda"),
        ("PDMESH_ROUTING", "nearest", "PDMESH_ROUTING: 'nearest' is not one of"),
        ("PDMESH_BLOCK_SIZE", "sixteen", "PDMESH_BLOCK_SIZE: invalid literal for int()"),
    ):
        monkeypatch.setenv(name, value)
        with pytest.raises(SystemExit) as exc:
            parse_args(["demo"])
        assert exc.value.code == 2 and words in capsys.readouterr().err
        monkeypatch.delenv(name)
    monkeypatch.setenv("PDMESH_DEVICE", "cuda")
    assert parse_args(["up", "--device", "cpu"])[0].device == "cpu"  # a flag overrides a variable
    with pytest.raises(SystemExit):
        parse_args(["up", "--device", "gpu"])  # and argparse checks the flag's choices


def test_the_launchers_choices_are_those_of_the_settings_it_passes_them_to() -> None:
    """``LauncherSettings`` repeats choices it hands to the workers and the router (``mesh`` imports
    neither the engine nor the router): they must agree with the classes that check them."""
    from mesh.cli import LauncherSettings

    def choices(cls: type) -> dict[str, tuple]:
        return {f.name: f.metadata["choices"] for f in dataclasses.fields(cls) if f.metadata.get("choices")}

    launcher = choices(LauncherSettings)
    owners = choices(EngineConfig) | choices(RouterConfig) | choices(WorkerSettings)
    assert set(launcher) == {
        "device", "dtype", "kv_cache_dtype", "quantization", "routing", "kv_transfer", "tool_call_parser",
        "reasoning_parser",
    }  # fmt: skip
    assert all(launcher[name] == owners[name] for name in launcher), (launcher, owners)


def test_up_gives_each_worker_a_gpu_of_its_own_in_turn() -> None:
    """On CUDA, ``pdmesh up`` hands each worker (prefill workers first) the next GPU as its only visible
    one, so expert-parallel ranks get a GPU each; with fewer GPUs the list is reused from the start; the
    ids come from ``--gpus``, else from CUDA_VISIBLE_DEVICES; on the CPU nothing is set."""
    from mesh.cli import Mesh, parse_args, worker_gpus

    def planned(argv: list[str], env: dict[str, str]) -> Mesh:
        mesh = Mesh(parse_args(["up", "--http-port", "0", *argv])[0])
        mesh.plan(env)
        return mesh

    mesh = planned(
        ["--device", "cuda", "--gpus", "4,5,6", "--num-decode", "2", "--decode-expert-parallel"], {}
    )
    assert [(c.name, c.env["CUDA_VISIBLE_DEVICES"]) for c in mesh.children] == [
        ("prefill-0", "4"), ("decode-0", "5"), ("decode-1", "6"),
    ]  # fmt: skip
    ranks = [c.argv[c.argv.index("--expert-parallel-rank") + 1] for c in mesh.children[1:]]
    assert ranks == ["0", "1"]
    shared = planned(
        ["--device", "cuda", "--num-prefill", "2", "--num-decode", "2"], {"CUDA_VISIBLE_DEVICES": "2,3"}
    )
    assert [c.env["CUDA_VISIBLE_DEVICES"] for c in shared.children] == ["2", "3", "2", "3"]
    assert all(not c.env for c in planned(["--num-decode", "2"], {"CUDA_VISIBLE_DEVICES": "0,1"}).children)
    assert worker_gpus(" 1, 3 ,", {}) == ["1", "3"]
    # The workers' KV cache dtype is the launcher's, for every worker (fp8 on one side only would refuse
    # every KV transfer).
    fp8 = planned(["--kv-cache-dtype", "fp8", "--num-decode", "2"], {})
    assert [
        c.argv[c.argv.index("--kv-cache-dtype") + 1] for c in fp8.children if "--kv-cache-dtype" in c.argv
    ] == ["fp8"] * 3
    assert worker_gpus(None, {"CUDA_VISIBLE_DEVICES": ""}) == []
    # LoRA settings go to every worker alike (a request's adapter runs on its prefill and decode worker).
    lora = planned(
        ["--enable-lora", "--max-loras", "3", "--lora-modules", "a=/x", "b=/y", "--num-decode", "2"], {}
    )
    workers = [c.argv for c in lora.children]
    assert len(workers) == 3 and all(
        argv[argv.index("--enable-lora") :][:5]
        == ["--enable-lora", "--max-loras", "3", "--max-lora-rank", "16"]
        and argv[argv.index("--lora-modules") :][:3] == ["--lora-modules", "a=/x", "b=/y"]
        for argv in workers
    )
    assert all("--enable-lora" not in c.argv for c in fp8.children)
    # A speculative config goes to every worker and to the KV offload store: an MTP draft's KV is a pool
    # layer more, which the store's layout must have too.
    spec = planned(["--speculative-config", '{"method": "mtp"}', "--kvstore", "--model", "tiny-deepseek"], {})
    assert [c.name for c in spec.children] == ["prefill-0", "decode-0", "kvstore"]
    assert all(c.argv[c.argv.index("--speculative-config") + 1] == '{"method": "mtp"}' for c in spec.children)
    assert all("--speculative-config" not in c.argv for c in fp8.children)


def test_up_splits_each_gpu_among_its_workers() -> None:
    """On CUDA without a pool size, each worker gets --gpu-memory-utilization of its GPU's fraction over
    the workers sharing that GPU, and those sharing one start in waves; a size given here or to the
    workers is passed on instead; on the CPU each worker gets 2048 blocks."""
    from mesh.cli import CPU_NUM_KV_BLOCKS, Mesh, parse_args

    def planned(argv: list[str], env: dict[str, str]) -> Mesh:
        mesh = Mesh(parse_args(["up", "--http-port", "0", *argv])[0])
        mesh.plan(env)
        return mesh

    def flag(child: object, name: str) -> str | None:
        argv = child.argv  # type: ignore[attr-defined]
        return argv[argv.index(name) + 1] if name in argv else None

    three_on_two = planned(["--device", "cuda", "--num-decode", "2"], {"CUDA_VISIBLE_DEVICES": "0,1"})
    assert [(c.env["CUDA_VISIBLE_DEVICES"], flag(c, "--gpu-memory-utilization"), c.wave)
            for c in three_on_two.children] == [("0", "0.4500", 0), ("1", "0.9000", 0), ("0", "0.4500", 1)]  # fmt: skip
    assert all(flag(c, "--num-kv-blocks") is None for c in three_on_two.children)
    half = planned(["--device", "cuda", "--gpu-memory-utilization", "0.5"], {"CUDA_VISIBLE_DEVICES": "3"})
    assert [flag(c, "--gpu-memory-utilization") for c in half.children] == ["0.2500", "0.2500"]
    sized = planned(["--device", "cuda", "--num-kv-blocks", "900"], {"CUDA_VISIBLE_DEVICES": "0"})
    assert [(flag(c, "--num-kv-blocks"), flag(c, "--gpu-memory-utilization")) for c in sized.children] == [
        ("900", None), ("900", None),
    ]  # fmt: skip
    own = planned(["--device", "cuda", "--worker-arg=--kv-cache-memory-gb=8"], {"CUDA_VISIBLE_DEVICES": "0"})
    assert all(flag(c, "--gpu-memory-utilization") is None for c in own.children)
    ranks = planned(["--device", "cuda", "--num-decode", "2", "--decode-expert-parallel"],
                    {"CUDA_VISIBLE_DEVICES": "0,1"})  # fmt: skip
    assert [c.wave for c in ranks.children] == [0, 0, 0]  # expert-parallel ranks meet as they start
    cpu = planned(["--num-decode", "2"], {})
    assert [flag(c, "--num-kv-blocks") for c in cpu.children] == [str(CPU_NUM_KV_BLOCKS)] * 3


@pytest.mark.parametrize(
    "command",
    [["-m", "prefill_svc"], ["-m", "decode_svc"], ["-m", "router"], ["-m", "mesh.cli", "up"]],
    ids=["prefill", "decode", "router", "pdmesh-up"],
)
def test_every_service_prints_its_help(command: list[str]) -> None:
    """``--help`` lists every flag: help texts with a percent sign (argparse formats them with %) once
    made the workers' crash with a TypeError."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, *command, "--help"], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage:" in done.stdout and "--host" in done.stdout
    if command[1] in ("prefill_svc", "decode_svc"):
        assert "--kv-cache-dtype {auto,fp8,fp8_e4m3,fp8_e5m2}" in done.stdout and "6-25% lower" in done.stdout
