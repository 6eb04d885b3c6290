#!/usr/bin/env bash
# memopt's offload on a CUDA machine, in one command (issue 29):
#
#     bash benchmarks/gpu_offload.sh [OUTDIR]
#
# 1. tests/test_offload.py with -m cuda (the CPU tests too): the measured peak within the
#    budget and within 2% of the plan;
# 2. `python -m benchmarks.offload --device cuda` on the MLP, GPT-2 and the Llama config
#    (the measured link, memopt.link): recompute-only memopt, memopt with offload, HF
#    checkpointing and eager under save_on_cpu, interleaved; the table in OUTDIR/offload.md.
# Each part runs under its own time limit (TESTS_SECONDS, BENCH_SECONDS) so that the whole
# fits one device call. memopt must be importable as installed (see gpu_kernels.sh).
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh" "$@"
timeout "${TESTS_SECONDS:-120}" $py -m pytest -q -m "cuda or not cuda" tests/test_offload.py \
    -p no:cacheprovider -p no:logging > "$out/tests.log" 2>&1
status=$?
tail -n 20 "$out/tests.log"
# shellcheck disable=SC2086
timeout "${BENCH_SECONDS:-360}" $py -m benchmarks.offload --device cuda \
    --models ${MODELS:-mlp gpt2 llama} --budgets ${BUDGETS:-0.8 0.6 0.45} \
    > "$out/offload.md" 2> "$out/offload.err"
bench=$?
cat "$out/offload.md"
tail -n 20 "$out/offload.err"
echo "tests exit $status, benchmark exit $bench"
exit $(( status || bench ))
