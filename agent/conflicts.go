package agent

import (
	"fmt"
	"maps"
	"slices"
	"strings"

	"github.com/gpu-agent/gpu-agent/catalog"
)

// The GPU Operator's per-node switches for the components gpu-agent
// replaces: each DaemonSet runs on nodes where its label is "true"
// (docs/migrating.md).
const (
	LabelDeployMIGManager = "nvidia.com/gpu.deploy.mig-manager"
	LabelDeployGFD        = "nvidia.com/gpu.deploy.gpu-feature-discovery"
)

// Event reason of a conflict with another component on the node.
const ReasonConflict = "GPUPluginConflict"

// Conflicts is what of NVIDIA's components gpu-agent sees acting on its
// node, and what it does about each.
type Conflicts struct {
	// MIGManager: the node's LabelDeployMIGManager is "true", so
	// mig-manager acts on the same nvidia.com/mig.config label; no GPU is
	// repartitioned or reset.
	MIGManager bool `json:"migManager,omitempty"`
	// GFD: GPU feature discovery runs on the node (LabelDeployGFD); its
	// labels are left to it.
	GFD bool `json:"gfd,omitempty"`
	// Plugins maps each resource another device plugin serves on this
	// kubelet to its socket; gpu-agent does not offer it meanwhile.
	Plugins map[string]string `json:"plugins,omitempty"`
}

// nodeConflicts reads the label side of the conflicts from the Node's
// labels.
func nodeConflicts(labels map[string]string) (migManager, gfd bool) {
	return labels[LabelDeployMIGManager] == "true", labels[LabelDeployGFD] == "true"
}

// Messages says each conflict in a sentence, for /status, logs and Events.
func (c Conflicts) Messages() []string {
	var out []string
	if c.MIGManager {
		out = append(out, "mig-manager runs on this node ("+LabelDeployMIGManager+"=true) and acts on the same nvidia.com/mig.config label: no GPU is repartitioned until it is off (docs/migrating.md)")
	}
	if c.GFD {
		out = append(out, "GPU feature discovery runs on this node ("+LabelDeployGFD+"=true): its nvidia.com/gpu.* labels are left to it")
	}
	for _, r := range slices.Sorted(maps.Keys(c.Plugins)) {
		out = append(out, fmt.Sprintf("another device plugin serves %s on this kubelet (%s): gpu-agent does not offer it until that plugin is gone", r, c.Plugins[r]))
	}
	return out
}

// withoutResources is cat less the resources another plugin serves: the
// kubelet keeps one registration per resource, the latest, so two plugins
// serving one resource would take turns, each handing out devices the
// other does not know were taken.
func withoutResources(cat *catalog.Catalog, foreign map[string]string) *catalog.Catalog {
	if cat == nil || len(foreign) == 0 {
		return cat
	}
	out := &catalog.Catalog{Resources: map[string]*catalog.Resource{}}
	for name, r := range cat.Resources {
		if _, ok := foreign[name]; !ok {
			out.Resources[name] = r
		}
	}
	return out
}

// gfdLabel reports whether GPU feature discovery writes label k: the
// nvidia.com/ labels of NodeLabels but mig-manager's state label.
func gfdLabel(k string) bool {
	return strings.HasPrefix(k, "nvidia.com/") && k != LabelMIGConfigState
}

// withoutGFDLabels is labels less those GFD writes, where GFD runs: GFD wins
// its own labels, so the two never overwrite each other's values.
func withoutGFDLabels(labels map[string]string, gfd bool) map[string]string {
	if !gfd {
		return labels
	}
	maps.DeleteFunc(labels, func(k, _ string) bool { return gfdLabel(k) })
	return labels
}

// noteConflicts logs and reports a change of conflicts.
func (a *Agent) noteConflicts(c Conflicts) {
	before := a.conflicts.Messages()
	a.conflicts = c
	now := c.Messages()
	if slices.Equal(before, now) {
		return
	}
	for _, m := range now {
		if !slices.Contains(before, m) {
			a.log.Warn("conflict with another GPU component on this node", "conflict", m)
			a.event(true, ReasonConflict, "%s", m)
		}
	}
	for _, m := range before {
		if !slices.Contains(now, m) {
			a.log.Info("conflict over", "conflict", m)
		}
	}
}

// conflictsWith is what the node's labels and the kubelet's other plugins
// say now; only the resources cat offers conflict.
func (a *Agent) conflictsWith(cat *catalog.Catalog) Conflicts {
	var c Conflicts
	c.MIGManager, c.GFD = nodeConflicts(a.labels)
	if a.opts.ForeignPlugins == nil || cat == nil {
		return c
	}
	for r, sock := range a.opts.ForeignPlugins() {
		if _, ours := cat.Resources[r]; ours {
			if c.Plugins == nil {
				c.Plugins = map[string]string{}
			}
			c.Plugins[r] = sock
		}
	}
	return c
}
