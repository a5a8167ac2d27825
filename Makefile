# Two set-up commands: `make demo` and `make test`. Both build everything they need.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.qtool-installed
KSRC := $(wildcard qtool/kernels/src/*.c qtool/kernels/src/*.h qtool/calibrate/src/*.c)
SHARED ?= ../shared
WORK ?= qtool_work

.PHONY: install demo test bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip setuptools wheel

$(STAMP): $(PY) pyproject.toml setup.py $(KSRC)
	$(PY) -m pip install -q --no-build-isolation -e '.[test]'
	touch $@

install: $(STAMP)

test: install
	$(PY) -m pytest

clean:
	rm -rf $(VENV) build *.egg-info $(WORK) qtool/kernels/*.so
