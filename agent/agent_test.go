package agent

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/mig"
)

// recorder is a Publisher that keeps every catalog it was given.
type recorder struct {
	mu   sync.Mutex
	cats []*catalog.Catalog
	got  chan struct{}
}

func newRecorder() *recorder { return &recorder{got: make(chan struct{}, 100)} }

func (r *recorder) Update(c *catalog.Catalog) {
	r.mu.Lock()
	r.cats = append(r.cats, c)
	r.mu.Unlock()
	r.got <- struct{}{}
}

func (r *recorder) last() *catalog.Catalog {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.cats) == 0 {
		return &catalog.Catalog{Resources: map[string]*catalog.Resource{}}
	}
	return r.cats[len(r.cats)-1]
}

func (r *recorder) wait(t *testing.T) {
	t.Helper()
	select {
	case <-r.got:
	case <-time.After(5 * time.Second):
		t.Fatal("no catalog published")
	}
}

func startAgent(t *testing.T, profile string, updates chan config.Update, reg prometheus.Registerer) (*Agent, *recorder) {
	t.Helper()
	node, err := sim.New(profile)
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	rec := newRecorder()
	a := New(Options{Lib: node, NodeName: "node-a", ConfigSource: "test.yaml", ConfigUpdates: updates,
		Publisher: rec, ResyncInterval: time.Hour, Registerer: reg})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return a, rec
}

func TestAgentDefaultConfigServesWholeGPUs(t *testing.T) {
	a, rec := startAgent(t, "dgx-a100", nil, nil)
	rec.wait(t)
	r := rec.last().Resources[ResourceGPU]
	if r == nil || len(r.Devices) != 8 {
		t.Fatalf("want 8 whole GPUs, got %+v", rec.last().Names())
	}
	for _, d := range r.Devices {
		if !strings.HasPrefix(d.ID, "GPU-") || !d.Healthy || d.NUMANode < 0 {
			t.Errorf("device %+v: want a healthy GPU UUID with its NUMA node", d)
		}
	}
	waitFor(t, func() bool { return !a.Status().LastPass.IsZero() })
	st := a.Status()
	if len(st.GPUs) != 8 || st.Config.Source != "test.yaml" || st.Config.Name != "default" {
		t.Errorf("status %+v", st)
	}
}

func TestAgentKeepsLastGoodConfig(t *testing.T) {
	updates := make(chan config.Update)
	reg := prometheus.NewRegistry()
	a, rec := startAgent(t, "pcie-4gpu", updates, reg)

	good := "version: v1\nconfigs:\n  default:\n    devicePlugin:\n      passDeviceSpecs: true\n"
	updates <- config.Update{Data: []byte(good)}
	rec.wait(t)
	first := rec.last()
	if n := len(first.Resources[ResourceGPU].Devices); n != 4 {
		t.Fatalf("want 4 GPUs, got %d", n)
	}
	if got := first.Resources[ResourceGPU].Devices[0].Spec.DeviceNodes; len(got) != 1 {
		t.Fatalf("passDeviceSpecs not applied: %v", got)
	}

	updates <- config.Update{Data: []byte("version: v1\nconfigs:\n  default:\n    devicePlugin:\n      passDeviceSpec: true\n")}
	waitFor(t, func() bool { return a.Status().Config.Error != "" })
	st := a.Status()
	if !strings.Contains(st.Config.Error, "passDeviceSpec") {
		t.Errorf("error %q does not name the bad field", st.Config.Error)
	}
	if st.Config.Generation != 1 || st.Config.Name != "default" {
		t.Errorf("last good config not kept: %+v", st.Config)
	}
	if got := testutil.ToFloat64(a.metrics.configValid); got != 0 {
		t.Errorf("gpu_agent_config_valid = %v, want 0", got)
	}
	// The rejected edit must not have published anything.
	select {
	case <-rec.got:
		t.Fatal("a rejected config published a catalog")
	case <-time.After(50 * time.Millisecond):
	}

	updates <- config.Update{Err: errors.New("read config.yaml: no such file")}
	waitFor(t, func() bool { return strings.Contains(a.Status().Config.Error, "no such file") })

	updates <- config.Update{Data: []byte("version: v1\nconfigs:\n  default: {}\n")}
	rec.wait(t)
	waitFor(t, func() bool { return a.Status().Config.Generation == 2 })
	if st := a.Status(); st.Config.Error != "" {
		t.Errorf("after a good edit: %+v", st.Config)
	}
	if got := rec.last().Resources[ResourceGPU].Devices[0].Spec.DeviceNodes; len(got) != 0 {
		t.Errorf("device specs still passed after the edit turned them off: %v", got)
	}
	if got := testutil.ToFloat64(a.metrics.configErrors); got != 2 {
		t.Errorf("gpu_agent_config_errors_total = %v, want 2", got)
	}
}

