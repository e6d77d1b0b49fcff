package telemetry

import (
	"fmt"
	"math"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/podresources"
	"github.com/gpu-agent/gpu-agent/usage"
)

type fixedPods struct{ x *usage.PodIndex }

func (f fixedPods) PodIndex() *usage.PodIndex { return f.x }

// settableAttribution is an AttributionSource a test changes between passes.
type settableAttribution struct{ a *podresources.Attribution }

func (s *settableAttribution) Attribution() *podresources.Attribution { return s.a }

// workload is a pod with one container, and the cgroup its processes run in.
type workload struct {
	ns, name, container string
	uid, ctrID          string
}

func newWorkload(i int, ns, name string) workload {
	return workload{ns: ns, name: name, container: "main",
		uid: fmt.Sprintf("%08x-0000-4000-8000-%012x", i, i), ctrID: fmt.Sprintf("%064x", i+1)}
}

func (w workload) cgroup() string {
	return "0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod" + strings.ReplaceAll(w.uid, "-", "_") +
		".slice/cri-containerd-" + w.ctrID + ".scope\n"
}

func (w workload) pod() *corev1.Pod {
	return &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: w.ns, Name: w.name, UID: types.UID(w.uid)},
		Status: corev1.PodStatus{ContainerStatuses: []corev1.ContainerStatus{{Name: w.container, ContainerID: "containerd://" + w.ctrID}}}}
}

// holderRig is a simulated node with a HolderTracker and a Collector over it.
type holderRig struct {
	t    *testing.T
	clk  *simtest.Clock
	n    *sim.Node
	inv  *gpu.Inventory
	attr *settableAttribution
	pods []*corev1.Pod
	tr   *HolderTracker
	s    *Sampler
	col  *Collector
	exp  *Exposition
}

func newHolderRig(t *testing.T, profile string, opts HolderOptions) *holderRig {
	clk := simtest.NewClock()
	n := simtest.Node(t, profile, sim.WithClock(clk.Now))
	r := &holderRig{t: t, clk: clk, n: n, inv: simtest.Inventory(t, n), attr: &settableAttribution{}}
	opts.Owners = usage.SimResolver{Src: n}
	opts.Pods = r
	opts.Attribution = r.attr
	opts.Now = clk.Now
	r.tr = NewHolderTracker(n, opts)
	r.tr.SetInventory(r.inv)
	r.s = newSampler(n, clk)
	r.s.SetInventory(r.inv)
	r.col = NewCollector(CollectorOptions{Samples: r.s, Attribution: r.attr, Holders: r.tr, DRA: opts.DRA})
	return r
}

// scrape samples the devices and scrapes the collector as the agent's
// /metrics serves it, through an Exposition.
func (r *holderRig) scrape() string {
	r.t.Helper()
	r.s.Sample()
	if r.exp == nil {
		r.exp = NewExposition(r.col)
	}
	rec := serve(r.t, MetricsHandler(prometheus.NewRegistry(), r.exp), "/metrics", nil)
	if rec.Code != http.StatusOK {
		r.t.Fatalf("scrape: %d %s", rec.Code, rec.Body)
	}
	return rec.Body.String()
}

func (r *holderRig) PodIndex() *usage.PodIndex { return usage.NewPodIndex(r.pods) }

func simClock(c *simtest.Clock) sim.Option { return sim.WithClock(c.Now) }

func simResolver(n *sim.Node) usage.SimResolver { return usage.SimResolver{Src: n} }

func simProcess(pid, sm uint32, w workload) sim.Process {
	return sim.Process{PID: pid, GI: sim.NoInstance, CI: sim.NoInstance, SM: sm, MemoryBytes: 1 << 30, Cgroup: w.cgroup()}
}

// start runs a process of w on GPU gpu (whole) with the given SM load.
func (r *holderRig) start(gpu int, pid uint32, w workload, sm uint32, mem uint64) {
	r.t.Helper()
	must(r.t, r.n.StartProcess(gpu, sim.Process{PID: pid, GI: sim.NoInstance, CI: sim.NoInstance, SM: sm, MemoryBytes: mem, Cgroup: w.cgroup()}))
}

