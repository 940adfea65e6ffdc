PYTHON ?= python3
PIP := $(PYTHON) -m pip

.PHONY: install test demo

install:
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'

test: install
	$(PYTHON) -m pytest -q

demo: install
	$(PYTHON) -m triton_mtp.demo
