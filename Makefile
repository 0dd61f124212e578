# Two commands do all the set-up on a fresh machine that has only python3:
#   make demo   runs the main job
#   make test   runs the test suite
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test test-fast bench clean

# A fresh install of .[all] from a warm pip cache took 80 s on a 2-core machine (1.6 GB:
# Ray, the Kubernetes client, the test tools); an edge device needs only .[edge] (282 MB).
$(STAMP): pyproject.toml
	@echo "installing splitinfer[all] (Ray, Kubernetes client, plots, test tools; 1.6 GB) into $(VENV):"
	@echo "  about 1-2 minutes from a warm pip cache, longer while pip downloads (an edge device needs only '.[edge]')"
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[all]'
	touch $(STAMP)
	@echo "installed into $(VENV)"

demo: $(STAMP)
	$(BIN)/splitinfer demo

test: $(STAMP)
	$(BIN)/python -m pytest -q tests

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q tests/unit

bench: $(STAMP)
	$(BIN)/python -m bench

clean:
	rm -rf $(VENV) build *.egg-info
