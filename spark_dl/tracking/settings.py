"""Tracking settings read from the environment, on the driver and in ranks alike."""
from __future__ import annotations

import os

from spark_dl import protocol


def tracking_disabled_by_env() -> bool:
    """``SPARK_DL_TRACKING=0`` (or false/no/off) turns tracking off."""
    return protocol.switched_off(os.environ, protocol.TRACKING_ENV)
