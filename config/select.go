package config

import (
	"fmt"
	"maps"
	"slices"
	"strings"
)

// SelectReason says why a config was chosen for a node.
type SelectReason string

// Selection reasons, in order of precedence (see Select).
const (
	ReasonNodeEntry         SelectReason = "node entry"
	ReasonNodeLabel         SelectReason = "node label"
	ReasonDevicePluginLabel SelectReason = "device-plugin label"
	ReasonDefaultKey        SelectReason = "default key"
	ReasonDefault           SelectReason = "default"
	ReasonImplicit          SelectReason = "implicit default"
)

// NVIDIA's node labels, read with NVIDIA's meaning.
const (
	// DevicePluginConfigLabel names a config: a key of NVIDIA's multi-key
	// device plugin ConfigMap (here: a config under configs).
	DevicePluginConfigLabel = "nvidia.com/device-plugin.config"
	// MIGConfigLabel names an entry of mig-parted's mig-configs: the MIG
	// layout of the node, whatever config is selected.
	MIGConfigLabel = "nvidia.com/mig.config"
)

// Selected is the config chosen for one node, with its MIG layout resolved.
type Selected struct {
	// Name of the config under configs.
	Name   string
	Reason SelectReason
	Config *Config
	// MIGLayout is the config's mig.devices, or the mig-configs entry named by
	// mig.migPartedConfig or by the nvidia.com/mig.config label; nil when the
	// node's MIG layout is left alone. The planner checks it against the
	// node's GPUs (indices, models, profiles).
	MIGLayout MigLayout
	// MIGSource says where MIGLayout came from ("" when nil).
	MIGSource string
}

// Select picks the config for a node. Precedence, first match wins:
//
//  1. the node's entry under nodes:;
//  2. the node label gpu-agent.io/config=<config>;
//  3. the node label nvidia.com/device-plugin.config=<config> (NVIDIA's: a
//     key of a multi-key ConfigMap, which is a config here);
//  4. the ConfigMap's default key (ParseConfigMap's defaultKey, NVIDIA's
//     config.default);
//  5. the config named "default";
//  6. an implicit default: whole GPUs, existing MIG devices served (mixed
//     strategy), as NVIDIA's plugin does with no config. A file that only
//     holds mig-configs (mig-parted's, like the GPU Operator's
//     default-mig-parted-config) thus still serves the node.
//
// Independently, the node label nvidia.com/mig.config=<entry> picks the MIG
// layout from mig-configs, overriding the selected config's own (as
// mig-manager applies it whatever the device plugin's config). A label or
// entry that names nothing is an error naming it; the caller keeps its last
// good selection.
func (f *File) Select(nodeName string, labels map[string]string) (Selected, error) {
	var name string
	var reason SelectReason
	var label string
	switch {
	case f.Nodes[nodeName] != "" && nodeName != "":
		name, reason = f.Nodes[nodeName], ReasonNodeEntry
	case labels[ConfigLabel] != "":
		name, reason, label = labels[ConfigLabel], ReasonNodeLabel, ConfigLabel
	case labels[DevicePluginConfigLabel] != "":
		name, reason, label = labels[DevicePluginConfigLabel], ReasonDevicePluginLabel, DevicePluginConfigLabel
	case f.DefaultKey != "":
		name, reason = f.DefaultKey, ReasonDefaultKey
	default:
		name, reason = DefaultConfigName, ReasonDefault
	}
	c, ok := f.Configs[name]
	switch {
	case ok && c != nil:
	case label != "":
		return Selected{}, fmt.Errorf("node %s: label %s=%s names a config that is not defined (defined: %s)", nodeName, label, name, listNames(f.Configs))
	case reason == ReasonNodeEntry:
		return Selected{}, fmt.Errorf("node %s: nodes entry names config %q, which is not defined", nodeName, name)
	case reason == ReasonDefaultKey:
		return Selected{}, fmt.Errorf("default key %q is not a key of the ConfigMap (keys: %s)", name, listNames(f.Configs))
	default:
		name, reason, c = DefaultConfigName, ReasonImplicit, implicitDefault()
	}
	s := Selected{Name: name, Reason: reason, Config: c, MIGLayout: c.MIG.Devices}
	if s.MIGLayout != nil {
		s.MIGSource = "configs." + name + ".mig.devices"
	}
	if c.MIG.MigPartedConfig != "" {
		l, ok := f.MigConfigs[c.MIG.MigPartedConfig]
		if !ok {
			return Selected{}, fmt.Errorf("node %s: config %q: mig-configs entry %q is not defined", nodeName, name, c.MIG.MigPartedConfig)
		}
		s.MIGLayout, s.MIGSource = l, "mig-configs."+c.MIG.MigPartedConfig
	}
	if entry := labels[MIGConfigLabel]; entry != "" {
		l, ok := f.MigConfigs[entry]
		if !ok {
			return Selected{}, fmt.Errorf("node %s: label %s=%s names no mig-configs entry (entries: %s)", nodeName, MIGConfigLabel, entry, listNames(f.MigConfigs))
		}
		s.MIGLayout, s.MIGSource = l, "label "+MIGConfigLabel+"="+entry
		if s.Config.MIG.Strategy == MIGStrategyNone {
			// A layout asked for by mig-manager's label is meant to be
			// served: strategy none would hide every device it creates.
			cc := *s.Config
			cc.MIG.Strategy = MIGStrategyMixed
			s.Config = &cc
		}
	}
	return s, nil
}

// implicitDefault is what a node gets when nothing selects a config.
func implicitDefault() *Config {
	c := Default().Configs[DefaultConfigName]
	c.MIG.Strategy = MIGStrategyMixed
	return c
}

// listNames lists a map's keys for an error, sorted and bounded.
func listNames[V any](m map[string]V) string {
	names := slices.Sorted(maps.Keys(m))
	if len(names) == 0 {
		return "none"
	}
	if len(names) > 12 {
		return strings.Join(names[:12], ", ") + fmt.Sprintf(", ... (%d more)", len(names)-12)
	}
	return strings.Join(names, ", ")
}
