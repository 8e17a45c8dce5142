# Every target creates or reuses .venv by itself, so a fresh clone needs nothing but python3 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU wheel of this release lies on the build machines' disk; a looser pin downloads gigabytes.
TORCH_PIN ?= torch==2.13.0
STUDY ?= demo
PYTEST_ARGS ?=

.PHONY: install system-deps test sweep bench lint dashboard status best clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_PIN)"
	$(PY) -m pip install -q -e '.[dev]'
	touch $(STAMP)

# The dashboard tests drive Debian's headless Chromium; install it where we may (root with apt-get).
system-deps:
	@if ! command -v chromium >/dev/null 2>&1; then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; \
		else \
			echo "warning: chromium is missing; install Debian's chromium package for the dashboard tests" >&2; \
		fi; \
	fi

test: $(STAMP) system-deps
	$(PY) -m pytest -q $(PYTEST_ARGS)

# The cost check prints nothing unless the spec's cap is exceeded; with-db resolves the study database
# from AWS Secrets Manager or a file where the cluster is set up so (docs/aws.md), else passes through.
sweep: $(STAMP)
	$(PY) -m infra cost $(STUDY) --check
	$(PY) -m infra with-db -- $(PY) -m sweep run $(STUDY)

status: $(STAMP)
	$(PY) -m sweep status $(STUDY)

best: $(STAMP)
	$(PY) -m sweep best $(STUDY)

bench: $(STAMP)
	$(PY) -m bench

lint: $(STAMP)
	$(VENV)/bin/ruff check .

clean:
	rm -rf runs/ .pytest_cache

# -- AWS (docs/aws.md) --------------------------------------------------------------------------
INFRA := $(PY) -m infra
NEED ?= trn2.3xlarge=8
CLUSTER ?= trnsweep
SSH_CIDR ?=
DB_SECRET ?=
RENDER_ARGS ?=

.PHONY: infra-check infra-capacity infra-cost infra-bucket infra-sg infra-iam infra-render infra-db-url

infra-check: $(STAMP)
	$(INFRA) check --need $(NEED) $(if $(DB_SECRET),--db-secret $(DB_SECRET))

infra-capacity: $(STAMP)
	$(INFRA) capacity --need $(NEED)

infra-cost: $(STAMP)
	$(INFRA) cost $(STUDY)

infra-bucket: $(STAMP)
	$(INFRA) bucket

infra-sg: $(STAMP)
	$(INFRA) security-group --cluster-name $(CLUSTER) --ssh-cidr $(SSH_CIDR)

infra-iam: $(STAMP)
	$(INFRA) iam $(if $(DB_SECRET),--db-secret $(DB_SECRET))

infra-render: $(STAMP)
	$(INFRA) render-cluster --cluster-name $(CLUSTER) $(RENDER_ARGS)

infra-db-url: $(STAMP)
	$(INFRA) db-url --check
