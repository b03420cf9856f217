# The two commands of the README's quick start. Both create .venv (Python 3.11) and install mmkv into it first.
# --no-cache-dir: torch's CUDA wheels and their libraries are several GB; a pip cache would hold them a second time.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.mmkv-installed

.PHONY: demo test install

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --no-cache-dir --upgrade pip 'setuptools>=68,<82' wheel
	$(VENV)/bin/python -m pip install -q --no-cache-dir -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mmkv demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider
