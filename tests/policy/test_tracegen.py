"""The workload generator: seeded, Mooncake's format, prefix-hash ids, shapes that differ."""

from __future__ import annotations

import json

import pytest

from datamover.cli import main as datamover_main
from datamover.policy.replay import load_trace
from datamover.policy.tracegen import SHAPES, generate


def parents(rows):
    """Each id's parent (the id before it in its request); a prefix hash has exactly one."""
    seen: dict[int, int] = {}
    for row in rows:
        for i, block in enumerate(row["hash_ids"]):
            parent = row["hash_ids"][i - 1] if i else -1
            assert seen.setdefault(block, parent) == parent, f"id {block} after two different blocks"
    return seen


def test_same_seed_same_trace_and_the_format():
    a, b, c = generate("mixed", 300, 7), generate("mixed", 300, 7), generate("mixed", 300, 8)
    assert a == b and a != c
    row = a[0]
    assert set(row) == {"timestamp", "input_length", "output_length", "hash_ids"}
    assert all(x["timestamp"] <= y["timestamp"] for x, y in zip(a, a[1:]))
    assert all(0 < r["input_length"] <= 512 * len(r["hash_ids"]) for r in a)


def test_ids_are_prefix_hashes_in_every_shape():
    for shape in SHAPES:
        parents(generate(shape, 400, 1))


def test_shapes_differ_in_the_ways_they_claim():
    def stats(shape):
        rows = generate(shape, 1500, 2)
        refs = sum(len(r["hash_ids"]) for r in rows)
        distinct = len({b for r in rows for b in r["hash_ids"]})
        return refs / len(rows), 1 - distinct / refs

    chat_len, chat_reuse = stats("chat")
    agent_len, _ = stats("agent")
    _, scan_reuse = stats("scan")
    _, prompts_reuse = stats("prompts")
    assert agent_len > 2 * chat_len  # tool loops grow long prefixes
    assert scan_reuse < chat_reuse  # one-off prompts are references never made again
    assert prompts_reuse > 0.5  # popular system prompts dominate


def test_the_command_writes_a_trace_the_replay_reads(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    assert datamover_main(["tracegen", "--shape", "rag", "--requests", "200", "--seed", "3", "-o", str(out)]) == 0
    assert "200 requests" in capsys.readouterr().out
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    trace = load_trace(out)
    assert trace.requests == len(rows) == 200
    first, second = load_trace(out, part="first"), load_trace(out, part="second")
    assert first.requests + second.requests == 200 and first.requests and second.requests
    assert first.times.max() < second.times.min()


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--rate", "0"], "argument --rate: must be a finite number above 0, got 0"),  # was ZeroDivisionError
        (["--rate", "-1"], "argument --rate: must be a finite number above 0, got -1"),  # was numpy's ValueError
        (["--rate", "nan"], "argument --rate: must be a finite number above 0, got nan"),
        (["--rate", "fast"], "argument --rate: not a number: 'fast'"),
        (["--requests", "0"], "argument --requests: must be a finite number above 0, got 0"),
        (["--seed", "-1"], "argument --seed: must be 0 or more, got -1"),  # was numpy's ValueError
        (["--seed", "0.5"], "argument --seed: not an integer: '0.5'"),
    ],
)
def test_bad_rate_or_count_is_an_argparse_error(tmp_path, capsys, argv, said):
    out = tmp_path / "t.jsonl"
    with pytest.raises(SystemExit) as info:
        datamover_main(["tracegen", *argv, "-o", str(out)])
    assert info.value.code == 2
    assert capsys.readouterr().err.strip().endswith(said)
    assert not out.exists()


def test_rate_override_is_used_and_requests_is_said_to_be_approximate(tmp_path, capsys):
    out = tmp_path / "t.jsonl"
    argv = ["tracegen", "--shape", "prompts", "--rate", "0.8", "--requests", "50", "-o", str(out)]
    assert datamover_main(argv) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    usual = generate("prompts", 50)  # single requests only, at the shape's own 8 per second: ten times as fast
    assert len(rows) == len(usual) == 50
    assert abs(rows[-1]["timestamp"] - 10 * usual[-1]["timestamp"]) <= 10
    with pytest.raises(SystemExit):
        datamover_main(["tracegen", "--help"])
    assert "about this many requests, never more" in " ".join(capsys.readouterr().out.split())
