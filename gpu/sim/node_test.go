package sim

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

func hasMethod(t reflect.Type, name string) bool {
	_, ok := t.MethodByName(name)
	return ok
}

func TestProfilesSortedAndBuildable(t *testing.T) {
	ps := Profiles()
	want := []string{"dgx-a100", "dgx-a100-80gb", "dgx-b200", "dgx-h100", "dgx-h100-mig", "dgx-h200", "dgx1-v100", "gb200-tray",
		"gh200", "gh200-144g", "pcie-4gpu", "pcie-8gpu", "pcie-a30x4", "pcie-h100nvl-x2", "two-islands-16"}
	var got []string
	for _, p := range ps {
		got = append(got, p.Name)
		if p.Description == "" || strings.Contains(p.Description, "\n") {
			t.Errorf("%s: description %q is not one line", p.Name, p.Description)
		}
		n, err := New(p.Name)
		if err != nil {
			t.Errorf("New(%q): %v", p.Name, err)
			continue
		}
		if n.Profile() != p.Name {
			t.Errorf("Profile() = %q, want %q", n.Profile(), p.Name)
		}
	}
	if !slices.Equal(got, want) {
		t.Errorf("Profiles() = %v, want %v", got, want)
	}
}

func TestNewUnknownProfileListsKnown(t *testing.T) {
	_, err := New("dgx-z900")
	if err == nil {
		t.Fatal("New(unknown) succeeded")
	}
	for _, p := range Profiles() {
		if !strings.Contains(err.Error(), p.Name) {
			t.Errorf("error %q does not list %s", err, p.Name)
		}
	}
}

