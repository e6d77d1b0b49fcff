# go-nvml's cgo headers use deprecated declarations; keep the build quiet.
export CGO_CFLAGS := -Wno-deprecated-declarations

GO ?= go
BIN := bin/gpu-agent
# Where `make run` keeps its sockets and state, so it needs no root.
RUN_DIR ?= $(CURDIR)/.run

.PHONY: all build test unit lint fmt bench run fuzz clean e2e image deploy-test

all: build

build:
	$(GO) build -o $(BIN) ./cmd/gpu-agent

# The README's test command; .ci/run calls exactly this. e2e needs root (it
# runs a real kubelet and containerd) and installs its Debian packages.
test: lint unit deploy-test e2e

lint:
	@out="$$(gofmt -l .)"; \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	cd test/bench && $(GO) vet ./...
	cd test/e2e && $(GO) vet -tags e2e ./...
	cd test/deploy && $(GO) vet ./...

unit:
	$(GO) test -race -count=1 ./...

IMAGE ?= ghcr.io/gpu-agent/gpu-agent
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)

# The image needs a Docker engine (not on these machines); test/deploy checks
# the Dockerfile instead.
image:
	docker build --build-arg VERSION=$(VERSION) -t $(IMAGE):$(VERSION) .

# Install artefacts: manifests and chart variants decoded strictly, examples
# validated, the Dockerfile checked, the DaemonSet's own args run on a sim.
deploy-test:
	cd test/deploy && $(GO) test -race -count=1 ./...

# A real kubelet (built from k8s.io/kubernetes, cached) with containerd and
# runc starts static pods that request gpu-agent's resources.
e2e:
	cd test/e2e && ./run.sh

fmt:
	gofmt -w $$(git ls-files '*.go')

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

# Short fuzzing of every parser of outside input (the seed corpora also run
# in every `go test`).
FUZZTIME ?= 30s
fuzz:
	$(GO) test -run '^$$' -fuzz FuzzParse -fuzztime $(FUZZTIME) ./config
	$(GO) test -run '^$$' -fuzz FuzzNormalizeBusID -fuzztime $(FUZZTIME) ./gpu
	$(GO) test -run '^$$' -fuzz FuzzParent -fuzztime $(FUZZTIME) ./timeslice
	$(GO) test -run '^$$' -fuzz FuzzParseMigMinors -fuzztime $(FUZZTIME) ./cdi

# Runs the agent on a simulated DGX A100 with its sockets and GPU state under $(RUN_DIR).
run: build
	mkdir -p $(RUN_DIR)/device-plugins $(RUN_DIR)/state $(RUN_DIR)/mps
	$(BIN) run --backend sim:dgx-a100,state=$(RUN_DIR)/sim-state.json \
		--device-plugin-dir $(RUN_DIR)/device-plugins \
		--pod-resources-socket $(RUN_DIR)/pod-resources.sock \
		--state-dir $(RUN_DIR)/state --mps-root $(RUN_DIR)/mps \
		--listen 127.0.0.1:9400

clean:
	rm -rf bin $(RUN_DIR)
