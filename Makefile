PYTHON ?= python3
PIP := $(PYTHON) -m pip
TOOLS := build/tools
APT_PACKAGES := docker-compose nginx-light libb64-0d

.PHONY: install system-packages perf-analyzer test demo soak

install: system-packages perf-analyzer
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[dev]'

# Debian packages the tests drive: docker-compose (offline validation), nginx (scale-out), libb64 (perf_analyzer).
system-packages:
	@if ! dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $(APT_PACKAGES); fi

# perf_analyzer ships inside the tritonclient 2.48.0 wheel (newer wheels need glibc 2.38 or carry none).
perf-analyzer: $(TOOLS)/bin/perf_analyzer
$(TOOLS)/bin/perf_analyzer:
	$(PIP) install nvidia-cuda-runtime-cu12
	rm -rf $(TOOLS)/wheel && mkdir -p $(TOOLS)/bin
	$(PIP) download -q --no-deps -d $(TOOLS)/wheel tritonclient==2.48.0
	cd $(TOOLS)/wheel && $(PYTHON) -m zipfile -e tritonclient-2.48.0-*.whl x
	cp $(TOOLS)/wheel/x/tritonclient-2.48.0.data/data/bin/perf_analyzer $@ && chmod +x $@
	rm -rf $(TOOLS)/wheel

test: install
	$(PYTHON) -m pytest -q

demo: install
	$(PYTHON) -m triton_mtp.demo

soak: install
	$(PYTHON) bench/soak.py
