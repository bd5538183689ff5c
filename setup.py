"""Builds kvlink's C core through cffi (metadata lives in pyproject.toml).

The extension uses only CPython's limited API (cffi builds it so: ``_kvlink_c.abi3.so``), so
the wheel is tagged abi3 for CPython 3.10 and newer: one wheel serves every such interpreter.
"""

from setuptools import setup

setup(
    cffi_modules=["kvlink/_ffi_build.py:ffibuilder"],
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
