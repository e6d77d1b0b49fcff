package telemetry

import (
	"flag"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/podresources"
)

var update = flag.Bool("update", false, "rewrite golden files")

type fixedState struct{ s *health.State }

func (f fixedState) State() *health.State { return f.s }

type fixedAttribution struct{ a *podresources.Attribution }

func (f fixedAttribution) Attribution() *podresources.Attribution { return f.a }

type fixedCatalog struct{ c *catalog.Catalog }

func (f fixedCatalog) Catalog() *catalog.Catalog { return f.c }

func pod(ns, name, container, resource string, ids ...string) *podresourcesv1.PodResources {
	return &podresourcesv1.PodResources{Namespace: ns, Name: name, Containers: []*podresourcesv1.ContainerResources{{
		Name: container, Devices: []*podresourcesv1.ContainerDevices{{ResourceName: resource, DeviceIds: ids}},
	}}}
}

// goldenNode is a dgx-h100 trimmed to two GPUs: GPU 0 in MIG mode with two
// 1g instances (one running a process), GPU 1 whole, busy, shared by replicas.
// beforeValues (nil: none) runs once the GPUs are laid out, before their
// telemetry values (ECC counts, remapped rows) are set: a health watcher
// started then sees only the faults it is shown.
func goldenNode(t *testing.T, clk *simtest.Clock, beforeValues func(*sim.Node, *gpu.Inventory)) (*sim.Node, *gpu.Inventory) {
	t.Helper()
	n := simtest.Node(t, "dgx-h100", sim.WithImmediateMIGModeChange(), sim.WithClock(clk.Now))
	dev, _ := n.DeviceGetHandleByIndex(0)
	if _, r := dev.SetMigMode(nvml.DEVICE_MIG_ENABLE); r != nvml.SUCCESS {
		t.Fatalf("SetMigMode: %v", r)
	}
	info, r := dev.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	if r != nvml.SUCCESS {
		t.Fatal(r)
	}
	for s := range 2 {
		gi, r := dev.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: uint32(s), Size: 1})
		if r != nvml.SUCCESS {
			t.Fatal(r)
		}
		ci, _ := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if _, r := gi.CreateComputeInstance(&ci); r != nvml.SUCCESS {
			t.Fatal(r)
		}
	}
	inv := simtest.Inventory(t, n)
	inv.GPUs = inv.GPUs[:2]
	if beforeValues != nil {
		beforeValues(n, inv)
	}
	gi := inv.GPUs[0].Instances[0]
	must(t, n.SetProcesses(0, []nvml.ProcessInfo{{Pid: 42, UsedGpuMemory: 3 << 30, GpuInstanceId: uint32(gi.GI), ComputeInstanceId: uint32(gi.CI)}}))
	must(t, n.SetUtilization(1, 80, 35))
	must(t, n.SetMemoryUsed(1, 20<<30))
	must(t, n.SetTemperature(1, 61))
	must(t, n.SetPower(1, 512345))
	must(t, n.SetClocks(1, 1755, 2619))
	must(t, n.SetECC(1, 7, 1))
	must(t, n.SetRemappedRows(1, 2, 1, true, false))
	must(t, n.SetCodecUtilization(1, 0, 12))
	must(t, n.SetPCIeReplays(1, 3))
	must(t, n.SetInstanceUtilization(0, gi.GI, 50, 20))
	return n, inv
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

// scrape renders the collector as /metrics would.
func scrape(tb testing.TB, c prometheus.Collector, reg *prometheus.Registry) string {
	tb.Helper()
	if reg == nil {
		reg = prometheus.NewPedanticRegistry()
		reg.MustRegister(c)
	}
	rec := httptest.NewRecorder()
	promhttp.HandlerFor(reg, promhttp.HandlerOpts{ErrorHandling: promhttp.HTTPErrorOnError}).ServeHTTP(rec, httptest.NewRequest(http.MethodGet, "/metrics", nil))
	if rec.Code != http.StatusOK {
		tb.Fatalf("scrape: %d %s", rec.Code, rec.Body.String())
	}
	return rec.Body.String()
}

