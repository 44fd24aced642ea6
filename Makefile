# The two commands: `make run` (set up, then the whole pipeline on the digits sample) and
# `make test` (set up, then the test suite); `make serve` brings the servers up for the Prefect UI
# and schedules; `make bench` runs the benchmarks. Set-up is keyed on
# the lock file: a changed lock builds a fresh virtual environment, an unchanged one is reused.

PYTHON ?= python3
VENV ?= .venv
LOCK := requirements.lock
KEY := $(shell cat $(LOCK) pyproject.toml | sha256sum | cut -c1-16)
STAMP := $(VENV)/.installed-$(KEY)
BIN := $(VENV)/bin
# The environment's bin folder on PATH for its own Python processes (imageops-venv-bin.pth): MLflow's
# `mlflow models serve` starts `uvicorn` by name. Copied here, not installed by pip: setuptools'
# editable installs leave out data files (pypa/setuptools#3399).
PATH_HOOK := $(VENV)/lib/python3.11/site-packages/imageops-venv-bin.pth

.PHONY: screenshots install run serve test lint format docs bench clean

install: $(STAMP) $(PATH_HOOK)
	@# A cached environment (CI keeps one per lock) may hold the editable install of another
	@# clone: its subprocesses (torchrun, the CLI) would run that clone's code. Point it here.
	@$(BIN)/python -I -c "import app, pathlib, sys; \
	sys.exit(pathlib.Path(app.__file__).resolve().parents[1] != pathlib.Path('$(CURDIR)').resolve())" \
	2>/dev/null || $(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --editable .

$(PATH_HOOK): imageops-venv-bin.pth | $(STAMP)
	cp imageops-venv-bin.pth $@

# No file-time prerequisites: the stamp's name holds the content key, so a fresh clone (new file
# times, same content) keeps a working environment, and a changed lock gets a new one.
$(STAMP):
	rm -rf $(VENV)
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	# Exact versions from the lock; torch and torchvision come from the machine's wheel store.
	$(BIN)/python -m pip install --quiet --requirement $(LOCK)
	$(BIN)/python -m pip install --quiet --no-deps --no-build-isolation --editable .
	touch $@

run: install
	$(BIN)/imageops run

# The whole stack on localhost (Prefect server + worker, MLflow server, promotion receiver, every
# deployment); Ctrl-C stops it.
serve: install
	$(BIN)/imageops serve

# One pytest worker per core: the slow tests mostly wait on processes and servers. A test module
# goes whole to one worker (loadscope): its module-scoped servers and clusters start once, not once
# per worker (work stealing split test_cluster_hosts and started its two hosts, S3, MLflow,
# Prefect and Ray twice). The modules go out longest first (tests/module_seconds.txt), the Ray
# modules as one unit (tests/conftest.py): 790 to 801 s on 2 cores on 2026-11-27 (see docs/tests.md).
test: install
	$(BIN)/python -m pytest -n auto --dist loadscope --no-loadscope-reorder

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# The documentation site (mkdocs.yml) into site/, strict: a broken link, a missing anchor or page
# fails it. The home page is the README; the CLI reference is generated from the commands.
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# The docs' screenshots (docs/img/prefect-*.png, mlflow-*.png), taken by the browser tests of
# tests/test_stack.py as they pass (Debian's chromium; about 8 minutes on 2 cores).
screenshots: install
	IMAGEOPS_SCREENSHOTS=$(CURDIR)/docs/img $(BIN)/python -m pytest -p no:randomly tests/test_stack.py

# Every benchmark in bench/, each in a fresh process; writes the results table into
# docs/benchmarks.md and the plots into docs/img/. Quick by default (about 18 minutes on 2 cores);
# `make bench FULL=1` uses real sizes and more repeats.
bench: install
	$(BIN)/python -m bench $(if $(FULL),--full)

clean:
	rm -rf .imageops data/raw data/digits data/repro
