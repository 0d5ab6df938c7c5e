"""The sign kernels' per-bucket scratch is kept per calling thread: repeated calls in a process with
glibc's default malloc settings (a ``torchrun`` script, not a spark-dl rank) take no page faults of
their own, and threads calling at once each get their own."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import torch

from spark_dl.compression import native
from spark_dl.protocol import MALLOC_ENV

# Every call in here writes into outputs allocated once, so the only memory a call could fault in
# is the kernels' own: 2M elements in 64-element buckets are 1 MB of sums a pass (32 bytes a
# bucket), which glibc's defaults mapped and unmapped again on every call.
FAULTS = r"""
import json, resource, sys, torch
from spark_dl import _native as ext
from spark_dl.compression import native

n, b, calls = 2_000_003, 64, 12
native.set_threads(2)
g = torch.randn(n, generator=torch.Generator().manual_seed(0))
e, p = torch.zeros(n), torch.empty(n)
nb = -(-n // b)
means, scales = torch.empty(2 * nb), torch.empty(nb)
bits, out = torch.empty((n + 7) // 8, dtype=torch.uint8), torch.empty(n)
steps = {
    "onebit_encode": lambda: ext.onebit_encode(g.data_ptr(), e.data_ptr(), 0, p.data_ptr(), 0, n, b,
                                               means.data_ptr(), bits.data_ptr(), 2.0),
    "onebit_decode": lambda: ext.onebit_decode(means.data_ptr(), bits.data_ptr(), n, b, out.data_ptr(), 1),
    "scaled_sign_encode": lambda: ext.scaled_sign_encode(g.data_ptr(), e.data_ptr(), 0, p.data_ptr(), n, b,
                                                         bits.data_ptr(), scales.data_ptr(), 2.0),
    "scaled_sign_decode": lambda: ext.scaled_sign_decode(scales.data_ptr(), bits.data_ptr(), n, b,
                                                         out.data_ptr(), 1),
}
faults = {}
for name, step in steps.items():
    for _ in range(3):
        step()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(calls):
        step()
    faults[name] = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
print(json.dumps(faults))
"""


def test_sign_kernels_take_no_page_faults_per_call_under_glibcs_defaults():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    env[MALLOC_ENV] = "0"
    run = subprocess.run([sys.executable, "-c", FAULTS], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    faults = json.loads(run.stdout.strip().splitlines()[-1])
    # before the scratch was kept: 842 a call for each encoder (its two arrays of sums)
    assert all(f < 5 for f in faults.values()), faults


def test_threads_calling_at_once_each_get_their_own_scratch():
    n, b = 300_001, 64
    inputs = [torch.randn(n, generator=torch.Generator().manual_seed(s)) * (s + 1) for s in range(4)]
    want = [native.scaled_sign_encode(x, bucket=b) for x in inputs]
    want_1bit = [native.onebit_encode(x, b)[0] for x in inputs]
    errors: list[str] = []

    def work(i: int) -> None:
        for _ in range(30):
            scales, bits = native.scaled_sign_encode(inputs[i], bucket=b)
            means = native.onebit_encode(inputs[i], b)[0]
            if not (torch.equal(scales, want[i][0]) and torch.equal(bits, want[i][1])
                    and torch.equal(means, want_1bit[i])):
                errors.append(f"thread {i}: another thread's sums")
                return

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


def test_a_call_after_a_larger_one_reuses_the_scratch_and_stays_exact():
    # sizes up and down: a kept block larger than needed, then one grown past it
    for n in (1_000_003, 5_000, 2_000_011, 70):
        x = torch.randn(n, generator=torch.Generator().manual_seed(n))
        scales, _ = native.scaled_sign_encode(x, bucket=64)
        lengths = torch.full((scales.numel(),), 64.0, dtype=torch.float64)
        lengths[-1] = n - 64 * (scales.numel() - 1)
        sums = torch.nn.functional.pad(x.double().abs(), (0, 64 * scales.numel() - n)).view(-1, 64).sum(1)
        assert torch.allclose(scales.double(), sums / lengths, rtol=1e-6)
