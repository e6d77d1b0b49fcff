package sim

import (
	"bytes"
	"encoding/json"
	"net/http/httptest"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// callZero calls method name of handle with zero arguments and returns its
// nvml.Return result.
func callZero(t *testing.T, handle any, name string) nvml.Return {
	t.Helper()
	m := reflect.ValueOf(handle).MethodByName(name)
	args := make([]reflect.Value, m.Type().NumIn())
	for i := range args {
		args[i] = reflect.Zero(m.Type().In(i))
	}
	for _, out := range m.Call(args) {
		if out.Type() == returnType {
			return out.Interface().(nvml.Return)
		}
	}
	t.Fatalf("%s returns no nvml.Return", name)
	return 0
}

// Every method of every handle must honour FailCalls, modelled or not: a
// method that named itself wrongly in its check would run instead.
func TestFailCallsReachesEveryMethod(t *testing.T) {
	n := newNode(t, "dgx-a100", WithMIGEnabled())
	d := handle(t, n, 4)
	gi := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4)
	ci := createFullCI(t, gi)
	mig, r := d.GetMigDeviceHandleByIndex(0)
	wantRet(t, "MIG device", r, nvml.SUCCESS)
	handles := []struct {
		what   string
		handle any
		iface  reflect.Type
		prefix string // of the FailCalls name
	}{
		{"GPU", d, reflect.TypeFor[nvml.Device](), ""},
		{"MIG device", mig, reflect.TypeFor[nvml.Device](), ""},
		{"GPU instance", gi, reflect.TypeFor[nvml.GpuInstance](), "GpuInstance"},
		{"compute instance", ci, reflect.TypeFor[nvml.ComputeInstance](), "ComputeInstance"},
	}
	other := handle(t, n, 5)
	for _, h := range handles {
		for i := range h.iface.NumMethod() {
			name := h.iface.Method(i).Name
			if !has(h.iface, name) || name == "Destroy" {
				continue // Destroy: below, it would end the handle
			}
			if err := n.FailCalls(4, h.prefix+name, nvml.ERROR_TIMEOUT, 1); err != nil {
				t.Fatal(err)
			}
			if name == "GetUUID" {
				// Another GPU's calls are not this GPU's.
				if _, r := other.GetUUID(); r != nvml.SUCCESS {
					t.Errorf("GPU 5 GetUUID with GPU 4's failing: %v", r)
				}
			}
			if r := callZero(t, h.handle, name); r != nvml.ERROR_TIMEOUT {
				t.Errorf("%s %s: %v, want the injected ERROR_TIMEOUT", h.what, name, r)
			}
			if r := callZero(t, h.handle, name); r == nvml.ERROR_TIMEOUT {
				t.Errorf("%s %s: still failing after its one failure", h.what, name)
			}
		}
	}
	for _, h := range handles[2:] {
		if err := n.FailCalls(4, h.prefix+"Destroy", nvml.ERROR_IN_USE, 1); err != nil {
			t.Fatal(err)
		}
		if r := callZero(t, h.handle, "Destroy"); r != nvml.ERROR_IN_USE {
			t.Errorf("%s Destroy: %v, want the injected ERROR_IN_USE", h.what, r)
		}
	}
	wantRet(t, "CI Destroy once the failure is used", ci.Destroy(), nvml.SUCCESS)
}

