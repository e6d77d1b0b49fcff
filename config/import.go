package config

import (
	"fmt"
	"sort"
	"strings"

	"gopkg.in/yaml.v3"
)

// nvdpFile is the NVIDIA k8s-device-plugin config file (api/config/v1),
// declared field by field so that a field of theirs is accepted, and a typo
// is still an error. Fields the agent has no use for are declared too and
// produce a warning when set (see nvdpIgnored).
type nvdpFile struct {
	Version   string        `yaml:"version"`
	Flags     nvdpFlags     `yaml:"flags"`
	Resources nvdpResources `yaml:"resources"`
	Sharing   Sharing       `yaml:"sharing"`
	Imex      nvdpImex      `yaml:"imex"`
	Health    nvdpHealth    `yaml:"health"`
}

type nvdpFlags struct {
	MigStrategy             *string          `yaml:"migStrategy"`
	FailOnInitError         *bool            `yaml:"failOnInitError"`
	MpsRoot                 *string          `yaml:"mpsRoot"`
	NvidiaDriverRoot        *string          `yaml:"nvidiaDriverRoot"`
	NvidiaDevRoot           *string          `yaml:"nvidiaDevRoot"`
	GDRCopyEnabled          *bool            `yaml:"gdrcopyEnabled"`
	GDSEnabled              *bool            `yaml:"gdsEnabled"`
	MOFEDEnabled            *bool            `yaml:"mofedEnabled"`
	UseNodeFeatureAPI       *bool            `yaml:"useNodeFeatureAPI"`
	DeviceDiscoveryStrategy *string          `yaml:"deviceDiscoveryStrategy"`
	Plugin                  *nvdpPluginFlags `yaml:"plugin"`
	GFD                     *nvdpGFDFlags    `yaml:"gfd"`
}

type nvdpPluginFlags struct {
	PassDeviceSpecs *bool `yaml:"passDeviceSpecs"`
	// DeviceListStrategy is one string or a list in their schema.
	DeviceListStrategy  *StringList `yaml:"deviceListStrategy"`
	DeviceIDStrategy    *string     `yaml:"deviceIDStrategy"`
	CDIAnnotationPrefix *string     `yaml:"cdiAnnotationPrefix"`
	NvidiaCTKPath       *string     `yaml:"nvidiaCTKPath"`
	ContainerDriverRoot *string     `yaml:"containerDriverRoot"`
	KubeletSocket       *string     `yaml:"kubeletSocket"`
	CDIFeatureFlags     *string     `yaml:"cdiFeatureFlags"`
	// SharedDevicesAllocationPolicy (v0.20.0) is how GetPreferredAllocation
	// picks replicas and MIG devices: distributed (NVIDIA's default, the
	// least used GPU first) or packed (the most used first).
	SharedDevicesAllocationPolicy *string `yaml:"sharedDevicesAllocationPolicy"`
}

type nvdpGFDFlags struct {
	Oneshot         *bool     `yaml:"oneshot"`
	NoTimestamp     *bool     `yaml:"noTimestamp"`
	SleepInterval   *Duration `yaml:"sleepInterval"`
	OutputFile      *string   `yaml:"outputFile"`
	MachineTypeFile *string   `yaml:"machineTypeFile"`
}

type nvdpResources struct {
	GPUs []nvdpResource `yaml:"gpus"`
	MIGs []nvdpResource `yaml:"mig"`
}

type nvdpResource struct {
	Pattern string `yaml:"pattern"`
	Name    string `yaml:"name"`
}

type nvdpImex struct {
	ChannelIDs []int `yaml:"channelIDs"`
	Required   *bool `yaml:"required"`
}

type nvdpHealth struct {
	Disabled     *bool      `yaml:"disabled"`
	EventTypes   []string   `yaml:"eventTypes"`
	IgnoredXIDs  []int      `yaml:"ignoredXIDs"`
	CriticalXIDs *xidsOrAll `yaml:"criticalXIDs"`
}

// xidsOrAll is NVIDIA's criticalXIDs: "all" or a list of XIDs.
type xidsOrAll struct {
	All  bool
	XIDs []int
}

