"""Crash safety of kvlink.store's disk tier (docs/store.md, "On disk"): 10,000 random
put / get / delete / prefetch / pin operations in a child process killed with SIGKILL twice
mid-run, a slot torn between runs as a power cut would, and a restart after each: no wrong
byte is ever served, every torn block is discarded, memory and files stay bounded."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvlink.store._format import PAGE, SLOT_MAGIC
from tests.store_worker import BLOCK_BYTES

ROOT = Path(__file__).resolve().parents[2]
SLOT = PAGE + BLOCK_BYTES


def run_worker(d: Path, ops: int, seed: int, kill_after: int | None, wt: bool) -> dict[str, int]:
    """Runs tests/store_worker.py; SIGKILLs it once it reported ``kill_after`` ops.
    Returns what it said: opened blocks, discarded, ops done, and at a clean end rss/files."""
    cmd = [
        sys.executable,
        "-m",
        "tests.store_worker",
        str(d),
        "--ops",
        str(ops),
        "--seed",
        str(seed),
    ]
    if wt:
        cmd.append("--write-through")
    out: dict[str, int] = {"ops": 0}
    deadline = time.monotonic() + 120
    with subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    ) as p:
        try:
            assert p.stdout is not None and p.stderr is not None
            for line in p.stdout:
                word, *rest = line.split()
                assert word != "WRONG", f"the store served a wrong block: {line}"
                if word == "open":
                    out["blocks"], out["discarded"] = int(rest[0]), int(rest[1])
                elif word == "ops":
                    out["ops"] = int(rest[0])
                    if kill_after is not None and out["ops"] >= kill_after:
                        p.send_signal(signal.SIGKILL)
                        break
                elif word == "done":
                    out["rss_kib"], out["files"] = int(rest[0]), int(rest[1])
                assert time.monotonic() < deadline, "the worker took over 120 s"
            rc = p.wait(timeout=30)
            err = p.stderr.read()
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    if kill_after is None:
        assert rc == 0, err
    else:
        assert rc == -signal.SIGKILL, err
    return out


def tear_one_slot(d: Path) -> bool:
    """Overwrites half the payload of the first slot holding a block, as a write cut by a
    power loss leaves it.  False when no slot holds one."""
    slab = d / "slab-0000.kvl"
    data = slab.read_bytes()
    for off in range(PAGE, len(data), SLOT):
        if data[off : off + 8] == SLOT_MAGIC:
            with open(slab, "r+b") as f:
                f.seek(off + PAGE + BLOCK_BYTES // 2)
                f.write(os.urandom(BLOCK_BYTES // 2))
            return True
    return False


@pytest.mark.timeout(400)
@pytest.mark.parametrize("wt", [False, True], ids=["write-back", "write-through"])
def test_ten_thousand_ops_with_two_kills_serve_no_wrong_byte(tmp_path, wt):
    d = tmp_path / "store"
    done = 0
    first = run_worker(d, 5000, 1, kill_after=3300, wt=wt)
    done += first["ops"]
    assert first["blocks"] == 0
    assert tear_one_slot(d)
    second = run_worker(d, 5000, 2, kill_after=3300, wt=wt)
    done += second["ops"]
    assert second["blocks"] > 0, "the restart found nothing the first run wrote"
    assert second["discarded"] >= 1, "the torn slot was not discarded"
    last = run_worker(d, 10_000 - done, 3, kill_after=None, wt=wt)
    done += last["ops"]
    assert done >= 10_000
    assert last["files"] == 1  # one slab file, nothing else
    assert last["rss_kib"] < 400 * 1024
