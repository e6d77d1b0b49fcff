package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/dra"
)

// DRAPublisher publishes the node's DRA pool (dra.Driver); it must not block.
type DRAPublisher interface {
	Publish(p *dra.Pool)
}

// ClaimsPrepare asks the loop to prepare claims (the DRA driver's
// NodePrepareResources); the answer goes to Reply once it is checkpointed.
type ClaimsPrepare struct {
	Claims []dra.Claim
	Reply  chan<- map[types.UID]dra.Prepared
}

// ClaimsUnprepare asks the loop to release claims.
type ClaimsUnprepare struct {
	Claims []dra.ClaimRef
	Reply  chan<- map[types.UID]error
}

func (ClaimsPrepare) kind() string   { return "dra-prepare" }
func (ClaimsUnprepare) kind() string { return "dra-unprepare" }

// PreparedClaim is a claim prepared on this node: the allocation ledger's
// DRA side, checkpointed.
type PreparedClaim struct {
	Namespace string                `json:"namespace"`
	Name      string                `json:"name"`
	Devices   []PreparedClaimDevice `json:"devices"`
	At        time.Time             `json:"at"`
}

// PreparedClaimDevice is one device of a prepared claim.
type PreparedClaimDevice struct {
	dra.PreparedDevice
	UUID string `json:"uuid"`
}

func (c PreparedClaim) String() string { return "ResourceClaim " + c.Namespace + "/" + c.Name }

func (c PreparedClaim) prepared() dra.Prepared {
	out := dra.Prepared{Devices: make([]dra.PreparedDevice, 0, len(c.Devices))}
	for _, d := range c.Devices {
		out.Devices = append(out.Devices, d.PreparedDevice)
	}
	return out
}

// PrepareClaims implements dra.Claims: it hands the claims to the loop and
// waits for its answer.
func (a *Agent) PrepareClaims(ctx context.Context, claims []dra.Claim) (map[types.UID]dra.Prepared, error) {
	reply := make(chan map[types.UID]dra.Prepared, 1)
	a.inbox.Post(ClaimsPrepare{Claims: claims, Reply: reply})
	select {
	case r := <-reply:
		return r, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("prepare: %w", context.Cause(ctx))
	}
}

// UnprepareClaims implements dra.Claims.
func (a *Agent) UnprepareClaims(ctx context.Context, claims []dra.ClaimRef) (map[types.UID]error, error) {
	reply := make(chan map[types.UID]error, 1)
	a.inbox.Post(ClaimsUnprepare{Claims: claims, Reply: reply})
	select {
	case r := <-reply:
		return r, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("unprepare: %w", context.Cause(ctx))
	}
}

// prepareClaims records the claims it can prepare in the ledger. A claim
// prepared before gets the same answer (the kubelet asks again after its
// own restart). A device that is unknown, unhealthy, held through the
// device plugin or prepared for another claim fails the claim, naming the
// device; the kubelet retries it.
func (a *Agent) prepareClaims(e ClaimsPrepare, pool *dra.Pool) (map[types.UID]dra.Prepared, []types.UID) {
	out := make(map[types.UID]dra.Prepared, len(e.Claims))
	var added []types.UID
	for _, c := range e.Claims {
		if pc, ok := a.claims[c.UID]; ok {
			out[c.UID] = pc.prepared()
			continue
		}
		pc, err := a.prepareClaim(c, pool)
		if err != nil {
			a.log.Warn("DRA claim not prepared", "claim", c.String(), "uid", c.UID, "error", err)
			out[c.UID] = dra.Prepared{Err: err}
			continue
		}
		a.claims[c.UID] = pc
		added = append(added, c.UID)
		out[c.UID] = pc.prepared()
		a.log.Info("DRA claim prepared", "claim", c.String(), "uid", c.UID, "devices", deviceNames(pc))
	}
	return out, added
}

