package gpu_test

import (
	"encoding/binary"
	"encoding/json"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/uuid"

	"github.com/gpu-agent/gpu-agent/gpu"
)

var clusterA = uuid.MustParse("3b2f1e0c-9d4a-4f7e-8b1c-2a5d6e7f8091")

// mask builds a health mask: every defined field FALSE, the named ones
// TRUE, incorrect configuration cfg.
func mask(cfg uint32, trueShifts ...uint32) uint32 {
	m := cfg << nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION
	for _, s := range []uint32{nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW, nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY,
		nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY, nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY} {
		v := uint32(nvml.GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE)
		if slices.Contains(trueShifts, s) {
			v = nvml.GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE
		}
		m |= v << s
	}
	return m
}

func TestDecodeFabric(t *testing.T) {
	completed := func(f func(*nvml.GpuFabricInfo_v3)) nvml.GpuFabricInfo_v3 {
		info := nvml.GpuFabricInfo_v3{ClusterUuid: clusterA, CliqueId: 32766, State: nvml.GPU_FABRIC_STATE_COMPLETED,
			HealthMask: mask(nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE), HealthSummary: nvml.GPU_FABRIC_HEALTH_SUMMARY_HEALTHY}
		if f != nil {
			f(&info)
		}
		return info
	}
	tests := []struct {
		name    string
		info    nvml.GpuFabricInfo_v3
		want    *gpu.Fabric
		clique  string
		wantErr string
	}{
		{"not fabric-attached", nvml.GpuFabricInfo_v3{CliqueId: 9}, nil, "", ""},
		{"in a clique", completed(nil),
			&gpu.Fabric{State: gpu.FabricCompleted, ClusterUUID: clusterA.String(), CliqueID: 32766, Health: gpu.FabricHealthy},
			clusterA.String() + ".32766", ""},
		{"single-node NVSwitch fabric: no cluster UUID", completed(func(i *nvml.GpuFabricInfo_v3) { i.ClusterUuid = [16]uint8{}; i.CliqueId = 0 }),
			&gpu.Fabric{State: gpu.FabricCompleted, Health: gpu.FabricHealthy}, "", ""},
		{"registration in progress: its domain means nothing yet",
			completed(func(i *nvml.GpuFabricInfo_v3) {
				i.State = nvml.GPU_FABRIC_STATE_IN_PROGRESS
				i.Status = uint32(nvml.ERROR_UNKNOWN)
			}),
			&gpu.Fabric{State: gpu.FabricInProgress, Health: gpu.FabricHealthy}, "", ""},
		{"not started", completed(func(i *nvml.GpuFabricInfo_v3) { i.State = nvml.GPU_FABRIC_STATE_NOT_STARTED }),
			&gpu.Fabric{State: gpu.FabricNotStarted, Health: gpu.FabricHealthy}, "", ""},
		{"registration failed", completed(func(i *nvml.GpuFabricInfo_v3) { i.Status = uint32(nvml.ERROR_NOT_READY) }),
			&gpu.Fabric{State: gpu.FabricCompleted, Error: nvml.ERROR_NOT_READY.Error(), ClusterUUID: clusterA.String(), CliqueID: 32766, Health: gpu.FabricHealthy},
			"", ""},
		{"degraded bandwidth", completed(func(i *nvml.GpuFabricInfo_v3) {
			i.HealthMask = mask(nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE, nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW)
			i.HealthSummary = nvml.GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY
		}), &gpu.Fabric{State: gpu.FabricCompleted, ClusterUUID: clusterA.String(), CliqueID: 32766, Health: gpu.FabricLimitedCapacity,
			Conditions: []string{"degraded-bandwidth"}}, clusterA.String() + ".32766", ""},
		{"route unhealthy, wrong chassis", completed(func(i *nvml.GpuFabricInfo_v3) {
			i.HealthMask = mask(nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_INCORRECT_CHASSIS_SN,
				nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY, nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY)
			i.HealthSummary = nvml.GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY
		}), &gpu.Fabric{State: gpu.FabricCompleted, ClusterUUID: clusterA.String(), CliqueID: 32766, Health: gpu.FabricUnhealthy,
			Conditions: []string{"route-unhealthy", "access-timeout-recovery", "incorrect-chassis-serial"}}, clusterA.String() + ".32766", ""},
		{"version 1: no health", completed(func(i *nvml.GpuFabricInfo_v3) { i.HealthMask, i.HealthSummary = 0, 0 }),
			&gpu.Fabric{State: gpu.FabricCompleted, ClusterUUID: clusterA.String(), CliqueID: 32766}, clusterA.String() + ".32766", ""},
		{"unknown state", completed(func(i *nvml.GpuFabricInfo_v3) { i.State = 4 }), nil, "", "state 4"},
		{"unknown health summary", completed(func(i *nvml.GpuFabricInfo_v3) { i.HealthSummary = 7 }), nil, "", "health summary 7"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := gpu.DecodeFabric(tt.info)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) || got != nil {
					t.Fatalf("DecodeFabric = %+v, %v; want an error containing %q", got, err, tt.wantErr)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("DecodeFabric = %+v, %v; want %+v", got, err, tt.want)
			}
			if c := got.Clique(); c != tt.clique {
				t.Errorf("Clique() = %q, want %q", c, tt.clique)
			}
		})
	}
}

