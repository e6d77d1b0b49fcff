package agent

import (
	"fmt"

	"k8s.io/apimachinery/pkg/util/version"

	"github.com/gpu-agent/gpu-agent/config"
)

// ControlPlaneChanged carries the API server's version (GET /version's
// gitVersion, "v1.36.3"), which the scheduler's is taken to match: the
// cost of some device models depends on it (docs/dra-devices.md, "Scale").
type ControlPlaneChanged struct{ Version string }

func (ControlPlaneChanged) kind() string { return "control-plane" }

// countersEveryNode is the last minor version of Kubernetes whose
// scheduler gathers every node's counter sets at every node's Filter call
// (k8s.io/dynamic-resource-allocation before v0.37).
const countersEveryNode = 36

// countersWarning says, where sel offers MIG on demand on counters (no
// spareLayout) and the control plane's scheduler gathers every node's
// counter sets at every node, what that costs and what to do instead.
// Nothing when the version is not known.
func countersWarning(controlPlane string, sel config.Selected) string {
	if sel.Config == nil || controlPlane == "" {
		return ""
	}
	od := sel.Config.DRA.MIGOnDemand
	if od == nil || !od.Enabled || od.SpareLayout != nil {
		return ""
	}
	v, err := version.ParseGeneric(controlPlane)
	if err != nil || v.Major() != 1 || v.Minor() > countersEveryNode {
		return ""
	}
	return fmt.Sprintf("configs.%s.dra.migOnDemand: the control plane is Kubernetes %s, whose scheduler gathers every node's counter sets at every node: "+
		"MIG on demand on counters makes scheduling slow down with the square of the nodes that use it (docs/dra-devices.md, \"Scale\"); "+
		"set spareLayout (deploy/examples/dra-mig-on-demand.yaml), which publishes none, or serve MIG claims from a static layout", sel.Name, controlPlane)
}
