"""How ``kvlink-bench`` shows results: live progress and a table for people, JSON lines for
machines, CSV and a plot on request. Every ``gbps`` is GB/s (1e9 bytes per second)."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import shlex
import shutil
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from .measure import chunk_label, fmt_size

JSON_FIELDS = (
    "tool",
    "op",
    "size_bytes",
    "chunk_bytes",
    "paths",
    "seconds",
    "gbps",
    "first_layer_s",
    "p50_s",
    "p99_s",
    "cpu_s",
    "limit_gbps",
    "ratio_to_limit",
)
# What each row of one run also says, for `kvlink-bench table`: the scenario a row measures
# and the baseline it is a ratio against (both null on rows without a baseline, and on the
# baseline's own row), the command line that ran (with the KVLINK_*/UCX_* settings that
# shape it; never a secret), the UTC start of the run and the git commit of the kvlink
# measured ("+dirty" with uncommitted changes; null outside a git checkout).
RUN_FIELDS = ("scenario", "baseline", "command", "date", "commit")
CSV_EXTRA = ("concurrency", "layers", "cpu_cores", "verified")
PLOT_HINT = "pip install kvlink[plot]"


def plot_unavailable() -> str | None:
    """Why --plot cannot work here (matplotlib missing), or None."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return f"--plot needs matplotlib, which is not installed: {PLOT_HINT}"
    return None


def git_commit(root: str | os.PathLike[str] | None = None) -> str | None:
    """The short commit of the kvlink checkout at ``root`` (default: the one this package is
    in), "+dirty" with uncommitted changes to tracked files; None when it is not a git
    checkout of its own (an installed wheel, inside someone else's repository)."""
    top = Path(root) if root is not None else Path(__file__).resolve().parents[2]

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", "-C", str(top), *args], capture_output=True, text=True,
                                 timeout=10, check=False)  # fmt: skip
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout.strip() if out.returncode == 0 else None

    where = git("rev-parse", "--show-toplevel")
    if where is None or Path(where).resolve() != top.resolve():
        return None
    commit = git("rev-parse", "--short=12", "HEAD")
    if commit is None:
        return None
    dirty = git("status", "--porcelain", "--untracked-files=no")
    return commit + ("+dirty" if dirty else "")


