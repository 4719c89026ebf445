"""What kvshare's Serve request router reads: its settings, the request's prompt, and how the
workers hash prompts.

- :class:`ServeRouterSettings`: the ``request_router_kwargs``, validated.
- :func:`extract_prompt`: block hashes, token ids or text from a Serve request's arguments
  (kvshare's routed fields, OpenAI ``messages``/``prompt``; dicts or pydantic objects).
- :class:`WorkerHashing`: a replica's hashing scheme (root, block size, tokenizer, sharing
  mode), published in its ``WorkerInfo.meta`` so the router hashes exactly what it stores.
- :func:`replica_worker_id`: the kvshare worker id of a Serve replica.

Kept apart from :mod:`kvshare.router.serve.request_router` because Serve pickles the router's own module by value
into every process holding a handle; this one is imported by reference.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ray.serve._private.common import ReplicaID

from kvshare.hasher import Hasher
from kvshare.router.core.sources import Sharing
from kvshare.tokenizer import ByteTokenizer, HFTokenizer, tokenizer_from_spec
from kvshare.types import BlockHash, WorkerId

# Keys of WorkerInfo.meta a Serve replica publishes so the router hashes what workers store.
META_ROOT = "root_hex"
META_BLOCK_TOKENS = "block_tokens"
META_BYTES_PER_TOKEN = "bytes_per_token"
META_TOKENIZER = "tokenizer"
META_SHARING = "sharing"  # "local": the worker loads only its own node's blocks
# Key of a Serve replica's routing stats (``record_routing_stats``) naming the registered
# kvshare worker it forwards to (a replica in front of an engine that registered itself).
FRONTS_WORKER = "kvshare_worker_id"


def replica_worker_id(replica_id: ReplicaID) -> WorkerId:
    """The kvshare worker id of a Serve replica: ``serve.<app>#<deployment>#<unique id>``.

    The index does not allow ':' in worker ids, so Serve's full id prefix is dropped and any
    ':' left in an app or deployment name becomes '_'.
    """
    full = replica_id.to_full_id_str().removeprefix("SERVE_REPLICA::")
    return WorkerId("serve." + full.replace(":", "_"))


@dataclass(frozen=True)
class ServeRouterSettings:
    """``request_router_kwargs`` of :class:`KVShareRequestRouter` (all optional).

    ``namespace``: the kvshare namespace to route in ('' = the one the replicas registered).
    ``sharing``: ``global`` (workers pull blocks from any node) or ``local`` (only from their
    own node); '' = what the workers registered (``WorkerInfo.meta["sharing"]``), else global.
    ``index_timeout_s``: deadline for the index answer before falling back to power of two.
    ``pending_ttl_s``: how long a routed prefix counts as held by its replica before the index
    confirms it. ``prefill_tokens_per_s``: prefill speed assumed until workers report one.
    ``bandwidths``: bytes/s by transport (``shm``, ``disk``, ``nixl``, ...); they override what
    the pools measured (read from the deployment every 30 s).
    ``log_decisions``: log every decision (estimates per replica) at INFO in Serve's log.
    ``spill_ratio``/``spill_after_passes``: on a request's first routing passes, replicas
    estimated more than ``spill_ratio`` slower than the best are held back; from pass
    ``spill_after_passes`` on (Serve backs off between passes) every replica is offered.
    ``index_replica``: keep a copy of the index in the router's process
    (:class:`~kvshare.actors.index.replica.IndexReplica`, polling the shards' change streams every
    ``replica_poll_s``), as Dynamo's KV router and Serve LLM's ``KVAwareRouter`` keep theirs:
    a decision then waits on no index call. ``loads_refresh_s`` > 0: the workers' load
    reports are read in the background every that many seconds (from the first decision on,
    while the router lives) and a decision uses the latest read (0: read for every request,
    within ``index_timeout_s``).
    ``hint_kwarg``: the keyword argument the replicas take the router hint in (what the index
    answered when the request was routed, as ``kv_transfer_params``: :mod:`kvshare.vllm.router_hint`;
    e.g. :class:`~kvshare.router.serve.vllm_replicas.VllmReplica`'s ``kvshare_hint``); '' sends none (a
    replica's method need not accept one).
    """

    namespace: str = ""
    """The kvshare namespace to route in ('' = the one the replicas registered)."""
    policy: str = "cost"
    """The routing policy's registered name (`cost`, `round_robin`, `least_loaded`, the peers'
    rules)."""
    sharing: str = ""
    """`global` (workers pull blocks from any node) or `local` (only from their own node); '' =
    what the workers registered, else global."""
    ray_namespace: str = "kvshare"
    """The Ray namespace kvshare's actors are registered in."""
    index_timeout_s: float = 0.2
    """Deadline in seconds for the index answer before falling back."""
    connect_retry_s: float = 2.0
    """Seconds between attempts to reach an index that is not deployed yet or restarting."""
    workers_refresh_s: float = 1.0
    """Once every replica's worker is known, the registrations are re-read in the background this
    often (seconds)."""
    pending_ttl_s: float = 10.0
    """How long a routed prefix counts as held by its replica before the index confirms it
    (seconds)."""
    spill_ratio: float = 0.5
    """On a request's first routing passes, replicas estimated more than this much slower than the
    best are held back."""
    spill_after_passes: int = 4
    """From this routing pass on every replica is offered."""
    prefill_tokens_per_s: float = 4000.0
    """Prefill speed assumed until the workers report one."""
    bytes_per_token: int = 0
    """KV bytes per token for the cost model when the workers' hashing does not say (0 = unknown).
    KV bytes per token for the cost model when the workers' hashing does not say (0 = unknown)."""
    bandwidths: Mapping[str, float] | None = None
    """Bytes/s by transport (`shm`, `disk`, `nixl`, ...) that override what the pools measured."""
    log_decisions: bool = False
    """Log every decision (estimates per replica) at INFO in Serve's log."""
    index_replica: bool = False
    """Keep a copy of the index in the router's process, so a decision waits on no index call."""
    replica_poll_s: float = 0.02
    """With `index_replica`: how often the copy polls the shards' change streams (seconds)."""
    loads_refresh_s: float = 0.0
    """> 0: the workers' load reports are read in the background this often (seconds) and a
    decision uses the latest read; 0: read for every request."""
    hint_kwarg: str = ""
    """The keyword argument the replicas take the router hint in (e.g. `kvshare_hint`); '' sends
    none."""

    def __post_init__(self) -> None:
        if self.index_timeout_s <= 0 or self.pending_ttl_s <= 0:
            raise ValueError("index_timeout_s and pending_ttl_s must be positive seconds")
        if self.spill_after_passes < 1 or self.spill_ratio < 0:
            raise ValueError("spill_after_passes must be >= 1 and spill_ratio >= 0")
        if self.prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be positive")
        if self.replica_poll_s <= 0 or self.loads_refresh_s < 0:
            raise ValueError("replica_poll_s must be positive and loads_refresh_s >= 0 seconds")
        if self.sharing:
            Sharing(self.sharing)  # ValueError naming the bad value

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> ServeRouterSettings:
        known = set(cls.__dataclass_fields__)
        bad = sorted(set(kwargs) - known)
        if bad:
            raise ValueError(f"unknown request_router_kwargs {bad}: use some of {sorted(known)}")
        return cls(**dict(kwargs))


