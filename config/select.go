package config

import (
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strings"
)

// SelectReason says why a config was chosen for a node.
type SelectReason string

// Selection reasons, in order of precedence (see Select).
const (
	ReasonNodeEntry         SelectReason = "node entry"
	ReasonGPUAgentLabel     SelectReason = "gpu-agent.io/config label"
	ReasonDevicePluginLabel SelectReason = "nvidia.com/device-plugin.config label"
	ReasonDefaultKey        SelectReason = "default key"
	ReasonDefaultConfig     SelectReason = "default config"
	ReasonImplicit          SelectReason = "implicit default"
)

// Earlier names of two reasons, kept so callers written against them build.
const (
	// Deprecated: use ReasonGPUAgentLabel; "node label" became ambiguous
	// once NVIDIA's labels select configs too.
	ReasonNodeLabel = ReasonGPUAgentLabel
	// Deprecated: use ReasonDefaultConfig.
	ReasonDefault = ReasonDefaultConfig
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
	// Name of the config under configs; DefaultConfigName for the implicit
	// default.
	Name   string
	Reason SelectReason
	// Config is the config to run. With a MIG layout from the
	// nvidia.com/mig.config label and a config whose strategy is none, it is
	// a copy with the agent's --mig-strategy, else mixed (see Select), so
	// compare Selected values with Equal, not by this pointer.
	Config *Config
	// MIGLayout is the config's mig.devices, or the mig-configs entry named by
	// mig.migPartedConfig or by the nvidia.com/mig.config label; nil when the
	// node's MIG layout is left alone. The planner checks it against the
	// node's GPUs (indices, models, profiles).
	MIGLayout MigLayout
	// MIGSource says where MIGLayout came from: the field path
	// ("configs.big.mig.devices", "configs.big.mig.migPartedConfig") or
	// the label ("label nvidia.com/mig.config=all-1g.10gb"); "" when
	// MIGLayout is nil.
	MIGSource string
	// MIGEntry is the mig-configs entry MIGLayout is (by migPartedConfig or
	// the label); "" for a config's own mig.devices or no layout. It is what
	// mig-manager would report its nvidia.com/mig.config.state for.
	MIGEntry string
	// MIGPath is where MIGLayout is written, as its author wrote it: the
	// mig-configs entry ("mig-configs.five-1g-one-2g") or the config's own
	// layout ("configs.big.mig.devices"); MIGKey is the ConfigMap key that
	// holds it ("" for a file). Both are "" when MIGLayout is nil. Errors
	// about the layout name it so (MIGError), whatever config or label
	// picked it.
	MIGPath string
	MIGKey  string
	// migLines are the lines of the paths under MIGPath, when known.
	migLines map[string]int
	// Notes are inputs Select deliberately did not act on, one sentence
	// each, for the log and /status; see Select.
	Notes []string
}

// Equal reports whether two selections would have the node run the same:
// same config name, reason and content, same MIG layout from the same
// source (the lines it is written on do not count). Select builds a new Config when it adjusts the MIG strategy, so
// pointer comparison would see a change on every call.
func (s Selected) Equal(o Selected) bool {
	if s.Name != o.Name || s.Reason != o.Reason || s.MIGSource != o.MIGSource || s.MIGEntry != o.MIGEntry ||
		s.MIGPath != o.MIGPath || s.MIGKey != o.MIGKey ||
		!slices.Equal(s.Notes, o.Notes) || (s.Config == nil) != (o.Config == nil) {
		return false
	}
	if s.Config != nil && s.Config != o.Config && !reflect.DeepEqual(*s.Config, *o.Config) {
		return false
	}
	return reflect.DeepEqual(s.MIGLayout, o.MIGLayout)
}

