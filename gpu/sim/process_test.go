package sim

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

func pids(procs []nvml.ProcessInfo) []uint32 {
	out := []uint32{}
	for _, p := range procs {
		out = append(out, p.Pid)
	}
	return out
}

// TestProcessLists: MPS clients and the other compute processes are listed
// apart, and a MIG device handle lists only its own.
func TestProcessLists(t *testing.T) {
	n := newNode(t, "dgx-h100-mig")
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(n.StartProcess(0, Process{PID: 10, GI: 1, CI: 0, MemoryBytes: 1 << 30}))
	must(n.StartProcess(0, Process{PID: 11, GI: 1, CI: 0, MPS: true, MemoryBytes: 2 << 30}))
	must(n.StartProcess(0, Process{PID: 12, GI: 2, CI: 0, MemoryBytes: 3 << 30}))
	d := handle(t, n, 0)
	m0, r := d.GetMigDeviceHandleByIndex(0)
	wantRet(t, "MIG handle 0", r, nvml.SUCCESS)
	tests := []struct {
		name string
		dev  nvml.Device
		mps  bool
		want []uint32
	}{
		{"GPU, compute", d, false, []uint32{10, 12}},
		{"GPU, MPS", d, true, []uint32{11}},
		{"MIG 1/0, compute", m0, false, []uint32{10}},
		{"MIG 1/0, MPS", m0, true, []uint32{11}},
	}
	for _, tt := range tests {
		get := tt.dev.GetComputeRunningProcesses
		if tt.mps {
			get = tt.dev.GetMPSComputeRunningProcesses
		}
		procs, r := get()
		if r != nvml.SUCCESS || !slices.Equal(pids(procs), tt.want) {
			t.Errorf("%s: %v, %v; want %v", tt.name, pids(procs), r, tt.want)
		}
	}
	if mem, _ := m0.GetMemoryInfo_v2(); mem.Used != 3<<30 {
		t.Errorf("MIG 1/0 memory used %d, want its two processes' 3 GiB", mem.Used)
	}
	_, r = m0.GetProcessUtilization(0)
	wantRet(t, "utilization on a MIG device", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = d.GetProcessUtilization(0)
	wantRet(t, "utilization on a MIG-enabled GPU", r, nvml.ERROR_NOT_SUPPORTED)

	must(n.StopProcess(0, 10))
	if procs, _ := m0.GetComputeRunningProcesses(); len(procs) != 0 {
		t.Errorf("after stop: %v", pids(procs))
	}
	if err := n.StopProcess(0, 10); err == nil || !strings.Contains(err.Error(), "no process 10") {
		t.Errorf("stop twice: %v", err)
	}
}

// TestProcessUtilizationSamples: one sample per busy process and second,
// newer than lastSeen, from the buffer's last minute; none is NOT_FOUND.
func TestProcessUtilizationSamples(t *testing.T) {
	clk := newTestClock()
	n := newNode(t, "pcie-8gpu", WithClock(clk.now))
	d := handle(t, n, 3)
	_, r := d.GetProcessUtilization(0)
	wantRet(t, "no process", r, nvml.ERROR_NOT_FOUND)

	if err := n.StartProcess(3, Process{PID: 7, GI: NoInstance, CI: NoInstance, SM: 40, Mem: 10, Enc: 5, Dec: 6}); err != nil {
		t.Fatal(err)
	}
	if err := n.StartProcess(3, Process{PID: 8, GI: NoInstance, CI: NoInstance, MemoryBytes: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	_, r = d.GetProcessUtilization(0)
	wantRet(t, "busy process, no period ended yet", r, nvml.ERROR_NOT_FOUND)

	clk.add(3 * time.Second)
	s, r := d.GetProcessUtilization(0)
	wantRet(t, "after 3 s", r, nvml.SUCCESS)
	if len(s) != 3 {
		t.Fatalf("%d samples after 3 s, want 3 of PID 7 (PID 8 is idle): %+v", len(s), s)
	}
	want := nvml.ProcessUtilizationSample{Pid: 7, TimeStamp: s[0].TimeStamp, SmUtil: 40, MemUtil: 10, EncUtil: 5, DecUtil: 6}
	if s[0] != want {
		t.Errorf("sample %+v, want %+v", s[0], want)
	}
	for i := 1; i < len(s); i++ {
		if s[i].TimeStamp-s[i-1].TimeStamp != uint64(time.Second.Microseconds()) {
			t.Errorf("samples %d and %d are %d µs apart, want 1 s", i-1, i, s[i].TimeStamp-s[i-1].TimeStamp)
		}
	}
	last := s[len(s)-1].TimeStamp
	if now := uint64(clk.t.UnixMicro()); last > now || now-last >= uint64(time.Second.Microseconds()) {
		t.Errorf("last sample at %d, clock at %d", last, now)
	}
	_, r = d.GetProcessUtilization(last)
	wantRet(t, "nothing newer", r, nvml.ERROR_NOT_FOUND)
	clk.add(time.Second)
	if s, r := d.GetProcessUtilization(last); r != nvml.SUCCESS || len(s) != 1 || s[0].TimeStamp <= last {
		t.Errorf("one second later: %+v, %v", s, r)
	}
	clk.add(10 * time.Minute)
	if s, _ := d.GetProcessUtilization(0); len(s) != procSampleBuffer {
		t.Errorf("%d samples after 10 minutes, want the buffer's %d", len(s), procSampleBuffer)
	}
	// A change of load starts a new series: the old one's samples are gone.
	if err := n.StartProcess(3, Process{PID: 7, GI: NoInstance, CI: NoInstance, SM: 90}); err != nil {
		t.Fatal(err)
	}
	clk.add(2 * time.Second)
	if s, _ := d.GetProcessUtilization(0); len(s) != 2 || s[1].SmUtil != 90 {
		t.Errorf("after a change of load: %+v", s)
	}
}

func TestProcessRefused(t *testing.T) {
	whole := func(p Process) Process { p.GI, p.CI = NoInstance, NoInstance; return p }
	tests := []struct {
		name    string
		profile string
		p       Process
		err     string
	}{
		{"pid 0", "pcie-8gpu", whole(Process{}), "pid 0"},
		{"over 100%", "pcie-8gpu", whole(Process{PID: 1, SM: 101}), "above 100%"},
		{"cgroup too long", "pcie-8gpu", whole(Process{PID: 1, Cgroup: strings.Repeat("x", maxCgroupBytes+1)}), "cgroup of 201 bytes"},
		{"encoder on H100", "dgx-h100", whole(Process{PID: 1, Enc: 1}), "has no encoder"},
		{"whole GPU with MIG devices", "dgx-h100-mig", whole(Process{PID: 1}), "give its gi and ci"},
		{"MIG device with MIG off", "dgx-h100", Process{PID: 1, GI: 1, CI: 0}, "MIG is off"},
		{"no such MIG device", "dgx-h100-mig", Process{PID: 1, GI: 9, CI: 0}, "no MIG device 9/0"},
		{"more than the instance's memory", "dgx-h100-mig", Process{PID: 1, GI: 1, CI: 0, MemoryBytes: 20 << 30}, "more than its GPU instance"},
		{"more than the GPU's memory", "pcie-8gpu", whole(Process{PID: 1, MemoryBytes: 1 << 40}), "not reserved"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := newNode(t, tt.profile)
			err := n.StartProcess(0, tt.p)
			if err == nil || !strings.Contains(err.Error(), tt.err) {
				t.Fatalf("error %v, want %q", err, tt.err)
			}
			if procs, _ := n.Processes(0); len(procs) != 0 {
				t.Errorf("refused process kept: %+v", procs)
			}
		})
	}
	n := newNode(t, "pcie-8gpu")
	for i := range maxProcsPerGPU {
		if err := n.StartProcess(1, whole(Process{PID: uint32(i + 1)})); err != nil {
			t.Fatal(err)
		}
	}
	if err := n.StartProcess(1, whole(Process{PID: 9999})); err == nil || !strings.Contains(err.Error(), "at most") {
		t.Errorf("process %d: %v", maxProcsPerGPU+1, err)
	}
}

// TestProcessesKept: processes outlive the process holding the state file,
// with their load, as real ones outlive an agent restart; a reset ends them.
func TestProcessesKept(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	clk := newTestClock()
	n := newNode(t, "dgx-h100-mig", WithStateFile(path), WithClock(clk.now))
	p := Process{PID: 4242, GI: 3, CI: 0, MPS: true, MemoryBytes: 5 << 30, SM: 30, Mem: 20,
		Cgroup: "0::/kubepods.slice/kubepods-pod0b9e4a8c_1d2f_4e3a_9b8c_7d6e5f4a3b2c.slice/cri-containerd-" + strings.Repeat("ab", 32) + ".scope\n"}
	if err := n.StartProcess(2, p); err != nil {
		t.Fatal(err)
	}
	if err := n.Close(); err != nil {
		t.Fatal(err)
	}
	again := newNode(t, "dgx-h100-mig", WithStateFile(path), WithClock(clk.now))
	if procs, _ := again.Processes(2); len(procs) != 1 || procs[0] != p {
		t.Errorf("after restart %+v, want %+v", procs, p)
	}
	if err := again.Reset(2); err != nil {
		t.Fatal(err)
	}
	if procs, _ := again.Processes(2); len(procs) != 0 {
		t.Errorf("after reset %+v", procs)
	}
}

// TestProcessesFullStateFile: the most processes a node can hold fit its
// state file, which reads back.
func TestProcessesFullStateFile(t *testing.T) {
	n := newNode(t, "two-islands-16")
	for g := range 16 {
		for i := range maxProcsPerGPU {
			p := Process{PID: uint32(4_000_000 + g*1000 + i), GI: NoInstance, CI: NoInstance, MemoryBytes: 123 << 20,
				SM: 100, Mem: 100, Enc: 100, Dec: 100, Cgroup: "0::/" + strings.Repeat("x", maxCgroupBytes-4)}
			if err := n.StartProcess(g, p); err != nil {
				t.Fatal(err)
			}
		}
	}
	data, err := n.State()
	if err != nil {
		t.Fatal(err)
	}
	if len(data) > maxStateBytes {
		t.Fatalf("state of %d bytes, more than the %d a state file may hold", len(data), maxStateBytes)
	}
	if got := structure(data); got > maxStructurePerGPU*17 {
		t.Fatalf("structure %d above the bound %d", got, maxStructurePerGPU*17)
	}
	c := newNode(t, "two-islands-16", WithState(data))
	if procs, _ := c.Processes(15); len(procs) != maxProcsPerGPU {
		t.Errorf("copy has %d processes on GPU 15", len(procs))
	}
}

func TestProcessHTTP(t *testing.T) {
	clk := newTestClock()
	n := newNode(t, "dgx-h100-mig", WithClock(clk.now))
	mig, r := handle(t, n, 1).GetMigDeviceHandleByIndex(2)
	wantRet(t, "MIG handle", r, nvml.SUCCESS)
	migUUID, _ := mig.GetUUID()
	h := n.Handler()
	post := func(path, body string) (int, string) {
		t.Helper()
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, path, strings.NewReader(body)))
		var out map[string]any
		_ = json.Unmarshal(rec.Body.Bytes(), &out)
		msg, _ := out["error"].(string)
		return rec.Code, msg
	}
	tests := []struct {
		name, path, body string
		status           int
		errPart          string
	}{
		{"by MIG uuid", "/sim/process", `{"uuid":"` + migUUID + `","pid":100,"mem_used_bytes":1048576}`, 200, ""},
		{"load changed, rest kept", "/sim/process", `{"uuid":"` + migUUID + `","pid":100,"sm_util":50}`, 200, ""},
		{"by gpu, gi and ci", "/sim/process", `{"gpu":1,"gi":1,"ci":0,"pid":101,"mps":true}`, 200, ""},
		{"same pid on another GPU", "/sim/process", `{"gpu":2,"gi":1,"ci":0,"pid":100}`, 200, ""},
		{"no pid", "/sim/process", `{"gpu":1}`, 400, `missing "pid"`},
		{"no device", "/sim/process", `{"pid":1}`, 400, `missing "gpu" or "uuid"`},
		{"gpu and uuid", "/sim/process", `{"gpu":1,"uuid":"x","pid":1}`, 400, "not both"},
		{"gi without ci", "/sim/process", `{"gpu":1,"gi":1,"pid":1}`, 400, `both "gi" and "ci"`},
		{"unknown uuid", "/sim/process", `{"uuid":"GPU-nope","pid":1}`, 400, "no GPU or MIG device"},
		{"whole GPU with MIG on", "/sim/process", `{"gpu":1,"pid":1}`, 400, "give its gi and ci"},
		{"stop on one GPU", "/sim/process/stop", `{"gpu":1,"pid":101}`, 200, ""},
		{"stop everywhere", "/sim/process/stop", `{"pid":100}`, 200, ""},
		{"stop unknown", "/sim/process/stop", `{"pid":100}`, 400, "no process 100 on any GPU"},
	}
	for _, tt := range tests {
		code, msg := post(tt.path, tt.body)
		if code != tt.status || (tt.errPart == "") != (msg == "") || !strings.Contains(msg, tt.errPart) {
			t.Errorf("%s: %d %q, want %d %q", tt.name, code, msg, tt.status, tt.errPart)
		}
		if tt.name == "load changed, rest kept" {
			procs, _ := n.Processes(1)
			want := []Process{{PID: 100, GI: 3, CI: 0, MemoryBytes: 1 << 20, SM: 50}}
			if !slices.Equal(procs, want) {
				t.Errorf("after %s: %+v, want %+v", tt.name, procs, want)
			}
		}
	}
	for g := range 3 {
		if procs, _ := n.Processes(g); len(procs) != 0 {
			t.Errorf("GPU %d still runs %+v", g, procs)
		}
	}
}

