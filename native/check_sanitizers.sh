#!/bin/sh
# Builds kernels.c with AddressSanitizer and UBSan into a standalone driver and runs it; any
# report aborts the run (halt_on_error, -fno-sanitize-recover), so the exit status says it all.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$(mktemp -d)}
${CC:-gcc} -O1 -g -std=c11 -pthread -ffp-contract=off -fno-omit-frame-pointer \
    -fsanitize=address,undefined -fno-sanitize-recover=all \
    "$here/kernels.c" "$here/sanitize_driver.c" -lm -o "$out/sanitize_driver"
ASAN_OPTIONS=halt_on_error=1:detect_leaks=1 UBSAN_OPTIONS=halt_on_error=1:print_stacktrace=1 \
    "$out/sanitize_driver"
