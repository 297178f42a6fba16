#!/usr/bin/env bash
# Step 1 of the GPU tier, on a machine that reaches PyPI (yours): download into .gpu_wheels/ the
# wheels the lent GPU machine lacks (it has PyTorch 2.11.0+cu130, transformers 5.17, NCCL, pytest;
# Python 3.12, x86_64; no package registry): Megatron-core, DeepSpeed (built here as a pure-Python
# wheel, its ops compile on first use), Ray, and their missing dependencies, at this project's versions.
# Ray's wheel (79 MB) is slimmed to 39 MB so that everything fits the device tool's 64 MiB: its
# Java jar, dashboard web client and the libraries xray does not use (rllib, serve, tune, train,
# data, llm) are left out. Measured (pip download --no-deps, 2026-11): ray 2.60.0 79.3 MB (slimmed
# 39.4 MB), megatron-core 0.16.1 2.6 MB, deepspeed 0.19.8 2.0 MB (sdist; the wheel built here: 2.2 MB),
# their dependencies 3.8 MB: 48.0 MB in all, one call.
# .gpu_wheels/ is ignored by git; the device tool carries it (carry: [".gpu_wheels"]).
#
# --with-vllm adds what the default pair megatron-vllm and benchmarks/gpu_grpo.py need, and packs
# the whole set into parts for consecutive calls of one warm lease (.gpu_parts/NN/, ignored by git):
# - vLLM 0.26.0 (CUDA 13 wheel, 289.6 MiB): the newest release pinned to torch==2.11.0, the
#   machine's torch (0.20-0.26 pin 2.11.0, 0.27-0.33 pin 2.13.0); its kernels link libcudart.so.13.
#   Slimmed here to 149.2 MiB: the FlashAttention-2 library (123.5 MiB packed; Hopper runs
#   FlashAttention-3, which stays), the Rust front-end binary vllm-rs (14.9 MiB; not used by an
#   in-process engine) and DeepGEMM's extensions for Pythons other than 3.12 are left out. If an
#   H100/H200 run asks for FlashAttention-2, set XRAY_VLLM_SLIM=0 (the whole wheel: one more part).
# - vLLM's imports that the machine lacks, found by running the in-process engine (xray's rollout)
#   with each candidate hidden: cbor2, pyzmq, openai (+ distro, jiter, sniffio), openai-harmony,
#   msgspec, pybase64, cachetools, xgrammar (+ apache-tvm-ffi), fastapi (+ starlette),
#   partial-json-parser, llguidance, compressed-tensors (+ loguru): 18 wheels, 15.6 MB. vLLM's other
#   requirements (OpenTelemetry, MCP, anthropic, flashinfer, tilelang, CUTLASS DSL, ...) are
#   imported only by features xray does not use and stay behind (pip install --no-deps).
# - TRL 1.16.0 and datasets 5.2.0 (+ dill, multiprocess), for the benchmark's TRL side: 1.8 MB.
# In all about 220 MB: 4 parts of at most $XRAY_PART_MIB (56) MiB, each a folder .gpu_parts/NN/
# holding one slice of one tar of the wheels and the MANIFEST (the part count and the tar's
# sha256). The working tree travels beside each part (about 3 MB; the tool's limit is 64 MiB for
# both). One call per part, back to back (an idle machine goes back after 30 s), each carrying
# its part and running the same command; the call that brings the last part puts the tar back
# together, checks it, installs and runs:
#   run(command="bash tests/gpu/run_on_device.sh grpo", carry=[".gpu_parts/01"])  ... 02, 03
#   run(command="bash tests/gpu/run_on_device.sh grpo", carry=[".gpu_parts/04"], timeout_s=600)
# Step 2, on the GPU machine: tests/gpu/run_on_device.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
with_vllm=0
case "${1:-}" in
  --with-vllm) with_vllm=1 ;;
  "") ;;
  *) echo "usage: $0 [--with-vllm]" >&2; exit 2 ;;
