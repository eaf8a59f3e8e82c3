#!/usr/bin/env bash
# The GPU check (docs/gpu.md): bundles compiled here for sm_90, run on a machine with an NVIDIA GPU.
#
#   scripts/gpu-check.sh prepare [--model NAME ...]   this workstation, no GPU needed: compiles the
#       check's models for cuda-sm90 (and one for jetson-orin), checks the cubins' ELF headers
#       (sm_90, sm_87), runs each bundle here through its CPU fallback against onnxruntime, and stages
#       bundles + the runtime-only TVM pieces in .gpu-check/ (under 64 MiB; what does not fit is named)
#   scripts/gpu-check.sh run                           the GPU machine (x86_64, CUDA 13 driver, Python
#       3.12 with numpy, onnxruntime, torch; no TVM, no network), in one run of a few minutes: outputs
#       within each bundle's promise, latency beside torch eager; writes $OUT/gpu-table.md
#       (default .gpu-check/out) naming the machine, for docs/gpu.md
#
# On the lent GPU machine: run(command="bash scripts/gpu-check.sh run", carry=[".gpu-check"]).
set -euo pipefail
cd "$(dirname "$0")/.."
what="${1:-}"
shift || true
case "$what" in
  prepare)
    exec .venv/bin/python scripts/gpu_check.py prepare "$@" ;;
  run)
    command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader || true
    exec timeout 570 "${PYTHON:-python3}" scripts/gpu_check.py run "$@" ;;
  *)
    echo "usage: scripts/gpu-check.sh prepare [--model NAME ...] | run   (docs/gpu.md)" >&2
    exit 2 ;;
esac
