"""The KV offload store service: host-memory + disk block pool, Redis index, blocks served over NIXL."""
