"""What `make wheel` built: a wheel holding every module of the checkout, tagged abi3 and
manylinux, and an sdist holding everything a build from it reads; installing that sdist on a
host without a compiler says so in one line."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from tests.install.conftest import OUTSIDE_ENV, ROOT, package_files

# kvlink-0.1.0-cp310-abi3-manylinux_2_34_x86_64.whl: one wheel for CPython 3.10 and newer
WHEEL_TAG = re.compile(r"^kvlink-[^-]+-cp310-abi3-manylinux_\d+_\d+_(x86_64|aarch64)\.whl$")


def test_the_wheel_holds_every_module_of_the_checkout(wheel: Path) -> None:
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [f for f in package_files() if f not in names]
    assert not missing, f"{wheel.name} lacks {missing}"
    # the C core, built for the limited API, and nothing of the build's own leftovers
    assert "kvlink/_kvlink_c.abi3.so" in names
    assert not [n for n in names if n.endswith((".c", ".o"))]
    assert "kvlink/py.typed" in names


def test_the_wheel_is_abi3_and_manylinux(wheel: Path) -> None:
    assert WHEEL_TAG.match(wheel.name), wheel.name
    meta = zipfile.ZipFile(wheel).read(
        next(n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".dist-info/WHEEL"))
    ).decode()
    assert "Root-Is-Purelib: false" in meta
    assert re.search(r"^Tag: cp310-abi3-manylinux_\d+_\d+_", meta, re.M), meta


def test_the_wheel_carries_the_entry_points_engines_look_for(wheel: Path) -> None:
    z = zipfile.ZipFile(wheel)
    eps = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")))
    text = eps.decode()
    for line in ("[vllm.general_plugins]", "[sglang.srt.plugins]", "kvlink = kvlink.cli.main:main",
                 "kvlink-bench = kvlink.cli.bench:main"):
        assert line in text, text


def test_the_sdist_holds_what_a_build_from_it_reads(sdist: Path) -> None:
    with tarfile.open(sdist) as t:
        top = t.getnames()[0].split("/")[0]
        names = {n.removeprefix(top + "/") for n in t.getnames()}
    csrc = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "csrc").rglob("*")
                  if p.is_file())
    need = [*csrc, *package_files(), "pyproject.toml", "setup.py", "MANIFEST.in", "LICENSE",
            "README.md"]
    missing = [f for f in need if f not in names]
    assert not missing, f"{sdist.name} lacks {missing}"
    assert any(n.endswith(".h") for n in names), "no headers in the sdist"


def test_building_the_sdist_without_a_compiler_says_what_to_install(sdist: Path,
                                                                   tmp_path: Path) -> None:
    """pip on a host with no C compiler: one message naming what is missing and what to do,
    not a traceback out of the build script. PATH holds only what pip itself needs."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("pkg-config",):  # anything but a compiler
        found = subprocess.run(["which", tool], capture_output=True, text=True).stdout.strip()
        if found:
            (bindir / tool).symlink_to(found)
    env = {"PATH": str(bindir), "HOME": str(tmp_path), **OUTSIDE_ENV}
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--no-cache-dir", "-w", str(tmp_path / "out"), str(sdist)],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "kvlink: cannot build the C core: no C compiler found" in out, out[-3000:]
    assert "apt-get install gcc" in out
    assert "Traceback" not in out, out[-3000:]


