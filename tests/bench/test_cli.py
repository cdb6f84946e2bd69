"""`datamover bench` end to end on tiny sweeps: exits 0 with --check, writes what it says, sizes model runs."""

from __future__ import annotations

import json

import pytest

from datamover.bench import output
from datamover.cli import main

TINY = ["--block-sizes", "4K,64K", "--batch-sizes", "1,8", "--min-time", "0.01", "--max-iters", "3", "--quiet"]


def test_tiny_sweep_with_check(tmp_path, capsys) -> None:
    js, cs, png = tmp_path / "b.json", tmp_path / "b.csv", tmp_path / "b.png"
    argv = ["bench", "--backend", "memcpy,posix", "--check", "--dir", str(tmp_path), *TINY]
    rc = main([*argv, "--json", str(js), "--csv", str(cs), "--plot", str(png)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "memcpy" in out and "posix" in out
    data = json.loads(js.read_text())
    rows = data["results"]
    # memcpy: WRITE only; posix: WRITE and READ; 2 blocks x 2 batches each
    assert len(rows) == 4 + 8
    assert all(r["checked"] is True for r in rows)
    assert data["settings"]["check"] is True and data["machine"]["versions"]["numpy"]
    back, _ = output.read_csv(str(cs))
    assert [r.row() for r in back] == rows
    assert png.stat().st_size > 10_000


def test_model_sized_run(tmp_path, capsys) -> None:
    js = tmp_path / "m.json"
    argv = ["bench", "--model", "llama-3.1-8b", "--isl", "64", "--page-tokens", "16", "--tp", "8"]
    rc = main([*argv, "--backend", "posix", "--check", "--dir", str(tmp_path), *TINY, "--json", str(js)])
    assert rc == 0
    assert "llama-3.1-8b isl=64 page=16 tp=8 layout=layer" in capsys.readouterr().out
    rows = json.loads(js.read_text())["results"]
    # one KV head per rank: 128 dims x 2 B x 16 tokens = 4 KiB; 32 layers x K,V x 4 pages = 256 blocks
    assert {(r["block"], r["batch"]) for r in rows} == {(4096, 256)}
    assert {r["op"] for r in rows} == {"WRITE", "READ"}
    assert all(r["checked"] for r in rows)


def test_model_run_caps_batch_to_max_bytes(tmp_path, capsys) -> None:
    argv = ["bench", "--model", "70b", "--isl", "4096", "--layout", "block", "--backend", "posix", "--op", "WRITE"]
    rc = main([*argv, "--max-bytes", "16M", "--dir", str(tmp_path), *TINY, "--json", str(tmp_path / "c.json")])
    assert rc == 0
    assert "to stay within --max-bytes" in capsys.readouterr().out
    rows = json.loads((tmp_path / "c.json").read_text())["results"]
    assert [(r["block"], r["batch"]) for r in rows] == [(5 << 20, 3)]


def test_unknown_model_is_an_error() -> None:
    with pytest.raises(SystemExit, match="unknown model"):
        main(["bench", "--model", "gpt-17", *TINY])


def test_list_models(capsys) -> None:
    assert main(["bench", "--list-models", "--isl", "8192", "--tp", "1", "--layout", "block"]) == 0
    out = capsys.readouterr().out
    # 70B, tp 1, a 16-token page of all 80 layers' K and V: 5 MiB; 512 pages; 2.5 GiB per request
    assert "llama-3.1-70b    80 layers, 8 KV heads x 128    bf16  ->     512 blocks of    5 MiB (2560 MiB)" in out


def test_param_reaches_our_backend(tmp_path, monkeypatch) -> None:
    from datamover.backends.posix.aio import AioContext

    monkeypatch.setattr(AioContext, "start", lambda *a, **k: pytest.fail("aio used although posix.aio=false"))
    js = tmp_path / "p.json"
    argv = ["bench", "--backend", "posix", "--param", "posix.aio=false", "--param", "posix.threads=2", *TINY]
    assert main([*argv, "--check", "--dir", str(tmp_path), "--json", str(js)]) == 0
    assert all(r["checked"] for r in json.loads(js.read_text())["results"])
    with pytest.raises(SystemExit, match=r"BACKEND\.KEY=VALUE"):
        main(["bench", "--param", "aio=false", *TINY])


def test_pin_hosts_without_peer_hosts_is_an_error(capsys) -> None:
    assert main(["bench", "--backend", "memcpy", "--pin-hosts", *TINY]) == 2
    assert "--pin-hosts: only with --ucx-peer-host" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--block-sizes", "0"], "block and batch sizes must be at least 1"),
        (["--batch-sizes", "0"], "block and batch sizes must be at least 1"),
        (["--batch-sizes", "8,x"], "--batch-sizes wants whole numbers, got '8,x'"),
        (["--block-sizes", "4K,lots"], "--block-sizes must be a byte count like 4096 or '16G', got 'lots'"),
        (["--max-bytes", "lots"], "--max-bytes must be a byte count like 4096 or '16G', got 'lots'"),
    ],
)
def test_bad_sizes_are_one_line_not_a_traceback(argv, said, capsys) -> None:
    try:
        rc = main(["bench", "--backend", "memcpy", *argv])
        err = capsys.readouterr().err.strip()
    except SystemExit as exc:
        rc, err = 1, str(exc.code)
    assert rc != 0 and err == "datamover bench: " + said


