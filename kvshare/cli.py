"""The ``kvshare`` command.

Core commands live here (``size``). Commands that need the cluster or the router (``up``,
``status``, ``down``, ``gateway``, ``sim``, ``vllm``) are registered under the
``kvshare.commands`` entry-point group (pyproject.toml), so the library never imports
``kvshare.actors`` or ``kvshare.router``; one that fails to import is an error naming it, never
a silently missing command. A plugin is ``register(subparsers) -> None`` and sets ``func``.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points

from kvshare.attention import AttentionKind
from kvshare.layout import KVLayout, format_bytes, resolve_config


def _size(args: argparse.Namespace) -> int:
    path = resolve_config(args.config)
    layout = KVLayout.from_hf_config(path, dtype=args.dtype, block_tokens=args.block_tokens)
    total = layout.bytes_per_token * args.tokens
    hit_blocks = args.tokens // layout.block_tokens
    if args.json:
        out: dict[str, object] = {
            "bytes_per_token": layout.bytes_per_token,
            "bytes_per_block": layout.bytes_per_block,
            "total_bytes": total,
            "tokens": args.tokens,
            "layout": layout.to_dict(),
        }
        if layout.kind is AttentionKind.SLIDING:
            out["groups"] = [{**g.to_dict(), "bytes_per_token": layout.group_bytes_per_token(g),
                              "hit_blocks": g.blocks_needed(hit_blocks, layout.block_tokens)}
                             for g in layout.groups]
            out["hit_tokens"] = hit_blocks * layout.block_tokens
            out["hit_bytes"] = layout.hit_bytes(hit_blocks)
        print(json.dumps(out))
        return 0
    print(f"layout          {_describe(layout)}")
    for i, g in enumerate(layout.groups):
        per = layout.group_bytes_per_token(g)
        if g.window is None:
            what = "full attention"
        else:
            wb = g.window_blocks(layout.block_tokens)
            what = (f"window {g.window:,}: a hit needs only its last {wb} "
                    f"block{'s' if wb != 1 else ''} ({wb * layout.block_tokens:,} tokens)")
        print(f"group {i}         {len(g.layers)} layers, {per:,} bytes/token "
              f"({format_bytes(per)}), {what}")
    live = ", every layer's pages live" if layout.groups else ""
    print(f"bytes/token     {layout.bytes_per_token:,} ({format_bytes(layout.bytes_per_token)})"
          f"{live}")
    print(f"bytes/block     {layout.bytes_per_block:,} ({format_bytes(layout.bytes_per_block)}, "
          f"{layout.block_tokens} tokens)")
    print(f"{args.tokens:,} tokens  {total:,} ({format_bytes(total)})")
    if layout.groups and not hit_blocks:
        print(f"hit             none: a hit needs at least one full block ({layout.block_tokens} "
              "tokens)")
    elif layout.groups:
        hit, every = layout.hit_bytes(hit_blocks), hit_blocks * layout.bytes_per_block
        print(f"hit on {hit_blocks * layout.block_tokens:,} tokens  {hit:,} ({format_bytes(hit)}"
              f", {hit / every:.1%} of all layers'): every block of the full-attention group, "
              "the last window of each sliding group")
    return 0


def _describe(layout: KVLayout) -> str:
    if layout.kind is AttentionKind.MLA:
        return (f"{layout.num_layers} layers x one {layout.head_dim}-wide latent (kv_lora_rank "
                f"{layout.head_dim - layout.rope_dim} + rope {layout.rope_dim}), {layout.dtype}, "
                "MLA: no K/V pair, no heads, the same on every TP rank")
    heads = (f"{layout.num_layers} layers x {layout.num_kv_heads} kv heads x "
             f"head_dim {layout.head_dim}, {layout.dtype}")
    if layout.kind is AttentionKind.SLIDING:
        return f"{heads}, {len(layout.groups)} KV-cache groups by attention window"
    return heads


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvshare", description="Cluster-wide KV-cache sharing")
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    sub = parser.add_subparsers(dest="command", required=True)
    size = sub.add_parser("size", help="KV cache size of a model from its config.json")
    size.add_argument(
        "config", help="path to a Hugging Face config.json, or a bundled config's name"
    )
    size.add_argument("--tokens", type=_positive_int, required=True, help="number of tokens")
    size.add_argument("--dtype", default=None, help="KV dtype (default: the config's dtype)")
    size.add_argument("--block-tokens", type=_positive_int, default=256)
    size.add_argument("--json", action="store_true", help="print one JSON object")
    size.set_defaults(func=_size)
    for ep in sorted(entry_points(group="kvshare.commands"), key=lambda e: e.name):
        try:
            register = ep.load()
        except ImportError as exc:  # a broken install is an error, not a missing command
            raise ImportError(f"the kvshare {ep.name!r} commands ({ep.value}) failed to import: "
                              f"{exc}; reinstall kvshare (pip install -e .)") from exc
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING)
    try:
        return int(args.func(args) or 0)
    except (ValueError, KeyError, FileNotFoundError) as exc:
        print(f"kvshare {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
