package agent

import (
	"cmp"
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log/slog"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"runtime"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"k8s.io/apimachinery/pkg/types"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/mig"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// A deterministic simulation of the node, in the spirit of FoundationDB's:
// each seed drives one agent through a random sequence of what happens to
// a GPU node (the kubelet allocating and releasing devices, the scheduler's
// claims prepared and unprepared, config and label edits, XIDs, NVML
// failures, crashes of the agent mid-change and restarts), and after every
// operation checks the invariants the allocation ledger exists for. The
// agent runs through the test harness: Step by hand on an injected clock,
// its background work run in order, a simulated node whose GPU state lives
// in a file (it outlives the agent, as real GPUs do). Nothing depends on
// wall-clock time, goroutines or map order, so a seed replays exactly:
//
//	go test -run '^TestSimulation$' ./agent                         # 200 seeds of 20 operations
//	go test -run '^TestSimulation$' ./agent -sim.from=K -sim.seeds=N  # seeds K to K+N-1
//	go test -run '^TestSimulation$' ./agent -sim.seed=K -sim.steps=N  # one seed, its sequence printed
//	go test -run '^TestSimulation$' ./agent -sim.seed=K -sim.log      # with the agent's log in it
//	go test -run '^TestSimulation$' ./agent -sim.seed=K -sim.transcript=FILE  # the state after each operation
//	make simulation                                                 # 10,000 seeds of 60 operations
//
// A seed that breaks an invariant fails the test with its whole sequence,
// one operation per line, and the violation: each kind of violation once,
// with its shortest sequence. A seed's sequence depends on its number and
// -sim.steps (the settling at the end moves).
//
// The default (200 seeds of 20 operations) takes about 27 s under -race
// on 2 cores, 5 s without.
var (
	simSeeds = flag.Int("sim.seeds", 200, "TestSimulation: run N seeds, from -sim.from")
	simFrom  = flag.Int("sim.from", 0, "TestSimulation: the first seed of -sim.seeds (a sweep in chunks)")
	simSeed  = flag.Int("sim.seed", -1, "TestSimulation: run this seed only, and print its sequence")
	simSteps = flag.Int("sim.steps", 20, "TestSimulation: operations per seed (then the node settles)")
	simLog   = flag.Bool("sim.log", false, "TestSimulation: log what the agent logs (with -sim.seed)")
	// simKnownOK lets the known issues pass (simKnown), so that seeds go
	// on to find others; -sim.known=false shows them.
	simKnownOK = flag.Bool("sim.known", true, "TestSimulation: let the known issues (simKnown) pass")
)

// simIssue is a violation the simulation found in the agent that is not
// fixed yet; its regress test (simulation_regress_test.go) shows it.
type simIssue struct {
	kind string // the violation's kind, as the invariant reports it
	test string // the regress test
	// during, when set, is when the issue shows: a violation of its kind
	// is the issue only then, and ends the seed (what follows would be
	// its consequences). Without it, violations of its kind are let pass
	// and the seed goes on.
	during func(s *simRun) bool
}

// noAnswerYet: the agent has had no answer from pod-resources since it
// started, so it knows only the allocations its log still has.
func noAnswerYet(s *simRun) bool { return s.h.a.ledger.Holders() == nil }

// simKnownEnd ends a seed at a known issue (simIssue.during).
type simKnownEnd string

// simKnown are the known issues: violations of these kinds are counted
// and let pass while -sim.known is true (the default).
var simKnown = []simIssue{}

// always: a known issue that ends the seed whenever it shows.
func always(*simRun) bool { return true }

func TestSimulation(t *testing.T) {
	seeds := make([]uint64, 0, *simSeeds)
	for s := range *simSeeds {
		seeds = append(seeds, uint64(*simFrom+s))
	}
	if *simSeed >= 0 {
		seeds = []uint64{uint64(*simSeed)}
	}
	base := t.TempDir()
	results := make([]simResult, len(seeds))
	work := make(chan int)
	var wg sync.WaitGroup
	for range min(runtime.GOMAXPROCS(0), len(seeds)) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := range work {
				results[i] = runSimulation(t, base, seeds[i], *simSteps, *simLog && *simSeed >= 0, *simTranscript != "")
			}
		}()
	}
	for i := range seeds {
		work <- i
	}
	close(work)
	wg.Wait()

	if *simSeed >= 0 && results[0].violation.kind == "" {
		r := results[0]
		t.Logf("seed %d (%s), %d operations:\n%s", r.seed, r.profile, r.operations(), strings.Join(r.ops, "\n"))
	} else if len(seeds) > 0 {
		// The simulation itself must replay: the first seed again, the
		// same sequence to the letter.
		again := runSimulation(t, base, seeds[0], *simSteps, false, false)
		if a, b := strings.Join(results[0].ops, "\n"), strings.Join(again.ops, "\n"); a != b {
			t.Errorf("seed %d does not replay: first run\n%s\nsecond run\n%s", seeds[0], a, b)
		}
	}
	if *simTranscript != "" && len(results) > 0 {
		r := results[0]
		if i := slices.IndexFunc(results, func(r simResult) bool { return r.violation.kind != "" }); i >= 0 {
			r = results[i]
		}
		head := fmt.Sprintf("# TestSimulation, seed %d (%s), -sim.steps=%d: each operation (indented: what it did), then after ----\n"+
			"# what changed: NVML, what the device plugin and the DRA pool offer, who holds what, the agent's ledger.\n\n", r.seed, r.profile, *simSteps)
		if err := os.WriteFile(*simTranscript, []byte(head+r.transcript), 0o644); err != nil {
			t.Fatal(err)
		}
		t.Logf("transcript of seed %d written to %s", r.seed, *simTranscript)
	}
	known := map[string][]uint64{}
	failed := map[string][]simResult{}
	for _, r := range results {
		for k := range r.known {
			known[k] = append(known[k], r.seed)
		}
		if r.violation.kind != "" {
			failed[r.violation.kind] = append(failed[r.violation.kind], r)
		}
	}
	seen := map[string]int{}
	for _, r := range results {
		for k, n := range r.seen {
			seen[k] += n
		}
	}
	var lines []string
	for _, k := range slices.Sorted(maps.Keys(seen)) {
		lines = append(lines, fmt.Sprintf("%6d  %s", seen[k], k))
	}
	t.Logf("what %d seeds exercised:\n%s", len(results), strings.Join(lines, "\n"))
	for _, k := range slices.Sorted(maps.Keys(known)) {
		i := slices.IndexFunc(simKnown, func(x simIssue) bool { return x.kind == k })
		first := known[k][0]
		for _, seed := range known[k] {
			if at := results[seed-seeds[0]].knownAt[k]; at < results[first-seeds[0]].knownAt[k] {
				first = seed
			}
		}
		t.Logf("known issue %q (%s) let pass in %d of %d seeds, such as %v; first after %d operations in seed %d",
			k, simKnown[i].test, len(known[k]), len(seeds), known[k][:min(len(known[k]), 10)], results[first-seeds[0]].knownAt[k], first)
	}
	// Each kind of violation once, with its shortest sequence (the
	// easiest to read), and how many seeds broke it so.
	for _, k := range slices.Sorted(maps.Keys(failed)) {
		rs := failed[k]
		slices.SortStableFunc(rs, func(a, b simResult) int { return cmp.Compare(a.operations(), b.operations()) })
		var seeds []uint64
		for _, r := range rs {
			seeds = append(seeds, r.seed)
		}
		r := rs[0]
		t.Errorf("%s: %d of %d seeds, such as %v; seed %d (%s) after %d operations (replay: -sim.seed=%d -sim.steps=%d):\n%s\nVIOLATION %s",
			k, len(rs), len(results), seeds[:min(len(seeds), 10)], r.seed, r.profile, r.operations(), r.seed, *simSteps, strings.Join(r.ops, "\n"), r.violation)
	}
}

// simResult is one seed's outcome: the operations it ran and, if one broke
// an invariant, which.
type simResult struct {
	seed      uint64
	profile   string
	ops       []string
	violation simViolation
	// known counts the violations of known issues let pass, by kind, and
	// knownAt is after how many operations each first showed; seen counts
	// what happened, by what (what the seeds exercise).
	known, knownAt, seen map[string]int
	// transcript is the seed's, with -sim.transcript.
	transcript string
}

// simViolation stops a seed: an invariant broke (or the harness gave up).
// kind says which invariant, and how (one per check), detail what
// happened.
type simViolation struct {
	kind, detail string
	// known: a known issue when it happened (simIssue.during), seen
	// inside an operation.
	known bool
}

func (v simViolation) String() string { return v.kind + ": " + v.detail }

// operations counts the operations of r's sequence (its other lines are
// what they did).
func (r simResult) operations() int {
	n := 0
	for _, l := range r.ops {
		if !strings.HasPrefix(l, " ") {
			n++
		}
	}
	return n
}

// runSimulation runs one seed; record: with its transcript.
func runSimulation(t *testing.T, base string, seed uint64, steps int, log, record bool) (res simResult) {
	dir, err := os.MkdirTemp(base, fmt.Sprintf("seed-%d-", seed))
	if err != nil {
		return simResult{seed: seed, violation: simViolation{kind: "harness", detail: err.Error()}}
	}
	tb := &seedTB{TB: t, dir: dir, log: log}
	s := newSimRun(tb, seed)
	if record {
		s.transcript = &transcript{last: map[string]string{}}
	}
	defer func() {
		res = simResult{seed: seed, profile: s.profile.name, ops: s.ops, known: s.known, knownAt: s.knownAt, seen: s.seen}
		if r := recover(); r != nil {
			if k, ok := r.(simKnownEnd); ok {
				s.note("known issue (the seed ends here): %s", string(k))
				s.count(string(k))
				res.ops = s.ops
			} else if v, ok := r.(simViolation); ok {
				res.violation = v
			} else {
				// The agent (or the simulation) panicked: where matters.
				res.violation = simViolation{kind: "panic", detail: fmt.Sprintf("%v\n%s", r, debug.Stack())}
			}
		}
		res.transcript = s.finish(res.violation)
		s.close()
		tb.cleanup()
		os.RemoveAll(dir)
	}()
	s.start()
	for range steps {
		s.op()
	}
	s.do("settle", s.settle)
	return res
}

// seedTB is the testing.TB a seed's harness gets: Fatal stops the seed
// (not the test: seeds run on goroutines of their own), temp dirs are the
// seed's, and the agent's log is kept only when asked for.
type seedTB struct {
	testing.TB
	dir string
	n   int
	// log: the agent's log lines go into the sequence (logTo).
	log      bool
	logTo    func(line string)
	cleanups []func()
}

