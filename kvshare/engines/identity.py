"""Model identity: a digest of what makes a model's KV what it is, never its name.

- Random-init model: the canonical JSON of its config, the seed and the KV dtype.
- Model at a path: ``config.json``, the weight manifest (safetensors index, each weight file's
  name, size and safetensors header), a sampled digest of each weight file's bytes
  (:data:`SAMPLES` evenly spaced windows of :data:`WINDOW` bytes, so retrained weights of the
  same shapes differ without reading every byte), the tokenizer files and the KV dtype.

New weights at the same path therefore never match old blocks; identical copies of a model on
different nodes (any mtime) share them. The identity, the layout's
fingerprint and a tenant salt make the namespace root (:class:`kvshare.hasher.Hasher`).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from typing import Any

from kvshare.engines.tokenizer import TOKENIZER_FILES

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAMPLES = 16
WINDOW = 1 << 20


def _canonical(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()


def random_init_identity(config: Mapping[str, Any], seed: int, kv_dtype: str) -> str:
    """Identity of a model built from ``config`` with weights drawn from ``seed``."""
    h = hashlib.sha256(b"kvshare-model-random-v1")
    h.update(_canonical({"config": dict(config), "seed": int(seed), "kv_dtype": kv_dtype}))
    return "rand-" + h.hexdigest()[:32]


def _safetensors_header(path: str) -> bytes:
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            return b""
        (n,) = struct.unpack("<Q", raw)
        return f.read(min(n, 64 * 2**20))


def _sampled_digest(path: str) -> bytes:
    """xxh3-128 over ``SAMPLES`` evenly spaced ``WINDOW``-byte windows (the whole file if small)."""
    import xxhash

    h = xxhash.xxh3_128()
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if size <= SAMPLES * WINDOW:
            h.update(f.read())
        else:
            step = (size - WINDOW) // (SAMPLES - 1)
            for i in range(SAMPLES):
                f.seek(i * step)
                h.update(f.read(WINDOW))
    return h.digest()


def path_identity(model_path: str, kv_dtype: str) -> str:
    """Identity of the model stored under ``model_path`` (a local directory)."""
    if not os.path.isdir(model_path):
        raise ValueError(f"model path {model_path!r} is not a directory")
    cfg = os.path.join(model_path, "config.json")
    if not os.path.exists(cfg):
        raise ValueError(f"{model_path} has no config.json: not a Hugging Face model directory")
    h = hashlib.sha256(b"kvshare-model-path-v1")
    h.update(kv_dtype.encode())
    with open(cfg, "rb") as f:
        h.update(_canonical(json.load(f)))
    names = sorted(os.listdir(model_path))
    weights = [n for n in names if n.endswith(_WEIGHT_SUFFIXES)]
    if not weights:
        raise ValueError(f"{model_path} holds no weight files ({', '.join(_WEIGHT_SUFFIXES)})")
    for name in names:
        full = os.path.join(model_path, name)
        if name.endswith(".index.json"):
            with open(full, "rb") as f:
                h.update(b"index:" + name.encode() + f.read())
        elif name in weights:
            h.update(b"weight:" + name.encode() + struct.pack("<Q", os.path.getsize(full)))
            if name.endswith(".safetensors"):
                h.update(_safetensors_header(full))
            h.update(_sampled_digest(full))
        elif name in TOKENIZER_FILES:
            with open(full, "rb") as f:
                h.update(b"tok:" + name.encode() + f.read())
    return "path-" + h.hexdigest()[:32]