// passes moves the clock by step n times, a pass after each.
func (r *holderRig) passes(n int, step time.Duration) {
	for range n {
		r.clk.Add(step)
		r.tr.Pass()
	}
}

// use returns the holder use of pod on device, failing without one.
func (r *holderRig) use(device, pod string) HolderUse {
	r.t.Helper()
	for _, u := range r.tr.Holders().Holders {
		if u.Device == device && u.Pod == pod {
			return u
		}
	}
	r.t.Fatalf("no holder %s on %s in %+v", pod, device, r.tr.Holders().Holders)
	return HolderUse{}
}

// holderSeries returns the scraped lines of metric whose labels contain every
// part, with their values.
func holderSeries(text, metric string, parts ...string) []string {
	var out []string
	for line := range strings.Lines(text) {
		if !strings.HasPrefix(line, metric+"{") {
			continue
		}
		ok := true
		for _, p := range parts {
			ok = ok && strings.Contains(line, p)
		}
		if ok {
			out = append(out, strings.TrimSpace(line[strings.LastIndexByte(line, '}')+1:]))
		}
	}
	return out
}

// TestHolderTimeSliced: four pods share GPU 0 through replicas. Each gets
// its own SM, memory and process count, DCGM's GPU_UTIL and FB_USED split
// as dcgm-exporter splits them, idle time that grows for the pods that do
// nothing, averages over the windows; a pod that ends loses its series at
// the next pass.
func TestHolderTimeSliced(t *testing.T) {
	r := newHolderRig(t, "dgx-h100", HolderOptions{})
	g0 := r.inv.GPUs[0].UUID
	busy, light, idle, none := newWorkload(1, "ml", "busy"), newWorkload(2, "ml", "light"), newWorkload(3, "ml", "idle"), newWorkload(4, "ml", "none")
	var pods []*podresourcesv1.PodResources
	for i, w := range []workload{busy, light, idle, none} {
		r.pods = append(r.pods, w.pod())
		pods = append(pods, pod(w.ns, w.name, w.container, "nvidia.com/gpu.shared", fmt.Sprintf("%s::%d", g0, i)))
	}
	r.attr.a = podresources.NewAttribution(pods, nil)
	r.start(0, 1001, busy, 40, 4<<30)
	r.start(0, 1002, busy, 20, 1<<30) // a second process of the same container
	r.start(0, 1003, light, 10, 2<<30)
	r.start(0, 1004, idle, 0, 3<<30)

	r.passes(1, 10*time.Second)
	for _, tc := range []struct {
		pod   string
		sm    float64
		procs int
		fb    uint64
	}{{"busy", 60, 2, 5 << 30}, {"light", 10, 1, 2 << 30}, {"idle", 0, 1, 3 << 30}, {"none", 0, 0, 0}} {
		u := r.use(g0, tc.pod)
		if !u.UtilKnown || !u.PerProcess || !u.Attributed || u.SM != tc.sm || u.Processes != tc.procs || u.FBBytes != tc.fb || u.Sharers != 4 {
			t.Errorf("%s: %+v, want SM %v, %d processes, %d bytes, 4 sharers", tc.pod, u, tc.sm, tc.procs, tc.fb)
		}
	}

	// Ten minutes on: the busy pods were active a second ago at most, the
	// others have not been since they were first seen.
	r.passes(60, 10*time.Second)
	if u := r.use(g0, "busy"); u.IdleSeconds > 1 || u.SMAvg["1h"] != 60 || u.SMAvg["24h"] != 60 {
		t.Errorf("busy after 10 min: idle %v s, averages %v", u.IdleSeconds, u.SMAvg)
	}
	for _, p := range []string{"idle", "none"} {
		if u := r.use(g0, p); u.IdleSeconds != 600 || u.SMAvg["1h"] != 0 || !u.LastActive.IsZero() {
			t.Errorf("%s after 10 min: idle %v s (want 600), averages %v, last active %v", p, u.IdleSeconds, u.SMAvg, u.LastActive)
		}
	}

	text := r.scrape()
	for _, tc := range []struct {
		metric, pod, want string
	}{
		{"gpu_agent_holder_sm_util_percent", "busy", "60"},
		{"gpu_agent_holder_fb_used_bytes", "light", "2.147483648e+09"},
		{"gpu_agent_holder_processes", "busy", "2"},
		{"gpu_agent_holder_idle_seconds", "idle", "600"},
		{"gpu_agent_holder_sm_util_avg_percent", "busy", "60"},
		{"DCGM_FI_DEV_GPU_UTIL", "light", "10"},
		{"DCGM_FI_DEV_FB_USED", "busy", "5120"},
		{"DCGM_FI_DEV_FB_USED", "none", "0"},
	} {
		got := holderSeries(text, tc.metric, `pod="`+tc.pod+`"`)
		if len(got) == 0 || got[0] != tc.want {
			t.Errorf("%s{pod=%q}: %v, want %s", tc.metric, tc.pod, got, tc.want)
		}
	}
	if got := holderSeries(text, "gpu_agent_holder_sm_util_avg_percent", `pod="busy"`); len(got) != 2 {
		t.Errorf("busy has %d average series, want 2 (1h, 24h)", len(got))
	}
	if strings.Contains(text, `pid=`) {
		t.Error("a series carries a PID label")
	}

	// The light pod stops working: its idle time grows from its last sample.
	r.start(0, 1003, light, 0, 2<<30)
	r.passes(30, 10*time.Second)
	if u := r.use(g0, "light"); u.IdleSeconds < 299 || u.IdleSeconds > 301 {
		t.Errorf("light idle %v s after 5 min without work, want 300", u.IdleSeconds)
	}

	// The idle pod ends: its series go at the next pass, and so does its record.
	r.attr.a = podresources.NewAttribution(pods[:2], nil)
	must(t, r.n.StopProcess(0, 1004))
	r.passes(1, 10*time.Second)
	text = r.scrape()
	if got := holderSeries(text, "gpu_agent_holder_idle_seconds", `pod="idle"`); len(got) != 0 {
		t.Errorf("ended pod still has idle series %v", got)
	}
	if got := holderSeries(text, "gpu_agent_holder_idle_seconds", `pod="busy"`); len(got) != 1 {
		t.Errorf("busy pod: %v", got)
	}
	if len(r.tr.state) != 2 {
		t.Errorf("%d records kept, want 2", len(r.tr.state))
	}
}