func (t *seedTB) Helper() {}
func (t *seedTB) Fatal(args ...any) {
	panic(simViolation{kind: "harness", detail: fmt.Sprint(args...)})
}
func (t *seedTB) Fatalf(format string, args ...any) {
	panic(simViolation{kind: "harness", detail: fmt.Sprintf(format, args...)})
}
func (t *seedTB) Errorf(format string, args ...any) { t.Fatalf(format, args...) }
func (t *seedTB) Log(args ...any) {
	if t.log && t.logTo != nil {
		t.logTo(fmt.Sprint(args...))
	}
}
func (t *seedTB) Cleanup(f func()) { t.cleanups = append(t.cleanups, f) }
func (t *seedTB) TempDir() string {
	t.n++
	d := filepath.Join(t.dir, fmt.Sprintf("tmp%d", t.n))
	if err := os.MkdirAll(d, 0o755); err != nil {
		t.Fatal(err)
	}
	return d
}

func (t *seedTB) cleanup() {
	for i := len(t.cleanups) - 1; i >= 0; i-- {
		t.cleanups[i]()
	}
}

// simProfile is a simulated node and the MIG profile names its configs use.
type simProfile struct {
	name string
	opts []sim.Option
	// small, two, three and seven are the model's 1g, 2g, 3g and 7g
	// profiles (one memory slice for 1g).
	small, two, three, seven string
}

var simProfiles = []simProfile{
	// MIG on, no instances: a layout applies without a reset, and GPUs no
	// layout governs make their MIG devices on demand for DRA claims.
	{name: "dgx-a100", opts: []sim.Option{sim.WithMIGEnabled()}, small: "1g.5gb", two: "2g.10gb", three: "3g.20gb", seven: "7g.40gb"},
	// MIG off, switched without a reset: DRA claims turn it on and off.
	{name: "dgx-h100", opts: []sim.Option{sim.WithImmediateMIGModeChange()}, small: "1g.10gb", two: "2g.20gb", three: "3g.40gb", seven: "7g.80gb"},
}

// simConfig is one config file the admin may write.
type simConfig struct{ name, yaml string }

// onDemandSection turns MIG on demand on, indented to go under a config.
const onDemandSection = "    dra:\n      migOnDemand: {enabled: true}\n"

// simConfigs are the config files a seed switches between: whole GPUs,
// time-slicing, MIG layouts of several shapes (each on some of the GPUs,
// overlapping, so the others stay whole or make MIG devices for claims;
// one the GPUs cannot hold), the single strategy, time-sliced MIG devices,
// DRA only, and a file whose configs and layouts node labels select.
func simConfigs(p simProfile) []simConfig {
	layout := func(strategy, devices, counts string) string {
		return "version: v1\nconfigs:\n  default:\n    mig:\n      strategy: " + strategy + "\n      devices:\n      - devices: " + devices +
			"\n        mig-enabled: true\n        mig-devices: " + counts + "\n"
	}
	small := fmt.Sprintf("{%q: 7}", p.small)
	mixed := fmt.Sprintf("{%q: 1, %q: 1, %q: 1}", p.three, p.two, p.small)
	big := fmt.Sprintf("{%q: 2}", p.three)
	labelled := "version: v1\nconfigs:\n  default: {}\n" +
		"  sliced:\n    sharing:\n      timeSlicing:\n        resources:\n        - name: nvidia.com/gpu\n          replicas: 2\n" +
		"  dra-only:\n    devicePlugin:\n      enabled: false\n" +
		"mig-configs:\n" +
		"  some-small:\n  - devices: [0, 1, 2]\n    mig-enabled: true\n    mig-devices: " + small + "\n" +
		"  mixed:\n  - devices: [0, 1, 2, 3]\n    mig-enabled: true\n    mig-devices: " + mixed + "\n" +
		"  some-big:\n  - devices: [2, 3, 4, 5]\n    mig-enabled: true\n    mig-devices: " + big + "\n"
	// Most configs offer MIG on demand, so that claims make MIG devices on
	// the GPUs no layout governs; "whole" and "sliced" do not, so switching
	// to them leaves the devices claims made, which stay offered until
	// released, and "allow-listed" offers one profile.
	onDemand := func(yaml string) string {
		if strings.Contains(yaml, "  default: {}\n") {
			return strings.Replace(yaml, "  default: {}\n", "  default:\n"+onDemandSection, 1)
		}
		return strings.Replace(yaml, "  default:\n", "  default:\n"+onDemandSection, 1)
	}
	layout = func(layout func(strategy, devices, counts string) string) func(strategy, devices, counts string) string {
		return func(strategy, devices, counts string) string { return onDemand(layout(strategy, devices, counts)) }
	}(layout)
	labelled = onDemand(labelled)
	return []simConfig{
		{"whole", wholeGPUs},
		{"on-demand", migOnDemand},
		{"allow-listed", "version: v1\nconfigs:\n  default:\n    dra:\n      migOnDemand: {enabled: true, profiles: [" + p.small + "]}\n"},
		{"sliced", sliced2},
		{"small", layout("mixed", "[0, 1, 2]", small)},
		{"mixed", layout("mixed", "[0, 1, 2, 3]", mixed)},
		{"big", layout("mixed", "[2, 3, 4, 5]", big)},
		{"unfit", layout("mixed", "all", fmt.Sprintf("{%q: 2}", p.seven))},
		{"single", layout("single", "[0, 1, 2]", small)},
		{"small-sliced", layout("mixed", "[0, 1, 2]", small) +
			"    sharing:\n      timeSlicing:\n        resources:\n        - name: " + MIGResourceName(p.small) + "\n          replicas: 2\n"},
		{"dra-only", onDemand(draOnly)},
		{"labelled", labelled},
		// One spare GPU: the others open as claims take it and close a
		// grace after a surplus, while claims from stale pools still name
		// partitions of GPUs closed since.
		{"spares", "version: v1\nconfigs:\n  default:\n    dra:\n      migOnDemand: {enabled: true, spareGPUs: 1}\n"},
		// Two spares offering a layout, not the GPU whole: every change of
		// face waits out the grace (facesApart), and the node publishes no
		// counters once settled. The layout is named by compute slices
		// ("1g"), as the example does, and is the model's mixed one.
		{"spare-layout", "version: v1\nconfigs:\n  default:\n    dra:\n      migOnDemand: {enabled: true, spareGPUs: 2, spareLayout: {\"3g\": 1, \"2g\": 1, \"1g\": 1}}\n"},
	}
}

// simLabels are the node labels a seed switches between: they select among
// the labelled file's configs and layouts (and name one that is not there).
var simLabels = []map[string]string{
	{},
	{"gpu-agent.io/config": "sliced"},
	{"gpu-agent.io/config": "dra-only"},
	{"nvidia.com/mig.config": "some-small"},
	{"nvidia.com/mig.config": "mixed"},
	{"nvidia.com/mig.config": "some-big"},
	{"gpu-agent.io/config": "sliced", "nvidia.com/mig.config": "some-small"},
	{"gpu-agent.io/config": "missing"},
}

// simFaults are the NVML calls a seed makes fail, and how: a GPU read
// partly, instances that cannot be made or destroyed, a bare GPU instance
// left by a compute instance that could not be made.
var simFaults = []struct {
	call string
	ret  nvml.Return
}{
	{"GetMigMode", nvml.ERROR_UNKNOWN},
	{"GetMigDeviceHandleByIndex", nvml.ERROR_UNKNOWN},
	{"GetGpuInstances", nvml.ERROR_UNKNOWN},
	{"CreateGpuInstanceWithPlacement", nvml.ERROR_INSUFFICIENT_RESOURCES},
	{"GpuInstanceCreateComputeInstance", nvml.ERROR_UNKNOWN},
	{"GpuInstanceDestroy", nvml.ERROR_IN_USE},
	{"ComputeInstanceDestroy", nvml.ERROR_IN_USE},
	{"SetMigMode", nvml.ERROR_UNKNOWN},
}

type simFault struct {
	gpu  int
	call int // index in simFaults
}

// simRun is one seed's world: the node, the agent, the kubelet and
// scheduler the test plays, and the operations so far.
type simRun struct {
	tb      *seedTB
	seed    uint64
	rng     *rand.Rand
	profile simProfile
	configs []simConfig
	dir     string // the agent's state dir, kept across restarts
	state   string // the simulated node's state file

	clock *clock
	node  *sim.Node
	h     *harness
	pub   *recorder    // the catalogs the kubelet was given, across restarts
	rec   *draRecorder // the pools the scheduler was given, across restarts
	kube  *simKubelet

	// facesChecked counts the pools facesApart has seen; faceSeen is, per
	// GPU UUID, when it last saw the GPU offered free whole, and a
	// partition of it, without counters.
	facesChecked int
	faceSeen     map[string]*[2]time.Time

	config int
	labels map[string]string
	xid    map[int]bool
	faults map[simFault]bool
	lost   map[int]bool
	// made are the MIG devices made for DRA claims (on GPUs no layout
	// governs) that still exist; dynOn the GPUs a claim turned MIG on for.
	made  map[string]ident
	dynOn map[string]bool
	// known counts the violations of known issues let pass, by kind, and
	// knownAt after how many operations each first showed; seen counts
	// what happened, by what.
	known, knownAt, seen map[string]int

	// truthOf is what truth read last, from truthFile.
	truthFile os.FileInfo
	truthOf   *simTruth

	// pending are events posted while the loop was busy (meanwhile).
	pending []Event

	// The state dir, the Node's cordon and the API server
	// (simulation_state_test.go): full, the state dir takes no more
	// bytes; cordon is the Node's annotation, and cordonView what the
	// agent must act on (the GPUs by index: the annotation once the
	// Node watch told it, until then what it restored); statuses are
	// the claim statuses the agent last handed its writer.
	full       bool
	cordon     []string
	cordonView map[int]bool
	statuses   *simClaimStatus

	ops      []string
	found    []simViolation // seen inside an operation (MIG applies)
	nextName int
	// transcript, with -sim.transcript: the operations and the state
	// after each (simtranscript_test.go).
	transcript *transcript
}

func newSimRun(tb *seedTB, seed uint64) *simRun {
	rng := rand.New(rand.NewPCG(seed, 0x9e3779b97f4a7c15))
	p := simProfiles[rng.IntN(len(simProfiles))]
	s := &simRun{
		tb: tb, seed: seed, rng: rng, profile: p, configs: simConfigs(p),
		dir: filepath.Join(tb.dir, "state"), state: filepath.Join(tb.dir, "gpus.json"),
		clock: newClock(), pub: newRecorder(), rec: &draRecorder{},
		labels: map[string]string{}, xid: map[int]bool{}, faults: map[simFault]bool{}, lost: map[int]bool{},
		made: map[string]ident{}, dynOn: map[string]bool{}, known: map[string]int{}, knownAt: map[string]int{}, seen: map[string]int{},
		cordonView: map[int]bool{}, statuses: &simClaimStatus{},
	}
	s.kube = &simKubelet{s: s}
	tb.logTo = func(line string) { s.ops = append(s.ops, "      | "+line) }
	if err := os.MkdirAll(s.dir, 0o755); err != nil {
		tb.Fatal(err)
	}
	return s
}

