package agent

import (
	"testing"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/podresources"
	"github.com/gpu-agent/gpu-agent/telemetry"
)

func TestDRADeviceResolvesPreparedClaims(t *testing.T) {
	inv := &gpu.Inventory{GPUs: []gpu.GPU{
		{UUID: "GPU-0"},
		{UUID: "GPU-1", Instances: []gpu.MIGInstance{{UUID: "MIG-1a", Profile: "3g.40gb"}}},
	}}
	claims := map[types.UID]PreparedClaim{
		"u1": {Namespace: "ml", Name: "whole", Devices: []PreparedClaimDevice{{PreparedDevice: dra.PreparedDevice{Device: "gpu-0"}, UUID: "GPU-0"}}},
		"u2": {Namespace: "ml", Name: "made", Devices: []PreparedClaimDevice{{PreparedDevice: dra.PreparedDevice{Device: "gpu-1-mig-3g40gb-4"}, UUID: "MIG-1a", Created: true}}},
	}
	a := &Agent{}
	hold := func(claim, device string) podresources.DRAHold {
		return podresources.DRAHold{ClaimNamespace: "ml", ClaimName: claim, Driver: devicemodel.DriverName, Pool: "node-1", Device: device}
	}
	if _, ok := a.DRADevice(hold("whole", "gpu-0")); ok {
		t.Fatal("resolved a device before the loop published any claim")
	}
	a.draHeld.Store(newDRAHeld("node-1", claims, inv))
	otherDriver := hold("whole", "gpu-0")
	otherDriver.Driver = "nic.example.com"
	otherPool := hold("whole", "gpu-0")
	otherPool.Pool = "node-2"
	tests := []struct {
		name string
		h    podresources.DRAHold
		want telemetry.DRADevice
		ok   bool
	}{
		{"whole GPU", hold("whole", "gpu-0"), telemetry.DRADevice{UUID: "GPU-0"}, true},
		{"MIG device made for the claim, profile from the inventory", hold("made", "gpu-1-mig-3g40gb-4"), telemetry.DRADevice{UUID: "MIG-1a", MIGProfile: "3g.40gb"}, true},
		{"a device the claim does not have", hold("whole", "gpu-1"), telemetry.DRADevice{}, false},
		{"a claim not prepared", hold("other", "gpu-0"), telemetry.DRADevice{}, false},
		{"another driver", otherDriver, telemetry.DRADevice{}, false},
		{"another node's pool", otherPool, telemetry.DRADevice{}, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, ok := a.DRADevice(tt.h)
			if got != tt.want || ok != tt.ok {
				t.Errorf("DRADevice = %+v, %v; want %+v, %v", got, ok, tt.want, tt.ok)
			}
		})
	}
}
