"""Generate the Python for ``protos/pdmesh/v1/*.proto``: messages, type stubs and gRPC stubs.

``python -m protos.generate`` writes them beside the .proto files, where they are committed;
``generate(out_dir)`` writes the same tree under another root (the drift test compares the two).
Protos are compiled with the repository root as the include path, so they import one another as
``protos/pdmesh/v1/x.proto`` and the generated modules as ``from protos.pdmesh.v1 import x_pb2``.
"""

from __future__ import annotations

import sys
from importlib import resources
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = Path("protos") / "pdmesh" / "v1"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def proto_files() -> list[Path]:
    """The .proto files, relative to the repository root."""
    return sorted(p.relative_to(REPO_ROOT) for p in (REPO_ROOT / PROTO_DIR).glob("*.proto"))


def generated_files(root: Path) -> list[Path]:
    """The generated files under ``root`` (the repository root, or a ``generate`` output dir)."""
    return sorted(p for p in (root / PROTO_DIR).iterdir() if p.name.endswith(GENERATED_SUFFIXES))


def generate(out_dir: Path | str) -> list[Path]:
    """Compile every proto into ``out_dir`` (mirroring ``protos/pdmesh/v1``); return the files written."""
    # Imported here: grpc_tools' compiler extension must not load into a process that also loaded NIXL's
    # bundled protobuf/abseil (it crashes); the drift test therefore runs generation in a subprocess.
    from grpc_tools import protoc

    out = Path(out_dir)
    (out / PROTO_DIR).mkdir(parents=True, exist_ok=True)
    well_known = resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    args = [
        "grpc_tools.protoc",
        f"--proto_path={REPO_ROOT}",
        f"--proto_path={well_known}",
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        *(str(REPO_ROOT / p) for p in proto_files()),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed: {' '.join(args)}")
    return generated_files(out)


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else REPO_ROOT
    written = generate(out)
    for path in written:
        print(path.relative_to(out))
    sys.exit(0)


if __name__ == "__main__":
    main()
