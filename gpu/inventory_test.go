package gpu_test

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock/dgxa100"

	"github.com/gpu-agent/gpu-agent/gpu"
)

func newInventory(t *testing.T, n *fakeNode, opts gpu.Options) *gpu.Inventory {
	t.Helper()
	inv, err := gpu.New(n.lib(t), opts)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	return inv
}

func plainGPU(i int) fakeGPU {
	return fakeGPU{
		uuid:   fmt.Sprintf("GPU-%04d", i),
		name:   "NVIDIA A100-SXM4-40GB",
		memMiB: 40960,
		bus:    fmt.Sprintf("00000000:%02X:00.0", 0x07+0x10*i),
		minor:  i,
		numa:   i / 4,
		cc:     [2]int{8, 0},
		mig:    on(false, false),
	}
}

func plainNode(n int) *fakeNode {
	node := &fakeNode{driver: "550.54.15"}
	for i := range n {
		node.gpus = append(node.gpus, plainGPU(i))
	}
	return node
}

func indexes(inv *gpu.Inventory) []int {
	var out []int
	for _, g := range inv.GPUs {
		out = append(out, g.Index)
	}
	return out
}

func calls(inv *gpu.Inventory) []string {
	var out []string
	for _, e := range inv.Errors {
		out = append(out, fmt.Sprintf("%d/%s/%s", e.Index, e.Call, e.Err))
	}
	return out
}

func TestNewReadsGPUFields(t *testing.T) {
	node := plainNode(2)
	node.gpus[1].mig = on(false, true)
	node.gpus[1].numa = 1
	inv := newInventory(t, node, gpu.Options{})

	want := []gpu.GPU{
		{Index: 0, UUID: "GPU-0000", Name: "NVIDIA A100-SXM4-40GB", MemoryBytes: 40960 << 20, PCIBusID: "0000:07:00.0",
			PCIeRoot: "pci0000:07", Brand: "Nvidia",
			Minor: 0, NUMANode: 0, ComputeCapability: gpu.ComputeCapability{Major: 8}, MIGCapable: true},
		{Index: 1, UUID: "GPU-0001", Name: "NVIDIA A100-SXM4-40GB", MemoryBytes: 40960 << 20, PCIBusID: "0000:17:00.0",
			PCIeRoot: "pci0000:17", Brand: "Nvidia",
			Minor: 1, NUMANode: 1, ComputeCapability: gpu.ComputeCapability{Major: 8}, MIGCapable: true,
			MIG: gpu.MIGMode{Pending: true}},
	}
	if !reflect.DeepEqual(inv.GPUs, want) {
		t.Errorf("GPUs:\n got %+v\nwant %+v", inv.GPUs, want)
	}
	if inv.DriverVersion != "550.54.15" || inv.CUDADriverVersion != "12.8" {
		t.Errorf("DriverVersion = %q, CUDADriverVersion = %q", inv.DriverVersion, inv.CUDADriverVersion)
	}
	if len(inv.Errors) != 0 {
		t.Errorf("Errors = %v, want none", inv.Errors)
	}
}

func TestNewNUMA(t *testing.T) {
	node := plainNode(3)
	node.gpus[2].fail = map[string]nvml.Return{"GetNumaNodeId": nvml.ERROR_NOT_SUPPORTED}

	t.Run("nvml", func(t *testing.T) {
		inv := newInventory(t, node, gpu.Options{})
		if got := []int{inv.GPUs[0].NUMANode, inv.GPUs[1].NUMANode, inv.GPUs[2].NUMANode}; !slices.Equal(got, []int{0, 0, -1}) {
			t.Errorf("NUMA = %v, want [0 0 -1]", got)
		}
		if len(inv.Errors) != 0 {
			t.Errorf("NOT_SUPPORTED is an answer, not an error; Errors = %v", inv.Errors)
		}
	})
	t.Run("option", func(t *testing.T) {
		var asked []string
		inv := newInventory(t, node, gpu.Options{NUMANode: func(bus string) (int, error) {
			asked = append(asked, bus)
			if bus == "0000:17:00.0" {
				return -1, fmt.Errorf("no such file")
			}
			return 3, nil
		}})
		if want := []string{"0000:07:00.0", "0000:17:00.0", "0000:27:00.0"}; !slices.Equal(asked, want) {
			t.Errorf("asked for %v, want sysfs-form %v", asked, want)
		}
		if got := []int{inv.GPUs[0].NUMANode, inv.GPUs[1].NUMANode, inv.GPUs[2].NUMANode}; !slices.Equal(got, []int{3, -1, 3}) {
			t.Errorf("NUMA = %v, want [3 -1 3]", got)
		}
		if len(inv.Errors) != 1 || inv.Errors[0].Index != 1 || !strings.Contains(inv.Errors[0].Err, "no such file") {
			t.Errorf("Errors = %v, want the lookup failure of gpu 1", inv.Errors)
		}
	})
}