// TestHolderMPSAndMIG: MPS clients are told apart by their cgroups; on a
// MIG device NVML has memory only, so a holder has no utilization series
// and no idle time (unknown is not idle), but its memory and processes.
func TestHolderMPSAndMIG(t *testing.T) {
	t.Run("MPS", func(t *testing.T) {
		r := newHolderRig(t, "dgx-h100", HolderOptions{})
		g := r.inv.GPUs[1].UUID
		a, b := newWorkload(1, "ml", "a"), newWorkload(2, "ml", "b")
		r.pods = []*corev1.Pod{a.pod(), b.pod()}
		r.attr.a = podresources.NewAttribution([]*podresourcesv1.PodResources{
			pod("ml", "a", "main", "nvidia.com/gpu.shared", g+"::0"), pod("ml", "b", "main", "nvidia.com/gpu.shared", g+"::1")}, nil)
		must(t, r.n.StartProcess(1, sim.Process{PID: 20, GI: sim.NoInstance, CI: sim.NoInstance, MPS: true, SM: 30, MemoryBytes: 1 << 30, Cgroup: a.cgroup()}))
		must(t, r.n.StartProcess(1, sim.Process{PID: 21, GI: sim.NoInstance, CI: sim.NoInstance, MPS: true, SM: 5, MemoryBytes: 1 << 30, Cgroup: b.cgroup()}))
		r.passes(2, 10*time.Second)
		if u := r.use(g, "a"); !u.MPS || u.SM != 30 {
			t.Errorf("a: %+v", u)
		}
		if u := r.use(g, "b"); !u.MPS || u.SM != 5 {
			t.Errorf("b: %+v", u)
		}
	})
	t.Run("MIG", func(t *testing.T) {
		r := newHolderRig(t, "dgx-h100-mig", HolderOptions{})
		g := r.inv.GPUs[0]
		in := g.Instances[0]
		w := newWorkload(1, "ml", "m")
		r.pods = []*corev1.Pod{w.pod()}
		r.attr.a = podresources.NewAttribution([]*podresourcesv1.PodResources{pod("ml", "m", "main", "nvidia.com/mig-1g.10gb", in.UUID)}, nil)
		must(t, r.n.StartProcess(0, sim.Process{PID: 30, GI: uint32(in.GI), CI: uint32(in.CI), SM: 50, MemoryBytes: 2 << 30, Cgroup: w.cgroup()}))
		r.passes(2, 10*time.Second)
		u := r.use(in.UUID, "m")
		if u.UtilKnown || u.Processes != 1 || u.FBBytes != 2<<30 || u.MIGProfile != in.Profile || u.GI != in.GI {
			t.Errorf("MIG holder: %+v", u)
		}
		text := r.scrape()
		if got := holderSeries(text, "gpu_agent_holder_fb_used_bytes", `pod="m"`, `GPU_I_PROFILE="`+in.Profile+`"`); len(got) != 1 {
			t.Errorf("MIG holder memory series: %v", got)
		}
		if got := holderSeries(text, "gpu_agent_holder_idle_seconds", `pod="m"`); len(got) != 0 {
			t.Errorf("MIG holder has idle series %v, though NVML has no utilization there", got)
		}
	})
}

