"""Write docs/configuration.md from the settings classes (``python docs/gen_configuration.py``).

The settings are declared once (``mesh.config.setting``); this script and the drift test in
tests/test_config.py keep the reference in step with them.
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.config import EngineConfig  # noqa: E402
from eplb_svc.config import EPLBSettings  # noqa: E402
from kvstore_svc.config import KVStoreSettings  # noqa: E402
from mesh.cli import LauncherSettings  # noqa: E402
from mesh.config import reference_markdown  # noqa: E402
from mesh.worker_service import WorkerSettings  # noqa: E402
from router.config import RouterConfig  # noqa: E402

SECTIONS = [
    ("Engine (prefill and decode workers, offline LLM)", EngineConfig),
    ("Worker service (python -m prefill_svc / decode_svc)", WorkerSettings),
    ("Router (python -m router)", RouterConfig),
    ("KV offload store (python -m kvstore_svc)", KVStoreSettings),
    ("EPLB controller (python -m eplb_svc)", EPLBSettings),
    ("Launcher (pdmesh up, pdmesh demo)", LauncherSettings),
]
TARGET = REPO / "docs" / "configuration.md"


def render() -> str:
    return reference_markdown(SECTIONS) + "\n"


if __name__ == "__main__":
    TARGET.write_text(render())
    print(f"wrote {TARGET.relative_to(REPO)}")
