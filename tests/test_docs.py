"""The documentation site builds with no warnings: every page in the navigation, every link and anchor
between pages resolving, every API reference entry found (mkdocs.yml, docs/)."""
from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_docs_build_strict(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
