package gpu

import (
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Drivers without the versioned call, or without version 3 of its struct,
// are asked version 1; any other answer of version 3 stands.
func TestFabricV3OrV1(t *testing.T) {
	v1 := func() (nvml.GpuFabricInfo, nvml.Return) {
		return nvml.GpuFabricInfo{CliqueId: 1, State: nvml.GPU_FABRIC_STATE_COMPLETED}, nvml.SUCCESS
	}
	for _, tt := range []struct {
		v3ret      nvml.Return
		wantClique uint32
		wantRet    nvml.Return
	}{
		{nvml.SUCCESS, 3, nvml.SUCCESS},
		{nvml.ERROR_NOT_SUPPORTED, 3, nvml.ERROR_NOT_SUPPORTED},
		{nvml.ERROR_FUNCTION_NOT_FOUND, 1, nvml.SUCCESS},
		{nvml.ERROR_ARGUMENT_VERSION_MISMATCH, 1, nvml.SUCCESS},
	} {
		v3 := func() (nvml.GpuFabricInfo_v3, nvml.Return) {
			return nvml.GpuFabricInfo_v3{CliqueId: 3, State: nvml.GPU_FABRIC_STATE_COMPLETED}, tt.v3ret
		}
		info, ret := fabricV3OrV1(v3, v1)
		if info.CliqueId != tt.wantClique || ret != tt.wantRet {
			t.Errorf("v3 answering %v: clique %d, %v; want %d, %v", tt.v3ret, info.CliqueId, ret, tt.wantClique, tt.wantRet)
		}
	}
}