// start boots the node and the first agent with a random config.
func (s *simRun) start() {
	s.config = s.rng.IntN(len(s.configs))
	s.do(fmt.Sprintf("start %s, config %s", s.profile.name, s.configs[s.config].name), func() {
		s.node = s.newNode(s.rng.IntN(5) == 0)
		s.h = s.newHarness(false)
		s.h.step(ConfigChanged{Update: config.Update{Data: []byte(s.configs[s.config].yaml)}})
	})
}

func (s *simRun) close() {
	if s.h != nil {
		s.h.a.Ledger().Close()
	}
	if s.node != nil {
		s.node.Close()
	}
}

// newNode opens the simulated node from its state file; armed, it crashes
// the agent right after one of its next few MIG changes.
func (s *simRun) newNode(armed bool) *sim.Node {
	log := quietLogger()
	if s.tb.log {
		log = slog.New(slog.NewTextHandler(testWriter{s.tb}, nil)) // the crash, NVML calls failed
	}
	opts := append(slices.Clone(s.profile.opts), sim.WithStateFile(s.state), sim.WithClock(s.clock.Now), sim.WithLogger(log))
	if armed {
		opts = append(opts, sim.WithCrashAfter(1+s.rng.IntN(8), func() { panic(crash{}) }))
	}
	n, err := sim.New(s.profile.name, opts...)
	if err != nil {
		s.tb.Fatal(err)
	}
	n.Init()
	return n
}

// newHarness starts an agent on the node, on the seed's clock, state dir,
// kubelet and recorders; restored, from what the last one checkpointed.
func (s *simRun) newHarness(restored bool) *harness {
	opts := []harnessOption{withDRA(s.rec), func(h *harness) {
		h.clock, h.opts.Now = s.clock, s.clock.Now
		h.pub, h.opts.Publisher = s.pub, s.pub
		h.opts.Holdings = s.kube
		var log *slog.Logger // the applier's steps, resumes and abandons, with -sim.log
		if s.tb.log {
			log = h.opts.Logger
		}
		applier := mig.NewApplier(h.node, h.dir, log)
		applier.SetWrite(s.writeState)
		h.opts.MIG = &watchingApplier{s: s, next: applier}
		h.opts.WriteState = s.writeState
		h.opts.ClaimStatus = s.statuses
	}}
	if !s.tb.log {
		opts = append(opts, withQuietLog())
	}
	// Last, with the log the agent has: the ledger's allocation log goes
	// through the seed's state dir, which may be full.
	opts = append(opts, func(h *harness) { h.opts.Ledger = s.newLedger(h.opts.Logger) })
	if restored {
		opts = append(opts, withCheckpoint())
	}
	return newHarnessIn(s.tb, s.node, s.dir, opts...)
}

// do runs one operation, named what, and checks the invariants after it. A
// crash of the agent (the simulated node's, mid-change) restarts it, as
// the kubelet would, and the operation is over.
func (s *simRun) do(what string, f func()) {
	s.ops = append(s.ops, what)
	open := s.spares()
	if !s.guard(func() { f(); s.flush() }) {
		s.countSpares(open, s.spares())
		s.check()
		s.record()
		return
	}
	s.pending = nil // posted to the inbox of the agent that died
	s.note("crashed: the agent is restarted")
	s.seen["the agent crashed mid-operation"]++
	for s.guard(s.restart) {
		s.note("crashed again: the agent is restarted")
		s.seen["the agent crashed while restarting"]++
	}
	s.check()
	s.record()
	if len(s.kube.unpreparing) > 0 {
		s.do("the kubelet asks again to unprepare what it had no answer for", func() { s.note("%s", s.kube.unprepareAll()) })
	}
}

// spares is the running agent's spare GPUs (none before the start).
func (s *simRun) spares() spares {
	if s.h == nil || s.h.a == nil {
		return spares{}
	}
	return s.h.a.spares
}

// countSpares counts the spare GPUs (migOnDemand.spareGPUs) that began
// opening (under spareLayout), opened and closed between two passes.
func (s *simRun) countSpares(before, after spares) {
	if before.open == nil || after.open == nil {
		return
	}
	for uuid := range after.opening {
		if _, ok := before.opening[uuid]; !ok {
			s.seen["spare GPU opening"]++
		}
	}
	for uuid := range after.open {
		if _, ok := before.open[uuid]; !ok {
			s.seen["spare GPU opened"]++
		}
	}
	for uuid := range before.open {
		if _, ok := after.open[uuid]; !ok {
			s.seen["spare GPU closed"]++
		}
	}
}

// flush hands the loop the events posted while it was busy.
func (s *simRun) flush() {
	for len(s.pending) > 0 {
		evs := s.pending
		s.pending = nil
		s.h.step(evs...)
	}
}

// guard runs f and reports whether the simulated crash stopped it.
func (s *simRun) guard(f func()) (crashed bool) {
	defer func() {
		if r := recover(); r != nil {
			if r != (crash{}) {
				panic(r)
			}
			crashed = true
		}
	}()
	f()
	return false
}

// restart starts a new agent on the state the crashed one left (its state
// dir, the GPUs' state file), as the DaemonSet would; the node may crash
// it again. At start the agent's watchers tell it the config, labels and
// health; the kubelet's pod-resources refresh answers at start too, but
// not always before the first pass.
func (s *simRun) restart() {
	s.close()
	if s.rng.IntN(2) == 0 && !s.full {
		s.history()
	}
	s.boot(nil)
}

// boot starts the agent on what the last one left (restart, upgrade), and
// hands it to restored, when set, before its first pass. The Node watch
// may answer after that pass: until it does, the agent acts on the cordon
// it checkpointed.
func (s *simRun) boot(restored func()) {
	s.node = s.newNode(s.rng.IntN(3) == 0)
	s.h = s.newHarness(true)
	if restored != nil {
		restored()
	}
	s.cordonView = map[int]bool{}
	if cp := s.h.opts.Restored; cp != nil {
		s.cordonView = s.cordonOf(cp.Cordon)
	}
	evs := []Event{ConfigChanged{Update: config.Update{Data: []byte(s.configs[s.config].yaml)}}, LabelsChanged{Labels: maps.Clone(s.labels)},
		HealthChanged{State: s.healthState()}}
	if s.rng.IntN(2) == 0 {
		evs = append(evs, CordonChanged{GPUs: slices.Clone(s.cordon)})
		s.cordonView = s.cordonOf(s.cordon)
	}
	if !s.kube.down && s.rng.IntN(2) == 0 {
		evs = append(evs, HoldingsChanged{Attribution: s.kube.attribution(), Answered: s.clock.Now()})
	}
	s.h.step(evs...)
}

// history gives the allocation log the length of a long-running node's:
// old records (of devices long gone) past the size from which settling
// compacts it, as happens after some hundreds of allocations. A compacted
// log no longer has the allocations the kubelet already listed.
func (s *simRun) history() {
	f, err := os.OpenFile(filepath.Join(s.dir, ledger.AllocLogFile), os.O_WRONLY|os.O_APPEND|os.O_CREATE, 0o600)
	if err != nil {
		s.tb.Fatal(err)
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		s.tb.Fatal(err)
	}
	at := s.clock.Now().Add(-30 * 24 * time.Hour)
	n := 0
	for size := fi.Size(); size < ledger.CompactAbove; n++ {
		line := fmt.Appendf(nil, `{"at":%q,"ids":["GPU-long-gone-%d"]}`, at.Format(time.RFC3339Nano), n)
		if _, err := f.Write(append(line, '\n')); err != nil {
			s.tb.Fatal(err)
		}
		size += int64(len(line) + 1)
	}
	if n > 0 {
		s.note("the allocation log has a long history (%d old records)", n)
	}
}

// The operations, by weight.
func (s *simRun) op() {
	s.clock.Advance(time.Duration(s.rng.IntN(2000)) * time.Millisecond) // the kubelet's pace
	ops := []struct {
		weight int
		f      func()
	}{
		{16, func() { s.allocate(false) }},
		{4, func() { s.allocate(true) }},
		{3, s.probe},
		{10, s.exit},
		{14, s.prepare},
		{3, s.retryPrepare},
		{9, s.unprepare},
		{5, s.editConfig},
		{4, s.editLabels},
		{5, s.toggleXID},
		{6, s.injectFault},
		{3, s.clearFaults},
		{3, s.toggleKubelet},
		{5, s.holdingsChanged},
		{10, s.tick},
		{3, s.crashRestart},
		{2, func() { s.do("settle", s.settle) }},
		// A full state dir gets room again within a few operations (logs
		// rotated, an image pruned): the agent's other work goes on.
		{map[bool]int{false: 3, true: 25}[s.full], s.toggleFull},
		{3, s.editCordon},
		{2, s.upgradeRollback},
		{2, s.apiServerLost},
	}
	total := 0
	for _, o := range ops {
		total += o.weight
	}
	n := s.rng.IntN(total)
	for _, o := range ops {
		if n < o.weight {
			o.f()
			return
		}
		n -= o.weight
	}
}

// allocate is the kubelet allocating 1 to 3 devices of one resource to a
// new container: chosen from the catalog it was last given (stale: one of
// the few before, as ListAndWatch may lag), among those healthy there and
// not allocated already; the device plugin checks them against the catalog
// it serves now, then the ledger (its Admit).
func (s *simRun) allocate(stale bool) {
	cat := s.pub.last()
	what := "allocate"
	if stale {
		s.pub.mu.Lock()
		if n := len(s.pub.cats); n > 1 {
			cat = s.pub.cats[n-1-s.rng.IntN(min(n-1, 3))-1]
		}
		s.pub.mu.Unlock()
		what = "allocate from a stale catalog"
	}
	res, ids := s.choose(cat)
	if len(ids) == 0 {
		s.do(what+": nothing free", func() {})
		return
	}
	s.do(fmt.Sprintf("%s %s %s", what, res, shortIDs(ids)), func() {
		if s.admit(res, ids, true) {
			s.h.step(Allocated{Resource: res, IDs: ids})
		}
	})
}

// choose is what the kubelet allocates a new container from cat: 1 to 3
// devices of one resource, healthy there and not allocated already.
func (s *simRun) choose(cat *catalog.Catalog) (string, []string) {
	type pick struct {
		res string
		ids []string
	}
	var choices []pick
	for _, name := range slices.Sorted(maps.Keys(cat.Resources)) {
		held := s.kube.allocatedIDs(name)
		var free []string
		for _, d := range cat.Resources[name].Devices {
			if d.Healthy && !held[d.ID] {
				free = append(free, d.ID)
			}
		}
		if len(free) > 0 {
			choices = append(choices, pick{name, free})
		}
	}
	if len(choices) == 0 {
		return "", nil
	}
	c := choices[s.rng.IntN(len(choices))]
	n := 1 + s.rng.IntN(min(3, len(c.ids)))
	return c.res, pickN(s.rng, c.ids, n)
}

