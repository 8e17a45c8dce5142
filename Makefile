# Every target creates or reuses .venv by itself, so a fresh clone needs nothing but python3 and make.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# The CPU wheel of this release lies on the build machines' disk; a looser pin downloads gigabytes.
# trn2 workers do not use it: they take torch 2.14.0 from the TorchNeuron DLAMI's venv (the pinned Neuron
# set, sweep/neuron/versions.py); 2.13.0 is itself a TorchNeuron torch (docs/neuron.md, "Install").
TORCH_PIN ?= torch==2.13.0
STUDY ?= demo
PYTEST_ARGS ?=
# make test runs the suite on two pytest-xdist workers, each test module on one worker (its module fixtures, a
# sweep or a kit, are built once); each worker has its own Ray head and session fixtures. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2

.PHONY: install system-deps test faults faults-full sweep compare-demo preflight bench lint dashboard job status best clean \
	clean-studies

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
	$(PY) -X faulthandler -m pytest -q $(if $(filter-out 0,$(TEST_WORKERS)),-n $(TEST_WORKERS) --dist loadscope) \
	  $(PYTEST_ARGS)

# The cost check prints nothing unless the spec's cap is exceeded; with-db resolves the study database
# from AWS Secrets Manager or a file where the cluster is set up so (docs/aws.md), else passes through.
# Each fault injected into a real sweep (PostgreSQL, local Ray), then the same checks; prints a table.
faults: $(STAMP)
	FAULTS_FULL=1 $(PY) -X faulthandler -m pytest -q -m faults tests/faults/test_faults.py

# Only the rows make test leaves to FAULTS_FULL=1 (the gRPC proxy's restart and outage, the GCS kill, the node
# removal): what .ci/run adds after make test, so CI runs every row.
faults-full: $(STAMP)
	FAULTS_FULL=1 $(PY) -X faulthandler -m pytest -q -m faults_full tests/faults/test_faults.py

sweep: $(STAMP)
	$(PY) -m infra cost $(STUDY) --check
	$(PY) -m infra with-db -- $(PY) -m sweep run $(STUDY)

# Does a change help? script-demo's train.py against a copy with one constant changed (LEARNING_RATE 0.003 ->
# 0.01), paired seeds on two local Ray nodes, until the sequential decision says ADOPT or DISCARD (docs/compare.md).
# On one 2-core machine the two nodes' runs share its cores, so step counts vary more than on a trn2 node with a
# chip to itself: the demo lets a pair's sides differ by 35% in steps before calling it confounded (10% by default),
# and states its noise (a paired sd of 0.01 val_bpb at 15 s on the CPU, against the competition's 0.0007).
COMPARE_CAND := runs/compare-demo/train.py
compare-demo: $(STAMP)
	@mkdir -p $(dir $(COMPARE_CAND))
	sed 's/^LEARNING_RATE = .*/LEARNING_RATE = 0.01  # the one change compare-demo tries/' \
	  sweep/studies/script-demo/train.py > $(COMPARE_CAND)
	$(PY) -m sweep compare sweep/studies/script-demo/train.py $(COMPARE_CAND) --spec script-demo --local-nodes 2 \
	  --min-effect 0.01 --noise-sd 0.01 --max-runs 12 --step-tolerance 0.35

# Prove this trn2 node in a few minutes before a study spends anything (docs/neuron.md, "Preflight"):
# make preflight STUDY=phase1. Exit 1 names the first failed check and its fix. Where the spec trains on
# CUDA (make preflight STUDY=cuda-probe on a GPU node) the CUDA set runs instead, with a throughput probe.
preflight: $(STAMP)
	$(PY) -m sweep preflight $(STUDY)

# optuna-dashboard on the study's storage, at http://127.0.0.1:8080 (ssh -L from a laptop on a cluster).
dashboard: $(STAMP)
	$(PY) -m infra with-db -- $(PY) -m sweep dashboard $(STUDY)

# The commit of the code shipped to the cluster (Ray leaves .git out of a job's working dir).
GIT_COMMIT = $(shell c=$$(git rev-parse HEAD 2>/dev/null) && { git diff --quiet HEAD || c=$$c-dirty; echo $$c; })

# One ad-hoc trial on a running Ray head, recorded in STUDY: make job STUDY=phase1 PARAMS='{"depth": 12}'
# [BUDGET=seconds] [NOW=1: run it at once rather than in a running sweep's next free slot]
# [PRUNABLE=1: the study's pruner may stop it, like a trial of the sweep].
# The head: RAY_API_SERVER_ADDRESS (or RAY_ADDRESS) = http://HEAD:8265; with token auth, its token in
# ~/.ray/auth_token or RAY_AUTH_TOKEN, and RAY_AUTH_MODE=token.
job: $(STAMP)
	@test -n '$(PARAMS)' || { echo "make job: PARAMS='{...}' is required" >&2; exit 2; }
	$(VENV)/bin/ray job submit --working-dir . \
	  --runtime-env-json '{"env_vars": {"SWEEP_GIT_COMMIT": "$(GIT_COMMIT)"}}' \
	  -- python -m sweep trial --study $(STUDY) --params '$(PARAMS)' \
	  $(if $(BUDGET),--budget-s $(BUDGET)) $(if $(NOW),--now) $(if $(PRUNABLE),--prunable)

status: $(STAMP)
	$(PY) -m sweep status $(STUDY)

best: $(STAMP)
	$(PY) -m sweep best $(STUDY)

bench: $(STAMP)
	$(PY) -m bench

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# Caches only: every study (runs/optuna-journal.log) and artifact (runs/artifacts/) stays. The worked example's
# kit data (sweep/studies/script-demo/data, tokenizer: its `python prepare.py`) is a cache too.
clean:
	rm -rf .pytest_cache .ruff_cache .hypothesis runs/cache runs/scratch
	rm -rf sweep/studies/*/data sweep/studies/*/tokenizer sweep/studies/*/.kit-ready* sweep/studies/*/.kit-manifest.json
	rm -rf sweep/studies/kit-demo/out sweep/studies/kit-demo/.setup.lock
	find . -path ./$(VENV) -prune -o -name __pycache__ -type d -prune -exec rm -rf {} +

# Everything under runs/ but the cluster configs (runs/aws/, which `ray down` needs): the embedded study store,
# every trial's artifacts and checkpoints, the data caches. It says what goes before it goes.
clean-studies:
	@gone=$$(ls -d runs/* runs/.[!.]* 2>/dev/null | grep -v '^runs/aws$$'); \
	if [ -z "$$gone" ]; then echo "clean-studies: nothing under runs/ to remove"; exit 0; fi; \
	echo "clean-studies removes every study and artifact under runs/ (runs/aws/ stays):"; \
	du -sh $$gone | sed 's/^/    /'; \
	rm -rf $$gone; \
	echo "removed"

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
