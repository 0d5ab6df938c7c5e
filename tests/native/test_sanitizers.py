"""kernels.c under AddressSanitizer and UBSan: every kernel on edge sizes, SIMD and scalar,
one and two threads (native/sanitize_driver.c). Any report fails the run."""
from __future__ import annotations

import pathlib
import subprocess

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "native" / "check_sanitizers.sh"


def test_kernels_are_clean_under_asan_and_ubsan(tmp_path):
    run = subprocess.run(["sh", str(SCRIPT), str(tmp_path)], capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.startswith("ok: 0 failed checks"), run.stdout
