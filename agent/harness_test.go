package agent

import (
	"context"
	"errors"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/mig"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// recorder is a Publisher that keeps every catalog it was given.
type recorder struct {
	mu   sync.Mutex
	cats []*catalog.Catalog
	got  chan struct{}
}

func newRecorder() *recorder { return &recorder{got: make(chan struct{}, 1000)} }

func (r *recorder) Update(c *catalog.Catalog) {
	r.mu.Lock()
	r.cats = append(r.cats, c)
	r.mu.Unlock()
	select {
	case r.got <- struct{}{}:
	default:
	}
}

func (r *recorder) last() *catalog.Catalog {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.cats) == 0 {
		return &catalog.Catalog{Resources: map[string]*catalog.Resource{}}
	}
	return r.cats[len(r.cats)-1]
}

func (r *recorder) published() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.cats)
}

// clock is a hand-driven clock.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func newClock() *clock { return &clock{now: time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// holdings is a pod-resources API the test scripts: who holds what, or an
// error (unreachable, hanging).
type holdings struct {
	mu    sync.Mutex
	att   *podresources.Attribution
	err   error
	calls int
}

func (h *holdings) Refresh(context.Context) (*podresources.Attribution, error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	h.calls++
	if h.err != nil {
		return nil, h.err
	}
	if h.att == nil {
		return podresources.NewAttribution(nil, nil), nil
	}
	return h.att, nil
}

// hold makes ml/trainer (main) hold ids of resource (none: nothing held).
func (h *holdings) hold(resource string, ids ...string) *podresources.Attribution {
	var pods []*podresourcesv1.PodResources
	if len(ids) > 0 {
		pods = []*podresourcesv1.PodResources{{Name: "trainer", Namespace: "ml", Containers: []*podresourcesv1.ContainerResources{{
			Name: "main", Devices: []*podresourcesv1.ContainerDevices{{ResourceName: resource, DeviceIds: ids}}}}}}
	}
	att := podresources.NewAttribution(pods, nil)
	h.mu.Lock()
	h.att, h.err = att, nil
	h.mu.Unlock()
	return att
}

func (h *holdings) fail(err error) {
	h.mu.Lock()
	h.err = err
	h.mu.Unlock()
}

func (h *holdings) refreshes() int {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.calls
}

// healthControl records what the loop told the health watcher.
type healthControl struct {
	inventories int
	policies    []health.Policy
}

func (h *healthControl) SetInventory(*gpu.Inventory) { h.inventories++ }
func (h *healthControl) SetPolicy(p health.Policy)   { h.policies = append(h.policies, p) }

// harness drives one agent by hand: events in, Step, assertions on what it
// published. No goroutine runs the loop, so nothing depends on timing.
type harness struct {
	t      testing.TB
	node   *sim.Node
	a      *Agent
	pub    *recorder
	hold   *holdings
	health *healthControl
	clock  *clock
	dir    string
	opts   Options
	// background is work the loop handed off (Options.Background), run by
	// step once the batch is done, as the goroutine would.
	background []func() Event
}

type harnessOption func(*harness)

// withMIG gives the agent a MIG applier journaling under the harness's dir.
func withMIG() harnessOption {
	return func(h *harness) { h.opts.MIG = mig.NewApplier(h.node, h.dir, nil) }
}

// withReset lets the agent reset the simulated node's GPUs.
func withReset() harnessOption {
	return func(h *harness) {
		node := h.node
		h.opts.Reset = mig.NewResetter(node, func(_ context.Context, g gpu.GPU) error { return node.Reset(g.Index) })
	}
}

// withQuietLog drops the agent's log (benchmarks).
func withQuietLog() harnessOption {
	return func(h *harness) { h.opts.Logger = slog.New(slog.DiscardHandler) }
}

// withoutHoldings leaves the agent without a pod-resources API.
func withoutHoldings() harnessOption {
	return func(h *harness) { h.opts.Holdings = nil }
}

// withCheckpoint starts the agent from what an earlier agent checkpointed
// in the harness's state dir.
func withCheckpoint() harnessOption {
	return func(h *harness) {
		cp, err := LoadCheckpoint(h.dir)
		if err != nil {
			h.t.Fatal(err)
		}
		h.opts.Restored = cp
	}
}

