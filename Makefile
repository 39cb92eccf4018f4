# Entry points: `make demo` (set up, then the recovery demo), `make test` (set up, then every test) and
# `make lint` (set up, then ruff and mypy; CI runs it before the tests).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | cksum | cut -d' ' -f1)

.PHONY: setup demo test lint clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# torch is pinned to 2.13.0 (CPU build on these machines); never let a resolver pick a CUDA build.
	$(VENV)/bin/pip install --quiet 'torch==2.13.0'
	$(VENV)/bin/pip install --quiet -e '.[test]'
	rm -f $(VENV)/.installed-* && touch $@

setup: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/undying demo

test: $(STAMP)
	@scripts/ensure-etcd.sh
	@scripts/ensure-tmux.sh
	@scripts/ensure-slurm.sh
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider --durations=40 tests

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests examples bench
	$(VENV)/bin/mypy  # the package under src, as [tool.mypy] in pyproject.toml says

clean:
	rm -rf $(VENV) runs
