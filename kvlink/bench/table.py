"""``kvlink-bench table``: today's figures as one markdown table, from JSON lines.

A row of the table is one JSON object with a ``scenario``; ``kvlink-bench --json`` writes one
for each result measured against a baseline in the same run (``report.RUN_FIELDS``), and
``docs/data/benchmarks-current.jsonl`` holds the figures of the bench/ scripts in the same
shape. Fields:

- ``scenario``, ``baseline``, ``command`` (required): what was measured, against what (in the
  same run), and the command line that measures it again.
- ``ratio``, or ``ratio_to_limit`` as kvlink-bench writes it: the figure, a number or null
  (null: unmeasured; ``ratio_text`` then says why).
- optional: ``ratio_text`` (shown instead of the number), ``detail`` (absolute figures; for
  kvlink-bench rows made from ``gbps`` and ``limit_gbps``), ``target`` and ``met``
  (true/false/null), ``date``, ``commit``, ``section`` (an anchor in the page the table is in).

Lines without a ``scenario`` (iperf3's own row, notes, rows of runs without a baseline) are
skipped. When several rows name the same scenario, the last one read wins and keeps the place
of the first, so ``kvlink-bench table current.jsonl new-run.jsonl`` updates rows in place.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

BEGIN = "<!-- kvlink-bench table: begin -->"
END = "<!-- kvlink-bench table: end -->"
REQUIRED = ("scenario", "baseline", "command")
COLUMNS = ("Scenario", "Figure", "Baseline (same run)", "Target", "Measured", "Command")


class TableError(Exception):
    """Input the table cannot be made from; the message names the file (and line)."""


def load(paths: Sequence[str | os.PathLike[str]]) -> list[dict[str, Any]]:
    """The table's rows from JSON-lines files, in order, the last row of a scenario winning.

    Raises:
        TableError: a file cannot be read, a line is not a JSON object, a row with a
            scenario lacks a required field or has a ratio that is not a number, or no file
            has a row with a scenario.
    """
    rows: dict[str, dict[str, Any]] = {}
    for path in paths:
        try:
            with open(path, encoding="utf-8") as f:
                lines = f.read().splitlines()
        except OSError as exc:
            raise TableError(f"{os.fspath(path)}: cannot read: {exc.strerror or exc}") from exc
        except UnicodeDecodeError as exc:
            raise TableError(f"{os.fspath(path)}: not UTF-8 text: {exc.reason}") from exc
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{os.fspath(path)}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TableError(f"{where}: not JSON: {exc.msg} (column {exc.colno})") from None
            if not isinstance(obj, dict):
                raise TableError(f"{where}: expected a JSON object, got {type(obj).__name__}")
            if obj.get("scenario") is None:
                continue
            _check(obj, where)
            rows[str(obj["scenario"])] = obj
    if not rows:
        names = ", ".join(os.fspath(p) for p in paths)
        raise TableError(
            f"{names}: no row with a scenario (kvlink-bench --json writes one for each result "
            "measured against a baseline in the same run, e.g. --compare iperf3)"
        )
    return list(rows.values())


def _check(row: dict[str, Any], where: str) -> None:
    for field in REQUIRED:
        if not isinstance(row.get(field), str) or not row[field].strip():
            raise TableError(f"{where}: scenario {row['scenario']!r} has no {field!r} (a string)")
    ratio = _ratio(row)
    if ratio is not None and (
        isinstance(ratio, bool) or not isinstance(ratio, int | float) or not math.isfinite(ratio)
    ):
        raise TableError(f"{where}: scenario {row['scenario']!r}: ratio {ratio!r} is not a number")


def _ratio(row: dict[str, Any]) -> Any:
    return row["ratio"] if "ratio" in row else row.get("ratio_to_limit")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _code(text: str) -> str:
    text = " ".join(text.split())
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}".replace("|", "\\|")


def _number(x: float) -> str:
    """Three decimals at most, two at least: 0.925, 0.98, 4.00, 0.016."""
    head, _, tail = f"{x:.3f}".partition(".")
    return f"{head}.{tail.rstrip('0').ljust(2, '0')}"


def _figure(row: dict[str, Any]) -> str:
    ratio = _ratio(row)
    if row.get("ratio_text"):
        text = str(row["ratio_text"])
    elif ratio is None:
        text = "unmeasured"
    else:
        text = f"**{_number(ratio)} x**"
    detail = row.get("detail")
    if detail is None and row.get("gbps") is not None and row.get("limit_gbps"):
        detail = f"{row['gbps']:.3f} vs {row['limit_gbps']:.3f} GB/s"
    return _cell(f"{text} ({detail})" if detail else text)


def _target(row: dict[str, Any]) -> str:
    target = str(row.get("target") or "-")
    met = row.get("met")
    if met is True:
        target += ": met"
    elif met is False:
        target += ": **not met**"
    return _cell(target)


def _measured(row: dict[str, Any]) -> str:
    date = str(row.get("date") or "-")
    if "T" in date and date.endswith("Z"):  # kvlink-bench's 2026-12-01T16:25:03Z
        date = date[:16].replace("T", " ") + " UTC"
    commit = row.get("commit")
    if commit:
        head, plus, rest = str(commit).partition("+")
        date += f", {head[:7]}{plus}{rest}"
    return _cell(date)


def render(rows: Sequence[dict[str, Any]]) -> str:
    """The markdown table of ``rows`` (as :func:`load` returns them), ending in a newline."""
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + " --- |" * len(COLUMNS)]
    for r in rows:
        name = _cell(str(r["scenario"]))
        if r.get("section"):
            name = f"[{name}](#{r['section']})"
        cells = (name, _figure(r), _cell(r["baseline"]), _target(r), _measured(r),
                 _code(r["command"]))  # fmt: skip
        out.append("| " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def replace(text: str, table: str, name: str) -> str:
    """``text`` with what lies between the BEGIN and END marker lines replaced by ``table``;
    everything outside the markers is kept exactly.

    Raises:
        TableError: a marker is missing or there twice, or END comes before BEGIN
            (``name`` is the file, for the message).
    """
    for marker in (BEGIN, END):
        count = text.count(marker)
        if count != 1:
            how = "no" if count == 0 else f"{count} times the"
            raise TableError(
                f"{name}: {how} marker {marker!r}: the table goes between one {BEGIN!r} line "
                f"and one {END!r} line"
            )
    start = text.index(BEGIN) + len(BEGIN)
    end = text.index(END)
    if end < start:
        raise TableError(f"{name}: {END!r} comes before {BEGIN!r}")
    return text[:start] + "\n" + table + text[end:]


def write(path: str | os.PathLike[str], table: str) -> None:
    """Replaces the table between the markers in the file at ``path`` (see :func:`replace`).

    Raises:
        TableError: the file cannot be read or written, or its markers are wrong.
    """
    name = os.fspath(path)
    try:
        with open(path, encoding="utf-8", newline="") as f:
            text = f.read()
    except OSError as exc:
        raise TableError(f"{name}: cannot read: {exc.strerror or exc}") from exc
    new = replace(text, table, name)
    try:
        with open(path, "w", encoding="utf-8", newline="") as f:
            f.write(new)
    except OSError as exc:
        raise TableError(f"{name}: cannot write: {exc.strerror or exc}") from exc
