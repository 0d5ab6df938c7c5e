"""An install without a C compiler: pip still succeeds, no ``spark_dl._native`` is built, and the
compressors fall back to their torch paths with the same results as ``SPARK_DL_NATIVE=0`` here.

The project is copied to a temporary directory (so the repo gets no ``build/``) and installed
with ``pip install --target`` while CC/CXX/LDSHARED name a compiler that logs its arguments and
fails. The fallback install is then imported in a fresh interpreter. That interpreter must not
see the repo's editable install: its finder (``__editable___spark_dl_*_finder``, appended to
``sys.meta_path`` by a .pth file) resolves any *missing* direct child of ``spark_dl`` from
/work/main/spark_dl, so ``import spark_dl._native`` would pick up the repo's built .so even with
the fallback ``spark_dl`` first on PYTHONPATH. The child drops that finder before importing.
"""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import spark_dl
from spark_dl.compression import native

ROOT = pathlib.Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="CC/LDSHARED are not how MSVC builds run")

# The compressors' work, run in the fallback interpreter and here (the same source in both).
WORKLOAD = textwrap.dedent(
    """
    import torch
    import spark_dl.compression as C


    def workload(g1, g2):
        out = {}
        fp = C.FP16()
        p = fp.compress(g1)
        out["fp16"] = [*p.tensors, fp.decompress(p)]
        tk = C.TopK(0.01)
        p = tk.compress(g1)
        values, idx = p.tensors
        order = idx.argsort()
        out["topk"] = [values[order], idx[order], tk.decompress(p)]
        for name, c in [("onebit", C.OneBit(1024)), ("efsign", C.EFSign())]:
            for step, g in enumerate([g1, g2]):  # the second step carries the first's residual
                p = c.compress(g, key="w")
                out[f"{name}{step}"] = [*p.tensors, c.decompress(p), c.residuals.memory["w"].clone()]
        q = C.QSGD(seed=0)
        for step, g in enumerate([g1, g2]):  # the call counter moves the noise stream
            p = q.compress(g)
            acc = torch.ones(g.numel())
            q.decompress_into(p, acc, accumulate=True)  # the collectives' path
            out[f"qsgd{step}"] = [*p.tensors, q.decompress(p), acc]
        return out
    """
)

CHILD = textwrap.dedent(
    """
    import pathlib, sys

    # Drop the repo's editable-install finder (see the module docstring of test_fallback.py).
    sys.meta_path[:] = [f for f in sys.meta_path
                        if not getattr(f, "__module__", "").startswith("__editable__")]
    site, io = pathlib.Path(sys.argv[1]).resolve(), pathlib.Path(sys.argv[2])

    import torch
    import spark_dl
    from spark_dl.compression import native

    torch.set_num_threads(int(sys.argv[3]))  # the parent's: same reduction order in torch's sums
    exec((io / "workload.py").read_text())
    g1, g2 = torch.load(io / "inputs.pt")
    out = workload(g1, g2)
    x = torch.zeros(1)
    out["state"] = {
        "available": native.available(),
        "enabled": native.enabled(x),
        "features": native.features(),
        "modules": {name: str(getattr(m, "__file__", None)) for name, m in sys.modules.items()
                    if name == "spark_dl" or name.startswith("spark_dl.")},
        "site": str(site),
    }
    torch.save(out, io / "outputs.pt")
    """
)


@pytest.fixture(scope="module")
def fallback_install(tmp_path_factory):
    """(install dir, pip's CompletedProcess, the fake compiler's log) of a compiler-less install."""
    tmp = tmp_path_factory.mktemp("fallback")
    src, site = tmp / "src", tmp / "site"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(ROOT / name, src / name)
    junk = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o", "*.egg-info", "build")
    shutil.copytree(ROOT / "native", src / "native", ignore=junk)
    shutil.copytree(ROOT / "spark_dl", src / "spark_dl", ignore=junk)  # without the repo's _native*.so

    log = tmp / "cc.log"
    cc = tmp / "no-cc"
    cc.write_text(f'#!/bin/sh\necho "$0 $*" >> "{log}"\necho "no C compiler here" >&2\nexit 1\n')
    cc.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(CC=str(cc), CXX=str(cc), LDSHARED=f"{cc} -shared", PIP_DISABLE_PIP_VERSION_CHECK="1",
               PIP_NO_INPUT="1", PIP_CONFIG_FILE=os.devnull)
    run = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-v", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(site), str(src)],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=300,
    )
    return site, run, log