@pytest.mark.timeout(600)
def test_the_sdist_installs_as_a_user_would(sdist: Path, tmp_path: Path) -> None:
    """`pip install kvlink-*.tar.gz` into a fresh virtualenv with pip's build isolation (the
    build's setuptools and cffi from the index, no UCX there): the build says what it left out
    and how to get it, and the installed kvlink works and says the same in `kvlink doctor`."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    # a user's build: no -Werror, and no UCX the build could find (not the host's libucx-dev)
    env = {**os.environ, **OUTSIDE_ENV, "PKG_CONFIG_PATH": str(tmp_path),
           "PKG_CONFIG_LIBDIR": str(tmp_path)}
    env.pop("KVLINK_WERROR", None)
    r = subprocess.run([str(venv / "bin" / "pip"), "install", "-v", str(sdist)],
                       capture_output=True, text=True, timeout=540, env=env, cwd=tmp_path)
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "kvlink: UCX transport: NOT compiled in: UCX headers not found" in out, out[-4000:]
    assert "pip install libucx-cu12" in out
    doctor = subprocess.run([str(venv / "bin" / "kvlink"), "doctor", "--json"],
                            capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert doctor.returncode == 0, doctor.stderr
    found = {f["name"]: f for f in json.loads(doctor.stdout)}
    core = found["core"]
    assert core["status"] == "ok"
    assert Path(core["data"]["path"]).is_relative_to(venv)
    assert core["data"]["build"]["werror"] is False
    assert core["data"]["build"]["ucx"] is False
    assert found["ucx"]["status"] == "missing"
    assert "libucx-cu12" in found["ucx"]["fix"]


def _other_cpythons() -> list[Path]:
    """CPython 3.10+ interpreters on this host other than the one running the tests: pyenv's
    and python3.X on PATH, the oldest and the newest."""
    found: dict[tuple[int, int], Path] = {}
    here = sys.version_info[:2]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    cands = [*pyenv.glob("3.*/bin/python3"), *(Path(d) / f"python3.{m}"
             for d in os.environ.get("PATH", "").split(os.pathsep) for m in range(10, 20))]
    for exe in cands:
        if not exe.is_file():
            continue
        r = subprocess.run([str(exe), "-c", "import sys; print(*sys.version_info[:2])"],
                           capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            continue
        ver = tuple(int(x) for x in r.stdout.split())
        gil = subprocess.run([str(exe), "-c", "import sysconfig; "
                              "print(sysconfig.get_config_var('Py_GIL_DISABLED') or 0)"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        # free-threaded builds take no abi3 wheels
        if ver >= (3, 10) and ver != here and len(ver) == 2 and gil in ("0", "None"):
            found.setdefault((ver[0], ver[1]), exe)
    picked = sorted(found)
    return [found[v] for v in dict.fromkeys([picked[0], picked[-1]])] if picked else []


# loads the wheel's C core alone (kvlink's package __init__ needs numpy and more) and runs it
ABI3_PROBE = """
import importlib.util, sys, types
pkg = types.ModuleType("kvlink"); pkg.__path__ = [sys.argv[1]]; sys.modules["kvlink"] = pkg
so = sys.argv[1] + "/_kvlink_c.abi3.so"
spec = importlib.util.spec_from_file_location("kvlink._kvlink_c", so)
mod = importlib.util.module_from_spec(spec); spec.loader.exec_module(mod)
print(hex(mod.lib.kvl_crc32c(0, b"123456789", 9)))
"""


@pytest.mark.timeout(600)
def test_one_wheel_serves_other_cpythons(wheel: Path, tmp_path: Path) -> None:
    """abi3: the same wheel installs into CPython 3.10 and the newest CPython here, and its C
    core loads and computes there (crc32c's check value)."""
    others = _other_cpythons()
    if not others:
        pytest.skip("no other CPython 3.10+ on this host to install the wheel into")
    for exe in others:
        ver = subprocess.run([str(exe), "-c", "import sys; print('%d%d' % sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
        venv = tmp_path / f"py{ver}"
        made = subprocess.run([str(exe), "-m", "venv", str(venv)], capture_output=True,
                              text=True, timeout=120)
        if made.returncode != 0:  # e.g. Debian's python3.X without its -venv package
            continue
        pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
        r = subprocess.run([*pip, "--no-deps", str(wheel)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, (exe, r.stderr[-2000:])
        r = subprocess.run([*pip, "cffi>=1.16"], capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, (exe, r.stderr[-2000:])
        site = subprocess.run([str(venv / "bin" / "python"), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['platlib'])"],
                              capture_output=True, text=True, timeout=60).stdout.strip()
        r = subprocess.run([str(venv / "bin" / "python"), "-c", ABI3_PROBE, f"{site}/kvlink"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path,
                           env={**os.environ, **OUTSIDE_ENV})
        assert r.returncode == 0 and r.stdout.strip() == "0xe3069283", (exe, r.stderr[-2000:])


def test_a_build_without_liburing_headers_says_what_it_leaves_out(tmp_path: Path) -> None:
    """The build script's probes with a compiler that sees no system headers (-nostdinc): no
    liburing.h, so the build says io_uring is left out and what to install."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc (its -nostdinc)")
    code = f"import runpy; runpy.run_path({str(ROOT / 'kvlink' / '_ffi_build.py')!r})"
    env = {**os.environ, "CC": "gcc -nostdinc", "KVLINK_BUILD_UCX": "0"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env=env, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    assert ("kvlink: io_uring disk I/O: NOT compiled in: liburing headers not found: the "
            "store's disk tier will use a thread pool") in r.stderr, r.stderr
    assert "apt-get install liburing-dev" in r.stderr
    assert "kvlink: UCX transport: NOT compiled in" in r.stderr
