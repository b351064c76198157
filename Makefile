# The two set-up commands: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --disable-pip-version-check -q -c requirements.lock

TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres
TEST_REDIS_URL ?= redis://127.0.0.1:6379/1

.PHONY: demo test install install-dev chromium check-services lint bench bench-billing \
        bench-verification clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(VENV)/.installed: $(BIN)/python pyproject.toml requirements.lock
	$(PIP) -e '.[platform]'
	@touch $@

$(VENV)/.installed-dev: $(VENV)/.installed
	$(PIP) -e '.[platform,dev]'
	@touch $@

install: $(VENV)/.installed
install-dev: $(VENV)/.installed-dev

demo: install
	@bash scripts/demo.sh

# Debian's chromium for the browser tests; Playwright drives it through executablePath.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "Installing Debian's chromium for the browser tests..."; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

check-services: install-dev
	@DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python scripts/check_services.py

test: install-dev chromium check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/pytest $(PYTEST_ARGS)

lint: install-dev
	$(BIN)/ruff check .

bench: install-dev check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/catalog.py
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/billing.py $(BENCH_ARGS)
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/verification.py

# Reserve+settle pairs/s and latency with 32 clients; BENCH_ARGS="--duration 5" for a quick run.
bench-billing: install-dev check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/billing.py $(BENCH_ARGS)

# The planted-fault fleet verified end to end: recall on liars, false flags on honest cards.
bench-verification: install-dev check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/verification.py

clean:
	rm -rf $(VENV) db.sqlite3 var staticfiles
