package sim

import (
	"bufio"
	"encoding/json"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"golang.org/x/sys/unix"
)

// fabricV3 reads a GPU's version 3 fabric info as the gpu package does.
func fabricV3(t *testing.T, n *Node, i int) (nvml.GpuFabricInfo_v3, nvml.Return) {
	t.Helper()
	d, ok := handle(t, n, i).(interface {
		GetGpuFabricInfoV3() (nvml.GpuFabricInfo_v3, nvml.Return)
	})
	if !ok {
		t.Fatal("sim device has no GetGpuFabricInfoV3")
	}
	return d.GetGpuFabricInfoV3()
}

// healthField is NVML_GPU_FABRIC_HEALTH_GET.
func healthField(mask, shift, width uint32) uint32 { return mask >> shift & width }

// Nodes of one clique agree on cluster UUID and clique id; another clique
// is another domain; every GPU of a tray reports the same.
func TestFabricInfoCliques(t *testing.T) {
	a := newNode(t, "gb200-tray", WithClique(7))
	b := newNode(t, "gb200-tray", WithClique(7))
	c := newNode(t, "gb200-tray", WithClique(8))
	want7, want8 := ClusterUUID(7), ClusterUUID(8)
	if want7 == want8 {
		t.Fatal("two cliques, one cluster UUID")
	}
	for _, tt := range []struct {
		name   string
		n      *Node
		uuid   [16]byte
		clique uint32
	}{{"a", a, want7, 7}, {"b", b, want7, 7}, {"c", c, want8, 8}} {
		for i := range 4 {
			v1, r := handle(t, tt.n, i).GetGpuFabricInfo()
			wantRet(t, "GetGpuFabricInfo", r, nvml.SUCCESS)
			if v1.State != nvml.GPU_FABRIC_STATE_COMPLETED || v1.Status != uint32(nvml.SUCCESS) || v1.ClusterUuid != tt.uuid || v1.CliqueId != tt.clique {
				t.Errorf("node %s gpu %d v1: %+v", tt.name, i, v1)
			}
			v3, r := fabricV3(t, tt.n, i)
			wantRet(t, "GetGpuFabricInfoV3", r, nvml.SUCCESS)
			if v3.ClusterUuid != tt.uuid || v3.CliqueId != tt.clique || v3.HealthSummary != nvml.GPU_FABRIC_HEALTH_SUMMARY_HEALTHY ||
				v3.Version != nvml.STRUCT_VERSION(v3, 3) {
				t.Errorf("node %s gpu %d v3: %+v", tt.name, i, v3)
			}
			if got := healthField(v3.HealthMask, nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW, nvml.GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW); got != nvml.GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE {
				t.Errorf("node %s gpu %d: degraded bandwidth field %d, want FALSE", tt.name, i, got)
			}
		}
	}
	// The default clique is one all unconfigured trays share.
	d := newNode(t, "gb200-tray")
	if v1, _ := handle(t, d, 0).GetGpuFabricInfo(); v1.CliqueId != defaultClique || v1.ClusterUuid != ClusterUUID(defaultClique) {
		t.Errorf("default clique: %+v", v1)
	}
}

// GPUs without a multi-node fabric answer NOT_SUPPORTED, and take no clique.
func TestFabricInfoNotSupported(t *testing.T) {
	n := newNode(t, "dgx-h100")
	_, r := handle(t, n, 0).GetGpuFabricInfo()
	wantRet(t, "GetGpuFabricInfo on dgx-h100", r, nvml.ERROR_NOT_SUPPORTED)
	_, r = fabricV3(t, n, 0)
	wantRet(t, "GetGpuFabricInfoV3 on dgx-h100", r, nvml.ERROR_NOT_SUPPORTED)
	if _, err := New("dgx-h100", WithClique(1)); err == nil || !strings.Contains(err.Error(), "gb200-tray") {
		t.Errorf("clique on dgx-h100: %v, want refused naming the fabric profiles", err)
	}
	if err := n.SetFabricFault(0, FabricFault{RouteUnhealthy: true}); err == nil {
		t.Error("fabric fault on dgx-h100 accepted")
	}
	// A lost GPU says so, here as in every call.
	g := newNode(t, "gb200-tray")
	d := handle(t, g, 1)
	if err := g.SetLost(1, true); err != nil {
		t.Fatal(err)
	}
	_, r = d.GetGpuFabricInfo()
	wantRet(t, "GetGpuFabricInfo on a lost GPU", r, nvml.ERROR_GPU_IS_LOST)
}

