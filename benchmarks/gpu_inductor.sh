#!/usr/bin/env bash
# The evidence for kernels="inductor" as the default on CUDA (issue 25, item 4), in one
# device call:
#
#     bash benchmarks/gpu_inductor.sh [OUTDIR]
#
# Three parts at once, each a pytest run in its own processes (allocation peaks are per
# process, so running them side by side changes no measurement, only the time):
# 1. zoo: every zoo model (benchmarks/zoo.py) under kernels="inductor" on the GPU, at no
#    budget and at a binding one (tests/test_zoo.py, MEMOPT_TEST_DEVICE=cuda), on
#    ZOO_WORKERS pytest-xdist workers;
# 2. fuzz: the fuzz slice on the GPU, op by op and under inductor (tests/test_fuzz.py);
# 3. cuda: a budget above the no-budget peak measures no more (tests/test_cuda.py) and
#    reserved=True bounds the caching allocator's segments (tests/test_cuda_step.py).
# Each part has its own time limit; the logs are OUTDIR/{zoo,fuzz,cuda}.log and the
# measured rows OUTDIR/cuda_rows.jsonl. memopt must be importable (see gpu_kernels.sh).
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh" "$@"
export MEMOPT_CUDA_REPORT="$out/cuda_rows.jsonl"
common=(-p no:cacheprovider -rfEX --durations=8)
workers=()  # pytest-xdist's workers for the zoo (ZOO_WORKERS=0: none, xdist not needed)
[ "${ZOO_WORKERS:-6}" -gt 0 ] && workers=(-n "${ZOO_WORKERS:-6}")
MEMOPT_TEST_DEVICE=${TEST_DEVICE:-cuda} timeout "${ZOO_SECONDS:-420}" $py -m pytest -v \
    -m "slow or not slow" tests/test_zoo.py -k "${ZOO_K:-inductor}" \
    "${workers[@]}" "${common[@]}" > "$out/zoo.log" 2>&1 &
zoo=$!
MEMOPT_TEST_DEVICE=${TEST_DEVICE:-cuda} timeout "${FUZZ_SECONDS:-420}" $py -m pytest -v -s \
    -m "slow or not slow" tests/test_fuzz.py -k "${FUZZ_K:-slice}" "${common[@]}" \
    > "$out/fuzz.log" 2>&1 &
fuzz=$!
timeout "${CUDA_SECONDS:-300}" $py -m pytest -v -m cuda tests/test_cuda.py \
    tests/test_cuda_step.py -k "${CUDA_K:-above_the_peak or reserved_true}" "${common[@]}" \
    > "$out/cuda.log" 2>&1 &
cuda=$!
status=0
for part in zoo fuzz cuda; do
    wait "${!part}"
    code=$?
    echo "## $part: exit $code"
    grep -E "PASSED|FAILED|XFAIL|XPASS|ERROR|SKIPPED|fuzz: |^[0-9.]+s (call|setup)|passed|failed" \
        "$out/$part.log" | tail -n 40
    grep -c "PASSED" "$out/$part.log" | sed 's/^/passed lines: /'
    [ "$code" -eq 0 ] || [ "$code" -eq 5 ] || status=1
done
exit $status
