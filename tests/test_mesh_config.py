"""Settings choices hold wherever a value comes from: flags (argparse), PDMESH_* variables, overrides handed
to ``from_sources`` and a settings class's own constructor, each with an error naming the setting."""

from __future__ import annotations

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
