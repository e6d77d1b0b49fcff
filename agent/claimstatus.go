package agent

import (
	"reflect"
	"slices"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/dra"
)

// ClaimStatusPublisher writes what the driver says of prepared claims'
// devices into ResourceClaim.status.devices; Set must not block (the
// writes happen in the background, so Prepare never waits on the API).
type ClaimStatusPublisher interface {
	Set(claims map[types.UID]dra.ClaimStatus)
}

// publishClaimStatus hands the claim statuses to the writer when they
// changed: after a Prepare or Unprepare, and when a prepared device's
// health changed.
func (a *Agent) publishClaimStatus() {
	if a.opts.ClaimStatus == nil {
		return
	}
	want := a.claimStatuses()
	if a.claimStatus != nil && reflect.DeepEqual(want, a.claimStatus) {
		return
	}
	a.claimStatus = want
	a.opts.ClaimStatus.Set(want)
}

// claimStatuses is each prepared claim's devices as the driver reports
// them: healthy or why not (the pool's reasons, unhealthy or cordoned,
// which the ResourceSlice's taints give too, or the health watcher's for a device the pool does not
// list as it is), and what the device is.
func (a *Agent) claimStatuses() map[types.UID]dra.ClaimStatus {
	claims := a.ledger.Claims()
	out := make(map[types.UID]dra.ClaimStatus, len(claims))
	for uid, pc := range claims {
		cs := dra.ClaimStatus{UID: uid, Namespace: pc.Namespace, Name: pc.Name}
		for _, d := range pc.Devices {
			if slices.ContainsFunc(cs.Devices, func(o dra.DeviceStatus) bool { return o.Device == d.Device && o.ShareID == d.ShareID }) {
				continue // the API keys entries by device and share: admin access to a device held too
			}
			ds := dra.DeviceStatus{Device: d.Device, ShareID: d.ShareID, Data: map[string]any{"uuid": d.UUID}}
			if pd, ok := a.draPool.Device(d.Device); ok {
				// A cordon is said too: the device keeps working for this
				// claim, but the GPU is out of service.
				ds.Unhealthy = joinReason(pd.Unhealthy, pd.Cordoned)
			}
			if r, bad := a.health.Unhealthy(d.UUID); bad && ds.Unhealthy == "" {
				ds.Unhealthy = r
			}
			if d.Created {
				ds.Data["parentUUID"] = d.Parent
				ds.Data["profile"] = d.Profile
				ds.Data["placement"] = map[string]any{"start": d.Placement.Start, "size": d.Placement.Size}
			}
			cs.Devices = append(cs.Devices, ds)
		}
		out[uid] = cs
	}
	return out
}
