"""Tokenizers for the reference worker: byte-level by default, a model's own when given a path.

Both expose the same small surface (:class:`Tokenizer`): ``encode``, ``decode``,
``apply_chat_template`` (returns token ids, with the assistant turn opened), ``eos_id`` and
``vocab_size``. The gateway tokenizes once with the same class and forwards token ids, so a
worker never re-tokenizes a routed request.

Byte tokenizer ids: ``0..255`` are UTF-8 bytes; specials follow (``<bos>`` = 256, ``<eos>`` =
257, ``<pad>`` = 258, then the chat role markers), as ``kvshare/configs/tiny-llama.json`` says.
Its chat template is::

    <bos> (<|system|> text <|end|>)? (<|user|> text <|end|> | <|assistant|> text <|end|>)* <|assistant|>
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

BYTE_SPECIALS = ("<bos>", "<eos>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
_ROLES = ("system", "user", "assistant")


@runtime_checkable
class Tokenizer(Protocol):
    """What the worker and the gateway need from a tokenizer."""

    name: str
    vocab_size: int
    eos_id: int

    def encode(self, text: str) -> list[int]:
        """Token ids of plain text (no specials added)."""
        ...

    def decode(self, ids: Sequence[int]) -> str:
        """Text of token ids; specials are dropped, broken UTF-8 is replaced."""
        ...

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Token ids of a chat, ending with an open assistant turn."""
        ...


def _message_text(message: Mapping[str, Any]) -> tuple[str, str]:
    role = message.get("role")
    if role not in _ROLES:
        raise ValueError(f"chat message role {role!r} is not one of {_ROLES}")
    content = message.get("content", "")
    if isinstance(content, list):  # OpenAI content parts: keep the text parts
        content = "".join(
            str(p.get("text", "")) for p in content if isinstance(p, Mapping) and p.get("type") == "text"
        )
    if not isinstance(content, str):
        raise ValueError(f"chat message content must be a string, got {type(content).__name__}")
    return str(role), content


class ByteTokenizer:
    """UTF-8 bytes plus seven specials; no files, no downloads, identical in every process."""

    name = "kvshare-bytes-v1"

    def __init__(self, vocab_size: int = 512) -> None:
        if vocab_size < 256 + len(BYTE_SPECIALS):
            raise ValueError(
                f"the byte tokenizer needs vocab_size >= {256 + len(BYTE_SPECIALS)}, got {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.special = {tok: 256 + i for i, tok in enumerate(BYTE_SPECIALS)}
        self.bos_id = self.special["<bos>"]
        self.eos_id = self.special["<eos>"]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        if not messages:
            raise ValueError("a chat needs at least one message")
        out = [self.bos_id]
        end = self.special["<|end|>"]
        for message in messages:
            role, text = _message_text(message)
            out.append(self.special[f"<|{role}|>"])
            out.extend(self.encode(text))
            out.append(end)
        out.append(self.special["<|assistant|>"])
        return out

    def files_digest_input(self) -> bytes:
        """What identifies this tokenizer in the model identity digest."""
        return f"{self.name}:{self.vocab_size}".encode()


class HFTokenizer:
    """A model's own tokenizer (``transformers.AutoTokenizer``) from a local path."""

    def __init__(self, path: str) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ValueError(f"the tokenizer at {path!r} needs transformers: "
                             "pip install 'kvshare[reference]'") from None

        self.path = path
        self.name = os.path.basename(os.path.normpath(path))
        self._tok: Any = AutoTokenizer.from_pretrained(path, local_files_only=True)
        self.vocab_size = int(len(self._tok))
        eos = self._tok.eos_token_id
        self.eos_id = int(eos if eos is not None else -1)

    def encode(self, text: str) -> list[int]:
        return [int(i) for i in self._tok.encode(text, add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids), skip_special_tokens=True))

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        msgs = [dict(zip(("role", "content"), _message_text(m), strict=True)) for m in messages]
        if getattr(self._tok, "chat_template", None):
            ids = self._tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
            if isinstance(ids, Mapping):
                ids = ids["input_ids"]
            return [int(i) for i in ids]
        text = "".join(f"{m['role']}: {m['content']}\n" for m in msgs) + "assistant: "
        return [int(i) for i in self._tok.encode(text, add_special_tokens=True)]


TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
    "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "chat_template.json",
)


def load_tokenizer(model_path: str | None, vocab_size: int = 512) -> ByteTokenizer | HFTokenizer:
    """The model's tokenizer when ``model_path`` has tokenizer files, else the byte tokenizer."""
    if model_path is None:
        return ByteTokenizer(vocab_size)
    if not any(os.path.exists(os.path.join(model_path, f)) for f in TOKENIZER_FILES):
        raise ValueError(
            f"{model_path} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...): "
            "copy the model's tokenizer next to its weights"
        )
    return HFTokenizer(model_path)


def tokenizer_spec(tok: ByteTokenizer | HFTokenizer) -> dict[str, Any]:
    """A JSON-able description (the gateway rebuilds the same tokenizer from it)."""
    if isinstance(tok, ByteTokenizer):
        return {"kind": "bytes", "vocab_size": tok.vocab_size}
    return {"kind": "hf", "path": tok.path}


def tokenizer_from_spec(spec: Mapping[str, Any] | str) -> ByteTokenizer | HFTokenizer:
    """Inverse of :func:`tokenizer_spec` (accepts its JSON text too)."""
    data = json.loads(spec) if isinstance(spec, str) else dict(spec)
    if data.get("kind") == "bytes":
        return ByteTokenizer(int(data.get("vocab_size", 512)))
    if data.get("kind") == "hf":
        return HFTokenizer(str(data["path"]))
    raise ValueError(f"unknown tokenizer spec {data!r}: expected kind 'bytes' or 'hf'")