// FuzzDecodeFabric decodes any fabric info NVML could hand back. What it
// accepts names a clique exactly when the registration succeeded with a
// cluster UUID, reads back from JSON as it was, and lists each condition
// once.
func FuzzDecodeFabric(f *testing.F) {
	seed := func(info nvml.GpuFabricInfo_v3) []byte {
		b := make([]byte, 34)
		copy(b, info.ClusterUuid[:])
		binary.LittleEndian.PutUint32(b[16:], info.Status)
		binary.LittleEndian.PutUint32(b[20:], info.CliqueId)
		b[24] = info.State
		binary.LittleEndian.PutUint32(b[25:], info.HealthMask)
		b[29] = info.HealthSummary
		return b
	}
	f.Add(seed(nvml.GpuFabricInfo_v3{}))
	f.Add(seed(nvml.GpuFabricInfo_v3{ClusterUuid: clusterA, CliqueId: 1, State: 3, HealthMask: mask(1), HealthSummary: 1}))
	f.Add(seed(nvml.GpuFabricInfo_v3{ClusterUuid: clusterA, CliqueId: 1, State: 3, Status: 27, HealthMask: 0xffffffff, HealthSummary: 2}))
	f.Add(seed(nvml.GpuFabricInfo_v3{State: 2, HealthSummary: 3}))
	f.Add(seed(nvml.GpuFabricInfo_v3{State: 9, HealthSummary: 9}))
	f.Fuzz(func(t *testing.T, b []byte) {
		var info nvml.GpuFabricInfo_v3
		b = append(b, make([]byte, 34)...)
		copy(info.ClusterUuid[:], b)
		info.Status = binary.LittleEndian.Uint32(b[16:])
		info.CliqueId = binary.LittleEndian.Uint32(b[20:])
		info.State = b[24]
		info.HealthMask = binary.LittleEndian.Uint32(b[25:])
		info.HealthSummary = b[29]
		fab, err := gpu.DecodeFabric(info)
		if err != nil {
			if fab != nil || !strings.HasPrefix(err.Error(), "fabric info: ") {
				t.Fatalf("DecodeFabric = %+v, %q", fab, err)
			}
			return
		}
		if fab == nil {
			if info.State != nvml.GPU_FABRIC_STATE_NOT_SUPPORTED {
				t.Fatalf("state %d decoded as no fabric", info.State)
			}
			return
		}
		wantClique := info.State == nvml.GPU_FABRIC_STATE_COMPLETED && info.Status == 0 && info.ClusterUuid != [16]uint8{}
		if (fab.Clique() != "") != wantClique {
			t.Fatalf("Clique() = %q for %+v", fab.Clique(), info)
		}
		if wantClique && fab.Clique() != uuid.UUID(info.ClusterUuid).String()+"."+itoa(info.CliqueId) {
			t.Fatalf("Clique() = %q for %+v", fab.Clique(), info)
		}
		seen := map[string]bool{}
		for _, c := range fab.Conditions {
			if seen[c] || c == "" {
				t.Fatalf("conditions %q", fab.Conditions)
			}
			seen[c] = true
		}
		data, err := json.Marshal(fab)
		if err != nil {
			t.Fatal(err)
		}
		var back gpu.Fabric
		if err := json.Unmarshal(data, &back); err != nil || !reflect.DeepEqual(&back, fab) {
			t.Fatalf("JSON round trip: %+v, %v; want %+v", back, err, fab)
		}
	})
}

func itoa(v uint32) string { return strconv.FormatUint(uint64(v), 10) }

// A fabric NVML fails to read is unread, not absent: the GPU may be in a
// clique. One a newer driver describes in values this build does not
// know is unread too, with the error.
func TestInventoryFabric(t *testing.T) {
	in := nvml.GpuFabricInfo{ClusterUuid: clusterA, CliqueId: 4, State: nvml.GPU_FABRIC_STATE_COMPLETED}
	node := fakeNode{gpus: []fakeGPU{
		{uuid: "GPU-0", name: "NVIDIA GB200", memMiB: 189471, bus: "00000008:01:00.0", fabric: &in},
		{uuid: "GPU-1", name: "NVIDIA GB200", memMiB: 189471, bus: "00000009:01:00.0", fabric: &in, minor: 1,
			fail: map[string]nvml.Return{"GetGpuFabricInfoV": nvml.ERROR_TIMEOUT}},
		{uuid: "GPU-2", name: "NVIDIA GB200", memMiB: 189471, bus: "00000018:01:00.0", minor: 2,
			fabric: &nvml.GpuFabricInfo{State: 7}},
		{uuid: "GPU-3", name: "NVIDIA H100", memMiB: 81559, bus: "00000019:01:00.0", minor: 3},
	}}
	inv := newInventory(t, &node, gpu.Options{})
	if c := inv.GPUs[0].Fabric.Clique(); c != clusterA.String()+".4" || inv.GPUs[0].Unknown(gpu.FactFabric) {
		t.Errorf("gpu 0: clique %q, unread %v", c, inv.GPUs[0].Unread)
	}
	for _, i := range []int{1, 2} {
		if g := inv.GPUs[i]; g.Fabric != nil || !g.Unknown(gpu.FactFabric) {
			t.Errorf("gpu %d: fabric %+v, unread %v; want unread", i, g.Fabric, g.Unread)
		}
	}
	if g := inv.GPUs[3]; g.Fabric != nil || g.Unknown(gpu.FactFabric) {
		t.Errorf("gpu 3 (no fabric): %+v, unread %v", g.Fabric, g.Unread)
	}
	var calls []string
	for _, e := range inv.Errors {
		calls = append(calls, e.Error())
	}
	if len(calls) != 2 || !strings.Contains(calls[0], "gpu 1 (GPU-1): GetGpuFabricInfoV") || !strings.Contains(calls[1], "state 7") {
		t.Errorf("errors %q", calls)
	}
}
