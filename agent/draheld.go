package agent

import (
	"strconv"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/podresources"
	"github.com/gpu-agent/gpu-agent/telemetry"
)

// draHeld maps each device of each prepared claim to the node's device, so
// that metrics can name the pod that holds it through the claim (the
// kubelet lists claims by name and pool device, never by UUID). Immutable;
// the loop builds a new one at the end of each Step.
type draHeld struct {
	pool    string
	devices map[draHeldKey]telemetry.DRADevice
}

type draHeldKey struct{ namespace, claim, device string }

// newDRAHeld indexes claims on pool (the node's name). A device's MIG
// profile is the inventory's: a MIG device made for a claim has none in
// the pool until it exists.
func newDRAHeld(pool string, claims map[types.UID]PreparedClaim, inv *gpu.Inventory) *draHeld {
	h := &draHeld{pool: pool, devices: map[draHeldKey]telemetry.DRADevice{}}
	profiles := map[string]string{}
	if inv != nil {
		for _, g := range inv.GPUs {
			for _, m := range g.Instances {
				profiles[m.UUID] = m.Profile
			}
		}
	}
	for _, pc := range claims {
		for _, d := range pc.Devices {
			if d.UUID == "" {
				continue
			}
			dev := telemetry.DRADevice{UUID: d.UUID, MIGProfile: profiles[d.UUID]}
			dev.MPSActiveThreads, _ = strconv.Atoi(d.MPSEnv["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"])
			h.devices[draHeldKey{pc.Namespace, pc.Name, d.Device}] = dev
		}
	}
	return h
}

// DRADevice implements [telemetry.DRASource]: the device a prepared claim
// holds, from the claims as the loop last published them.
func (a *Agent) DRADevice(h podresources.DRAHold) (telemetry.DRADevice, bool) {
	held := a.draHeld.Load()
	if held == nil || h.Driver != devicemodel.DriverName || h.Pool != held.pool {
		return telemetry.DRADevice{}, false
	}
	d, ok := held.devices[draHeldKey{h.ClaimNamespace, h.ClaimName, h.Device}]
	return d, ok
}