func TestFailCalls(t *testing.T) {
	type step struct {
		gpu  int
		want nvml.Return
	}
	tests := []struct {
		name  string
		call  string
		ret   nvml.Return
		count int
		steps []step // GetMigMode calls in order
	}{
		{"twice", "GetMigMode", nvml.ERROR_UNKNOWN, 2, []step{{0, nvml.ERROR_UNKNOWN}, {1, nvml.SUCCESS}, {0, nvml.ERROR_UNKNOWN}, {0, nvml.SUCCESS}}},
		{"interface name", "DeviceGetMigMode", nvml.ERROR_GPU_IS_LOST, 1, []step{{0, nvml.ERROR_GPU_IS_LOST}, {0, nvml.SUCCESS}}},
		{"until cleared", "GetMigMode", nvml.ERROR_TIMEOUT, -1, []step{{0, nvml.ERROR_TIMEOUT}, {0, nvml.ERROR_TIMEOUT}, {0, nvml.ERROR_TIMEOUT}}},
		{"zero clears nothing set", "GetMigMode", nvml.ERROR_TIMEOUT, 0, []step{{0, nvml.SUCCESS}}},
		{"other method", "GetUUID", nvml.ERROR_TIMEOUT, -1, []step{{0, nvml.SUCCESS}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := newNode(t, "dgx-h100")
			if err := n.FailCalls(0, tt.call, tt.ret, tt.count); err != nil {
				t.Fatal(err)
			}
			for i, s := range tt.steps {
				_, _, r := handle(t, n, s.gpu).GetMigMode()
				if r != s.want {
					t.Errorf("call %d on GPU %d: %v, want %v", i, s.gpu, r, s.want)
				}
			}
			if err := n.FailCalls(0, tt.call, tt.ret, 0); err != nil {
				t.Fatal(err)
			}
			if _, _, r := handle(t, n, 0).GetMigMode(); r != nvml.SUCCESS {
				t.Errorf("after clearing: %v", r)
			}
		})
	}
}

func TestFailCallsErrors(t *testing.T) {
	n := newNode(t, "pcie-4gpu")
	tests := []struct {
		gpu  int
		call string
		ret  nvml.Return
		want string
	}{
		{4, "GetUUID", nvml.ERROR_UNKNOWN, "gpu 4 out of range"},
		{1, "GetUUIDs", nvml.ERROR_UNKNOWN, `gpu 1 (GPU-`},
		{1, "Destroy", nvml.ERROR_UNKNOWN, `"Destroy" is not a method`},
		{1, "GetGpuInstanceProfileInfoV", nvml.ERROR_UNKNOWN, "is not a method"}, // cannot return an error
		{1, "GetUUID", nvml.SUCCESS, "must be an error"},
	}
	for _, tt := range tests {
		err := n.FailCalls(tt.gpu, tt.call, tt.ret, 1)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("FailCalls(%d, %q, %v): %v, want %q", tt.gpu, tt.call, tt.ret, err, tt.want)
		}
	}
	// -1 is "until cleared"; -2 means nothing.
	if err := n.FailCalls(1, "GetUUID", nvml.ERROR_UNKNOWN, -2); err == nil || !strings.Contains(err.Error(), "count -2") {
		t.Errorf("FailCalls with count -2: %v, want an error naming the count", err)
	}
}

// An injected failure is the driver refusing a call: before Init the
// library answers first, and the failure waits for a real call.
func TestFailCallsNotCountedBeforeInit(t *testing.T) {
	n, err := New("pcie-4gpu")
	if err != nil {
		t.Fatal(err)
	}
	n.Init()
	d := handle(t, n, 0)
	n.Shutdown()
	if err := n.FailCalls(0, "GetName", nvml.ERROR_TIMEOUT, 1); err != nil {
		t.Fatal(err)
	}
	_, r := d.GetName()
	wantRet(t, "before Init", r, nvml.ERROR_UNINITIALIZED)
	n.Init()
	defer n.Shutdown()
	_, r = d.GetName()
	wantRet(t, "after Init", r, nvml.ERROR_TIMEOUT)
}