esac
py=.venv/bin/python
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
dest=.gpu_wheels
platforms=()
for n in 17 24 27 28 31; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
fetch() {
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" --platform manylinux2014_x86_64 --platform any -d "$dest" "$@"
}
rm -rf "$dest" && mkdir -p "$dest"
fetch "megatron-core==$(version megatron-core)" "pydantic==$(version pydantic)" \
  "pydantic-core==$(version pydantic-core)" "annotated-types==$(version annotated-types)" \
  "typing-inspection==$(version typing-inspection)" "hjson==$(version hjson)" \
  "ray==$(version ray)" "jsonschema==$(version jsonschema)" \
  "jsonschema-specifications==$(version jsonschema-specifications)" \
  "referencing==$(version referencing)" "rpds-py==$(version rpds-py)" "xxhash==$(version xxhash)"
"$py" -m pip wheel -q --no-deps --no-build-isolation -w "$dest" "deepspeed==$(version deepspeed)"
"$py" - "$dest"/ray-*.whl <<'PY'
import os
import sys
import zipfile

DROP = ("ray/jars/", "ray/dashboard/client/build/", "ray/rllib/", "ray/serve/", "ray/tune/", "ray/train/",
        "ray/data/", "ray/llm/")
wheel = sys.argv[1]
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(wheel + ".slim", "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
    for item in src.infolist():
        if not item.filename.startswith(DROP):
            out.writestr(item, src.read(item), compresslevel=9)
os.replace(wheel + ".slim", wheel)
PY
if [ "$with_vllm" = 1 ]; then
  fetch vllm==0.26.0 openai-harmony==0.0.8 \
    "cbor2==$(version cbor2)" "pyzmq==$(version pyzmq)" "openai==$(version openai)" "distro==$(version distro)" \
    "jiter==$(version jiter)" "sniffio==$(version sniffio)" "msgspec==$(version msgspec)" \
    "pybase64==$(version pybase64)" "cachetools==$(version cachetools)" "xgrammar==$(version xgrammar)" \
    "apache-tvm-ffi==$(version apache-tvm-ffi)" "fastapi==$(version fastapi)" "starlette==$(version starlette)" \
    "partial-json-parser==$(version partial-json-parser)" "llguidance==$(version llguidance)" \
    "compressed-tensors==$(version compressed-tensors)" "loguru==$(version loguru)" \
    "trl==$(version trl)" "datasets==$(version datasets)" "dill==$(version dill)" \
    "multiprocess==$(version multiprocess)"
  if [ "${XRAY_VLLM_SLIM:-1}" = 1 ]; then
    "$py" - "$dest"/vllm-*.whl <<'PY'
import os
import sys
import zipfile

DROP = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs")
wheel = sys.argv[1]
with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(wheel + ".slim", "w", zipfile.ZIP_DEFLATED) as out:
    for item in src.infolist():
        name = item.filename
        other_python = name.startswith("vllm/third_party/deep_gemm/_C.cpython-") and "-312-" not in name
        if name not in DROP and not other_python:
            out.writestr(item, src.read(item), compress_type=item.compress_type)
os.replace(wheel + ".slim", wheel)
PY
  fi
  part_mib=${XRAY_PART_MIB:-56}
  rm -rf .gpu_parts && mkdir -p .gpu_parts
  tar -cf .gpu_parts/wheels.tar -C "$dest" .
  split -b "${part_mib}m" -d -a 2 --numeric-suffixes=1 .gpu_parts/wheels.tar .gpu_parts/slice.
  sum=$(sha256sum .gpu_parts/wheels.tar | cut -d' ' -f1)
  rm .gpu_parts/wheels.tar
  parts=$(ls .gpu_parts/slice.* | wc -l)
  for slice in .gpu_parts/slice.*; do
    k=${slice##*.}
    mkdir -p ".gpu_parts/$k" && mv "$slice" ".gpu_parts/$k/part"
    printf 'parts=%s\nsha256=%s\n' "$parts" "$sum" > ".gpu_parts/$k/MANIFEST"
  done
  tree=$(git ls-files -co --exclude-standard -z | du -cb --files0-from=- 2>/dev/null | tail -1 | cut -f1)
  echo "packed $dest into $parts parts of at most $part_mib MiB (.gpu_parts/01..); the working tree beside" \
       "each: $((tree / 1048576)) MiB (the tool carries 64 MiB per call)"
fi
du -sh "$dest" && ls "$dest"
