"""kvlink from the wheel, in the plain virtualenv `make wheel-venv` made and in the engines'
virtualenvs: the demo, `kvlink doctor` (its "missing" answers included), and no trace of the
checkout in any of them."""

from __future__ import annotations

import ctypes.util
import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import require_tool, unavailable
from tests.install.conftest import OUTSIDE_ENV, ROOT

ENGINE_VENVS = {"vllm": ROOT / ".venv-vllm", "sglang": ROOT / ".venv-sglang"}


def run(venv: Path, *args: str, timeout: float = 120, env: dict[str, str] | None = None,
        prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, str(venv / "bin" / args[0]), *args[1:]], capture_output=True,
                          text=True, timeout=timeout, cwd="/",
                          env={**os.environ, **OUTSIDE_ENV, **(env or {})})


def doctor(venv: Path, *args: str, **kw: Any) -> dict[str, dict[str, Any]]:
    r = run(venv, "kvlink", "doctor", "--json", *args, **kw)
    assert r.returncode == 0, r.stderr[-3000:]
    return {f["name"]: f for f in json.loads(r.stdout)}


def engine_venv(engine: str) -> Path:
    venv = ENGINE_VENVS[engine]
    for name, what in ((".unavailable", "could not be built"),
                       (".wheel-unavailable", "did not take kvlink's wheel")):
        why = venv / name
        if why.exists():
            unavailable(f"the {engine} virtualenv {what}: {why.read_text().strip()}")
    if not (venv / ".kvlink-wheel").exists():
        unavailable(f"{venv} has no kvlink wheel: `make {engine}-venv` installs it")
    return venv


@pytest.mark.timeout(300)
def test_the_demo_runs_from_the_wheel(wheel_venv: Path) -> None:
    r = run(wheel_venv, "kvlink-bench", "demo", timeout=240)
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    assert "0 mismatches" in r.stdout, r.stdout[-3000:]
    assert "verified every byte on the receiver" in r.stdout


def test_doctor_in_a_plain_venv_says_what_is_missing_and_what_to_do(wheel_venv: Path) -> None:
    found = doctor(wheel_venv)
    core = found["core"]
    assert core["status"] == "ok", core
    assert Path(core["data"]["path"]).is_relative_to(wheel_venv), core
    assert core["data"]["abi"] == "abi3"
    build = core["data"]["build"]
    if os.environ.get("KVLINK_REQUIRE_ALL") == "1":  # CI's wheel carries every part
        assert build["ucx"] and build["io_uring"], build
    # the plain venv has no UCX library (kvlink[ucx] not asked for): missing, with the fix
    # (unless the host's own libucp loads)
    if ctypes.util.find_library("ucp") is None:
        assert found["ucx"]["status"] == "missing", found["ucx"]
        assert "pip install 'kvlink[ucx]'" in found["ucx"]["fix"]
    for engine in ("vllm", "sglang"):
        assert found[engine]["status"] == "missing", found[engine]
    assert set(found) == {"core", "ucx", "io_uring", "same_host", "nics", "gpu", "secret",
                          "discovery", "vllm", "sglang"}
    assert all(f["status"] != "error" for f in found.values()), found
    text = run(wheel_venv, "kvlink", "doctor")
    assert text.returncode == 0
    assert text.stdout.splitlines()[0].startswith("ok       core"), text.stdout


def test_doctor_reads_the_cluster_secret_without_showing_it(wheel_venv: Path) -> None:
    secret = "ab" * 32
    found = doctor(wheel_venv, env={"KVLINK_SECRET": secret})
    assert found["secret"]["status"] == "ok"
    assert secret not in json.dumps(found)
    unset = subprocess.run(
        [str(wheel_venv / "bin" / "kvlink"), "doctor", "--json"], capture_output=True, text=True,
        timeout=120, cwd="/",
        env={k: v for k, v in os.environ.items() if not k.startswith("KVLINK_SECRET")})
    assert {f["name"]: f for f in json.loads(unset.stdout)}["secret"]["status"] == "warn"
    bad = doctor(wheel_venv, env={"KVLINK_SECRET": "short"})["secret"]
    assert bad["status"] == "error" and "KVLINK_SECRET" in bad["detail"], bad


