# thrift-sidecar — the whole set-up on a fresh machine is `make demo` and `make test`.
# Everything heavy is cached outside the repository (pip cache, Go module cache,
# $(CACHE)); the venv lives in .venv (ignored by git).

PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
CACHE  ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/thrift-sidecar
STAMP  := $(VENV)/.installed
TEST_STAMP := $(VENV)/.installed-test
GEN    := tests/gen
GOCLIENT := $(CACHE)/bin/sidecar-test-client
PYTEST_ARGS ?=

.PHONY: demo test deps test-deps thrift-compiler chromium jaeger gen go-client bench clean

demo: deps
	$(VENV)/bin/thrift-sidecar demo

test: test-deps gen go-client jaeger chromium
	SIDECAR_GO_CLIENT=$(GOCLIENT) $(PY) -m pytest $(PYTEST_ARGS)

# `deps`: what the sidecar runs with (make demo); `test-deps` adds the test tools (make test).
deps: $(STAMP)
test-deps: $(TEST_STAMP)

$(STAMP): pyproject.toml setup.py $(wildcard proxy/*.c proxy/codec/*.c)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q -e .
	touch $@

$(TEST_STAMP): $(STAMP)
	$(PIP) install -q -e '.[test]'
	touch $@

APT_INSTALL = if [ "$$(id -u)" = 0 ]; then SUDO=; else SUDO=sudo; fi; \
	  $$SUDO apt-get update -qq && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq

# Headless Chromium renders the hops waterfall in tests (Debian's package).
chromium:
	@command -v chromium >/dev/null 2>&1 || { echo "installing Debian's chromium"; $(APT_INSTALL) chromium; }

# A real Jaeger v2 for end-to-end tests, built from the Go module proxy and cached outside the repo.
jaeger:
	CACHE=$(CACHE) tools/jaeger/build.sh >/dev/null

# The Thrift compiler generates the test services' code from IDL (Debian's package).
thrift-compiler:
	@command -v thrift >/dev/null 2>&1 || { echo "installing Debian's thrift-compiler"; $(APT_INSTALL) thrift-compiler; }

gen: thrift-compiler $(GEN)/.stamp

$(GEN)/.stamp: tests/idl/sidecar_test.thrift
	rm -rf $(GEN) && mkdir -p $(GEN)
	thrift --gen py -out $(GEN) tests/idl/sidecar_test.thrift
	touch $@

# A second language's real Thrift client (Go), built into the cache outside the repo.
go-client: thrift-compiler
	CACHE=$(CACHE) tests/interop/go/build.sh $(GOCLIENT)

bench: deps
	bench/run.sh $(BENCH_ARGS)

# A bounded 10-minute soak: mixed calls while upstreams restart at random; 0 lost idempotent
# calls, the proxy's RSS and open fds steady (tests/test_soak.py runs 60 s of it in `make test`).
.PHONY: soak
soak: deps gen
	$(PY) tools/soak.py --duration 600

# A long fuzz of the codec (~15 min on 2 cores): FUZZ_INPUTS inputs, half for the unframed
# scanner (compiled vs pure, step by step), half decoder streams over every framing and protocol
# (the codec invariant), then the Hypothesis properties of tests/test_scanner_compiled.py with
# FUZZ_EXAMPLES examples each. Inputs with new outcomes (and failures) go to tests/fuzz_corpus/,
# which `make test` replays.
FUZZ_INPUTS ?= 1000000
FUZZ_EXAMPLES ?= 20000
.PHONY: fuzz
fuzz: test-deps gen
	$(PY) tests/fuzz_codec.py --inputs $(FUZZ_INPUTS)
	HYPOTHESIS_PROFILE=fuzz FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(PY) -m pytest -q -p no:cacheprovider \
	  tests/test_scanner_compiled.py -k "fuzzed_input or either_scanner"

clean:
	rm -rf $(VENV) $(GEN) build *.egg-info
