"""The README section's examples run as written and print what it says they print."""
from __future__ import annotations

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
HEADING = "## The large-minibatch recipe"


def section() -> str:
    text = (ROOT / "README.md").read_text()
    assert HEADING in text, f"no '{HEADING}' section in README.md"
    return re.split(r"\n## ", text.split(HEADING, 1)[1], maxsplit=1)[0]


def test_readme_examples_run(tmp_path):
    code = "\n".join(re.findall(r"```python\n(.*?)```", section(), re.S))
    script = tmp_path / "examples.py"
    script.write_text(code)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=240, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")
    assert abs(float(lines[0]) - 0.02) < 1e-12
    assert lines[1] == "[0.1, 1.65, 3.2, 0.32, 0.032, 0.0032]"
    assert lines[2] == "tensor(0.0037)"