func goldenCollector(t *testing.T) (*Collector, *gpu.Inventory) {
	t.Helper()
	clk := simtest.NewClock()
	// GPU 1 had XIDs 13 and 48 (which marks it until reset) and a
	// single-bit ECC error, as the health watcher saw them.
	var st *health.State
	n, inv := goldenNode(t, clk, func(n *sim.Node, inv *gpu.Inventory) {
		st = watchedHealth(t, n, inv, func() {
			must(t, n.InjectXID(1, 13))
			must(t, n.InjectXID(1, 48))
			must(t, n.InjectEvent(sim.Event{GPU: 1, Type: nvml.EventTypeSingleBitEccError, GI: sim.NoInstance, CI: sim.NoInstance}))
		}, func(s *health.State) bool {
			st, ok := s.Stats(inv.GPUs[1].UUID)
			return ok && st.LastXID == 48 && st.SingleBitEvents == 1
		})
	})
	s := newSampler(n, clk)
	s.SetInventory(inv)
	s.Sample()

	g1, mig := inv.GPUs[1].UUID, inv.GPUs[0].Instances[0].UUID
	attr := podresources.NewAttribution([]*podresourcesv1.PodResources{
		pod("ml", "train-a", "worker", "nvidia.com/gpu.shared", g1+"::0"),
		pod("ml", "train-b", "worker", "nvidia.com/gpu.shared", g1+"::1", g1+"::2"),
		pod("web", "infer", "server", "nvidia.com/mig-1g.10gb", mig),
		pod("kube-system", "other", "c", "example.com/nic", "nic0"),
	}, podresources.IsGPUResource)
	cat := &catalog.Catalog{Resources: map[string]*catalog.Resource{"nvidia.com/gpu.shared": {
		Name: "nvidia.com/gpu.shared",
		Devices: []catalog.Device{
			{ID: g1 + "::0"}, {ID: g1 + "::1"}, {ID: g1 + "::2"}, {ID: g1 + "::3"},
		},
	}}}
	return NewCollector(CollectorOptions{
		Samples: s, Health: fixedState{st}, Attribution: fixedAttribution{attr},
		Catalog: fixedCatalog{cat}, Hostname: "node-1",
	}), inv
}

