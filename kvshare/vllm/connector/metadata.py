"""What the scheduler-side connector tells the workers each step (plain, picklable data)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorMetadata


@dataclass(frozen=True)
class LoadSpec:
    """Load kvshare blocks ``plan.blocks[first_block:]`` of one request into its pages.

    ``plan`` is :meth:`kvshare.client.types.Plan.to_dict`; pages below ``keep_tokens`` (vLLM's
    own prefix hit) are not written; ``page_ids`` are the request's pages from token 0.
    ``sync``: load before this step's forward pass (it computes the request's suffix), else
    in the background until ``get_finished`` reports it. ``group_pages``: with several
    KV-cache groups, every group's pages (vLLM's group order; ``page_ids`` is then the
    full-attention group's), :mod:`kvshare.vllm.connector.groups`; empty with one group.
    """

    req_id: str
    plan: dict[str, Any]
    first_block: int
    keep_tokens: int
    page_ids: tuple[int, ...]
    sync: bool = False
    group_pages: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class SaveSpec:
    """Store kvshare blocks ``[start_block, len(hashes))`` of one request from its pages.
    ``seq``: the save's number, marked when it ends (:mod:`kvshare.vllm.connector.save_marks`; 0: not
    marked); ``sync``: the step waits for it (a request whose end only vLLM's frontend sees);
    ``group_pages``: as :class:`LoadSpec`'s."""

    req_id: str
    hashes: tuple[bytes, ...]
    start_block: int
    page_ids: tuple[int, ...]
    seq: int = 0
    sync: bool = False
    group_pages: tuple[tuple[int, ...], ...] = ()


@dataclass
class KVShareMetadata(KVConnectorMetadata):
    """One step's loads and saves; ``busy`` is False for a step that runs no forward pass;
    ``preempted`` requests lose their pages after this step (their saves must finish first);
    ``marks``: the file the workers mark ended saves in (:mod:`kvshare.vllm.connector.save_marks`; "":
    none)."""

    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)
    busy: bool = False
    preempted: tuple[str, ...] = ()
    marks: str = ""
