#!/usr/bin/env bash
# Step 1 of the GPU tier, on a machine that reaches PyPI (yours): download into .gpu_wheels/ the
# wheels the lent GPU machine lacks (it has PyTorch, transformers, NCCL, pytest; Python 3.12,
# x86_64; no package registry): Megatron-core, DeepSpeed (built here as a pure-Python wheel, its
# ops compile on first use), Ray, and their missing dependencies, at this project's versions.
# Ray's wheel (79 MB) is slimmed to 38 MB so that everything fits the device tool's 64 MiB: its
# Java jar, dashboard web client and the libraries xray does not use (rllib, serve, tune, train,
# data, llm) are left out.
# .gpu_wheels/ is ignored by git; the device tool carries it (carry: [".gpu_wheels"]).
# Step 2, on the GPU machine: tests/gpu/run_on_device.sh.
set -euo pipefail
cd "$(dirname "$0")/../.."
py=.venv/bin/python
version() { "$py" -c "import importlib.metadata as m; print(m.version('$1'))"; }
dest=.gpu_wheels
rm -rf "$dest" && mkdir -p "$dest"
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform any -d "$dest" \
  "megatron-core==$(version megatron-core)" "pydantic==$(version pydantic)" \
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
du -sh "$dest" && ls "$dest"