func TestAgentFirstConfigInvalidServesNothing(t *testing.T) {
	updates := make(chan config.Update)
	a, rec := startAgent(t, "pcie-4gpu", updates, nil)
	updates <- config.Update{Data: []byte("version: v2\n")}
	waitFor(t, func() bool { return a.Status().Config.Error != "" })
	select {
	case <-rec.got:
		t.Fatal("published a catalog without any valid config")
	case <-time.After(50 * time.Millisecond):
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met in 5s")
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestAgentLostGPUStaysUnhealthy(t *testing.T) {
	node, err := sim.New("pcie-4gpu")
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	rec := newRecorder()
	a := New(Options{Lib: node, Publisher: rec, ResyncInterval: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go a.Run(ctx)
	rec.wait(t)

	if err := node.SetLost(2, true); err != nil {
		t.Fatal(err)
	}
	var lost catalog.Device
	waitFor(t, func() bool {
		d := findGPU(rec.last(), 2)
		lost = d
		return !d.Healthy
	})
	if n := len(rec.last().Resources[ResourceGPU].Devices); n != 4 {
		t.Errorf("lost GPU removed from the catalog: %d devices, want 4", n)
	}
	if !strings.Contains(lost.Reason, "GPU_IS_LOST") {
		t.Errorf("reason %q does not say the GPU is lost", lost.Reason)
	}
	for _, d := range rec.last().Resources[ResourceGPU].Devices {
		if d.GPU != 2 && !d.Healthy {
			t.Errorf("GPU %d marked unhealthy by another GPU's loss", d.GPU)
		}
	}

	if err := node.Reset(2); err != nil {
		t.Fatal(err)
	}
	waitFor(t, func() bool { return findGPU(rec.last(), 2).Healthy })
}

func findGPU(c *catalog.Catalog, idx int) catalog.Device {
	for _, d := range c.Resources[ResourceGPU].Devices {
		if d.GPU == idx {
			return d
		}
	}
	return catalog.Device{}
}

func TestAgentHealthMarksAndRecovers(t *testing.T) {
	node, err := sim.New("dgx-a100")
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	w := health.NewWatcher(node, health.PolicyFromConfig(config.Health{}), health.WatcherOptions{WaitTimeout: 10 * time.Millisecond})
	rec := newRecorder()
	updates := make(chan config.Update, 1)
	// The config's health section reaches the watcher: probe often, so the
	// reset is noticed within the test.
	updates <- config.Update{Data: []byte("version: v1\nconfigs:\n  default:\n    health:\n      probeInterval: 50ms\n")}
	a := New(Options{Lib: node, Publisher: rec, Health: w, HealthChanged: w.Changes(), ConfigUpdates: updates, ResyncInterval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	go a.Run(ctx)
	rec.wait(t)

	// An application XID (13) is ignored by default; a fatal one (48, double-bit ECC) marks only its GPU.
	// The watcher registers for events on its own schedule after it gets the
	// inventory: inject until the XIDs are seen.
	waitFor(t, func() bool {
		node.InjectXID(0, 13)
		node.InjectXID(1, 48)
		time.Sleep(20 * time.Millisecond)
		return !findGPU(rec.last(), 1).Healthy
	})
	for _, d := range rec.last().Resources[ResourceGPU].Devices {
		if d.GPU != 1 && !d.Healthy {
			t.Errorf("GPU %d unhealthy (%s); only GPU 1 had a fatal XID", d.GPU, d.Reason)
		}
	}
	if r := findGPU(rec.last(), 1).Reason; !strings.Contains(r, "48") {
		t.Errorf("reason %q does not name XID 48", r)
	}
	waitFor(t, func() bool { return len(a.Status().HealthCauses) == 1 })

	// A reset clears a reset-class XID.
	node.Reset(1)
	deadline := time.Now().Add(5 * time.Second)
	for !findGPU(rec.last(), 1).Healthy {
		if time.Now().After(deadline) {
			st := w.State()
			t.Fatalf("GPU 1 not healthy after reset: causes %+v log %+v", st.Causes, st.Log)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestAgentConfigThatDoesNotFitKeepsServing(t *testing.T) {
	node, err := sim.New("pcie-4gpu")
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	w := health.NewWatcher(node, health.PolicyFromConfig(config.Health{}), health.WatcherOptions{WaitTimeout: 10 * time.Millisecond})
	updates := make(chan config.Update)
	rec := newRecorder()
	resync := 20 * time.Millisecond
	a := New(Options{Lib: node, Publisher: rec, Health: w, HealthChanged: w.Changes(), ConfigUpdates: updates, ResyncInterval: resync})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go w.Run(ctx)
	go a.Run(ctx)

	updates <- config.Update{Data: []byte("version: v1\nconfigs:\n  default: {}\n")}
	rec.wait(t)
	misfit := "version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources:\n        - name: nvidia.com/gpu\n          devices: [\"7\"]\n          replicas: 2\n"
	updates <- config.Update{Data: []byte(misfit)}
	waitFor(t, func() bool { return strings.Contains(a.Status().Config.Error, "devices[0]") })
	if n := len(rec.last().Resources[ResourceGPU].Devices); n != 4 {
		t.Errorf("serving %d devices after a misfit config, want the last good 4 whole GPUs", n)
	}

	// Health keeps reaching the kubelet while the misfit config is in the file.
	waitFor(t, func() bool {
		node.InjectXID(1, 48)
		time.Sleep(20 * time.Millisecond)
		return !findGPU(rec.last(), 1).Healthy
	})
	// And the loop stays alive: a liveness restart would withdraw every device.
	time.Sleep(5 * resync)
	if !a.Alive() {
		t.Error("agent not alive while serving the last good config")
	}

	fits := strings.Replace(misfit, `["7"]`, `["3"]`, 1)
	updates <- config.Update{Data: []byte(fits)}
	waitFor(t, func() bool {
		return a.Status().Config.Error == "" && len(rec.last().Resources[ResourceGPU].Devices) == 5
	})
}

// fakeHoldings is a pod-resources answer the test can change.
type fakeHoldings struct {
	mu  sync.Mutex
	att *health.Attribution
}

func (f *fakeHoldings) Attribution() *health.Attribution {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.att
}

func (f *fakeHoldings) set(resource string, ids ...string) {
	pods := []*podresourcesv1.PodResources{{Name: "trainer", Namespace: "ml", Containers: []*podresourcesv1.ContainerResources{{
		Name: "main", Devices: []*podresourcesv1.ContainerDevices{{ResourceName: resource, DeviceIds: ids}}}}}}
	if len(ids) == 0 {
		pods = nil
	}
	f.mu.Lock()
	f.att = health.NewAttribution(pods, nil)
	f.mu.Unlock()
}

func TestAgentKeepsHeldReplicasAdvertised(t *testing.T) {
	node, err := sim.New("pcie-4gpu")
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	holdings := &fakeHoldings{}
	updates := make(chan config.Update)
	rec := newRecorder()
	a := New(Options{Lib: node, Publisher: rec, Holdings: holdings, ConfigUpdates: updates, ResyncInterval: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go a.Run(ctx)

	updates <- config.Update{Data: []byte("version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources:\n        - name: nvidia.com/gpu\n          replicas: 2\n")}
	rec.wait(t)
	held := rec.last().Resources[ResourceGPU].Devices[0].ID
	holdings.set(ResourceGPU, held)

	updates <- config.Update{Data: []byte("version: v1\nconfigs:\n  default: {}\n")}
	waitFor(t, func() bool {
		return a.Status().Config.Generation == 2 && len(rec.last().Resources[ResourceGPU].Devices) == 5
	})
	d, ok := rec.last().Resources[ResourceGPU].Device(held)
	if !ok || d.Healthy || !strings.Contains(d.Reason, "held by ml/trainer (main)") {
		t.Fatalf("held replica %s: %+v (present %v); want it advertised unhealthy, naming its holder", held, d, ok)
	}
	for _, d := range rec.last().Resources[ResourceGPU].Devices {
		if d.ID != held && (!d.Healthy || strings.Contains(d.ID, "::")) {
			t.Errorf("device %+v: want the 4 whole GPUs healthy", d)
		}
	}

	heldBy := ""
	for _, d := range a.Status().Resource[0].Devices {
		if d.ID == held {
			heldBy = d.HeldBy
		}
	}
	if heldBy != "ml/trainer (main)" {
		t.Errorf("/status says %s is held by %q, want ml/trainer (main)", held, heldBy)
	}
	// Before the edit, /status listed the shared devices; now none is shared.
	if sh := a.Status().Sharing; len(sh) != 1 || sh[0].Replicas != 1 || sh[0].Mode != "timeSlicing" || len(sh[0].Holders) != 1 {
		t.Errorf("sharing status %+v: want the held replica's GPU, 1 replica left, its holder", sh)
	}

	// Released: the next pass withdraws it.
	holdings.set(ResourceGPU)
	waitFor(t, func() bool { return len(rec.last().Resources[ResourceGPU].Devices) == 4 })
}

func TestAgentRepartitionsMIGLive(t *testing.T) {
	node, err := sim.New("dgx-h100", sim.WithMIGEnabled())
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	holdings := &fakeHoldings{}
	updates := make(chan config.Update)
	rec := newRecorder()
	a := New(Options{Lib: node, Publisher: rec, Holdings: holdings, ConfigUpdates: updates, ResyncInterval: 20 * time.Millisecond,
		MIG: mig.NewApplier(node, t.TempDir(), nil)})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go a.Run(ctx)

	layout := func(counts string) []byte {
		return []byte("version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n      devices:\n      - devices: all\n        mig-enabled: true\n        mig-devices: " + counts + "\n")
	}
	count := func(res string) int {
		r := rec.last().Resources[res]
		if r == nil {
			return 0
		}
		return len(r.Devices)
	}
	updates <- config.Update{Data: layout(`{"1g.10gb": 2, "3g.40gb": 1}`)}
	waitFor(t, func() bool { return count("nvidia.com/mig-1g.10gb") == 16 && count("nvidia.com/mig-3g.40gb") == 8 })
	for _, st := range a.Status().MIG {
		if st.Phase != mig.PhaseApplied {
			t.Errorf("GPU %d: MIG %+v, want applied", st.GPU, st)
		}
	}
	if count(ResourceGPU) != 0 {
		t.Errorf("MIG-enabled GPUs offered whole: %d", count(ResourceGPU))
	}

	// A pod holds a 1g instance of GPU 0; the new layout has no 1g: GPU 0 waits, naming the holder.
	var held string
	for _, d := range rec.last().Resources["nvidia.com/mig-1g.10gb"].Devices {
		if d.GPU == 0 {
			held = d.ID
			break
		}
	}
	holdings.set("nvidia.com/mig-1g.10gb", held)
	updates <- config.Update{Data: layout(`{"3g.40gb": 2}`)}
	waitFor(t, func() bool { return count("nvidia.com/mig-3g.40gb") == 15 })
	st := a.Status().MIG[0]
	if st.Phase != mig.PhasePending || !strings.Contains(st.Reason, "ml/trainer") {
		t.Errorf("GPU 0: MIG %+v, want pending naming ml/trainer", st)
	}
	if _, ok := rec.last().Resources["nvidia.com/mig-1g.10gb"].Device(held); !ok {
		t.Errorf("held instance %s no longer served", held)
	}

	// Released: GPU 0 converges by itself.
	holdings.set("nvidia.com/mig-1g.10gb")
	waitFor(t, func() bool { return count("nvidia.com/mig-3g.40gb") == 16 && count("nvidia.com/mig-1g.10gb") == 0 })
	if st := a.Status().MIG[0]; st.Phase != mig.PhaseApplied {
		t.Errorf("GPU 0 after release: %+v", st)
	}
}

// A MIG device allocated a moment ago counts as held before the kubelet's
// pod-resources answer lists it: a layout edit then must not destroy it.
func TestAgentRecentAllocationBlocksDestroy(t *testing.T) {
	node, err := sim.New("dgx-h100-mig")
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	updates := make(chan config.Update)
	rec := newRecorder()
	a := New(Options{Lib: node, Publisher: rec, Holdings: &fakeHoldings{}, ConfigUpdates: updates, ResyncInterval: time.Hour,
		MIG: mig.NewApplier(node, t.TempDir(), nil)})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go a.Run(ctx)
	updates <- config.Update{Data: []byte("version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n")}
	rec.wait(t)
	victim := rec.last().Resources["nvidia.com/mig-1g.10gb"].Devices[0]
	a.NoteAllocated([]string{victim.ID})

	updates <- config.Update{Data: []byte("version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n      devices:\n      - devices: all\n        mig-enabled: true\n        mig-devices: {\"7g.80gb\": 1}\n")}
	waitFor(t, func() bool {
		r := rec.last().Resources["nvidia.com/mig-7g.80gb"]
		return r != nil && len(r.Devices) == 7
	})
	if _, ok := rec.last().Resources["nvidia.com/mig-1g.10gb"].Device(victim.ID); !ok {
		t.Fatalf("recently allocated %s was destroyed", victim.ID)
	}
	st := a.Status().MIG[victim.GPU]
	if st.Phase != mig.PhasePending || !strings.Contains(st.Reason, "not yet listed by the kubelet") {
		t.Errorf("GPU %d: %+v, want pending on the recent allocation", victim.GPU, st)
	}
}
