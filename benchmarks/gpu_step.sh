#!/usr/bin/env bash
# memopt's whole-step checks on a CUDA machine, in one command (issues 25, 26, 27):
#
#     bash benchmarks/gpu_step.sh [OUTDIR]
#
# 1. tests/test_cuda_step.py (the optimizer inside the budget: stepped in the backward and
#    in chunks; blocks=True under aten and inductor) and tests/test_cuda.py's zoo
#    transformers under both kernels; every measurement in OUTDIR/cuda_rows.jsonl;
# 2. `python -m benchmarks.reserved` (the caching allocator's reserved memory beside the
#    allocated bytes a budget counts), with the default allocator, then with
#    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; rows in OUTDIR/reserved.jsonl.
# Each part runs under its own time limit (TESTS_SECONDS, RESERVED_SECONDS) so that the
# whole fits one device call. memopt must be importable as installed (see gpu_kernels.sh).
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh" "$@"
MEMOPT_CUDA_REPORT="$out/cuda_rows.jsonl" timeout "${TESTS_SECONDS:-270}" \
    $py -m pytest -q -m cuda tests/test_cuda_step.py \
    tests/test_cuda.py::test_zoo_transformer_on_cuda_within_a_binding_budget \
    -p no:cacheprovider -p no:logging > "$out/tests.log" 2>&1
status=$?
tail -n 30 "$out/tests.log"
bench=0
for conf in default expandable_segments:True; do
    if [ "$conf" = default ]; then unset PYTORCH_CUDA_ALLOC_CONF
    else export PYTORCH_CUDA_ALLOC_CONF=$conf; fi
    # shellcheck disable=SC2086
    timeout "${RESERVED_SECONDS:-100}" $py -m benchmarks.reserved --device "${DEVICE:-cuda}" \
        --models ${MODELS:-mlp64 resnet50 gpt2 llama} --log "$out/reserved.jsonl" \
        >> "$out/reserved.md" 2>> "$out/reserved.err" || bench=$?
done
cat "$out/reserved.md"
grep -v '^{' "$out/reserved.err" | tail -n 20
echo "tests exit $status, reserved exit $bench"
exit $(( status || bench ))
