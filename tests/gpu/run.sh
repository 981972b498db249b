#!/usr/bin/env bash
# `bazel run //tests/gpu:slime_grpo -- ARGS` (or miles_grpo): tests/gpu/run.py on the trainer image's Python, the one
# the wheels are installed into (python3 on PATH, or TRAINER_PYTHON), rather than on Bazel's.
set -euo pipefail
exec "${TRAINER_PYTHON:-python3}" tests/gpu/run.py "$@"
