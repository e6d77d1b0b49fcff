package mig

import (
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
)

func TestDesired(t *testing.T) {
	inv := &gpu.Inventory{GPUs: []gpu.GPU{
		{Index: 0, UUID: "GPU-a", MIGCapable: true, PCIDeviceID: 0x233010DE},
		{Index: 1, UUID: "GPU-b", MIGCapable: true, PCIDeviceID: 0x20B010DE},
		{Index: 2, UUID: "GPU-c", Name: "L40S", PCIDeviceID: 0x26B910DE},
		// GetMigMode failed: MIGCapable false means unknown here.
		{Index: 3, UUID: "GPU-d", Name: "A100", PCIDeviceID: 0x20B010DE,
			Unread: []gpu.Fact{gpu.FactMIGMode, gpu.FactInstances, gpu.FactGIsWithoutCI}},
	}}
	all := config.DeviceIndices{All: true}
	for _, tc := range []struct {
		name   string
		layout config.MigLayout
		want   map[int]string // index → Want.String()
		err    string
	}{
		{"all, non-MIG GPU skipped when MIG off", config.MigLayout{{Devices: all}},
			map[int]string{0: "mig disabled", 1: "mig disabled", 3: "mig disabled"}, ""},
		// MakePlan refuses GPU 3 until its MIG mode is read; Desired must
		// not fail the whole layout over it.
		{"MIG mode unread is not \"no MIG\"", config.MigLayout{{Devices: all, DeviceFilter: config.StringList{"0x20b010de"}, MigEnabled: true, MigDevices: map[string]int{"1g.5gb": 7}}},
			map[int]string{1: "7x 1g.5gb", 3: "7x 1g.5gb"}, ""},
		{"first matching entry wins", config.MigLayout{
			{Devices: config.DeviceIndices{Indices: []int{1}}, MigEnabled: true, MigDevices: map[string]int{"1g.5gb": 7}},
			{Devices: all, DeviceFilter: config.StringList{"0x233010DE"}, MigEnabled: true, MigDevices: map[string]int{"3g.40gb": 2, "1g.10gb": 0}},
		}, map[int]string{0: "2x 3g.40gb", 1: "7x 1g.5gb"}, ""},
		{"filter matches nothing", config.MigLayout{{Devices: all, DeviceFilter: config.StringList{"0x00000000"}, MigEnabled: true}},
			map[int]string{}, ""},
		{"MIG on a GPU without it", config.MigLayout{{Devices: config.DeviceIndices{Indices: []int{2}}, MigEnabled: true}},
			nil, "mig layout entry 0: gpu 2 (GPU-c): L40S does not support MIG"},
		{"negative count", config.MigLayout{{Devices: all, DeviceFilter: config.StringList{"0x20b010de"}, MigEnabled: true, MigDevices: map[string]int{"1g.5gb": -1}}},
			nil, "gpu 1 (GPU-b): mig-devices 1g.5gb: negative count"},
		{"bad filter", config.MigLayout{{Devices: all, DeviceFilter: config.StringList{"zz"}}}, nil, "device-filter \"zz\""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Desired(tc.layout, inv)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err = %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(tc.want) {
				t.Fatalf("got %v, want %v", got, tc.want)
			}
			for i, w := range tc.want {
				if got[i].String() != w {
					t.Errorf("gpu %d: %s, want %s", i, got[i], w)
				}
			}
		})
	}
}
