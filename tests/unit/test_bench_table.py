"""`kvlink-bench table`: today's figures as one markdown table from the JSON lines of runs, the
run fields kvlink-bench's rows carry for it, and input it must refuse with the file and line."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from kvlink.bench import table
from kvlink.bench.report import RUN_FIELDS, Reporter, git_commit, run_info
from kvlink.cli import bench as cli_bench
from tests.conftest import require_tool

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {
    "scenario": "Loopback TCP push, 4 paths, 1 GiB", "ratio": 0.98,
    "baseline": "iperf3, 4 streams on the same loopback paths", "target": ">= 0.9", "met": True,
    "date": "2026-12-01 10:39 UTC", "commit": "2685ac0",
    "command": "KVLINK_TRANSPORT=tcp kvlink-bench loopback --paths 4 --size 1GiB --compare iperf3",
}  # fmt: skip
GPU = {
    "scenario": "GPU -> GPU push", "ratio": None,
    "ratio_text": "unmeasured (no GPU machine lent)", "baseline": "host -> host push",
    "target": ">= 0.9", "command": "bash bench/gpu/device_check.sh",
}  # fmt: skip
DOC = f"# title\r\n\nbefore | the table\n{table.BEGIN}\nan old table\n{table.END}\nafter\n\n"


def jsonl(path: Path, *rows: dict | str) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def bench(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvlink.cli.bench", *argv], capture_output=True,
                          text=True, timeout=60, check=False, cwd=ROOT)  # fmt: skip


def test_the_table_has_a_row_per_scenario_with_ratio_baseline_date_and_command(tmp_path):
    f = jsonl(tmp_path / "r.jsonl", LOOPBACK, {"note": "iperf3 ran"}, "", GPU)
    lines = table.render(table.load([f])).splitlines()
    assert lines[0] == "| " + " | ".join(table.COLUMNS) + " |"
    assert lines[2] == (
        "| Loopback TCP push, 4 paths, 1 GiB | **0.98 x** | iperf3, 4 streams on the same loopback "
        "paths | >= 0.9: met | 2026-12-01 10:39 UTC, 2685ac0 | `KVLINK_TRANSPORT=tcp kvlink-bench "
        "loopback --paths 4 --size 1GiB --compare iperf3` |"
    )
    assert lines[3] == (
        "| GPU -> GPU push | unmeasured (no GPU machine lent) | host -> host push | >= 0.9 | - | "
        "`bash bench/gpu/device_check.sh` |"
    )
    assert len(lines) == 4


def test_a_later_row_of_a_scenario_replaces_it_in_place(tmp_path):
    a = jsonl(tmp_path / "a.jsonl", LOOPBACK, GPU)
    newer = {**LOOPBACK, "ratio": 1.5, "met": False, "commit": "abcdef1234+dirty"}
    b = jsonl(tmp_path / "b.jsonl", newer)
    rows = table.load([a, b])
    assert [r["scenario"] for r in rows] == [LOOPBACK["scenario"], GPU["scenario"]]
    line = table.render(rows).splitlines()[2]
    assert "| **1.50 x** |" in line and ">= 0.9: **not met**" in line and "abcdef1+dirty" in line


def test_cells_are_escaped_and_details_shown(tmp_path):
    row = {**LOOPBACK, "scenario": "a | b", "ratio": 0.0163, "detail": "11.8 vs 730.9 ms",
           "section": "pre-warm", "command": "for n in 0 2; do echo `x` | cat; done"}  # fmt: skip
    line = table.render(table.load([jsonl(tmp_path / "r.jsonl", row)])).splitlines()[2]
    assert line.startswith("| [a \\| b](#pre-warm) | **0.016 x** (11.8 vs 730.9 ms) |")
    assert line.endswith("| `` for n in 0 2; do echo `x` \\| cat; done `` |")


def test_kvlink_bench_rows_round_trip_into_the_table(monkeypatch, tmp_path):
    """The rows a kvlink-bench run prints carry RUN_FIELDS; the ones measured against the
    run's baseline get a scenario and make the table, the baseline's own row does not."""
    monkeypatch.setenv("KVLINK_TRANSPORT", "tcp")
    monkeypatch.setenv("KVLINK_SECRET", "s3cret" * 8)
    monkeypatch.setenv("KVLINK_REQUIRE_ALL", "1")  # the tests' own, not a setting
    argv = ["loopback", "--paths", "2", "--size", "16MiB,1GiB", "--json"]
    args = cli_bench.build_parser().parse_args(argv)
    cli_bench.resolve(args)
    rep = Reporter("loopback", json_lines=True)
    rep.run = run_info("kvlink-bench", argv)
    rep.scenario_of = lambda row: cli_bench.scenario_name(args, row)
    out = io.StringIO()
    with redirect_stdout(out):
        rep.result({"tool": "kvlink", "op": "push", "size_bytes": 1 << 20, "gbps": 2.0,
                    "ratio_to_limit": None, "limit_gbps": None})  # fmt: skip
        cli_bench.report_limit(rep, 2.0, 1 << 30, 2)
        for size, nics in ((16 << 20, ["tcp"]), (1 << 30, ["tcp"])):
            rep.result({"tool": "kvlink", "op": "push", "size_bytes": size, "chunk_bytes": 0,
                        "paths": 2, "transports": nics, "gbps": 2.5, "limit_gbps": 2.0,
                        "ratio_to_limit": 1.25})  # fmt: skip
        rep.result({"tool": "nixl", "op": "push", "size_bytes": 1 << 30, "chunk_bytes": None,
                    "paths": 2, "gbps": 1.0, "limit_gbps": 2.0, "ratio_to_limit": 0.5})  # fmt: skip
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert all(set(RUN_FIELDS) <= set(r) for r in rows)
    assert [r["scenario"] for r in rows] == [
        None, None,
        "loopback tcp push 16MiB, 2 paths", "loopback tcp push 1GiB, 2 paths",
        "loopback push 1GiB, 2 paths [nixl]",
    ]  # fmt: skip
    assert rows[2]["baseline"] == "iperf3, 2 streams on the same paths"
    assert rows[0]["baseline"] is None and rows[1]["baseline"] is None
    command = rows[2]["command"]
    assert command == "KVLINK_TRANSPORT=tcp kvlink-bench " + " ".join(argv)
    assert "SECRET" not in command and "s3cret" not in command
    assert rows[2]["date"].endswith("Z") and rows[2]["commit"] == git_commit()
    # and the table made from what was printed
    printed = tmp_path / "run.jsonl"
    printed.write_text(out.getvalue())
    got = table.render(table.load([printed]))
    assert "| loopback tcp push 1GiB, 2 paths | **1.25 x** (2.500 vs 2.000 GB/s) |" in got
    assert len(got.splitlines()) == 2 + 3


def test_scenario_flag_names_the_rows(tmp_path):
    args = cli_bench.build_parser().parse_args(
        ["testbed", "--size", "20MB,1GiB", "--scenario", "Testbed push"]
    )
    cli_bench.resolve(args)
    row = {"tool": "kvlink", "size_bytes": 1 << 30, "chunk_bytes": 4 << 20, "paths": 4}
    assert cli_bench.scenario_name(args, row) == "Testbed push (1GiB, chunk 4MiB)"
    args.size = [1 << 30]
    args.chunk = [0]
    assert cli_bench.scenario_name(args, {**row, "chunk_bytes": 0}) == "Testbed push"


def test_git_commit_names_the_checkout_and_nothing_else(tmp_path):
    git = require_tool("git")
    assert git_commit(tmp_path) is None  # not a checkout
    repo = tmp_path / "repo"
    repo.mkdir()

    def run(*a: str) -> str:
        cmd = [git, "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *a]
        return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()

    run("init", "-q")
    (repo / "f").write_text("1")
    run("add", "f")
    run("commit", "-qm", "one")
    head = run("rev-parse", "--short=12", "HEAD")
    assert git_commit(repo) == head
    (repo / "f").write_text("2")
    assert git_commit(repo) == head + "+dirty"
    (repo / "sub").mkdir()
    assert git_commit(repo / "sub") is None  # inside someone else's repository


def test_write_replaces_only_between_the_markers(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_bytes(DOC.encode())
    new = table.render(table.load([jsonl(tmp_path / "r.jsonl", LOOPBACK)]))
    table.write(doc, new)
    got = doc.read_bytes().decode()
    head, _, rest = DOC.partition(table.BEGIN)
    _, _, tail = rest.partition(table.END)
    assert got == head + table.BEGIN + "\n" + new + table.END + tail
    table.write(doc, new)  # again: the same bytes
    assert doc.read_bytes().decode() == got


def test_the_cli_prints_and_writes_the_table(tmp_path):
    f = jsonl(tmp_path / "r.jsonl", LOOPBACK)
    out = bench("table", str(f))
    assert out.returncode == 0, out.stderr
    assert out.stdout == table.render([LOOPBACK])
    doc = tmp_path / "B.md"
    doc.write_bytes(DOC.encode())
    out = bench("table", str(f), "--write", str(doc))
    assert out.returncode == 0, out.stderr
    assert out.stdout == f"kvlink-bench table: 1 rows written to {doc}\n"
    assert table.render([LOOPBACK]) in doc.read_text()


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"scenario": "x"\n', "{f}:1: not JSON: Expecting ',' delimiter (column 17)"),
        (json.dumps(LOOPBACK) + "\n[1, 2]\n", "{f}:2: expected a JSON object, got list"),
        ('\n{"scenario": "x", "baseline": "b"}\n',
         "{f}:2: scenario 'x' has no 'command' (a string)"),
        (json.dumps({**LOOPBACK, "ratio": "fast"}) + "\n",
         "{f}:1: scenario 'Loopback TCP push, 4 paths, 1 GiB': ratio 'fast' is not a number"),
        ('{"note": "n"}\n{"tool": "kvlink", "scenario": null}\n', "{f}: no row with a scenario"),
    ],
)  # fmt: skip
def test_bad_input_names_the_file_and_line(tmp_path, content, message):
    f = tmp_path / "bad.jsonl"
    f.write_text(content)
    with pytest.raises(table.TableError) as exc:
        table.load([f])
    assert str(exc.value).startswith(message.format(f=f)), str(exc.value)
    out = bench("table", str(f))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("kvlink-bench table: " + message.format(f=f))


def test_a_missing_file_or_marker_is_named(tmp_path):
    out = bench("table", str(tmp_path / "none.jsonl"))
    assert out.returncode == 2
    assert (
        out.stderr == f"kvlink-bench table: {tmp_path / 'none.jsonl'}: cannot read: "
        "No such file or directory\n"
    )
    f = jsonl(tmp_path / "r.jsonl", LOOPBACK)
    for text, why in [
        ("no markers\n", f"no marker {table.BEGIN!r}"),
        (DOC + table.END + "\n", f"2 times the marker {table.END!r}"),
        (f"{table.END}\n{table.BEGIN}\n", f"{table.END!r} comes before {table.BEGIN!r}"),
    ]:
        doc = tmp_path / "B.md"
        doc.write_bytes(text.encode())
        out = bench("table", str(f), "--write", str(doc))
        assert out.returncode == 2
        assert out.stderr.startswith(f"kvlink-bench table: {doc}: {why}"), out.stderr
        assert doc.read_bytes() == text.encode()  # left as it was
    out = bench("table", str(f), "--write", str(tmp_path / "none.md"))
    assert out.returncode == 2 and "none.md: cannot read: No such file" in out.stderr


def test_docs_benchmarks_table_is_the_one_its_jsonl_makes():
    """docs/BENCHMARKS.md's table is written by kvlink-bench table from
    docs/data/benchmarks-current.jsonl: an edit of one without the other fails here."""
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    rows = table.load([ROOT / "docs" / "data" / "benchmarks-current.jsonl"])
    assert table.replace(text, table.render(rows), "BENCHMARKS.md") == text
