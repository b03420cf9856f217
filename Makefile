# The two commands of the README's quick start. Both create .venv (Python 3.11) and install mmkv into it first.
# --no-cache-dir: torch's CUDA wheels and their libraries are several GB; a pip cache would hold them a second time.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
STAMP := $(VENV)/.mmkv-installed

.PHONY: demo test install

# pip keeps every wheel it downloads until the install ends: a first install took 7.1 GiB of disk at its peak for the
# 5.4 GiB .venv it leaves (measured on a 2-core CPU machine), so it is refused up front with less than 8 GiB free,
# and pip's temporary files go beside .venv, on its disk, not to a /tmp that may be a small one of its own.
NEED_GIB := 8
PIP_TMP := $(abspath $(VENV))/.pip-tmp

$(STAMP): pyproject.toml
	test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	@$(VENV)/bin/python -c "import importlib.util, shutil, sys; \
	  free = shutil.disk_usage('$(VENV)').free / 2**30; \
	  sys.exit(0 if importlib.util.find_spec('torch') or free >= $(NEED_GIB) else \
	  f'make: {free:.1f} GiB free on the disk of $(abspath $(VENV)); installing torch with its CUDA libraries needs about $(NEED_GIB) GiB (free some space, or point VENV at another disk)')"
	mkdir -p $(PIP_TMP)
	TMPDIR=$(PIP_TMP) $(VENV)/bin/python -m pip install -q --no-cache-dir --upgrade pip 'setuptools>=68,<82' wheel
	TMPDIR=$(PIP_TMP) $(VENV)/bin/python -m pip install -q --no-cache-dir -e '.[test]'
	rm -rf $(PIP_TMP)
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mmkv demo

test: $(STAMP)
	$(VENV)/bin/python -m pytest -q -p no:cacheprovider
