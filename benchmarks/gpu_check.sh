#!/usr/bin/env bash
# What has not run on a GPU yet, in one device call (issue 25), for a machine with a CUDA
# device:
#
#     bash benchmarks/gpu_check.sh [OUTDIR]
#
# Part 1, four pytest runs side by side (allocation peaks are per process, so running them
# together changes no measurement, only the time), each under PART_SECONDS:
#   cuda   every `cuda` test (tests/test_cuda*.py, the CUDA cases of test_offload.py and
#          test_bad_input.py) on CUDA_WORKERS pytest-xdist workers: the regression check;
#   zoo    every zoo model op by op on the GPU (the CNNs and T5 never ran there), at no budget
#          and a binding budget, on ZOO_WORKERS workers;
#   fuzz   the fuzz slice on the GPU, op by op and with offload;
#   fuzzi  the fuzz slice on the GPU under kernels="inductor".
# Part 2, alone on the device (its times are quotable): `python -m benchmarks.run --speed`
# for SPEED_MODELS and SPEED_CONFIGS, one round, each finished run appended to
# OUTDIR/speed.jsonl at once, under SPEED_SECONDS.
# PARTS (default "cuda zoo fuzz fuzzi speed") names the parts to run: on an H200 (2026-11-29)
# the four test parts side by side took 150 s (cuda), 150 s (zoo) and more than 270 s
# (both fuzz parts, cut): give the fuzz parts a call of their own (PARTS="fuzz fuzzi",
# PART_SECONDS=540).
# memopt must be importable as installed (see gpu_kernels.sh). The files in OUTDIR are at
# most eight: env.txt, {cuda,zoo,fuzz,fuzzi,speed}.log, speed.jsonl, cuda_rows.jsonl.
# shellcheck source=benchmarks/gpu_env.sh
source "$(dirname "$0")/gpu_env.sh" "$@"
export MEMOPT_CUDA_REPORT="$out/cuda_rows.jsonl"
# each process's inductor compiles on a few workers: ten processes share 16 cores
export TORCHINDUCTOR_COMPILE_THREADS=${COMPILE_THREADS:-4}
limit=${PART_SECONDS:-290}
common=(-p no:cacheprovider -p no:logging -rfEX --durations=5)
parts=" ${PARTS:-cuda zoo fuzz fuzzi speed} "
run_part() {  # name, pytest arguments...
    local name=$1
    shift
    [[ $parts == *" $name "* ]] || return 5  # not asked for: pytest's "no tests ran"
    timeout "$limit" $py -m pytest "$@" "${common[@]}" > "$out/$name.log" 2>&1
}
run_part cuda -v -m cuda tests -n "${CUDA_WORKERS:-4}" &
cuda=$!
MEMOPT_TEST_DEVICE=cuda run_part zoo -v -m "slow or not slow" tests/test_zoo.py \
    -k "${ZOO_K:-not inductor}" -n "${ZOO_WORKERS:-6}" &
zoo=$!
MEMOPT_TEST_DEVICE=cuda run_part fuzz -v -s -m "slow or not slow" tests/test_fuzz.py \
    -k "slice and not inductor" &
fuzz=$!
MEMOPT_TEST_DEVICE=cuda run_part fuzzi -v -s -m "slow or not slow" tests/test_fuzz.py \
    -k "slice_inductor" &
fuzzi=$!
status=0
for part in cuda zoo fuzz fuzzi; do
    wait "${!part}"
    code=$?
    echo "## $part: exit $code (124: cut at ${limit}s)"
    [ -f "$out/$part.log" ] || continue
    grep -E "FAILED|XFAIL|XPASS|ERROR|fuzz: |^[0-9.]+s (call|setup)| passed| failed" \
        "$out/$part.log" | tail -n 30
    grep -c "PASSED" "$out/$part.log" | sed 's/^/passed lines: /'
    [ "$code" -eq 0 ] || [ "$code" -eq 5 ] || status=1
done
bench=0
if [[ $parts == *" speed "* ]]; then
IFS='|' read -r -a labels <<< "${SPEED_CONFIGS:-eager|torch.compile|memopt aten|memopt inductor}"
# shellcheck disable=SC2086
timeout "${SPEED_SECONDS:-140}" $py -m benchmarks.run --speed --device "${DEVICE:-cuda}" \
    --rounds 1 --models ${SPEED_MODELS:-mlp64 resnet50} --configs "${labels[@]}" \
    --log "$out/speed.jsonl" > "$out/speed.log" 2>&1
bench=$?
tail -n 30 "$out/speed.log"
fi
echo "tests exit $status, speed exit $bench"
exit $(( status || bench ))