func (a *Agent) prepareClaim(c dra.Claim, pool *dra.Pool) (PreparedClaim, error) {
	if len(c.Devices) == 0 {
		return PreparedClaim{}, fmt.Errorf("claim %s: no device of driver %s on this node is allocated to it", c, dra.DriverName)
	}
	pc := PreparedClaim{Namespace: c.Namespace, Name: c.Name, At: a.now()}
	byDevice := map[string]int{}
	for _, r := range c.Devices {
		if i, ok := byDevice[r.Device]; ok {
			// Two requests served by one device: one entry, both requests.
			pc.Devices[i].Requests = append(pc.Devices[i].Requests, r.Request)
			continue
		}
		d, ok := pool.Device(r.Device)
		if !ok {
			return PreparedClaim{}, fmt.Errorf("claim %s: request %q: device %q is not offered on this node (any more)", c, r.Request, r.Device)
		}
		if d.Unhealthy != "" {
			return PreparedClaim{}, fmt.Errorf("claim %s: request %q: device %s (%s) is unhealthy: %s", c, r.Request, r.Device, d.UUID, d.Unhealthy)
		}
		if by := a.heldElsewhere(d.UUID, c.UID); by != "" {
			return PreparedClaim{}, fmt.Errorf("claim %s: request %q: device %s (%s) is in use by %s", c, r.Request, r.Device, d.UUID, by)
		}
		byDevice[r.Device] = len(pc.Devices)
		pc.Devices = append(pc.Devices, PreparedClaimDevice{
			PreparedDevice: dra.PreparedDevice{Requests: []string{r.Request}, Device: r.Device, CDIDevices: []string{d.CDIDevice()}},
			UUID:           d.UUID,
		})
	}
	return pc, nil
}

// heldElsewhere names who, other than claim uid, holds the device: a
// container through the device plugin (the kubelet's answer or an
// allocation it has not listed yet), or another claim.
func (a *Agent) heldElsewhere(uuid string, uid types.UID) string {
	if hs := a.att.Holders(uuid); len(hs) > 0 {
		return hs[0].String() + " (device plugin)"
	}
	if at, ok := a.ledger[uuid]; ok {
		return "a container the device plugin gave it at " + at.UTC().Format(time.TimeOnly) + " UTC"
	}
	for other, pc := range a.claims {
		if other == uid {
			continue
		}
		for _, d := range pc.Devices {
			if d.UUID == uuid {
				return pc.String()
			}
		}
	}
	return ""
}

// unprepareClaims drops the claims from the ledger; unknown ones are
// already released.
func (a *Agent) unprepareClaims(e ClaimsUnprepare) (map[types.UID]error, []PreparedClaim) {
	out := make(map[types.UID]error, len(e.Claims))
	var removed []PreparedClaim
	for _, c := range e.Claims {
		out[c.UID] = nil
		pc, ok := a.claims[c.UID]
		if !ok {
			continue
		}
		delete(a.claims, c.UID)
		removed = append(removed, pc)
		a.log.Info("DRA claim unprepared", "claim", c.String(), "uid", c.UID, "devices", deviceNames(pc))
	}
	return out, removed
}

func deviceNames(pc PreparedClaim) []string {
	out := make([]string, 0, len(pc.Devices))
	for _, d := range pc.Devices {
		out = append(out, d.Device)
	}
	return out
}

// claimedUUIDs maps each device UUID a prepared claim holds to the claim.
func claimedUUIDs(claims map[types.UID]PreparedClaim) map[string]string {
	out := map[string]string{}
	for _, uid := range slices.Sorted(maps.Keys(claims)) {
		for _, d := range claims[uid].Devices {
			out[d.UUID] = claims[uid].String()
		}
	}
	return out
}