func TestFabricFaults(t *testing.T) {
	shifts := map[string]uint32{
		"degraded":  nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW,
		"recovery":  nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY,
		"unhealthy": nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY,
	}
	tests := []struct {
		name    string
		fault   FabricFault
		state   uint8
		status  nvml.Return
		summary uint8
		trueBit string // the health field reported TRUE, if any
		domain  bool   // cluster UUID and clique reported
	}{
		{"none", FabricFault{}, nvml.GPU_FABRIC_STATE_COMPLETED, nvml.SUCCESS, nvml.GPU_FABRIC_HEALTH_SUMMARY_HEALTHY, "", true},
		{"not started", FabricFault{State: nvml.GPU_FABRIC_STATE_NOT_STARTED}, nvml.GPU_FABRIC_STATE_NOT_STARTED, nvml.SUCCESS, nvml.GPU_FABRIC_HEALTH_SUMMARY_HEALTHY, "", false},
		{"in progress", FabricFault{State: nvml.GPU_FABRIC_STATE_IN_PROGRESS}, nvml.GPU_FABRIC_STATE_IN_PROGRESS, nvml.SUCCESS, nvml.GPU_FABRIC_HEALTH_SUMMARY_HEALTHY, "", false},
		{"failed registration", FabricFault{Status: nvml.ERROR_NOT_READY}, nvml.GPU_FABRIC_STATE_COMPLETED, nvml.ERROR_NOT_READY, nvml.GPU_FABRIC_HEALTH_SUMMARY_HEALTHY, "", true},
		{"degraded bandwidth", FabricFault{DegradedBandwidth: true}, nvml.GPU_FABRIC_STATE_COMPLETED, nvml.SUCCESS, nvml.GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY, "degraded", true},
		{"route recovery", FabricFault{RouteRecovery: true}, nvml.GPU_FABRIC_STATE_COMPLETED, nvml.SUCCESS, nvml.GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY, "recovery", true},
		{"route unhealthy", FabricFault{RouteUnhealthy: true}, nvml.GPU_FABRIC_STATE_COMPLETED, nvml.SUCCESS, nvml.GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY, "unhealthy", true},
	}
	n := newNode(t, "gb200-tray", WithClique(3))
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if err := n.SetFabricFault(2, tt.fault); err != nil {
				t.Fatal(err)
			}
			v3, r := fabricV3(t, n, 2)
			wantRet(t, "GetGpuFabricInfoV3", r, nvml.SUCCESS)
			if v3.State != tt.state || nvml.Return(v3.Status) != tt.status || v3.HealthSummary != tt.summary {
				t.Errorf("state %d status %d summary %d, want %d %d %d", v3.State, v3.Status, v3.HealthSummary, tt.state, tt.status, tt.summary)
			}
			for name, shift := range shifts {
				want := uint32(nvml.GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE)
				if name == tt.trueBit {
					want = nvml.GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
				}
				if got := healthField(v3.HealthMask, shift, 3); got != want {
					t.Errorf("health field %s = %d, want %d", name, got, want)
				}
			}
			if got := v3.ClusterUuid == ClusterUUID(3) && v3.CliqueId == 3; got != tt.domain {
				t.Errorf("domain reported %v, want %v: %+v", got, tt.domain, v3)
			}
			// Version 1 says the same, less the health.
			v1, _ := handle(t, n, 2).GetGpuFabricInfo()
			if v1.State != v3.State || v1.Status != v3.Status || v1.ClusterUuid != v3.ClusterUuid || v1.CliqueId != v3.CliqueId {
				t.Errorf("v1 %+v disagrees with v3 %+v", v1, v3)
			}
			// The other GPUs are untouched.
			if o, _ := fabricV3(t, n, 1); o.HealthSummary != nvml.GPU_FABRIC_HEALTH_SUMMARY_HEALTHY || o.State != nvml.GPU_FABRIC_STATE_COMPLETED {
				t.Errorf("gpu 1: %+v", o)
			}
		})
	}
	for _, bad := range []FabricFault{{State: 9}, {Status: nvml.Return(12345)}} {
		if err := n.SetFabricFault(0, bad); err == nil {
			t.Errorf("SetFabricFault(%+v) accepted", bad)
		}
	}
}

