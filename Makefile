# corral: `make serve` runs the supervisor, `make test` runs the whole suite.
# Both create .venv with Debian's /usr/bin/python3 (runners must be able to
# read their interpreter, so not a pyenv under /root) and install what is
# missing, with apt when root.

PYTHON ?= /usr/bin/python3
VENV := .venv
APT_PACKAGES := python3 python3-venv bubblewrap util-linux iproute2
SYSTEM_STAMP := $(VENV)/.system-packages
SERVE_STAMP := $(VENV)/.installed-serve
TEST_STAMP := $(VENV)/.installed-test
PYTEST_ARGS ?=

.PHONY: serve test check bench clean system-packages

serve: $(SERVE_STAMP)
	$(VENV)/bin/corral serve

check: $(SERVE_STAMP)
	$(VENV)/bin/corral check

test: $(TEST_STAMP)
	$(VENV)/bin/python -m pytest $(PYTEST_ARGS)

bench: $(TEST_STAMP)
	cd $(CURDIR) && $(VENV)/bin/python bench/run_all.py

system-packages:
	@missing=""; \
	for p in $(APT_PACKAGES); do \
		dpkg-query -W -f='$${Status}\n' $$p 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing$$missing"; \
			DEBIAN_FRONTEND=noninteractive apt-get update -q && \
			DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends $$missing; \
		else \
			echo "warning: missing$$missing (run as root to install them with apt)"; \
		fi; \
	fi

$(SYSTEM_STAMP):
	$(MAKE) system-packages
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q --upgrade pip
	touch $@

$(SERVE_STAMP): $(SYSTEM_STAMP) setup.cfg pyproject.toml
	$(VENV)/bin/python -m pip install -q -e .
	touch $@

$(TEST_STAMP): $(SYSTEM_STAMP) setup.cfg pyproject.toml
	$(VENV)/bin/python -m pip install -q -e '.[test]'
	touch $@ $(SERVE_STAMP)

clean:
	rm -rf $(VENV) build *.egg-info
