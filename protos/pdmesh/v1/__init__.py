"""``pdmesh.v1`` contracts. Evolution rules are in docs/contracts.md: extend, never break."""
