package ledger

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mps"
)

// Claim is a DRA claim prepared on this node, or what one left to undo
// (an intent, a release): the ledger's DRA side, checkpointed as it is.
type Claim struct {
	Namespace string        `json:"namespace"`
	Name      string        `json:"name"`
	Devices   []ClaimDevice `json:"devices"`
	At        time.Time     `json:"at"`
}

// ClaimDevice is one device of a prepared claim.
type ClaimDevice struct {
	dra.PreparedDevice
	UUID string `json:"uuid"`
	// Created: the MIG device was created for this claim (dynamic MIG) on
	// GPU Parent, profile Profile at Placement; Unprepare destroys it.
	Created      bool          `json:"created,omitempty"`
	Parent       string        `json:"parent,omitempty"`
	Profile      string        `json:"profile,omitempty"`
	ProfileIndex int           `json:"profileIndex,omitempty"`
	Placement    gpu.Placement `json:"placement,omitzero"`
	// MPSEnv is the MPS client environment the claim's spec gives its
	// containers (a shared device under MPS).
	MPSEnv map[string]string `json:"mpsEnv,omitempty"`
	// MPSDaemon is the daemon the claim's opaque config asked for on a
	// device the node's config does not share by MPS: it runs while the
	// claim holds the device.
	MPSDaemon *mps.Daemon `json:"mpsDaemon,omitempty"`
	// Interval is the time slice the claim's config set on the GPU.
	Interval devicemodel.Interval `json:"interval,omitempty"`
	// Shares is how many shares of a shared device the claim took.
	Shares int64 `json:"shares,omitempty"`
	// AdminAccess: given for administrative access; it holds nothing.
	AdminAccess bool `json:"adminAccess,omitempty"`
}

// samePlace reports whether d and o are the MIG device of one profile at
// one placement of one GPU (an intent and the device made for it).
func (d ClaimDevice) samePlace(o ClaimDevice) bool {
	return d.Parent == o.Parent && d.Placement == o.Placement && d.Profile == o.Profile
}

func (c Claim) String() string { return "ResourceClaim " + c.Namespace + "/" + c.Name }

// Prepared is the claim as the DRA driver answers the kubelet.
func (c Claim) Prepared() dra.Prepared {
	out := dra.Prepared{Devices: make([]dra.PreparedDevice, 0, len(c.Devices))}
	for _, d := range c.Devices {
		out.Devices = append(out.Devices, d.PreparedDevice)
	}
	return out
}

// DeviceNames lists the claim's devices, for logs.
func (c Claim) DeviceNames() []string {
	out := make([]string, 0, len(c.Devices))
	for _, d := range c.Devices {
		out = append(out, d.Device)
	}
	return out
}

// Describe lists what a release or intent record still has to undo.
func (c Claim) Describe() string {
	left := []string{}
	for _, d := range c.Devices {
		switch {
		case d.UUID != "":
			left = append(left, d.UUID)
		default:
			left = append(left, fmt.Sprintf("%s at %d on %s (to be made)", d.Profile, d.Placement.Start, d.Parent))
		}
	}
	if len(left) == 0 {
		left = append(left, "CDI spec")
	}
	return c.Namespace + "/" + c.Name + ": " + strings.Join(left, ", ")
}

// clone copies c, its device list included: the ledger shortens and
// appends to its own lists, which a caller's copy must not see.
func (c Claim) clone() Claim {
	c.Devices = slices.Clone(c.Devices)
	return c
}

// cloneClaims copies m for a caller.
func cloneClaims(m map[types.UID]Claim) map[types.UID]Claim {
	out := make(map[types.UID]Claim, len(m))
	for uid, c := range m {
		out[uid] = c.clone()
	}
	return out
}

// Claim is the prepared claim uid, if the ledger holds it.
func (l *Ledger) Claim(uid types.UID) (Claim, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.claims[uid]
	return c.clone(), ok
}

// Claims copies the prepared claims, by claim UID.
func (l *Ledger) Claims() map[types.UID]Claim {
	l.mu.Lock()
	defer l.mu.Unlock()
	return cloneClaims(l.claims)
}

// Intents copies the MIG devices being made for claims being prepared, by
// claim UID.
func (l *Ledger) Intents() map[types.UID]Claim {
	l.mu.Lock()
	defer l.mu.Unlock()
	return cloneClaims(l.intents)
}

// Release is what released claim uid left to undo, if anything.
func (l *Ledger) Release(uid types.UID) (Claim, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	c, ok := l.releases[uid]
	return c.clone(), ok
}

// Releases copies what released claims left to undo, by claim UID.
func (l *Ledger) Releases() map[types.UID]Claim {
	l.mu.Lock()
	defer l.mu.Unlock()
	return cloneClaims(l.releases)
}

// Dynamic reports whether a claim turned GPU uuid's MIG mode on (so it
// goes back off once the claims' MIG devices are gone).
func (l *Ledger) Dynamic(uuid string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.dynamicMIG[uuid]
}

// ClaimedAt names the claim whose MIG device (prepared, being made, or to
// be destroyed) is recorded at a placement overlapping pl on GPU uuid (""
// when none).
func (l *Ledger) ClaimedAt(uuid string, pl gpu.Placement) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, set := range []map[types.UID]Claim{l.claims, l.intents, l.releases} {
		for _, uid := range slices.Sorted(maps.Keys(set)) {
			for _, d := range set[uid].Devices {
				if d.Created && d.Parent == uuid && d.Placement.Overlaps(pl) {
					return set[uid].String()
				}
			}
		}
	}
	return ""
}

// HasClaim reports whether the ledger holds prepared claim uid.
func (l *Ledger) HasClaim(uid types.UID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.claims[uid]
	return ok
}

// HasRelease reports whether released claim uid left something to undo.
func (l *Ledger) HasRelease(uid types.UID) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	_, ok := l.releases[uid]
	return ok
}