// meanwhile is the kubelet allocating while the loop is busy applying a
// MIG plan: the device plugin's Allocate runs on gRPC goroutines of its
// own, at any time; the Allocated event it posts reaches the loop after
// the batch it is in.
func (s *simRun) meanwhile() {
	res, ids := s.choose(s.pub.last())
	if len(ids) == 0 {
		return
	}
	s.note("meanwhile, allocate %s %s", res, shortIDs(ids))
	s.seen["Allocate during a MIG apply"]++
	if s.admit(res, ids, true) {
		s.pending = append(s.pending, Allocated{Resource: res, IDs: ids})
	}
}

// admit is the device plugin's Allocate: the catalog it serves (checked
// when checkPlugin), then the ledger; it reports whether the devices were
// handed out. A container that got its devices runs until it exits; the
// kubelet lists it after its admission.
func (s *simRun) admit(res string, ids []string, checkPlugin bool) bool {
	if checkPlugin {
		r := s.pub.last().Resources[res]
		if r == nil {
			s.note("refused by the plugin: no such resource now")
			s.seen["Allocate refused by the plugin"]++
			return false
		}
		for _, id := range ids {
			d, ok := r.Device(id)
			if !ok || !d.Healthy {
				s.note("refused by the plugin: %s unknown or unhealthy now", short(id))
				s.seen["Allocate refused by the plugin"]++
				return false
			}
		}
		if r.MaxPerContainer > 0 && len(ids) > r.MaxPerContainer && strings.Contains(strings.Join(ids, ","), "::") {
			s.note("refused by the plugin: more than %d shared devices", r.MaxPerContainer)
			return false
		}
	}
	var uuids []string
	for _, id := range ids {
		u, _, _ := strings.Cut(id, "::")
		if !slices.Contains(uuids, u) {
			uuids = append(uuids, u)
		}
	}
	truth := s.truth()
	ledger := s.ledgerTaken(truth)
	if err := s.h.a.Ledger().Admit(res, handoutsOf(ids)); err != nil {
		s.note("refused by the ledger: %s", shortErr(err))
		s.seen["Allocate refused by the ledger"]++
		return false
	}
	for _, u := range uuids {
		for _, x := range slices.Sorted(maps.Keys(ledger)) {
			if s.covers(truth, x, ledger[x], u) {
				s.fail("ledger: Allocate accepted what it keeps", "%s, while it has %s as %s", short(u), short(x), ledger[x].why)
			}
		}
	}
	s.loggedNow(uuids)
	c := s.kube.add(res, ids, truth)
	s.seen["Allocate accepted"]++
	s.note("accepted: %s", c.name)
	return true
}

// probe is a stale plugin snapshot: a device the catalog now shows
// unhealthy reaches the ledger anyway, which must refuse it if a claim
// holds it, a release or intent waits on it, or a MIG plan dooms it.
func (s *simRun) probe() {
	cat := s.pub.last()
	type cand struct{ res, id string }
	var cands []cand
	for _, name := range slices.Sorted(maps.Keys(cat.Resources)) {
		held := s.kube.allocatedIDs(name)
		for _, d := range cat.Resources[name].Devices {
			if !d.Healthy && !held[d.ID] {
				cands = append(cands, cand{name, d.ID})
			}
		}
	}
	if len(cands) == 0 {
		s.do("probe: nothing unhealthy", func() {})
		return
	}
	c := cands[s.rng.IntN(len(cands))]
	s.do(fmt.Sprintf("probe the ledger with unhealthy %s %s", c.res, short(c.id)), func() {
		if s.admit(c.res, []string{c.id}, false) {
			s.h.step(Allocated{Resource: c.res, IDs: []string{c.id}})
		}
	})
}

// exit ends a container: the kubelet stops listing it.
func (s *simRun) exit() {
	if len(s.kube.containers) == 0 {
		s.do("exit: no container", func() {})
		return
	}
	i := s.rng.IntN(len(s.kube.containers))
	c := s.kube.containers[i]
	s.do("exit "+c.name, func() { s.kube.containers = slices.Delete(s.kube.containers, i, i+1) })
}

// prepare is the scheduler allocating a new claim 1 or 2 devices of the
// pool it last saw (sometimes an older one), then the kubelet preparing
// it.
func (s *simRun) prepare() {
	pool := s.rec.last()
	stale := ""
	if s.rng.IntN(8) == 0 {
		s.rec.mu.Lock()
		if n := len(s.rec.pools); n > 1 {
			pool = s.rec.pools[n-2]
			stale = " (from a stale pool)"
		}
		s.rec.mu.Unlock()
	}
	if pool == nil {
		s.do("prepare: no pool", func() {})
		return
	}
	if s.kube.noSlices {
		s.do("prepare: no ResourceSlice (the API server lost them)", func() {})
		return
	}
	n := 1 + s.rng.IntN(2)
	var devs []dra.Allocated
	for i := range n {
		a, ok := s.kube.schedule(pool, devs)
		if !ok {
			break
		}
		a.Request = fmt.Sprintf("r%d", i)
		devs = append(devs, a)
	}
	if len(devs) == 0 {
		s.do("prepare: nothing free in the pool"+stale, func() {})
		return
	}
	s.nextName++
	c := &simClaim{uid: types.UID(fmt.Sprintf("uid-%d", s.nextName)), name: fmt.Sprintf("claim-%d", s.nextName), devs: devs}
	s.kube.claims = append(s.kube.claims, c)
	var names []string
	for _, d := range devs {
		name := d.Device
		if d.ShareID != "" {
			name += fmt.Sprintf(" (shared, %d)", max(d.SharesTaken, 1))
		}
		names = append(names, name)
	}
	s.do(fmt.Sprintf("prepare %s: %s%s", c.name, strings.Join(names, ", "), stale), func() { s.prepareClaim(c) })
}

// retryPrepare is the kubelet asking again for a claim it has no answer
// for (or one it has: after its own restart it asks again).
func (s *simRun) retryPrepare() {
	if len(s.kube.claims) == 0 {
		s.do("prepare again: no claim", func() {})
		return
	}
	c := s.kube.claims[s.rng.IntN(len(s.kube.claims))]
	s.do("prepare "+c.name+" again", func() { s.prepareClaim(c) })
}

func (s *simRun) prepareClaim(c *simClaim) {
	had := s.h.a.ledger.HasClaim(c.uid)
	reply := make(chan map[types.UID]dra.Prepared, 1)
	s.h.step(ClaimsPrepare{Claims: []dra.Claim{c.claim()}, Reply: reply})
	var p dra.Prepared
	select {
	case r := <-reply:
		p = r[c.uid]
	default:
		s.fail("harness", "Step did not answer the Prepare of %s", c.name)
	}
	if p.Err != nil {
		c.prepared, c.held = false, nil
		s.note("failed: %s", shortErr(p.Err))
		s.seen["Prepare refused"]++
		return
	}
	truth := s.truth()
	c.prepared, c.held = true, nil
	var got []string
	for i, pd := range p.Devices {
		u := strings.TrimPrefix(pd.CDIDevices[0], devicemodel.CDIKind+"=")
		id, ok := truth.ident(u)
		if !ok {
			s.violate("vanished: prepared what NVML does not have", fmt.Sprintf("%s got %s (%s)", c.name, pd.Device, short(u)))
		}
		shares := int64(0)
		if i < len(c.devs) && c.devs[i].ShareID != "" {
			shares = max(c.devs[i].SharesTaken, 1)
		}
		c.held = append(c.held, heldDevice{uuid: u, id: id, shares: shares})
		got = append(got, short(u))
	}
	s.note("prepared: %s", strings.Join(got, " "))
	s.seen["Prepare answered"]++
	s.preparedNow(c, had)
}

// unprepare is the kubelet releasing a claim (its pod is gone). Without an
// answer (the agent crashed) it asks again.
func (s *simRun) unprepare() {
	if len(s.kube.claims) == 0 {
		s.do("unprepare: no claim", func() {})
		return
	}
	i := s.rng.IntN(len(s.kube.claims))
	c := s.kube.claims[i]
	s.do("unprepare "+c.name, func() {
		s.kube.claims = slices.Delete(s.kube.claims, i, i+1)
		s.kube.unpreparing = append(s.kube.unpreparing, c)
		s.note("%s", s.kube.unprepareAll())
	})
}

func (s *simRun) editConfig() {
	next := s.rng.IntN(len(s.configs) - 1)
	if next >= s.config {
		next++
	}
	s.do("config "+s.configs[next].name, func() {
		s.config = next
		s.h.step(ConfigChanged{Update: config.Update{Data: []byte(s.configs[next].yaml)}})
		s.noteConfig()
	})
}

func (s *simRun) editLabels() {
	l := simLabels[s.rng.IntN(len(simLabels))]
	s.do(fmt.Sprintf("labels %v", l), func() {
		s.labels = maps.Clone(l)
		s.h.step(LabelsChanged{Labels: maps.Clone(l)})
		s.noteConfig()
	})
}

// noteConfig says what the config in force is, when it is not the one
// asked for.
func (s *simRun) noteConfig() {
	if e := s.h.a.Status().Config.Error; e != "" {
		s.note("config error: %.120s", e)
	}
}

// toggleXID raises a fatal XID on a GPU, or clears it (the GPU recovered).
func (s *simRun) toggleXID() {
	g := s.rng.IntN(8)
	what := fmt.Sprintf("XID 48 on GPU %d", g)
	if s.xid[g] {
		what = fmt.Sprintf("GPU %d recovers", g)
	}
	s.do(what, func() {
		if s.xid[g] {
			delete(s.xid, g)
		} else {
			s.xid[g] = true
		}
		s.h.step(HealthChanged{State: s.healthState()})
	})
}

// healthState is the health watcher's state: XID 48 on each GPU in s.xid.
func (s *simRun) healthState() *health.State {
	var saved []health.SavedCause
	for _, g := range slices.Sorted(maps.Keys(s.xid)) {
		saved = append(saved, health.SavedCause{Cause: health.Cause{
			GPU: s.truth().gpus[g].uuid, Index: g, GI: health.AllInstances, CI: health.AllInstances, Kind: health.CauseXID, XID: 48,
			Class: health.ClassReset, Count: 1, Reason: "XID 48 (double-bit ECC error), needs GPU reset",
		}})
	}
	return health.RestoredState(saved, "")
}

// injectFault makes NVML fail: some calls on one GPU (the next few, or
// until cleared), or the whole GPU lost.
func (s *simRun) injectFault() {
	g := s.rng.IntN(8)
	if s.rng.IntN(6) == 0 {
		s.do(fmt.Sprintf("GPU %d lost", g), func() {
			if err := s.node.SetLost(g, true); err != nil {
				s.tb.Fatal(err)
			}
			s.lost[g] = true
		})
		return
	}
	f := simFault{gpu: g, call: s.rng.IntN(len(simFaults))}
	count := []int{1, 1, 2, 3, -1}[s.rng.IntN(5)]
	s.do(fmt.Sprintf("NVML: the next %d %s on GPU %d fail", count, simFaults[f.call].call, g), func() {
		if err := s.node.FailCalls(g, simFaults[f.call].call, simFaults[f.call].ret, count); err != nil {
			s.tb.Fatal(err)
		}
		s.faults[f] = true
		if s.rng.IntN(2) == 0 {
			s.h.step(Tick{})
		}
	})
}

