"""``scripts/horovod_conformance.py`` on a small test file written like Horovod's: the counts, a
failure on one rank, a hang that costs one test (the launch resumes with the rest), and the
names Horovod's ``common.py`` imports from its launcher."""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

FAKE_SUITE = '''
import time
import unittest

import mock
import torch
import horovod.torch as hvd
from horovod.runner.util.threads import in_thread


class FakeTests(unittest.TestCase):
    def tearDown(self):
        if hvd.is_initialized():
            hvd.barrier()
            hvd.shutdown()

    def test_passes(self):
        hvd.init()
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()
        assert mock.patch is not None
        in_thread(lambda: None).join()

    def test_fails_on_one_rank(self):
        hvd.init()
        assert hvd.rank() == 0, "rank 1 disagrees"

    def test_hangs(self):
        hvd.init()
        if hvd.rank() == 0:
            time.sleep(120)

    def test_after_the_hang(self):
        hvd.init()
        assert hvd.allreduce(torch.ones(1), op=hvd.Sum).item() == hvd.size()

    def test_skips(self):
        self.skipTest("not here")
'''


def test_counts_failures_and_resumes_after_a_hang(tmp_path):
    (tmp_path / "test_fake.py").write_text(FAKE_SUITE)
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "horovod_conformance.py"), "--suite", str(tmp_path),
         "--files", "test_fake.py", "--np", "2", "--timeout", "15", "--json", str(tmp_path / "out.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "5 tests on 2 ranks (each file in one launch" in out.stdout
    assert "2 passed, 1 skipped, 1 failed, 1 hung" in out.stdout
    outcomes = {t.split("::")[-1]: v["outcome"] for t, v in json.loads((tmp_path / "out.json").read_text()).items()}
    assert outcomes == {"test_passes": "passed", "test_fails_on_one_rank": "failed", "test_hangs": "hung",
                        "test_after_the_hang": "passed", "test_skips": "skipped"}
    assert "rank 1 disagrees" in out.stdout
