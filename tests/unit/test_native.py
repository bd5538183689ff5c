"""The native boundary: Python's enums match the C header, and nothing above
kvlink/_native.py touches the compiled library."""

from __future__ import annotations

import re
from enum import IntEnum
from pathlib import Path

import pytest

import kvlink
from kvlink import _native

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "csrc" / "include" / "kvlink.h"


def header_enum(c_name: str) -> dict[str, int]:
    """NAME -> value of ``typedef enum c_name { ... }`` in kvlink.h."""
    text = re.sub(r"/\*.*?\*/", "", HEADER.read_text(), flags=re.S)
    m = re.search(rf"typedef enum {c_name} \{{(.*?)\}}", text, flags=re.S)
    assert m, f"enum {c_name} is not in {HEADER}"
    out = {}
    for item in m.group(1).split(","):
        if item.strip():
            name, value = (s.strip() for s in item.split("="))
            out[name] = int(value, 0)
    return out


@pytest.mark.parametrize(
    "c_name,prefix,py_enum",
    [
        ("kvl_err", "KVL_ERR_", kvlink.ErrorCode),
        ("kvl_op", "KVL_OP_", kvlink.Op),
        ("kvl_xfer_state", "KVL_XFER_", kvlink.TransferState),
        ("kvl_path_state", "KVL_PATH_", kvlink.PathState),
        ("kvl_mem", "KVL_MEM_", kvlink.MemoryType),
    ],
)
def test_enums_match_the_header(c_name: str, prefix: str, py_enum: type[IntEnum]) -> None:
    in_c = {
        ("OK" if name == "KVL_OK" else name.removeprefix(prefix)): value
        for name, value in header_enum(c_name).items()
    }
    in_py = {e.name: int(e.value) for e in py_enum}
    assert in_py == in_c, f"{py_enum.__name__} drifted from {c_name} in kvlink.h"


def test_rights_bits_come_from_the_header() -> None:
    bits = header_enum("kvl_rights")
    assert bits["KVL_LOCAL_READONLY"] == _native.lib.KVL_LOCAL_READONLY
    assert bits["KVL_REMOTE_READ"] == _native.lib.KVL_REMOTE_READ
    assert bits["KVL_REMOTE_WRITE"] == _native.lib.KVL_REMOTE_WRITE


def test_only_the_binding_touches_the_compiled_library() -> None:
    offenders = [
        f"{path.relative_to(ROOT)}:{n}"
        for path in sorted((ROOT / "kvlink").rglob("*.py"))
        if path.name not in ("_native.py", "_ffi_build.py")
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if re.search(r"\blib\.kvl_|\bffi\.|_kvlink_c\b", line)
    ]
    assert offenders == [], "call the C core through kvlink._native only"


def test_unknown_code_from_the_core_is_a_kvlink_error() -> None:
    with pytest.raises(kvlink.KvlinkError):
        _native.check(9999)
