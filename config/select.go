package config

import "fmt"

// SelectReason says why a config was chosen for a node.
type SelectReason string

// Selection reasons, in order of precedence.
const (
	ReasonNodeEntry SelectReason = "node entry"
	ReasonNodeLabel SelectReason = "node label"
	ReasonDefault   SelectReason = "default"
)

// Selected is the config chosen for one node, with its MIG layout resolved.
type Selected struct {
	// Name of the config under configs.
	Name   string
	Reason SelectReason
	Config *Config
	// MIGLayout is the config's mig.devices, or the mig-configs entry named by
	// mig.migPartedConfig; nil when the config leaves MIG alone. The planner
	// checks it against the node's GPUs (indices, models, profiles).
	MIGLayout MigLayout
}

// Select picks the config for a node: the node's entry under nodes:, else
// the node's ConfigLabel label, else the config named "default".
func (f *File) Select(nodeName string, labels map[string]string) (Selected, error) {
	var name string
	var reason SelectReason
	if n, ok := f.Nodes[nodeName]; ok && nodeName != "" {
		name, reason = n, ReasonNodeEntry
	} else if l := labels[ConfigLabel]; l != "" {
		name, reason = l, ReasonNodeLabel
	} else {
		name, reason = DefaultConfigName, ReasonDefault
	}
	c, ok := f.Configs[name]
	switch {
	case ok && c != nil:
	case reason == ReasonNodeLabel:
		return Selected{}, fmt.Errorf("node %s: label %s=%s names a config that is not defined", nodeName, ConfigLabel, name)
	case reason == ReasonNodeEntry:
		return Selected{}, fmt.Errorf("node %s: nodes entry names config %q, which is not defined", nodeName, name)
	default:
		return Selected{}, fmt.Errorf("node %s: no nodes entry, no %s label and no %q config", nodeName, ConfigLabel, DefaultConfigName)
	}
	s := Selected{Name: name, Reason: reason, Config: c, MIGLayout: c.MIG.Devices}
	if c.MIG.MigPartedConfig != "" {
		l, ok := f.MigConfigs[c.MIG.MigPartedConfig]
		if !ok {
			return Selected{}, fmt.Errorf("node %s: config %q: mig-configs entry %q is not defined", nodeName, name, c.MIG.MigPartedConfig)
		}
		s.MIGLayout = l
	}
	return s, nil
}
