package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/utils/ptr"
)

func TestParseCPUTime(t *testing.T) {
	// A comm with a space and a parenthesis: only what follows the last ')' counts. utime 250, stime 50.
	stat := "4242 (kube sched) uler) S 1 4242 4242 0 -1 4194560 100 0 0 0 250 50 0 0 20 0 12 0 1234 0 0"
	got, err := parseCPUTime([]byte(stat))
	if err != nil {
		t.Fatal(err)
	}
	if want := 3 * time.Second; got != want {
		t.Fatalf("got %s, want %s", got, want)
	}
	if _, err := parseCPUTime([]byte("4242 (x) S 1 2")); err == nil {
		t.Fatal("a short stat line was read")
	}
}

func TestParseMemory(t *testing.T) {
	status := "Name:\tkube-scheduler\nVmPeak:\t  900000 kB\nVmHWM:\t   204800 kB\nVmRSS:\t   102400 kB\nThreads:\t12\n"
	got, err := parseMemory([]byte(status))
	if err != nil {
		t.Fatal(err)
	}
	if got.HWM != 200<<20 || got.RSS != 100<<20 {
		t.Fatalf("got %+v, want HWM 200 MiB, RSS 100 MiB", got)
	}
	if _, err := parseMemory([]byte("Name:\tkthreadd\n")); err == nil {
		t.Fatal("a status without VmRSS was read")
	}
}

func str(s string) resourceapi.DeviceAttribute { return resourceapi.DeviceAttribute{StringValue: &s} }
func num(n int64) resourceapi.DeviceAttribute  { return resourceapi.DeviceAttribute{IntValue: &n} }

// defaultLike is a small default-model pool: two GPUs consuming their counters, a MIG placement, and the
// counter sets in a slice of their own, as the agent publishes them.
func defaultLike() template {
	consume := func(set string) []resourceapi.DeviceCounterConsumption {
		return []resourceapi.DeviceCounterConsumption{{CounterSet: set, Counters: map[string]resourceapi.Counter{}}}
	}
	gpu := func(name string, clique int64) resourceapi.Device {
		return resourceapi.Device{Name: name, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"type": str("gpu"), "nvlinkClique": num(clique)}, ConsumesCounters: consume(name + "-counters")}
	}
	pool := resourceapi.ResourcePool{Name: "template", Generation: 3, ResourceSliceCount: 2}
	return template{Model: "default", Slices: []resourceapi.ResourceSlice{
		{ObjectMeta: metav1.ObjectMeta{Name: "template-gpu.nvidia.com-abcde"}, Spec: resourceapi.ResourceSliceSpec{
			Driver: driverName, Pool: pool, NodeName: ptr.To("template"),
			SharedCounters: []resourceapi.CounterSet{{Name: "gpu-0-counters"}, {Name: "gpu-1-counters"}},
		}},
		{ObjectMeta: metav1.ObjectMeta{Name: "template-gpu.nvidia.com-fghij"}, Spec: resourceapi.ResourceSliceSpec{
			Driver: driverName, Pool: pool, NodeName: ptr.To("template"),
			Devices: []resourceapi.Device{
				gpu("gpu-0", 0), gpu("gpu-1", 0),
				{Name: "gpu-0-mig-1g-10gb-0", Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
					"gpu.nvidia.com/type": str("mig"), "profile": str("1g.10gb")}, ConsumesCounters: consume("gpu-0-counters")},
			},
		}},
	}}
}

func TestWholeGPUsOnly(t *testing.T) {
	def := defaultLike()
	base, err := wholeGPUsOnly(def)
	if err != nil {
		t.Fatal(err)
	}
	if len(base.Slices) != 1 {
		t.Fatalf("%d slices, want 1", len(base.Slices))
	}
	s := base.Slices[0].Spec
	if len(s.Devices) != 2 || s.SharedCounters != nil || s.Pool.ResourceSliceCount != 1 {
		t.Fatalf("got %d devices, counters %v, pool %+v; want the 2 GPUs alone in a pool of one slice", len(s.Devices), s.SharedCounters, s.Pool)
	}
	for _, d := range s.Devices {
		if d.ConsumesCounters != nil {
			t.Fatalf("device %s still consumes counters", d.Name)
		}
	}
	if def.Slices[1].Spec.Devices[0].ConsumesCounters == nil {
		t.Fatal("the default model's template was changed")
	}
	if st := base.stats(); st.Devices != 2 || st.CounterSets != 0 {
		t.Fatalf("stats %+v", st)
	}
}

