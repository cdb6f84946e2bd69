"""`datamover tracegen`: seeded synthetic request traces in Mooncake's format, in several workload shapes.

Each request is `{"timestamp": ms, "input_length": tokens, "output_length": tokens, "hash_ids": [...]}`, one
id per 512-token block. Ids are prefix hashes, as in Mooncake's release: a block's id stands for the whole
prompt up to and including it, so the same document after two different system prompts gets two ids, and a
block's parent is always the same block.

Traffic is made of four kinds of request, mixed in proportions that define a shape:
- chat: a multi-turn session on one of the system prompts (Zipf popularity); each turn re-sends the whole
  conversation and appends the last answer and a new message, after a think time;
- agent: a tool loop, a session of many quick turns, each appending a tool's output;
- rag: a single request of a system prompt, a few documents (Zipf over a corpus shared by all users) and a
  question;
- oneoff: a long prompt nobody sends again after the system prompt (a scan, from a cache's point of view).
Arrivals are Poisson; `bursts` modulates the rate (on/off periods) and moves the popular documents and prompts
to a new hot set at each burst.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

BLOCK_TOKENS = 512


@dataclass(frozen=True)
class Shape:
    """A workload: the share of each kind of request and their parameters (times in seconds)."""

    chat: float = 0.0
    agent: float = 0.0
    rag: float = 0.0
    oneoff: float = 0.0
    prompts: int = 40  # system prompts
    prompt_zipf: float = 1.0
    prompt_blocks: tuple[int, int] = (2, 12)
    chat_turns: float = 4.0  # mean turns of a chat session (geometric)
    chat_think_s: float = 60.0
    agent_turns: float = 20.0
    agent_think_s: float = 3.0
    docs: int = 2000
    doc_zipf: float = 0.9
    doc_blocks: tuple[int, int] = (2, 8)
    docs_per_request: tuple[int, int] = (1, 4)
    oneoff_blocks: tuple[int, int] = (10, 60)
    rate: float = 4.0  # new sessions or single requests per second
    bursts: bool = False
    burst_period_s: float = 300.0


SHAPES: dict[str, Shape] = {
    "chat": Shape(chat=1.0),
    "agent": Shape(agent=0.7, chat=0.3, rate=1.0),
    "rag": Shape(rag=0.8, chat=0.2, rate=6.0),
    "bursty": Shape(chat=0.5, rag=0.5, bursts=True, rate=5.0),
    "scan": Shape(chat=0.4, oneoff=0.6, rate=5.0),
    "mixed": Shape(chat=0.4, agent=0.15, rag=0.3, oneoff=0.15, bursts=True, rate=4.0),
    "prompts": Shape(oneoff=1.0, prompts=300, prompt_zipf=1.1, prompt_blocks=(4, 30), oneoff_blocks=(1, 4), rate=8.0),
}


class _Ids:
    """Prefix-hash ids: one per (parent id, block content), numbered in order of first appearance."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def chain(self, contents: Sequence[tuple]) -> list[int]:
        out, parent = [], -1
        for content in contents:
            key = (parent, content)
            parent = self._ids.setdefault(key, len(self._ids))
            out.append(parent)
        return out


def _zipf(rng: np.random.Generator, n: int, a: float, size: int) -> np.ndarray:
    p = 1.0 / np.arange(1, n + 1) ** a
    return rng.choice(n, size=size, p=p / p.sum())


