"""PyTorch Lightning, whichever way it is installed: ``lightning`` (Lightning 2) ships it as
``lightning.pytorch``, older installs as ``pytorch_lightning``."""
from __future__ import annotations

import importlib
from types import ModuleType


def lightning_module(user: str, sub: str = "") -> ModuleType:
    """Lightning's package (or its module ``sub``, e.g. ``"strategies"``); ``user`` (the importing
    module) is named in the error when Lightning is not installed."""
    for base in ("lightning.pytorch", "pytorch_lightning"):
        try:
            importlib.import_module(base)
        except ImportError:
            continue
        return importlib.import_module(f"{base}.{sub}" if sub else base)
    raise ImportError(f"{user} needs PyTorch Lightning: pip install lightning")
