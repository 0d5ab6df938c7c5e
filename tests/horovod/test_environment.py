"""What a Horovod script finds around it: horovodrun's environment variables and Horovod's exceptions."""
from __future__ import annotations

import pytest
import spark_dl.horovod as hvd

from spark_dl import HorovodRunner


def horovod_view():
    import os

    import horovod.torch as hvd
    from horovod.common.exceptions import HorovodInternalError

    hvd.init()
    env = {k: os.environ[k] for k in ("HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK", "HOROVOD_LOCAL_SIZE",
                                      "HOROVOD_CROSS_RANK", "HOROVOD_CROSS_SIZE")}
    api = {"HOROVOD_RANK": hvd.rank(), "HOROVOD_SIZE": hvd.size(), "HOROVOD_LOCAL_RANK": hvd.local_rank(),
           "HOROVOD_LOCAL_SIZE": hvd.local_size(), "HOROVOD_CROSS_RANK": hvd.cross_rank(),
           "HOROVOD_CROSS_SIZE": hvd.cross_size()}
    return env, {k: str(v) for k, v in api.items()}, HorovodInternalError is hvd.HorovodInternalError


def test_ranks_have_horovodruns_variables_and_they_agree_with_the_api():
    for env, api, same_class in HorovodRunner(np=-2).run_all(horovod_view):
        assert env == api
        assert same_class
    assert [e["HOROVOD_RANK"] for e, _, _ in HorovodRunner(np=-2).run_all(horovod_view)] == ["0", "1"]


def test_horovods_exceptions_are_there_and_are_runtime_errors():
    assert issubclass(hvd.HorovodInternalError, RuntimeError)
    assert hvd.HostsUpdatedInterrupt(skip_sync=True).skip_sync is True
    with pytest.raises(RuntimeError):
        raise hvd.HorovodInternalError("a peer was lost")


@pytest.mark.parametrize("name", ["HOROVOD_RANK", "HOROVOD_SIZE", "HOROVOD_LOCAL_RANK"])
def test_env_refuses_horovods_placement_variables(name):
    from spark_dl import LaunchRefused

    with pytest.raises(LaunchRefused, match=name):
        HorovodRunner(np=-2, env={name: "3"})
