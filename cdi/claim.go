package cdi

import (
	"fmt"
	"maps"
	"slices"

	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpu-agent/gpu-agent/catalog"
)

// ClaimDevice is what one device of a DRA claim gives a container besides
// the node spec's device nodes: the claim's own environment and mounts (an
// MPS client's pipe directory and limits). It lives in a spec of the claim's
// own, written at Prepare and removed at Unprepare.
type ClaimDevice struct {
	Name   string
	Env    map[string]string
	Mounts []catalog.Mount
}

// ClaimSpecName is the spec file (without extension) of claim uid.
func ClaimSpecName(uid string) string { return NodeSpec + "-claim-" + uid }

// ClaimDeviceName names device i of claim uid in its spec.
func ClaimDeviceName(uid string, i int) string { return fmt.Sprintf("claim-%s-%d", uid, i) }

// claimSpec is the spec of a claim's devices, under the node spec's kind.
func claimSpec(devs []ClaimDevice) (*specs.Spec, error) {
	s := &specs.Spec{Kind: Kind}
	for _, d := range devs {
		var e specs.ContainerEdits
		for _, k := range slices.Sorted(maps.Keys(d.Env)) {
			e.Env = append(e.Env, k+"="+d.Env[k])
		}
		for _, m := range d.Mounts {
			opts := []string{"rbind", "nosuid", "nodev", "rw"}
			if m.ReadOnly {
				opts[3] = "ro"
			}
			e.Mounts = append(e.Mounts, &specs.Mount{HostPath: m.HostPath, ContainerPath: m.ContainerPath, Type: "bind", Options: opts})
		}
		s.Devices = append(s.Devices, specs.Device{Name: d.Name, ContainerEdits: e})
	}
	v, err := minimumVersion(s)
	if err != nil {
		return nil, err
	}
	s.Version = v
	return s, nil
}

// WriteClaim writes claim uid's spec.
func (k *Keeper) WriteClaim(uid string, devs []ClaimDevice) error {
	s, err := claimSpec(devs)
	if err != nil {
		return err
	}
	_, err = k.W.Write(ClaimSpecName(uid), s)
	return err
}

// ClaimPath is the file claim uid's spec is written to.
func (k *Keeper) ClaimPath(uid string) string { return k.W.Path(ClaimSpecName(uid)) }

// RemoveClaim removes claim uid's spec.
func (k *Keeper) RemoveClaim(uid string) error {
	_, err := k.W.Write(ClaimSpecName(uid), nil)
	return err
}

// RemoveStaleClaims removes the specs of claims keep does not name (the
// ledger at start: a claim unprepared while the agent was down).
func (k *Keeper) RemoveStaleClaims(keep func(uid string) bool) ([]string, error) {
	return k.W.RemoveStale(func(name string) bool {
		if name == NodeSpec {
			return true
		}
		uid, _ := cutClaim(name)
		return keep(uid)
	})
}

func cutClaim(name string) (string, bool) {
	const prefix = NodeSpec + "-claim-"
	if len(name) <= len(prefix) || name[:len(prefix)] != prefix {
		return "", false
	}
	return name[len(prefix):], true
}
