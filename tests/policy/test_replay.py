"""Trace replay: loading, multi-tier accounting, the report, the CLI, and the targets on the shared trace."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from datamover.policy.cli import main as replay_main
from datamover.policy.config import TierConfig, with_overrides
from datamover.policy.cost import CostModel
from datamover.policy.data_replay import run_with_data
from datamover.policy.keys import chunk_keys
from datamover.policy.policies import BASELINES, belady_hits, make_policy
from datamover.policy.replay import (
    TierSpec,
    TierStack,
    Trace,
    format_report,
    load_trace,
    parse_capacity,
    run_replay,
    simulate,
    single_tier,
)

SHARED_TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"


def write_trace(path: Path, requests: list[list[int]], step_ms: int = 1000) -> Path:
    with open(path, "w") as f:
        for i, ids in enumerate(requests):
            f.write(
                json.dumps(
                    {"timestamp": i * step_ms, "input_length": 512 * len(ids), "output_length": 1, "hash_ids": ids}
                )
                + "\n"
            )
    return path


def test_load_trace(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", [[0, 1, 2], [0, 1, 3, 4], [5]])
    trace = load_trace(path)
    assert trace.keys.tolist() == [0, 1, 2, 0, 1, 3, 4, 5]
    assert trace.times.tolist() == [0.0] * 3 + [1.0] * 4 + [2.0]
    assert trace.request.tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    assert (trace.distinct, trace.requests) == (6, 3)
    assert load_trace(path, limit=2).keys.tolist() == [0, 1, 2, 0, 1, 3, 4]


def test_two_tier_accounting():
    """Write-back demotion, promotion on a lower-tier hit, and the moves between each pair of tiers."""
    s = TierStack(make_policy("lru"), [TierSpec("l1_hbm", 2), TierSpec("l2_dram", 4)])
    served = [s.access(k, float(i), i) for i, k in enumerate([1, 2, 3, 1, 4, 5, 6, 7, 1])]
    # 1,2 fill L1; 3 demotes 1; 1 is an L2 hit, promoted to L1, demoting 2; 4 demotes 3; 5 evicts 1, already
    # in L2 so nothing moves; 6 demotes 4 (L2 now full); 7 demotes 5 and L2 drops its LRU chunk, 1; so the
    # last 1 is a miss, and it demotes 6 while L2 drops 2.
    assert served == [-1, -1, -1, 1, -1, -1, -1, -1, -1]
    assert s.hits == [0, 1] and s.misses == 8
    assert s.moved == {("prefill", "l1_hbm"): 8, ("l2_dram", "l1_hbm"): 1, ("l1_hbm", "l2_dram"): 6}
    assert s.evictions == [7, 2]
    assert s.resident == [{7, 1}, {3, 4, 5, 6}]


def test_write_through_copies_down_at_once():
    s = TierStack(make_policy("lru"), [TierSpec("l1_hbm", 2), TierSpec("l2_dram", 4)], write_through=True)
    for i, k in enumerate([1, 2, 3]):
        s.access(k, float(i), i)
    assert s.resident[1] == {1, 2, 3}
    assert s.moved == {("prefill", "l1_hbm"): 3, ("l1_hbm", "l2_dram"): 3}


def test_admission_refusal_writes_around_to_the_next_tier():
    config = with_overrides(TierConfig(), l1_hbm={"block_pool_size": 2}, l2_dram={"pinned_pool_gb": 1.0})
    trace_ids = [7, 8, 7, 8, 7, 8, 9]
    trace = Trace(np.array(trace_ids), np.zeros(len(trace_ids)), np.arange(len(trace_ids)))
    result = simulate(trace, "scored", config)
    assert result.moved[("prefill", "l2_dram")] == 1  # 9 scores below the hot residents: L1 refuses it


def test_model_version_mismatch_never_hits():
    """Chunks stored under one model or tokenizer version are never served for another, whatever the policy."""
    hashes = [11, 12, 13, 11, 12]
    for name in ("lru", "default"):
        s = TierStack(make_policy(name), [TierSpec("l1_hbm", 100), TierSpec("l2_dram", 100)])
        for i, key in enumerate(chunk_keys(hashes, "llama-3-8b@v1", "tok-v1")):
            s.access(key, float(i))
        assert sum(s.hits) == 2
        others = chunk_keys(set(hashes), "llama-3-8b@v2", "tok-v1") + chunk_keys(set(hashes), "llama-3-8b@v1", "tok-v2")
        assert [s.access(key, 10.0) for key in others] == [-1] * 6
        assert [s.access(key, 20.0) for key in chunk_keys(set(hashes), "llama-3-8b@v1", "tok-v1")] == [0] * 3


def test_parse_capacity():
    assert parse_capacity("1%", 182_790) == 1827
    assert parse_capacity("250", 10) == 250
    with pytest.raises(ValueError):
        parse_capacity("0.0001%", 100)


def test_report_sweep_plot_and_cli(tmp_path, capsys):
    rng = np.random.default_rng(0)
    requests = [[0, *rng.integers(1, 300, size=6).tolist()] for _ in range(200)]
    path = write_trace(tmp_path / "t.jsonl", requests)
    config = single_tier(TierConfig(), 20)
    report = run_replay(path, config, sweep=True, sweep_fractions=(0.05, 0.2), plot=tmp_path / "sweep.png")
    names = ["default", *BASELINES, "belady"]
    assert [r.policy for r in report.results] == names
    assert len(report.sweep) == 2 * len(names)
    assert (tmp_path / "sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = format_report(report)
    assert "of belady" in text and "sweep over L1 capacity" in text
    belady = report.results[-1]
    single = write_trace(tmp_path / "one.jsonl", [[k] for r in requests for k in r])  # one block per request
    alone = run_replay(single, config, policies=["belady"]).results[0]
    assert alone.hit_rate == belady_hits(load_trace(single).keys, 20) / report.refs
    assert all(belady.hit_rate >= r.hit_rate for r in report.results)
    assert all(r.prefix_hit_rate <= r.hit_rate for r in report.results)
    cost = CostModel.from_config(config)
    assert report.results[0].effective_ns(cost) == pytest.approx(
        100.0 * report.results[0].hit_rate + 50e6 * report.results[0].miss_rate
    )

    assert replay_main([str(path), "--single-tier", "--l1-capacity", "5%", "--json", "--policy", "lru"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["results"]] == ["lru"]
    assert out["results"][0]["tiers"][0]["capacity"] == int(out["distinct"] * 0.05)
    bad = tmp_path / "bad.yaml"
    bad.write_text("kv_cache_tiered:\n  l1_hbm:\n    block_pool_sise: 3\n")
    assert replay_main([str(path), "--config", str(bad)]) == 2
    assert "kv_cache_tiered.l1_hbm.block_pool_sise: unknown key" in capsys.readouterr().err
    nowhere = str(tmp_path / "missing" / "sweep.png")
    assert replay_main([str(path), "--sweep", "--plot", nowhere]) == 2  # before the sweep, which would run first
    assert "missing or not writable" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not SHARED_TRACE.exists(), reason=f"{SHARED_TRACE} not present")
def test_targets_on_the_shared_trace():
    """Single tier at 1/5/10 % of distinct blocks: LRU at about 21/53/76 % of Belady, the default policy above
    LRU at each (issue 18's bar; its aim of 40 % of Belady at 1 % is for traces not in the repository and is
    not met here: 36 %), every replay of the 288,500 references under 10 s (CPU)."""
    trace = load_trace(SHARED_TRACE)
    assert (len(trace.keys), trace.distinct) == (288_500, 182_790)
    for fraction, lru_share in ((0.01, 0.21), (0.05, 0.53), (0.10, 0.76)):
        config = single_tier(TierConfig(), int(trace.distinct * fraction))
        results = {name: simulate(trace, name, config) for name in ("lru", "default", "belady")}
        bound = results["belady"].hit_rate
        assert results["lru"].hit_rate / bound == pytest.approx(lru_share, abs=0.01)
        assert results["default"].hit_rate > results["lru"].hit_rate, (fraction, results["default"].hit_rate)
        for r in results.values():  # CPU time: other work on the machine must not fail this
            assert r.cpu_s < 10.0, (r.policy, fraction, r.cpu_s)


def test_with_data_checks_every_hit(tmp_path, capsys):
    rng = np.random.default_rng(1)
    requests = [[0, *rng.integers(1, 60, size=5).tolist()] for _ in range(80)]
    path = write_trace(tmp_path / "t.jsonl", requests)
    config = with_overrides(
        TierConfig(),
        l1_hbm={"block_pool_size": 8},
        l2_dram={"pinned_pool_gb": 16 * 65536 / 2**30, "hysteresis_cooldown_s": 0.0},
        l3_nvme={"enabled": True, "capacity_gb": 64 * 65536 / 2**30, "fsync_mode": "none"},
    )
    report = run_with_data(path, config, requests=80)
    assert report.wrong_chunks == 0 and report.stats["checksum_failures"] == 0
    assert report.requests == 80 and report.refs == 480
    hits = report.stats["hits"]
    assert hits["l1_hbm"] > 0 and hits["l3_nvme"] > 0  # the small upper tiers spill to L3 and are read back
    assert sum(hits.values()) + report.stats["misses"] == 480
    assert "0 wrong" in report.format()
    assert replay_main([str(path), "--with-data", "--requests", "40", "--policy", "lru"]) == 0
    assert "with data: 40 requests" in capsys.readouterr().out


def conversation_trace(path: Path, requests: int = 300) -> Path:
    """Multi-turn conversations: each turn re-reads its conversation so far and adds new blocks."""
    rng = np.random.default_rng(0)
    conversations: list[list[int]] = []
    fresh, stamp = 1, 0
    rows: list[tuple[int, list[int]]] = []
    for _ in range(requests):
        stamp += int(rng.integers(0, 3000))
        if conversations and rng.random() < 0.6:
            conv = conversations[int(rng.integers(len(conversations)))]
        else:
            conv = [0]
            conversations.append(conv)
        grow = int(rng.integers(1, 4))
        conv.extend(range(fresh, fresh + grow))
        fresh += grow
        rows.append((stamp, list(conv)))
    with open(path, "w") as f:
        for stamp, ids in rows:
            f.write(json.dumps({"timestamp": stamp, "hash_ids": ids}) + "\n")
    return path


@pytest.mark.parametrize("policy", ["default", "lru"])
def test_the_cache_makes_the_simulators_decisions(tmp_path, policy):
    """One tier, a prefix-structured trace: moving real bytes gives exactly the simulated hits and misses."""
    path = conversation_trace(tmp_path / "conv.jsonl")
    config = with_overrides(single_tier(TierConfig(), 20), policy={"name": policy})
    simulated = simulate(load_trace(path), policy, config)  # the cache serves each request as the replay does
    real = run_with_data(path, config, requests=300)
    assert real.wrong_chunks == 0
    assert real.stats["hits"]["l1_hbm"] == simulated.prefix_hits > 100  # the cache counts usable hits
    assert real.stats["misses"] == simulated.refs - simulated.prefix_hits
    assert real.stats["evictions"]["l1_hbm"] == simulated.evictions[0]  # and the policy made the same choices


def test_load_trace_keeps_64_bit_unsigned_ids_distinct(tmp_path):
    path = tmp_path / "u64.jsonl"
    big = [2**64 - 1, 2**63, 5]
    path.write_text(
        json.dumps({"timestamp": 0, "hash_ids": big}) + "\n" + json.dumps({"timestamp": 1, "hash_ids": [5, 2**63]})
    )
    trace = load_trace(path)
    assert trace.keys.tolist() == [-1, -(2**63), 5, 5, -(2**63)]  # the same 64 bits, as int64
    assert trace.distinct == 3


@pytest.mark.parametrize(
    "line, reason",
    [
        ("{not json", "Expecting property name"),
        ('{"timestamp": 0}', "no 'hash_ids'"),
        ('{"hash_ids": [1]}', "no 'timestamp'"),
        ('{"timestamp": 0, "hash_ids": [1.5, 2]}', "not a list of integers"),
        ('{"timestamp": 0, "hash_ids": ["ab"]}', "not a list of integers"),
        ('{"timestamp": 0, "hash_ids": 7}', "not a list of integers"),
        ('{"timestamp": "noon", "hash_ids": [1]}', "not a number of ms"),
        ('{"timestamp": NaN, "hash_ids": [1]}', "not a number of ms"),
        ("[1, 2]", "not a JSON object"),
    ],
)
def test_a_malformed_trace_line_is_named(tmp_path, line, reason):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n\n' + line + "\n")
    with pytest.raises(ValueError, match=rf"bad.jsonl, line 3: .*{reason}"):
        load_trace(path)


def test_the_replay_command_names_a_malformed_trace_line(tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": [1, 2]}\n{"timestamp": 1}\n')
    assert replay_main([str(path), "--policy", "lru"]) == 2
    assert "bad.jsonl, line 2: no 'hash_ids'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("lines", "kwargs", "said"),
    [
        ([], {}, "no request to replay (an empty file)"),
        (["", "   "], {}, "no request to replay (an empty file)"),
        (['{"timestamp": 0, "hash_ids": [1]}'], {"limit": 0}, "no request to replay (limit 0)"),
        (['{"timestamp": 0, "hash_ids": []}'] * 2, {}, "the 2 requests all have empty hash_ids"),
        (['{"timestamp": 5, "hash_ids": [1, 2]}'], {"part": "first"}, "the first half by time holds no request"),
        (['{"timestamp": 5, "hash_ids": [1]}'] * 3, {"part": "first"}, "3 requests, all in the other half"),
        (
            ['{"timestamp": 0, "hash_ids": [1]}', '{"timestamp": 9, "hash_ids": []}'],
            {"part": "second"},
            "the 1 requests in the second half by time all have empty hash_ids",
        ),
    ],
)
def test_a_trace_with_nothing_to_replay_is_named(tmp_path, lines, kwargs, said):
    """Was a ZeroDivisionError from the report (hit rate over no reference)."""
    path = tmp_path / "none.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    with pytest.raises(ValueError, match=rf"^trace .*none.jsonl: .*{re.escape(said)}"):
        load_trace(path, **kwargs)


def test_one_request_splits_into_an_empty_first_half_and_a_whole_second(tmp_path, capsys):
    path = write_trace(tmp_path / "one.jsonl", [[1, 2, 3]])
    assert load_trace(path, part="second").keys.tolist() == [1, 2, 3]
    assert replay_main([str(path), "--policy", "lru", "--part", "first"]) == 2
    assert "one.jsonl: the first half by time holds no request" in capsys.readouterr().err
    assert replay_main([str(path), "--policy", "lru", "--part", "second"]) == 0


def test_with_data_over_requests_without_references_is_named(tmp_path, capsys):
    """The replayed head of the trace has no reference (was a ValueError traceback from the cost model)."""
    path = tmp_path / "t.jsonl"
    path.write_text('{"timestamp": 0, "hash_ids": []}\n{"timestamp": 1, "hash_ids": [1, 2]}\n')
    assert replay_main([str(path), "--policy", "lru", "--with-data", "--requests", "1"]) == 2
    assert "the 1 requests all have empty hash_ids" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["inf%", "1e400%", "nan%", "-inf%", "1e400", "abc", "%", ""])
def test_a_capacity_that_is_no_number_is_named(text):
    """inf% was an OverflowError, nan% said only 'cannot convert float NaN to integer'."""
    with pytest.raises(ValueError, match=rf"^capacity {re.escape(repr(text))} is not a number of chunks"):
        parse_capacity(text, 1000)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--l1-capacity", "inf%"], "datamover replay: capacity 'inf%' is not a number of chunks"),
        (["--limit", "0"], "argument --limit: must be a finite number above 0, got 0"),
        (["--limit", "-1"], "argument --limit: must be a finite number above 0, got -1"),
        (["--with-data", "--requests", "-5"], "argument --requests: must be a finite number above 0, got -5"),
    ],
)
def test_bad_replay_arguments_are_one_line(tmp_path, capsys, argv, said):
    """Each was a traceback: OverflowError, ZeroDivisionError (an empty replay), the cost model's ValueError."""
    path = write_trace(tmp_path / "t.jsonl", [[1, 2], [1, 3]])
    try:
        code = replay_main([str(path), "--policy", "lru", *argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and said in err.strip().splitlines()[-1]


def test_a_line_past_the_longest_is_refused_without_reading_it(tmp_path, monkeypatch):
    """A 2 GB line was read whole and parsed (gigabytes); now reading stops at MAX_LINE_BYTES."""
    import tracemalloc

    import datamover.policy.replay as replay

    monkeypatch.setattr(replay, "MAX_LINE_BYTES", 64 << 10, raising=False)
    path = tmp_path / "long.jsonl"
    ids = ", ".join(["12345678901234567890"] * 200_000)  # 4.4 MB
    path.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1, "hash_ids": [' + ids + "]}\n")
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"long.jsonl, line 2: longer than 65,536 bytes"):
            load_trace(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    exact = tmp_path / "exact.jsonl"  # a line of exactly MAX_LINE_BYTES (its newline aside) is read
    row = '{"timestamp": 0, "hash_ids": [1]}'
    exact.write_text(row + " " * ((64 << 10) - len(row)) + "\n")
    assert load_trace(exact).keys.tolist() == [1]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b'{"timestamp": 0, "hash_ids": [1]}\xff\n', "'utf-8' codec can't decode byte 0xff"),
        (b"\x80\x81\n", "'utf-8' codec can't decode byte 0x80"),
        (b'{"timestamp": 0, "hash_ids": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n", "JSON nested too deeply"),
        (b"[" * 100_000 + b"\n", "JSON nested too deeply"),
        (b'{"timestamp": 1' + b"0" * 400 + b', "hash_ids": [1]}\n', "timestamp is too large a number of ms"),
    ],
)
def test_undecodable_deep_or_huge_lines_are_named(tmp_path, raw, reason):
    """Were a UnicodeDecodeError without file or line, a RecursionError and an OverflowError traceback."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"timestamp": 0, "hash_ids": [1, 2]}\n' + raw)
    with pytest.raises(ValueError, match=rf"bad.jsonl, line 2: {re.escape(reason)}"):
        load_trace(path)


def test_requests_without_hash_ids_are_skipped_and_counted(tmp_path, capsys):
    """They counted as requests before the last one with ids and not after it (2 or 1 for the same rows)."""
    rows = [
        '{"timestamp": 0, "hash_ids": []}',
        '{"timestamp": 1, "hash_ids": [1, 2]}',
        '{"timestamp": 2, "hash_ids": [1]}',
    ]
    for order in (rows, rows[::-1], [rows[1], rows[0], rows[2]]):
        path = tmp_path / "t.jsonl"
        path.write_text("".join(r + "\n" for r in order))
        trace = load_trace(path)
        assert (trace.requests, trace.skipped, len(trace.keys)) == (2, 1, 3)
        assert trace.request.tolist() in ([0, 0, 1], [0, 1, 1])
    assert replay_main([str(path), "--policy", "lru"]) == 0
    assert "2 requests, 3 chunk references, 2 distinct" in (out := capsys.readouterr().out)
    assert "1 requests without hash_ids skipped" in out.split("\n")[0]
    assert replay_main([str(path), "--policy", "lru", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert (report["requests"], report["requests_without_hash_ids"]) == (2, 1)


def test_requests_out_of_time_order_are_replayed_in_file_order_and_counted(tmp_path, capsys):
    """Nothing said that a trace's clock stepped back (the policies see it: a chunk used "later" looks newer)."""
    path = tmp_path / "t.jsonl"
    stamps = [0, 5000, 3000, 3000, 9000, 1000]
    path.write_text("".join(f'{{"timestamp": {t}, "hash_ids": [{i}, 99]}}\n' for i, t in enumerate(stamps)))
    trace = load_trace(path)
    assert trace.out_of_order == 2  # 3000 after 5000, 1000 after 9000 (a tie is in order)
    assert trace.keys.tolist()[::2] == [0, 1, 2, 3, 4, 5]  # file order kept
    assert trace.times.tolist()[::2] == [t / 1000.0 for t in stamps]
    assert load_trace(path, part="first").out_of_order == 1  # 0, 3000, 3000, 1000
    assert replay_main([str(path), "--policy", "lru"]) == 0
    assert "2 requests timed before the request above them (replayed in file order)" in capsys.readouterr().out
    assert replay_main([str(path), "--policy", "lru", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests_out_of_time_order"] == 2
    write_trace(path, [[1], [2]])
    assert load_trace(path).out_of_order == 0
    assert replay_main([str(path), "--policy", "lru"]) == 0
    assert "timed before" not in capsys.readouterr().out


def test_requests_naming_a_hash_id_twice_are_counted(tmp_path, capsys):
    """Each repeat is a reference (the second finds the chunk); nothing said a trace had them."""
    path = write_trace(tmp_path / "t.jsonl", [[1, 2, 1], [3, 4], [5, 5, 5, 6], [2, 1]])
    trace = load_trace(path)
    assert trace.repeating == 2 and len(trace.keys) == 11
    assert replay_main([str(path), "--policy", "lru", "--single-tier", "--l1-capacity", "8"]) == 0
    out = capsys.readouterr().out
    assert "; 2 requests name a hash_id twice" in out and "hit rate 45.45%" in out  # 1, 5, 5, 2 and 1 again
    assert replay_main([str(path), "--policy", "lru", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["requests_repeating_a_hash_id"] == 2
