"""The optional C extension spark_dl._native (native/); all other metadata is in pyproject.toml.

``optional=True``: without a C compiler the package still installs and the compressors use
their torch paths. The module uses only the CPython API (tensors arrive as addresses), so it
does not depend on the torch version.
"""
import sys

from setuptools import Extension, setup

args = ["-O3", "-ffp-contract=off", "-std=c11"]
if sys.platform != "win32":
    # Baseline x86-64 code: AVX2/F16C functions are chosen at run time (native/kernels.c).
    args += ["-pthread", "-fvisibility=hidden"]

setup(
    ext_modules=[
        Extension(
            "spark_dl._native",
            sources=["native/module.c", "native/kernels.c"],
            depends=["native/kernels.h"],
            extra_compile_args=args,
            extra_link_args=["-pthread"] if sys.platform != "win32" else [],
            optional=True,
        )
    ]
)