func TestIdentity(t *testing.T) {
	tests := []struct {
		profile string
		count   int
		name    string
		memMiB  uint64
		cc      [2]int
		numa    []int
		bus0    string
		arch    nvml.DeviceArchitecture
	}{
		{"dgx-a100", 8, "NVIDIA A100-SXM4-40GB", 40960, [2]int{8, 0}, []int{3, 3, 1, 1, 7, 7, 5, 5}, "00000000:07:00.0", nvml.DEVICE_ARCH_AMPERE},
		{"dgx-h100", 8, "NVIDIA H100 80GB HBM3", 81559, [2]int{9, 0}, []int{0, 0, 0, 0, 1, 1, 1, 1}, "00000000:18:00.0", nvml.DEVICE_ARCH_HOPPER},
		{"dgx1-v100", 8, "Tesla V100-SXM2-32GB", 32768, [2]int{7, 0}, []int{0, 0, 0, 0, 1, 1, 1, 1}, "00000000:06:00.0", nvml.DEVICE_ARCH_VOLTA},
		{"pcie-8gpu", 8, "NVIDIA L40S", 46068, [2]int{8, 9}, []int{0, 0, 0, 0, 1, 1, 1, 1}, "00000000:1B:00.0", nvml.DEVICE_ARCH_ADA},
		{"pcie-4gpu", 4, "NVIDIA L40S", 46068, [2]int{8, 9}, []int{0, 0, 1, 1}, "00000000:41:00.0", nvml.DEVICE_ARCH_ADA},
		{"dgx-a100-80gb", 8, "NVIDIA A100-SXM4-80GB", 81920, [2]int{8, 0}, []int{3, 3, 1, 1, 7, 7, 5, 5}, "00000000:07:00.0", nvml.DEVICE_ARCH_AMPERE},
		{"dgx-h200", 8, "NVIDIA H200", 143771, [2]int{9, 0}, []int{0, 0, 0, 0, 1, 1, 1, 1}, "00000000:18:00.0", nvml.DEVICE_ARCH_HOPPER},
		{"dgx-b200", 8, "NVIDIA B200", 183359, [2]int{10, 0}, []int{0, 0, 0, 0, 1, 1, 1, 1}, "00000000:1B:00.0", nvml.DEVICE_ARCH_BLACKWELL},
		{"pcie-a30x4", 4, "NVIDIA A30", 24576, [2]int{8, 0}, []int{0, 0, 1, 1}, "00000000:41:00.0", nvml.DEVICE_ARCH_AMPERE},
		{"pcie-h100nvl-x2", 2, "NVIDIA H100 NVL", 95830, [2]int{9, 0}, []int{0, 0}, "00000000:41:00.0", nvml.DEVICE_ARCH_HOPPER},
		{"gh200", 1, "NVIDIA GH200 480GB", 97871, [2]int{9, 0}, []int{0}, "00000000:01:00.0", nvml.DEVICE_ARCH_HOPPER},
		{"gh200-144g", 1, "NVIDIA GH200 144G HBM3e", 146511, [2]int{9, 0}, []int{0}, "00000000:01:00.0", nvml.DEVICE_ARCH_HOPPER},
		{"two-islands-16", 16, "Tesla V100-SXM2-32GB", 32768, [2]int{7, 0},
			[]int{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1}, "00000000:06:00.0", nvml.DEVICE_ARCH_VOLTA},
	}
	for _, tt := range tests {
		t.Run(tt.profile, func(t *testing.T) {
			n := newNode(t, tt.profile)
			count, r := n.DeviceGetCount()
			wantRet(t, "DeviceGetCount", r, nvml.SUCCESS)
			if count != tt.count {
				t.Fatalf("count = %d, want %d", count, tt.count)
			}
			seenBus := map[string]bool{}
			seenUUID := map[string]bool{}
			for i := range count {
				d := handle(t, n, i)
				name, _ := d.GetName()
				mem, _ := d.GetMemoryInfo()
				major, minor, _ := d.GetCudaComputeCapability()
				numa, _ := d.GetNumaNodeId()
				minorNum, _ := d.GetMinorNumber()
				idx, _ := d.GetIndex()
				arch, _ := d.GetArchitecture()
				uuid, _ := d.GetUUID()
				pci, r := d.GetPciInfo()
				wantRet(t, "GetPciInfo", r, nvml.SUCCESS)
				bus := cstr(pci.BusId[:])
				// Idle: only the reserved memory is in use.
				mem2, _ := d.GetMemoryInfo_v2()
				if mem2.Reserved == 0 || mem2.Used != 0 || mem.Used != mem2.Reserved || mem.Free+mem.Used != mem.Total {
					t.Errorf("gpu %d: idle memory %+v, v2 %+v", i, mem, mem2)
				}
				if name != tt.name || mem.Total != tt.memMiB<<20 || [2]int{major, minor} != tt.cc ||
					numa != tt.numa[i] || minorNum != i || idx != i || arch != tt.arch {
					t.Errorf("gpu %d: name %q mem %d cc %d.%d numa %d minor %d index %d arch %d", i, name, mem.Total, major, minor, numa, minorNum, idx, arch)
				}
				if i == 0 && bus != tt.bus0 {
					t.Errorf("gpu 0 bus id %q, want %q", bus, tt.bus0)
				}
				legacy := cstr(pci.BusIdLegacy[:])
				if legacy != bus[4:] || pci.Bus == 0 || pci.PciDeviceId&0xFFFF != 0x10DE {
					t.Errorf("gpu %d: legacy %q bus %#x device id %#x", i, legacy, pci.Bus, pci.PciDeviceId)
				}
				if seenBus[bus] || seenUUID[uuid] || !strings.HasPrefix(uuid, "GPU-") {
					t.Errorf("gpu %d: bus %q / uuid %q repeated or malformed", i, bus, uuid)
				}
				seenBus[bus], seenUUID[uuid] = true, true
				for _, id := range []string{bus, strings.ToLower(bus), legacy, bus[9:]} {
					if h, r := n.DeviceGetHandleByPciBusId(id); r != nvml.SUCCESS || h != d {
						t.Errorf("DeviceGetHandleByPciBusId(%q) = %v, %v", id, h, r)
					}
				}
				if h, r := n.DeviceGetHandleByUUID(uuid); r != nvml.SUCCESS || h != d {
					t.Errorf("DeviceGetHandleByUUID(%q) = %v, %v", uuid, h, r)
				}
			}
			_, r = n.DeviceGetHandleByIndex(count)
			wantRet(t, "handle past the end", r, nvml.ERROR_INVALID_ARGUMENT)
			_, r = n.DeviceGetHandleByUUID("GPU-00000000-0000-0000-0000-000000000000")
			wantRet(t, "unknown uuid", r, nvml.ERROR_NOT_FOUND)
			_, r = n.DeviceGetHandleByPciBusId("0000:ff:1f.0")
			wantRet(t, "unknown bus", r, nvml.ERROR_NOT_FOUND)
			_, r = n.DeviceGetHandleByPciBusId("bogus")
			wantRet(t, "bad bus id", r, nvml.ERROR_INVALID_ARGUMENT)
		})
	}
}