// A failed call must leave the GPU as it was, in memory and in the state
// file, and failures themselves are not kept: a restarted agent finds the
// driver healthy again.
func TestFailedCallsChangeNothing(t *testing.T) {
	path := filepath.Join(t.TempDir(), "s.json")
	n := openStateNode(t, "dgx-a100", path, WithMIGEnabled())
	d := handle(t, n, 0)
	gi := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 0)
	ci := createFullCI(t, gi)
	saved, _ := os.ReadFile(path)
	before := observe(t, n)

	info := giInfo(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	cinfo, _ := gi.GetComputeInstanceProfileInfo(nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
	calls := []struct {
		call string
		do   func() nvml.Return
	}{
		{"CreateGpuInstance", func() nvml.Return { _, r := d.CreateGpuInstance(info); return r }},
		{"CreateGpuInstanceWithPlacement", func() nvml.Return {
			_, r := d.CreateGpuInstanceWithPlacement(info, &nvml.GpuInstancePlacement{Start: 6, Size: 1})
			return r
		}},
		{"SetMigMode", func() nvml.Return { _, r := d.SetMigMode(nvml.DEVICE_MIG_DISABLE); return r }},
		{"GpuInstanceCreateComputeInstance", func() nvml.Return { _, r := gi.CreateComputeInstance(&cinfo); return r }},
		{"GpuInstanceDestroy", gi.Destroy},
		{"ComputeInstanceDestroy", ci.Destroy},
	}
	for _, c := range calls {
		if err := n.FailCalls(0, c.call, nvml.ERROR_UNKNOWN, -1); err != nil {
			t.Fatal(err)
		}
		wantRet(t, c.call, c.do(), nvml.ERROR_UNKNOWN)
	}
	if err := n.SetFlaky(1, 7); err != nil {
		t.Fatal(err)
	}
	_, r := d.CreateGpuInstance(info)
	wantRet(t, "CreateGpuInstance with every call flaky", r, nvml.ERROR_UNKNOWN)
	n.SetFlaky(0, 0)

	if after := observe(t, n); after != before {
		t.Errorf("failed calls changed the node:\nbefore:\n%s\nafter:\n%s", before, after)
	}
	if got, _ := os.ReadFile(path); !bytes.Equal(got, saved) {
		t.Errorf("failed calls rewrote the state file:\n%s\nwas:\n%s", got, saved)
	}
	closeNode(t, n)
	n2 := openStateNode(t, "dgx-a100", path)
	gi2, r := handle(t, n2, 0).GetGpuInstanceById(1)
	wantRet(t, "GI after reload", r, nvml.SUCCESS)
	ci2, r := gi2.GetComputeInstanceById(0)
	wantRet(t, "CI after reload", r, nvml.SUCCESS)
	wantRet(t, "ComputeInstanceDestroy after reload (failures are not kept)", ci2.Destroy(), nvml.SUCCESS)
}

func TestSetFlaky(t *testing.T) {
	// pattern is which of 300 GetMemoryInfo calls fail.
	pattern := func(rate float64, seed int64) string {
		n := newNode(t, "pcie-4gpu")
		if err := n.SetFlaky(rate, seed); err != nil {
			t.Fatal(err)
		}
		d := handle(t, n, 0)
		var b strings.Builder
		for range 300 {
			switch _, r := d.GetMemoryInfo(); r {
			case nvml.SUCCESS:
				b.WriteByte('.')
			case nvml.ERROR_UNKNOWN:
				b.WriteByte('x')
			default:
				t.Fatalf("flaky call returned %v", r)
			}
		}
		return b.String()
	}
	a, b := pattern(0.2, 42), pattern(0.2, 42)
	if a != b {
		t.Errorf("same seed, different failures:\n%s\n%s", a, b)
	}
	if fails := strings.Count(a, "x"); fails < 30 || fails > 90 {
		t.Errorf("%d of 300 calls failed at rate 0.2:\n%s", fails, a)
	}
	if c := pattern(0.2, 43); c == a {
		t.Errorf("seeds 42 and 43 fail the same calls")
	}
	if off := pattern(0, 42); strings.Contains(off, "x") {
		t.Errorf("rate 0 failed calls: %s", off)
	}
	n := newNode(t, "pcie-4gpu")
	for _, rate := range []float64{-0.1, 1.5} {
		if err := n.SetFlaky(rate, 1); err == nil || !strings.Contains(err.Error(), "rate") {
			t.Errorf("SetFlaky(%v): %v", rate, err)
		}
	}
	// Flaky applies to instance handles too, and FailCalls comes first.
	if err := n.SetFlaky(1, 1); err != nil {
		t.Fatal(err)
	}
	if err := n.FailCalls(0, "GetName", nvml.ERROR_TIMEOUT, 1); err != nil {
		t.Fatal(err)
	}
	_, r := handle(t, n, 0).GetName()
	wantRet(t, "GetName failing and flaky", r, nvml.ERROR_TIMEOUT)
	m := newNode(t, "dgx-a100", WithMIGEnabled())
	gi := createGI(t, handle(t, m, 0), nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0)
	m.SetFlaky(1, 1)
	_, r = gi.GetInfo()
	wantRet(t, "GPU instance GetInfo at rate 1", r, nvml.ERROR_UNKNOWN)
}

func TestHTTPFailAndFlaky(t *testing.T) {
	tests := []struct {
		name    string
		path    string
		body    string
		status  int
		errPart string
	}{
		{"fail", "/sim/fail", `{"gpu":1,"call":"GetMigMode","error":"ERROR_GPU_IS_LOST","count":1}`, 200, ""},
		{"fail default error", "/sim/fail", `{"gpu":2,"call":"GetMemoryInfo","count":-1}`, 200, ""},
		{"fail unknown error", "/sim/fail", `{"gpu":1,"call":"GetMigMode","error":"ERROR_MELTED","count":1}`, 400, `"error": unknown NVML error "ERROR_MELTED"`},
		{"fail unknown call", "/sim/fail", `{"gpu":1,"call":"Melt","count":1}`, 400, `"Melt" is not a method`},
		{"fail missing call", "/sim/fail", `{"gpu":1,"count":1}`, 400, `missing "call"`},
		{"fail missing count", "/sim/fail", `{"gpu":1,"call":"GetMigMode"}`, 400, `missing "count"`},
		{"fail missing gpu", "/sim/fail", `{"call":"GetMigMode","count":1}`, 400, `missing "gpu"`},
		{"fail gpu out of range", "/sim/fail", `{"gpu":9,"call":"GetMigMode","count":1}`, 400, "out of range"},
		{"fail unknown field", "/sim/fail", `{"gpu":1,"call":"GetMigMode","count":1,"times":2}`, 400, "times"},
		{"flaky bad rate", "/sim/flaky", `{"rate":2,"seed":1}`, 400, "rate 2 outside [0, 1]"},
		{"flaky missing rate", "/sim/flaky", `{"seed":1}`, 400, `missing "rate"`},
	}
	n := newNode(t, "dgx-a100")
	h := n.Handler()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest("POST", tt.path, strings.NewReader(tt.body)))
			var resp struct {
				OK    bool   `json:"ok"`
				Error string `json:"error"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil || rec.Code != tt.status {
				t.Fatalf("status %d (want %d), body %s", rec.Code, tt.status, rec.Body)
			}
			if tt.status == 200 && !resp.OK || tt.status != 200 && !strings.Contains(resp.Error, tt.errPart) {
				t.Errorf("response %+v, want error containing %q", resp, tt.errPart)
			}
		})
	}
	_, _, r := handle(t, n, 1).GetMigMode()
	wantRet(t, "GPU 1 GetMigMode after /sim/fail", r, nvml.ERROR_GPU_IS_LOST)
	_, _, r = handle(t, n, 1).GetMigMode()
	wantRet(t, "GPU 1 GetMigMode once the count is used", r, nvml.SUCCESS)
	_, r = handle(t, n, 2).GetMemoryInfo()
	wantRet(t, "GPU 2 GetMemoryInfo with the default error", r, nvml.ERROR_UNKNOWN)

	post := func(path, body string) {
		t.Helper()
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("POST", path, strings.NewReader(body)))
		if rec.Code != 200 {
			t.Fatalf("%s %s: %d %s", path, body, rec.Code, rec.Body)
		}
	}
	post("/sim/fail", `{"gpu":2,"call":"GetMemoryInfo","count":0}`)
	_, r = handle(t, n, 2).GetMemoryInfo()
	wantRet(t, "GPU 2 GetMemoryInfo after count 0", r, nvml.SUCCESS)
	post("/sim/flaky", `{"rate":1,"seed":3}`)
	_, r = handle(t, n, 3).GetName()
	wantRet(t, "GetName at rate 1", r, nvml.ERROR_UNKNOWN)
	post("/sim/flaky", `{"rate":0}`)
	_, r = handle(t, n, 3).GetName()
	wantRet(t, "GetName at rate 0", r, nvml.SUCCESS)
}
