"""One config definition: flags, PDMESH_* variables and the reference docs all come from it."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

from engine.config import EngineConfig
from mesh.config import add_arguments, from_sources, to_argv


def test_flags_env_and_defaults_resolve_in_order() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    args = parser.parse_args(["--block-size", "32", "--no-enable-prefix-caching"])
    env = {"PDMESH_BLOCK_SIZE": "64", "PDMESH_MAX_NUM_SEQS": "7", "PDMESH_DTYPE": "bfloat16"}
    cfg = from_sources(EngineConfig, args, env=env)
    assert cfg.block_size == 32  # the flag wins over the variable
    assert cfg.max_num_seqs == 7 and cfg.dtype == "bfloat16"  # variables beat defaults
    assert cfg.enable_prefix_caching is False
    assert cfg.model == "tiny-dense"
    again = from_sources(EngineConfig, parser.parse_args(to_argv(cfg)), env={})
    assert again == cfg


def test_vllms_enforce_eager_turns_cuda_graphs_off() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    assert from_sources(EngineConfig, parser.parse_args(["--enforce-eager"]), env={}).cuda_graphs is False
    assert from_sources(EngineConfig, parser.parse_args([]), env={}).cuda_graphs is True
    assert from_sources(EngineConfig, parser.parse_args(["--cuda-graphs"]), env={}).cuda_graphs is True


def test_bad_values_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="PDMESH_MAX_NUM_SEQS"):
        from_sources(EngineConfig, None, env={"PDMESH_MAX_NUM_SEQS": "lots"})
    with pytest.raises(ValueError, match="power of two"):
        EngineConfig(block_size=12)
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    with pytest.raises(SystemExit):
        parser.parse_args(["--kernel-backend", "cuda-magic"])
    # The same choices hold for a variable, which argparse never sees.
    with pytest.raises(ValueError, match="PDMESH_KERNEL_BACKEND: 'cuda-magic' is not one of torch, triton"):
        from_sources(EngineConfig, None, env={"PDMESH_KERNEL_BACKEND": "cuda-magic"})
    assert (
        from_sources(EngineConfig, None, env={"PDMESH_KERNEL_BACKEND": "triton"}).kernel_backend == "triton"
    )


def test_configuration_reference_is_current() -> None:
    path = Path(__file__).resolve().parent.parent / "docs" / "gen_configuration.py"
    spec = importlib.util.spec_from_file_location("gen_configuration", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TARGET.read_text() == module.render(), "run `python docs/gen_configuration.py` and commit"


def test_async_scheduling_defaults_by_device_and_honours_an_explicit_choice() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser, EngineConfig)
    assert EngineConfig().async_scheduling is False  # the CPU: host and device work do not overlap
    assert EngineConfig(device="cuda").async_scheduling is True
    assert EngineConfig(device="cuda", async_scheduling=False).async_scheduling is False
    assert EngineConfig(async_scheduling=True).async_scheduling is True
    off = from_sources(EngineConfig, parser.parse_args(["--device", "cuda", "--no-async-scheduling"]), env={})
    assert off.async_scheduling is False
    on = from_sources(EngineConfig, None, env={"PDMESH_DEVICE": "cuda"})
    assert on.async_scheduling is True
    assert from_sources(EngineConfig, parser.parse_args(to_argv(off)), env={}) == off  # a launcher's child