// Select picks the config for a node. Precedence, first match wins:
//
//  1. the node's entry under nodes:;
//  2. the node label gpu-agent.io/config=<config>;
//  3. the node label nvidia.com/device-plugin.config=<config> (NVIDIA's
//     meaning: a key of the device plugin's multi-key ConfigMap, which
//     ParseConfigMap makes a config of that name);
//  4. the default key (File.DefaultKey: ParseConfigMap's defaultKey,
//     NVIDIA's config.default; when that is empty, the map has no config
//     named "default" and exactly one device-plugin key and no gpu-agent
//     config (a mig-parted key's entries do not count), that key, as
//     NVIDIA's "single" fallback), else the config named "default";
//  5. else an implicit default: whole GPUs, no sharing, MIG left as it is,
//     and every MIG device that exists served under the agent's
//     --mig-strategy (File.DefaultMIGStrategy), mixed when unset. It is what
//     NVIDIA's plugin does without a config (it serves what exists, by its
//     --mig-strategy); mixed is the one strategy that serves any layout
//     (single refuses differing profiles, none hides MIG devices).
//     A file that only holds mig-configs (mig-parted's, such as the GPU
//     Operator's default-mig-parted-config) thus still serves the node.
//
// A label with an empty value counts as absent. A label, node entry or
// default key that names no config is an error naming it and listing the
// configs; a lower step is not tried, as a typo must not silently give the
// node another config (the caller keeps its last good selection).
//
// Independently of the config, the node label nvidia.com/mig.config=<entry>
// picks the MIG layout from mig-configs, overriding the config's own
// mig.devices or mig.migPartedConfig (as mig-manager applies it whatever
// the device plugin's config). An entry the file lacks is an error naming
// the label and listing the entries. If the selected config's strategy is
// none, the result uses the agent's --mig-strategy instead (mixed when
// unset), since none would hide every device the layout creates. Only when the file has no mig-configs at all is the
// label ignored (with a Note), not an error: the GPU Operator labels MIG
// GPUs' nodes nvidia.com/mig.config=all-disabled by default, so a plain
// device-plugin config would otherwise serve nothing on them; the label
// is then mig-manager's, about a file the agent was not given.
func (f *File) Select(nodeName string, labels map[string]string) (Selected, error) {
	s, err := f.selectConfig(nodeName, labels)
	if err != nil {
		return Selected{}, err
	}
	if err := f.selectMIG(&s, nodeName, labels); err != nil {
		return Selected{}, err
	}
	f.placeMIG(&s)
	return s, nil
}

// placeMIG records where s's MIG layout is written: its path, ConfigMap key
// and lines.
func (f *File) placeMIG(s *Selected) {
	switch {
	case s.MIGLayout == nil:
		return
	case s.MIGEntry != "":
		s.MIGPath = joinKey("mig-configs", s.MIGEntry)
	default:
		s.MIGPath = joinKey("configs", s.Name) + ".mig.devices"
	}
	s.MIGKey = f.keys[s.MIGPath]
	if s.MIGKey == "" && s.MIGEntry == "" {
		s.MIGKey = f.keys[joinKey("configs", s.Name)]
	}
	for p, line := range f.lines {
		if under(p, s.MIGPath) {
			if s.migLines == nil {
				s.migLines = map[string]int{}
			}
			s.migLines[p] = line
		}
	}
}

// under reports whether path p is prefix or inside it.
func under(p, prefix string) bool {
	return p == prefix || strings.HasPrefix(p, prefix) && (p[len(prefix)] == '.' || p[len(prefix)] == '[')
}

// MIGError is err about entry i of the selected MIG layout (i < 0: the
// layout as a whole) at its field ("" for the entry itself: "mig-devices",
// "mig-enabled", "device-filter"), named as its author wrote it: the
// ConfigMap key, the path and, when known, the line. It wraps err.
func (s Selected) MIGError(i int, field string, err error) error {
	p := s.MIGPath
	if p == "" {
		p = joinKey("configs", s.Name) + ".mig"
	}
	if i >= 0 {
		p = joinIndex(p, i)
		if field != "" {
			p = joinKey(p, field)
		}
	}
	line := 0
	for q := p; q != "" && line == 0; q = parentPath(q) {
		line = s.migLines[q]
	}
	return &layoutError{FieldError{Key: s.MIGKey, Path: p, Line: line, Msg: err.Error()}, err}
}

// layoutError is a FieldError that wraps the error it says (mig.ErrLayout).
type layoutError struct {
	FieldError
	err error
}

func (e *layoutError) Unwrap() error { return e.err }

