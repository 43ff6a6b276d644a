"""``python -m kvstore_svc``: one KV offload store process (flags: ``--help``; each has a ``PDMESH_*`` twin)."""

from __future__ import annotations

from kvstore_svc.service import main

if __name__ == "__main__":
    main()
