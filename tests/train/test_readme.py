"""The large-minibatch recipe page's examples run as written and print what it says they print."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "guide" / "large-batch.md"


def examples() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.S | re.M)


def test_recipe_page_examples_run(tmp_path):
    blocks = examples()
    assert len(blocks) == 4, f"{PAGE} has {len(blocks)} python blocks; this test expects the 4 it checks"
    script = tmp_path / "examples.py"
    script.write_text("\n".join(blocks))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert abs(float(lines[0]) - 0.02) < 1e-12
    assert lines[1] == "[0.1, 1.65, 3.2, 0.32, 0.032, 0.0032]"
    assert lines[2] == "tensor(0.0037)"