func (s *simRun) clearFaults() {
	s.do("NVML: faults cleared, lost GPUs back", s.clearAllFaults)
}

func (s *simRun) clearAllFaults() {
	for _, f := range slices.SortedFunc(maps.Keys(s.faults), func(a, b simFault) int {
		return cmp.Or(cmp.Compare(a.gpu, b.gpu), cmp.Compare(a.call, b.call))
	}) {
		if err := s.node.FailCalls(f.gpu, simFaults[f.call].call, simFaults[f.call].ret, 0); err != nil {
			s.tb.Fatal(err)
		}
	}
	clear(s.faults)
	for _, g := range slices.Sorted(maps.Keys(s.lost)) {
		if err := s.node.SetLost(g, false); err != nil {
			s.tb.Fatal(err)
		}
	}
	clear(s.lost)
}

// toggleKubelet makes pod-resources unreachable, or reachable again.
func (s *simRun) toggleKubelet() {
	what := "pod-resources unreachable"
	if s.kube.down {
		what = "pod-resources answers again"
	}
	s.do(what, func() { s.kube.down = !s.kube.down })
}

// holdingsChanged is the background pod-resources refresh: an unsolicited
// answer, with the time it came or (sometimes) without.
func (s *simRun) holdingsChanged() {
	if s.kube.down {
		s.do("pod-resources refresh: unreachable", func() {})
		return
	}
	e := HoldingsChanged{Attribution: s.kube.attribution()}
	what := "pod-resources refresh, time unknown"
	if s.rng.IntN(4) != 0 {
		e.Answered, what = s.clock.Now(), "pod-resources refresh"
	}
	s.do(what, func() { s.h.step(e) })
}

func (s *simRun) tick() {
	d := time.Duration(1+s.rng.IntN(40)) * time.Second
	s.do(fmt.Sprintf("%v later: resync", d), func() {
		s.clock.Advance(d)
		if s.kube.noSlices {
			s.kube.noSlices = false
			s.note("the slice controller wrote the ResourceSlices again")
		}
		s.h.step(Tick{})
	})
}

// crashRestart kills the agent between two batches and starts another.
func (s *simRun) crashRestart() {
	s.do("agent killed and restarted", s.restart)
	if len(s.kube.unpreparing) > 0 {
		s.do("the kubelet asks again to unprepare what it had no answer for", func() { s.note("%s", s.kube.unprepareAll()) })
	}
}

// settle lets the node come to rest: NVML works again, the kubelet answers
// and retries what it has no answer for, time passes and the agent
// resyncs. Then nothing the agent made may be left behind (invariant 3).
func (s *simRun) settle() {
	s.clearAllFaults()
	s.kube.down = false
	s.full = false
	s.kube.noSlices = false
	s.note("%s", s.kube.retryUnprepares())
	for range 4 {
		s.clock.Advance(11 * time.Second)
		s.h.step(HoldingsChanged{Attribution: s.kube.attribution(), Answered: s.clock.Now()}, Tick{})
	}
	s.seen["settled, orphans checked"]++
	if v := s.orphans(); v != nil && !s.tolerate(v.kind) {
		panic(*v)
	}
	if st := s.h.a.Status().State; st != nil && st.Error != "" {
		s.violate("state: not saved once the state dir had room", st.Error)
	}
}

// note adds an outcome to the current operation's line.
func (s *simRun) note(format string, args ...any) {
	// Without the seed's temporary dir, which differs from run to run
	// (errors name the state dir's files): a seed replays to the letter.
	s.ops = append(s.ops, "  "+strings.ReplaceAll(fmt.Sprintf(format, args...), s.tb.dir, "$SEED"))
}

// violate stops the seed, unless the violation is a known issue let pass.
func (s *simRun) violate(kind, detail string) {
	if !s.tolerate(kind) {
		panic(simViolation{kind: kind, detail: detail})
	}
}

// fail stops the seed: an invariant broke, in the way kind says.
func (s *simRun) fail(kind, format string, args ...any) {
	panic(simViolation{kind: kind, detail: fmt.Sprintf(format, args...)})
}

// pickN picks n distinct elements of xs at random, in xs's order.
func pickN(rng *rand.Rand, xs []string, n int) []string {
	idx := rng.Perm(len(xs))[:n]
	slices.Sort(idx)
	out := make([]string, 0, n)
	for _, i := range idx {
		out = append(out, xs[i])
	}
	return out
}

// short abbreviates a UUID (or a replica ID) for the sequence.
func short(id string) string {
	u, rep, isRep := strings.Cut(id, "::")
	prefix, rest, ok := strings.Cut(u, "-")
	if ok && len(rest) > 8 {
		u = prefix + "-" + rest[:8]
	}
	if isRep {
		return u + "::" + rep
	}
	return u
}

func shortIDs(ids []string) string {
	out := make([]string, len(ids))
	for i, id := range ids {
		out[i] = short(id)
	}
	return "[" + strings.Join(out, " ") + "]"
}

// shortErr is an error with its UUIDs abbreviated, cut to a line.
func shortErr(err error) string {
	words := strings.Fields(err.Error())
	for i, w := range words {
		if strings.HasPrefix(w, "GPU-") || strings.HasPrefix(w, "MIG-") || strings.HasPrefix(w, "(GPU-") || strings.HasPrefix(w, "(MIG-") {
			words[i] = strings.TrimPrefix(w, "(")
			words[i] = strings.TrimRight(short(words[i]), "),:")
		}
	}
	msg := strings.Join(words, " ")
	if len(msg) > 200 {
		msg = msg[:200] + "..."
	}
	return msg
}

func quietLogger() *slog.Logger { return slog.New(slog.DiscardHandler) }

// simKubelet is the kubelet and the scheduler as the test plays them: the
// containers holding device plugin devices, the claims allocated to pods
// on this node, and pod-resources (HoldingsSource) answering from them.
type simKubelet struct {
	s    *simRun
	down bool
	// noSlices: the API server lost the node's ResourceSlices, and the
	// slice controller has not written them again yet.
	noSlices bool
	// containers run until they exit; listed once admitted.
	containers []*simContainer
	// claims the scheduler allocated on this node, prepared or not yet;
	// unpreparing those whose pods are gone, until the agent says done.
	claims      []*simClaim
	unpreparing []*simClaim
	next        int
}

type simContainer struct {
	name, resource string
	ids            []string
	held           []heldDevice
	admitted       time.Time
}

type simClaim struct {
	uid      types.UID
	name     string
	devs     []dra.Allocated
	prepared bool
	held     []heldDevice // what the Prepare answer gave
	// forgotten: the API server lost the claim (apiServerLost); the
	// kubelet still runs its pod.
	forgotten bool
}

// heldDevice is a device a holder has, and what it was when handed out.
type heldDevice struct {
	uuid    string
	replica bool
	id      ident
	shares  int64
}

func (c *simClaim) claim() dra.Claim {
	return dra.Claim{UID: c.uid, Namespace: "sim", Name: c.name, Devices: slices.Clone(c.devs)}
}

func (c *simClaim) ref() dra.ClaimRef {
	return dra.ClaimRef{UID: c.uid, Namespace: "sim", Name: c.name}
}

// simAdmission bounds how long the kubelet takes to list a container
// after Allocate (its admission): under 5 s, the margin the agent gives it
// (recentSettle).
const simAdmission = 5 * time.Second

// add records a container given ids of res; the kubelet lists it after
// its admission.
func (k *simKubelet) add(res string, ids []string, truth *simTruth) *simContainer {
	k.next++
	c := &simContainer{name: fmt.Sprintf("pod-%d", k.next), resource: res, ids: ids,
		admitted: k.s.clock.Now().Add(time.Duration(k.s.rng.IntN(int(simAdmission/time.Millisecond))) * time.Millisecond)}
	for _, id := range ids {
		u, _, rep := strings.Cut(id, "::")
		d, ok := truth.ident(u)
		if !ok {
			k.s.violate("vanished: handed out what NVML does not have", fmt.Sprintf("%s got %s", c.name, short(u)))
		}
		c.held = append(c.held, heldDevice{uuid: u, replica: rep, id: d})
	}
	k.containers = append(k.containers, c)
	return c
}

// allocatedIDs are the device IDs of res the kubelet has given running
// containers: it never gives one twice.
func (k *simKubelet) allocatedIDs(res string) map[string]bool {
	out := map[string]bool{}
	for _, c := range k.containers {
		if c.resource == res {
			for _, id := range c.ids {
				out[id] = true
			}
		}
	}
	return out
}

// attribution is the kubelet's pod-resources answer now: the containers
// it has admitted.
func (k *simKubelet) attribution() *podresources.Attribution {
	var pods []*podresourcesv1.PodResources
	now := k.s.clock.Now()
	for _, c := range k.containers {
		if c.admitted.After(now) {
			continue
		}
		pods = append(pods, &podresourcesv1.PodResources{Name: c.name, Namespace: "sim", Containers: []*podresourcesv1.ContainerResources{{
			Name: "main", Devices: []*podresourcesv1.ContainerDevices{{ResourceName: c.resource, DeviceIds: c.ids}}}}})
	}
	return podresources.NewAttribution(pods, nil)
}

// Refresh implements HoldingsSource.
func (k *simKubelet) Refresh(context.Context) (*podresources.Attribution, error) {
	if k.down {
		return nil, errUnreachable
	}
	return k.attribution(), nil
}

