"""Makes this checkout of kvlink installed in another virtualenv the way ``pip install -e .``
would, without building the C core a second time (the abi3 one ``make build`` made serves every
venv): a ``.pth`` naming the checkout, a ``kvlink-checkout`` dist-info carrying pyproject.toml's
entry points (the ``vllm.general_plugins`` and ``sglang.srt.plugins`` groups: the frameworks
find kvlink's plugins through them) and pyproject.toml's console scripts in the venv's ``bin/``
(``kvlink``, ``kvlink-bench``). Idempotent: run it again after pyproject.toml changed.
``pip uninstall kvlink-checkout`` removes what it wrote (RECORD lists it).

    VENV/bin/python tests/link_checkout.py VENV

Run it with the venv's own Python (its site-packages is where the files go). Standard library
only (and pip's tomli on Python 3.10).
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import sys
import sysconfig
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the copy pip carries
    from pip._vendor import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """#!{python}
# kvlink's console script, written by tests/link_checkout.py (as pip writes one)
import sys
from {module} import {func}
if __name__ == "__main__":
    sys.exit({func}())
"""


def _record_line(path: Path, site: Path) -> str:
    data = path.read_bytes()
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    try:
        name = path.relative_to(site).as_posix()
    except ValueError:  # bin/: RECORD names it relative to site-packages, as pip does
        name = Path("..", "..", "..", path.relative_to(site.parents[2])).as_posix()
    return f"{name},sha256={digest},{len(data)}"


def link(venv: Path) -> list[Path]:
    """Writes the .pth, the dist-info and the console scripts into ``venv``; returns them."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    site = Path(sysconfig.get_paths()["purelib"])
    bindir = venv / "bin"
    python = bindir / "python"
    written: list[Path] = []

    pth = site / "kvlink-checkout.pth"
    pth.write_text(f"{ROOT}\n")
    written.append(pth)

    # Named kvlink-checkout, not kvlink: run from the checkout (python -m puts the working
    # directory first on sys.path), importlib.metadata finds the main venv's kvlink.egg-info
    # there first and, by name, would hide a "kvlink" distribution's entry points behind its
    # (perhaps older) ones; under another name both are seen (vLLM loads a plugin name once).
    for old in [*site.glob("kvlink-*.dist-info"), *site.glob("kvlink_checkout-*.dist-info")]:
        shutil.rmtree(old)  # an older version's, or this one's again
    info = site / f"kvlink_checkout-{project['version']}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: kvlink-checkout\nVersion: {project['version']}\n"
        f"Summary: {project.get('description', '')} (this checkout, linked)\n"
    )
    (info / "INSTALLER").write_text("kvlink tests/link_checkout.py\n")
    (info / "direct_url.json").write_text(
        json.dumps({"url": ROOT.as_uri(), "dir_info": {"editable": True}})
    )
    groups = {"console_scripts": project.get("scripts", {}), **project.get("entry-points", {})}
    (info / "entry_points.txt").write_text(
        "".join(
            f"[{group}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
            for group, eps in groups.items()
        )
    )
    written += [info / n for n in ("METADATA", "INSTALLER", "direct_url.json", "entry_points.txt")]

    for name, target in project.get("scripts", {}).items():
        module, func = target.split(":")
        script = bindir / name
        script.write_text(SCRIPT.format(python=python, module=module, func=func))
        script.chmod(0o755)
        written.append(script)

    lines = [_record_line(p, site) for p in written]
    (info / "RECORD").write_text("\n".join([*lines, f"{info.name}/RECORD,,"]) + "\n")
    return written


def main() -> int:
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    venv = Path(sys.argv[1]).resolve()
    if Path(sys.prefix).resolve() != venv:
        print(f"link_checkout: run it with {venv}/bin/python (this is {sys.prefix})",
              file=sys.stderr)
        return 2
    for p in link(venv):
        print(f"link_checkout: wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