// TestHolderDRAClaim: two claims share GPU 2; each claim's series carries
// its own process's figures and its dra_* labels.
func TestHolderDRAClaim(t *testing.T) {
	clkless := fixedDRA{}
	r := newHolderRig(t, "dgx-h100", HolderOptions{DRA: clkless})
	g := r.inv.GPUs[2].UUID
	clkless["ml/share-a/gpu-2"] = DRADevice{UUID: g}
	clkless["ml/share-b/gpu-2"] = DRADevice{UUID: g}
	a, b := newWorkload(1, "ml", "pa"), newWorkload(2, "ml", "pb")
	r.pods = []*corev1.Pod{a.pod(), b.pod()}
	r.attr.a = podresources.NewAttribution([]*podresourcesv1.PodResources{
		draPod("ml", "pa", "main", "share-a", "gpu-2"), draPod("ml", "pb", "main", "share-b", "gpu-2")}, nil)
	r.start(2, 40, a, 70, 1<<30)
	r.passes(2, 10*time.Second)
	if u := r.use(g, "pa"); u.Claim == nil || u.Claim.Name != "share-a" || u.SM != 70 {
		t.Errorf("pa: %+v", u)
	}
	text := r.scrape()
	if got := holderSeries(text, "gpu_agent_holder_sm_util_percent", `dra_claim_name="share-b"`); len(got) != 1 || got[0] != "0" {
		t.Errorf("claim share-b SM: %v, want 0", got)
	}
	if got := holderSeries(text, "gpu_agent_holder_idle_seconds", `dra_claim_name="share-b"`, `pod="pb"`); len(got) != 1 || got[0] != "10" {
		t.Errorf("claim share-b idle: %v, want 10 (seen first a pass ago)", got)
	}
}