@pytest.mark.root
@pytest.mark.parametrize(("scope", "drop_cap", "status"), [
    ("3", False, "missing"),
    ("1", True, "missing"),
    ("1", False, "ok"),  # root keeps CAP_SYS_PTRACE
    ("0", True, "ok"),
])
def test_doctor_on_ptrace_scope(wheel_venv: Path, scope: str, drop_cap: bool,
                                status: str) -> None:
    """Yama's ptrace_scope as the kernel would show it (a private mount namespace with its own
    /proc/sys/kernel, so the host's setting is untouched), with and without CAP_SYS_PTRACE."""
    if os.geteuid() != 0:
        unavailable("needs root (a mount namespace)")
    require_tool("setpriv")
    real = Path("/proc/sys/kernel/yama/ptrace_scope")
    if status == "ok" and drop_cap and real.exists() and real.read_text().strip() != "0":
        # doctor's real probe meets the kernel's own rule, which the mount does not change
        pytest.skip(f"this host's Yama ptrace_scope is {real.read_text().strip()}, not 0")
    cmd = (
        "mount -t tmpfs kvl-doctor /proc/sys/kernel && mkdir /proc/sys/kernel/yama && "
        f"echo {scope} > /proc/sys/kernel/yama/ptrace_scope && exec "
        + ("setpriv --bounding-set -sys_ptrace --inh-caps -sys_ptrace " if drop_cap else "")
        + f"{wheel_venv / 'bin' / 'kvlink'} doctor --json"
    )
    r = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
                       capture_output=True, text=True, timeout=120, cwd="/",
                       env={**os.environ, **OUTSIDE_ENV})
    assert r.returncode == 0, r.stderr[-3000:]
    same = {f["name"]: f for f in json.loads(r.stdout)}["same_host"]
    assert same["data"]["ptrace_scope"] == scope, same
    assert same["status"] == status, same
    if status == "missing":
        assert same["fix"], same
        assert ("reboot" in same["fix"]) == (scope == "3"), same


def test_doctor_asks_the_discovery_etcd(wheel_venv: Path, etcd: Any) -> None:
    found = doctor(wheel_venv, "--discovery", etcd.url())
    assert found["discovery"]["status"] == "ok", found["discovery"]
    assert "etcd 3." in found["discovery"]["detail"]
    dead = doctor(wheel_venv, "--discovery", "etcd://127.0.0.1:1/x")["discovery"]
    assert dead["status"] == "error" and "unreachable" in dead["detail"], dead
    bad = doctor(wheel_venv, "--discovery", "http://x")["discovery"]
    assert bad["status"] == "error" and "unknown scheme" in bad["detail"], bad
    tls = doctor(wheel_venv, "--discovery", "etcds://127.0.0.1:1/x",
                 env={"KVLINK_DISCOVERY_CA_FILE": "/nonexistent"})["discovery"]
    assert tls["status"] == "error" and "KVLINK_DISCOVERY_CA_FILE" in tls["detail"], tls


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_the_engines_venvs_run_the_installed_wheel(engine: str) -> None:
    """kvlink entered the engine's venv as a user installs it: doctor there finds the engine at
    its tested version with kvlink's plugin registered, kvlink in the venv's own
    site-packages, and no path hook naming this checkout."""
    venv = engine_venv(engine)
    found = doctor(venv)
    assert found[engine]["status"] == "ok", found[engine]
    assert found[engine]["data"]["plugin"] is True
    assert Path(found["core"]["data"]["path"]).is_relative_to(venv), found["core"]
    hooks = [p for p in venv.glob("lib/python3*/site-packages/*.pth")
             if str(ROOT / "kvlink") in p.read_text() or p.read_text().strip() == str(ROOT)]
    assert not hooks, f"path hooks to the checkout: {hooks}"
    probe = {
        "vllm": "from kvlink.integrations.vllm import KvlinkConnector, KvlinkStoreConnector",
        "sglang": "import kvlink.integrations.sglang as s; s.register()",
    }[engine]
    r = run(venv, "python", "-c", f"import kvlink.store; {probe}; print('ok')")
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_nothing_in_the_plain_venv_comes_from_the_checkout(wheel_venv: Path) -> None:
    code = ("import sys, kvlink, kvlink.store, kvlink.integrations.vllm, kvlink.testbed; "
            "print('\\n'.join(m.__file__ for n, m in sys.modules.items() "
            "if n.startswith('kvlink') and getattr(m, '__file__', None)))")
    r = run(wheel_venv, "python", "-c", code)
    assert r.returncode == 0, r.stderr[-2000:]
    files = r.stdout.split()
    assert files and all(Path(f).is_relative_to(wheel_venv) for f in files), files
    assert shutil.which("kvlink", path=str(wheel_venv / "bin"))
