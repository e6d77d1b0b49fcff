package plugin

import (
	"testing"

	"github.com/gpu-agent/gpu-agent/catalog"
)

// What NVIDIA's plugin puts in a container for deviceIDStrategy index and
// gdsEnabled / mofedEnabled / gdrcopyEnabled: NVIDIA_VISIBLE_DEVICES lists
// the indices (once per device, replicas or not), and every container gets
// NVIDIA_GDS, NVIDIA_MOFED and NVIDIA_GDRCOPY=enabled.
func TestAllocateRuntimeIDAndCommonEnv(t *testing.T) {
	env := map[string]string{"NVIDIA_GDS": "enabled", "NVIDIA_MOFED": "enabled", "NVIDIA_GDRCOPY": "enabled"}
	dev := func(id, uuid, index string, replica bool) catalog.Device {
		return catalog.Device{ID: id, Healthy: true, Replica: replica, Spec: catalog.AllocateSpec{VisibleID: uuid, RuntimeID: index}}
	}
	tests := []struct {
		name    string
		res     *catalog.Resource
		ids     []string
		visible string
	}{
		{
			name: "GPU indices",
			res: &catalog.Resource{Name: "nvidia.com/gpu", Common: catalog.AllocateSpec{Env: env},
				Devices: []catalog.Device{dev("GPU-a", "GPU-a", "0", false), dev("GPU-b", "GPU-b", "1", false)}},
			ids: []string{"GPU-b", "GPU-a"}, visible: "1,0",
		},
		{
			name: "MIG indices, replicas of one device named once",
			res: &catalog.Resource{Name: "nvidia.com/mig-1g.10gb", Common: catalog.AllocateSpec{Env: env},
				Devices: []catalog.Device{dev("MIG-x::0", "MIG-x", "0:3", true), dev("MIG-x::1", "MIG-x", "0:3", true), dev("MIG-y::0", "MIG-y", "1:0", true)}},
			ids: []string{"MIG-x::0", "MIG-x::1", "MIG-y::0"}, visible: "0:3,1:0",
		},
		{
			name: "no runtime ID: the UUID, as before",
			res: &catalog.Resource{Name: "nvidia.com/gpu", Common: catalog.AllocateSpec{Env: env},
				Devices: []catalog.Device{dev("GPU-a", "GPU-a", "", false)}},
			ids: []string{"GPU-a"}, visible: "GPU-a",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := allocate(tt.res, allocReq(tt.ids))
			if err != nil {
				t.Fatal(err)
			}
			got := resp.GetContainerResponses()[0].GetEnvs()
			if got[visibleDevicesEnv] != tt.visible {
				t.Errorf("%s = %q, want %q", visibleDevicesEnv, got[visibleDevicesEnv], tt.visible)
			}
			for k, v := range env {
				if got[k] != v {
					t.Errorf("%s = %q, want %q", k, got[k], v)
				}
			}
		})
	}
}

// A change of runtime ID alone is a change the kubelet must be told of.
func TestSameDevicesSeesRuntimeID(t *testing.T) {
	a := &catalog.Resource{Name: "nvidia.com/gpu", Devices: []catalog.Device{{ID: "GPU-a", Spec: catalog.AllocateSpec{VisibleID: "GPU-a"}}}}
	b := &catalog.Resource{Name: "nvidia.com/gpu", Devices: []catalog.Device{{ID: "GPU-a", Spec: catalog.AllocateSpec{VisibleID: "GPU-a", RuntimeID: "0"}}}}
	if catalog.SameDevices(a, b) {
		t.Error("SameDevices ignores RuntimeID")
	}
}