def generate(shape: Shape | str, requests: int = 4000, seed: int = 0) -> list[dict]:
    """About `requests` requests of a shape (a name of SHAPES or a Shape), sorted by time; same seed, same trace."""
    s = SHAPES[shape] if isinstance(shape, str) else shape
    rng = np.random.default_rng(seed)
    ids = _Ids()
    prompt_len = rng.integers(s.prompt_blocks[0], s.prompt_blocks[1] + 1, s.prompts)
    doc_len = rng.integers(s.doc_blocks[0], s.doc_blocks[1] + 1, s.docs)
    kinds = np.array(["chat", "agent", "rag", "oneoff"])
    share = np.array([s.chat, s.agent, s.rag, s.oneoff], dtype=float)
    share /= share.sum()
    mean_len = share @ np.array([s.chat_turns, s.agent_turns, 1.0, 1.0])
    starts_needed = max(1, int(requests / mean_len))
    t, starts = 0.0, []
    while len(starts) < starts_needed:  # Poisson arrivals; with bursts, 4x the rate in on periods, 1/4 in off
        rate = s.rate
        if s.bursts:
            rate *= 4.0 if int(t / s.burst_period_s) % 2 == 0 else 0.25
        t += rng.exponential(1.0 / rate)
        starts.append(t)
    rows: list[tuple[float, list[int], int]] = []
    serial = 0
    for start in starts:
        kind = kinds[rng.choice(4, p=share)]
        epoch = int(start / (2 * s.burst_period_s)) if s.bursts else 0  # each burst has its own hot set
        prompt = int((_zipf(rng, s.prompts, s.prompt_zipf, 1)[0] + 7919 * epoch) % s.prompts)
        head = [("prompt", prompt, i) for i in range(prompt_len[prompt])]
        serial += 1
        if kind in ("chat", "agent"):
            turns = int(rng.geometric(1.0 / (s.chat_turns if kind == "chat" else s.agent_turns)))
            think = s.chat_think_s if kind == "chat" else s.agent_think_s
            body: list[tuple] = []
            when = start
            for turn in range(turns):
                grow = int(rng.integers(1, 4)) if kind == "chat" else int(rng.integers(1, 7))
                body += [("session", serial, turn, i) for i in range(grow)]
                rows.append((when, ids.chain(head + body), int(rng.integers(50, 800))))
                when += rng.exponential(think)
        elif kind == "rag":
            k = int(rng.integers(s.docs_per_request[0], s.docs_per_request[1] + 1))
            docs = (_zipf(rng, s.docs, s.doc_zipf, k) + 104729 * epoch) % s.docs
            body = [("doc", int(d), i) for d in docs for i in range(doc_len[d])]
            body += [("question", serial, i) for i in range(int(rng.integers(1, 3)))]
            rows.append((start, ids.chain(head + body), int(rng.integers(50, 500))))
        else:
            n = int(rng.integers(s.oneoff_blocks[0], s.oneoff_blocks[1] + 1))
            body = [("oneoff", serial, i) for i in range(n)]
            rows.append((start, ids.chain(head + body), int(rng.integers(20, 400))))
    rows.sort(key=lambda r: r[0])
    rows = rows[:requests]
    t0 = rows[0][0] if rows else 0.0
    return [
        {
            "timestamp": round((when - t0) * 1000.0),
            "input_length": len(blocks) * BLOCK_TOKENS - int(rng.integers(0, BLOCK_TOKENS)),
            "output_length": out,
            "hash_ids": blocks,
        }
        for when, blocks, out in rows
    ]


def write_trace(rows: list[dict], path: str) -> None:
    """Write rows as JSON lines (Mooncake's format)."""
    with open(path, "w") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(", ", ": ")) + "\n")


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a finite number of ``kind`` above zero (tracegen's rate and count, replay's counts)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not 0 < value < float("inf"):  # also refuses nan
            raise argparse.ArgumentTypeError(f"must be a finite number above 0, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its messages
    return parse


def _seed(text: str) -> int:
    """An argparse type: a seed numpy takes (an integer >= 0; a negative one was numpy's ValueError)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {text}")
    return value


def add_tracegen_parser(sub: argparse._SubParsersAction) -> None:
    """Add `tracegen` to a subcommand parser."""
    p = sub.add_parser("tracegen", help="write a seeded synthetic trace in Mooncake's format")
    p.add_argument("--shape", default="mixed", choices=sorted(SHAPES), help="workload shape (default mixed)")
    p.add_argument(
        "--requests",
        type=positive(int),
        default=4000,
        help="about this many requests, never more: sessions are started for about this many turns and the trace "
        "is cut there, so a shape of long sessions may write fewer (default 4000)",
    )
    p.add_argument("--seed", type=_seed, default=0, help="random seed, 0 or more (default 0)")
    p.add_argument("--rate", type=positive(float), help="override the shape's arrivals per second (> 0)")
    p.add_argument("--output", "-o", required=True, help="JSON-lines file to write")
    p.set_defaults(func=cmd_tracegen)


def cmd_tracegen(args: argparse.Namespace) -> int:
    shape = SHAPES[args.shape]
    if args.rate is not None:
        shape = replace(shape, rate=args.rate)
    rows = generate(shape, args.requests, args.seed)
    write_trace(rows, args.output)
    refs = sum(len(r["hash_ids"]) for r in rows)
    distinct = len({i for r in rows for i in r["hash_ids"]})
    print(f"{args.output}: {len(rows):,} requests, {refs:,} block references, {distinct:,} distinct ({args.shape})")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m datamover.policy.tracegen --shape NAME -o FILE`."""
    parser = argparse.ArgumentParser(prog="datamover", description=__doc__)
    add_tracegen_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["tracegen", *(sys.argv[1:] if argv is None else argv)])
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
