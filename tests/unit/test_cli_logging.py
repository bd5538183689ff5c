"""Every `kvlink` and `kvlink-bench` command sends kvlink's log records to stderr at the level
its --log-level names (the library itself only has a NullHandler: without this a command's
records vanish, as `kvlink relay`'s refusals once did)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.test_relay import OTHER, SECRET, _ask

BIN = Path(sys.executable).parent
SETUP_LINE = "kvlink's records at DEBUG and above go to stderr"
# each command, run so that it ends at once (a closed port, a missing file, a tiny job) after
# its logging is set up
COMMANDS = {
    "kvlink doctor": ["kvlink", "doctor"],
    "kvlink paths": ["kvlink", "paths", "127.0.0.1:1"],
    "kvlink top": ["kvlink", "top", "127.0.0.1:1", "--once"],
    "kvlink trace": ["kvlink", "trace", "127.0.0.1:1"],
    "kvlink testbed": ["kvlink", "testbed", "status", "--tag", "kvlnolog"],
    "kvlink bench": ["kvlink", "bench", "table", "/nonexistent.json"],
    "kvlink-bench": ["kvlink-bench", "table", "/nonexistent.json"],
    "kvlink-bench demo": ["kvlink-bench", "demo", "--paths", "1", "--layers", "2", "--blocks",
                          "4", "--block-kib", "4"],
}


def run(argv: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / argv[0]), *argv[1:]], capture_output=True, text=True,
                          timeout=timeout, env={k: v for k, v in os.environ.items()
                                                if not k.startswith("KVLINK_SECRET")})


@pytest.mark.parametrize("name", list(COMMANDS))
def test_log_level_sends_kvlink_records_to_stderr(name: str) -> None:
    debug = run([*COMMANDS[name], "--log-level", "debug"])
    assert SETUP_LINE in debug.stderr, (debug.returncode, debug.stderr[-2000:])
    assert f"DEBUG kvlink: {name}:" in debug.stderr, debug.stderr[-2000:]
    quiet = run([*COMMANDS[name], "--log-level", "error"])
    assert " DEBUG " not in quiet.stderr and " INFO " not in quiet.stderr, quiet.stderr[-2000:]
    assert quiet.returncode == debug.returncode


def test_the_demo_logs_its_agents_records() -> None:
    r = run([*COMMANDS["kvlink-bench demo"], "--log-level", "info"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "INFO kvlink: agent prefill-0 listening on" in r.stderr, r.stderr[-2000:]
    assert SETUP_LINE not in r.stderr  # a DEBUG record, below info


def test_a_bad_log_level_is_a_usage_error() -> None:
    r = run(["kvlink", "doctor", "--log-level", "loud"])
    assert r.returncode == 2
    assert "--log-level: invalid choice: 'loud'" in r.stderr


def test_the_relay_daemon_logs_what_it_refuses(tmp_path: Path) -> None:
    """`kvlink relay` logs at INFO by default: a request under a wrong secret is refused and
    said on stderr (at most once a second), as docs/security.md promises."""
    md = tmp_path / "relay.json"
    err = (tmp_path / "relay.err").open("w")
    proc = subprocess.Popen(
        [str(BIN / "kvlink"), "relay", "--name", "r-log", "--nics", "127.0.0.3",
         "--metadata-out", str(md)],
        stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "KVLINK_SECRET": SECRET},
    )
    try:
        deadline = time.monotonic() + 60
        while not md.exists() and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "relay.err").read_text()
            time.sleep(0.1)
        assert md.exists(), (tmp_path / "relay.err").read_text()
        port = json.loads(md.read_text())["relay"][0][1]
        status, _ = _ask(port, ("127.0.0.3", 9), OTHER)
        assert status == 1
        text = ""
        while "refused" not in text and time.monotonic() < deadline:
            time.sleep(0.1)
            text = (tmp_path / "relay.err").read_text()
        assert "kvlink" in text and "refused a request claiming to be 'test'" in text, text
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        finally:
            proc.kill()
            err.close()


def test_log_level_before_the_demo_reaches_it() -> None:
    """`kvlink-bench --log-level debug demo ...`: the level given before the command counts."""
    demo = COMMANDS["kvlink-bench demo"]
    r = run([demo[0], "--log-level", "debug", *demo[1:]])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "DEBUG kvlink: kvlink-bench demo:" in r.stderr, r.stderr[-2000:]
