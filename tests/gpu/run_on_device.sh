#!/usr/bin/env bash
# Step 2 of the GPU tier, on the lent GPU machine, from the repository root, with .gpu_wheels/
# carried (step 1: tests/gpu/fetch_wheels.sh). Installs the carried wheels into its python3,
# runs the GPU tier (pytest -m gpu: the engines and Workhorses, then colocated end-to-end runs on
# Ray) and the 1B bf16 training benchmark; prints their summaries.
# With the device tool: run(command="bash tests/gpu/run_on_device.sh", carry=[".gpu_wheels"]).
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -m pip install -q --no-index --no-deps .gpu_wheels/*.whl || exit 1
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null || exit 1  # xray's commands
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH="$PWD" PYTHONWARNINGS=ignore
python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts="--strict-markers -ra"
tier=$?
python3 benchmarks/megatron_train.py --device cuda --dtype bfloat16 --model 1B --batch 8 --seq 2048 \
  --micro 2 --rounds 5 2>&1 | grep -v -i warn | tail -4
exit $tier
