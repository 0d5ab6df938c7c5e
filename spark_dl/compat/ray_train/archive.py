"""A checkpoint folder as a tar stream: how its files travel through the job's channels."""
from __future__ import annotations

import os
import tarfile
from typing import BinaryIO


def pack(directory: str, out: BinaryIO) -> None:
    """Write ``directory``'s files (links as links) to ``out`` as an uncompressed tar."""
    with tarfile.open(fileobj=out, mode="w") as tar:
        tar.add(directory, arcname=".")


def unpack(source: BinaryIO, directory: str) -> None:
    """Extract a :func:`pack`-ed tar into ``directory`` (made if missing)."""
    os.makedirs(directory, exist_ok=True)
    with tarfile.open(fileobj=source, mode="r") as tar:
        if hasattr(tarfile, "data_filter"):  # Python >= 3.10.12 / 3.11.4: no paths outside ``directory``
            tar.extractall(directory, filter="data")
        else:  # pragma: no cover - older Pythons
            tar.extractall(directory)
