#!/usr/bin/env bash
# The GPU bench on a bare GPU machine: its own python3 (torch, transformers >= 5.17), this tree on PYTHONPATH, no
# install and no network. Options: those of `vlmspec bench` plus --pairs (see eval/vlmspec_eval/gpu_bench.py).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD:$PWD/eval${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m vlmspec_eval.gpu_bench "$@"
