#!/usr/bin/env bash
# The project's one prepared GPU check (scripts/gpu_check.py says what it runs and prints):
#   python scripts/gpu_carry.py                  # where there is network: build/gpu-carry
#   scripts/gpu_check.sh [WORKDIR]               # on the GPU machine, build/gpu-carry carried along
#   GPU_CHECK_ALLOW_CPU=1 scripts/gpu_check.sh   # a tiny shape on the CPU (CI: tests/test_gpu_check.py)
# PYTHON picks the interpreter (default python3: the GPU machine's, the one with torch).
set -uo pipefail
cd "$(dirname "$0")/.."
exec env PYTHONUNBUFFERED=1 "${PYTHON:-python3}" scripts/gpu_check.py "$@"
