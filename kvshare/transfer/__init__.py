"""Moving KV blocks: ``shm`` (same node), ``nixl`` (UCX/RDMA), ``objstore`` (Ray), peer fetch.

Importing this package imports neither Ray nor NIXL; each transport imports what it needs.
"""

from kvshare.transfer.base import BlockResult, Transfer, TransferResult, Transport

__all__ = ["BlockResult", "Transfer", "TransferResult", "Transport"]