func (x *xidsOrAll) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind == yaml.ScalarNode && strings.EqualFold(n.Value, "all") {
		*x = xidsOrAll{All: true}
		return nil
	}
	var xids []int
	if n.Kind != yaml.SequenceNode || n.Decode(&xids) != nil {
		return fmt.Errorf("expected \"all\" or a list of XIDs, got %s", describe(n))
	}
	*x = xidsOrAll{XIDs: xids}
	return nil
}

// nvdpIgnored lists their fields the agent accepts but does not act on, with
// why, so the warning tells the user what to do instead.
func nvdpIgnored() map[string]string {
	return map[string]string{
		"flags.failOnInitError":            "the agent always keeps running and reports errors on /status",
		"flags.mpsRoot":                    "use the agent's --mps-root flag",
		"flags.nvidiaDriverRoot":           "not configurable in gpu-agent yet",
		"flags.nvidiaDevRoot":              "use the agent's --nvidia-dev-root flag (NVIDIA_DEV_ROOT)",
		"flags.useNodeFeatureAPI":          "gpu-agent does not publish node features",
		"flags.deviceDiscoveryStrategy":    "gpu-agent always discovers devices through NVML",
		"flags.plugin.nvidiaCTKPath":       "gpu-agent writes its CDI specs itself, without nvidia-ctk",
		"flags.plugin.containerDriverRoot": "not configurable in gpu-agent yet",
		"flags.plugin.kubeletSocket":       "use the agent's --device-plugin-dir flag",
		"flags.plugin.cdiFeatureFlags":     "gpu-agent's CDI specs have no feature flags",
		"flags.gfd":                        "gpu-agent does not include GPU feature discovery",
		"resources":                        "resource names are NVIDIA's fixed names in gpu-agent",
		"imex":                             "IMEX channels are not supported by gpu-agent",
		"health.disabled":                  "gpu-agent always watches health; list XIDs in health.ignoredXIDs instead",
		"health.eventTypes":                "gpu-agent always watches XID and ECC events",
	}
}

