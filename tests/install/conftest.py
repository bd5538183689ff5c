"""kvlink as users install it: the sdist and wheel `make wheel` built (dist/), the plain
virtualenv holding nothing but that wheel and its dependencies (`make wheel-venv`:
.venv-wheel), and the engines' virtualenvs the same wheel went into. Every command here runs
from a folder outside the checkout, so nothing of the checkout can stand in for the wheel."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import unavailable

ROOT = Path(__file__).resolve().parents[2]
DIST = ROOT / "dist"
WHEEL_VENV = ROOT / ".venv-wheel"
# no cwd or script folder on sys.path for the children, whatever their cwd
OUTSIDE_ENV = {"PYTHONSAFEPATH": "1"}


def built(pattern: str) -> Path:
    found = sorted(DIST.glob(pattern))
    if not found:
        unavailable(f"no {pattern} in {DIST}: `make wheel` builds it (make test does)")
    return found[-1]


@pytest.fixture(scope="session")
def wheel() -> Path:
    return built("kvlink-*.whl")


@pytest.fixture(scope="session")
def sdist() -> Path:
    return built("kvlink-*.tar.gz")


@pytest.fixture(scope="session")
def wheel_venv() -> Path:
    if not (WHEEL_VENV / ".kvlink-wheel").exists():
        unavailable(f"{WHEEL_VENV} is missing: `make wheel-venv` builds it (make test does)")
    return WHEEL_VENV


def package_files() -> list[str]:
    """Every file of the kvlink package in this checkout that an install must carry, relative
    to the checkout (the built C core and caches aside)."""
    return sorted(
        p.relative_to(ROOT).as_posix()
        for p in (ROOT / "kvlink").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix not in (".so", ".c", ".pyc")
    )