@dataclass(frozen=True)
class PromptInput:
    """What the router found in a request: hashes, token ids or text (first found wins)."""

    namespace: str | None = None
    hashes: tuple[BlockHash, ...] | None = None
    tokens: tuple[int, ...] | None = None
    text: str | None = None
    messages: tuple[Mapping[str, Any], ...] | None = None


def _get(obj: Any, key: str) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key)
    return getattr(obj, key, None)


def _prompt_from(obj: Any) -> PromptInput | None:
    """Look for kvshare's routed fields, then OpenAI-style ``prompt``/``messages``."""
    extra = _get(obj, "kvshare")
    src = extra if extra is not None else obj
    ns = _get(src, "namespace")
    ns = ns if isinstance(ns, str) else None
    hexes = _get(src, "hashes_hex")
    tokens = _get(src, "token_ids")
    if tokens is None:
        tokens = _get(src, "prompt_token_ids")
    hashes = None
    if isinstance(hexes, list | tuple) and hexes:
        try:
            hashes = tuple(BlockHash(bytes.fromhex(h)) for h in hexes)
        except (TypeError, ValueError):
            hashes = None
    tok = tuple(int(t) for t in tokens) if isinstance(tokens, list | tuple) and tokens else None
    if hashes is not None or tok is not None:
        return PromptInput(ns, hashes, tok)
    messages = _get(obj, "messages")
    if isinstance(messages, list | tuple) and messages:
        msgs = tuple(m if isinstance(m, Mapping) else _as_dict(m) for m in messages)
        return PromptInput(ns, messages=msgs)
    prompt = _get(obj, "prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return PromptInput(ns, text=prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return PromptInput(ns, tokens=tuple(prompt))
    return None


def _as_dict(message: Any) -> dict[str, Any]:
    dump = getattr(message, "model_dump", None)
    if callable(dump):
        return dict(dump())
    return {"role": getattr(message, "role", None), "content": getattr(message, "content", "")}


def extract_prompt(args: Sequence[Any], kwargs: Mapping[str, Any]) -> PromptInput | None:
    """The prompt of a Serve request: the first argument (positional, then keyword) that has
    kvshare routed fields (``kvshare: {token_ids, hashes_hex, namespace}`` or those fields
    directly), ``messages`` or ``prompt``; dicts and objects (e.g. pydantic) alike."""
    for arg in (*args, *kwargs.values()):
        found = _prompt_from(arg)
        if found is not None:
            return found
    return None


@dataclass(frozen=True)
class WorkerHashing:
    """How the registered workers hash prompts (learned from their WorkerInfo.meta)."""

    root: BlockHash
    block_tokens: int
    bytes_per_token: int
    tokenizer: ByteTokenizer | HFTokenizer
    sharing: Sharing

    @property
    def hasher(self) -> Hasher:
        """Hashes under the workers' root (the router learns no identity, so no other salt);
        made on first use. (Not ``functools.cached_property``: Ray Serve pickles this package
        by value with the request router, and that descriptor holds a lock.)"""
        made: Hasher | None = self.__dict__.get("_hasher")
        if made is None:
            made = Hasher.from_root(self.root, self.block_tokens)
            object.__setattr__(self, "_hasher", made)
        return made

    @classmethod
    def from_meta(cls, meta: Mapping[str, str]) -> WorkerHashing | None:
        try:
            return cls(BlockHash(bytes.fromhex(meta[META_ROOT])), int(meta[META_BLOCK_TOKENS]),
                       int(meta.get(META_BYTES_PER_TOKEN, "0")),
                       tokenizer_from_spec(json.loads(meta[META_TOKENIZER])),
                       Sharing(meta.get(META_SHARING, "global")))
        except (KeyError, ValueError):
            return None

    def tokens_of(self, prompt: PromptInput) -> list[int] | None:
        if prompt.tokens is not None:
            return list(prompt.tokens)
        if prompt.messages is not None:
            return self.tokenizer.apply_chat_template(prompt.messages)
        if prompt.text is not None:
            return self.tokenizer.encode(prompt.text)
        return None
