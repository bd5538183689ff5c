"""Builds kvlink's C core through cffi (metadata lives in pyproject.toml)."""

from setuptools import setup

setup(cffi_modules=["kvlink/_ffi_build.py:ffibuilder"])