// TestPCIIDs pins each model's PCI device and subsystem ids: the device
// ids are what the GPU Operator's default mig-parted config filters on.
func TestPCIIDs(t *testing.T) {
	for _, tt := range []struct {
		profile           string
		device, subsystem uint32
	}{
		{"dgx-a100", 0x20B010DE, 0x134F10DE},
		{"dgx-a100-80gb", 0x20B210DE, 0x147F10DE},
		{"pcie-a30x4", 0x20B710DE, 0x153210DE},
		{"dgx-h100", 0x233010DE, 0x16C110DE},
		{"pcie-h100nvl-x2", 0x232110DE, 0x183910DE},
		{"dgx-h200", 0x233510DE, 0x18BE10DE},
		{"gh200", 0x234210DE, 0x180910DE},
		{"gh200-144g", 0x234810DE, 0x18D210DE},
		{"dgx-b200", 0x290110DE, 0x199910DE},
	} {
		pci, r := handle(t, newNode(t, tt.profile), 0).GetPciInfo()
		if r != nvml.SUCCESS || pci.PciDeviceId != tt.device || pci.PciSubSystemId != tt.subsystem {
			t.Errorf("%s: device %#x subsystem %#x, %v; want %#x %#x", tt.profile, pci.PciDeviceId, pci.PciSubSystemId, r, tt.device, tt.subsystem)
		}
	}
}

func cstr(b []int8) string {
	var s []byte
	for _, c := range b {
		if c == 0 {
			break
		}
		s = append(s, byte(c))
	}
	return string(s)
}

func TestStableUUIDs(t *testing.T) {
	build := func() (gpus []string, mig string) {
		n := newNode(t, "dgx-a100", WithMIGEnabled())
		for i := range 8 {
			u, _ := handle(t, n, i).GetUUID()
			gpus = append(gpus, u)
		}
		d := handle(t, n, 2)
		createFullCI(t, createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4))
		m, r := d.GetMigDeviceHandleByIndex(0)
		wantRet(t, "GetMigDeviceHandleByIndex", r, nvml.SUCCESS)
		mig, _ = m.GetUUID()
		return gpus, mig
	}
	g1, m1 := build()
	g2, m2 := build()
	if !slices.Equal(g1, g2) || m1 != m2 {
		t.Errorf("UUIDs differ between constructions:\n%v %s\n%v %s", g1, m1, g2, m2)
	}
	if !strings.HasPrefix(m1, "MIG-") || slices.Contains(g1, "GPU-"+m1[4:]) {
		t.Errorf("MIG uuid %q malformed or reuses a GPU uuid", m1)
	}
	other := newNode(t, "dgx-h100")
	if u, _ := handle(t, other, 0).GetUUID(); u == g1[0] {
		t.Errorf("two profiles share uuid %s", u)
	}
}

