#!/usr/bin/env bash
# Step 2 of the GPU tier, on the lent GPU machine, from the repository root (step 1, on a machine
# with PyPI: tests/gpu/fetch_wheels.sh). Installs the carried wheels into its python3, then runs
#   tier (default): the GPU tier (pytest -m gpu: the engines and Workhorses, then colocated
#                   end-to-end runs on Ray) and the 1B bf16 training benchmark; prints their summaries;
#   grpo:           benchmarks/gpu_grpo.py (xray's GRPO step on a Qwen3-0.6B-shaped model against
#                   TRL's GRPOTrainer; needs fetch_wheels.sh --with-vllm for megatron-vllm and TRL);
#                   extra arguments go to it (e.g. --backend megatron-dsinfer without vLLM).
# The wheels come one of two ways:
# - .gpu_wheels/ carried whole (fetch_wheels.sh without --with-vllm, about 48 MB, one call):
#     run(command="bash tests/gpu/run_on_device.sh", carry=[".gpu_wheels"])
# - parts (fetch_wheels.sh --with-vllm, about 212 MiB: .gpu_parts/01..04), one call per part,
#   back to back on one warm lease, each running the same command: every call moves its part to
#   /tmp/xray_parts (kept while the lease lasts) and, until all have come, stops there; the call
#   that brings the last one checks the tar's sha256, unpacks it to /tmp/xray_wheels, installs and runs:
#     run(command="bash tests/gpu/run_on_device.sh grpo", carry=[".gpu_parts/01"])   ... 02, 03
#     run(command="bash tests/gpu/run_on_device.sh grpo", carry=[".gpu_parts/04"], timeout_s=600)
#   A later call of the same lease finds /tmp/xray_wheels installed and carries nothing.
# Where the device tool's $OUT is set, the run's log is written there too (it comes back).
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-tier}
[ $# -gt 0 ] && shift
stash=/tmp/xray_parts
unpacked=/tmp/xray_wheels

take_parts() {  # 0: the parts are all here and unpacked; 1: none carried; 2: more to come; 3: broken
  local d have
  for d in .gpu_parts/[0-9][0-9]; do
    [ -f "$d/part" ] || continue
    mkdir -p "$stash" && cp "$d/part" "$stash/$(basename "$d")" && cp "$d/MANIFEST" "$stash/MANIFEST" || return 3
  done
  [ -f "$stash/MANIFEST" ] || return 1
  local parts sha256
  . "$stash/MANIFEST"
  have=$(find "$stash" -name '[0-9][0-9]' | wc -l)
  if [ "$have" -lt "$parts" ]; then
    echo "wheel parts here: $(cd "$stash" && ls [0-9][0-9] | tr '\n' ' ')of $parts: carry the next part" \
         "(.gpu_parts/NN) in the next call, at once (an idle machine goes back after 30 s)"
    return 2
  fi
  cat "$stash"/[0-9][0-9] > /tmp/xray-wheels.tar
  if ! echo "$sha256  /tmp/xray-wheels.tar" | sha256sum -c --quiet; then
    echo "the $parts parts do not add up to the packed tar (sha256 differs): rerun tests/gpu/fetch_wheels.sh" \
         "--with-vllm and carry every part of that one packing" >&2
    rm -f /tmp/xray-wheels.tar "$stash"/[0-9][0-9]
    return 3
  fi
  rm -rf "$unpacked" && mkdir -p "$unpacked" && tar -xf /tmp/xray-wheels.tar -C "$unpacked" || return 3
  rm -rf /tmp/xray-wheels.tar "$stash"
}

take_parts
case $? in
  0|1) ;;
  2) exit 0 ;;
  *) exit 1 ;;
esac
if [ -d "$unpacked" ]; then wheels=$unpacked; else wheels=.gpu_wheels; fi
if [ ! -f "$wheels/.installed" ]; then
  if ! ls "$wheels"/*.whl > /dev/null 2>&1; then
    echo "no wheels: carry .gpu_wheels or .gpu_parts/NN (made by tests/gpu/fetch_wheels.sh)" >&2
    exit 1
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile "$wheels"/*.whl || exit 1
  touch "$wheels/.installed" 2>/dev/null || true
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /dev/null || exit 1  # xray's commands
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
export PYTHONPATH="$PWD" PYTHONWARNINGS=ignore PYTHONUNBUFFERED=1
log=${OUT:-/tmp}/run_on_device.log
case "$mode" in
  tier)
    python3 -m pytest -m gpu tests/gpu -q -p no:cacheprovider -o addopts="--strict-markers -ra" 2>&1 | tee "$log"
    tier=${PIPESTATUS[0]}
    python3 benchmarks/megatron_train.py --device cuda --dtype bfloat16 --model 1B --batch 8 --seq 2048 \
      --micro 2 --rounds 5 2>&1 | grep -v -i warn | tail -4
    exit "$tier" ;;
  grpo)
    python3 benchmarks/gpu_grpo.py "$@" 2>&1 | tee "$log" | grep -v -i warn
    exit "${PIPESTATUS[0]}" ;;
  *)
    echo "usage: $0 [tier|grpo] [benchmark arguments]" >&2
    exit 2 ;;
esac