// A fabric fault outlives the process, as the fabric's view of a GPU
// outlives the agent, and a reset; clearing it writes it away.
func TestFabricFaultStateFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "state.json")
	n, err := New("gb200-tray", WithStateFile(path), WithClique(5))
	if err != nil {
		t.Fatal(err)
	}
	n.Init()
	want := FabricFault{State: nvml.GPU_FABRIC_STATE_IN_PROGRESS, Status: nvml.ERROR_NOT_READY, DegradedBandwidth: true, RouteUnhealthy: true}
	if err := n.SetFabricFault(3, want); err != nil {
		t.Fatal(err)
	}
	if err := n.Reset(3); err != nil {
		t.Fatal(err)
	}
	n.Close()
	data, _ := os.ReadFile(path)
	if !strings.Contains(string(data), `"state": "in-progress"`) || !strings.Contains(string(data), `"status": "ERROR_NOT_READY"`) {
		t.Errorf("state file lacks the fault:\n%s", data)
	}

	m, err := New("gb200-tray", WithStateFile(path), WithClique(5))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	m.Init()
	v3, _ := fabricV3(t, m, 3)
	if v3.State != nvml.GPU_FABRIC_STATE_IN_PROGRESS || nvml.Return(v3.Status) != nvml.ERROR_NOT_READY || v3.HealthSummary != nvml.GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY {
		t.Errorf("after restart: %+v", v3)
	}
	if err := m.SetFabricFault(3, FabricFault{}); err != nil {
		t.Fatal(err)
	}
	if data, _ := os.ReadFile(path); strings.Contains(string(data), `"fabric"`) {
		t.Errorf("cleared fault still in the state file:\n%s", data)
	}
}

