#!/usr/bin/env bash
# The checks that need a GPU host, in one go (CI has no GPU): the CUDA/NCCL tests, the compression
# benchmark with gradients and compression on the GPU (ResNet-50's layout, the 1 Gbit/s shaped link
# when root with `ip`/`tc`), and the kernels benchmark on the host's cores. Logs go to $1 (default
# benchmarks/results/gpu-run-<date>/), one file per step; a failing step does not stop the others.
#
#   bash benchmarks/gpu_checks.sh [logdir]
#
# Hosts without iproute2 can unpack its .deb files into a folder of their own (IPROUTE_ROOT=/that/folder
# puts it on PATH/LD_LIBRARY_PATH; its bin/ is searched too, for wrappers that run ip/tc with their
# own libraries); without `ip`/`tc` the benchmark prints why it skips the shaped link and still
# times encode/decode. The compression benchmark's two ranks share the one GPU: where the CUDA MPS
# daemon is installed it runs for that step, so their kernels run side by side as on two GPUs
# instead of time-slicing one (GPU_CHECKS_MPS=0 leaves it off).
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
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the benchmarks import spark_dl from this checkout
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
{ nvidia-smi -L; nproc; "$py" -c "import torch; print(torch.__version__, torch.cuda.is_available())"; command -v ip tc; } \
    >"$log/host.txt" 2>&1
cat "$log/host.txt"
step build 150 "$py" setup.py build_ext --inplace -q
step powersgd-round 90 "$py" benchmarks/powersgd_round.py --device cuda
mps=0
if [ "${GPU_CHECKS_MPS:-1}" = 1 ] && command -v nvidia-cuda-mps-control >/dev/null \
        && nvidia-cuda-mps-control -d >/dev/null 2>&1; then
    mps=1
fi
echo "CUDA MPS daemon for the compression benchmark: $([ $mps = 1 ] && echo on || echo off)" >>"$log/host.txt"
step compression-cuda 240 "$py" benchmarks/compression.py --device cuda --steps 9
if [ $mps = 1 ]; then
    echo quit | nvidia-cuda-mps-control
    # the same without MPS: the ranks' CUDA contexts time-slice the GPU
    step compression-cuda-timesliced 120 "$py" benchmarks/compression.py --device cuda --steps 9 \
        --compressors fp32,powersgd-r4
fi
step tests-gpu 200 "$py" -m pytest -q -n 0 -p no:cacheprovider tests/gpu
step kernels 150 "$py" benchmarks/kernels.py
exit $status
