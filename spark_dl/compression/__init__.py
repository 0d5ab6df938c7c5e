"""Gradient compression: compressors, error feedback, compressed all-reduce, a DDP hook.

    from spark_dl.compression import allreduce, QSGD
    avg = allreduce(grad, QSGD(), name="layer1.weight")

==============  =========  ==================  ==========================
compressor      summable   bits / element      error feedback
==============  =========  ==================  ==========================
NoneCompressor  yes        32                  no
FP16, BF16      yes        16                  no
OneBit          no         2 (1 + 64 / 64)     built in
EFSign          no         1 (+32 per tensor)  built in
QSGD            no         4.06 (s=7, d=512)   no (unbiased; scaled by max |v|)
TopK            no         64 * ratio          wrap in ErrorFeedback
RandomK         yes        32 * ratio          wrap in ErrorFeedback
PowerSGD        own rounds 32 r (n+m) / (n m)  built in
Auto            per tensor, the fastest of the above that is safe for the optimizer, measured
==============  =========  ==================  ==========================
"""
from spark_dl.compression.auto import Auto
from spark_dl.compression.base import Compressor, Payload
from spark_dl.compression.collectives import allreduce
from spark_dl.compression.ddp import DDPHookState, compressed_hook, ddp_hook, make_ddp_hook
from spark_dl.compression.fp import BF16, FP16, NoneCompressor
from spark_dl.compression.memory import ErrorFeedback
from spark_dl.compression.powersgd import PowerSGD
from spark_dl.compression.qsgd import QSGD
from spark_dl.compression.sign import EFSign, OneBit, ScaledSign, SignMeans
from spark_dl.compression.sparse import RandomK, TopK
from spark_dl.compression.stats import CompressionStats, CompressionWarning, stats
from spark_dl.compression.training import TrainingFeedback

__all__ = [
    "Compressor", "Payload", "ErrorFeedback", "allreduce", "stats", "CompressionStats",
    "NoneCompressor", "FP16", "BF16", "OneBit", "SignMeans", "EFSign", "ScaledSign", "QSGD",
    "TopK", "RandomK", "PowerSGD", "make_ddp_hook", "ddp_hook", "compressed_hook",
    "DDPHookState", "CompressionWarning", "TrainingFeedback", "Auto",
]
