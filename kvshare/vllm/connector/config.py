"""The connector's settings and keys, read from vLLM's config and validated at start-up.

``kv_connector_extra_config`` keys (:class:`ConnectorSettings`; an unknown key is an error):

- ``namespace`` (required): the kvshare namespace this model's blocks live in, as deployed by
  ``kvshare up --namespace NAME --layout MODEL/config.json --dtype DTYPE --block-tokens N``;
- ``ray_address``: the Ray cluster to join (``auto``, ``HOST:PORT``); not needed when the
  engine already runs inside Ray (a Ray actor or task);
- ``node``: the Ray node id whose pool this engine uses as its own (default: the node its Ray
  connection lands on; set it where several Ray nodes share a host, as a process that joins
  Ray lands on the head there);
- ``ray_namespace`` (default ``kvshare``), ``block_tokens`` (default 256: a multiple of
  vLLM's ``--block-size``), ``remote`` (``auto``|``nixl``|``objstore``), ``cut`` (``cost``:
  the cost model picks how much to load; ``all``), ``save`` (store new blocks, default true),
  ``load_deadline_s``, ``store_deadline_s``, ``index_timeout_s``;
- ``sync_local_mib`` (default 256): a load wholly from this node's pool (shared memory) of at
  most this many MiB completes inside the step that computes the request's suffix, before its
  forward pass (that step waits for the copy, ~a memcpy of the prefix's KV); larger loads and
  loads from other nodes are asynchronous. 0: every load asynchronous;
- ``sync_save_mib`` (default 256): a request whose saved blocks come to at most this many
  MiB and whose stores into this node's pool (a copy into shared memory and the commit that
  publishes them to the index) are still running when it finishes is held until they end
  (at most 0.5 s, ``save_marks.SYNC_SAVE_WAIT_S``) before its last output leaves the
  engine, so the moment an answer ends its blocks are found by any worker's next lookup
  (read-after-write: a client's next turn sent at once, to this engine or another node's,
  reuses them). No step waits for a store otherwise (:mod:`kvshare.vllm.connector.save_marks`): a
  prompt's store runs while the request decodes (a request with stop strings, whose end only
  vLLM's frontend sees, waits in each step that saves). Larger saves, and a store slower than that,
  finish in the background. 0: every save in the background;
- ``lookup_threads`` (default 4): index lookups in flight at once; ``price_lookups`` (default
  true): a request is held for its lookup only as long as the prefill the lookup could save
  (:mod:`kvshare.vllm.connector.lookup`), false: up to ``index_timeout_s``;
- ``router_hints`` (default true): a request routed by kvshare's gateway or Serve router
  carries what the router's index query found (``kv_transfer_params.kvshare.held_tokens``:
  the longest prefix of the prompt held anywhere in the cluster, its pending blocks
  included); when that is no more than vLLM's own prefix hit plus part of one block the
  engine does not ask the index again (:mod:`kvshare.vllm.router_hint`). false: every
  request is looked up; ``router_hint_max_age_s`` (default 1.0): a hint is trusted only
  while the request has waited less than this since it reached the engine (a request that
  queued longer is looked up: blocks stored meanwhile are worth the query, which is small
  beside that wait).

Keys (:func:`model_keys`): the namespace root hashes the model identity (config, weight
manifest and sampled weight bytes, tokenizer files; :func:`kvshare.identity.
path_identity`) together with vLLM's compute dtype and KV dtype, the layout and the request's
``cache_salt`` (the tenant salt). Quantized KV whose scales are computed at run time
(per-token-head, turboquant, nvfp4) is never shared; fp8 with static scales is (its scales
are in the weights the identity digests). LoRA and multimodal requests are not shared (no
lookups, no stores): their KV depends on more than the tokens.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from kvshare.attention import AttentionKind, read_attention
from kvshare.layout import KVLayout, normalize_dtype
from kvshare.vllm.connector.mla import check_mla_pages, mla_layout

SHAREABLE_KV_DTYPES = ("auto", "float16", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class ConnectorSettings:
    """``kv_connector_extra_config``, validated."""

    namespace: str
    """The kvshare namespace this model's blocks live in, as deployed by `kvshare up --namespace
    NAME --layout MODEL/config.json --dtype DTYPE --block-tokens N`."""
    ray_address: str = ""
    """The Ray cluster to join (`auto`, `HOST:PORT`); not needed when the engine already runs
    inside Ray (a Ray actor or task)."""
    node: str = ""
    """The Ray node id whose pool this engine uses as its own ('' = the node its Ray connection
    lands on); set it where several Ray nodes share a host, as a process that joins Ray lands on
    the head there."""
    ray_namespace: str = "kvshare"
    """The Ray namespace kvshare's actors are registered in."""
    block_tokens: int = 256
    """Tokens per share block: a multiple of vLLM's `--block-size`, as given to `kvshare up
    --block-tokens`."""
    remote: str = "auto"
    """How blocks held on other nodes travel: `auto` (the faster of nixl and objstore as measured),
    `nixl` or `objstore`."""
    cut: str = "cost"
    """`cost`: the cost model picks how much of the cached prefix to load; `all`: load all of it."""
    save: bool = True
    """Store new full blocks in this node's pool (write-through)."""
    load_deadline_s: float = 5.0
    """Seconds a load's block transfers may take; a block not read by then is a miss, which vLLM
    recomputes."""
    store_deadline_s: float = 10.0
    """Seconds a store into this node's pool may take before it is given up."""
    index_timeout_s: float = 2.0
    """Deadline for an index lookup, in seconds; an index slower than that is a miss."""
    sync_local_mib: float = 256.0
    """A load wholly from this node's pool of at most this many MiB completes inside the step that
    computes the request's suffix, before its forward pass; larger loads and loads from other
    nodes are asynchronous. 0: every load asynchronous."""
    sync_save_mib: float = 256.0
    """A request whose saved blocks come to at most this many MiB and whose stores are still
    running when it finishes is held (at most 0.5 s) until they are published, so the next turn
    finds them on any node (read-after-write). 0: every save in the background."""
    lookup_threads: int = 4
    """Index lookups in flight at once."""
    price_lookups: bool = True
    """Hold a request for its lookup only as long as the prefill the lookup could save; false: up
    to `index_timeout_s`."""
    router_hints: bool = True
    """Trust the index answer a request routed by kvshare's gateway or Serve router carries
    (`kv_transfer_params.kvshare`) and do not ask the index again; false: every request is
    looked up."""
    router_hint_max_age_s: float = 1.0
    """A router hint is trusted only while the request has waited less than this many seconds since
    it reached the engine; a request that queued longer is looked up."""

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        data = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(
                f"KVShareConnector: unknown kv_connector_extra_config keys {unknown}; "
                f"known keys: {sorted(known)}")
        if not isinstance(data.get("namespace"), str) or not data["namespace"]:
            raise ValueError(
                'KVShareConnector needs kv_connector_extra_config {"namespace": NAME}: the '
                "namespace given to `kvshare up --namespace NAME` for this model")
        try:
            s = cls(
                namespace=data["namespace"],
                ray_address=str(data.get("ray_address", "")),
                node=str(data.get("node", "")),
                ray_namespace=str(data.get("ray_namespace", "kvshare")),
                block_tokens=int(data.get("block_tokens", 256)),
                remote=str(data.get("remote", "auto")),
                cut=str(data.get("cut", "cost")),
                save=_as_bool(data.get("save", True)),
                load_deadline_s=float(data.get("load_deadline_s", 5.0)),
                store_deadline_s=float(data.get("store_deadline_s", 10.0)),
                index_timeout_s=float(data.get("index_timeout_s", 2.0)),
                sync_local_mib=float(data.get("sync_local_mib", 256.0)),
                sync_save_mib=float(data.get("sync_save_mib", 256.0)),
                lookup_threads=int(data.get("lookup_threads", 4)),
                price_lookups=_as_bool(data.get("price_lookups", True)),
                router_hints=_as_bool(data.get("router_hints", True)),
                router_hint_max_age_s=float(data.get("router_hint_max_age_s", 1.0)),
            )
        except (TypeError, ValueError) as exc:
            raise ValueError(f"KVShareConnector: bad kv_connector_extra_config value: {exc}") from exc
        if s.remote not in ("auto", "nixl", "objstore"):
            raise ValueError(f'KVShareConnector: "remote" must be auto, nixl or objstore, got {s.remote!r}')
        if s.cut not in ("cost", "all"):
            raise ValueError(f'KVShareConnector: "cut" must be cost or all, got {s.cut!r}')
        if not s.sync_local_mib >= 0:
            raise ValueError(f'KVShareConnector: "sync_local_mib" must be >= 0 (0: every load '
                             f'asynchronous), got {s.sync_local_mib}')
        if not s.sync_save_mib >= 0:
            raise ValueError(f'KVShareConnector: "sync_save_mib" must be >= 0 (0: every save in '
                             f'the background), got {s.sync_save_mib}')
        if not s.router_hint_max_age_s >= 0:
            raise ValueError(f'KVShareConnector: "router_hint_max_age_s" must be >= 0 (0: no hint '
                             f'is trusted), got {s.router_hint_max_age_s}')
        if s.lookup_threads < 1:
            raise ValueError(f'KVShareConnector: "lookup_threads" must be >= 1, got {s.lookup_threads}')
        if s.block_tokens <= 0:
            raise ValueError(f'KVShareConnector: "block_tokens" must be positive, got {s.block_tokens}')
        return s


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if str(value).lower() in ("1", "true", "yes"):
        return True
    if str(value).lower() in ("0", "false", "no"):
        return False
    raise ValueError(f"expected true or false, got {value!r}")


@dataclass(frozen=True)
class ModelKeys:
    """What one engine's blocks are keyed by (the same in every engine serving this model)."""

    layout: KVLayout
    identity: str
    tp_size: int

    def root(self, cache_salt: str | None) -> bytes:
        from kvshare.hasher import Hasher

        return bytes(Hasher.for_layout(self.identity, self.layout).root_for(cache_salt or ""))


_NOT_YET: dict[AttentionKind, str] = {}
"""Attention kinds whose pages the vLLM connector cannot load or save yet (none now)."""


def refuse_kind(layout: KVLayout, model: str) -> None:
    """ValueError naming what the vLLM integration cannot do yet with ``layout``'s attention
    kind (MHA/GQA passes): raised before vLLM starts, not from inside the engine."""
    why = _NOT_YET.get(layout.kind)
    if why is not None:
        raise ValueError(f"KVShareConnector: {model} uses {why}: serve it without kvshare (no "
                         "KVShareConnector in --kv-transfer-config) until then")


def check_model(vllm_config: Any, settings: ConnectorSettings) -> None:
    """ValueError naming the fix when this engine's KV cannot be shared as configured."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    mla = bool(getattr(mc, "use_mla", False))  # one latent per token: kvshare.vllm.connector.mla
    kind = ""
    if mc.is_hybrid or getattr(mc, "is_attention_free", False):
        kind = ("hybrid / state-space (Mamba-style) layers, whose per-sequence state has no "
                "kvshare block format yet")
    if kind:
        raise ValueError(
            f"KVShareConnector: {mc.model} uses {kind}: remove the KVShareConnector from "
            "--kv-transfer-config for this model")
    pc = vllm_config.parallel_config
    if int(pc.pipeline_parallel_size) > 1:
        raise ValueError("KVShareConnector: pipeline parallelism is not supported yet: run with "
                         "--pipeline-parallel-size 1 or remove the KVShareConnector")
    if not mla and int(pc.tensor_parallel_size) > int(mc.get_total_num_kv_heads()):
        raise ValueError(
            f"KVShareConnector: --tensor-parallel-size {pc.tensor_parallel_size} exceeds the "
            f"model's {mc.get_total_num_kv_heads()} kv heads (replicated heads are not supported)")
    page = int(cc.block_size)
    if mla:
        check_mla_pages(str(mc.model), settings.block_tokens, page)
    if settings.block_tokens % page:
        good = ((settings.block_tokens // page) or 1) * page
        raise ValueError(
            f"KVShareConnector: kvshare block_tokens {settings.block_tokens} is not a multiple "
            f"of vLLM's --block-size {page}: set \"block_tokens\" to a multiple of {page} (e.g. "
            f"{good}) here and in `kvshare up --block-tokens`, or change --block-size")
    if str(cc.cache_dtype) not in SHAREABLE_KV_DTYPES:
        raise ValueError(
            f"KVShareConnector: --kv-cache-dtype {cc.cache_dtype} uses scales computed at run "
            f"time, so its KV is never shared: use one of {list(SHAREABLE_KV_DTYPES)}")


def model_keys(vllm_config: Any, settings: ConnectorSettings) -> ModelKeys:
    """Layout and identity of this engine's model (after :func:`check_model`)."""
    from kvshare.identity import path_identity

    check_model(vllm_config, settings)
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    model_dtype = normalize_dtype(str(mc.dtype))
    kv_dtype = model_dtype if str(cc.cache_dtype) == "auto" else normalize_dtype(str(cc.cache_dtype))
    num_layers = int(mc.get_num_layers(pc))
    if getattr(mc, "use_mla", False):
        layout = mla_layout(mc, num_layers, kv_dtype, settings.block_tokens)
    else:
        # sliding-window hybrids: the KV-cache groups (layer -> window) the namespace root covers
        try:
            attn = read_attention(mc.hf_text_config.to_dict(), num_layers, str(mc.model))
        except ValueError as exc:  # state or attention kvshare has no block format for
            raise ValueError(f"KVShareConnector: {exc}: remove the KVShareConnector from "
                             "--kv-transfer-config for this model") from exc
        layout = KVLayout(
            num_layers=num_layers,
            num_kv_heads=int(mc.get_total_num_kv_heads()),
            head_dim=int(mc.get_head_size()),
            dtype=kv_dtype,
            block_tokens=settings.block_tokens,
            kind=attn.kind if attn.kind is AttentionKind.SLIDING else AttentionKind.MHA,
            groups=attn.groups,
        )
    path = _local_model_dir(mc)
    identity = path_identity(path, f"model={model_dtype};kv={kv_dtype}")
    return ModelKeys(layout, identity, int(pc.tensor_parallel_size))


def _local_model_dir(mc: Any) -> str:
    """The directory vLLM loads the model from (a hub name resolves to its local snapshot)."""
    if os.path.isdir(str(mc.model)):
        return str(mc.model)
    try:
        from huggingface_hub import snapshot_download

        return str(snapshot_download(str(mc.model), revision=mc.revision, local_files_only=True))
    except Exception as exc:
        raise ValueError(
            f"KVShareConnector: cannot find model {mc.model!r} on local disk to compute its "
            f"identity ({exc}): pass a local model directory as --model") from exc
