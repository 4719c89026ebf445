"""Generated tokens as text: incremental deltas that honour OpenAI ``stop`` strings."""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvshare.tokenizer import ByteTokenizer, HFTokenizer

_CONTEXT = 6  # tokens decoded again before new ones (a BPE piece can change its neighbours' text)


class TextOut:
    """Turns generated tokens into text as they come, ending at the first ``stop`` string.

    :meth:`push` returns the text safe to send now: never half a multi-byte character, never a
    part of a stop string and nothing after one. Once a stop string appears :attr:`stopped` is
    true and :attr:`text` is everything before it (OpenAI leaves the stop string out);
    :meth:`flush` returns what was held back. Tokens in ``skip`` (EOS) add no text. Each push
    decodes a few tokens, not the whole completion.
    """

    def __init__(self, tokenizer: ByteTokenizer | HFTokenizer, stops: Sequence[str] = (),
                 skip: Collection[int] = ()) -> None:
        self.tokenizer = tokenizer
        self.stops = tuple(s for s in stops if s)
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.skip = frozenset(skip)
        self.text = ""
        self.stopped = False
        self._done: list[int] = []  # tokens already in self.text
        self._pending: list[int] = []
        self._sent = 0

    def push(self, token: int) -> str:
        """Add one generated token; the text that may be sent now ("" if none)."""
        if self.stopped or token in self.skip:
            return ""
        self._pending.append(token)
        if not self._take(final=False):
            return ""  # a multi-byte character is not complete yet
        safe = len(self.text) if self.stopped else len(self.text) - self.hold
        if safe <= self._sent:
            return ""
        delta = self.text[self._sent:safe]
        self._sent = safe
        return delta

    def _take(self, final: bool) -> bool:
        """Move the pending tokens' text into :attr:`text` unless it ends mid-character."""
        ctx = self._done[-_CONTEXT:]
        base = self.tokenizer.decode(ctx)
        chunk = self.tokenizer.decode(ctx + self._pending)
        if not final and chunk.endswith("\ufffd") and len(self._pending) < 4:
            return False
        self._done.extend(self._pending)
        self._pending = []
        self._append(chunk[len(base):] if chunk.startswith(base) else chunk)
        return True

    def _append(self, new: str) -> None:
        start = max(0, len(self.text) - self.hold)
        full = self.text + new
        hits = [p for p in (full.find(s, start) for s in self.stops) if p >= 0]
        if hits:
            full = full[:min(hits)]
            self.stopped = True
        self.text = full

    def flush(self) -> str:
        """The text not sent yet (held back for a possible stop string, or a broken character)."""
        if self._pending and not self.stopped:
            self._take(final=True)
        delta = self.text[self._sent:]
        self._sent = len(self.text)
        return delta