// TestHolderStateAcrossRestart: idle times and averages survive a new
// tracker on the same state file, which keeps every record until the
// kubelet's first answer says who still holds what.
func TestHolderStateAcrossRestart(t *testing.T) {
	path := filepath.Join(t.TempDir(), HolderStateFile)
	r := newHolderRig(t, "dgx-h100", HolderOptions{StatePath: path})
	g := r.inv.GPUs[0].UUID
	busy, idle := newWorkload(1, "ml", "busy"), newWorkload(2, "ml", "idle")
	r.pods = []*corev1.Pod{busy.pod(), idle.pod()}
	attr := podresources.NewAttribution([]*podresourcesv1.PodResources{
		pod("ml", "busy", "main", "nvidia.com/gpu.shared", g+"::0"), pod("ml", "idle", "main", "nvidia.com/gpu.shared", g+"::1")}, nil)
	r.attr.a = attr
	r.start(0, 50, busy, 80, 1<<30)
	r.passes(31, 10*time.Second) // 5 min
	must(t, r.n.StopProcess(0, 50))
	r.tr.passMu.Lock()
	r.tr.save(r.clk.Now())
	r.tr.passMu.Unlock()
	if err := r.tr.SaveError(); err != nil {
		t.Fatal(err)
	}

	// The agent is down for an hour.
	r.clk.Add(time.Hour)
	attrSrc := &settableAttribution{}
	again := NewHolderTracker(r.n, HolderOptions{StatePath: path, Owners: usage.SimResolver{Src: r.n}, Pods: r, Attribution: attrSrc, Now: r.clk.Now})
	again.SetInventory(r.inv)
	again.Pass()
	if len(again.state) != 2 {
		t.Fatalf("%d records before the kubelet answered, want both kept", len(again.state))
	}
	attrSrc.a = attr
	r.clk.Add(10 * time.Second)
	again.Pass()
	got := map[string]HolderUse{}
	for _, u := range again.Holders().Holders {
		got[u.Pod] = u
	}
	// Busy was active until 5 min in, at 80% for 300 s, then held the
	// GPU 10 s idle after the restart (the hour down is nobody's); idle
	// never was active, since the first pass.
	if u := got["busy"]; u.IdleSeconds < 3609 || u.IdleSeconds > 3611 || math.Abs(u.SMAvg["24h"]-80*300.0/310) > 1e-9 {
		t.Errorf("busy after restart: idle %v s, want 3610; averages %v, want %v over 24h", u.IdleSeconds, u.SMAvg, 80*300.0/310)
	}
	if u := got["idle"]; u.IdleSeconds != 3600+310 || u.SMAvg["24h"] != 0 {
		t.Errorf("idle after restart: %v s, want %d; averages %v", u.IdleSeconds, 3600+310, u.SMAvg)
	}
}

// TestHolderStateForwardCompatible: a later version's file is read for the
// fields this one knows; an earlier or broken one starts afresh.
func TestHolderStateForwardCompatible(t *testing.T) {
	later := `{"version": 7, "future": {"x": 1}, "holders": [{"device": "GPU-1", "namespace": "ml", "pod": "p", "container": "c",
		"firstSeen": "2026-01-02T03:04:05Z", "lastActive": "2026-01-02T04:00:00Z", "newField": [1, 2],
		"buckets": [[1767322800, 300, 6000], [1767322500, 10, 10], [1767323100, -1, 0], [1767323400, 300, 999999]]}]}`
	st, err := decodeHolderState([]byte(later))
	if err != nil {
		t.Fatal(err)
	}
	k := holderKey{"GPU-1", seriesHolder{Holder: podresources.Holder{Namespace: "ml", Pod: "p", Container: "c"}}}
	h := st[k]
	if h == nil || h.lastActive.Hour() != 4 || len(h.win) != 1 || h.win[0].smTotal != 6000 {
		t.Fatalf("decoded %+v; want the one sound bucket and the times", h)
	}
	for _, bad := range []string{`{"holders": []}`, `{"version": 0}`, `[1]`, `{"version": 1, "holders": {}}`} {
		if _, err := decodeHolderState([]byte(bad)); err == nil {
			t.Errorf("%s: no error", bad)
		}
	}
	path := filepath.Join(t.TempDir(), HolderStateFile)
	must(t, os.WriteFile(path, []byte("{torn"), 0o644))
	if tr := NewHolderTracker(simtest.Node(t, "pcie-8gpu"), HolderOptions{StatePath: path}); len(tr.state) != 0 {
		t.Errorf("torn file restored %d records", len(tr.state))
	}
}