// schedule picks a device of pool for a new claim that already has devs,
// as the scheduler would: healthy, not allocated to another claim (a
// shared device while its shares last), its counters not exhausted.
func (k *simKubelet) schedule(pool *devicemodel.Pool, devs []dra.Allocated) (dra.Allocated, bool) {
	allocated := map[string]int64{} // device name → shares taken (exclusive: -1)
	var all []dra.Allocated
	for _, c := range append(slices.Clone(k.claims), k.unpreparing...) {
		if !c.forgotten { // the API server lost it: the scheduler does not know its devices are taken
			all = append(all, c.devs...)
		}
	}
	all = append(all, devs...)
	used := map[int]map[string]int64{} // counter set (GPU) → counter → consumed
	for _, a := range all {
		if a.ShareID != "" {
			allocated[a.Device] += max(a.SharesTaken, 1)
		} else {
			allocated[a.Device] = -1
		}
		if d, ok := pool.Device(a.Device); ok && len(d.Consumes) > 0 {
			g := d.ParentIndexOrSelf()
			if used[g] == nil {
				used[g] = map[string]int64{}
			}
			for c, v := range d.Consumes {
				used[g][c] += v
			}
		}
	}
	limits := map[int]map[string]int64{}
	for _, cs := range pool.CounterSets {
		limits[cs.GPU] = cs.Counters
	}
	fits := func(d devicemodel.Device) bool {
		g := d.ParentIndexOrSelf()
		for c, v := range d.Consumes {
			if used[g][c]+v > limits[g][c] {
				return false
			}
		}
		return true
	}
	// By kind first, so whole GPUs and existing MIG devices are not
	// drowned by the many partitions.
	byKind := map[string][]dra.Allocated{}
	for _, d := range pool.Devices {
		if d.Unhealthy != "" || d.Cordoned != "" || !fits(d) {
			continue
		}
		switch {
		case d.Shares > 1:
			want := int64(1 + k.s.rng.IntN(2))
			if n := allocated[d.Name]; n >= 0 && n+want <= int64(d.Shares) {
				k.s.nextName++
				byKind["shared"] = append(byKind["shared"], dra.Allocated{Device: d.Name, ShareID: types.UID(fmt.Sprintf("share-%d", k.s.nextName)), SharesTaken: want})
			}
		case allocated[d.Name] != 0:
		case d.Partition:
			byKind["partition"] = append(byKind["partition"], dra.Allocated{Device: d.Name})
		default:
			byKind[d.Type] = append(byKind[d.Type], dra.Allocated{Device: d.Name})
		}
	}
	if len(byKind) == 0 {
		return dra.Allocated{}, false
	}
	kinds := slices.Sorted(maps.Keys(byKind))
	kind := kinds[k.s.rng.IntN(len(kinds))]
	k.s.seen["claim device scheduled: "+kind]++
	ds := byKind[kind]
	return ds[k.s.rng.IntN(len(ds))], true
}

// unprepareAll asks the agent to release every claim whose pod is gone.
func (k *simKubelet) unprepareAll() string {
	if len(k.unpreparing) == 0 {
		return "nothing to unprepare"
	}
	refs := make([]dra.ClaimRef, 0, len(k.unpreparing))
	for _, c := range k.unpreparing {
		refs = append(refs, c.ref())
	}
	reply := make(chan map[types.UID]error, 1)
	k.s.h.step(ClaimsUnprepare{Claims: refs, Reply: reply})
	var out map[types.UID]error
	select {
	case out = <-reply:
	default:
		k.s.fail("harness", "Step did not answer the Unprepare")
	}
	var said []string
	k.unpreparing = slices.DeleteFunc(k.unpreparing, func(c *simClaim) bool {
		if err := out[c.uid]; err != nil {
			said = append(said, c.name+": "+shortErr(err))
			return false
		}
		said = append(said, c.name+" unprepared")
		return true
	})
	return strings.Join(said, "; ")
}

// retryUnprepares is the kubelet asking again for releases it got no
// answer for.
func (k *simKubelet) retryUnprepares() string {
	if len(k.unpreparing) == 0 {
		return "no unprepare to retry"
	}
	return "again: " + k.unprepareAll()
}

// ident is what a device is: a GPU (and its MIG mode), or a MIG device of
// one profile at one placement of a GPU. The simulated node names a MIG
// device by its GPU and GPU/compute instance ids, so a device destroyed
// and made again elsewhere can come back under the same UUID: a holder's
// device is the one it got only while its ident is the same.
type ident struct {
	gpu         int
	parent      string // a MIG device's GPU; "" for a GPU
	profile     string
	start, size int
	migOn       bool // a GPU's MIG mode
}

func (d ident) String() string {
	if d.parent == "" {
		return fmt.Sprintf("GPU %d", d.gpu)
	}
	return fmt.Sprintf("%s at %d on GPU %d", d.profile, d.start, d.gpu)
}

// simTruth is what the GPUs are, read from the simulated node's state
// file: it is written before every NVML call that changes the GPUs
// returns, and reading it calls no NVML (whose calls a test may be making
// fail).
type simTruth struct {
	gpus []truthGPU
	mig  map[string]ident
}

type truthGPU struct {
	uuid  string
	lost  bool
	migOn bool
	bare  []ident // GPU instances without a compute instance
}

// simStateFile is the part of the simulated node's state file (version 1,
// gpu/sim's package doc) the simulation reads.
type simStateFile struct {
	GPUs []struct {
		Index        int    `json:"index"`
		UUID         string `json:"uuid"`
		Lost         bool   `json:"lost"`
		MIGCurrent   bool   `json:"mig_current"`
		GPUInstances []struct {
			Profile   string `json:"profile"`
			Placement struct {
				Start int `json:"start"`
				Size  int `json:"size"`
			} `json:"placement"`
			ComputeInstances []struct {
				UUID string `json:"uuid"`
			} `json:"compute_instances"`
		} `json:"gpu_instances"`
	} `json:"gpus"`
}

func (s *simRun) truth() (t *simTruth) {
	// The node writes the file anew (temp file, rename) for each change:
	// while it is the same file, it says the same.
	fi, err := os.Stat(s.state)
	if err != nil {
		s.tb.Fatal(err)
	}
	if s.truthOf != nil && os.SameFile(fi, s.truthFile) && fi.ModTime().Equal(s.truthFile.ModTime()) && fi.Size() == s.truthFile.Size() {
		return s.truthOf
	}
	b, err := os.ReadFile(s.state)
	if err != nil {
		s.tb.Fatal(err)
	}
	s.truthFile = fi
	defer func() { s.truthOf = t }()
	var f simStateFile
	if err := json.Unmarshal(b, &f); err != nil {
		s.tb.Fatal(err)
	}
	t = &simTruth{mig: map[string]ident{}}
	for _, g := range f.GPUs {
		tg := truthGPU{uuid: g.UUID, lost: g.Lost, migOn: g.MIGCurrent}
		for _, gi := range g.GPUInstances {
			id := ident{gpu: g.Index, parent: g.UUID, profile: gi.Profile, start: gi.Placement.Start, size: gi.Placement.Size}
			if len(gi.ComputeInstances) == 0 {
				tg.bare = append(tg.bare, id)
			}
			for _, ci := range gi.ComputeInstances {
				t.mig[ci.UUID] = id
			}
		}
		t.gpus = append(t.gpus, tg)
	}
	return t
}

// ident is what device u is now.
func (t *simTruth) ident(u string) (ident, bool) {
	if d, ok := t.mig[u]; ok {
		return d, true
	}
	for i, g := range t.gpus {
		if g.uuid == u {
			return ident{gpu: i, migOn: g.migOn}, true
		}
	}
	return ident{}, false
}

// index is the index of GPU uuid (-1 when NVML has no such GPU).
func (t *simTruth) index(uuid string) int {
	return slices.IndexFunc(t.gpus, func(g truthGPU) bool { return g.uuid == uuid })
}

// parentOf is the GPU of MIG device u ("" for a GPU, or a device neither
// NVML nor the ledger knows).
func (s *simRun) parentOf(t *simTruth, u string) string {
	if d, ok := t.mig[u]; ok {
		return d.parent
	}
	p, _ := s.h.a.ledger.Where(u)
	return p.GPU
}

// overlap reports whether devices a and b (with their GPUs, "" for a GPU)
// share silicon: the same device, or a MIG device and its GPU.
func overlap(a, pa, b, pb string) bool {
	return a == b || (pa != "" && pa == b) || (pb != "" && pb == a)
}

// holder is a container or a claim, and the devices it has.
type holder struct {
	name  string
	claim bool
	// made: MIG devices made for claims that no claim holds (failed or
	// released): DRA's until they are destroyed, which is no violation.
	made bool
	// leaving: a claim the ledger holds that the kubelet is unpreparing
	// (its pods are gone): nobody else may have its devices yet, but they
	// may go.
	leaving bool
	devs    []heldDevice
}

// holders are everyone who has a device now: the containers the kubelet
// runs (what Allocate gave them), the claims it prepared (what Prepare
// answered), and claims the ledger holds that the kubelet does not know
// as prepared (a crash took the answer, or their release is not through).
func (s *simRun) holders(truth *simTruth) []holder {
	var out []holder
	for _, c := range s.kube.containers {
		out = append(out, holder{name: c.name + " (device plugin)", devs: c.held})
	}
	known := map[types.UID]bool{}
	for _, c := range s.kube.claims {
		if c.prepared {
			out = append(out, holder{name: c.name, claim: true, devs: c.held})
			known[c.uid] = true
		}
	}
	l := s.h.a.ledger
	for _, uid := range slices.Sorted(maps.Keys(l.Claims())) {
		if known[uid] {
			continue
		}
		h := holder{name: l.Claims()[uid].Name + " (in the ledger)", claim: true,
			leaving: slices.ContainsFunc(s.kube.unpreparing, func(c *simClaim) bool { return c.uid == uid })}
		for _, d := range l.Claims()[uid].Devices {
			if d.AdminAccess {
				continue
			}
			id, ok := truth.ident(d.UUID)
			if !ok {
				// Gone from NVML: where the ledger last saw it, or where
				// the claim's record says it made it.
				p, ok := l.Where(d.UUID)
				if !ok {
					p = ledger.Place{GPU: d.Parent, Profile: d.Profile, Placement: d.Placement}
				}
				id = ident{gpu: truth.index(p.GPU), parent: p.GPU, profile: p.Profile, start: p.Placement.Start, size: p.Placement.Size}
			}
			h.devs = append(h.devs, heldDevice{uuid: d.UUID, id: id, shares: d.Shares})
		}
		out = append(out, h)
	}
	held := map[string]bool{}
	for _, h := range out {
		for _, d := range h.devs {
			held[d.uuid] = h.claim
		}
	}
	made := holder{name: "DRA (made for a claim, not destroyed yet)", claim: true, made: true}
	for _, u := range slices.Sorted(maps.Keys(s.made)) {
		if !held[u] {
			made.devs = append(made.devs, heldDevice{uuid: u, id: s.made[u]})
		}
	}
	if len(made.devs) > 0 {
		out = append(out, made)
	}
	return out
}

// taken is why the ledger keeps a device from the device plugin; exact:
// only the device itself (the GPU of a MIG device made or destroyed for a
// claim, whose other MIG devices are free), not its MIG devices too.
type taken struct {
	why   string
	exact bool
}

