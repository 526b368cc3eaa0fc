#!/usr/bin/env bash
# The GPU check (issue 32), run on a machine with one NVIDIA GPU from the source tree:
#   benchmarks/gpu_check.sh OUT_DIR
# 1. the CUDA tests (tests/test_cuda.py: every collective, selector, quantizer, the
#    wire format, error feedback, the DDP hook and FSDP2 on CUDA tensors);
# 2. the GPU kernel benchmark (sparcml bench-gpu: selection against torch.topk at
#    0.1% and 1% of a 64 MB gradient, quantizers against a device-to-device copy,
#    the sparse collectives' stream kernels).
# Nothing is installed: the machine's PyTorch (with CUDA), numba and pytest are used,
# and sparcml is imported from src/. Everything it writes goes to OUT_DIR.
source "$(dirname "$0")/device_env.sh"  # $out, $py, "${sp[@]}"; cd to the root
{
    date -u
    uptime
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    "$py" -c 'import sys, torch, numba; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "numba", numba.__version__, "device", torch.cuda.get_device_name())'
    git log -1 --format='commit %H' 2>/dev/null || true
} >"$out/device.txt" 2>&1
cat "$out/device.txt"

echo "== CUDA tests"
# whole-step limits, so that a hang in one step leaves the other's output
timeout "${TESTS_LIMIT_S:-300}" "$py" -m pytest tests/test_cuda.py -q -p no:cacheprovider \
    -o addopts="-ra" --durations=10 --timeout 120 --junitxml="$out/cuda_tests.xml" 2>&1 | tee "$out/cuda_tests.txt"
tests_rc=${PIPESTATUS[0]}

echo "== GPU kernel benchmark"
timeout "${BENCH_LIMIT_S:-180}" "$py" -m sparcml.tools.cli bench-gpu --json "$out/bench_gpu.json" 2>"$out/bench_gpu.log" \
    | tee "$out/bench_gpu.txt"
bench_rc=${PIPESTATUS[0]}
echo "cuda tests exit $tests_rc, bench-gpu exit $bench_rc"
exit $((tests_rc != 0 || bench_rc != 0))