// TestProcessCgroup: a cgroup set over /sim/process names the process's pod
// for ProcessCgroup, kept when later requests leave it out; a process
// without one is a real PID's, for the host's /proc.
func TestProcessCgroup(t *testing.T) {
	n := newNode(t, "pcie-8gpu")
	h := n.Handler()
	post := func(body string) {
		t.Helper()
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/sim/process", strings.NewReader(body)))
		if rec.Code != http.StatusOK {
			t.Fatalf("%s: %d %s", body, rec.Code, rec.Body)
		}
	}
	const cg = "0::/kubepods/besteffort/pod0b9e4a8c-1d2f-4e3a-9b8c-7d6e5f4a3b2c/abc\n"
	post(`{"gpu":3,"pid":700,"cgroup":"0::/kubepods/besteffort/pod0b9e4a8c-1d2f-4e3a-9b8c-7d6e5f4a3b2c/abc\n"}`)
	post(`{"gpu":3,"pid":700,"sm_util":20}`)
	post(`{"gpu":4,"pid":701}`)
	if got, ok := n.ProcessCgroup(700); !ok || got != cg {
		t.Errorf("ProcessCgroup(700) = %q, %v; want %q", got, ok, cg)
	}
	if got, ok := n.ProcessCgroup(701); ok {
		t.Errorf("ProcessCgroup(701) = %q, want none", got)
	}
}