// ledgerTaken maps each device the ledger keeps from the device plugin to
// why: prepared for a claim, made or destroyed for one, doomed by a MIG
// plan.
func (s *simRun) ledgerTaken(truth *simTruth) map[string]taken {
	l := s.h.a.ledger
	out := map[string]taken{}
	for _, uid := range slices.Sorted(maps.Keys(l.Claims())) {
		for _, d := range l.Claims()[uid].Devices {
			if !d.AdminAccess {
				out[d.UUID] = taken{why: "prepared for " + l.Claims()[uid].Name}
			}
		}
	}
	for _, uid := range slices.Sorted(maps.Keys(l.Claims())) {
		for _, d := range l.Claims()[uid].Devices {
			// A MIG device made for the claim: its record names its GPU,
			// whether or not the inventory still shows the device.
			if !d.AdminAccess && d.Parent != "" && !hasKey(out, d.Parent) {
				out[d.Parent] = taken{why: "the GPU of a MIG device prepared for " + l.Claims()[uid].Name, exact: true}
			}
		}
	}
	for u, by := range releasingUUIDs(l.Releases(), l.Intents(), s.h.a.inv, claimedUUIDs(l.Claims())) {
		if _, ok := out[u]; !ok {
			out[u] = taken{why: "made or destroyed for " + by, exact: s.parentOf(truth, u) == ""}
		}
	}
	for u, why := range l.Doomed() {
		out[u] = taken{why: "doomed: " + why}
	}
	return out
}

// covers reports whether what the ledger keeps as x (t) covers device u.
func (s *simRun) covers(truth *simTruth, x string, t taken, u string) bool {
	if t.exact {
		return u == x
	}
	return overlap(u, s.parentOf(truth, u), x, s.parentOf(truth, x))
}

// reporter takes a violation: its kind (one per way an invariant can
// break) and what happened. It reports whether to go on checking: only
// for a known issue the simulation tolerates (simKnown).
type reporter func(kind, detail string) bool

// check runs the invariants after an operation.
func (s *simRun) check() {
	for _, v := range s.found {
		if v.known {
			panic(simKnownEnd(v.kind))
		}
		if !s.tolerate(v.kind) {
			panic(v)
		}
	}
	s.found = nil
	truth := s.truth()
	hs := s.holders(truth)
	for _, inv := range []func(*simTruth, []holder, reporter){s.vanished, s.givenTwice, s.catalogAgrees, s.poolAgrees, s.facesApart, s.cordonHeld, s.stateSaved} {
		var stop *simViolation
		inv(truth, hs, func(kind, detail string) bool {
			if s.tolerate(kind) {
				return true
			}
			stop = &simViolation{kind: kind, detail: detail}
			return false
		})
		if stop != nil {
			panic(*stop)
		}
	}
}

// tolerate reports whether violations of kind are a known issue the
// simulation lets pass (counting them), and notes the first in the
// sequence.
func (s *simRun) tolerate(kind string) bool {
	k, ok := s.knownIssue(kind)
	if !ok {
		return false
	}
	if k.during != nil {
		panic(simKnownEnd(kind))
	}
	if s.known[kind] == 0 {
		s.note("known issue: %s", kind)
	}
	s.count(kind)
	return true
}

// count counts a violation of a known issue.
func (s *simRun) count(kind string) {
	if _, ok := s.knownAt[kind]; !ok {
		s.knownAt[kind] = simResult{ops: s.ops}.operations()
	}
	s.known[kind]++
}

// knownIssue is the known issue a violation of kind is now, if any.
func (s *simRun) knownIssue(kind string) (simIssue, bool) {
	if !*simKnownOK {
		return simIssue{}, false
	}
	i := slices.IndexFunc(simKnown, func(k simIssue) bool { return k.kind == kind && (k.during == nil || k.during(s)) })
	if i < 0 {
		return simIssue{}, false
	}
	return simKnown[i], true
}

// vanished (invariant 1): everything a holder has is in NVML, as it was
// when it was handed out.
func (s *simRun) vanished(truth *simTruth, hs []holder, report reporter) {
	for _, h := range hs {
		if h.made || h.leaving {
			continue
		}
		for _, d := range h.devs {
			now, ok := truth.ident(d.uuid)
			switch {
			case !ok:
				if !report("vanished", fmt.Sprintf("%s (%s) of %s is gone from NVML", short(d.uuid), d.id, h.name)) {
					return
				}
			case now != d.id:
				if !report("vanished", fmt.Sprintf("%s of %s was %s, NVML now has %s (MIG mode %v)", short(d.uuid), h.name, d.id, now, now.migOn)) {
					return
				}
			}
		}
	}
}

// givenTwice (invariant 2): no device (a MIG device and its GPU overlap)
// has two holders, except time-sliced replicas of one device in
// containers, and a shared device in claims whose shares fit.
func (s *simRun) givenTwice(_ *simTruth, hs []holder, report reporter) {
	type entry struct {
		h *holder
		d heldDevice
	}
	var all []entry
	shares := map[string]int64{}
	for i := range hs {
		for _, d := range hs[i].devs {
			all = append(all, entry{&hs[i], d})
			shares[d.uuid] += d.shares
		}
	}
	for i, a := range all {
		for _, b := range all[i+1:] {
			if a.h == b.h && !a.h.claim {
				continue // one container's own devices: one Allocate, the plugin checked them
			}
			if !overlap(a.d.uuid, a.d.id.parent, b.d.uuid, b.d.id.parent) {
				continue
			}
			kind := "given twice: a container and a claim"
			switch {
			case a.h.made || b.h.made:
				kind = "given twice: a container and a device made for a claim"
				if a.h.claim && b.h.claim {
					kind = "given twice: a claim and a device made for another"
				}
			case !a.h.claim && !b.h.claim && a.d.uuid == b.d.uuid && a.d.replica && b.d.replica:
				continue // time-slicing: replicas of one device
			case a.h.claim && b.h.claim && a.d.uuid == b.d.uuid && a.d.shares > 0 && b.d.shares > 0:
				continue // a shared device (one claim may take two shares of it): its shares are counted below
			case !a.h.claim && !b.h.claim:
				// The kubelet gives an ID once per resource: these are
				// one device under two IDs or two resources.
				kind = "given twice: two containers, one device under two names"
			case a.h.claim && b.h.claim && a.h == b.h:
				kind = "given twice: one claim, one GPU twice"
			case a.h.claim && b.h.claim:
				kind = "given twice: two claims"
			}
			detail := fmt.Sprintf("%s (%s) to %s and %s (%s) to %s", short(a.d.uuid), a.d.id, a.h.name, short(b.d.uuid), b.d.id, b.h.name)
			if !report(kind, detail) {
				return
			}
		}
	}
	for _, u := range slices.Sorted(maps.Keys(shares)) {
		if shares[u] > 2 { // every config shares a device 2 ways
			if !report("given twice: shares exceeded", fmt.Sprintf("%s shared by claims taking %d shares of 2", short(u), shares[u])) {
				return
			}
		}
	}
}

// catalogAgrees (invariant 4, the device plugin's side): the catalog the
// kubelet was last given offers healthy nothing the ledger has as
// prepared for a claim, made or destroyed for one, or doomed.
func (s *simRun) catalogAgrees(truth *simTruth, _ []holder, report reporter) {
	ledger := s.ledgerTaken(truth)
	cat := s.pub.last()
	for _, name := range slices.Sorted(maps.Keys(cat.Resources)) {
		for _, d := range cat.Resources[name].Devices {
			if !d.Healthy {
				continue
			}
			u := d.Spec.VisibleID
			for _, x := range slices.Sorted(maps.Keys(ledger)) {
				if s.covers(truth, x, ledger[x], u) {
					detail := fmt.Sprintf("%s offers %s healthy, while the ledger has %s as %s", name, short(d.ID), short(x), ledger[x].why)
					if !report("catalog: offers what the ledger keeps", detail) {
						return
					}
				}
			}
		}
	}
}

// facesApart (invariant 4, DRA's side, exactness): where a GPU has no
// counter set, the scheduler cannot tell which of its devices clash, so
// none of them may: no two of its devices share silicon (the GPU whole and
// one of its MIG devices, two overlapping placements). And across pools:
// neither the GPU whole nor a partition of it is offered free (untainted,
// allocated to no claim) without counters within the grace after the other
// was, since the scheduler may have given that one out just before it saw
// the change.
func (s *simRun) facesApart(_ *simTruth, _ []holder, report reporter) {
	s.rec.mu.Lock()
	pools := slices.Clone(s.rec.pools[min(s.facesChecked, len(s.rec.pools)):])
	s.facesChecked = len(s.rec.pools)
	s.rec.mu.Unlock()
	allocated := map[string]bool{}
	for _, c := range append(slices.Clone(s.kube.claims), s.kube.unpreparing...) {
		for _, d := range c.devs {
			allocated[d.Device] = true
		}
	}
	grace := s.h.a.opts.MIGCloseGrace
	now := s.clock.Now()
	// Across pools only under spareLayout: a config that turns MIG on
	// demand off, or on with counters, changes faces at once by design.
	layout := s.configs[s.config].name == "spare-layout"
	if s.faceSeen == nil || !layout {
		s.faceSeen = map[string]*[2]time.Time{}
	}
	for _, p := range pools {
		counted := map[int]bool{}
		for _, cs := range p.CounterSets {
			counted[cs.GPU] = true
		}
		byGPU := map[int][]devicemodel.Device{}
		for _, d := range p.Devices {
			if d.Type != devicemodel.TypeGPU && d.Type != devicemodel.TypeMIG {
				continue
			}
			if g := d.ParentIndexOrSelf(); !counted[g] {
				byGPU[g] = append(byGPU[g], d)
			}
		}
		for _, g := range slices.Sorted(maps.Keys(byGPU)) {
			ds := byGPU[g]
			for i, a := range ds {
				for _, b := range ds[i+1:] {
					clash := a.Type != b.Type || (a.Placement.Size > 0 && b.Placement.Size > 0 && a.Placement.Overlaps(b.Placement))
					if clash && a.Shares <= 1 && b.Shares <= 1 && !report("pool: devices that clash, without counters",
						fmt.Sprintf("GPU %d offers %s and %s with no counter set", g, a.Name, b.Name)) {
						return
					}
				}
			}
			var uuid string
			free := [2]bool{} // whole, partitions
			for _, d := range ds {
				if d.Type == devicemodel.TypeGPU {
					uuid = d.UUID
				} else {
					uuid = d.ParentUUID
				}
				if d.Closing || d.Unhealthy != "" || d.Cordoned != "" || allocated[d.Name] {
					continue
				}
				switch {
				case d.Type == devicemodel.TypeGPU:
					free[0] = true
				case d.Partition:
					free[1] = true
				}
			}
			seen := s.faceSeen[uuid]
			if seen == nil {
				seen = &[2]time.Time{}
				s.faceSeen[uuid] = seen
			}
			for k, name := range []string{"whole", "a partition"} {
				other := seen[1-k]
				if layout && free[k] && !other.IsZero() && now.Sub(other) < grace && !report("pool: a face offered within the grace of the other",
					fmt.Sprintf("GPU %d offered %s free %v after the other face, without counters", g, name, now.Sub(other))) {
					return
				}
			}
			for k := range free {
				if free[k] {
					seen[k] = now
				}
			}
		}
	}
}