func TestTopologyLevels(t *testing.T) {
	const (
		pix = nvml.TOPOLOGY_SINGLE
		pxb = nvml.TOPOLOGY_MULTIPLE
		phb = nvml.TOPOLOGY_HOSTBRIDGE
		nod = nvml.TOPOLOGY_NODE
		sys = nvml.TOPOLOGY_SYSTEM
	)
	tests := []struct {
		profile string
		i, j    int
		want    nvml.GpuTopologyLevel
	}{
		{"dgx-a100", 0, 1, pxb}, {"dgx-a100", 0, 2, sys}, {"dgx-a100", 6, 7, pxb}, {"dgx-a100", 3, 3, nvml.TOPOLOGY_INTERNAL},
		{"dgx-h100", 4, 5, pxb}, {"dgx-h100", 1, 2, sys},
		{"dgx-a100-80gb", 0, 1, pxb}, {"dgx-a100-80gb", 0, 2, sys}, {"dgx-h200", 4, 5, pxb}, {"dgx-h200", 1, 2, sys},
		{"dgx-b200", 2, 3, pxb}, {"dgx-b200", 3, 4, sys}, {"pcie-a30x4", 2, 3, pix}, {"pcie-a30x4", 1, 2, sys},
		{"pcie-h100nvl-x2", 0, 1, pix}, {"gh200", 0, 0, nvml.TOPOLOGY_INTERNAL}, {"gh200-144g", 0, 0, nvml.TOPOLOGY_INTERNAL},
		{"dgx1-v100", 2, 3, pix}, {"dgx1-v100", 0, 3, phb}, {"dgx1-v100", 3, 4, sys},
		{"pcie-8gpu", 4, 5, pix}, {"pcie-8gpu", 4, 7, nod}, {"pcie-8gpu", 0, 7, sys},
		{"pcie-4gpu", 0, 1, pix}, {"pcie-4gpu", 1, 2, sys},
		{"two-islands-16", 8, 9, pix}, {"two-islands-16", 8, 11, pxb}, {"two-islands-16", 8, 15, nod}, {"two-islands-16", 7, 8, sys},
	}
	for _, tt := range tests {
		n := newNode(t, tt.profile)
		a, b := handle(t, n, tt.i), handle(t, n, tt.j)
		for _, dir := range [][2]nvml.Device{{a, b}, {b, a}} {
			got, r := dir[0].GetTopologyCommonAncestor(dir[1])
			if r != nvml.SUCCESS || got != tt.want {
				t.Errorf("%s %d-%d: %v, %v; want %v", tt.profile, tt.i, tt.j, got, r, tt.want)
			}
		}
	}
	n := newNode(t, "dgx-a100")
	foreign := newNode(t, "dgx-a100")
	_, r := handle(t, n, 0).GetTopologyCommonAncestor(handle(t, foreign, 1))
	wantRet(t, "handle of another node", r, nvml.ERROR_INVALID_ARGUMENT)
	near, r := handle(t, n, 0).GetTopologyNearestGpus(pxb)
	if r != nvml.SUCCESS || len(near) != 1 || near[0] != handle(t, n, 1) {
		t.Errorf("GetTopologyNearestGpus(PXB) = %v, %v; want GPU 1", near, r)
	}
}

// lanes counts GPU i's lanes to each peer GPU and to each switch bus.
func lanes(t *testing.T, n *Node, i int) (peers map[int]int, switches map[string]int) {
	t.Helper()
	d := handle(t, n, i)
	peers, switches = map[int]int{}, map[string]int{}
	for link := 0; ; link++ {
		state, r := d.GetNvLinkState(link)
		if r == nvml.ERROR_NOT_SUPPORTED || r == nvml.ERROR_INVALID_ARGUMENT {
			return peers, switches
		}
		if r != nvml.SUCCESS || state != nvml.FEATURE_ENABLED {
			t.Fatalf("gpu %d link %d: %v %v", i, link, state, r)
		}
		typ, r1 := d.GetNvLinkRemoteDeviceType(link)
		pci, r2 := d.GetNvLinkRemotePciInfo(link)
		if r1 != nvml.SUCCESS || r2 != nvml.SUCCESS {
			t.Fatalf("gpu %d link %d: %v %v", i, link, r1, r2)
		}
		bus := cstr(pci.BusId[:])
		switch typ {
		case nvml.NVLINK_DEVICE_TYPE_SWITCH:
			switches[bus]++
		case nvml.NVLINK_DEVICE_TYPE_GPU:
			peer, r := n.DeviceGetHandleByPciBusId(bus)
			if r != nvml.SUCCESS {
				t.Fatalf("gpu %d link %d: remote %q: %v", i, link, bus, r)
			}
			j, _ := peer.GetIndex()
			peers[j]++
		default:
			t.Fatalf("gpu %d link %d: remote type %v", i, link, typ)
		}
	}
}

