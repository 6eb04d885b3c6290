#!/usr/bin/env bash
# memopt's speed against torch.compile on a CUDA machine, in one command (issue 25):
#
#     bash benchmarks/gpu_speed.sh [OUTDIR]
#
# `python -m benchmarks.profile_step` (every configuration in one process, rounds
# interleaved, medians of paired ratios to eager), three times:
# 1. the Llama workload: eager, torch.compile, memopt inductor and aten at no budget, and
#    memopt inductor at 99MiB (the peak inductor's activation_memory_budget=0.5 reached on
#    an H100) and at 0.6 of the unoptimized peak;
# 2. tests/test_cuda_kernels.py (eager's gradients and the budget under Triton kernels);
# 3. the Llama again with eager and inductor's knob at 0.5, in a process of its own (the
#    knob and torch.compile share dynamo's cache in one process);
# 4. the 12-layer GPT-2: eager, torch.compile, memopt inductor at no budget and at 1.66GiB
#    (torch.compile's and the knob's peak on an H100).
# Each part has its own time limit, so that the whole fits one device call (10 minutes).
# memopt must be importable as installed (see gpu_kernels.sh).
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh" "$@"
part() {  # part NAME SECONDS ARGS...: one profile_step run, its output in $out/NAME.md
    local name=$1 seconds=$2
    shift 2
    timeout "$seconds" $py -m benchmarks.profile_step --device "${DEVICE:-cuda}" --top 4 "$@" \
        > "$out/$name.md" 2> "$out/$name.err"
    echo "## $name: exit $?"
    grep -v '^  ' "$out/$name.md"
    grep -v '^\s*$' "$out/$name.err" | tail -n 5
}
part llama "${LLAMA_SECONDS:-150}" --model llama --rounds 15 --configs eager torch_compile \
    memopt:inductor memopt:aten memopt:inductor:99MiB memopt:inductor:0.6
MEMOPT_CUDA_REPORT="$out/cuda_rows.jsonl" timeout "${TESTS_SECONDS:-110}" \
    $py -m pytest -q -m cuda tests/test_cuda_kernels.py -p no:cacheprovider -p no:logging \
    > "$out/tests.log" 2>&1
status=$?
tail -n 15 "$out/tests.log"
echo "tests exit $status"
part llama_knob "${KNOB_SECONDS:-60}" --model llama --rounds 15 --configs eager inductor:0.5
part gpt2 "${GPT2_SECONDS:-200}" --model gpt2 --rounds 8 --configs eager torch_compile \
    memopt:inductor memopt:inductor:1.66GiB
exit $status