// poolAgrees (invariant 4, DRA's side): the pool last published offers no
// device a container holds through the device plugin (nor the GPU of one,
// nor a partition overlapping one), nothing made or destroyed for a
// released claim, nothing doomed.
func (s *simRun) poolAgrees(truth *simTruth, hs []holder, report reporter) {
	pool := s.rec.last()
	if pool == nil {
		return
	}
	// What released claims left and intents: the GPU (not offered whole)
	// and the MIG device where the record says it is (its UUID may be
	// another's by now: one destroyed and made again gets the same).
	type left struct {
		why string
		id  ident
	}
	var gone []left
	l := s.h.a.ledger
	claimed := claimedUUIDs(l.Claims())
	for _, set := range []map[types.UID]PreparedClaim{l.Releases(), l.Intents()} {
		for _, uid := range slices.Sorted(maps.Keys(set)) {
			for _, d := range set[uid].Devices {
				if !d.Created {
					continue
				}
				// Only a device NVML has where the record says: one
				// destroyed already leaves the record only the GPU's MIG
				// mode to undo, one not made yet nothing to offer.
				for _, u := range slices.Sorted(maps.Keys(truth.mig)) {
					if id := truth.mig[u]; id.parent == d.Parent && id.profile == d.Profile && id.start == d.Placement.Start && id.size == d.Placement.Size && !hasKey(claimed, u) {
						gone = append(gone, left{"made or destroyed for " + set[uid].Name, id})
					}
				}
			}
		}
	}
	doomed := l.Doomed()
	for _, d := range pool.Devices {
		for _, h := range hs {
			if h.claim {
				continue
			}
			for _, hd := range h.devs {
				kind, detail := "", ""
				switch {
				case d.Partition && hd.uuid == d.ParentUUID:
					kind, detail = "pool: a partition of a held GPU", fmt.Sprintf("offers %s, on GPU %s that %s holds", d.Name, short(hd.uuid), h.name)
				case d.Partition && hd.id.parent == d.ParentUUID && placementsOverlap(hd.id, d.Placement):
					kind, detail = "pool: a partition over a held MIG device", fmt.Sprintf("offers %s, over %s (%s) that %s holds", d.Name, short(hd.uuid), hd.id, h.name)
				case !d.Partition && d.UUID == hd.uuid:
					kind, detail = "pool: a held device", fmt.Sprintf("offers %s (%s), which %s holds", d.Name, short(d.UUID), h.name)
				case !d.Partition && d.ParentUUID != "" && d.ParentUUID == hd.uuid:
					kind, detail = "pool: a MIG device of a held GPU", fmt.Sprintf("offers %s (%s), on GPU %s that %s holds", d.Name, short(d.UUID), short(hd.uuid), h.name)
				case !d.Partition && hd.id.parent != "" && hd.id.parent == d.UUID:
					kind, detail = "pool: the GPU of a held MIG device", fmt.Sprintf("offers %s, whose MIG device %s %s holds", d.Name, short(hd.uuid), h.name)
				default:
					continue
				}
				if !report(kind, detail) {
					return
				}
			}
		}
		for _, g := range gone {
			kind, detail := "pool: offers what the ledger keeps", ""
			switch {
			case !d.Partition && d.UUID == g.id.parent:
				detail = fmt.Sprintf("offers %s whole, while the ledger has its %s as %s", d.Name, g.id, g.why)
			case !d.Partition && d.ParentUUID == g.id.parent && d.Profile == g.id.profile && d.Placement == (gpu.Placement{Start: g.id.start, Size: g.id.size}):
				detail = fmt.Sprintf("offers %s (%s), which the ledger has as %s", d.Name, g.id, g.why)
			case d.Partition && d.ParentUUID == g.id.parent && placementsOverlap(g.id, d.Placement):
				detail = fmt.Sprintf("offers %s, over %s, which the ledger has as %s", d.Name, g.id, g.why)
				if !s.believes(g.id) {
					kind = "pool: a partition over a device the inventory does not show"
				}
			default:
				continue
			}
			if !report(kind, detail) {
				return
			}
		}
		for _, u := range slices.Sorted(maps.Keys(doomed)) {
			if !d.Partition && overlap(d.UUID, d.ParentUUID, u, s.parentOf(truth, u)) || d.Partition && d.ParentUUID == u {
				if !report("pool: offers what the ledger keeps", fmt.Sprintf("offers %s, which is doomed: %s", d.Name, doomed[u])) {
					return
				}
			}
		}
	}
}

// migPhase is what /status says of GPU i's MIG layout ("none" without one).
func (s *simRun) migPhase(i int) string {
	for _, st := range s.h.a.Status().MIG {
		if st.GPU == i {
			return st.Phase + ": " + st.Reason
		}
	}
	return "none"
}

// believes reports whether the agent's inventory has MIG device id.
func (s *simRun) believes(id ident) bool {
	if s.h.a.inv == nil {
		return false
	}
	g, ok := s.h.a.inv.GPUByUUID(id.parent)
	if !ok {
		return false
	}
	_, ok = instanceAt(g, id.profile, gpu.Placement{Start: id.start, Size: id.size})
	return ok
}

func placementsOverlap(id ident, p gpu.Placement) bool {
	return gpu.Placement{Start: id.start, Size: id.size}.Overlaps(p)
}

// governed are the GPUs (by index) the selected config's MIG layout
// governs: their MIG devices are the layout's, not made for claims.
func (s *simRun) governed() map[int]bool {
	out := map[int]bool{}
	a := s.h.a
	if a.selected.MIGLayout == nil || a.inv == nil {
		return out
	}
	if wants, err := mig.Desired(a.selected.MIGLayout, a.inv); err == nil {
		for i := range wants {
			out[i] = true
		}
	}
	return out
}

// orphans (invariant 3), once the node has settled: nothing left to undo
// in the ledger, no GPU instance without a compute instance, no MIG device
// made for a claim that no claim holds (on GPUs no layout governs), no GPU
// left in MIG mode that a claim turned it on for.
func (s *simRun) orphans() *simViolation {
	l := s.h.a.ledger
	for _, set := range []map[types.UID]PreparedClaim{l.Releases(), l.Intents()} {
		for _, uid := range slices.Sorted(maps.Keys(set)) {
			return &simViolation{kind: "orphan: left in the ledger to undo", detail: set[uid].Describe()}
		}
	}
	if d := l.Doomed(); len(d) > 0 {
		return &simViolation{kind: "orphan: still doomed", detail: fmt.Sprint(d)}
	}
	truth := s.truth()
	governed := s.governed()
	for i, g := range truth.gpus {
		// A layout that waits (for holders) removes the bare GPU instance
		// with the rest of its plan, once it runs: waiting, not left.
		if len(g.bare) > 0 && !(governed[i] && strings.HasPrefix(s.migPhase(i), mig.PhasePending)) {
			return &simViolation{kind: "orphan: a GPU instance without a compute instance", detail: fmt.Sprintf("GPU %d: %s (MIG %s)", i, g.bare[0], s.migPhase(i))}
		}
	}
	claimed := claimedUUIDs(l.Claims())
	held := map[string]bool{}
	for _, c := range s.kube.containers {
		for _, d := range c.held {
			held[d.uuid] = true
		}
	}
	for _, u := range slices.Sorted(maps.Keys(s.made)) {
		id := s.made[u]
		if now, ok := truth.mig[u]; ok && now == id && !hasKey(claimed, u) && !held[u] && !governed[id.gpu] {
			return &simViolation{kind: "orphan: a MIG device made for a claim", detail: fmt.Sprintf("%s (%s) is left with no claim holding it", short(u), id)}
		}
	}
	for _, u := range slices.Sorted(maps.Keys(s.dynOn)) {
		id, _ := truth.ident(u)
		g := truth.gpus[id.gpu]
		instances := 0
		for _, m := range truth.mig {
			if m.parent == u {
				instances++
			}
		}
		if g.migOn && instances == 0 && len(g.bare) == 0 && !governed[id.gpu] {
			return &simViolation{kind: "orphan: MIG mode a claim turned on", detail: fmt.Sprintf("GPU %d is left in MIG mode with no MIG device", id.gpu)}
		}
	}
	return nil
}

// foundNow keeps a violation seen inside an operation, for check.
func (s *simRun) foundNow(kind, detail string) {
	k, ok := s.knownIssue(kind)
	s.found = append(s.found, simViolation{kind: kind, detail: detail, known: ok && k.during != nil})
}

// watchingApplier is the MIG applier with the simulation watching each
// apply: what it destroyed (invariant 5: never a device someone holds) and
// what it made for claims (invariant 3 looks for those left behind). The
// applier's Guard (the ledger) is its own.
type watchingApplier struct {
	s    *simRun
	next *mig.Applier
}

// Apply implements MIGApplier.
func (w *watchingApplier) Apply(ctx context.Context, p mig.Plan, g mig.Guard) (mig.State, error) {
	if len(p.Steps) > 0 && w.s.rng.IntN(4) == 0 {
		w.s.meanwhile()
	}
	before := w.s.truth()
	// Deferred: a simulated crash mid-plan unwinds through here.
	defer func() { w.s.applied(p, before, w.s.truth()) }()
	return w.next.Apply(ctx, p, g)
}

// applied compares the GPUs before and after one apply.
func (s *simRun) applied(p mig.Plan, before, after *simTruth) {
	governed := s.governed()
	hs := s.holders(after)
	heldBy := func(u string, id ident) string {
		for _, h := range hs {
			if h.made || h.leaving {
				continue
			}
			for _, d := range h.devs {
				if d.uuid == u && d.id == id {
					return h.name
				}
			}
		}
		return ""
	}
	for _, u := range slices.Sorted(maps.Keys(before.mig)) {
		id := before.mig[u]
		if after.mig[u] == id {
			continue
		}
		delete(s.made, u)
		s.seen["MIG device destroyed"]++
		if by := heldBy(u, id); by != "" {
			s.foundNow("destroyed while held: a MIG device", fmt.Sprintf("%s (%s) of %s, by the MIG plan for GPU %d (want %s)", short(u), id, by, p.GPU, p.Want))
		}
	}
	for _, u := range slices.Sorted(maps.Keys(after.mig)) {
		id := after.mig[u]
		if before.mig[u] != id && !governed[id.gpu] {
			s.made[u] = id
			s.seen["MIG device made for a claim"]++
		}
	}
	for i, g := range after.gpus {
		was := before.gpus[i]
		if g.migOn == was.migOn {
			continue
		}
		if by := heldBy(g.uuid, ident{gpu: i, migOn: was.migOn}); by != "" {
			s.foundNow("destroyed while held: a GPU's MIG mode", fmt.Sprintf("GPU %d (%s) of %s turned MIG %v, by the MIG plan for GPU %d", i, short(g.uuid), by, g.migOn, p.GPU))
		}
		switch {
		case g.migOn && !governed[i]:
			s.dynOn[g.uuid] = true
			s.seen["MIG mode turned on for a claim"]++
		default:
			delete(s.dynOn, g.uuid)
		}
	}
}
