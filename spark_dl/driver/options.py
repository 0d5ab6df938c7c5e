"""The runner's options, checked before anything starts: seconds, the ranks' environment."""
from __future__ import annotations

from typing import Any, Mapping

from spark_dl import protocol
from spark_dl.errors import LaunchRefused, in_range

START_TIMEOUT_S = 300.0
ELASTIC_SETTLE_S = 5.0  # min_np: how long a restart waits for all np slots before taking fewer
NODES = ("hosts", "tasks")


def seconds(name: str, value: Any, unset: str = "") -> float:
    """``value`` as seconds: a finite number > 0 (numpy's included; ``inf``, ``nan``, bools and text
    refused, as the runners' ``--run-timeout``/``--start-timeout`` refuse them). ``unset``: what
    None means for ``name``, said in the refusal."""
    if not in_range(value, low=0, low_open=True):
        raise LaunchRefused(f"{name} must be a number of seconds > 0, got {value!r}: pass a finite one such as "
                            f"{SECONDS_EXAMPLE.get(name, 60)}{f', or None for {unset}' if unset else ''}")
    return float(value)


SECONDS_EXAMPLE = {"start_timeout": 300, "run_timeout": 3600, "grow_interval": 60}


def rank_env(env: Mapping[str, str] | None) -> dict[str, str]:
    """``env=`` checked: string names and values that the OS accepts, none of spark-dl's own."""
    if env is None:
        return {}
    if not isinstance(env, Mapping):
        raise LaunchRefused(f"env must be a dict of environment variables (str -> str), got {type(env).__name__}")
    out: dict[str, str] = {}
    for key, value in env.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key:
            raise LaunchRefused(f"env: {key!r} is not an environment variable name (a non-empty str without '=')")
        if not isinstance(value, str) or "\0" in value:
            raise LaunchRefused(
                f"env[{key!r}] must be a str without NUL characters, got {value!r} ({type(value).__name__}): "
                f"write env={{{key!r}: {str(value)!r}}}"
            )
        if key in protocol.RESERVED_ENV:
            raise LaunchRefused(
                f"env sets {key}, which spark-dl sets in every rank itself (its place in the world or the run's "
                f"plumbing); remove it. Variables spark-dl sets: {', '.join(sorted(protocol.RESERVED_ENV))}"
            )
        out[key] = value
    return out
