package imex

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"slices"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/stateformat"
	"k8s.io/apimachinery/pkg/types"
)

// StateFile is the driver's checkpoint in the agent's state directory.
const StateFile = "compute-domain.json"

// stateFormat is the checkpoint's format: 1.0 is the first; 1.1 adds a
// device's shareID (a 1.0 reader answers Prepare without it, as 1.0 did).
var stateFormat = stateformat.Format{Reads: []stateformat.Version{{Major: 1, Minor: 1}}}

// maxStateBytes bounds the checkpoint: a claim record is some hundred
// bytes, and a node has at most as many claims as channels.
const maxStateBytes = 16 << 20

// Kind is what a prepared claim is for.
type Kind string

// The kinds of claims.
const (
	KindChannel Kind = "channel"
	KindDaemon  Kind = "daemon"
)

// PreparedClaim is one claim the driver prepared: which domain, which of
// the pool's devices the scheduler gave it, and which host channels it
// got for them.
type PreparedClaim struct {
	UID       types.UID `json:"uid"`
	Namespace string    `json:"namespace"`
	Name      string    `json:"name"`
	Kind      Kind      `json:"kind"`
	// Domain is the ComputeDomain's UID (the opaque config's domainID).
	Domain string              `json:"domain"`
	Mode   cdv1.AllocationMode `json:"mode,omitempty"`
	// Devices are the allocation's devices, Requests what each serves.
	Devices []ClaimDevice `json:"devices"`
	// Channels are the host channels the claim's containers get; the
	// domain's own (isolation), not the allocated device's id.
	Channels []int `json:"channels,omitempty"`
}

// ClaimDevice is one allocated device of a claim: a device, or one share
// of a device that allows multiple allocations.
type ClaimDevice struct {
	Requests []string `json:"requests"`
	Device   string   `json:"device"`
	// ShareID is the allocation's share of the device (DRAConsumableCapacity),
	// nil for a device allocated whole.
	ShareID *types.UID `json:"shareID,omitempty"`
}

// checkpoint is the file's content.
type checkpoint struct {
	Version int             `json:"version"`
	Minor   int             `json:"minor"`
	Claims  []PreparedClaim `json:"claims"`
}

// loadState reads the checkpoint in dir. A missing file is no claims; one
// that cannot be read is set aside (the claims it held are prepared again
// by the kubelet, which calls Prepare on restart); one of a newer major is
// an error (*stateformat.NewerError) and left in place.
func loadState(dir string) ([]PreparedClaim, error) {
	path := filepath.Join(dir, StateFile)
	b, err := atomicfile.ReadFile(path, maxStateBytes)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	var claims []PreparedClaim
	if err == nil {
		claims, err = decodeState(b)
		if newer := (*stateformat.NewerError)(nil); errors.As(err, &newer) {
			return nil, fmt.Errorf("%s: %w", path, err)
		}
		if err == nil {
			return claims, nil
		}
	}
	_, err = atomicfile.SetAside(path, err)
	return nil, err
}

// checkClaims refuses a checkpoint whose claims cannot be what the driver
// wrote: a claim twice, a kind it does not know, no domain.
func checkClaims(claims []PreparedClaim) error {
	seen := map[types.UID]bool{}
	for i, c := range claims {
		switch {
		case c.UID == "" || seen[c.UID]:
			return fmt.Errorf("claims[%d]: uid %q empty or given twice", i, c.UID)
		case c.Kind != KindChannel && c.Kind != KindDaemon:
			return fmt.Errorf("claims[%d] (%s): kind %q", i, c.UID, c.Kind)
		case c.Domain == "":
			return fmt.Errorf("claims[%d] (%s): no domain", i, c.UID)
		case slices.ContainsFunc(c.Channels, func(ch int) bool { return ch < 0 || ch >= maxChannels }):
			return fmt.Errorf("claims[%d] (%s): channel out of range", i, c.UID)
		}
		seen[c.UID] = true
	}
	return nil
}

// saveState writes the checkpoint atomically.
func saveState(dir string, claims []PreparedClaim) error {
	v := stateFormat.Current()
	b, err := json.Marshal(checkpoint{Version: v.Major, Minor: v.Minor, Claims: claims})
	if err != nil {
		return err
	}
	if err := atomicfile.Write(filepath.Join(dir, StateFile), b); err != nil {
		return fmt.Errorf("compute-domain checkpoint: %w", err)
	}
	return nil
}

// decodeState is loadState's decoding alone, for the fuzz target.
func decodeState(b []byte) ([]PreparedClaim, error) {
	var cp checkpoint
	if _, err := stateFormat.Decode(b, &cp); err != nil {
		return nil, err
	}
	return cp.Claims, checkClaims(cp.Claims)
}