func TestClaimsFit(t *testing.T) {
	def := defaultLike()
	base, err := wholeGPUsOnly(def)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range claimSpecs("1g.10gb") {
		fitsDef, _ := c.Fits(def)
		fitsBase, why := c.Fits(base)
		if !fitsDef {
			t.Errorf("%s does not fit the default-like template", c.Name)
		}
		if c.Name == "mig-1g" {
			if fitsBase {
				t.Errorf("mig-1g fits whole GPUs only")
			}
		} else if !fitsBase {
			t.Errorf("%s does not fit whole GPUs only: %s", c.Name, why)
		}
	}
}

func TestCloneSlices(t *testing.T) {
	node := &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "fleet-node-7", UID: "uid-7"}}
	got := cloneSlices(defaultLike(), node)
	if len(got) != 2 {
		t.Fatalf("%d slices, want 2", len(got))
	}
	for i, s := range got {
		if want := "fleet-node-7-gpu.nvidia.com-" + string(rune('0'+i)); s.Name != want {
			t.Errorf("name %s, want %s", s.Name, want)
		}
		if *s.Spec.NodeName != node.Name || s.Spec.Pool.Name != node.Name || s.Spec.Pool.Generation != 3 {
			t.Errorf("%s: node %s, pool %+v", s.Name, *s.Spec.NodeName, s.Spec.Pool)
		}
		if len(s.OwnerReferences) != 1 || s.OwnerReferences[0].UID != node.UID || s.OwnerReferences[0].Name != node.Name {
			t.Errorf("%s: owners %+v", s.Name, s.OwnerReferences)
		}
	}
}

