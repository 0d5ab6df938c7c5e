"""Every on-by-default ``SPARK_DL_*`` switch is turned off by the same values (``protocol.OFF``: 0,
false, no, off, in any case, spaces ignored) and by nothing else."""
from __future__ import annotations

import pytest
import torch

from spark_dl import protocol
from spark_dl.compat import horovod_imports
from spark_dl.compat.horovod import checks, joining
from spark_dl.compression import native
from spark_dl.rank import allocator
from spark_dl.task import zygote
from spark_dl.tracking import settings

SWITCHES = {
    protocol.NATIVE_ENV: lambda env: native.available() and native.enabled(torch.zeros(1)),
    protocol.HVD_CHECKS_ENV: lambda env: checks.enabled(),
    protocol.HVD_JOIN_ENV: lambda env: joining.enabled(),
    protocol.ZYGOTE_ENV: lambda env: zygote.enabled(env),
    protocol.MALLOC_ENV: lambda env: allocator.choice(env) == "reuse",
    protocol.HOROVOD_IMPORTS_ENV: lambda env: horovod_imports.enabled(),
    protocol.TRACKING_ENV: lambda env: not settings.tracking_disabled_by_env(),
}


@pytest.mark.parametrize("name", sorted(SWITCHES))
@pytest.mark.parametrize("value", ["0", "false", "False", "NO", " off "])
def test_each_off_value_turns_each_switch_off(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    assert not SWITCHES[name]({name: value})


@pytest.mark.parametrize("name", sorted(SWITCHES))
@pytest.mark.parametrize("value", [None, "1", "true", "on", "yes"])
def test_unset_or_on_leaves_each_switch_on(monkeypatch, name, value):
    if value is None:
        monkeypatch.delenv(name, raising=False)
    else:
        monkeypatch.setenv(name, value)
    env = {} if value is None else {name: value}
    assert SWITCHES[name](env)