func TestFabricStateFileRefused(t *testing.T) {
	n := newNode(t, "gb200-tray")
	if err := n.SetFabricFault(0, FabricFault{RouteRecovery: true}); err != nil {
		t.Fatal(err)
	}
	good, err := n.State()
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, profile, from, to, want string
	}{
		{"unknown state", "gb200-tray", `"route_recovery": true`, `"state": "half-done"`, `fabric state "half-done"`},
		{"unknown status", "gb200-tray", `"route_recovery": true`, `"status": "ERROR_MELTED"`, `unknown NVML error "ERROR_MELTED"`},
		{"empty", "gb200-tray", `"route_recovery": true`, ``, `empty "fabric"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			data := strings.Replace(string(good), tt.from, tt.to, 1)
			_, err := New(tt.profile, WithState([]byte(data)))
			if err == nil || !strings.Contains(err.Error(), tt.want) || !strings.Contains(err.Error(), "gpu 0") {
				t.Errorf("New: %v, want an error naming gpu 0 and %q", err, tt.want)
			}
		})
	}
	// A dgx-h100 state with a fabric record is not one this sim wrote.
	h := newNode(t, "dgx-h100")
	hs, _ := h.State()
	bad := strings.Replace(string(hs), `"remapped_rows"`, `"fabric": {"route_unhealthy": true}, "remapped_rows"`, 1)
	if _, err := New("dgx-h100", WithState([]byte(bad))); err == nil || !strings.Contains(err.Error(), "not attached to an NVLink fabric") {
		t.Errorf("fabric on dgx-h100: %v", err)
	}
}

func TestHTTPFabric(t *testing.T) {
	n := newNode(t, "gb200-tray", WithClique(2))
	h := n.Handler()
	post := func(body string) (int, string) {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("POST", "/sim/fabric", strings.NewReader(body)))
		var resp struct{ Error string }
		if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil {
			t.Fatalf("answer %q: %v", rec.Body, err)
		}
		return rec.Code, resp.Error
	}
	for _, tt := range []struct {
		body    string
		status  int
		errPart string
	}{
		{`{"gpu":1,"state":"not-started"}`, 200, ""},
		{`{"gpu":1,"state":"sideways"}`, 400, `"state": fabric state "sideways": want not-started, in-progress or completed`},
		{`{"gpu":1,"status":"ERROR_MELTED"}`, 400, `"status": unknown NVML error`},
		{`{"gpu":1,"degraded":true}`, 400, "unknown field"},
		{`{"state":"in-progress"}`, 400, `missing "gpu"`},
		{`{"gpu":4,"route_unhealthy":true}`, 400, "out of range"},
	} {
		code, body := post(tt.body)
		if code != tt.status || !strings.Contains(body, tt.errPart) {
			t.Errorf("POST %s: %d %s, want %d containing %q", tt.body, code, body, tt.status, tt.errPart)
		}
	}
	if v3, _ := fabricV3(t, n, 1); v3.State != nvml.GPU_FABRIC_STATE_NOT_STARTED {
		t.Errorf("after POST not-started: %+v", v3)
	}
	if code, body := post(`{"gpu":1,"status":"SUCCESS","route_unhealthy":true,"degraded_bw":true}`); code != 200 {
		t.Fatalf("%d %s", code, body)
	}
	if v3, _ := fabricV3(t, n, 1); v3.State != nvml.GPU_FABRIC_STATE_COMPLETED || v3.HealthSummary != nvml.GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY {
		t.Errorf("after POST route_unhealthy: %+v", v3)
	}
	if code, _ := post(`{"gpu":1}`); code != 200 {
		t.Fatal(code)
	}
	if v3, _ := fabricV3(t, n, 1); v3.HealthSummary != nvml.GPU_FABRIC_HEALTH_SUMMARY_HEALTHY {
		t.Errorf("after clearing: %+v", v3)
	}
	o := newNode(t, "dgx-a100")
	rec := httptest.NewRecorder()
	o.Handler().ServeHTTP(rec, httptest.NewRequest("POST", "/sim/fabric", strings.NewReader(`{"gpu":0,"route_unhealthy":true}`)))
	if rec.Code != 400 || !strings.Contains(rec.Body.String(), "not attached to an NVLink fabric") {
		t.Errorf("dgx-a100: %d %s", rec.Code, rec.Body)
	}
}

// Each GB200 GPU is in a PCI domain of its own, and NVML finds it by it.
func TestGB200PCIDomains(t *testing.T) {
	n := newNode(t, "gb200-tray")
	for i, want := range []string{"00000008:01:00.0", "00000009:01:00.0", "00000018:01:00.0", "00000019:01:00.0"} {
		p, _ := handle(t, n, i).GetPciInfo()
		if got := cString(p.BusId[:]); got != want {
			t.Errorf("gpu %d bus id %s, want %s", i, got, want)
		}
		d, r := n.DeviceGetHandleByPciBusId(want[4:])
		wantRet(t, "DeviceGetHandleByPciBusId", r, nvml.SUCCESS)
		if idx, _ := d.GetIndex(); idx != i {
			t.Errorf("%s is gpu %d, want %d", want, idx, i)
		}
	}
	if _, r := n.DeviceGetHandleByPciBusId("0000:01:00.0"); r != nvml.ERROR_NOT_FOUND {
		t.Errorf("domain 0: %v, want NOT_FOUND", r)
	}
}

func cString(b []int8) string {
	var s []byte
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}

// procDevicesMajor reads /proc/devices' way of listing a character device.
func procDevicesMajor(t *testing.T, path, name string) int {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	char := false
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		switch {
		case line == "Character devices:":
			char = true
		case line == "Block devices:":
			char = false
		case char:
			if num, dev, ok := strings.Cut(line, " "); ok && dev == name {
				m, err := strconv.Atoi(num)
				if err != nil {
					t.Fatalf("%s: %q", path, line)
				}
				return m
			}
		}
	}
	t.Fatalf("%s: no character device %s", path, name)
	return 0
}

func TestWriteDriverFiles(t *testing.T) {
	root := t.TempDir()
	n := newNode(t, "gb200-tray", WithIMEXChannels(5))
	if got := n.IMEXChannelCount(); got != 5 {
		t.Fatalf("IMEXChannelCount %d", got)
	}
	if err := n.WriteDriverFiles(root); err != nil {
		if strings.Contains(err.Error(), "CAP_MKNOD") {
			t.Skip(err)
		}
		t.Fatal(err)
	}
	major := procDevicesMajor(t, filepath.Join(root, ProcDevicesPath), "nvidia-caps-imex-channels")
	params, _ := os.ReadFile(filepath.Join(root, DriverParamsPath))
	if !strings.Contains(string(params), "ImexChannelCount: 5\n") {
		t.Errorf("params:\n%s", params)
	}
	if c, _ := os.ReadFile(filepath.Join(root, FabricIMEXMgmtCapPath)); !strings.Contains(string(c), "DeviceFileMinor: 512\n") {
		t.Errorf("fabric-imex-mgmt:\n%s", c)
	}
	check := func(count int) {
		t.Helper()
		entries, err := os.ReadDir(filepath.Join(root, IMEXChannelsDir))
		if err != nil || len(entries) != count {
			t.Fatalf("%d channel nodes (%v), want %d", len(entries), err, count)
		}
		for i := range count {
			var st unix.Stat_t
			p := filepath.Join(root, IMEXChannelsDir, "channel"+strconv.Itoa(i))
			if err := unix.Stat(p, &st); err != nil {
				t.Fatal(err)
			}
			if st.Mode&unix.S_IFMT != unix.S_IFCHR || st.Mode&0o777 != 0o666 ||
				int(unix.Major(uint64(st.Rdev))) != major || int(unix.Minor(uint64(st.Rdev))) != i {
				t.Errorf("%s: mode %o, %d:%d; want char 0666 %d:%d", p, st.Mode, unix.Major(uint64(st.Rdev)), unix.Minor(uint64(st.Rdev)), major, i)
			}
		}
	}
	check(5)
	// Written again with fewer channels, the extra nodes go.
	m := newNode(t, "gb200-tray", WithIMEXChannels(2))
	if err := m.WriteDriverFiles(root); err != nil {
		t.Fatal(err)
	}
	check(2)
	if _, err := New("gb200-tray", WithIMEXChannels(-1)); err == nil {
		t.Error("-1 IMEX channels accepted")
	}
	// Without a fabric there is no fabric-imex-mgmt capability.
	other := t.TempDir()
	if err := newNode(t, "dgx-h100", WithIMEXChannels(0)).WriteDriverFiles(other); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(other, FabricIMEXMgmtCapPath)); !os.IsNotExist(err) {
		t.Errorf("fabric-imex-mgmt on dgx-h100: %v", err)
	}
	if m := procDevicesMajor(t, filepath.Join(other, ProcDevicesPath), "nvidia-caps-imex-channels"); m != major {
		t.Errorf("dgx-h100 major %d", m)
	}
}
