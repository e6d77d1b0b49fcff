package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/ledger"
)

// The DRA driver's requests as loop events, the claim records of the
// ledger, and the loop's handling of a batch of requests (claimsStep).

// DRAPublisher publishes the node's DRA pool (dra.Driver); it must not block.
type DRAPublisher interface {
	Publish(p *devicemodel.Pool)
}

// ClaimsPrepare asks the loop to prepare claims (the DRA driver's
// NodePrepareResources); the answer goes to Reply once it is checkpointed.
type ClaimsPrepare struct {
	Claims []dra.Claim
	Reply  chan<- map[types.UID]dra.Prepared
	// GaveUp, when set, says whether the caller stopped waiting: a request
	// it gave up on is not acted upon (its claims could stay prepared with
	// nobody to release them).
	GaveUp func() bool
}

// ClaimsUnprepare asks the loop to release claims.
type ClaimsUnprepare struct {
	Claims []dra.ClaimRef
	Reply  chan<- map[types.UID]error
}

func (ClaimsPrepare) kind() string   { return "dra-prepare" }
func (ClaimsUnprepare) kind() string { return "dra-unprepare" }

// PreparedClaim and PreparedClaimDevice are the ledger's record of a
// prepared claim, under the names the agent's checkpoint and tests use.
type (
	PreparedClaim       = ledger.Claim
	PreparedClaimDevice = ledger.ClaimDevice
)

// PrepareClaims implements dra.Claims: it hands the claims to the loop and
// waits for its answer.
func (a *Agent) PrepareClaims(ctx context.Context, claims []dra.Claim) (map[types.UID]dra.Prepared, error) {
	reply := make(chan map[types.UID]dra.Prepared, 1)
	a.inbox.Post(ClaimsPrepare{Claims: claims, Reply: reply, GaveUp: func() bool { return ctx.Err() != nil }})
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

// claimReplies are the answers of one Step, sent once the ledger they
// describe is checkpointed.
type claimReplies struct {
	changed bool
	send    []func()
}

func (r claimReplies) sendAll() {
	for _, f := range r.send {
		f() // buffered channels: the caller may have given up
	}
}

// claimsStep prepares and releases the claims of one batch, in the order
// the kubelet asked (a Prepare it gave up on, then its Unprepare, leaves
// nothing prepared), and checkpoints the ledger before any answer leaves:
// a claim the kubelet was told is prepared is never forgotten by a
// restart, and one that could not be written is refused (the kubelet asks
// again).
func (a *Agent) claimsStep(events []Event) claimReplies {
	var r claimReplies
	if len(events) == 0 {
		return r
	}
	invBefore, relBefore, pendBefore := a.inv, a.releasingNow(), maps.Clone(a.mpsPending)
	var removed []PreparedClaim
	var added []types.UID
	var prepared []map[types.UID]dra.Prepared
	for _, ev := range events {
		switch e := ev.(type) {
		case ClaimsUnprepare:
			out, rm := a.unprepareClaims(e)
			removed = append(removed, rm...)
			r.send = append(r.send, func() { e.Reply <- out })
		case ClaimsPrepare:
			var out map[types.UID]dra.Prepared
			if e.GaveUp != nil && e.GaveUp() {
				out = map[types.UID]dra.Prepared{}
				for _, c := range e.Claims {
					out[c.UID] = dra.Prepared{Err: fmt.Errorf("claim %s: the kubelet stopped waiting before the agent got to it", c)}
				}
			} else {
				var add []types.UID
				out, add = a.prepareClaims(e)
				added = append(added, add...)
			}
			prepared = append(prepared, out)
			r.send = append(r.send, func() { e.Reply <- out })
		}
	}
	if len(added)+len(removed) == 0 {
		// A claim that failed may still have changed the node (MIG mode,
		// a device left to destroy): plan for what is there now.
		// So may one whose MPS daemon is to be started first.
		r.changed = a.inv != invBefore || !maps.Equal(relBefore, a.releasingNow()) || !maps.Equal(pendBefore, a.mpsPending)
		return r
	}
	r.changed = true
	if err := a.checkpoint(); err == nil {
		for _, uid := range added {
			if a.ledger.HasClaim(uid) {
				a.ledger.DropIntents(uid)
			}
		}
	} else {
		for _, uid := range added {
			pc, ok := a.ledger.Claim(uid)
			if !ok {
				continue
			}
			a.release(uid, pc, true)
			for _, out := range prepared {
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
			if d.Cordoned != "" {
				st.Cordoned = append(st.Cordoned, d.Name)
			}
		}
	}
	if a.spares.open != nil && a.inv != nil {
		for _, g := range a.inv.GPUs {
			if since, ok := a.spares.opening[g.UUID]; ok {
				st.Opening = append(st.Opening, ClosingMIGGPU{GPU: g.Index, At: since.Add(a.opts.MIGCloseGrace)})
			}
			since, ok := a.spares.open[g.UUID]
			switch {
			case !ok:
			case since.IsZero():
				st.OpenGPUs = append(st.OpenGPUs, g.Index)
			default:
				st.OpenGPUs = append(st.OpenGPUs, g.Index)
				st.Closing = append(st.Closing, ClosingMIGGPU{GPU: g.Index, At: since.Add(a.opts.MIGCloseGrace)})
			}
		}
	}
	claims := a.ledger.Claims()
	for _, uid := range slices.Sorted(maps.Keys(claims)) {
		pc := claims[uid]
		st.Claims = append(st.Claims, pc.Namespace+"/"+pc.Name+": "+strings.Join(pc.DeviceNames(), ", "))
	}
	for _, set := range []map[types.UID]PreparedClaim{a.ledger.Releases(), a.ledger.Intents()} {
		for _, uid := range slices.Sorted(maps.Keys(set)) {
			st.Releasing = append(st.Releasing, set[uid].Describe())
		}
	}
	return st
}

// releasingNow maps what released claims left, and intents, to the claim
// (releasingUUIDs of the ledger now).
func (a *Agent) releasingNow() map[string]string {
	return releasingUUIDs(a.ledger.Releases(), a.ledger.Intents(), a.inv, claimedUUIDs(a.ledger.Claims()))
}