// fromNVIDIA converts a device-plugin file into one config named "default",
// with NVIDIA's defaults where the file is silent, and returns the errors
// NVIDIA's plugin would refuse to start with that validation cannot see
// in the converted config.
func fromNVIDIA(n *nvdpFile, lines map[string]int, o ParseOptions) (*File, []string, ErrorList) {
	var errs ErrorList
	errAt := func(path, format string, args ...any) {
		errs = append(errs, &FieldError{Path: path, Line: lines[path], Msg: fmt.Sprintf(format, args...)})
	}
	c := &Config{Sharing: n.Sharing}
	// Without flags.migStrategy NVIDIA's plugin takes its --mig-strategy
	// (MIG_STRATEGY), so the agent's does the same.
	c.MIG.Strategy = o.MIGStrategy
	if n.Flags.MigStrategy != nil {
		c.MIG.Strategy = MIGStrategy(*n.Flags.MigStrategy)
	}
	// NVIDIA's default for replicas and MIG devices; whole GPUs get the
	// best-connected set under every policy, there as here.
	c.Allocation.Policy = PolicyDistributed
	if p := n.Flags.Plugin; p != nil {
		if p.PassDeviceSpecs != nil {
			c.DevicePlugin.PassDeviceSpecs = *p.PassDeviceSpecs
		}
		if p.DeviceListStrategy != nil {
			// Several strategies at once, as NVIDIA's plugin takes them;
			// an unknown one fails validation at their path.
			c.DevicePlugin.DeviceListStrategy = strings.Join(*p.DeviceListStrategy, ",")
		}
		if p.CDIAnnotationPrefix != nil {
			c.DevicePlugin.CDIAnnotationPrefix = *p.CDIAnnotationPrefix
		}
		if p.DeviceIDStrategy != nil {
			c.DevicePlugin.DeviceIDStrategy = *p.DeviceIDStrategy // checked by validation, at this path
		}
		if v := p.SharedDevicesAllocationPolicy; v != nil {
			switch AllocationPolicy(*v) {
			case PolicyDistributed, PolicyPacked:
				c.Allocation.Policy = AllocationPolicy(*v)
			default:
				errAt("flags.plugin.sharedDevicesAllocationPolicy", "unknown value %q: must be %s or %s, as for NVIDIA's plugin",
					*v, PolicyDistributed, PolicyPacked)
			}
		}
	}
	c.DevicePlugin.GDSEnabled = n.Flags.GDSEnabled != nil && *n.Flags.GDSEnabled
	c.DevicePlugin.MOFEDEnabled = n.Flags.MOFEDEnabled != nil && *n.Flags.MOFEDEnabled
	c.DevicePlugin.GDRCopyEnabled = n.Flags.GDRCopyEnabled != nil && *n.Flags.GDRCopyEnabled
	if m := c.Sharing.MPS; m != nil && len(m.Resources) > 0 {
		// NVIDIA's plugin shares no MIG device with MPS: it refuses to
		// start with the mixed strategy, and fails a resource holding MIG
		// devices (single) when it is served. A file in its format fails
		// the same way here; gpu-agent's own format may share them.
		m.RefuseMIGDevices = true
		if c.MIG.Strategy == MIGStrategyMixed {
			if n.Flags.MigStrategy != nil {
				errAt("flags.migStrategy", "mixed is not supported with sharing.mps: NVIDIA's device plugin refuses the pair, as it shares no MIG device with MPS; "+
					"use none or single, or write the config in gpu-agent's format, which does")
			} else {
				errAt("sharing.mps", "not supported with the agent's --mig-strategy mixed: NVIDIA's device plugin refuses the pair, as it shares no MIG device with MPS; "+
					"set flags.migStrategy to none or single, or write the config in gpu-agent's format, which does")
			}
		}
	}
	// NVIDIA prefixes a bare name with nvidia.com/, so "gpu" means nvidia.com/gpu.
	var warnings []string
	if ts := c.Sharing.TimeSlicing; ts != nil {
		for i := range ts.Resources {
			qualifyNVIDIA(&ts.Resources[i])
			warnings = append(warnings, dropNVIDIAIgnored(&ts.Resources[i], ts.RenameByDefault, joinIndex("sharing.timeSlicing.resources", i), lines)...)
		}
	}
	if mps := c.Sharing.MPS; mps != nil {
		for i := range mps.Resources {
			qualifyNVIDIA(&mps.Resources[i].ReplicatedResource)
			warnings = append(warnings, dropNVIDIAIgnored(&mps.Resources[i].ReplicatedResource, mps.RenameByDefault, joinIndex("sharing.mps.resources", i), lines)...)
		}
	}
	c.Health.IgnoredXids = n.Health.IgnoredXIDs
	if len(n.Health.IgnoredXIDs) > 0 {
		warnings = append(warnings, fmt.Sprintf("health.ignoredXIDs: added to the default ignored list %v (line %d)",
			DefaultIgnoredXids(), lines["health.ignoredXIDs"]))
	}
	if x := n.Health.CriticalXIDs; x != nil && !x.All {
		c.Health.FatalXids = x.XIDs
	}

	// Values that are what gpu-agent does anyway need no warning.
	harmless := map[string]bool{}
	if r := n.Flags.NvidiaDriverRoot; r != nil && (*r == "/" || *r == "") {
		harmless["flags.nvidiaDriverRoot"] = true
	}
	for path, why := range nvdpIgnored() {
		if line, ok := lines[path]; ok && !harmless[path] {
			warnings = append(warnings, fmt.Sprintf("%s: ignored: %s (line %d)", path, why, line))
		}
	}
	sort.Strings(warnings)

	version := n.Version
	if version == "" {
		version = Version // NVIDIA's plugin defaults a missing version to v1
	}
	def := joinKey("configs", DefaultConfigName)
	return &File{
		Version: version,
		Configs: map[string]*Config{DefaultConfigName: c},
		Format:  FormatNVIDIADevicePlugin,
		rewrites: []pathRewrite{
			{def + ".sharing", "sharing"},
			{def + ".mig.strategy", "flags.migStrategy"},
			{def + ".devicePlugin.passDeviceSpecs", "flags.plugin.passDeviceSpecs"},
			{def + ".devicePlugin.deviceListStrategy", "flags.plugin.deviceListStrategy"},
			{def + ".devicePlugin.deviceIDStrategy", "flags.plugin.deviceIDStrategy"},
			{def + ".devicePlugin.cdiAnnotationPrefix", "flags.plugin.cdiAnnotationPrefix"},
			{def + ".devicePlugin.gdsEnabled", "flags.gdsEnabled"},
			{def + ".devicePlugin.mofedEnabled", "flags.mofedEnabled"},
			{def + ".devicePlugin.gdrcopyEnabled", "flags.gdrcopyEnabled"},
			{def + ".allocation.policy", "flags.plugin.sharedDevicesAllocationPolicy"},
			{def + ".health.ignoredXids", "health.ignoredXIDs"},
			{def + ".health.fatalXids", "health.criticalXIDs"},
			{def, ""},
		},
	}, warnings, errs
}

