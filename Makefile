# go-nvml's cgo headers use deprecated declarations; keep the build quiet.
export CGO_CFLAGS := -Wno-deprecated-declarations

GO ?= go
BIN := bin/gpu-agent
# Where `make run` keeps its sockets and state, so it needs no root.
RUN_DIR ?= $(CURDIR)/.run
# Where `make run` serves /status, /metrics and /sim (README's Quick start
# curls it); test/deploy runs the Quick start on a free port.
LISTEN ?= 127.0.0.1:9400

.PHONY: all build test unit lint fmt bench run clean-run fuzz fuzz-short simulation sim-transcript clean e2e e2e-k8s134 e2e-rack image deploy-test fleet-bench

all: build

IMAGE ?= ghcr.io/gpu-agent/gpu-agent
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
# `gpu-agent version`, /status and gpu_agent_build_info report them; the Go
# version comes from the binary's build info, and so does the commit where
# the build stamped VCS information.
COMMIT ?= $(shell git rev-parse HEAD 2>/dev/null)
LDFLAGS := -X main.version=$(VERSION) -X main.commit=$(COMMIT)

# -v lists each package as it is compiled: a cold build compiles a few
# hundred (Kubernetes, gRPC) for minutes on two cores, a warm one none.
# go-nvml is cgo: with CGO_ENABLED=0 (or no C compiler, which turns cgo off)
# it fails deep inside with "undefined: Return". Say so before that.
build:
	@if [ "$$($(GO) env CGO_ENABLED)" != 1 ]; then \
		echo "gpu-agent needs cgo (go-nvml binds libnvidia-ml through it): build with CGO_ENABLED=1 and a C compiler ($$($(GO) env CC)) on PATH" >&2; exit 1; fi
	@echo "building $(BIN) $(VERSION) (a first build compiles every dependency: minutes on two cores)"
	$(GO) build -v -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/gpu-agent

# The README's test command; .ci/run calls exactly this. e2e needs root (it
# runs a real kubelet and containerd) and installs its Debian packages.
# Every fuzz target's seeds and testdata/fuzz corpus run in `make unit`;
# fuzzing itself (make fuzz, fuzz-short) is not part of it: its instrumented
# build of every dependency cost 5 1/2 minutes of a cold run.
test: lint unit deploy-test e2e

# The e2e module is vetted without cgo, as run.sh builds Kubernetes and runs
# the suite: one compile of the Kubernetes packages serves all three.
lint:
	@out="$$(gofmt -l .)"; \
	if [ -n "$$out" ]; then echo "gofmt needed on:"; echo "$$out"; exit 1; fi
	$(GO) vet ./...
	cd test/bench && $(GO) vet ./...
	cd test/e2e && CGO_ENABLED=0 $(GO) vet -tags e2e ./... && CGO_ENABLED=0 $(GO) vet -tags e2e,k8s134 ./...
	cd test/deploy && $(GO) vet ./...

unit:
	$(GO) test -race -count=1 -timeout 30m ./...

# Allocate against live MIG repartitions, for real and at length (make unit
# runs 20 flips): about 10 minutes on 2 cores.
HAMMER_FLIPS ?= 500
hammer:
	$(GO) test -count=1 -run '^TestAllocateHammer$$' -timeout 1h ./agent -hammer.flips=$(HAMMER_FLIPS) -v

# The image needs a Docker engine (not on these machines); test/deploy checks
# the Dockerfile instead.
image:
	docker build --build-arg VERSION=$(VERSION) --build-arg COMMIT=$(COMMIT) -t $(IMAGE):$(VERSION) .

