"""A transfer agent's handshake on the wire: ``mesh.kv_transfer.TransferMetadata`` to and from
``pdmesh.v1.TransferMetadata``.

Every KV holder answers ``GetTransferMetadata`` with its agent's metadata (workers, the KV offload store)
and every reader adds the answer as a peer (decode workers, the store reading offered blocks, workers
loading from the store); both directions live here so that they stay each other's inverse.
"""

from __future__ import annotations

from mesh.kv_transfer import TransferMetadata
from protos.pdmesh.v1 import common_pb2


def metadata_to_proto(meta: TransferMetadata) -> common_pb2.TransferMetadata:
    return common_pb2.TransferMetadata(
        agent_name=meta.agent_name,
        agent_metadata=meta.agent_metadata,
        layout_fingerprint=meta.layout_fingerprint,
        block_nbytes=meta.block_nbytes,
        num_blocks=meta.num_blocks,
        pool_base_address=meta.base_address,
        device=meta.device,
        mem_type=meta.mem_type,
    )


def metadata_from_proto(msg: common_pb2.TransferMetadata) -> TransferMetadata:
    return TransferMetadata(
        agent_name=msg.agent_name,
        agent_metadata=msg.agent_metadata,
        layout_fingerprint=msg.layout_fingerprint,
        block_nbytes=msg.block_nbytes,
        num_blocks=msg.num_blocks,
        base_address=msg.pool_base_address,
        device=msg.device,
        mem_type=msg.mem_type,
    )
