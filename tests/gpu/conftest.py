"""GPU tests: collected only where torch sees a CUDA device (CI has none; run them on a GPU host
with ``python -m pytest tests/gpu``). They need no Spark: ranks start in local mode."""
import torch

collect_ignore_glob = [] if torch.cuda.is_available() else ["test_*.py"]
