#!/usr/bin/env bash
# memopt's kernels="inductor" checks on a CUDA machine, in one command (issue 25):
#
#     bash benchmarks/gpu_kernels.sh [OUTDIR]
#
# 1. tests/test_cuda_kernels.py: eager's gradients and the predicted peak against
#    max_memory_allocated with inductor's Triton kernels (rows in OUTDIR/cuda_rows.jsonl);
# 2. the speed table (`python -m benchmarks.run --speed --device cuda`) for MODELS
#    (default: llama gpt2), one round, the configurations in CONFIGS; each finished run is
#    appended to OUTDIR/speed.jsonl at once, so a run cut short keeps what it measured.
# Each part runs under its own time limit (TESTS_SECONDS, SPEED_SECONDS) so that the
# whole fits one device call (10 minutes). memopt must be importable as installed: from a
# bare checkout with PYTHONPATH=$PWD, `memopt.passes` and `memopt.allocator` (top-level
# folders mapped by pyproject.toml's package-dir) are not found; `pip install -e .`, or
# on a machine without network `ln -sfn ../passes memopt/passes; ln -sfn ../allocator
# memopt/allocator` as the 2026-11-26 H100 run did.
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh" "$@"
MEMOPT_CUDA_REPORT="$out/cuda_rows.jsonl" timeout "${TESTS_SECONDS:-240}" \
    $py -m pytest -q -m cuda tests/test_cuda_kernels.py -p no:cacheprovider -p no:logging \
    > "$out/tests.log" 2>&1
status=$?
tail -n 25 "$out/tests.log"
configs=${CONFIGS:-"eager|torch.compile|inductor budget=0.5|memopt aten|memopt inductor|memopt aten @ inductor budget=0.5 peak|memopt inductor @ inductor budget=0.5 peak|memopt aten @ 60% eager|memopt inductor @ 60% eager"}
IFS='|' read -r -a labels <<< "$configs"
# shellcheck disable=SC2086
timeout "${SPEED_SECONDS:-320}" $py -m benchmarks.run --speed --device "${DEVICE:-cuda}" \
    --rounds "${ROUNDS:-1}" --models ${MODELS:-llama gpt2} --configs "${labels[@]}" \
    --log "$out/speed.jsonl" > "$out/speed.md" 2> "$out/speed.err"
bench=$?
cat "$out/speed.md"
tail -n 30 "$out/speed.err"
echo "tests exit $status, speed exit $bench"
exit $(( status || bench ))