func TestCollectorGolden(t *testing.T) {
	c, _ := goldenCollector(t)
	got := scrape(t, c, nil)
	path := filepath.Join("testdata", "metrics.golden")
	if *update {
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if got != string(want) {
		t.Errorf("metrics differ from %s (run with -update if intended):\n%s", path, diffLines(string(want), got))
	}
}

// diffLines lists the lines only one side has.
func diffLines(want, got string) string {
	w, g := map[string]bool{}, map[string]bool{}
	for _, l := range strings.Split(want, "\n") {
		w[l] = true
	}
	for _, l := range strings.Split(got, "\n") {
		g[l] = true
	}
	var b strings.Builder
	for _, l := range strings.Split(want, "\n") {
		if !g[l] {
			b.WriteString("- " + l + "\n")
		}
	}
	for _, l := range strings.Split(got, "\n") {
		if !w[l] {
			b.WriteString("+ " + l + "\n")
		}
	}
	return b.String()
}

// TestCollectorSemantics asserts what the golden file must show, so an
// -update cannot bless a regression silently.
func TestCollectorSemantics(t *testing.T) {
	c, inv := goldenCollector(t)
	out := scrape(t, c, nil)
	g0, g1 := inv.GPUs[0], inv.GPUs[1]
	mig := g0.Instances[0]
	lines := strings.Split(out, "\n")
	// has reports whether a series of metric name has all labels (`k="v"`)
	// and, unless value is "", that value.
	has := func(name, value string, labels ...string) bool {
		for _, l := range lines {
			if !strings.HasPrefix(l, name+"{") || (value != "" && !strings.HasSuffix(l, "} "+value)) {
				continue
			}
			ok := true
			for _, lb := range labels {
				ok = ok && (strings.Contains(l, "{"+lb+",") || strings.Contains(l, ","+lb+",") || strings.Contains(l, ","+lb+"}") || strings.Contains(l, "{"+lb+"}"))
			}
			if ok {
				return true
			}
		}
		return false
	}
	q := func(k, v string) string { return k + `="` + v + `"` }
	gi := itoa(mig.GI)
	tests := []struct {
		name   string
		metric string
		value  string
		labels []string
		want   bool
	}{
		{"whole GPU carries dcgm labels, power in W", "DCGM_FI_DEV_POWER_USAGE", "512.345", []string{q("gpu", "1"), q("UUID", g1.UUID),
			q("device", "nvidia1"), q("modelName", "NVIDIA H100 80GB HBM3"), q("Hostname", "node-1"), q("GPU_I_ID", ""), q("DCGM_FI_DRIVER_VERSION", "550.54.15")}, true},
		{"pci_bus_id in NVML form", "DCGM_FI_DEV_GPU_TEMP", "", []string{q("gpu", "1"), q("pci_bus_id", nvmlBusID(g1.PCIBusID))}, true},
		{"framebuffer in MiB", "DCGM_FI_DEV_FB_USED", "20480", []string{q("gpu", "1")}, true},
		{"utilization on a whole GPU", "DCGM_FI_DEV_GPU_UTIL", "80", []string{q("gpu", "1")}, true},
		{"every replica holder gets a series", "DCGM_FI_DEV_GPU_TEMP", "61", []string{q("gpu", "1"), q("namespace", "ml"), q("pod", "train-a"), q("container", "worker")}, true},
		{"second replica holder", "DCGM_FI_DEV_GPU_TEMP", "61", []string{q("gpu", "1"), q("pod", "train-b")}, true},
		{"no unattributed series for a held GPU", "DCGM_FI_DEV_GPU_TEMP", "", []string{q("gpu", "1"), q("pod", "")}, false},
		{"no utilization on a MIG-enabled GPU", "DCGM_FI_DEV_GPU_UTIL", "", []string{q("gpu", "0")}, false},
		{"MIG device framebuffer with instance labels and pod", "DCGM_FI_DEV_FB_USED", "3072", []string{q("gpu", "0"), q("UUID", g0.UUID),
			q("GPU_I_PROFILE", "1g.10gb"), q("GPU_I_ID", gi), q("pod", "infer"), q("namespace", "web")}, true},
		{"no temperature per MIG device", "DCGM_FI_DEV_GPU_TEMP", "", []string{q("GPU_I_ID", gi)}, false},
		{"no pod on a MIG-enabled parent GPU", "DCGM_FI_DEV_GPU_TEMP", "", []string{q("gpu", "0"), q("pod", "infer")}, false},
		{"non-GPU resources are not attributed", "DCGM_FI_DEV_GPU_TEMP", "", []string{q("pod", "other")}, false},
		{"latest XID", "DCGM_FI_DEV_XID_ERRORS", "48", []string{q("gpu", "1")}, true},
		{"no XID yet", "DCGM_FI_DEV_XID_ERRORS", "0", []string{q("gpu", "0")}, true},
		{"health gauge of a marked GPU", "gpu_agent_device_healthy", "0", []string{q("gpu", "1"), q("GPU_I_ID", "")}, true},
		{"MIG devices of a healthy GPU healthy", "gpu_agent_device_healthy", "1", []string{q("gpu", "0"), q("GPU_I_ID", gi)}, true},
		{"replicas offered", "gpu_agent_replicas", "4", []string{q("UUID", g1.UUID), q("resource", "nvidia.com/gpu.shared")}, true},
		{"replicas allocated", "gpu_agent_device_allocated_ids", "3", []string{q("gpu", "1"), q("GPU_I_ID", "")}, true},
		{"holders", "gpu_agent_device_holders", "2", []string{q("gpu", "1"), q("GPU_I_ID", "")}, true},
		{"allocations per container", "gpu_agent_allocated_devices", "2", []string{q("pod", "train-b"), q("resource", "nvidia.com/gpu.shared")}, true},
		{"xid counter", "gpu_agent_xid_events_total", "1", []string{q("gpu", "1"), q("xid", "13")}, true},
		{"per-GPU xid counter", "gpu_agent_gpu_xid_events_total", "2", []string{q("gpu", "1")}, true},
		{"per-GPU xid counter at 0 before any XID", "gpu_agent_gpu_xid_events_total", "0", []string{q("gpu", "0")}, true},
		{"ecc counter", "gpu_agent_ecc_events_total", "1", []string{q("gpu", "1"), q("type", "single-bit")}, true},
		{"mig mode", "gpu_agent_mig_mode", "1", []string{q("gpu", "0"), q("state", "current")}, true},
		{"mig devices", "gpu_agent_mig_devices", "2", []string{q("gpu", "0"), q("profile", "1g.10gb")}, true},
		{"active cause", "gpu_agent_health_causes", "1", []string{q("gpu", "1"), q("class", "reset-gpu"), q("kind", "xid")}, true},
		{"decoder utilization, attributed", "DCGM_FI_DEV_DEC_UTIL", "12", []string{q("gpu", "1"), q("pod", "train-a")}, true},
		{"no encoder series on an H100 (no NVENC), not a 0", "DCGM_FI_DEV_ENC_UTIL", "", nil, false},
		{"no decoder series on a MIG-enabled GPU", "DCGM_FI_DEV_DEC_UTIL", "", []string{q("gpu", "0")}, false},
		{"PCIe replays", "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", "3", []string{q("gpu", "1")}, true},
		{"HBM temperature follows the GPU's and memory load", "DCGM_FI_DEV_MEMORY_TEMP", "67", []string{q("gpu", "1")}, true},
		{"reserved framebuffer", "DCGM_FI_DEV_FB_RESERVED", "407", []string{q("gpu", "1")}, true},
		{"no reserved framebuffer per MIG device", "DCGM_FI_DEV_FB_RESERVED", "", []string{q("GPU_I_ID", gi)}, false},
		{"MIG-enabled GPU's used framebuffer is its instances'", "DCGM_FI_DEV_FB_USED", "3072", []string{q("gpu", "0"), q("GPU_I_ID", "")}, true},
		{"NVLink counter", "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "", []string{q("gpu", "1")}, true},
		{"engine activity of a whole GPU from GPM", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "0.8000000000000002", []string{q("gpu", "1"), q("pod", "train-b")}, true},
		{"engine activity per MIG instance, attributed", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "0.5", []string{q("gpu", "0"), q("UUID", g0.UUID),
			q("GPU_I_PROFILE", "1g.10gb"), q("GPU_I_ID", gi), q("pod", "infer")}, true},
		{"idle MIG instance has a 0, not no series", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "0", []string{q("gpu", "0"), q("GPU_I_ID", itoa(g0.Instances[1].GI))}, true},
		{"MIG-enabled GPU's engine activity weighs its instances by slices", "DCGM_FI_PROF_GR_ENGINE_ACTIVE", "0.07142857142857142", []string{q("gpu", "0"), q("GPU_I_ID", "")}, true},
		{"NVLink traffic in bytes/s", "DCGM_FI_PROF_NVLINK_TX_BYTES", "1.08e+11", []string{q("gpu", "1")}, true},
		{"no PCIe traffic per MIG instance", "DCGM_FI_PROF_PCIE_TX_BYTES", "", []string{q("GPU_I_ID", gi)}, false},
		{"no NVLink traffic per MIG instance", "DCGM_FI_PROF_NVLINK_RX_BYTES", "", []string{q("GPU_I_ID", gi)}, false},
	}
	for _, tt := range tests {
		if got := has(tt.metric, tt.value, tt.labels...); got != tt.want {
			t.Errorf("%s: found=%v, want %v (%s %v = %q)", tt.name, got, tt.want, tt.metric, tt.labels, tt.value)
		}
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

func TestSamplerLostAndNotSupported(t *testing.T) {
	n := simtest.Node(t, "pcie-4gpu")
	inv := simtest.Inventory(t, n)
	s := NewSampler(n, SamplerOptions{})
	s.SetInventory(inv)
	s.Sample()
	g := s.Snapshot().GPUs[2]
	if _, ok := g.Values.Get(FieldGPUTemp); !ok {
		t.Fatal("temperature not sampled")
	}
	must(t, n.SetLost(2, true))
	s.Sample()
	g = s.Snapshot().GPUs[2]
	if !g.Lost {
		t.Error("lost GPU not flagged")
	}
	if _, ok := g.Values.Get(FieldGPUTemp); ok {
		t.Error("lost GPU still reports a temperature")
	}
	if _, ok := s.Snapshot().GPUs[1].Values.Get(FieldGPUTemp); !ok {
		t.Error("another GPU lost its values because one was lost")
	}
	must(t, n.SetLost(2, false))
	s.Sample()
	if g := s.Snapshot().GPUs[2]; g.Lost {
		t.Error("GPU still lost after it came back")
	}
}

func TestNVMLBusID(t *testing.T) {
	tests := map[string]string{"0000:07:00.0": "00000000:07:00.0", "0000:a1:00.0": "00000000:A1:00.0", "00000000:07:00.0": "00000000:07:00.0"}
	for in, want := range tests {
		if got := nvmlBusID(in); got != want {
			t.Errorf("nvmlBusID(%q) = %q, want %q", in, got, want)
		}
	}
}

// A GPU instance split into compute instances (a 1c.* profile) is one
// series per holder, not one per MIG device: those would carry the same
// labels, and a registry refuses duplicates (the whole scrape fails).
func TestCollectorComputeInstancesShareTheirGPUInstance(t *testing.T) {
	clk := simtest.NewClock()
	n := simtest.Node(t, "dgx-h100", sim.WithMIGEnabled(), sim.WithClock(clk.Now))
	dev, _ := n.DeviceGetHandleByIndex(0)
	info, _ := dev.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_2_SLICE)
	gi, r := dev.CreateGpuInstance(&info)
	if r != nvml.SUCCESS {
		t.Fatal(r)
	}
	ci, _ := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	for range 2 {
		if _, r := gi.CreateComputeInstance(&ci); r != nvml.SUCCESS {
			t.Fatal(r)
		}
	}
	inv := simtest.Inventory(t, n)
	ins := inv.GPUs[0].Instances
	if len(ins) != 2 || ins[0].GI != ins[1].GI {
		t.Fatalf("want two MIG devices in one GPU instance, got %+v", ins)
	}
	must(t, n.SetInstanceUtilization(0, ins[0].GI, 30, 10))
	s := newSampler(n, clk)
	s.SetInventory(inv)
	s.Sample()
	tests := []struct {
		name  string
		pods  []*podresourcesv1.PodResources
		holds []string // pods of the GPU instance's series, "" for none
	}{
		{"neither held", nil, []string{""}},
		{"one held", []*podresourcesv1.PodResources{pod("a", "p1", "c", "nvidia.com/mig-1c.2g.20gb", ins[1].UUID)}, []string{"p1"}},
		{"each held by another pod", []*podresourcesv1.PodResources{
			pod("a", "p1", "c", "nvidia.com/mig-1c.2g.20gb", ins[0].UUID),
			pod("a", "p2", "c", "nvidia.com/mig-1c.2g.20gb", ins[1].UUID),
		}, []string{"p1", "p2"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := NewCollector(CollectorOptions{Samples: s, Attribution: fixedAttribution{podresources.NewAttribution(tt.pods, podresources.IsGPUResource)}})
			out := scrape(t, c, nil) // fails on duplicate series
			for _, name := range []string{"DCGM_FI_DEV_FB_USED", "DCGM_FI_PROF_GR_ENGINE_ACTIVE"} {
				var got []string
				for _, l := range strings.Split(out, "\n") {
					if strings.HasPrefix(l, name+"{") && strings.Contains(l, `GPU_I_ID="`+itoa(ins[0].GI)+`"`) {
						_, rest, _ := strings.Cut(l, `pod="`)
						p, _, _ := strings.Cut(rest, `"`)
						got = append(got, p)
					}
				}
				if !slices.Equal(got, tt.holds) {
					t.Errorf("%s: series for pods %q, want %q", name, got, tt.holds)
				}
			}
			holders := "0"
			if tt.pods != nil {
				holders = itoa(len(tt.pods))
			}
			if want := `gpu_agent_device_holders{GPU_I_ID="` + itoa(ins[0].GI) + `",GPU_I_PROFILE="` + ins[0].Profile + `",UUID="` + inv.GPUs[0].UUID + `",gpu="0"} ` + holders; !strings.Contains(out, want+"\n") {
				t.Errorf("no %s", want)
			}
		})
	}
}