func FuzzDecodeHolderState(f *testing.F) {
	f.Add([]byte(`{"version":1,"holders":[{"device":"GPU-1","namespace":"a","pod":"b","container":"c","claimName":"x","firstSeen":"2026-01-02T03:04:05Z","buckets":[[1,2,3]]}]}`))
	f.Add([]byte(`{"version":2,"holders":[{"device":"","buckets":[[1e308,1e308,-1]]}]}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		st, err := decodeHolderState(data)
		if err != nil {
			return
		}
		for k, h := range st {
			if k.device == "" {
				t.Fatal("record without a device")
			}
			for i, b := range h.win {
				if b.held < 0 || b.smTotal < 0 || b.smTotal > 100*b.held || (i > 0 && b.at <= h.win[i-1].at) {
					t.Fatalf("unsound bucket kept: %+v", h.win)
				}
			}
		}
		// What was read writes back and reads the same.
		data, err = encodeHolderState(st)
		if err != nil {
			t.Fatal(err)
		}
		again, err := decodeHolderState(data)
		if err != nil || len(again) != len(st) {
			t.Fatalf("round trip: %d records, %v; want %d", len(again), err, len(st))
		}
	})
}

// TestHolderIdleNotice: OnIdle is called once a holder has been idle for
// IdleAfter, once per idle spell, and again after it worked and idled anew.
func TestHolderIdleNotice(t *testing.T) {
	var got []HolderUse
	after := 5 * time.Minute
	r := newHolderRig(t, "dgx-h100", HolderOptions{IdleAfter: func() time.Duration { return after }, OnIdle: func(u HolderUse) { got = append(got, u) }})
	g := r.inv.GPUs[0].UUID
	w := newWorkload(1, "ml", "p")
	r.pods = []*corev1.Pod{w.pod()}
	r.attr.a = podresources.NewAttribution([]*podresourcesv1.PodResources{pod("ml", "p", "main", "nvidia.com/gpu", g)}, nil)
	r.start(0, 60, w, 0, 1<<30)
	r.passes(30, 10*time.Second) // idle since the first pass: 290 s
	if len(got) != 0 {
		t.Fatalf("notice after 290 s idle: %+v", got)
	}
	r.passes(1, 10*time.Second)
	if len(got) != 1 || got[0].Pod != "p" || got[0].IdleSeconds != 300 || got[0].Device != g {
		t.Fatalf("after 5 min idle: %+v", got)
	}
	r.passes(60, 10*time.Second)
	if len(got) != 1 {
		t.Fatalf("%d notices in one idle spell", len(got))
	}
	r.start(0, 60, w, 50, 1<<30)
	r.passes(1, 10*time.Second)
	r.start(0, 60, w, 0, 1<<30)
	r.passes(31, 10*time.Second)
	if len(got) != 2 {
		t.Fatalf("%d notices after a second idle spell, want 2", len(got))
	}
	after = 0 // turned off by the config
	r.start(0, 60, w, 50, 1<<30)
	r.passes(1, 10*time.Second)
	r.start(0, 60, w, 0, 1<<30)
	r.passes(60, 10*time.Second)
	if len(got) != 2 {
		t.Fatalf("notice while off: %+v", got[2:])
	}
}

// mpsCatalog shares each of uuids by MPS as replicas replicas, with the
// active-thread percentage the catalog's replicas give their clients (0:
// time-sliced, no MPS environment).
func mpsCatalog(pct, replicas int, uuids ...string) *catalog.Catalog {
	res := &catalog.Resource{Name: "nvidia.com/gpu.shared"}
	for _, u := range uuids {
		for i := range replicas {
			d := catalog.Device{ID: fmt.Sprintf("%s::%d", u, i), Replica: true, Spec: catalog.AllocateSpec{VisibleID: u}}
			if pct > 0 {
				d.Spec.Env = map[string]string{"CUDA_MPS_PIPE_DIRECTORY": "/mps/" + u + "/pipe", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": strconv.Itoa(pct)}
			}
			res.Devices = append(res.Devices, d)
		}
	}
	return &catalog.Catalog{Resources: map[string]*catalog.Resource{res.Name: res}}
}

// TestHolderMPSLimit: an MPS client's active-thread limit comes from its
// replica (device plugin) or its claim (DRA), and its use of it is its SM %
// over the limit, not capped; no limit without MPS, no use without a known
// SM %. The series go with the holder.
func TestHolderMPSLimit(t *testing.T) {
	for _, tc := range []struct {
		name      string
		pct       int // the catalog's replicas' limit; 0: time-sliced
		claimPct  int // the claim's limit, through DRA; -1: no claim
		sm        uint32
		wantLimit int
		wantUsed  float64
	}{
		{name: "replica of 2", pct: 50, claimPct: -1, sm: 30, wantLimit: 50, wantUsed: 60},
		{name: "over its limit", pct: 25, claimPct: -1, sm: 60, wantLimit: 25, wantUsed: 240},
		{name: "idle", pct: 25, claimPct: -1, sm: 0, wantLimit: 25, wantUsed: 0},
		{name: "time-sliced", pct: 0, claimPct: -1, sm: 30},
		{name: "claim's share", pct: 50, claimPct: 20, sm: 10, wantLimit: 20, wantUsed: 50},
		{name: "claim without MPS", pct: 0, claimPct: 0, sm: 10},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dra := fixedDRA{}
			r := newHolderRig(t, "dgx-h100", HolderOptions{DRA: dra})
			g := r.inv.GPUs[1].UUID
			r.tr.opts.Catalog = fixedCatalog{mpsCatalog(tc.pct, 2, g)}
			a, b := newWorkload(1, "ml", "a"), newWorkload(2, "ml", "b")
			r.pods = []*corev1.Pod{a.pod(), b.pod()}
			holdA := pod("ml", "a", "main", "nvidia.com/gpu.shared", g+"::0")
			if tc.claimPct >= 0 {
				dra["ml/share-a/gpu-1"] = DRADevice{UUID: g, MPSActiveThreads: tc.claimPct}
				holdA = draPod("ml", "a", "main", "share-a", "gpu-1")
			}
			r.attr.a = podresources.NewAttribution([]*podresourcesv1.PodResources{holdA, pod("ml", "b", "main", "nvidia.com/gpu.shared", g+"::1")}, nil)
			must(t, r.n.StartProcess(1, sim.Process{PID: 20, GI: sim.NoInstance, CI: sim.NoInstance, MPS: tc.pct > 0, SM: tc.sm, MemoryBytes: 1 << 30, Cgroup: a.cgroup()}))
			must(t, r.n.StartProcess(1, sim.Process{PID: 21, GI: sim.NoInstance, CI: sim.NoInstance, MPS: tc.pct > 0, SM: 5, MemoryBytes: 1 << 30, Cgroup: b.cgroup()}))
			r.passes(2, 10*time.Second)
			u := r.use(g, "a")
			if u.MPSThreadLimit != tc.wantLimit || math.Abs(u.MPSLimitUsed-tc.wantUsed) > 1e-9 {
				t.Errorf("limit %d%%, used %v%%; want %d%%, %v%%", u.MPSThreadLimit, u.MPSLimitUsed, tc.wantLimit, tc.wantUsed)
			}
			text := r.scrape()
			limit := holderSeries(text, "gpu_agent_holder_mps_active_thread_limit_percent", `pod="a"`)
			used := holderSeries(text, "gpu_agent_holder_mps_limit_used_percent", `pod="a"`)
			if tc.wantLimit == 0 {
				if len(limit)+len(used) != 0 {
					t.Errorf("MPS series without MPS: %v %v", limit, used)
				}
				return
			}
			if want := []string{strconv.Itoa(tc.wantLimit)}; !slices.Equal(limit, want) {
				t.Errorf("limit series %v, want %v", limit, want)
			}
			if want := []string{strconv.FormatFloat(tc.wantUsed, 'g', -1, 64)}; !slices.Equal(used, want) {
				t.Errorf("used series %v, want %v", used, want)
			}

			// a ends: its series go at the next pass.
			r.attr.a = podresources.NewAttribution([]*podresourcesv1.PodResources{pod("ml", "b", "main", "nvidia.com/gpu.shared", g+"::1")}, nil)
			r.passes(1, 10*time.Second)
			text = r.scrape()
			for _, m := range []string{"gpu_agent_holder_mps_active_thread_limit_percent", "gpu_agent_holder_mps_limit_used_percent"} {
				if got := holderSeries(text, m, `pod="a"`); len(got) != 0 {
					t.Errorf("%s of an ended holder: %v", m, got)
				}
				if got := holderSeries(text, m, `pod="b"`); tc.pct > 0 && len(got) != 1 {
					t.Errorf("%s of b: %v", m, got)
				}
			}
		})
	}
}
