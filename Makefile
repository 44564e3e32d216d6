# kvrelay — run `make help` for the targets.
GO        ?= go
BIN       ?= bin/kvrelay
PKGS      ?= ./...
FUZZTIME  ?= 10s
BENCHTIME ?= 1s
export GOFLAGS ?= -buildvcs=false

.DEFAULT_GOAL := help

# The race detector needs cgo, and cgo a C compiler (hack/ci-deps.sh installs gcc).
RACE := $(shell command -v $${CC:-gcc} >/dev/null 2>&1 && echo -race)
# go-nvml's cgo calls deprecated NVML functions on purpose (older drivers): quiet.
NVML_CFLAGS := -O2 -g -Wno-deprecated-declarations

.PHONY: help
help: ## show this help
	@if [ -t 1 ]; then c='\033[36m'; r='\033[0m'; else c=; r=; fi; \
	awk -v c="$$c" -v r="$$r" 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  %s%-10s%s %s\n", c, $$1, r, $$2}' $(MAKEFILE_LIST)

# bin/kvrelay is built without the ELF symbol table and DWARF (-s -w, a quarter of the file;
# panics and pprof still name functions and lines) and with module-relative file names
# (-trimpath). `make build LDFLAGS=` keeps the symbols, for perf or a debugger.
LDFLAGS ?= -s -w
# kvrelay version names the commit built (GOFLAGS leaves the VCS stamp out).
COMMIT := $(shell git rev-parse --short=12 HEAD 2>/dev/null)

.PHONY: build
build: ## build bin/kvrelay (stripped; LDFLAGS= keeps symbols)
	$(GO) build -trimpath -ldflags '$(LDFLAGS) -X main.commit=$(COMMIT)' -o $(BIN) ./cmd/kvrelay

.PHONY: run
run: build ## start the embedded default (kvrelay up) on loopback; Ctrl-C stops it
	./$(BIN) up

.PHONY: test
test: ## run every test (with the race detector where a C compiler is), never from the cache
	$(GO) vet $(PKGS)
	@if [ -z "$(RACE)" ]; then echo "make test: no C compiler (gcc): running without the race detector; hack/ci-deps.sh installs one"; fi
	$(GO) test $(RACE) -count=1 -timeout 14m $(PKGS)
	@if [ -n "$(RACE)" ]; then CGO_CFLAGS="$(NVML_CFLAGS)" $(GO) test -race -count=1 -tags nvml ./ebpf/gpu; else echo "ebpf/gpu: no C compiler, NVML tests (-tags nvml) skipped"; fi

.PHONY: bench
bench: ## run the Go benchmarks (BENCHTIME=1s)
	$(GO) test -run '^$$' -bench . -benchmem -benchtime $(BENCHTIME) $(PKGS)

.PHONY: fuzz
fuzz: ## run each fuzz target for FUZZTIME (default 10s)
	FUZZTIME=$(FUZZTIME) ./hack/fuzz.sh

.PHONY: generate
generate: ## regenerate committed generated code and test fixtures that need no network
	./hack/gen-ebpf.sh # clang-14 for ebpf/probes; go generate ./... includes ./ebpf/...
	$(GO) generate ./...

.PHONY: verify
verify: ## fail on unformatted code, vet findings, imports across layers, generated code that drifted, tracked build outputs, big files and machine paths, or stale design citations and package docs
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	./hack/verify-layers.sh
	$(GO) run ./hack/verify-tree
	$(GO) run ./hack/verify-docs
	./hack/verify-generated.sh
