# Sourced by benchmarks/gpu.sh and benchmarks/gpu_kernels.sh with their arguments: the
# output folder (`out`, the first argument, default gpu-results), the Python (`py`,
# $PYTHON or python3), unbuffered output, and the versions and device in $out/env.txt.
set -uo pipefail
out=${1:-gpu-results}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1
py=${PYTHON:-python3}
$py -c "import torch, memopt; print('torch', torch.__version__, '| memopt', memopt.__version__,
'|', torch.cuda.get_device_name() if torch.cuda.is_available() else 'no CUDA device')" \
    | tee "$out/env.txt"
