"""The ``pdmesh`` proto package; one sub-package per API version."""
