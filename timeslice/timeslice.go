// Package timeslice advertises a device several times so that the CUDA time
// slicer shares it between containers, and maps replica IDs back to the
// device they share. It is pure: catalog devices in, catalog devices out.
package timeslice

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
)

// Sep separates a device ID from its replica number, as NVIDIA's plugin
// writes replica IDs ("GPU-<uuid>::3"), so tools that parse them keep working.
const Sep = "::"

// ReplicaID is the ID of replica n (from 0) of the device parent.
func ReplicaID(parent string, n int) string { return parent + Sep + strconv.Itoa(n) }

// Parent splits a replica ID; ok is false for an ID that is no replica.
func Parent(id string) (parent string, n int, ok bool) {
	p, num, found := strings.Cut(id, Sep)
	if !found || p == "" {
		return "", 0, false
	}
	n, err := strconv.Atoi(num)
	if err != nil || n < 0 || strconv.Itoa(n) != num {
		return "", 0, false
	}
	return p, n, true
}

// Expand returns replicas copies of each device, IDs <ID>::0..replicas-1.
// A replica shares everything else with its device: health, NUMA node, GPU
// and what a container receives (NVIDIA_VISIBLE_DEVICES names the device
// itself, so two replicas of one GPU in a container name it once).
func Expand(devs []catalog.Device, replicas int) []catalog.Device {
	out := make([]catalog.Device, 0, len(devs)*replicas)
	for _, d := range devs {
		for n := range replicas {
			r := d
			r.ID, r.Replica = ReplicaID(d.ID, n), true
			out = append(out, r)
		}
	}
	return out
}

// Select returns the devices a sharing entry selects among devs (the
// resource's physical devices, in GPU order): all of them, the first Count,
// or those its list names by GPU index or UUID. field names the entry in
// errors ("configs.default.sharing.timeSlicing.resources[0].devices").
func Select(sel config.ReplicaDevices, devs []catalog.Device, field string) ([]catalog.Device, error) {
	switch {
	case sel.All || sel.IsZero():
		return devs, nil
	case sel.Count > 0:
		if sel.Count > len(devs) {
			return nil, fmt.Errorf("%s: %d devices asked for, the node has %d", field, sel.Count, len(devs))
		}
		return devs[:sel.Count], nil
	}
	var out []catalog.Device
	for i, ref := range sel.List {
		if strings.Contains(ref, ":") || strings.HasPrefix(ref, "MIG-GPU-") {
			// Resolving "gpu:mig" indices needs the MIG device index, which
			// the catalog does not carry yet; say so rather than guess.
			return nil, fmt.Errorf("%s[%d]: %q: MIG index references are not supported yet; name the MIG device by its UUID (MIG-...)", field, i, ref)
		}
		idx := slices.IndexFunc(devs, func(d catalog.Device) bool { return matches(d, ref) })
		if idx < 0 {
			return nil, fmt.Errorf("%s[%d]: %q names no device of this resource on this node", field, i, ref)
		}
		if slices.ContainsFunc(out, func(d catalog.Device) bool { return d.ID == devs[idx].ID }) {
			return nil, fmt.Errorf("%s[%d]: %q selects a device already selected", field, i, ref)
		}
		out = append(out, devs[idx])
	}
	return out, nil
}

func matches(d catalog.Device, ref string) bool {
	if n, err := strconv.Atoi(ref); err == nil {
		// An index names a whole GPU, never one of its MIG devices.
		return n == d.GPU && strings.HasPrefix(d.ID, "GPU-")
	}
	return ref == d.ID || ref == d.Spec.VisibleID
}
