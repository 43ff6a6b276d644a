"""pdmesh's gRPC contracts: ``pdmesh/v1/*.proto`` and the Python generated beside them.

The generated ``*_pb2*.py`` files are committed and must match ``python -m protos.generate``
(``tests/test_protos.py`` fails on drift). Nothing here may import service or engine code.
"""