func TestNewFailures(t *testing.T) {
	tests := []struct {
		name string
		gpu  int // which GPU fails
		fail map[string]nvml.Return
		// wantGPUs are the NVML indexes left in the inventory.
		wantGPUs   []int
		wantErrors []string
		// check, if set, looks further at the failing GPU's entry.
		check func(t *testing.T, inv *gpu.Inventory)
	}{
		{
			name:       "uuid unknown error",
			gpu:        1,
			fail:       map[string]nvml.Return{"GetUUID": nvml.ERROR_UNKNOWN},
			wantGPUs:   []int{0, 2},
			wantErrors: []string{"1/GetUUID/ERROR_UNKNOWN"},
		},
		{
			name:       "handle",
			gpu:        0,
			fail:       map[string]nvml.Return{"DeviceGetHandleByIndex": nvml.ERROR_UNKNOWN},
			wantGPUs:   []int{1, 2},
			wantErrors: []string{"0/DeviceGetHandleByIndex/ERROR_UNKNOWN"},
		},
		{
			name:       "lost on memory",
			gpu:        2,
			fail:       map[string]nvml.Return{"GetMemoryInfo": nvml.ERROR_GPU_IS_LOST},
			wantGPUs:   []int{0, 1},
			wantErrors: []string{"2/GetMemoryInfo/ERROR_GPU_IS_LOST"},
			check: func(t *testing.T, inv *gpu.Inventory) {
				if inv.Errors[0].UUID != "GPU-0002" {
					t.Errorf("error names UUID %q, want GPU-0002", inv.Errors[0].UUID)
				}
			},
		},
		{
			// A lost GPU is left out even when the call that notices is optional.
			name:       "lost on mig mode",
			gpu:        1,
			fail:       map[string]nvml.Return{"GetMigMode": nvml.ERROR_GPU_IS_LOST},
			wantGPUs:   []int{0, 2},
			wantErrors: []string{"1/GetMigMode/ERROR_GPU_IS_LOST"},
		},
		{
			name:       "minor",
			gpu:        1,
			fail:       map[string]nvml.Return{"GetMinorNumber": nvml.ERROR_NO_PERMISSION},
			wantGPUs:   []int{0, 2},
			wantErrors: []string{"1/GetMinorNumber/ERROR_NO_PERMISSION"},
		},
		{
			// Optional facts degrade to unknown and are reported; the GPU stays.
			name:       "compute capability",
			gpu:        1,
			fail:       map[string]nvml.Return{"GetCudaComputeCapability": nvml.ERROR_UNKNOWN},
			wantGPUs:   []int{0, 1, 2},
			wantErrors: []string{"1/GetCudaComputeCapability/ERROR_UNKNOWN"},
			check: func(t *testing.T, inv *gpu.Inventory) {
				if cc := inv.GPUs[1].ComputeCapability; cc != (gpu.ComputeCapability{}) {
					t.Errorf("compute capability = %v, want unknown 0.0", cc)
				}
			},
		},
		{
			name:       "mig mode unknown error",
			gpu:        0,
			fail:       map[string]nvml.Return{"GetMigMode": nvml.ERROR_UNKNOWN},
			wantGPUs:   []int{0, 1, 2},
			wantErrors: []string{"0/GetMigMode/ERROR_UNKNOWN"},
			check: func(t *testing.T, inv *gpu.Inventory) {
				if inv.GPUs[0].MIGCapable {
					t.Error("GPU whose MIG mode could not be read is MIG capable")
				}
				// ... and its false MIGCapable says unknown, not "no MIG".
				if !inv.GPUs[0].Unknown(gpu.FactMIGMode) {
					t.Errorf("Unread = %v, want the MIG mode in it", inv.GPUs[0].Unread)
				}
			},
		},
		{
			name:       "topology pair",
			gpu:        0,
			fail:       map[string]nvml.Return{"GetTopologyCommonAncestor": nvml.ERROR_UNKNOWN},
			wantGPUs:   []int{0, 1, 2},
			wantErrors: []string{"0/GetTopologyCommonAncestor(gpu 1)/ERROR_UNKNOWN", "0/GetTopologyCommonAncestor(gpu 2)/ERROR_UNKNOWN"},
			check: func(t *testing.T, inv *gpu.Inventory) {
				lv := inv.Topology.Level
				if lv[0][1] != gpu.LevelSystem || lv[1][0] != gpu.LevelSystem {
					t.Errorf("failed pair level = %v/%v, want SYS", lv[0][1], lv[1][0])
				}
				if lv[1][2] != gpu.LevelSingle {
					t.Errorf("healthy pair level = %v, want PIX", lv[1][2])
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			node := plainNode(3)
			node.level = func(i, j int) nvml.GpuTopologyLevel { return nvml.TOPOLOGY_SINGLE }
			node.gpus[tt.gpu].fail = tt.fail
			inv := newInventory(t, node, gpu.Options{})
			if got := indexes(inv); !slices.Equal(got, tt.wantGPUs) {
				t.Errorf("GPUs = %v, want %v", got, tt.wantGPUs)
			}
			if got := calls(inv); !slices.Equal(got, tt.wantErrors) {
				t.Errorf("Errors = %q, want %q", got, tt.wantErrors)
			}
			if n := inv.Topology.Len(); n != len(tt.wantGPUs) {
				t.Errorf("topology covers %d GPUs, want %d", n, len(tt.wantGPUs))
			}
			if tt.check != nil {
				tt.check(t, inv)
			}
		})
	}
}

func TestNewLeftOutGPUKeepsTopologyAligned(t *testing.T) {
	// GPU 1 fails; positions in Topology must follow Inventory.GPUs, not NVML
	// indexes: GPUs 0 and 2 are position 0 and 1.
	node := plainNode(3)
	node.gpus[1].fail = map[string]nvml.Return{"GetName": nvml.ERROR_UNKNOWN}
	node.level = func(i, j int) nvml.GpuTopologyLevel {
		if min(i, j) == 0 && max(i, j) == 2 {
			return nvml.TOPOLOGY_HOSTBRIDGE
		}
		return nvml.TOPOLOGY_SYSTEM
	}
	node.gpus[0].links = []fakeLink{{typ: nvml.NVLINK_DEVICE_TYPE_GPU, remote: node.gpus[2].bus}}
	inv := newInventory(t, node, gpu.Options{})
	if got := inv.Topology.Level[0][1]; got != gpu.LevelHostBridge {
		t.Errorf("level between GPU0 and GPU2 = %v, want PHB", got)
	}
	if got := inv.Topology.DirectLanes[0][1]; got != 1 {
		t.Errorf("lanes GPU0→GPU2 = %d, want 1", got)
	}
}

func TestNewDeviceCountFails(t *testing.T) {
	node := plainNode(1)
	node.countRet = nvml.ERROR_UNINITIALIZED
	inv, err := gpu.New(node.lib(t), gpu.Options{})
	if err == nil {
		t.Fatalf("New = %+v, want error", inv)
	}
	if !strings.Contains(err.Error(), "DeviceGetCount") {
		t.Errorf("error %q does not name the call", err)
	}
}

func TestNewNoGPUs(t *testing.T) {
	inv := newInventory(t, plainNode(0), gpu.Options{})
	if inv.GPUs == nil || len(inv.GPUs) != 0 || inv.Topology.Len() != 0 {
		t.Errorf("empty node: GPUs=%#v topology len %d", inv.GPUs, inv.Topology.Len())
	}
}

func TestNewNVLink(t *testing.T) {
	bus := func(i int) string { return plainGPU(i).bus }
	toGPU := func(i int) fakeLink { return fakeLink{typ: nvml.NVLINK_DEVICE_TYPE_GPU, remote: bus(i)} }
	toSwitch := func(s string) fakeLink { return fakeLink{typ: nvml.NVLINK_DEVICE_TYPE_SWITCH, remote: s} }
	rep := func(l fakeLink, n int) []fakeLink { return slices.Repeat([]fakeLink{l}, n) }
	const swA, swB, swC = "00000000:C1:00.0", "00000000:C2:00.0", "00000000:C3:00.0"

	tests := []struct {
		name   string
		links  [][]fakeLink // per GPU
		direct [][]int
		sw     []int
		fabric []int
		// lanes are checked with Topology.Lanes: {i, j, want}.
		lanes  [][3]int
		errors []string
	}{
		{
			name: "direct lanes",
			links: [][]fakeLink{
				append(rep(toGPU(1), 2), toGPU(2)),
				rep(toGPU(0), 2),
				{toGPU(0), {down: true, typ: nvml.NVLINK_DEVICE_TYPE_GPU, remote: bus(1)}},
			},
			direct: [][]int{{0, 2, 1}, {2, 0, 0}, {1, 0, 0}},
			sw:     []int{0, 0, 0},
			fabric: []int{-1, -1, -1},
			lanes:  [][3]int{{0, 1, 2}, {0, 2, 1}, {1, 2, 0}, {2, 1, 0}},
		},
		{
			// GPU0 and GPU1 share switch A; GPU2 reaches B, GPU3 reaches B and C,
			// GPU4 only C: 2, 3 and 4 are one fabric through GPU3.
			name: "switch fabrics",
			links: [][]fakeLink{
				rep(toSwitch(swA), 4),
				rep(toSwitch(swA), 3),
				rep(toSwitch(swB), 2),
				append(rep(toSwitch(swB), 2), rep(toSwitch(swC), 2)...),
				rep(toSwitch(swC), 2),
				nil,
			},
			direct: [][]int{make([]int, 6), make([]int, 6), make([]int, 6), make([]int, 6), make([]int, 6), make([]int, 6)},
			sw:     []int{4, 3, 2, 4, 2, 0},
			fabric: []int{0, 0, 1, 1, 1, -1},
			lanes:  [][3]int{{0, 1, 3}, {1, 0, 3}, {2, 4, 2}, {3, 4, 2}, {0, 2, 0}, {4, 5, 0}},
		},
		{
			name: "direct plus switch",
			links: [][]fakeLink{
				append(rep(toSwitch(swA), 2), toGPU(1)),
				append(rep(toSwitch(swA), 2), toGPU(0)),
			},
			direct: [][]int{{0, 1}, {1, 0}},
			sw:     []int{2, 2},
			fabric: []int{0, 0},
			lanes:  [][3]int{{0, 1, 3}},
		},
		{
			// Older drivers cannot name the remote device type: a remote bus
			// id that is one of our GPUs counts, anything else is ignored.
			name: "old driver",
			links: [][]fakeLink{
				{
					{typRet: nvml.ERROR_NOT_SUPPORTED, remote: bus(1)},
					{typRet: nvml.ERROR_NOT_SUPPORTED, remote: bus(1)},
					{typRet: nvml.ERROR_NOT_SUPPORTED, remote: swA},
				},
				nil,
			},
			direct: [][]int{{0, 2}, {0, 0}},
			sw:     []int{0, 0},
			fabric: []int{-1, -1},
			lanes:  [][3]int{{0, 1, 2}},
		},
		{
			// A link that cannot be read is reported and contributes nothing;
			// the other links still count.
			name: "link errors",
			links: [][]fakeLink{
				{
					{typ: nvml.NVLINK_DEVICE_TYPE_GPU, typRet: nvml.ERROR_UNKNOWN, remote: bus(1)},
					toGPU(1),
					{typ: nvml.NVLINK_DEVICE_TYPE_SWITCH, remote: swA, pciRet: nvml.ERROR_UNKNOWN},
					{typ: nvml.NVLINK_DEVICE_TYPE_IBMNPU, remote: "00000000:99:00.0"},
					toGPU(7), // not a GPU of this node
				},
				nil,
			},
			direct: [][]int{{0, 1}, {0, 0}},
			sw:     []int{1, 0},
			fabric: []int{-1, -1},
			lanes:  [][3]int{{0, 1, 1}},
			errors: []string{
				"0/GetNvLinkRemoteDeviceType(link 0)/ERROR_UNKNOWN",
				"0/GetNvLinkRemotePciInfo(link 2)/ERROR_UNKNOWN",
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			node := plainNode(len(tt.links))
			for i, l := range tt.links {
				node.gpus[i].links = l
			}
			inv := newInventory(t, node, gpu.Options{})
			top := inv.Topology
			if !reflect.DeepEqual(top.DirectLanes, tt.direct) {
				t.Errorf("DirectLanes = %v, want %v", top.DirectLanes, tt.direct)
			}
			if !slices.Equal(top.SwitchLanes, tt.sw) {
				t.Errorf("SwitchLanes = %v, want %v", top.SwitchLanes, tt.sw)
			}
			if !slices.Equal(top.Fabric, tt.fabric) {
				t.Errorf("Fabric = %v, want %v", top.Fabric, tt.fabric)
			}
			for _, l := range tt.lanes {
				if got := top.Lanes(l[0], l[1]); got != l[2] {
					t.Errorf("Lanes(%d, %d) = %d, want %d", l[0], l[1], got, l[2])
				}
			}
			if got := calls(inv); !slices.Equal(got, tt.errors) {
				t.Errorf("Errors = %q, want %q", got, tt.errors)
			}
		})
	}
}

func migNode() *fakeNode {
	node := plainNode(2)
	node.gpus[0].mig = on(true, true)
	node.gpus[0].migs = []fakeMIG{
		// Slots are listed out of GI order; slot 1 and 4 stay empty.
		{slot: 0, uuid: "MIG-c", gi: 2, ci: 0, giProfile: nvml.GPU_INSTANCE_PROFILE_3_SLICE, ciProfile: nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE, start: 4, len: 4, memMiB: 19968},
		{slot: 2, uuid: "MIG-b2", gi: 1, ci: 1, giProfile: nvml.GPU_INSTANCE_PROFILE_2_SLICE, ciProfile: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, start: 0, len: 2, memMiB: 9856},
		{slot: 3, uuid: "MIG-b1", gi: 1, ci: 0, giProfile: nvml.GPU_INSTANCE_PROFILE_2_SLICE, ciProfile: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, start: 0, len: 2, memMiB: 9856},
		{slot: 5, uuid: "MIG-me", gi: 9, ci: 0, giProfile: nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, ciProfile: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, start: 2, len: 1},
		{slot: 6, uuid: "MIG-a", gi: 13, ci: 0, giProfile: nvml.GPU_INSTANCE_PROFILE_1_SLICE, ciProfile: nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE, start: 3, len: 1, memMiB: 4864},
	}
	// MIG off: its instances must not be read.
	node.gpus[1].migs = node.gpus[0].migs
	return node
}

func TestNewMIGInstances(t *testing.T) {
	inv := newInventory(t, migNode(), gpu.Options{})
	want := []gpu.MIGInstance{
		{UUID: "MIG-b1", Profile: "1c.2g.10gb", GIProfileID: nvml.GPU_INSTANCE_PROFILE_2_SLICE, GI: 1, CI: 0, Placement: gpu.Placement{Start: 0, Size: 2}, MemoryBytes: 9856 << 20, Index: 3},
		{UUID: "MIG-b2", Profile: "1c.2g.10gb", GIProfileID: nvml.GPU_INSTANCE_PROFILE_2_SLICE, GI: 1, CI: 1, Placement: gpu.Placement{Start: 0, Size: 2}, MemoryBytes: 9856 << 20, Index: 2},
		{UUID: "MIG-c", Profile: "3g.20gb", GIProfileID: nvml.GPU_INSTANCE_PROFILE_3_SLICE, GI: 2, CI: 0, Placement: gpu.Placement{Start: 4, Size: 4}, MemoryBytes: 19968 << 20, Index: 0},
		// No memory from the MIG handle: the profile's size stands in.
		{UUID: "MIG-me", Profile: "1g.5gb+me", GIProfileID: nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, GI: 9, CI: 0, Placement: gpu.Placement{Start: 2, Size: 1}, MemoryBytes: 4864 << 20, Index: 5},
		{UUID: "MIG-a", Profile: "1g.5gb", GIProfileID: nvml.GPU_INSTANCE_PROFILE_1_SLICE, GI: 13, CI: 0, Placement: gpu.Placement{Start: 3, Size: 1}, MemoryBytes: 4864 << 20, Index: 6},
	}
	if !reflect.DeepEqual(inv.GPUs[0].Instances, want) {
		t.Errorf("instances:\n got %+v\nwant %+v", inv.GPUs[0].Instances, want)
	}
	if inv.GPUs[1].Instances != nil {
		t.Errorf("MIG-off GPU has instances %+v", inv.GPUs[1].Instances)
	}
	if len(inv.Errors) != 0 {
		t.Errorf("Errors = %v", inv.Errors)
	}
}

func TestNewMIGFailures(t *testing.T) {
	tests := []struct {
		call      string
		ret       nvml.Return
		wantGPU   bool
		wantInsts int
		wantErr   string
		// wantUnread is the GPU's Unread.
		wantUnread []gpu.Fact
	}{
		// The first failing slot (0, GI 2) is recorded; with the failure on
		// every slot, all five are skipped but the GPU stays, its instances
		// marked unread: they exist.
		{"GetComputeInstanceById", nvml.ERROR_UNKNOWN, true, 0, "0/mig 0: gi 2: GetComputeInstanceById(0)/ERROR_UNKNOWN", []gpu.Fact{gpu.FactInstances}},
		// NOT_SUPPORTED from a MIG device that is there cannot mean "none".
		{"GetGpuInstanceById", nvml.ERROR_NOT_SUPPORTED, true, 0, "0/mig 0: GetGpuInstanceById(2)/ERROR_NOT_SUPPORTED", []gpu.Fact{gpu.FactInstances}},
		{"GetMigDeviceHandleByIndex", nvml.ERROR_UNKNOWN, true, 0, "0/GetMigDeviceHandleByIndex(0)/ERROR_UNKNOWN", []gpu.Fact{gpu.FactInstances}},
		{"GetGpuInstanceProfileInfo", nvml.ERROR_GPU_IS_LOST, false, 0, "0/mig 0: GetGpuInstanceProfileInfo (profile id 2)/ERROR_GPU_IS_LOST", nil},
		{"GetMaxMigDeviceCount", nvml.ERROR_NOT_SUPPORTED, true, 0, "", nil},
		{"GetGpuInstances", nvml.ERROR_UNKNOWN, true, 5, "0/GetGpuInstances(1g.5gb)/ERROR_UNKNOWN", []gpu.Fact{gpu.FactGIsWithoutCI}},
	}
	for _, tt := range tests {
		t.Run(tt.call, func(t *testing.T) {
			node := migNode()
			node.gpus[0].fail = map[string]nvml.Return{tt.call: tt.ret}
			inv := newInventory(t, node, gpu.Options{})
			got, ok := inv.GPUByUUID("GPU-0000")
			if ok != tt.wantGPU {
				t.Fatalf("GPU present = %v, want %v", ok, tt.wantGPU)
			}
			if len(got.Instances) != tt.wantInsts {
				t.Errorf("%d instances, want %d", len(got.Instances), tt.wantInsts)
			}
			if !slices.Equal(got.Unread, tt.wantUnread) {
				t.Errorf("Unread = %v, want %v", got.Unread, tt.wantUnread)
			}
			errs := calls(inv)
			if tt.wantErr == "" {
				if len(errs) != 0 {
					t.Errorf("Errors = %q, want none", errs)
				}
				return
			}
			if len(errs) == 0 || errs[0] != tt.wantErr {
				t.Errorf("Errors = %q, want first %q", errs, tt.wantErr)
			}
			if !tt.wantGPU && len(errs) != 1 {
				t.Errorf("a lost GPU should stop at the first error, got %q", errs)
			}
		})
	}
}

func TestMIGProfileName(t *testing.T) {
	const a100, h100 = 40960, 81559 // MiB NVML reports
	prof := func(slices uint32, mib uint64) nvml.GpuInstanceProfileInfo {
		return nvml.GpuInstanceProfileInfo{SliceCount: slices, MemorySizeMB: mib}
	}
	tests := []struct {
		id    int
		info  nvml.GpuInstanceProfileInfo
		total uint64
		want  string
	}{
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, prof(1, 4864), a100, "1g.5gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, prof(1, 4864), a100, "1g.5gb+me"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, prof(1, 9856), a100, "1g.10gb"},
		{nvml.GPU_INSTANCE_PROFILE_2_SLICE, prof(2, 9856), a100, "2g.10gb"},
		{nvml.GPU_INSTANCE_PROFILE_3_SLICE, prof(3, 19968), a100, "3g.20gb"},
		{nvml.GPU_INSTANCE_PROFILE_4_SLICE, prof(4, 19968), a100, "4g.20gb"},
		{nvml.GPU_INSTANCE_PROFILE_7_SLICE, prof(7, 40192), a100, "7g.40gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, prof(1, 9856), h100, "1g.10gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, prof(1, 9856), h100, "1g.10gb+me"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, prof(1, 19968), h100, "1g.20gb"},
		{nvml.GPU_INSTANCE_PROFILE_2_SLICE, prof(2, 19968), h100, "2g.20gb"},
		{nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1, prof(2, 19968), h100, "2g.20gb+me"},
		{nvml.GPU_INSTANCE_PROFILE_3_SLICE, prof(3, 40192), h100, "3g.40gb"},
		{nvml.GPU_INSTANCE_PROFILE_4_SLICE, prof(4, 40192), h100, "4g.40gb"},
		{nvml.GPU_INSTANCE_PROFILE_7_SLICE, prof(7, 80384), h100, "7g.80gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_GFX, prof(1, 9856), h100, "1g.10gb+gfx"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, prof(1, 9856), h100, "1g.10gb-me"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, prof(1, 9856), h100, "1g.10gb+me.all"},
		// Sizes and totals as drivers report them (nvidia-smi mig -lgip, nvidia-smi)
		// for the MIG models of the GPU Operator's default mig-parted config.
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, prof(1, 5952), 24576, "1g.6gb"},
		{nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1, prof(2, 11968), 24576, "2g.12gb+me"},
		{nvml.GPU_INSTANCE_PROFILE_4_SLICE, prof(4, 24000), 24576, "4g.24gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, prof(1, 11008), 95830, "1g.12gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, prof(1, 22144), 95830, "1g.24gb"},
		{nvml.GPU_INSTANCE_PROFILE_3_SLICE, prof(3, 47488), 95830, "3g.47gb"},
		{nvml.GPU_INSTANCE_PROFILE_7_SLICE, prof(7, 95360), 95830, "7g.94gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, prof(1, 23552), 97871, "1g.24gb"},
		{nvml.GPU_INSTANCE_PROFILE_3_SLICE, prof(3, 47616), 97871, "3g.48gb"},
		{nvml.GPU_INSTANCE_PROFILE_7_SLICE, prof(7, 95232), 97871, "7g.96gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, prof(1, 16384), 143771, "1g.18gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, prof(1, 33024), 143771, "1g.35gb"},
		{nvml.GPU_INSTANCE_PROFILE_3_SLICE, prof(3, 71168), 143771, "3g.71gb"},
		{nvml.GPU_INSTANCE_PROFILE_7_SLICE, prof(7, 143104), 143771, "7g.141gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, prof(1, 20992), 183359, "1g.23gb"},
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, prof(1, 22528), 183359, "1g.23gb"}, // an older driver's 22.00 GiB
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV2, prof(1, 45312), 183359, "1g.45gb"},
		{nvml.GPU_INSTANCE_PROFILE_3_SLICE, prof(3, 91136), 183359, "3g.90gb"},
		{nvml.GPU_INSTANCE_PROFILE_7_SLICE, prof(7, 182784), 183359, "7g.180gb"},
		// Unknown GPU memory: plain rounding up of the profile's own size.
		{nvml.GPU_INSTANCE_PROFILE_1_SLICE, prof(1, 4864), 0, "1g.5gb"},
	}
	for _, tt := range tests {
		t.Run(tt.want, func(t *testing.T) {
			if got := gpu.MIGProfileName(tt.id, tt.info, tt.total<<20); got != tt.want {
				t.Errorf("MIGProfileName(%d, %d slices %d MiB, total %d MiB) = %q, want %q",
					tt.id, tt.info.SliceCount, tt.info.MemorySizeMB, tt.total, got, tt.want)
			}
		})
	}
}

func TestSysfsNUMA(t *testing.T) {
	root := t.TempDir()
	files := map[string]string{
		"0000:07:00.0": "1\n",
		"0000:08:00.0": "-1\n", // single socket
		"0000:0a:00.0": "bogus\n",
		"0000:0b:00.0": "", // the device without numa_node (kernel without NUMA)
	}
	for bus, content := range files {
		dir := filepath.Join(root, "bus", "pci", "devices", bus)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		if content == "" {
			continue
		}
		if err := os.WriteFile(filepath.Join(dir, "numa_node"), []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	numa := gpu.SysfsNUMA(root)
	tests := []struct {
		bus     string
		want    int
		wantErr bool
	}{
		{"0000:07:00.0", 1, false},
		{"0000:08:00.0", -1, false},
		{"0000:0b:00.0", -1, false},
		{"0000:0a:00.0", -1, true},
		{"0000:0c:00.0", -1, true}, // no such device
		{"../../../etc", -1, true},
		{"..", -1, true},
		{"", -1, true},
	}
	for _, tt := range tests {
		got, err := numa(tt.bus)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("SysfsNUMA(%q) = %d, %v; want %d, error %v", tt.bus, got, err, tt.want, tt.wantErr)
		}
		if err != nil && tt.bus != "" && !strings.Contains(err.Error(), tt.bus) {
			t.Errorf("error %q does not name the device %q", err, tt.bus)
		}
	}
}

// fillNotSupported sets every nil XxxFunc field of the mock struct v points to
// (including embedded mocks) to a function that answers ERROR_NOT_SUPPORTED,
// so that calls the mock did not implement fail the way NVML would on a GPU
// that lacks the feature instead of panicking.
func fillNotSupported(t *testing.T, v any) {
	t.Helper()
	rv := reflect.ValueOf(v)
	if rv.Kind() != reflect.Pointer || rv.Elem().Kind() != reflect.Struct {
		t.Fatalf("fillNotSupported(%T): want a pointer to a struct", v)
	}
	fillStruct(rv.Elem())
}

func fillStruct(s reflect.Value) {
	retType := reflect.TypeFor[nvml.Return]()
	for i := range s.NumField() {
		f, sf := s.Field(i), s.Type().Field(i)
		switch {
		case sf.Anonymous && f.Kind() == reflect.Struct:
			fillStruct(f)
		case f.Kind() == reflect.Func && strings.HasSuffix(sf.Name, "Func") && f.IsNil() && f.CanSet():
			ft := f.Type()
			f.Set(reflect.MakeFunc(ft, func([]reflect.Value) []reflect.Value {
				out := make([]reflect.Value, ft.NumOut())
				for k := range out {
					out[k] = reflect.Zero(ft.Out(k))
					if ft.Out(k) == retType {
						out[k] = reflect.ValueOf(nvml.ERROR_NOT_SUPPORTED)
					}
				}
				return out
			}))
		}
	}
}

func TestFillNotSupported(t *testing.T) {
	d := dgxa100.NewDevice(0)
	fillNotSupported(t, d)
	if _, ret := d.GetNvLinkState(0); ret != nvml.ERROR_NOT_SUPPORTED {
		t.Errorf("filled GetNvLinkState = %v, want ERROR_NOT_SUPPORTED", ret)
	}
	if _, ret := d.GetName(); ret != nvml.SUCCESS {
		t.Errorf("implemented GetName was replaced: %v", ret)
	}
}

// TestNewDGXA100 builds an inventory from go-nvml's own mock server: New needs
// nothing that only our simulator provides.
func TestNewDGXA100(t *testing.T) {
	s := dgxa100.New()
	fillNotSupported(t, s)
	for _, d := range s.Devices {
		fillNotSupported(t, d.(*dgxa100.Device))
	}
	inv, err := gpu.New(s, gpu.Options{})
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	if len(inv.GPUs) != 8 {
		t.Fatalf("%d GPUs, want 8; errors %v", len(inv.GPUs), inv.Errors)
	}
	for i, g := range inv.GPUs {
		d := s.Devices[i].(*dgxa100.Device)
		if g.Index != i || g.UUID != d.UUID || g.Minor != i {
			t.Errorf("GPU %d: index %d uuid %q minor %d, want uuid %q", i, g.Index, g.UUID, g.Minor, d.UUID)
		}
		if g.Name != "Mock NVIDIA A100-SXM4-40GB" || g.MemoryBytes != 40960<<20 {
			t.Errorf("GPU %d: %q with %d bytes", i, g.Name, g.MemoryBytes)
		}
		if !g.MIGCapable || g.MIG.Current || g.ComputeCapability != (gpu.ComputeCapability{Major: 8}) || g.NUMANode != -1 {
			t.Errorf("GPU %d: MIG capable %v mode %+v CC %v NUMA %d", i, g.MIGCapable, g.MIG, g.ComputeCapability, g.NUMANode)
		}
	}
	if inv.DriverVersion != "550.54.15" {
		t.Errorf("DriverVersion = %q", inv.DriverVersion)
	}
	// That mock's GetPciInfo leaves the bus id empty, which New must report
	// (and nothing else: unimplemented calls read as NOT_SUPPORTED).
	for _, e := range inv.Errors {
		if e.Call != "GetPciInfo" || !strings.Contains(e.Err, "empty pci bus id") {
			t.Errorf("unexpected error %v", e)
		}
	}
	if len(inv.Errors) != 8 {
		t.Errorf("%d errors, want one empty bus id per GPU", len(inv.Errors))
	}
	if n := inv.Topology.Len(); n != 8 {
		t.Errorf("topology of %d GPUs", n)
	}
}

func TestSysfsPCIeRoot(t *testing.T) {
	root := t.TempDir()
	mk := func(target, bus string) {
		t.Helper()
		dir := filepath.Join(root, "devices", target)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		link := filepath.Join(root, "bus", "pci", "devices", bus)
		if err := os.MkdirAll(filepath.Dir(link), 0o755); err != nil {
			t.Fatal(err)
		}
		rel, err := filepath.Rel(filepath.Dir(link), dir)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink(rel, link); err != nil {
			t.Fatal(err)
		}
	}
	// A GPU behind a PCIe switch, one on a root port, and a device the
	// kernel placed outside any root complex (a virtual bus).
	mk("pci0000:00/0000:00:01.0/0000:01:00.0/0000:02:00.0/0000:07:00.0", "0000:07:00.0")
	mk("pci0001:80/0001:80:02.0/0001:81:00.0", "0001:81:00.0")
	mk("platform/vbus/0000:09:00.0", "0000:09:00.0")
	pcieRoot := gpu.SysfsPCIeRoot(root)
	tests := []struct {
		bus     string
		want    string
		wantErr bool
	}{
		{bus: "0000:07:00.0", want: "pci0000:00"},
		{bus: "0001:81:00.0", want: "pci0001:80"},
		{bus: "0000:09:00.0", wantErr: true},
		{bus: "0000:0c:00.0", wantErr: true}, // no such device
		{bus: "../../../etc", wantErr: true},
		{bus: "", wantErr: true},
	}
	for _, tt := range tests {
		got, err := pcieRoot(tt.bus)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("SysfsPCIeRoot(%q) = %q, %v; want %q, error %v", tt.bus, got, err, tt.want, tt.wantErr)
		}
	}
}
