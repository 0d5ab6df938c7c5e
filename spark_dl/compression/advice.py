"""Which compressor and optimizer pairs are known to fall short of uncompressed training, and what to
do instead: warned once where a compressor meets its optimizer (``DistributedOptimizer``,
``make_ddp_hook(c, optimizer=opt)``).

The verdicts are measurements (``benchmarks/convergence.py``, digits, 2 ranks, 150 steps, and a
1.6M-parameter model; the tables are in docs/guide/compression.md), not theorems: a longer run or
a smaller lr may close the gap, and a warning can be silenced with
``warnings.filterwarnings("ignore", category=CompressionWarning)``.
"""
from __future__ import annotations

import warnings
from typing import Any

from spark_dl.compression.base import Compressor
from spark_dl.compression.memory import ErrorFeedback
from spark_dl.compression.sign import EFSign, ScaledSign, SignMeans
from spark_dl.compression.sparse import ADAPTIVE_RATIO, RandomK, TopK
from spark_dl.compression.stats import CompressionWarning
from spark_dl.compression.training import optimizer_settings

# Below this fraction of entries per step, top-k lags uncompressed training on short runs (under
# momentum SGD its sparsity warm-up keeps 1% within a point).
SPARSE_RATIO = 0.1
# Random-k needs this much to come within about a point: 16 bits an entry, FP16's bytes.
RANDOM_RATIO = 0.5


def _kind(optimizer: Any) -> str:
    """``"momentum"`` (heavy-ball SGD), ``"nesterov"``, ``"adaptive"`` (Adam-style ``betas``) or ``"plain"``."""
    group = optimizer.param_groups[0] if getattr(optimizer, "param_groups", None) else {}
    if "betas" in group:
        return "adaptive"
    if group.get("nesterov"):
        return "nesterov"
    return "momentum" if optimizer_settings(optimizer)[1] > 0 else "plain"


def advice(compressor: Compressor, optimizer: Any) -> str | None:
    """Why ``compressor`` under ``optimizer`` is known to train a worse model, and the fix; None
    where nothing is known against the pair."""
    kind = _kind(optimizer)
    inner = compressor.compressor if isinstance(compressor, ErrorFeedback) else compressor
    ramped = isinstance(inner, TopK) and inner.ramp_steps > 0 and isinstance(compressor, ErrorFeedback)
    # TopK() keeps more under Adam-style optimizers: judge the ratio it will keep under this one
    ratio = inner.ratio_for(kind == "adaptive") if isinstance(inner, TopK) else getattr(inner, "ratio", 1.0)
    bare = "" if isinstance(compressor, ErrorFeedback) else (
        " Without ErrorFeedback the entries it drops are lost for good: wrap it, ErrorFeedback(...).")
    if isinstance(inner, RandomK) and ratio < RANDOM_RATIO:
        return (f"{compressor!r} sends {ratio:g} of the entries a step, drawn at random whatever their size, so an "
                f"entry waits about {1 / ratio:.0f} steps for its turn: it trains a worse model (digits, 150 steps, "
                "10 seeds, both paths, momentum SGD, Nesterov, Adam, AdamW and warm-up with cosine decay, with error "
                "feedback: at ratio 0.01 13-38 points below uncompressed, 0.1 2.5-10.2 below, 0.25 1.1-4.4, 0.5 "
                f"0.1-1.1).{bare} At 0.5 it sends 16 bits an entry, FP16's bytes: use FP16() (within 0.2 "
                "there), QSGD() (4 bits an entry, within 0.2) or OneBit() (2 bits, within a point).")
    if isinstance(inner, TopK) and ratio < SPARSE_RATIO and (kind == "adaptive" or not ramped):
        if ramped:  # under momentum SGD its sparsity warm-up keeps it within a point there
            return (f"{compressor!r} under Adam-style optimizers sends {ratio:g} of the entries a step, so an "
                    f"entry waits about {1 / ratio:.0f} steps for its turn: on short runs it trains a worse "
                    "model (digits, 150 steps, its 60-step sparsity warm-up included, 10 seeds: at ratio 0.01 1.1-1.4 "
                    "points below uncompressed at lr 0.002 x 2 ranks and 6.1-8.4 below at Adam's best lr there, "
                    "0.016 x 2; a 1.6M-parameter MLP at its best lr: 3.0-3.1 below, 12 seeds). Leave the ratio "
                    f"out, TopK() (it keeps {ADAPTIVE_RATIO:g} under Adam: within 0.8 at those lrs, 0.3 on that "
                    "MLP), or use OneBit() (within a point, at 2 bits an entry).")
        return (f"{compressor!r} sends {ratio:g} of the entries a step, so an entry waits about "
                f"{1 / ratio:.0f} steps for its turn: on short runs it trains a worse model (digits, 150 steps: "
                f"0.7-3.3 points below uncompressed with error feedback and no sparsity warm-up).{bare} Use OneBit() "
                "(1-bit with error feedback, within a point there), ErrorFeedback(TopK()) with its sparsity warm-up, "
                f"or ratio >= {SPARSE_RATIO:g}.")
    if isinstance(inner, (SignMeans, ScaledSign)) and not isinstance(compressor, ErrorFeedback):
        return (f"{compressor!r} has no error feedback: what its signs drop is lost for good and training stalls. "
                "Use OneBit() or EFSign(), which keep it and send it later.")
    if isinstance(compressor, EFSign) and kind == "adaptive" and not compressor.feedback.compress_momentum:
        wide = (" With a scale over more than 256 elements: 0.9-1.1 and 9.8-11.6 below on digits at those lrs.") \
            if compressor.wide() else ""
        return (f"{compressor!r} with compress_momentum=False under Adam-style optimizers compresses each rank's own "
                "preconditioned gradient, not the shared first moment: on a 1.6M-parameter MLP that trained 1.2 "
                "points below uncompressed at lr 0.002 x 2 ranks (12 seeds), and on digits 2.2-3.2 below at Adam's "
                f"best lr there, 0.016 x 2 (10 seeds).{wide} Leave compress_momentum=True (the default): within a "
                "point at both lrs on both models.")
    return None


def warn_if_known_worse(compressor: Compressor, optimizer: Any, stacklevel: int = 3) -> None:
    """A :class:`CompressionWarning` with :func:`advice`'s reason and fix, if it has one."""
    reason = advice(compressor, optimizer)
    if reason is not None:
        warnings.warn(reason, CompressionWarning, stacklevel=stacklevel)