def run_info(prog: str, argv: Sequence[str]) -> dict[str, Any]:
    """``command``, ``date`` and ``commit`` of RUN_FIELDS for a run of ``prog argv``."""
    from .._config import Config

    # the settings that shape a run: Config's KVLINK_* variables and UCX's; never a secret or
    # a credential (nor discovery's endpoints, which may carry one)
    private = ("secret", "password", "user", "discovery")
    tuning = {f"KVLINK_{f.name.upper()}" for f in dataclasses.fields(Config)
              if not any(p in f.name for p in private)}  # fmt: skip
    env = [f"{k}={shlex.quote(v)}" for k, v in sorted(os.environ.items())
           if k in tuning or k.startswith("UCX_")]  # fmt: skip
    return {
        "command": " ".join([*env, shlex.join([prog, *argv])]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": git_commit(),
    }


class Reporter:
    """Results of one ``kvlink-bench`` command; ``json``/``csv``/``plot`` as the flags say."""

    def __init__(self, command: str, json_lines: bool, csv_path: str | None = None,
                 plot_path: str | None = None) -> None:  # fmt: skip
        self.command = command
        self.json = json_lines
        self.csv_path = csv_path
        self.plot_path = plot_path
        self.rows: list[dict[str, Any]] = []
        # RUN_FIELDS: set by the CLI; a result row gets a scenario (scenario_of) and the
        # baseline's name once limit() has reported the baseline
        self.run: dict[str, Any] | None = None
        self.scenario_of: Callable[[dict[str, Any]], str] | None = None
        self.baseline: str | None = None
        self.console: Any = None
        self.bar: Any = None
        self.task: Any = None
        if not json_lines:
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn

            # wide enough for the summary table even when piped
            self.console = Console(width=max(150, shutil.get_terminal_size().columns))
            self.bar = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TextColumn("{task.completed}/{task.total} iterations"),
                console=self.console,
                transient=True,
            )
            self.bar.start()
            self.task = self.bar.add_task("starting", total=1)

    def progress(self, what: str, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=what, completed=done, total=total)

    def note(self, text: str) -> None:
        if self.console is not None:
            self.console.print(text)
        else:
            print(json.dumps({"note": text}), flush=True)

    def limit(self, row: dict[str, Any], baseline: str) -> None:
        """The baseline's own row (e.g. iperf3's); later results are ratios against it."""
        self._emit(row, None)
        self.baseline = baseline

    def result(self, row: dict[str, Any]) -> None:
        scenario = None
        if self.scenario_of and self.baseline and row.get("ratio_to_limit") is not None:
            scenario = self.scenario_of(row)
        self._emit(row, scenario)

    def _emit(self, row: dict[str, Any], scenario: str | None) -> None:
        if self.run is not None:
            row.update(self.run)
            row["scenario"] = scenario
            row["baseline"] = self.baseline if scenario else None
        self.rows.append(row)
        if self.json:
            print(json.dumps(row), flush=True)

    def stop(self) -> None:
        """Stops the progress bar (on error too), so what follows is readable."""
        if self.bar is not None:
            self.bar.stop()

    def finish(self) -> None:
        self.stop()
        if self.console is not None:
            self._table()
        if self.csv_path:
            with open(self.csv_path, "w", newline="") as f:
                w = csv.DictWriter(
                    f,
                    fieldnames=[*JSON_FIELDS, *CSV_EXTRA, *RUN_FIELDS],
                    extrasaction="ignore",
                )
                w.writeheader()
                w.writerows(self.rows)
        if self.plot_path:
            self._plot(self.plot_path)

    def _table(self) -> None:
        from rich.table import Table

        t = Table(title="kvlink-bench (GB/s = 1e9 bytes/s)")
        for col in ("tool", "op", "size", "chunk", "conc", "GB/s", "limit GB/s", "% limit",
                    "first layer", "p50", "p99", "CPU cores", "CPU s/GiB",
                    "per path GB/s"):  # fmt: skip
            t.add_column(col)
        for r in self.rows:
            ratio = r.get("ratio_to_limit")
            t.add_row(
                r["tool"],
                r.get("op", "-"),
                fmt_size(r["size_bytes"]),
                chunk_label(r.get("chunk_bytes")),
                str(r.get("concurrency", 1)),
                f"{r['gbps']:.3f}",
                f"{r['limit_gbps']:.3f}" if r.get("limit_gbps") else "-",
                f"{100 * ratio:.0f}%" if ratio else "-",
                f"{r['first_layer_s'] * 1e3:.1f} ms" if r.get("first_layer_s") else "-",
                f"{r['p50_s'] * 1e3:.1f} ms" if r.get("p50_s") else "-",
                f"{r['p99_s'] * 1e3:.1f} ms" if r.get("p99_s") else "-",
                f"{r['cpu_cores']:.2f}" if r.get("cpu_cores") is not None else "-",
                f"{r['cpu_s_per_gib']:.3f}" if r.get("cpu_s_per_gib") is not None else "-",
                " ".join(f"{v:.2f}" for v in r.get("per_path_gbps", {}).values()) or "-",
            )
        self.console.print(t)

    def _plot(self, path: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = [r for r in self.rows if r["tool"] == "kvlink"]
        by_chunk = (
            len({r["chunk_bytes"] for r in rows}) > 1 and len({r["size_bytes"] for r in rows}) == 1
        )
        key = "chunk_bytes" if by_chunk else "size_bytes"
        fig, ax = plt.subplots(figsize=(8, 4.5))
        groups: dict[Any, list[dict[str, Any]]] = {}
        for r in rows:
            groups.setdefault(r["size_bytes"] if by_chunk else r["chunk_bytes"], []).append(r)
        for g, rs in sorted(groups.items()):
            rs.sort(key=lambda r: r[key])
            ax.plot(
                [r[key] for r in rs],
                [r["gbps"] for r in rs],
                marker="o",
                label=f"kvlink ({'size' if by_chunk else 'chunk'} {chunk_label(g)})",
            )
        limits = [r["limit_gbps"] for r in rows if r.get("limit_gbps")]
        if limits:
            ax.axhline(max(limits), color="grey", linestyle="--", label="iperf3, same paths")
        ax.set_xscale("log", base=2)
        ax.set_ylim(bottom=0)
        ax.set_xlabel("chunk size (bytes)" if by_chunk else "transfer size (bytes)")
        ax.set_ylabel("GB/s (1e9 bytes/s)")
        ax.set_title(
            f"kvlink-bench {self.command}: throughput vs "
            f"{'chunk size' if by_chunk else 'size'} ({time.strftime('%Y-%m-%d')})"
        )
        ax.grid(True, alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        self.note(f"plot written to {path}")


class JsonLinesFile:
    """The ``--json FILE`` of the bench/ scenarios: one object per line, flushed as written;
    without a path, :meth:`emit` does nothing."""

    def __init__(self, path: str | os.PathLike[str] | None) -> None:
        self._f = open(path, "w") if path else None  # noqa: SIM115 (closed in close())

    def emit(self, obj: dict[str, Any]) -> None:
        if self._f is not None:
            self._f.write(json.dumps(obj) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