// dropNVIDIAIgnored undoes what NVIDIA's device plugin undoes in its own
// file format (DisableResourceNamingInConfig): a sharing entry's rename and
// devices. It serves the replicas of every device under the resource's own
// name, or <name>.shared with renameByDefault, and says so in a warning. A
// user switching with an old file must see the resources NVIDIA's plugin
// served: a rename honoured here would leave pods asking for nvidia.com/gpu
// unschedulable. gpu-agent's own format honours both fields.
func dropNVIDIAIgnored(r *ReplicatedResource, renameByDefault bool, path string, lines map[string]int) []string {
	var warnings []string
	served := r.Name
	if renameByDefault {
		served = r.Name + ".shared"
	}
	if r.Rename != "" && r.Rename != served {
		p := joinKey(path, "rename")
		warnings = append(warnings, fmt.Sprintf("%s: %s ignored, as NVIDIA's device plugin ignores it in its format: the replicas are served as %s (line %d); "+
			"gpu-agent's own format (version: v1 with configs:) honours rename", p, r.Rename, served, lines[p]))
	}
	r.Rename = ""
	if !r.Devices.All && !r.Devices.IsZero() {
		p := joinKey(path, "devices")
		warnings = append(warnings, fmt.Sprintf("%s: ignored, as NVIDIA's device plugin ignores it in its format: every device of %s is shared (line %d); "+
			"gpu-agent's own format (version: v1 with configs:) honours devices", p, r.Name, lines[p]))
	}
	r.Devices = ReplicaDevices{All: true}
	return warnings
}

func qualifyNVIDIA(r *ReplicatedResource) {
	if r.Name != "" && !strings.Contains(r.Name, "/") {
		r.Name = "nvidia.com/" + r.Name
	}
	if r.Rename != "" && !strings.Contains(r.Rename, "/") {
		r.Rename = "nvidia.com/" + r.Rename
	}
}

// migPartedFile is mig-parted's config file (api/spec/v1).
type migPartedFile struct {
	Version    string               `yaml:"version"`
	MigConfigs map[string]MigLayout `yaml:"mig-configs"`
}

// fromMigParted makes one config per mig-configs entry, each exposing its
// layout with the agent's --mig-strategy (mixed when unset), so an entry is
// picked like any named config (nodes:, the node label, or one named
// "default").
func fromMigParted(m *migPartedFile, o ParseOptions) *File {
	f := &File{
		Version:    m.Version,
		Configs:    map[string]*Config{},
		MigConfigs: m.MigConfigs,
		Format:     FormatMigParted,
	}
	for name := range m.MigConfigs {
		f.Configs[name] = &Config{MIG: MIG{Strategy: o.layoutStrategy(), MigPartedConfig: name}}
		f.rewrites = append(f.rewrites, pathRewrite{joinKey("configs", name), joinKey("mig-configs", name)})
	}
	// Longest first, so no entry's prefix shadows another's.
	sort.Slice(f.rewrites, func(i, j int) bool { return len(f.rewrites[i].from) > len(f.rewrites[j].from) })
	return f
}
