"""Reaching a pool's :class:`~kvshare.transfer.holder.server.BlockServer`: in-process or through Ray.

:class:`LocalControl` calls a BlockServer directly (same process: unit tests, a pool that
serves itself). :class:`ActorControl` calls the ``transfer_*`` methods of a NodePoolActor
(``actors/node_pool.py``), each taking the namespace first; replies are awaited with the
transfer's remaining time, and a dead or unreachable actor raises :class:`SourceGone`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

from kvshare.tiers.base import ByteArray
from kvshare.transfer.holder.server import BlockServer
from kvshare.transfer.wire import (
    BlockBatch,
    NixlPeerInfo,
    PushRequest,
    Ready,
    Reply,
    SlabInfo,
    SlotReply,
    SourceGone,
)
from kvshare.types import BlockHash

T = TypeVar("T")

class LocalControl:
    """:class:`BlockControl` over a BlockServer in this process."""

    def __init__(self, source: BlockServer) -> None:
        self.source = source

    def slab_info(self) -> Reply[SlabInfo | None]:
        return Ready(self.source.slab_info())

    def nixl_info(self) -> Reply[NixlPeerInfo | None]:
        return Ready(self.source.nixl_info())

    def prepare_read(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, verify: bool = False,
        nixl: bool = False,
    ) -> Reply[SlotReply]:
        return Ready(self.source.prepare_read(hashes, holder, ttl_s, verify, nixl))

    def finish(self, holder: str, lease_ids: Sequence[int]) -> Reply[list[bool]]:
        return Ready(self.source.finish(holder, lease_ids))

    def read_blocks(self, hashes: Sequence[BlockHash]) -> Reply[BlockBatch]:
        return Ready(self.source.read_blocks(hashes))

    def prepare_write(self, hashes: Sequence[BlockHash], holder: str, ttl_s: float,
                      nixl: bool = False) -> Reply[SlotReply]:
        return Ready(self.source.prepare_write(hashes, holder, ttl_s, nixl))

    def commit_write(
        self, holder: str, lease_ids: Sequence[int], checksums: Sequence[int]
    ) -> Reply[list[BlockHash]]:
        return Ready(self.source.commit_write(holder, lease_ids, checksums))

    def write_blocks(
        self, hashes: Sequence[BlockHash], data: ByteArray, checksums: Sequence[int]
    ) -> Reply[list[str]]:
        return Ready(self.source.write_blocks(hashes, data, checksums))

    def report_corrupt(self, hashes: Sequence[BlockHash]) -> Reply[int]:
        return Ready(self.source.report_corrupt(hashes))

    def touch(self, hashes: Sequence[BlockHash]) -> Reply[int]:
        return Ready(self.source.touch(hashes))

    def probe_blocks(self, n: int) -> Reply[list[BlockHash]]:
        return Ready(self.source.probe_blocks(n))

    def push_read(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, request: PushRequest
    ) -> Reply[SlotReply]:
        return Ready(self.source.push_read(hashes, holder, ttl_s, request))


class RayReply(Reply[T]):
    """An actor call in flight."""

    def __init__(self, ref: Any) -> None:
        self.ref = ref

    def done(self) -> bool:
        import ray

        ready, _ = ray.wait([self.ref], timeout=0)
        return bool(ready)

    def get(self, timeout: float) -> T:
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

        try:
            value: T = ray.get(self.ref, timeout=timeout)
            return value
        except GetTimeoutError as exc:
            raise TimeoutError(str(exc)) from exc
        except RayTaskError as exc:  # the pool raised: caller mistakes surface as they are
            if isinstance(exc.cause, ValueError | KeyError):
                raise exc.cause from None
            raise SourceGone(str(exc)) from exc
        except RayActorError as exc:  # died, unavailable
            raise SourceGone(str(exc)) from exc
        except RayError as exc:  # unschedulable (node removed), object lost
            raise SourceGone(str(exc)) from exc


class ActorControl:
    """:class:`BlockControl` through a NodePoolActor handle for one ``namespace``."""

    def __init__(self, actor: Any, namespace: str) -> None:
        self.actor = actor
        self.namespace = namespace

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return RayReply(getattr(self.actor, f"transfer_{method}").remote(self.namespace, *args))
        except Exception as exc:  # submitting to a dead actor can raise at once
            return Ready(None, SourceGone(str(exc)))

    def slab_info(self) -> Reply[SlabInfo | None]:
        return self._call("slab_info")  # type: ignore[no-any-return]

    def nixl_info(self) -> Reply[NixlPeerInfo | None]:
        return self._call("nixl_info")  # type: ignore[no-any-return]

    def prepare_read(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, verify: bool = False,
        nixl: bool = False,
    ) -> Reply[SlotReply]:
        return self._call("prepare_read", list(hashes), holder, ttl_s, verify, nixl)  # type: ignore[no-any-return]

    def finish(self, holder: str, lease_ids: Sequence[int]) -> Reply[list[bool]]:
        return self._call("finish", holder, list(lease_ids))  # type: ignore[no-any-return]

    def read_blocks(self, hashes: Sequence[BlockHash]) -> Reply[BlockBatch]:
        return self._call("read_blocks", list(hashes))  # type: ignore[no-any-return]

    def prepare_write(self, hashes: Sequence[BlockHash], holder: str, ttl_s: float,
                      nixl: bool = False) -> Reply[SlotReply]:
        return self._call("prepare_write", list(hashes), holder, ttl_s, nixl)  # type: ignore[no-any-return]

    def commit_write(
        self, holder: str, lease_ids: Sequence[int], checksums: Sequence[int]
    ) -> Reply[list[BlockHash]]:
        return self._call("commit_write", holder, list(lease_ids), list(checksums))  # type: ignore[no-any-return]

    def write_blocks(
        self, hashes: Sequence[BlockHash], data: ByteArray, checksums: Sequence[int]
    ) -> Reply[list[str]]:
        return self._call("write_blocks", list(hashes), data, list(checksums))  # type: ignore[no-any-return]

    def report_corrupt(self, hashes: Sequence[BlockHash]) -> Reply[int]:
        return self._call("report_corrupt", list(hashes))  # type: ignore[no-any-return]

    def touch(self, hashes: Sequence[BlockHash]) -> Reply[int]:
        return self._call("touch", list(hashes))  # type: ignore[no-any-return]

    def probe_blocks(self, n: int) -> Reply[list[BlockHash]]:
        return self._call("probe_blocks", n)  # type: ignore[no-any-return]

    def push_read(
        self, hashes: Sequence[BlockHash], holder: str, ttl_s: float, request: PushRequest
    ) -> Reply[SlotReply]:
        return self._call("push_read", list(hashes), holder, ttl_s, request)  # type: ignore[no-any-return]