// planDRA is the pool the node offers through DRA: every device the
// inventory has, less those the device plugin's containers hold (a device
// goes one way at a time); devices prepared for claims stay in (the
// scheduler already counts them as allocated).
func planDRA(s Snapshot) *dra.Pool {
	if !s.DRA {
		return nil
	}
	all := dra.Devices(s.Inventory, s.Health.UnhealthyDevices())
	p := &dra.Pool{Devices: make([]dra.Device, 0, len(all))}
	for _, d := range all {
		_, claimed := s.Holdings.Claimed[d.UUID]
		if !claimed && (len(s.Holdings.Attribution.Holders(d.UUID)) > 0 || hasKey(s.Holdings.Allocated, d.UUID)) {
			continue
		}
		p.Devices = append(p.Devices, d)
	}
	return p
}

func hasKey[V any](m map[string]V, k string) bool {
	_, ok := m[k]
	return ok
}

// withholdClaimed marks every catalog device that stands for a device a
// claim holds (the device itself or its replicas) unavailable to the kubelet's
// device manager: a device goes one way at a time.
func withholdClaimed(cat *catalog.Catalog, claimed map[string]string) {
	if cat == nil || len(claimed) == 0 {
		return
	}
	for _, r := range cat.Resources {
		for i := range r.Devices {
			d := &r.Devices[i]
			by, ok := claimed[d.Spec.VisibleID]
			if !ok {
				continue
			}
			d.Healthy = false
			d.Reason = "prepared for " + by + " through DRA"
		}
	}
}

// claimReplies are the answers of one Step, sent once the ledger they
// describe is checkpointed.
type claimReplies struct {
	changed    bool
	prepares   []ClaimsPrepare
	prepared   []map[types.UID]dra.Prepared
	unprepares []ClaimsUnprepare
	released   []map[types.UID]error
}

func (r claimReplies) send() {
	for i, e := range r.prepares {
		e.Reply <- r.prepared[i] // buffered: the caller may have given up
	}
	for i, e := range r.unprepares {
		e.Reply <- r.released[i]
	}
}

// claimsStep releases, then prepares, the claims of one batch, and
// checkpoints the ledger before any answer leaves: a claim the kubelet
// was told is prepared is never forgotten by a restart, and one that could
// not be written is refused (the kubelet asks again).
func (a *Agent) claimsStep(prepares []ClaimsPrepare, unprepares []ClaimsUnprepare) claimReplies {
	r := claimReplies{prepares: prepares, unprepares: unprepares}
	if len(prepares)+len(unprepares) == 0 {
		return r
	}
	var removed []PreparedClaim
	for _, e := range unprepares {
		out, rm := a.unprepareClaims(e)
		r.released = append(r.released, out)
		removed = append(removed, rm...)
	}
	var added []types.UID
	if len(prepares) > 0 {
		pool := planDRA(a.snapshot())
		for _, e := range prepares {
			out, add := a.prepareClaims(e, pool)
			r.prepared = append(r.prepared, out)
			added = append(added, add...)
		}
	}
	if len(added)+len(removed) == 0 {
		return r
	}
	r.changed = true
	if err := a.checkpoint(); err != nil {
		for _, uid := range added {
			delete(a.claims, uid)
			for _, out := range r.prepared {
				if _, ok := out[uid]; ok {
					out[uid] = dra.Prepared{Err: fmt.Errorf("%w: %w", errCheckpoint, err)}
				}
			}
		}
		// Released claims stay released: their containers are gone, and
		// the next checkpoint that succeeds forgets them.
	}
	return r
}

// errCheckpoint is why a prepared claim was rolled back.
var errCheckpoint = errors.New("the claim could not be checkpointed, so a restart would forget it")

func (a *Agent) draStatus() *DRAStatus {
	st := &DRAStatus{Devices: []string{}}
	if a.draPool != nil {
		for _, d := range a.draPool.Devices {
			st.Devices = append(st.Devices, d.Name)
			if d.Unhealthy != "" {
				st.Unhealthy = append(st.Unhealthy, d.Name)
			}
		}
	}
	for _, uid := range slices.Sorted(maps.Keys(a.claims)) {
		pc := a.claims[uid]
		st.Claims = append(st.Claims, pc.Namespace+"/"+pc.Name+": "+strings.Join(deviceNames(pc), ", "))
	}
	return st
}
