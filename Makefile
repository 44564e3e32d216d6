# kvrelay — run `make help` for the targets.
GO        ?= go
BIN       ?= bin/kvrelay
PKGS      ?= ./...
FUZZTIME  ?= 10s
BENCHTIME ?= 1s
export GOFLAGS ?= -buildvcs=false

.DEFAULT_GOAL := help

.PHONY: help
help: ## show this help
	@awk 'BEGIN {FS = ":.*## "} /^[a-zA-Z_-]+:.*## / {printf "  \033[36m%-10s\033[0m %s\n", $$1, $$2}' $(MAKEFILE_LIST)

.PHONY: build
build: ## build bin/kvrelay
	$(GO) build -o $(BIN) ./cmd/kvrelay

.PHONY: run
run: build ## start the embedded default (kvrelay up) on loopback; Ctrl-C stops it
	./$(BIN) up

.PHONY: test
test: ## run every test with the race detector
	$(GO) vet $(PKGS)
	$(GO) test -race -timeout 14m $(PKGS)
	@if command -v gcc >/dev/null 2>&1; then $(GO) test -race -tags nvml ./ebpf/gpu; else echo "ebpf/gpu: no C compiler, NVML tests (-tags nvml) skipped"; fi

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
verify: ## fail on unformatted code, vet findings or generated code that drifted
	@out=$$(gofmt -l $$(git ls-files '*.go')); if [ -n "$$out" ]; then echo "gofmt needed:"; echo "$$out"; exit 1; fi
	$(GO) vet $(PKGS)
	./hack/verify-generated.sh