func TestNVLinkCubeMesh(t *testing.T) {
	for _, profile := range []string{"dgx1-v100", "two-islands-16"} {
		n := newNode(t, profile)
		count, _ := n.DeviceGetCount()
		want := make([]map[int]int, count)
		for i := range want {
			want[i] = map[int]int{}
		}
		for base := 0; base < count; base += 8 {
			for _, e := range cubeMesh {
				want[base+e[0]][base+e[1]] = e[2]
				want[base+e[1]][base+e[0]] = e[2]
			}
		}
		for i := range count {
			peers, switches := lanes(t, n, i)
			if len(switches) != 0 || !reflect.DeepEqual(peers, want[i]) {
				t.Errorf("%s gpu %d: peers %v switches %v, want %v", profile, i, peers, switches, want[i])
			}
		}
	}
}

func TestNVSwitchLanes(t *testing.T) {
	tests := []struct {
		profile   string
		perSwitch []int
	}{
		{"dgx-a100", []int{2, 2, 2, 2, 2, 2}},
		{"dgx-h100", []int{5, 4, 4, 5}},
		{"dgx-a100-80gb", []int{2, 2, 2, 2, 2, 2}},
		{"dgx-h200", []int{5, 4, 4, 5}},
		{"dgx-b200", []int{9, 9}},
	}
	for _, tt := range tests {
		n := newNode(t, tt.profile)
		var first map[string]int
		for i := range 8 {
			peers, switches := lanes(t, n, i)
			var counts []int
			for _, c := range switches {
				counts = append(counts, c)
			}
			slices.Sort(counts)
			want := slices.Sorted(slices.Values(tt.perSwitch))
			if len(peers) != 0 || !slices.Equal(counts, want) {
				t.Errorf("%s gpu %d: peers %v, lanes per switch %v, want %v", tt.profile, i, peers, counts, want)
			}
			if first == nil {
				first = switches
			} else if !reflect.DeepEqual(first, switches) {
				t.Errorf("%s gpu %d reaches switches %v, gpu 0 %v", tt.profile, i, switches, first)
			}
		}
	}
}

func TestNVLinkIndexErrors(t *testing.T) {
	tests := []struct {
		profile string
		link    int
		want    nvml.Return
	}{
		{"dgx1-v100", 5, nvml.SUCCESS},
		{"dgx1-v100", 6, nvml.ERROR_NOT_SUPPORTED},
		{"dgx-h100", 17, nvml.SUCCESS},
		{"dgx-a100", 12, nvml.ERROR_NOT_SUPPORTED},
		{"dgx-a100", nvml.NVLINK_MAX_LINKS, nvml.ERROR_INVALID_ARGUMENT},
		{"dgx-a100", -1, nvml.ERROR_INVALID_ARGUMENT},
		{"pcie-4gpu", 0, nvml.ERROR_NOT_SUPPORTED},
		{"dgx-b200", 17, nvml.SUCCESS},
		{"dgx-b200", 18, nvml.ERROR_NOT_SUPPORTED},
		{"pcie-a30x4", 0, nvml.ERROR_NOT_SUPPORTED},
	}
	for _, tt := range tests {
		n := newNode(t, tt.profile)
		_, r := handle(t, n, 0).GetNvLinkState(tt.link)
		wantRet(t, fmt.Sprintf("%s link %d", tt.profile, tt.link), r, tt.want)
	}
}

func TestUninitialized(t *testing.T) {
	n, err := New("pcie-4gpu")
	if err != nil {
		t.Fatal(err)
	}
	_, r := n.DeviceGetCount()
	wantRet(t, "DeviceGetCount before Init", r, nvml.ERROR_UNINITIALIZED)
	wantRet(t, "Shutdown before Init", n.Shutdown(), nvml.ERROR_UNINITIALIZED)
	n.Init()
	n.Init()
	d := handle(t, n, 0)
	n.Shutdown()
	if _, r := d.GetName(); r != nvml.SUCCESS {
		t.Errorf("GetName with one Init left: %v", r)
	}
	n.Shutdown()
	_, r = d.GetName()
	wantRet(t, "GetName after last Shutdown", r, nvml.ERROR_UNINITIALIZED)
	_, r = d.GetFanSpeed() // not modelled
	wantRet(t, "unmodelled call after Shutdown", r, nvml.ERROR_UNINITIALIZED)
	_, r = n.SystemGetDriverVersion()
	wantRet(t, "SystemGetDriverVersion after Shutdown", r, nvml.ERROR_UNINITIALIZED)
	_, r = n.GetExcludedDeviceCount() // not modelled
	wantRet(t, "unmodelled library call after Shutdown", r, nvml.ERROR_UNINITIALIZED)
}

