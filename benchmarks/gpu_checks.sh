#!/usr/bin/env bash
# The checks that need a GPU host, in one go (CI has no GPU): the CUDA/NCCL tests, the compression
# benchmark with gradients and compression on the GPU (ResNet-50's layout, the 1 Gbit/s shaped link
# when root with `ip`/`tc`), and the kernels benchmark on the host's cores. Logs go to $1 (default
# benchmarks/results/gpu-run-<date>/), one file per step; a failing step does not stop the others.
#
#   bash benchmarks/gpu_checks.sh [logdir]
#
# Hosts without iproute2 can unpack its .deb files into a folder of their own and put it first on
# PATH/LD_LIBRARY_PATH (IPROUTE_ROOT=/that/folder does both); without `ip`/`tc` the benchmark
# prints why it skips the shaped link and still times encode/decode.
set -u
cd "$(dirname "$0")/.."
log=${1:-benchmarks/results/gpu-run-$(date -u +%Y%m%d-%H%M)}
mkdir -p "$log"
py=${PYTHON:-python3}
if [ -n "${IPROUTE_ROOT:-}" ]; then
    export PATH="$PATH:$IPROUTE_ROOT/usr/bin:$IPROUTE_ROOT/sbin:$IPROUTE_ROOT/usr/sbin:$IPROUTE_ROOT/bin"
    export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:+$LD_LIBRARY_PATH:}$IPROUTE_ROOT/usr/lib/x86_64-linux-gnu:$IPROUTE_ROOT/lib/x86_64-linux-gnu"
fi
export PYTHONUNBUFFERED=1
status=0
step() {  # step NAME SECONDS CMD...: run with a time limit, log, remember a failure
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*" >"$log/$name.txt"
    timeout "$limit" "$@" >>"$log/$name.txt" 2>&1
    local rc=$?
    echo "== $name: exit $rc" >>"$log/$name.txt"
    tail -n 25 "$log/$name.txt"
    [ $rc -eq 0 ] || status=1
}
{ nvidia-smi -L; nproc; "$py" -c "import torch; print(torch.__version__, torch.cuda.is_available())"; } \
    >"$log/host.txt" 2>&1
cat "$log/host.txt"
step build 300 "$py" setup.py build_ext --inplace -q
step tests-gpu 300 "$py" -m pytest -q -n 0 tests/gpu
step compression-cuda 420 "$py" benchmarks/compression.py --device cuda
step kernels 240 "$py" benchmarks/kernels.py
exit $status
