"""Synthetic multi-turn conversation traces in Mooncake format, for held-out simulator runs.

Shape (every draw from one seeded ``numpy`` generator, so a seed names a trace):

- ``conversations`` conversations start as a Poisson process over ``start_window_s``.
- Each opens with one of ``system_prompts`` shared system prompts (lengths uniform in
  ``system_tokens``), chosen Zipf-like (prompt ``k`` with weight ``1/(k+1)``), then runs a
  geometric number of turns (mean ``mean_turns``).
- Turn ``t``'s prompt = the previous prompt + the previous answer + a new user message; user
  messages are log-normal around ``user_tokens`` (a few are pasted documents, up to 16x),
  answers log-normal around ``output_tokens``; the next turn arrives an exponential think
  time (mean ``think_s``) after the previous one.
- Hash ids follow Mooncake's rule: one id per ``block_tokens`` block, equal ids for an equal
  prefix. A turn reuses the ids of its previous prompt's *full* blocks; the previous prompt's
  last partial block and everything after get new ids (their content changed).

``write_jsonl`` writes the rows; ``python -m kvshare.router.sim.trace_conversations OUT.jsonl [--seed N]``
does both.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class ConversationShape:
    conversations: int = 600
    start_window_s: float = 900.0
    system_prompts: int = 8
    system_tokens: tuple[int, int] = (1000, 6000)
    mean_turns: float = 6.0
    user_tokens: float = 400.0
    output_tokens: float = 300.0
    think_s: float = 40.0
    block_tokens: int = 512


def conversation_rows(shape: ConversationShape, seed: int = 0) -> list[dict[str, object]]:
    """Mooncake rows (timestamp ms, input_length, output_length, hash_ids), by arrival."""
    rng = np.random.default_rng(seed)
    bt = shape.block_tokens
    next_id = 0
    sys_len = rng.integers(shape.system_tokens[0], shape.system_tokens[1] + 1, shape.system_prompts)
    sys_ids: list[list[int]] = []
    for n in sys_len:
        k = int(n) // bt
        sys_ids.append(list(range(next_id, next_id + k)))
        next_id += k
    popularity = 1.0 / np.arange(1, shape.system_prompts + 1)
    popularity /= popularity.sum()
    starts = np.sort(rng.uniform(0, shape.start_window_s, shape.conversations))
    rows: list[dict[str, object]] = []
    for start in starts:
        s = int(rng.choice(shape.system_prompts, p=popularity))
        length = int(sys_len[s])
        full = list(sys_ids[s])  # ids of the prompt's full blocks so far
        t = float(start)
        turns = int(rng.geometric(1.0 / shape.mean_turns))
        for _ in range(turns):
            user = int(rng.lognormal(np.log(shape.user_tokens), 0.8))
            if rng.random() < 0.05:
                user *= int(rng.integers(4, 17))  # a pasted document
            length += max(1, user)
            n_blocks = -(-length // bt)
            ids = full + list(range(next_id, next_id + n_blocks - len(full)))
            next_id += n_blocks - len(full)
            out = max(1, int(rng.lognormal(np.log(shape.output_tokens), 0.6)))
            rows.append({"timestamp": round(t * 1000), "input_length": length,
                         "output_length": out, "hash_ids": ids})
            full = ids[: length // bt]
            length += out
            t += float(rng.exponential(shape.think_s))
    rows.sort(key=lambda r: r["timestamp"])  # type: ignore[arg-type,return-value]
    return rows


def write_jsonl(path: str | Path, rows: list[dict[str, object]]) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description="write a synthetic multi-turn conversation trace")
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--conversations", type=int, default=ConversationShape.conversations)
    ap.add_argument("--think-s", type=float, default=ConversationShape.think_s)
    args = ap.parse_args()
    shape = ConversationShape(conversations=args.conversations, think_s=args.think_s)
    write_jsonl(args.out, conversation_rows(shape, args.seed))


if __name__ == "__main__":
    main()