func TestSystemAndUnmodelledCalls(t *testing.T) {
	n := newNode(t, "dgx-h100")
	if v, r := n.SystemGetDriverVersion(); r != nvml.SUCCESS || v != driverVersion {
		t.Errorf("driver version %q, %v", v, r)
	}
	if v, r := n.SystemGetCudaDriverVersion(); r != nvml.SUCCESS || v != 12040 {
		t.Errorf("cuda version %d, %v", v, r)
	}
	d := handle(t, n, 0)
	if _, r := d.GetFanSpeed(); r != nvml.ERROR_NOT_SUPPORTED {
		t.Errorf("unmodelled device call: %v", r)
	}
	if _, r := n.GetExcludedDeviceCount(); r != nvml.ERROR_NOT_SUPPORTED {
		t.Errorf("unmodelled library call: %v", r)
	}
	if err := n.Extensions().LookupSymbol("nvmlDeviceGetMigMode"); err != nil {
		t.Errorf("LookupSymbol: %v", err)
	}
}

// The library-style functions (lib.DeviceGetName(d)) must agree with the
// handle methods, as in go-nvml's real library.
func TestInterfaceForwardsToHandles(t *testing.T) {
	n := newNode(t, "dgx-a100", WithMIGEnabled())
	d := handle(t, n, 1)
	want, _ := d.GetName()
	if got, r := n.DeviceGetName(d); r != nvml.SUCCESS || got != want {
		t.Errorf("DeviceGetName = %q, %v; want %q", got, r, want)
	}
	lvl, r := n.DeviceGetTopologyCommonAncestor(d, handle(t, n, 0))
	if r != nvml.SUCCESS || lvl != nvml.TOPOLOGY_MULTIPLE {
		t.Errorf("DeviceGetTopologyCommonAncestor = %v, %v", lvl, r)
	}
	gi := createGI(t, d, nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0)
	if info, r := n.GpuInstanceGetInfo(gi); r != nvml.SUCCESS || info.Id != 1 {
		t.Errorf("GpuInstanceGetInfo = %+v, %v", info, r)
	}
	if _, r := n.DeviceGetName(nil); r != nvml.ERROR_INVALID_ARGUMENT {
		t.Errorf("DeviceGetName(nil): %v", r)
	}
}

// Modelled calls must reach the sim's own methods, not the go-nvml mock,
// which records every call and would grow without bound; and every method
// the sim's handles declare must be one of NVML's (a typo would otherwise
// leave the real call answered NOT_SUPPORTED).
func TestHandlesShadowMocks(t *testing.T) {
	// Methods the mock lacks are the sim's own; they must all be NVML's.
	checks := []struct {
		typ, mock reflect.Type
	}{
		{reflect.TypeFor[*device](), reflect.TypeFor[*mock.Device]()},
		{reflect.TypeFor[*gpuInstance](), reflect.TypeFor[*mock.GpuInstance]()},
		{reflect.TypeFor[*computeInstance](), reflect.TypeFor[*mock.ComputeInstance]()},
		{reflect.TypeFor[*eventSet](), reflect.TypeFor[*mock.EventSet]()},
	}
	// Extensions NVML's Go binding cannot carry: GetGpuFabricInfoV3 stands
	// in for the GetGpuFabricInfoV handler, which only the real library
	// can answer.
	own := map[string]bool{"GetGpuFabricInfoV3": true}
	for _, c := range checks {
		for i := range c.typ.NumMethod() {
			if name := c.typ.Method(i).Name; !hasMethod(c.mock, name) && !own[name] {
				t.Errorf("%v declares %s, which is not an NVML method", c.typ, name)
			}
		}
	}
	n := newNode(t, "pcie-4gpu")
	d := handle(t, n, 0).(*device)
	d.GetName()
	d.GetUtilizationRates()
	n.DeviceGetCount()
	if c := len(d.Device.GetNameCalls()) + len(d.Device.GetUtilizationRatesCalls()) + len(n.Interface.DeviceGetCountCalls()); c != 0 {
		t.Errorf("modelled calls reached the recording mock %d times", c)
	}
}