# Install artefacts: manifests and chart variants decoded strictly, examples
# validated, the Dockerfile checked, the DaemonSet's own args run on a sim.
# Without -race: these tests hold no concurrent code of the agent's (make
# unit races all of it), and a race build of Helm and Kubernetes 1.37 for
# them alone cost minutes of a cold run; without it they reuse what make
# lint compiled to vet them.
deploy-test:
	@command -v curl >/dev/null || { echo "deploy-test: installing curl (README's Quick start, which test/deploy runs, uses it)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends curl >/dev/null; }
	cd test/deploy && $(GO) test -count=1 ./...

# A real kubelet (built from k8s.io/kubernetes, cached) with containerd and
# runc starts static pods that request gpu-agent's resources.
e2e:
	cd test/e2e && ./run.sh

# The e2e tests that make sense on Kubernetes 1.34, the version managed
# clusters run (DRA v1; partitionable devices, consumable capacity,
# extended-resource mapping and device taints alpha and off), against a
# kubelet and control plane built from test/e2e/k8s134/go.mod: the device
# plugin on a 1.34 kubelet, the DaemonSet install, and DRA with whole GPUs
# and static MIG while the API server drops the rest (k8s134_test.go). Not
# part of `make test`: the 1.34 build costs 13 minutes on 2 busy cores with
# the 1.36 build's Go cache, about 25 from nothing (then cached in
# ~/.cache/gpu-agent-e2e; a warm run takes 1-2 minutes). Root, like e2e.
E2E_K8S134_TESTS ?= ^(TestOneGPU|TestExhaustionAndReuse|TestKubeletRestart|TestClusterDaemonSetServesGPUs|TestClusterK8s134DRA)$$
e2e-k8s134:
	cd test/e2e && E2E_K8S=1.34 ./run.sh -run '$(E2E_K8S134_TESTS)'

# A ComputeDomain across a whole NVL72 rack (TestComputeDomainRack, docs/compute-domains.md): 18 sim GB200
# trays of one clique and two more nodes, 20 gpu-agent processes with the controller on a real control plane
# (no kubelet), 18 pods with their channel claims, one tray failing, and the domain deleted. Not part of
# `make test`: 108 to 128 s on 2 busy cores, 43 to 72 of them the pod garbage collector's wait for the failed Node's pod.
# Root, like e2e (run.sh).
e2e-rack:
	cd test/e2e && E2E_COMPUTE_DOMAIN_RACK=1 ./run.sh -run '^TestComputeDomainRack$$'

# Fleet-scale DRA scheduling (issue 28): the ResourceSlices the agent publishes on sim:$(FLEET_PROFILE), per
# device model, copied onto FLEET_NODES fake Nodes of a control plane of its own (etcd, kube-apiserver and
# kube-scheduler from test/e2e/run.sh's cache, built there when missing), and FLEET_PODS pods with a claim
# each timed until bound, beside whole GPUs without counters. Not part of `make test`; no root. The table
# goes to stdout and FLEET_OUT; see test/e2e/README.md (about 18 minutes on 2 cores at the defaults, a third
# of it MIG on demand on counters on 1.36, which spends its limit at 500 nodes; FLEET_NODES=100 FLEET_MODELS=default FLEET_CLAIMS=1gpu: 2 minutes).
FLEET_NODES ?= 100 500
FLEET_PODS ?= 100
FLEET_ROUNDS ?= 5
FLEET_MODELS ?= default static-mig static-mig-lean static-mig-nvidia-shape time-sliced mig-on-demand mig-every-placement
FLEET_CLAIMS ?= 1gpu mig-1g 2gpu-nvlink
FLEET_PROFILE ?= dgx-h100
FLEET_LIMIT ?= 60s
FLEET_OUT ?= $(CURDIR)/bin/fleet-bench.md
FLEET_ARGS ?=
# FLEET_K8S=1.37 runs the API server and scheduler of Kubernetes 1.37 (test/e2e/k8s137; a first build takes about
# 15 minutes on 2 cores, then cached), whose allocator no longer pays for every node's counters on every node;
# empty: the version in test/e2e/go.mod (1.36).
FLEET_K8S ?=
fleet-bench: build
	cd test/e2e && bins="$$(E2E_K8S='$(FLEET_K8S)' E2E_BUILD_ONLY='etcd kube-apiserver kube-scheduler' ./run.sh)" && eval "$$bins" && \
		$(GO) run ./cmd/fleet-bench -agent $(CURDIR)/$(BIN) -profile $(FLEET_PROFILE) -nodes '$(FLEET_NODES)' \
			-pods $(FLEET_PODS) -rounds $(FLEET_ROUNDS) -models '$(FLEET_MODELS)' -claims '$(FLEET_CLAIMS)' -limit $(FLEET_LIMIT) \
			-out $(FLEET_OUT) $(FLEET_ARGS)

fmt:
	gofmt -w $$(git ls-files '*.go')

bench:
	$(GO) test -run '^$$' -bench . -benchmem ./...

# Every fuzz target, as package:Target: each decoder of outside or persisted
# bytes. Their seeds and testdata/fuzz corpora also run in every `go test`.
FUZZ_TARGETS := \
	./agent:FuzzCordonAnnotation \
	./agent:FuzzDecodeAllocLog \
	./agent:FuzzDecodeCheckpoint \
	./cdi:FuzzParseMigMinors \
	./config:FuzzConfigMapManifest \
	./config:FuzzParse \
	./config:FuzzParseConfigMap \
	./dra/devicemodel:FuzzDecodeConfig \
	./dra/schedsim:FuzzRead \
	./gpu:FuzzNormalizeBusID \
	./gpu:FuzzPCIeRootOfLink \
	./gpu:FuzzReadJSON \
	./gpu/sim:FuzzHTTPHandler \
	./gpu/sim:FuzzLoadState \
	./mig:FuzzJournal \
	./mps:FuzzCarriesLimits \
	./mps:FuzzParseDesiredFile \
	./mps:FuzzParseHealthFile \
	./mps:FuzzParsePID \
	./mps/simdaemon:FuzzCommand \
	./stateformat:FuzzDecode \
	./timeslice:FuzzParent

# Fuzzes each target for FUZZTIME. go test fuzzes one target of one package
# per run. A new input that widens coverage is shrunk for at most
# FUZZMINTIME (default 60s), which would eat a short run.
FUZZTIME ?= 30s
FUZZMINTIME ?= 5s
# Go 1.26's fuzz coordinator can report its own -fuzztime deadline as a
# failure ("context deadline exceeded", no failing input: golang/go#75804,
# fixed in Go 1.27), mostly on busy cores: such a run is tried once more; a
# run that wrote a failing input, or fails again, fails the target.
fuzz:
	@for t in $(FUZZ_TARGETS); do \
		set -- -run '^$$' -fuzz "^$${t#*:}\$$" -fuzztime $(FUZZTIME) -fuzzminimizetime $(FUZZMINTIME) "$${t%%:*}"; \
		echo "$(GO) test $$*"; \
		for try in 1 2; do \
			out="$$($(GO) test "$$@" 2>&1)"; rc=$$?; echo "$$out"; \
			[ $$rc = 0 ] && break; \
			if [ $$try = 1 ] && echo "$$out" | grep -q 'context deadline exceeded' && ! echo "$$out" | grep -q 'Failing input written'; then \
				echo "fuzz: $$t: the fuzz coordinator's own deadline (golang/go#75804), no failing input: once more"; continue; \
			fi; \
			exit 1; \
		done; \
	done

# A few seconds of each target: about two minutes on two cores once the
# instrumented test binaries are built, five more cold.
fuzz-short:
	@$(MAKE) --no-print-directory fuzz FUZZTIME=4s FUZZMINTIME=1s

# The simulation (TestSimulation, agent/simulation_test.go) for SIM_SEEDS
# seeds of SIM_STEPS operations from seed SIM_FROM (a sweep in chunks);
# `make unit` runs 200 of 20. A failing seed prints its sequence and how to
# replay it. About 10 minutes on two idle cores, 26 on two shared with
# other work (TMPDIR on a tmpfs saves a third: the agent and the simulated
# GPUs fsync their state).
SIM_SEEDS ?= 10000
SIM_STEPS ?= 60
SIM_FROM ?= 0
simulation:
	$(GO) test -run '^TestSimulation$$' -count=1 -timeout 2h -v ./agent -sim.from=$(SIM_FROM) -sim.seeds=$(SIM_SEEDS) -sim.steps=$(SIM_STEPS)

# One seed as a transcript a person can follow (like etcd raft's
# datadriven files): each operation, then what it changed: NVML (MIG mode,
# MIG devices per GPU), what the device plugin and the DRA pool offer, who
# holds what, the agent's ledger (claims, intents, releases, doomed), and
# the violation, if any, at the end: make sim-transcript SEED=1047
# (SIM_STEPS as the sweep that found it; TRANSCRIPT=FILE).
SEED ?= 0
TRANSCRIPT ?= sim-$(SEED).txt
sim-transcript:
	$(GO) test -run '^TestSimulation$$' -count=1 ./agent -sim.seed=$(SEED) -sim.steps=$(SIM_STEPS) -sim.transcript=$(abspath $(TRANSCRIPT)) || true
	@echo "transcript of seed $(SEED): $(TRANSCRIPT)"

# Runs the agent on a simulated DGX A100 with its sockets, its state and the
# GPUs' state under $(RUN_DIR); CONFIG=FILE gives it a config.
CONFIG ?=
run: build
	mkdir -p $(RUN_DIR)/device-plugins $(RUN_DIR)/state $(RUN_DIR)/mps
	@echo "running the agent on sim:dgx-a100 (GPU and agent state in $(RUN_DIR); 'make clean-run' starts over)"
	$(BIN) run --backend sim:dgx-a100,state=$(RUN_DIR)/sim-state.json \
		--device-plugin-dir $(RUN_DIR)/device-plugins \
		--pod-resources-socket $(RUN_DIR)/pod-resources.sock \
		--state-dir $(RUN_DIR)/state --mps-root $(RUN_DIR)/mps \
		--listen $(LISTEN) $(if $(CONFIG),--config $(CONFIG))

# Starts `make run` over: the simulated GPUs' state and the agent's own
# (its checkpoint would restore the health causes of the old GPUs), after
# quitting the stand-in MPS daemons, which outlive the agent as real ones do.
clean-run:
	@for p in $(RUN_DIR)/mps/*/pipe; do \
		[ -S "$$p/control" ] && [ -x $(BIN) ] || continue; \
		echo quit | CUDA_MPS_PIPE_DIRECTORY="$$p" CUDA_MPS_LOG_DIRECTORY="$${p%/pipe}/log" $(BIN) mps-control-sim || true; \
	done
	rm -rf $(RUN_DIR)

clean: clean-run
	rm -rf bin
