"""Times the phases of `make test`: ``start FILE`` notes when the whole run began; ``run FILE
LABEL -- COMMAND...`` runs COMMAND, appends ``LABEL<TAB>seconds<TAB>exit status`` to FILE and
exits with COMMAND's status; ``report FILE`` prints the phases, their sum and the wall-clock
time since ``start`` (less than the sum where phases ran side by side). Standard library only
(it runs before any virtualenv exists).
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path


def run(times: Path, label: str, cmd: list[str]) -> int:
    t0 = time.monotonic()
    rc = subprocess.call(cmd)
    with times.open("a") as f:
        f.write(f"{label}\t{time.monotonic() - t0:.0f}\t{rc}\n")
    return rc


def report(times: Path) -> int:
    if not times.exists():
        print(f"no phase times in {times}")
        return 0
    rows = [line.split("\t") for line in times.read_text().splitlines() if line]
    started = [float(s) for label, s, rc in rows if rc == "start"]
    rows = [r for r in rows if r[2] != "start"]
    # a phase's parts ("part": pytest's suites) come before the phase's own line
    total = sum(float(s) for _, s, rc in rows if rc != "part")
    print("\nmake test, per phase:")
    parts: list[list[str]] = []
    for label, s, rc in rows:
        if rc == "part":
            parts.append([label, s])
            continue
        print(f"  {label:<34} {float(s) / 60:6.1f} min{'' if rc == '0' else f'  (exit {rc})'}")
        for plabel, ps in parts:
            print(f"    {plabel:<32} {float(ps) / 60:6.1f} min")
        parts = []
    print(f"  {'sum of the phases':<34} {total / 60:6.1f} min")
    if started:
        print(f"  {'wall clock (phases side by side)':<34} "
              f"{(time.time() - started[0]) / 60:6.1f} min")
    return 0


def start(times: Path) -> int:
    with times.open("a") as f:
        f.write(f"start\t{time.time():.0f}\tstart\n")
    return 0


def main(argv: list[str]) -> int:
    if len(argv) >= 5 and argv[0] == "run" and argv[3] == "--":
        return run(Path(argv[1]), argv[2], argv[4:])
    if len(argv) == 2 and argv[0] == "report":
        return report(Path(argv[1]))
    if len(argv) == 2 and argv[0] == "start":
        return start(Path(argv[1]))
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