func TestParseHeapAlloc(t *testing.T) {
	profile := []byte("heap profile: 12: 34 [56: 78] @ heap/524288\n1: 2 [3: 4] @ 0x1\n\n# runtime.MemStats\n# Alloc = 111\n# TotalAlloc = 222\n# HeapAlloc = 96468992\n# HeapSys = 130000000\n")
	got, err := parseHeapAlloc(profile)
	if err != nil || got != 96468992 {
		t.Fatalf("got %d, %v; want 96468992", got, err)
	}
	for _, bad := range []string{"", "heap profile: 1: 2 [3: 4] @ heap/1\n", "# HeapAlloc = many\n"} {
		if _, err := parseHeapAlloc([]byte(bad)); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}

func TestSteadyRate(t *testing.T) {
	t0 := time.Now()
	ts := []time.Time{t0, t0.Add(time.Second), t0.Add(2 * time.Second), t0.Add(4 * time.Second)}
	// Too few bindings after the creations: first to last.
	if got := steadyRate(ts, t0.Add(time.Second)); got != 0.75 {
		t.Fatalf("got %v, want 3 pods over 4 s", got)
	}
	if got := steadyRate(ts[:1], t0); got != 0 {
		t.Fatalf("one binding: got %v, want 0", got)
	}
	// 2 bound while 100 pods were being created (in 1 s), then 20 over 2 s: 10 pods/s, not 21/2.5 s.
	ts = []time.Time{t0.Add(500 * time.Millisecond), t0.Add(time.Second)}
	for i := range 20 {
		ts = append(ts, t0.Add(time.Second+time.Duration(i+1)*100*time.Millisecond))
	}
	if got := steadyRate(ts, t0.Add(time.Second)); got != 10 {
		t.Fatalf("got %v, want 20 pods over the 2 s after the creations", got)
	}
}

func TestTableRatio(t *testing.T) {
	rs := []result{
		{Model: baselineModel, Nodes: 100, Claim: "1gpu", Asked: 10, Bound: 10, Rate: 50, API: memory{HWM: 1 << 30}, APIPeakReset: true},
		{Model: "default", Nodes: 100, Claim: "1gpu", Asked: 10, Bound: 4, Rate: 0.5, TimedOut: true, Why: "6 pods unbound",
			Stats: stats{CounterSets: 8, Counters: 104, MaxCounters: 13}, APIPeakReset: true},
		{Model: "default", Nodes: 100, Claim: "mig-1g", Skip: "no MIG device of profile 1g.10gb"},
		// A MIG claim is held against whole GPUs' 1gpu row: whole GPUs have no MIG device.
		{Model: "mig-on-demand", Nodes: 100, Claim: "mig-1g", Asked: 10, Bound: 10, Rate: 30, RateMin: 20, RateMax: 31, Rounds: 3,
			Sched: memory{HWM: 200 << 20}, SchedHeap: 90 << 20},
		{Model: "mig-on-demand", Nodes: 500, Claim: "mig-1g", Asked: 10, Bound: 10, Rate: 30, RateMin: 30, RateMax: 30, Rounds: 3},
		// At 200 nodes the baseline was read before the models and after: each ratio is to the mean of both.
		{Model: baselineModel, Nodes: 200, Claim: "1gpu", Asked: 10, Bound: 10, Rate: 50},
		{Model: "time-sliced", Nodes: 200, Claim: "1gpu", Asked: 10, Bound: 10, Rate: 20},
		{Model: baselineAgain, Nodes: 200, Claim: "1gpu", Asked: 10, Bound: 10, Rate: 30},
	}
	out := table(rs, nil, []string{"- model x: not measured."})
	for _, want := range []string{
		"| default | 100 | 1gpu | 4/10 (limit) | 0.50 | 0.010 |", "8 × 13 |", "6 pods unbound", "not measured: no MIG device",
		"\n\n- model x: not measured.",
		"| mig-on-demand | 100 | mig-1g | 10/10 | 30.00 (20.0–31.0) | 0.600 (1gpu) | 0.0 | 0.000 | 200 | 90 |",
		"| mig-on-demand | 500 | mig-1g | 10/10 | 30.00 | – |", // no baseline at 500 nodes; one rate: no range
		"| whole-gpus-only | 200 | 1gpu | 10/10 | 50.00 | 1.250 |",
		"| time-sliced | 200 | 1gpu | 10/10 | 20.00 | 0.500 |",
		"| whole-gpus-only-again | 200 | 1gpu | 10/10 | 30.00 | 0.750 |",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
}

// A row's figures are its median round's, unless its last round reached the limit: then that round's.
func TestSummarizeRounds(t *testing.T) {
	rounds := []round{
		{Bound: 100, Rate: 90, Wall: 2 * time.Second, CPU: 3 * time.Second},
		{Bound: 100, Rate: 50, Wall: 4 * time.Second, CPU: 5 * time.Second},
		{Bound: 100, Rate: 70, Wall: 3 * time.Second, CPU: 4 * time.Second},
	}
	var r result
	r.summarize(rounds)
	if r.Rate != 70 || r.RateMin != 50 || r.RateMax != 90 || r.Wall != 3*time.Second || r.SchedCPU != 4*time.Second || r.Rounds != 3 || r.TimedOut {
		t.Errorf("three rounds: got %+v, want the 70 pods/s round's figures, 50–90", r)
	}
	r = result{}
	r.summarize(rounds[:2])
	if r.Rate != 50 {
		t.Errorf("two rounds: rate %v, want the lower middle one, 50", r.Rate)
	}
	r = result{}
	r.summarize(append(rounds[:1:1], round{Bound: 7, Rate: 0.2, Wall: time.Minute, TimedOut: true, Why: "93 pods unbound"}))
	if !r.TimedOut || r.Bound != 7 || r.Rate != 0.2 || r.RateMax != 0.2 || r.Why != "93 pods unbound" {
		t.Errorf("last round at the limit: got %+v, want its figures", r)
	}
	r = result{}
	r.summarize(nil)
	if r.Rounds != 0 || r.Rate != 0 {
		t.Errorf("no round: got %+v", r)
	}
}

// The examples the models name are ConfigMap manifests with a config.yaml key.
func TestConfigFromExamples(t *testing.T) {
	for _, m := range exampleModels {
		if m.Manifest == "" {
			continue
		}
		path := filepath.Join(repoDir(), m.Manifest)
		if _, err := os.Stat(path); err != nil {
			t.Logf("%s: %v (the model is skipped at run time)", m.Name, err)
			continue
		}
		cfg, err := configFromManifest(path, t.TempDir())
		if err != nil {
			t.Fatalf("%s: %v", m.Name, err)
		}
		b, err := os.ReadFile(cfg)
		if err != nil || !strings.Contains(string(b), "version: v1") {
			t.Fatalf("%s: config %q, %v", m.Name, b, err)
		}
	}
}

// A mixed fleet gives the model's slices to its first nodes only, and its rows say so.
func TestMixedFleet(t *testing.T) {
	mig := template{Model: "mig-on-demand"}
	def := template{Model: "default"}
	f := &fleetRun{tmpl: mig, others: def, mixed: 10, nodes: 100}
	for i, want := range map[int]string{0: "mig-on-demand", 9: "mig-on-demand", 10: "default", 99: "default"} {
		if got := f.tmplOf(i).Model; got != want {
			t.Errorf("node %d gets %s, want %s", i, got, want)
		}
	}
	if got, want := f.model(), "mig-on-demand on 10% (rest default)"; got != want {
		t.Errorf("model() = %q, want %q", got, want)
	}
	whole := &fleetRun{tmpl: mig, nodes: 100}
	if got := whole.tmplOf(99).Model; got != "mig-on-demand" {
		t.Errorf("unmixed fleet: node 99 gets %s", got)
	}
	for _, bad := range []string{"-1", "1", "1.5"} {
		if _, err := parseFlags([]string{"-mix", bad, "-nodes", "10"}); err == nil || !strings.Contains(err.Error(), "-mix") {
			t.Errorf("-mix %s: error %v, want one naming -mix", bad, err)
		}
	}
}

func TestNVIDIAShape(t *testing.T) {
	gib := func(n int64) resourceapi.DeviceCapacity {
		return resourceapi.DeviceCapacity{Value: *resource.NewQuantity(n<<30, resource.BinarySI)}
	}
	mig := func(name, parent, profile string, mem int64) resourceapi.Device {
		return resourceapi.Device{Name: name,
			Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
				"type": str("mig"), "profile": str(profile), "parentUUID": str(parent), "index": num(0)},
			Capacity: map[resourceapi.QualifiedName]resourceapi.DeviceCapacity{"memory": gib(mem), "multiprocessors": gib(0)}}
	}
	static := template{Model: "static-mig", Slices: []resourceapi.ResourceSlice{{Spec: resourceapi.ResourceSliceSpec{
		Driver: driverName, Devices: []resourceapi.Device{
			mig("gpu-0-mig-1-0", "GPU-0", "2g.20gb", 20), mig("gpu-0-mig-2-0", "GPU-0", "1g.10gb", 10),
			mig("gpu-0-mig-3-0", "GPU-0", "3g.40gb", 40), mig("gpu-1-mig-1-0", "GPU-1", "1g.10gb", 10),
		}}}}}
	got, err := nvidiaShape(static)
	if err != nil {
		t.Fatal(err)
	}
	// memorySlice capacities each device gets: its memory over the smallest (10 GiB), end to end per GPU.
	want := map[string][]string{
		"gpu-0-mig-1-0": {"memorySlice0", "memorySlice1"},
		"gpu-0-mig-2-0": {"memorySlice2"},
		"gpu-0-mig-3-0": {"memorySlice3", "memorySlice4", "memorySlice5", "memorySlice6"},
		"gpu-1-mig-1-0": {"memorySlice0"},
	}
	for _, d := range got.devices() {
		if _, ok := d.Attributes["index"]; ok {
			t.Errorf("%s keeps index", d.Name)
		}
		var slicesOf []string
		for name := range d.Capacity {
			if strings.HasPrefix(string(name), "memorySlice") {
				slicesOf = append(slicesOf, string(name))
			}
		}
		slices.Sort(slicesOf)
		if !slices.Equal(slicesOf, want[d.Name]) {
			t.Errorf("%s: memory slices %v, want %v", d.Name, slicesOf, want[d.Name])
		}
		if len(d.Capacity) != 2+len(want[d.Name]) {
			t.Errorf("%s: %d capacities, want its 2 and %d memory slices", d.Name, len(d.Capacity), len(want[d.Name]))
		}
	}
	if d := static.devices()[0]; len(d.Capacity) != 2 || d.Attributes["index"].IntValue == nil {
		t.Fatal("the static-mig template was changed")
	}
	if _, err := nvidiaShape(template{Model: "static-mig"}); err == nil {
		t.Error("a template without MIG devices was shaped")
	}
}