func (f *File) selectConfig(nodeName string, labels map[string]string) (Selected, error) {
	var name, label string
	var reason SelectReason
	_, hasDefault := f.Configs[DefaultConfigName]
	switch {
	case nodeName != "" && f.Nodes[nodeName] != "":
		name, reason = f.Nodes[nodeName], ReasonNodeEntry
	case labels[ConfigLabel] != "":
		name, reason, label = labels[ConfigLabel], ReasonGPUAgentLabel, ConfigLabel
	case labels[DevicePluginConfigLabel] != "":
		name, reason, label = labels[DevicePluginConfigLabel], ReasonDevicePluginLabel, DevicePluginConfigLabel
	case f.DefaultKey != "":
		name, reason = f.DefaultKey, ReasonDefaultKey
	case hasDefault:
		name, reason = DefaultConfigName, ReasonDefaultConfig
	default:
		return Selected{Name: DefaultConfigName, Reason: ReasonImplicit, Config: implicitDefaultWith(ParseOptions{MIGStrategy: f.DefaultMIGStrategy})}, nil
	}
	c, ok := f.Configs[name]
	if !ok {
		switch reason {
		case ReasonNodeEntry:
			return Selected{}, fmt.Errorf("%sits nodes: entry names config %q, which is not defined (configs: %s)", nodePrefix(nodeName), name, listNames(f.Configs))
		case ReasonDefaultKey:
			return Selected{}, fmt.Errorf("%sdefault key %q names no config (configs: %s)", nodePrefix(nodeName), name, listNames(f.Configs))
		}
		return Selected{}, fmt.Errorf("%slabel %s=%s names no config (configs: %s)", nodePrefix(nodeName), label, name, listNames(f.Configs))
	}
	if c == nil {
		// A File built in code may hold an empty entry, which Parse would
		// have filled with the defaults.
		c = Default().Configs[DefaultConfigName]
	}
	return Selected{Name: name, Reason: reason, Config: c}, nil
}

// selectMIG resolves s's MIG layout: the config's own, or the label's.
func (f *File) selectMIG(s *Selected, nodeName string, labels map[string]string) error {
	c := s.Config
	switch {
	case c.MIG.Devices != nil:
		s.MIGLayout, s.MIGSource = c.MIG.Devices, joinKey("configs", s.Name)+".mig.devices"
	case c.MIG.MigPartedConfig != "":
		l, ok := f.MigConfigs[c.MIG.MigPartedConfig]
		if !ok {
			return fmt.Errorf("%sconfig %q: mig.migPartedConfig names mig-configs entry %q, which is not defined (entries: %s)",
				nodePrefix(nodeName), s.Name, c.MIG.MigPartedConfig, listNames(f.MigConfigs))
		}
		s.MIGLayout, s.MIGSource, s.MIGEntry = l, joinKey("configs", s.Name)+".mig.migPartedConfig", c.MIG.MigPartedConfig
	}
	entry := labels[MIGConfigLabel]
	if entry == "" {
		return nil
	}
	if len(f.MigConfigs) == 0 {
		s.Notes = append(s.Notes, fmt.Sprintf("label %s=%s ignored: the config defines no mig-configs (add mig-parted's file as a key for the agent to apply it)",
			MIGConfigLabel, entry))
		return nil
	}
	l, ok := f.MigConfigs[entry]
	if !ok {
		return fmt.Errorf("%slabel %s=%s names no mig-configs entry (entries: %s)", nodePrefix(nodeName), MIGConfigLabel, entry, listNames(f.MigConfigs))
	}
	s.MIGLayout, s.MIGSource, s.MIGEntry = l, "label "+MIGConfigLabel+"="+entry, entry
	if c.MIG.Strategy == MIGStrategyNone || c.MIG.Strategy == "" {
		// A layout asked for by mig-manager's label is meant to be
		// served: strategy none would hide every device it creates. The
		// agent's --mig-strategy says how, as it does for mig-parted's
		// entries (mixed when unset).
		cc := *c
		cc.MIG.Strategy = ParseOptions{MIGStrategy: f.DefaultMIGStrategy}.layoutStrategy()
		s.Config = &cc
	}
	return nil
}

// nodePrefix starts an error about a node, when it has a name.
func nodePrefix(nodeName string) string {
	if nodeName == "" {
		return ""
	}
	return "node " + nodeName + ": "
}

// implicitDefault is what a node gets when nothing selects a config.
func implicitDefault() *Config {
	c := Default().Configs[DefaultConfigName]
	c.MIG.Strategy = MIGStrategyMixed
	return c
}

// maxListed bounds the names an error lists: the full list of a large file
// would bury the message.
const maxListed = 12

// listNames lists a map's keys for an error, sorted and bounded.
func listNames[V any](m map[string]V) string {
	names := slices.Sorted(maps.Keys(m))
	if len(names) == 0 {
		return "none"
	}
	if len(names) > maxListed {
		return strings.Join(names[:maxListed], ", ") + fmt.Sprintf(", ... (%d more)", len(names)-maxListed)
	}
	return strings.Join(names, ", ")
}
