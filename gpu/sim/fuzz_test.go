package sim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// FuzzHTTPHandler sends any method, path and body to the /sim handler of a
// node with MIG instances. It must answer 200, 400, 404 or 405 with a JSON
// body ({"ok":true} or a non-empty "error"; GET /sim/state: the node's
// State, changing nothing), and a request it refuses must
// change nothing the requests can change: kept state, telemetry, injected
// failures, queued events.
func FuzzHTTPHandler(f *testing.F) {
	for _, c := range httpCases() {
		f.Add(c.method, c.path, []byte(c.body))
	}
	for _, body := range []string{
		`{"gpu":0,"call":"GetMigMode","count":-2}`,
		`{"gpu":0,"call":"GetMigMode","count":-1,"error":"ERROR_TIMEOUT"}`,
		`{"gpu":0,"call":"GpuInstanceDestroy","count":1,"error":"ERROR_IN_USE"}`,
		`{"gpu":0,"call":"GetMigMode","count":1,"error":"SUCCESS"}`,
	} {
		f.Add("POST", "/sim/fail", []byte(body))
	}
	f.Add("POST", "/sim/flaky", []byte(`{"rate":0.5,"seed":3}`))
	f.Add("POST", "/sim/reboot", []byte(``))
	f.Add("POST", "/sim/reboot", []byte(`{"gpu":0}`))
	f.Add("POST", "/sim/flaky", []byte(`{"rate":1.5}`))
	f.Add("POST", "/sim/utilization", []byte(`{"gpu":1,"gi":1,"gpu_util":40,"mem_util":101}`))
	f.Add("POST", "/sim/utilization", []byte(`{"gpu":1,"gi":2,"gpu_util":40}`))
	f.Add("POST", "/sim/xid", []byte(`{"gpu":7,"xid":48,"gi":4294967295}`))
	f.Add("POST", "/sim/lost", []byte(`{"gpu":2,"lost":false}`))
	f.Add("PUT", "/sim/reset", []byte(`{"gpu":0}`))
	f.Add("GET", "/sim/state", []byte(nil))
	f.Add("DELETE", "/state", []byte(`{}`))
	f.Add("POST", "/sim/reset", []byte(`{"gpu":0} `))
	f.Add("POST", "/sim/reset", []byte(`{"gpu":0} x`))
	f.Add("POST", "/sim/reset", []byte(`{"GPU":1}`))
	f.Add("POST", "/sim/reset", []byte(`{"gpu":1,"pad":"`+strings.Repeat("x", maxRequestBytes)+`"}`))

	// A node costs about a millisecond to build, far more than a request:
	// a worker keeps one while it takes only refused requests, which (as
	// asserted) leave it as built, and builds another after each accepted one.
	var n *Node
	var built string
	f.Fuzz(func(t *testing.T, method, path string, body []byte) {
		defer func() {
			if t.Failed() {
				n = nil // a failure may leave it changed: the next input gets a new one
			}
		}()
		if n == nil {
			n = httpFuzzNode(t)
			built = simState(n)
		}
		before := simState(n)
		if before != built {
			t.Fatalf("node reused in another state than built:\nbuilt %s\nnow   %s", built, before)
		}

		req := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
		req.Method, req.URL.Path = method, path // any bytes, not only what a URL parser passes
		rec := httptest.NewRecorder()
		n.Handler().ServeHTTP(rec, req)

		if strings.TrimPrefix(path, "/sim") == "/state" && method == http.MethodGet {
			// Read-only: the node's State, and nothing changed.
			want, err := n.State()
			if err != nil || rec.Code != http.StatusOK || rec.Body.String() != string(want) {
				t.Fatalf("GET %s: %d %q, want 200 and the node's State (%v)", path, rec.Code, rec.Body, err)
			}
			if after := simState(n); after != before {
				t.Fatalf("GET %s changed the node:\nbefore %s\nafter  %s", path, before, after)
			}
			return
		}
		var resp struct {
			OK    bool   `json:"ok"`
			Error string `json:"error"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil {
			t.Fatalf("status %d with a body that is not JSON: %q", rec.Code, rec.Body)
		}
		switch rec.Code {
		case http.StatusOK:
			if !resp.OK || resp.Error != "" {
				t.Fatalf("200 with %q", rec.Body)
			}
			n.Shutdown()
			n = nil
			return
		case http.StatusBadRequest, http.StatusNotFound, http.StatusMethodNotAllowed:
			if resp.OK || resp.Error == "" {
				t.Fatalf("%d without an error: %q", rec.Code, rec.Body)
			}
			// The caller wrote JSON: an error in Go's terms tells them nothing.
			if strings.Contains(resp.Error, "Go value") || strings.Contains(resp.Error, "Go struct") {
				t.Fatalf("error names Go types: %q", resp.Error)
			}
		default:
			t.Fatalf("status %d for %s %q %q: %s", rec.Code, method, path, body, rec.Body)
		}
		if after := simState(n); after != before {
			t.Fatalf("refused request (%d %s) changed the node:\nbefore %s\nafter  %s", rec.Code, resp.Error, before, after)
		}
	})
}

// httpFuzzNode is a dgx-a100 with MIG on and two GPU instances on GPU 1
// (3g.20gb and 1g.5gb, each with its compute instance), and an event set
// registered for every event of every GPU.
func httpFuzzNode(t *testing.T) *Node {
	clock := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	n, err := New("dgx-a100", WithMIGEnabled(), WithClock(func() time.Time { return clock }))
	if err != nil {
		t.Fatal(err)
	}
	if r := n.Init(); r != nvml.SUCCESS {
		t.Fatal(r)
	}
	d := handle(t, n, 1)
	createFullCI(t, createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4))
	createFullCI(t, createGI(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0))
	events, r := n.EventSetCreate()
	if r != nvml.SUCCESS {
		t.Fatal(r)
	}
	for i := range n.gpus {
		if r := handle(t, n, i).RegisterEvents(supportedEvents, events); r != nvml.SUCCESS {
			t.Fatalf("RegisterEvents on GPU %d: %v", i, r)
		}
	}
	return n
}

// simState renders everything a /sim request can change: the kept state as
// the state file would hold it, the telemetry the requests set, injected
// failures and the events queued on each event set.
func simState(n *Node) string {
	n.mu.Lock()
	defer n.mu.Unlock()
	kept, err := json.Marshal(n.record())
	if err != nil {
		panic(err)
	}
	var b strings.Builder
	b.Write(kept)
	for _, g := range n.gpus {
		fmt.Fprintf(&b, "\ngpu %d: util %d/%d, memory %d, codec %d/%d", g.index, g.gpuUtil, g.memUtil, g.memUsed, g.encUtil, g.decUtil)
		for _, gi := range g.gis {
			fmt.Fprintf(&b, ", gi %d %d/%d", gi.id, gi.util, gi.memUtil)
		}
	}
	keys := slices.SortedFunc(maps.Keys(n.failures), func(a, b failKey) int {
		if a.gpu != b.gpu {
			return a.gpu - b.gpu
		}
		return strings.Compare(a.call, b.call)
	})
	for _, k := range keys {
		fmt.Fprintf(&b, "\nfail gpu %d %s: %+v", k.gpu, k.call, n.failures[k])
	}
	fmt.Fprintf(&b, "\nflaky %v (%t)", n.flakyRate, n.flakyRand != nil)
	for s := range n.sets {
		fmt.Fprintf(&b, "\nevents queued: %d", len(s.queue))
	}
	return b.String()
}

// FuzzLoadState loads any bytes as the state file of a fresh node of one of
// a few profiles (which picks it). Load succeeds or returns an error, and
// what it accepts is what the node keeps: the record the node would write
// holds the same fields (instances in id order), a fresh node loads that
// record back to itself, and a fresh node with MIG on makes the same layout
// through NVML, so a file cannot hold what NVML would refuse to make.
func FuzzLoadState(f *testing.F) {
	profiles := []string{"gh200", "pcie-a30x4", "pcie-h100nvl-x2", "dgx1-v100"}
	for i, p := range profiles {
		for _, busy := range []bool{false, true} {
			data, err := stateSeed(p, busy)
			if err != nil {
				f.Fatal(err)
			}
			f.Add(uint8(i), data)
		}
	}
	f.Fuzz(func(t *testing.T, which uint8, data []byte) {
		profile := profiles[int(which)%len(profiles)]
		n, err := New(profile)
		if err != nil {
			t.Fatal(err)
		}
		if err := n.load(data); err != nil {
			if err.Error() == "" {
				t.Fatal("load failed with an empty error")
			}
			return
		}
		got := n.record()
		var want stateFile
		if err := json.Unmarshal(data, &want); err != nil {
			t.Fatalf("loaded, but is not JSON: %v", err)
		}
		if want.BootID == "" {
			// A file from before boots were kept starts a new one.
			if got.BootID == "" {
				t.Fatal("loaded a file without a boot id and has none")
			}
			want.BootID = got.BootID
		}
		if !reflect.DeepEqual(inIDOrder(want), got) {
			t.Fatalf("the node keeps other state than the file it loaded:\nloaded %s\nkeeps  %s", mustJSON(t, inIDOrder(want)), mustJSON(t, got))
		}

		again, err := New(profile)
		if err != nil {
			t.Fatal(err)
		}
		if err := again.load(mustJSON(t, got)); err != nil {
			t.Fatalf("the node's own record does not load: %v\n%s", err, mustJSON(t, got))
		}
		if kept := again.record(); !reflect.DeepEqual(kept, got) {
			t.Fatalf("record changed in a second load:\nfirst  %s\nsecond %s", mustJSON(t, got), mustJSON(t, kept))
		}
		replayLayout(t, profile, got)
	})
}

// replayLayout makes st's GPU and compute instances on a fresh node of
// profile through NVML, failing t where NVML refuses one.
func replayLayout(t *testing.T, profile string, st stateFile) {
	n := newNode(t, profile, WithMIGEnabled())
	for i, rec := range st.GPUs {
		d := handle(t, n, i)
		for _, gr := range rec.GPUInstances {
			info, ok := profileByID(d, gr.ProfileID)
			if !ok {
				t.Fatalf("gpu %d: no profile with id %d", i, gr.ProfileID)
			}
			gi, r := d.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: gr.Placement.Start, Size: gr.Placement.Size})
			if r != nvml.SUCCESS {
				t.Fatalf("gpu %d: loaded GPU instance %d (%s at %d+%d), which NVML does not make: %v",
					i, gr.ID, gr.Profile, gr.Placement.Start, gr.Placement.Size, r)
			}
			for _, cr := range gr.ComputeInstances {
				cinfo, r := gi.GetComputeInstanceProfileInfo(int(cr.ProfileID), nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
				if r == nvml.SUCCESS {
					_, r = gi.CreateComputeInstanceWithPlacement(&cinfo, &nvml.ComputeInstancePlacement{Start: cr.Placement.Start, Size: cr.Placement.Size})
				}
				if r != nvml.SUCCESS {
					t.Fatalf("gpu %d: GPU instance %d: loaded compute instance %d (profile %d at %d+%d), which NVML does not make: %v",
						i, gr.ID, cr.ID, cr.ProfileID, cr.Placement.Start, cr.Placement.Size, r)
				}
			}
		}
	}
}

// inIDOrder is st as a node records it: instances by id, no nil lists.
func inIDOrder(st stateFile) stateFile {
	st.GPUs = slices.Clone(st.GPUs)
	if st.GPUs == nil {
		st.GPUs = []gpuRecord{}
	}
	for i := range st.GPUs {
		g := &st.GPUs[i]
		if len(g.Processes) == 0 {
			g.Processes = nil // left out when there are none
		}
		g.GPUInstances = slices.Clone(g.GPUInstances)
		if g.GPUInstances == nil {
			g.GPUInstances = []giRecord{}
		}
		slices.SortStableFunc(g.GPUInstances, func(a, b giRecord) int { return a.ID - b.ID })
		for j := range g.GPUInstances {
			gi := &g.GPUInstances[j]
			gi.ComputeInstances = slices.Clone(gi.ComputeInstances)
			if gi.ComputeInstances == nil {
				gi.ComputeInstances = []ciRecord{}
			}
			slices.SortStableFunc(gi.ComputeInstances, func(a, b ciRecord) int { return a.ID - b.ID })
		}
	}
	return st
}

func mustJSON(t *testing.T, st stateFile) []byte {
	t.Helper()
	b, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	return append(b, '\n')
}

// stateSeed is the state file a node of profile writes, fresh or, when busy,
// after some of everything a state file keeps: MIG instances of several
// profiles (a GPU instance without a compute instance, one with two smaller
// ones), a pending MIG mode change, ECC counts, a recovery action, remapped
// rows and a lost GPU. What the profile's GPUs refuse is left out.
func stateSeed(profile string, busy bool) ([]byte, error) {
	n, err := New(profile, WithMIGEnabled())
	if err != nil {
		return nil, err
	}
	n.Init()
	defer n.Shutdown()
	if busy {
		last := len(n.gpus) - 1
		d, _ := n.DeviceGetHandleByIndex(0)
		for _, p := range []int{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, nvml.GPU_INSTANCE_PROFILE_2_SLICE, nvml.GPU_INSTANCE_PROFILE_3_SLICE} {
			info, r := d.GetGpuInstanceProfileInfo(p)
			if r != nvml.SUCCESS {
				continue
			}
			gi, r := d.CreateGpuInstance(&info)
			if r != nvml.SUCCESS || p == nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1 {
				continue // the +me instance stays without a compute instance
			}
			for range 2 {
				if cinfo, r := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED); r == nvml.SUCCESS {
					gi.CreateComputeInstance(&cinfo)
				}
			}
		}
		if last > 0 {
			d1, _ := n.DeviceGetHandleByIndex(1)
			d1.SetMigMode(nvml.DEVICE_MIG_DISABLE) // pending until a reset
			if err := n.SetLost(last, true); err != nil {
				return nil, err
			}
		}
		if err := n.SetECC(0, 12, 1); err != nil {
			return nil, err
		}
		if err := n.SetRecoveryAction(last, nvml.GPU_RECOVERY_ACTION_GPU_RESET); err != nil {
			return nil, err
		}
		_ = n.SetRemappedRows(0, 3, 1, true, false) // Volta has none
		// A process on a MIG device where GPU 0 has one, else on the GPU.
		p := Process{PID: 77, GI: 2, CI: 0, MPS: true, MemoryBytes: 1 << 20, SM: 10, Dec: 3}
		if n.StartProcess(0, p) != nil {
			p.GI, p.CI, p.MPS = NoInstance, NoInstance, false
			if err := n.StartProcess(0, p); err != nil {
				return nil, err
			}
		}
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	b, err := json.MarshalIndent(n.record(), "", "  ")
	return append(b, '\n'), err
}
