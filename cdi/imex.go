package cdi

import (
	"errors"
	"fmt"
	"io/fs"
	"maps"
	"os"
	"slices"
	"strings"

	specs "tags.cncf.io/container-device-interface/specs-go"
)

// IMEXKind is the CDI kind of the compute-domain.nvidia.com driver's
// claims: one device per claim, named by the claim's UID.
const IMEXKind = "compute-domain.nvidia.com/claim"

// imexSpecPrefix starts the spec files of compute-domain claims; apart
// from NodeSpec's claim specs, so neither driver's stale-spec sweep
// removes the other's.
const imexSpecPrefix = "compute-domain-claim-"

// IMEXSpecName is the spec file (without extension) of claim uid.
func IMEXSpecName(uid string) string { return imexSpecPrefix + uid }

// IMEXDeviceName is the qualified CDI name of claim uid's device.
func IMEXDeviceName(uid string) string { return IMEXKind + "=" + uid }

// CharDevice is a character device node a claim's containers get.
type CharDevice struct {
	// Path is the node in the container; HostPath the host's node.
	Path, HostPath string
	Major, Minor   int64
}

// IMEXClaimSpec is the spec of claim uid: its device nodes (IMEX channels,
// mode 0666 as the driver makes them) and environment.
func IMEXClaimSpec(uid string, nodes []CharDevice, env map[string]string) (*specs.Spec, error) {
	var e specs.ContainerEdits
	mode := fs.FileMode(0o666)
	for _, n := range nodes {
		e.DeviceNodes = append(e.DeviceNodes, &specs.DeviceNode{Path: n.Path, HostPath: n.HostPath, Type: "c",
			Major: n.Major, Minor: n.Minor, FileMode: &mode, Permissions: "rw"})
	}
	for _, k := range slices.Sorted(maps.Keys(env)) {
		e.Env = append(e.Env, k+"="+env[k])
	}
	s := &specs.Spec{Kind: IMEXKind, Devices: []specs.Device{{Name: uid, ContainerEdits: e}}}
	v, err := minimumVersion(s)
	if err != nil {
		return nil, fmt.Errorf("cdi: claim %s: %w", uid, err)
	}
	s.Version = v
	return s, nil
}

// RemoveStaleIMEX removes the compute-domain claim specs in w's directory
// whose claim keep does not name, and returns the claims removed.
func RemoveStaleIMEX(w *Writer, keep func(uid string) bool) ([]string, error) {
	entries, err := os.ReadDir(w.dir)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cdi: %w", err)
	}
	var removed []string
	var errs []error
	for _, e := range entries {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		uid, mine := strings.CutPrefix(name, imexSpecPrefix)
		if !ok || !mine || !e.Type().IsRegular() || keep(uid) {
			continue
		}
		if _, err := w.remove(name); err != nil {
			errs = append(errs, err)
			continue
		}
		removed = append(removed, uid)
	}
	return removed, errors.Join(errs...)
}