def test_memcpy_param_reaches_its_agent(tmp_path, capsys) -> None:
    # memcpy's options were never read: threads=1 was ignored (the header said the default) and unknown keys passed
    js = tmp_path / "m.json"
    assert main(["bench", "--backend", "memcpy", "--param", "memcpy.threads=1", *TINY, "--json", str(js)]) == 0
    assert "memcpy: threads=1" in capsys.readouterr().out
    assert json.loads(js.read_text())["headers"]["memcpy"]["threads"] == 1
    assert main(["bench", "--backend", "memcpy", "--param", "memcpy.nosuch=1", *TINY]) == 2
    assert "backend 'memcpy': unknown parameter(s) ['nosuch']" in capsys.readouterr().err


def test_param_for_a_backend_not_benchmarked_is_refused(capsys) -> None:
    assert main(["bench", "--backend", "memcpy", "--param", "posix.threads=1", *TINY]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == (
        "datamover bench: --param posix.threads: backend 'posix' is not benchmarked in this run (memcpy)"
    )
    assert "GB/s" not in out  # refused before any timing


@pytest.mark.parametrize("value", ["x", "1.5"])
def test_bad_posix_param_is_one_line_and_leaves_no_file(tmp_path, capsys, value) -> None:
    # threads=x was a 30-line traceback (ValueError from int()); it and an unknown key left the bench file behind
    for param in (f"posix.threads={value}", "posix.nosuch=1"):
        assert main(["bench", "--backend", "posix", "--param", param, "--dir", str(tmp_path), *TINY]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("datamover bench: backend 'posix': ") and "\n" not in err
        assert list(tmp_path.iterdir()) == []


def test_unknown_op_is_refused(capsys) -> None:
    assert main(["bench", "--backend", "memcpy", "--op", "FOO", *TINY]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == "datamover bench: unknown --op FOO; ops are WRITE, READ, LOOKUP"
    assert "GB/s" not in out


def test_op_a_backend_lacks_is_said(tmp_path, capsys) -> None:
    # --op READ --backend memcpy printed an empty table and exited 0
    assert main(["bench", "--backend", "memcpy", "--op", "READ", *TINY]) == 2
    out, err = capsys.readouterr()
    assert err.strip() == "datamover bench: memcpy does not support READ (its ops: WRITE); skipped"
    assert "GB/s" not in out
    # a backend lacking the op is skipped, the others run it
    js = tmp_path / "r.json"
    argv = ["bench", "--backend", "memcpy,posix", "--op", "read", "--dir", str(tmp_path), *TINY, "--json", str(js)]
    assert main(argv) == 0
    assert "memcpy does not support READ (its ops: WRITE); skipped" in capsys.readouterr().err
    rows = json.loads(js.read_text())["results"]
    assert {(r["backend"], r["op"]) for r in rows} == {("posix", "READ")}
    # asked for both, memcpy times the one it has and says which it lacks
    assert main(["bench", "--backend", "memcpy", "--op", "WRITE,READ", *TINY]) == 0
    out, err = capsys.readouterr()
    assert err.strip() == "datamover bench: memcpy does not support READ (its ops: WRITE)"
    assert "memcpy   WRITE" in out
