#!/usr/bin/env bash
# memopt's GPU checks in one command (issue 16, item 4), for a machine with a CUDA device:
#
#     bash benchmarks/gpu.sh [OUTDIR]
#
# 1. the `cuda` test set (tests/test_cuda.py and the CUDA case of tests/test_bad_input.py),
#    every predicted-vs-measured row appended to OUTDIR/cuda_rows.jsonl;
# 2. the core benchmark on CUDA (`python -m benchmarks.run --device cuda`), its table in
#    OUTDIR/core.md.
# The benchmark runs after the tests, alone on the device, so its time ratios can be quoted.
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh" "$@"
MEMOPT_CUDA_REPORT="$out/cuda_rows.jsonl" $py -m pytest -q -m cuda -p no:cacheprovider \
    -p no:logging --junitxml="$out/junit.xml" > "$out/tests.log" 2>&1
status=$?
# shellcheck disable=SC2086
$py -m benchmarks.run --device cuda --models ${MODELS:-mlp64 resnet50 gpt2 lstm} \
    > "$out/core.md" 2> "$out/core.err"
bench=$?
tail -n 40 "$out/tests.log"
cat "$out/core.md"
tail -n 5 "$out/core.err"
echo "tests exit $status, benchmark exit $bench"
exit $(( status || bench ))
