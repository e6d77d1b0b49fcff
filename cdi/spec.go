// Package cdi generates the Container Device Interface spec of the node's
// GPUs and MIG devices and keeps it on disk in step with the inventory.
//
// The spec uses NVIDIA's kind, nvidia.com/gpu, and the device names NVIDIA's
// own generator (nvidia-ctk cdi generate) gives, so that a pod annotation,
// a runtime config or a DRA claim written for NVIDIA's specs resolves here
// too: each GPU by UUID and by index ("GPU-…", "0"), each MIG device by UUID
// and by "<gpu>:<mig>" ("MIG-…", "0:1"), and "all". The spec carries device
// nodes only; the driver's user-space libraries still reach containers the
// way they do today (the NVIDIA container toolkit).
package cdi

import (
	"errors"
	"fmt"
	"path/filepath"
	"slices"
	"strconv"

	cdiapi "tags.cncf.io/container-device-interface/pkg/cdi"
	"tags.cncf.io/container-device-interface/pkg/parser"
	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// Vendor and Class make the kind of every device the agent names: device
// plugin responses (cdi-annotations, cdi-cri) and DRA Prepare answers alike.
const (
	Vendor = "nvidia.com"
	Class  = "gpu"
	Kind   = Vendor + "/" + Class
)

// QualifiedName is the fully qualified CDI name of device id ("nvidia.com/gpu=<id>").
func QualifiedName(id string) string { return Kind + "=" + id }

// ControlNodes are the driver's device nodes every GPU container needs; a
// node the host lacks is left out (nvidia-uvm-tools often is).
var ControlNodes = []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}

// CapMinors answers which /dev/nvidia-caps/nvidia-cap<N> grants access to a
// MIG GPU instance (ci < 0) or to a compute instance in it.
type CapMinors interface {
	CapMinor(gpuMinor, gi, ci int) (int, bool)
}

// Host is what the spec needs from the machine beyond the inventory.
type Host struct {
	// DevRoot is where the driver's /dev lives on the host ("/" normally,
	// the driver container's root under the GPU Operator). Containers see
	// the nodes at /dev whatever it is.
	DevRoot string
	// Caps resolves MIG access capabilities (nil: no MIG device can be
	// described, which Build reports).
	Caps CapMinors
	// Exists says whether a host path exists (nil: assume it does).
	Exists func(path string) bool
}

// Build returns the spec of the GPUs and MIG devices in inv. A MIG device
// whose capability minors are unknown is left out (a spec that listed it
// without them would give containers a device they cannot open), and so is
// a name CDI does not allow (the device keeps its other names); each is
// named in the error, which comes with the spec of everything else: one
// device's trouble must not take every GPU's CDI name away.
func Build(inv *gpu.Inventory, h Host) (*specs.Spec, error) {
	if inv == nil || len(inv.GPUs) == 0 {
		return nil, nil
	}
	s := &specs.Spec{Kind: Kind}
	var all []*specs.DeviceNode
	var errs []error
	// add names the device what with nodes. A name CDI does not allow is left
	// out and named in the error: the spec is validated as a whole, so one
	// such name would keep every device from being written. The old MIG UUIDs
	// ("MIG-GPU-<uuid>/<gi>/<ci>", drivers before R470) have slashes; such a
	// device is still reached as "<gpu>:<mig>" and through "all".
	add := func(what string, nodes []*specs.DeviceNode, names ...string) {
		for _, n := range names {
			if err := parser.ValidateDeviceName(n); err != nil {
				errs = append(errs, fmt.Errorf("cdi: %s: name %q left out: %w", what, n, err))
				continue
			}
			s.Devices = append(s.Devices, specs.Device{Name: n, ContainerEdits: specs.ContainerEdits{DeviceNodes: nodes}})
		}
		for _, n := range nodes {
			if !slices.ContainsFunc(all, func(o *specs.DeviceNode) bool { return o.Path == n.Path }) {
				all = append(all, n)
			}
		}
	}
	for _, g := range inv.GPUs {
		gpuNode := h.node(fmt.Sprintf("/dev/nvidia%d", g.Minor))
		// A GPU in MIG mode is still named whole (nvidia-smi in a container
		// that has it sees every instance), as NVIDIA's generator does.
		add(fmt.Sprintf("GPU %d", g.Index), []*specs.DeviceNode{gpuNode}, g.UUID, strconv.Itoa(g.Index))
		if !g.MIG.Current {
			continue
		}
		for _, m := range g.Instances {
			if h.Caps == nil {
				errs = append(errs, fmt.Errorf("cdi: GPU %d MIG device %s left out: no MIG capability table to find its access devices", g.Index, m.UUID))
				continue
			}
			giCap, ok1 := h.Caps.CapMinor(g.Minor, m.GI, -1)
			ciCap, ok2 := h.Caps.CapMinor(g.Minor, m.GI, m.CI)
			if !ok1 || !ok2 {
				errs = append(errs, fmt.Errorf("cdi: GPU %d MIG device %s (gi %d, ci %d) left out: the driver's MIG capability table does not list its access devices",
					g.Index, m.UUID, m.GI, m.CI))
				continue
			}
			nodes := []*specs.DeviceNode{gpuNode,
				h.node(fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", giCap)),
				h.node(fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", ciCap))}
			add(fmt.Sprintf("GPU %d MIG device %d:%d", g.Index, g.Index, m.Index), nodes, m.UUID, fmt.Sprintf("%d:%d", g.Index, m.Index))
		}
	}
	s.Devices = append(s.Devices, specs.Device{Name: "all", ContainerEdits: specs.ContainerEdits{DeviceNodes: all}})
	for _, p := range ControlNodes {
		n := h.node(p)
		if h.Exists == nil || h.Exists(hostPath(n)) {
			s.ContainerEdits.DeviceNodes = append(s.ContainerEdits.DeviceNodes, n)
		}
	}
	v, err := minimumVersion(s)
	if err != nil {
		return nil, err
	}
	s.Version = v
	return s, errors.Join(errs...)
}

// minimumVersion is the oldest CDI version that can hold s: runtimes that
// bundle an older CDI library still read it.
func minimumVersion(s *specs.Spec) (string, error) {
	v, err := cdiapi.MinimumRequiredVersion(s)
	if err != nil {
		return "", fmt.Errorf("cdi: %w", err)
	}
	return v, nil
}

// node is the device node at container path p, found on the host under DevRoot.
func (h Host) node(p string) *specs.DeviceNode {
	n := &specs.DeviceNode{Path: p}
	if h.DevRoot != "" && h.DevRoot != "/" {
		n.HostPath = filepath.Join(h.DevRoot, p)
	}
	return n
}

func hostPath(n *specs.DeviceNode) string {
	if n.HostPath != "" {
		return n.HostPath
	}
	return n.Path
}