func newHarness(t testing.TB, node *sim.Node, opts ...harnessOption) *harness {
	t.Helper()
	return newHarnessIn(t, node, t.TempDir(), opts...)
}

// newHarnessIn runs the agent with dir as its state dir (a restart reuses
// the dir of the agent it replaces).
func newHarnessIn(t testing.TB, node *sim.Node, dir string, opts ...harnessOption) *harness {
	t.Helper()
	h := &harness{t: t, node: node, pub: newRecorder(), hold: &holdings{}, health: &healthControl{}, clock: newClock(), dir: dir}
	h.opts = Options{
		Observer: mig.NewObserver(node, gpu.Options{}), NodeName: "node-a", ConfigSource: "test.yaml",
		WaitForConfig: true, Publisher: h.pub, Health: h.health, Holdings: h.hold,
		StateDir: dir, Now: h.clock.Now, ResyncInterval: 30 * time.Second,
		Background: func(work func() Event) { h.background = append(h.background, work) },
		Logger:     slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug})),
	}
	for _, o := range opts {
		o(h)
	}
	h.a = New(h.opts)
	return h
}

type testWriter struct{ t testing.TB }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSuffix(string(p), "\n"))
	return len(p), nil
}

func simNode(t testing.TB, profile string, opts ...sim.Option) *sim.Node {
	t.Helper()
	n, err := sim.New(profile, opts...)
	if err != nil {
		t.Fatal(err)
	}
	n.Init()
	return n
}

// step handles one batch, then whatever work the loop handed off (asking
// the kubelet) and the batch each answer makes, until none is left: what
// the loop and its goroutines do, in order, without either.
func (h *harness) step(evs ...Event) {
	h.a.Step(evs)
	for len(h.background) > 0 {
		work := h.background[0]
		h.background = h.background[1:]
		h.a.Step([]Event{work()})
	}
}

// allocate is the device plugin's Allocate of device IDs of resource: the
// ledger records it (or refuses, the error returned), then the plugin
// tells the loop.
func (h *harness) allocate(resource string, ids ...string) error {
	if err := h.a.Ledger().Admit(resource, handoutsOf(ids)); err != nil {
		return err
	}
	h.step(Allocated{Resource: resource, IDs: ids})
	return nil
}

func (h *harness) config(yaml string) {
	h.step(ConfigChanged{Update: config.Update{Data: []byte(yaml)}})
}

// count is how many devices the last catalog offers under res.
func (h *harness) count(res string) int {
	r := h.pub.last().Resources[res]
	if r == nil {
		return 0
	}
	return len(r.Devices)
}

func (h *harness) device(res, id string) (catalog.Device, bool) {
	r := h.pub.last().Resources[res]
	if r == nil {
		return catalog.Device{}, false
	}
	return r.Device(id)
}

func (h *harness) migState(gpu int) MIGState {
	for _, st := range h.a.Status().MIG {
		if st.GPU == gpu {
			return st
		}
	}
	h.t.Fatalf("no MIG state for GPU %d in %+v", gpu, h.a.Status().MIG)
	return MIGState{}
}

// mixedLayout is a v1 config repartitioning every GPU to counts (mixed strategy).
func mixedLayout(counts string) string {
	return "version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n      devices:\n      - devices: all\n        mig-enabled: true\n        mig-devices: " + counts + "\n"
}

var errUnreachable = errors.New("dial unix /var/lib/kubelet/pod-resources/kubelet.sock: connect: no such file or directory")

// handoutsOf is what the device plugin hands the ledger for device IDs of
// the uuid strategy: each device once, "<uuid>::<n>" a replica of <uuid>.
func handoutsOf(ids []string) []ledger.Handout {
	var out []ledger.Handout
	for _, id := range ids {
		uuid, _, replica := strings.Cut(id, "::")
		if h := (ledger.Handout{UUID: uuid, Replica: replica}); !slices.Contains(out, h) {
			out = append(out, h)
		}
	}
	return out
}