def test_install_without_a_compiler_succeeds_without_the_extension(fallback_install):
    site, run, log = fallback_install
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
    # The build did try the compiler (so the extension was attempted, and its failure tolerated) ...
    assert log.exists(), "setuptools never invoked CC: " + run.stdout[-4000:]
    assert "native/" in log.read_text()
    # ... and installed the pure-Python package with no extension module.
    assert (site / "spark_dl" / "compression" / "native.py").is_file()
    assert (site / "spark_dl" / "compression" / "sign.py").is_file()
    assert not list(site.rglob("_native*")), list(site.rglob("_native*"))
    assert not list(site.rglob("*.so")), list(site.rglob("*.so"))


def test_fallback_install_compressors_use_the_torch_paths(fallback_install, tmp_path, monkeypatch):
    site, run, _ = fallback_install
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-6000:]
    gen = torch.Generator().manual_seed(0)
    g1 = torch.randn(97, 103, generator=gen)  # 9991 elements: not a byte, bucket or SIMD multiple
    g2 = torch.randn(97, 103, generator=gen)
    torch.save([g1, g2], tmp_path / "inputs.pt")
    (tmp_path / "workload.py").write_text(WORKLOAD)
    (tmp_path / "child.py").write_text(CHILD)

    env = {k: v for k, v in os.environ.items() if not k.startswith("SPARK_DL_NATIVE")}
    env["PYTHONPATH"] = str(site)
    child = subprocess.run(
        [sys.executable, str(tmp_path / "child.py"), str(site), str(tmp_path), str(torch.get_num_threads())],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    assert child.returncode == 0, child.stdout[-4000:] + child.stderr[-4000:]
    got = torch.load(tmp_path / "outputs.pt")

    state = got.pop("state")
    # Every spark_dl module came from the fallback install, none from the repo.
    assert state["modules"] and "spark_dl._native" not in state["modules"], state["modules"]
    for name, file in state["modules"].items():
        assert file.startswith(state["site"] + os.sep), (name, file)
    assert state["available"] is False and state["enabled"] is False and state["features"] == "none"

    scope: dict = {}
    exec(WORKLOAD, scope)
    monkeypatch.setenv("SPARK_DL_NATIVE", "0")
    ref = scope["workload"](g1, g2)  # this process's torch paths (the extension is here, switched off)
    monkeypatch.delenv("SPARK_DL_NATIVE")
    fast = scope["workload"](g1, g2)  # and its native kernels

    assert got.keys() == ref.keys()
    for key in ref:
        assert len(got[key]) == len(ref[key]), key
        for i, (a, b) in enumerate(zip(got[key], ref[key])):
            assert a.dtype == b.dtype and a.shape == b.shape, (key, i, a.dtype, b.dtype, a.shape, b.shape)
            if a.dtype.is_floating_point:
                # float results agree to rounding (the same torch code; sums may be ordered apart)
                assert torch.allclose(a, b, rtol=1e-5, atol=1e-6), (key, i)
            else:  # bits, codes, indices: the same torch code on the same input
                assert torch.equal(a, b), (key, i)
    # Exact where the torch path is deterministic by construction.
    for a, b in zip(got["fp16"], ref["fp16"]):
        assert torch.equal(a, b)
    for a, b in zip(got["topk"], ref["topk"]):
        assert torch.equal(a, b)

    # And what the fallback gives is what the native kernels give where those are exact.
    for a, b in zip(got["fp16"], fast["fp16"]):
        assert torch.equal(a, b)  # round to nearest even in both
    for a, b in zip(got["topk"], fast["topk"]):
        assert torch.equal(a, b)  # the same k entries (random floats: no ties at the cut)
    assert torch.equal(got["onebit0"][1], fast["onebit0"][1])  # sign bits of the first step
    assert torch.equal(got["efsign0"][1], fast["efsign0"][1])


def test_the_main_install_has_the_extension():
    # The repo's (editable) install is what these tests run against, with the kernels built.
    assert pathlib.Path(spark_dl.__file__).resolve().parent == ROOT / "spark_dl"
    assert native.available(), "spark_dl._native did not import: build it with pip install -e ."
    # the package's own build, not a .so found some other way
    assert pathlib.Path(native._ext.__file__).resolve().parent == pathlib.Path(spark_dl.__file__).resolve().parent
    assert native.features() in ("avx2 f16c", "avx2", "scalar")
