package config

import (
	"fmt"
	"math/big"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"time"

	"gopkg.in/yaml.v3"
)

// Version is the only schema version this package reads, in all three formats.
const Version = "v1"

// ConfigLabel is the node label that picks a named config when the node has no
// entry under nodes:.
const ConfigLabel = "gpu-agent.io/config"

// DefaultConfigName is the config used when nothing else selects one.
const DefaultConfigName = "default"

// Format says which kind of file a File was read from.
type Format string

// The formats Parse recognises from the file's top-level keys.
const (
	FormatGPUAgent           Format = "gpu-agent"
	FormatNVIDIADevicePlugin Format = "nvidia-device-plugin"
	FormatMigParted          Format = "mig-parted"
)

// File is a whole configuration file: named configs and how nodes pick one.
// Files read in NVIDIA's device-plugin or mig-parted format are converted to
// this shape, so consumers handle one type.
type File struct {
	// Version is the schema version, required at the top of every file.
	// Values: `v1`.
	Version string `yaml:"version"`
	// Nodes maps a node name to the name of its config. A node listed here
	// gets that config whatever its labels say; other nodes pick one by the
	// node label gpu-agent.io/config, then NVIDIA's
	// nvidia.com/device-plugin.config, then the agent's --default-config,
	// then the config named default.
	Nodes map[string]string `yaml:"nodes,omitempty"`
	// Configs are the named configs; each node is served one of them (see
	// nodes). Without one that applies, a node serves the built-in default:
	// whole GPUs and the MIG devices that exist, no sharing.
	Configs map[string]*Config `yaml:"configs"`
	// MigConfigs is mig-parted's table of named MIG layouts, each a list of
	// entries as in mig.devices. A config's mig.migPartedConfig names one,
	// and so does the node label nvidia.com/mig.config=<entry>, as
	// NVIDIA's mig-manager reads it.
	MigConfigs map[string]MigLayout `yaml:"mig-configs,omitempty"`
	// Format the file was read in (not part of the schema).
	Format Format `yaml:"-"`
	// DefaultKey is the config used when nothing else selects one, before
	// "default" (ParseConfigMap's defaultKey; not part of the schema).
	DefaultKey string `yaml:"-"`
	// DefaultMIGStrategy is ParseOptions.MIGStrategy, the agent's
	// --mig-strategy, which Select gives the implicit default and a layout
	// picked by the nvidia.com/mig.config label; "" means mixed there (not
	// part of the schema).
	DefaultMIGStrategy MIGStrategy `yaml:"-"`

	// lines maps each decoded field path (in the file's own format) to its line,
	// so validation errors found after decoding can still name a line.
	lines map[string]int
	// rewrites turn a path of the converted File back into the path the user
	// wrote, for files imported from another format.
	rewrites []pathRewrite
	// keys maps "configs.<name>" and "mig-configs.<name>" to the ConfigMap
	// key that defines it, for a File merged from a ConfigMap (whose lines
	// are then each key's, for those paths).
	keys map[string]string
}

// Config is one named configuration of a node.
type Config struct {
	// DevicePlugin is what the device plugin offers the kubelet and how a
	// container given a device gets it.
	DevicePlugin DevicePlugin `yaml:"devicePlugin"`
	// Allocation is how GetPreferredAllocation chooses among free devices.
	Allocation Allocation `yaml:"allocation"`
	// MIG is how MIG devices are offered and, optionally, the MIG layout the
	// agent makes on the GPUs.
	MIG MIG `yaml:"mig"`
	// Sharing offers devices as several replicas, by time-slicing or MPS.
	Sharing Sharing `yaml:"sharing"`
	// Health is which faults mark a device unhealthy and how devices are
	// probed and brought back.
	Health Health `yaml:"health"`
	// DRA is what the DRA driver (the agent's --dra) offers beyond the
	// node's devices as they are.
	DRA DRA `yaml:"dra,omitempty"`
	// Usage is what the agent does about how the holders of its devices use
	// them: the idle Event (the gpu_agent_holder_* metrics are always on).
	Usage Usage `yaml:"usage,omitempty"`
}

// Usage is what the agent does about how the holders of its devices use
// them (the gpu_agent_holder_* metrics measure it whatever this says).
type Usage struct {
	// IdleEventAfter, when set, sends a Kubernetes Event (reason
	// GPUAllocationIdle) to a pod once one of its containers or DRA claims
	// has held a GPU or MIG device this long without using it, naming the
	// device and the figures; once per idle spell. The agent never evicts
	// a pod for it. Off when unset; at least 1m.
	IdleEventAfter Duration `yaml:"idleEventAfter,omitempty"`
}

// MinIdleEventAfter is the shortest Usage.IdleEventAfter: a holder's use is
// read every 10 s, and an Event for every pause of a few seconds would be
// noise, not news.
const MinIdleEventAfter = time.Minute

// DRA is what the DRA driver (--dra) publishes beyond the node's devices as
// they are.
type DRA struct {
	// MIGOnDemand offers MIG devices that do not exist yet, made when a
	// claim is prepared and destroyed when it is released. Off unless set:
	// every profile at every placement is a device of its own drawing on
	// its GPU's counters (20 devices per H100 instead of 1), and the
	// scheduler pays for them on every node at every scheduling attempt,
	// whatever the claim asks for; spareGPUs keeps that to the GPUs in use
	// and a few free ones, and spareLayout to a layout's devices without
	// counters (docs/dra-devices.md, "Scale").
	MIGOnDemand *MIGOnDemand `yaml:"migOnDemand,omitempty"`
	// MIGDeviceAttributes, when set, are the only attributes a MIG device
	// carries beside type and profile, which it always carries. The
	// scheduler keeps every node's devices decoded, each with a Go map of
	// its attributes, and a map of more than 8 entries takes a table twice
	// as large: a MIG device with NVIDIA's 13 attributes costs it about
	// 4.4 KB, one with 8 about 2.6 KB (docs/dra-devices.md, "Scale"). For
	// fleets with many MIG devices whose claims select them by the
	// attributes kept: a claim that selects by one left out matches no MIG
	// device. Names as published, the resource.kubernetes.io/ ones in full:
	// uuid, index, productName, brand, architecture, cudaComputeCapability,
	// driverVersion, cudaDriverVersion, parentUUID,
	// resource.kubernetes.io/pciBusID, resource.kubernetes.io/pcieRoot,
	// resource.kubernetes.io/numaNode.
	// Default: every attribute NVIDIA's driver gives a MIG device.
	MIGDeviceAttributes []string `yaml:"migDeviceAttributes,omitempty,flow"`
}

// MIGAttributesAlways are the attributes every MIG device carries whatever
// DRA.MIGDeviceAttributes says: what a MIG DeviceClass and claim select on.
var MIGAttributesAlways = []string{"type", "profile"}

// MIGAttributesOptional are the other attributes a MIG device may carry,
// the names DRA.MIGDeviceAttributes accepts.
var MIGAttributesOptional = []string{
	"uuid", "index", "productName", "brand", "architecture", "cudaComputeCapability", "driverVersion",
	"cudaDriverVersion", "parentUUID",
	"resource.kubernetes.io/pciBusID", "resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/numaNode",
}

// MIGAttributesInSmallMap is how many attributes fit the scheduler's
// smallest Go map (one group of 8 slots); more take a table of 16.
const MIGAttributesInSmallMap = 8

// MIGOnDemand says which GPUs offer MIG devices made on demand, and which
// profiles. It applies to MIG-capable GPUs that no MIG layout of the config
// governs, that have MIG on or change MIG mode without a reset (Hopper and
// newer).
type MIGOnDemand struct {
	// Enabled turns MIG on demand on; profiles and device-filter without it
	// offer nothing (a warning says so).
	Enabled bool `yaml:"enabled"`
	// Profiles, when set, are the only profiles offered ("1g.10gb",
	// "3g.40gb"), each listed once; each profile costs the scheduler one
	// device per placement.
	// Default: every profile the GPU has.
	Profiles []string `yaml:"profiles,omitempty,flow"`
	// DeviceFilter restricts it to GPUs with these PCI device IDs
	// ("0x233010DE": 0x and 8 hex digits), as a MIG layout's device-filter
	// does.
	// Default: every model.
	DeviceFilter StringList `yaml:"device-filter,omitempty,flow"`
	// SpareGPUs, when above 0, is how many free GPUs offer MIG devices on
	// demand beside those that already hold MIG devices claims made: the
	// others are offered whole only, with no counters, until a spare is
	// taken and another opens. Each GPU that offers partitions costs the
	// scheduler one device per profile placement (20 on an H100) on every
	// Filter call; a spare costs what a static MIG layout does. A spare
	// found surplus (an earlier one freed) keeps its partitions, tainted
	// gpu.nvidia.com/closing, for a minute before they go: a claim the
	// scheduler gave one of them meanwhile is still prepared.
	// Default (0): every chosen GPU offers them.
	SpareGPUs int `yaml:"spareGPUs,omitempty"`
	// SpareLayout, when set (with spareGPUs), is what a spare offers
	// instead: these MIG devices ("1g.10gb": 2, "3g.40gb": 1), placed once
	// as a MIG layout is, made on demand, and not the GPU whole. A key of
	// compute slices alone ("1g": 2, "2g": 1, "3g": 1) names each model's
	// plain profile of that many with the least memory, so one layout
	// serves every MIG model of a fleet. No two of
	// the node's devices can then clash, so the node publishes no counters:
	// the scheduler's allocator of Kubernetes 1.36 gathers every node's
	// counters at every node (docs/dra-devices.md, "Scale"), and a layout
	// costs it only its devices. A GPU changes face (whole to layout, or
	// back) through the grace: the face it leaves is tainted
	// gpu.nvidia.com/closing for a minute before the other is published.
	// Default: unset, every profile at every placement on counters.
	SpareLayout map[string]int `yaml:"spareLayout,omitempty,flow"`
}

// Offers reports whether m offers profile on demand (m may be nil).
func (m *MIGOnDemand) Offers(profile string) bool {
	return m != nil && m.Enabled && (len(m.Profiles) == 0 || slices.Contains(m.Profiles, profile))
}

// DevicePlugin holds what the kubelet-facing servers do in Allocate.
type DevicePlugin struct {
	// PassDeviceSpecs adds the /dev/nvidia* device nodes of the devices to
	// every Allocate response, as NVIDIA's flag of that name does.
	PassDeviceSpecs bool `yaml:"passDeviceSpecs"`
	// DeviceListStrategy is how the allocated devices reach the container:
	// NVIDIA's strategies, one or several, comma-separated: "envvar"
	// (NVIDIA_VISIBLE_DEVICES, the default), "volume-mounts" (one /dev/null
	// mount per device under /var/run/nvidia-container-devices),
	// "cdi-annotations" (a cdi.k8s.io/ annotation naming the CDI devices)
	// and "cdi-cri" (the CDI devices in the CRI's own field). With only CDI
	// strategies the container gets its devices from the agent's CDI spec
	// alone: no NVIDIA_VISIBLE_DEVICES and no device specs.
	DeviceListStrategy string `yaml:"deviceListStrategy"`
	// CDIAnnotationPrefix is the key prefix of the cdi-annotations strategy,
	// NVIDIA's flags.plugin.cdiAnnotationPrefix: a DNS subdomain ending in
	// "/".
	CDIAnnotationPrefix string `yaml:"cdiAnnotationPrefix"`
	// DeviceIDStrategy is how a device is named in NVIDIA_VISIBLE_DEVICES:
	// "uuid" (the default) or "index" (the GPU index, "<gpu>:<mig>" for a
	// MIG device), NVIDIA's flags.plugin.deviceIDStrategy. The IDs the
	// kubelet sees stay UUIDs either way, as in NVIDIA's plugin.
	DeviceIDStrategy string `yaml:"deviceIDStrategy"`
	// GDSEnabled adds NVIDIA_GDS=enabled to every container given a device,
	// as NVIDIA's flag of that name does: the NVIDIA container runtime then
	// adds GPUDirect Storage support.
	GDSEnabled bool `yaml:"gdsEnabled"`
	// MOFEDEnabled adds NVIDIA_MOFED=enabled to every container given a
	// device, as NVIDIA's flag of that name does: the NVIDIA container
	// runtime then adds MOFED support.
	MOFEDEnabled bool `yaml:"mofedEnabled"`
	// GDRCopyEnabled adds NVIDIA_GDRCOPY=enabled to every container given a
	// device, as NVIDIA's flag of that name does: the NVIDIA container
	// runtime then adds GDRCopy support.
	GDRCopyEnabled bool `yaml:"gdrcopyEnabled"`
	// Enabled, when false, withdraws the device plugin's resources on the
	// nodes this config selects; with the agent's DRA driver on (--dra), their GPUs
	// are then offered through DRA only, and pods asking for nvidia.com/gpu
	// are served through a DeviceClass's extendedResourceName. Containers
	// that hold devices keep them. Without --dra such a config does not fit
	// the node.
	// Default: `true`.
	Enabled *bool `yaml:"enabled"`
}

// Serves reports whether the device plugin offers resources (Enabled unset
// or true).
func (p DevicePlugin) Serves() bool { return p.Enabled == nil || *p.Enabled }

// The values DevicePlugin.DeviceListStrategy accepts.
const (
	DeviceListStrategyEnvvar         = "envvar"
	DeviceListStrategyVolumeMounts   = "volume-mounts"
	DeviceListStrategyCDIAnnotations = "cdi-annotations"
	DeviceListStrategyCDICRI         = "cdi-cri"
)

// DeviceListStrategies are all of them, in the order NVIDIA documents them.
var DeviceListStrategies = []string{DeviceListStrategyEnvvar, DeviceListStrategyVolumeMounts, DeviceListStrategyCDIAnnotations, DeviceListStrategyCDICRI}

// DefaultCDIAnnotationPrefix is the CDI annotation key prefix runtimes read.
const DefaultCDIAnnotationPrefix = "cdi.k8s.io/"

// ListStrategies returns the strategies of DeviceListStrategy, envvar when
// none is given.
func (p DevicePlugin) ListStrategies() []string {
	if strings.TrimSpace(p.DeviceListStrategy) == "" {
		return []string{DeviceListStrategyEnvvar}
	}
	var out []string
	for _, s := range strings.Split(p.DeviceListStrategy, ",") {
		if s = strings.TrimSpace(s); s != "" && !slices.Contains(out, s) {
			out = append(out, s)
		}
	}
	return out
}

// UsesCDI reports whether a CDI strategy is among the device list strategies.
func (p DevicePlugin) UsesCDI() bool {
	s := p.ListStrategies()
	return slices.Contains(s, DeviceListStrategyCDIAnnotations) || slices.Contains(s, DeviceListStrategyCDICRI)
}

// The values DevicePlugin.DeviceIDStrategy accepts.
const (
	DeviceIDStrategyUUID  = "uuid"
	DeviceIDStrategyIndex = "index"
)

// ContainerEnv is the environment every container given a device gets
// from these settings (nil when none): what NVIDIA's plugin adds for
// gdsEnabled, mofedEnabled and gdrcopyEnabled.
func (p DevicePlugin) ContainerEnv() map[string]string {
	var env map[string]string
	set := func(on bool, name string) {
		if !on {
			return
		}
		if env == nil {
			env = map[string]string{}
		}
		env[name] = "enabled"
	}
	set(p.GDSEnabled, "NVIDIA_GDS")
	set(p.MOFEDEnabled, "NVIDIA_MOFED")
	set(p.GDRCopyEnabled, "NVIDIA_GDRCOPY")
	return env
}

// AllocationPolicy chooses devices for GetPreferredAllocation.
type AllocationPolicy string

// Allocation policies.
const (
	PolicyTopology    AllocationPolicy = "topology"
	PolicyPacked      AllocationPolicy = "packed"
	PolicyDistributed AllocationPolicy = "distributed"
)

// Allocation configures GetPreferredAllocation.
type Allocation struct {
	// Policy decides for shared devices (replicas, several MIG devices of
	// one GPU); whole GPUs always get the best-connected set. packed and
	// distributed are NVIDIA's sharedDevicesAllocationPolicy values, with
	// their meaning (fill the most used GPU first, or the least used); a file
	// in NVIDIA's format gets distributed, NVIDIA's default.
	Policy AllocationPolicy `yaml:"policy"`
}

// MIGStrategy is NVIDIA's way of exposing MIG devices: none ignores them,
// single exposes one uniform profile as nvidia.com/gpu, mixed exposes
// nvidia.com/mig-<profile> per profile.
type MIGStrategy string

// MIG strategies.
const (
	MIGStrategyNone   MIGStrategy = "none"
	MIGStrategySingle MIGStrategy = "single"
	MIGStrategyMixed  MIGStrategy = "mixed"
)

// MIG is the MIG part of a config: how instances are exposed and, optionally,
// the layout the agent should create.
type MIG struct {
	// Strategy is how MIG devices are offered to the kubelet, NVIDIA's
	// strategies: none offers every GPU whole, MIG-enabled ones included;
	// single offers the MIG devices as nvidia.com/gpu (every GPU must have
	// one profile); mixed offers nvidia.com/mig-<profile> per profile. A
	// layout that enables MIG needs single or mixed.
	Strategy MIGStrategy `yaml:"strategy"`
	// Devices is the MIG layout the agent makes, in mig-parted's list form:
	// the first entry that matches a GPU (by devices and device-filter)
	// applies to it. At most one of devices and migPartedConfig is set; with
	// neither, and no nvidia.com/mig.config label, the agent leaves MIG as
	// it is.
	Devices MigLayout `yaml:"devices,omitempty"`
	// MigPartedConfig names the entry of mig-configs that is the layout.
	MigPartedConfig string `yaml:"migPartedConfig,omitempty"`
	// ResetPolicy says whether the agent resets a GPU whose MIG mode change
	// waits for a reset (an A100's MIG enable, on most hosts): whenIdle
	// (the default) resets it once no container, claim or
	// process has it, as NVIDIA's mig-manager does after stopping the GPU's
	// clients; never leaves the reset to a person, the GPU reporting
	// reset-required with what would have blocked it.
	// Default: `whenIdle`.
	ResetPolicy ResetPolicy `yaml:"resetPolicy,omitempty"`
}

// ResetPolicy is when the agent resets a GPU for a pending MIG mode change.
type ResetPolicy string

// Reset policies.
const (
	ResetWhenIdle ResetPolicy = "whenIdle"
	ResetNever    ResetPolicy = "never"
)

// ResetsWhenIdle reports whether p lets the agent reset an idle GPU ("" is
// the default, whenIdle).
func (p ResetPolicy) ResetsWhenIdle() bool { return p == "" || p == ResetWhenIdle }

// MigLayout is mig-parted's per-device layout list; the first entry that
// matches a GPU (by index and device filter) applies to it.
type MigLayout []MigDeviceConfig

// MigDeviceConfig is one entry of a MigLayout, field names as in mig-parted.
type MigDeviceConfig struct {
	// DeviceFilter restricts the entry to GPUs with these PCI device ids
	// (e.g. "0x20B010DE": 0x and 8 hex digits).
	// Default: every model.
	DeviceFilter StringList `yaml:"device-filter,omitempty,flow"`
	// Devices are the GPU indices the entry applies to, or all.
	Devices DeviceIndices `yaml:"devices,flow"`
	// MigEnabled is the GPUs' MIG mode: true turns MIG on (an A100 then
	// needs a reset, see mig.resetPolicy), false turns it off and serves the
	// GPUs whole.
	MigEnabled bool `yaml:"mig-enabled"`
	// MigDevices maps a profile ("1g.10gb") to how many instances of it to
	// make on each GPU. A layout the GPU cannot hold (a profile it lacks,
	// too many of one, no placement that fits) is refused before anything
	// changes.
	MigDevices map[string]int `yaml:"mig-devices"`
}

// Sharing is the replica-based sharing of devices, NVIDIA's field names.
type Sharing struct {
	// TimeSlicing advertises each selected device several times; CUDA's
	// time slicer takes turns between the containers given its replicas,
	// with no limit on any one.
	TimeSlicing *TimeSlicing `yaml:"timeSlicing,omitempty"`
	// MPS advertises each selected device several times and runs an MPS
	// control daemon for it; each container given a replica is an MPS
	// client with compute and memory limits. A device can be in one sharing
	// policy only.
	MPS *MPS `yaml:"mps,omitempty"`
}

// TimeSlicing advertises each selected device several times; the CUDA time
// slicer shares it between the containers.
type TimeSlicing struct {
	// RenameByDefault advertises the replicas of every resource without a
	// rename of its own under <name>.shared.
	RenameByDefault bool `yaml:"renameByDefault"`
	// FailRequestsGreaterThanOne rejects a container's request for more
	// than one replica, which would not give it more GPU.
	FailRequestsGreaterThanOne *bool `yaml:"failRequestsGreaterThanOne,omitempty"`
	// Resources are the resources whose devices are shared, at least one,
	// each resource once.
	Resources []ReplicatedResource `yaml:"resources"`
}

// MPS shares devices through an MPS control daemon per GPU, with per-client
// limits.
type MPS struct {
	// RenameByDefault advertises the replicas of every resource without a
	// rename of its own under <name>.shared.
	RenameByDefault bool `yaml:"renameByDefault"`
	// FailRequestsGreaterThanOne rejects a container's request for more
	// than one replica; on by default for MPS, as in NVIDIA's plugin, since
	// a container given two replicas of one GPU gets one MPS client.
	FailRequestsGreaterThanOne *bool `yaml:"failRequestsGreaterThanOne,omitempty"`
	// Resources are the resources whose devices are shared, at least one,
	// each resource once, with each client's limits.
	Resources []MPSResource `yaml:"resources"`
	// RefuseMIGDevices makes sharing a MIG device with MPS an error when
	// the config is planned, as NVIDIA's plugin refuses it. Set for files in
	// NVIDIA's format, so that one fails here as it fails there; gpu-agent's
	// own format may share MIG devices (one daemon per MIG device, which
	// CUDA supports). Not part of the schema.
	RefuseMIGDevices bool `yaml:"-"`
}

// ReplicatedResource selects devices of one resource and how many replicas
// each gets.
type ReplicatedResource struct {
	// Name is the resource whose devices are shared: nvidia.com/gpu or
	// nvidia.com/mig-<profile>.
	Name string `yaml:"name"`
	// Rename is the resource the replicas are advertised under, a valid
	// extended resource name; no two entries may advertise one name.
	// Default: name, or <name>.shared with renameByDefault.
	Rename string `yaml:"rename,omitempty"`
	// Devices are the devices of the resource to share: all, the first N,
	// or a list of GPU indices ("0"), MIG indices ("0:1"), GPU UUIDs or MIG
	// UUIDs. The others stay whole.
	Devices ReplicaDevices `yaml:"devices,flow"`
	// Replicas is how many replicas each device is advertised as.
	// Values: 2 to 1024.
	Replicas int `yaml:"replicas"`
}

// MPSResource is a ReplicatedResource with the MPS client limits.
type MPSResource struct {
	ReplicatedResource `yaml:",inline"`
	// ActiveThreadPercentage is each client's share of the device's
	// compute, CUDA_MPS_ACTIVE_THREAD_PERCENTAGE.
	// Default: 100 / replicas.
	// Values: 1 to 100.
	ActiveThreadPercentage *int `yaml:"activeThreadPercentage,omitempty"`
	// PinnedDeviceMemoryLimit is each client's device memory,
	// CUDA_MPS_PINNED_DEVICE_MEM_LIMIT; above 0.
	// Default: the device's memory / replicas.
	PinnedDeviceMemoryLimit *Quantity `yaml:"pinnedDeviceMemoryLimit,omitempty"`
}

// Health is the XID policy and health probing.
type Health struct {
	// IgnoredXids are XIDs that do not mark a device unhealthy, added to
	// NVIDIA's default list of application errors (13, 31, 43, 45, 68, 109:
	// the program failed, not the GPU). Every other XID is fatal.
	IgnoredXids []int `yaml:"ignoredXids,omitempty,flow"`
	// FatalXids are XIDs that mark a device unhealthy even when on the
	// default list; an XID cannot be both here and in ignoredXids.
	FatalXids []int `yaml:"fatalXids,omitempty,flow"`
	// DisableDefaultIgnored drops NVIDIA's default list, so only
	// ignoredXids are ignored.
	DisableDefaultIgnored bool `yaml:"disableDefaultIgnored"`
	// RecoveryQuietPeriod is how long a device marked for an application
	// error's XID (one that needs no reset) must see no new one before it
	// is offered again. Faults that need a reset or a reboot clear on
	// evidence of one, not after a time.
	RecoveryQuietPeriod Duration `yaml:"recoveryQuietPeriod"`
	// ProbeInterval is how often every GPU is probed, besides NVML's
	// events: whether NVML still reaches it, whether it needs a reset, and
	// the evidence that a reset happened.
	ProbeInterval Duration `yaml:"probeInterval"`
	// DRATaintEffect is the effect of the device taint an unhealthy device
	// carries in the DRA driver's ResourceSlice: NoSchedule (the default)
	// keeps new claims off it, NoExecute also evicts the pods whose claims
	// hold it (those that do not tolerate the taint).
	// Default: `NoSchedule`.
	DRATaintEffect string `yaml:"draTaintEffect,omitempty"`
}

// The values Health.DRATaintEffect accepts.
const (
	DRATaintNoSchedule = "NoSchedule"
	DRATaintNoExecute  = "NoExecute"
)

// Default durations of Health.
const (
	DefaultRecoveryQuietPeriod = 5 * time.Minute
	DefaultProbeInterval       = 10 * time.Second
)

// DefaultIgnoredXids is NVIDIA's list of XIDs caused by applications rather
// than the GPU (13 graphics engine exception, 31 memory page fault, 43 GPU
// stopped processing, 45 preemptive cleanup, 68 video processor exception,
// 109 context switch timeout). A function, so no caller can change it.
func DefaultIgnoredXids() []int { return []int{13, 31, 43, 45, 68, 109} }

// IsFatal reports whether an XID marks the GPU unhealthy under this policy.
func (h *Health) IsFatal(xid int) bool {
	for _, x := range h.FatalXids {
		if x == xid {
			return true
		}
	}
	for _, x := range h.IgnoredXids {
		if x == xid {
			return false
		}
	}
	if !h.DisableDefaultIgnored {
		for _, x := range DefaultIgnoredXids() {
			if x == xid {
				return false
			}
		}
	}
	return true
}

// FailsRequestsGreaterThanOne reports the effective setting (default false).
func (t *TimeSlicing) FailsRequestsGreaterThanOne() bool {
	return t.FailRequestsGreaterThanOne != nil && *t.FailRequestsGreaterThanOne
}

// FailsRequestsGreaterThanOne reports the effective setting (default true).
func (m *MPS) FailsRequestsGreaterThanOne() bool {
	return m.FailRequestsGreaterThanOne == nil || *m.FailRequestsGreaterThanOne
}

// ReplicaDevices selects the devices of a resource to replicate: all of them,
// the first Count, or an explicit list. Exactly one is set after defaults.
type ReplicaDevices struct {
	All   bool
	Count int
	// List holds GPU indices ("0"), MIG indices ("0:1"), GPU UUIDs
	// ("GPU-<uuid>") or MIG UUIDs ("MIG-<uuid>", "MIG-GPU-<uuid>/<gi>/<ci>").
	// Which device each names is resolved against the hardware later.
	List []string
}

// IsZero reports whether no selection was made (so the default, all, applies).
func (d ReplicaDevices) IsZero() bool { return !d.All && d.Count == 0 && d.List == nil }

// UnmarshalYAML accepts "all", a count or a list of device references.
func (d *ReplicaDevices) UnmarshalYAML(n *yaml.Node) error {
	*d = ReplicaDevices{}
	switch n.Kind {
	case yaml.ScalarNode:
		if n.ShortTag() == "!!int" {
			c, err := strconv.Atoi(n.Value)
			if err != nil {
				return fmt.Errorf("invalid device count %q", n.Value)
			}
			if c <= 0 {
				return fmt.Errorf("device count must be > 0, got %d", c)
			}
			d.Count = c
			return nil
		}
		if n.Value != "all" {
			return fmt.Errorf("expected \"all\", a count or a list of devices, got %q", n.Value)
		}
		d.All = true
		return nil
	case yaml.SequenceNode:
		d.List = make([]string, 0, len(n.Content))
		for i, item := range n.Content {
			if item.Kind != yaml.ScalarNode || item.ShortTag() == "!!null" {
				return fmt.Errorf("[%d]: expected a device index or UUID, got %s", i, describe(item))
			}
			ref := item.Value
			if item.ShortTag() == "!!int" {
				idx, err := strconv.ParseUint(ref, 10, 31)
				if err != nil {
					return fmt.Errorf("[%d]: invalid GPU index %q", i, ref)
				}
				ref = strconv.FormatUint(idx, 10)
			}
			if !IsDeviceRef(ref) {
				return fmt.Errorf("[%d]: %q is not a GPU index, a \"gpu:mig\" index or a GPU/MIG UUID", i, ref)
			}
			d.List = append(d.List, ref)
		}
		return nil
	}
	return fmt.Errorf("expected \"all\", a count or a list of devices, got %s", describe(n))
}

// MarshalYAML writes the form UnmarshalYAML reads.
func (d ReplicaDevices) MarshalYAML() (any, error) {
	switch {
	case d.Count > 0:
		return d.Count, nil
	case d.List != nil:
		return d.List, nil
	default:
		return "all", nil
	}
}

var (
	reGPUIndex = regexp.MustCompile(`^[0-9]+$`)
	reMIGIndex = regexp.MustCompile(`^[0-9]+:[0-9]+$`)
	reUUID     = regexp.MustCompile(`^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$`)
	reMIGLong  = regexp.MustCompile(`^MIG-GPU-([0-9a-fA-F-]+)/[0-9]+/[0-9]+$`)
)

// IsDeviceRef reports whether s is a syntactically valid device reference for
// ReplicaDevices.List (whether the device exists is checked against hardware).
func IsDeviceRef(s string) bool {
	switch {
	case reGPUIndex.MatchString(s), reMIGIndex.MatchString(s):
		return true
	case strings.HasPrefix(s, "GPU-"):
		return reUUID.MatchString(s[len("GPU-"):])
	case strings.HasPrefix(s, "MIG-GPU-"):
		m := reMIGLong.FindStringSubmatch(s)
		return m != nil && reUUID.MatchString(m[1])
	case strings.HasPrefix(s, "MIG-"):
		return reUUID.MatchString(s[len("MIG-"):])
	}
	return false
}

// DeviceIndices is mig-parted's devices field: "all" or a list of GPU indices.
type DeviceIndices struct {
	All     bool
	Indices []int
}

// IsZero reports whether the field was absent.
func (d DeviceIndices) IsZero() bool { return !d.All && d.Indices == nil }

// UnmarshalYAML accepts "all" or a list of non-negative integers.
func (d *DeviceIndices) UnmarshalYAML(n *yaml.Node) error {
	*d = DeviceIndices{}
	switch n.Kind {
	case yaml.ScalarNode:
		if n.Value != "all" || n.ShortTag() != "!!str" {
			return fmt.Errorf("expected \"all\" or a list of GPU indices, got %q", n.Value)
		}
		d.All = true
		return nil
	case yaml.SequenceNode:
		d.Indices = make([]int, 0, len(n.Content))
		for i, item := range n.Content {
			if item.Kind != yaml.ScalarNode || item.ShortTag() != "!!int" {
				return fmt.Errorf("[%d]: expected a GPU index, got %s", i, describe(item))
			}
			idx, err := strconv.ParseUint(item.Value, 10, 31)
			if err != nil {
				return fmt.Errorf("[%d]: invalid GPU index %q", i, item.Value)
			}
			d.Indices = append(d.Indices, int(idx))
		}
		return nil
	}
	return fmt.Errorf("expected \"all\" or a list of GPU indices, got %s", describe(n))
}

// MarshalYAML writes the form UnmarshalYAML reads.
func (d DeviceIndices) MarshalYAML() (any, error) {
	if d.All || d.Indices == nil {
		return "all", nil
	}
	return d.Indices, nil
}

// StringList is a field that may be written as one string or a list of them
// (mig-parted's device-filter).
type StringList []string

// UnmarshalYAML accepts a string or a list of strings.
func (s *StringList) UnmarshalYAML(n *yaml.Node) error {
	switch n.Kind {
	case yaml.ScalarNode:
		if n.ShortTag() == "!!null" {
			*s = nil
			return nil
		}
		*s = StringList{n.Value}
		return nil
	case yaml.SequenceNode:
		out := make(StringList, 0, len(n.Content))
		for i, item := range n.Content {
			if item.Kind != yaml.ScalarNode || item.ShortTag() == "!!null" {
				return fmt.Errorf("[%d]: expected a string, got %s", i, describe(item))
			}
			out = append(out, item.Value)
		}
		*s = out
		return nil
	}
	return fmt.Errorf("expected a string or a list of strings, got %s", describe(n))
}

// Quantity is a byte count written as plain bytes or with a Kubernetes-style
// suffix: Ki, Mi, Gi, Ti, Pi (powers of 1024) or K (k), M, G, T, P (of 1000).
type Quantity int64

var reQuantity = regexp.MustCompile(`^([0-9]+(?:\.[0-9]+)?)(Ki|Mi|Gi|Ti|Pi|k|K|M|G|T|P)?$`)

// ParseQuantity parses a byte quantity such as "10Gi", "512M" or "1048576".
// The result must be a whole number of bytes that fits in an int64.
func ParseQuantity(s string) (Quantity, error) {
	m := reQuantity.FindStringSubmatch(s)
	if m == nil {
		return 0, fmt.Errorf("invalid quantity %q: want bytes or a number with Ki/Mi/Gi/Ti or K/M/G/T", s)
	}
	r, ok := new(big.Rat).SetString(m[1])
	if !ok {
		return 0, fmt.Errorf("invalid quantity %q", s)
	}
	mult := map[string]int64{
		"": 1, "Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "Pi": 1 << 50,
		"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15,
	}[m[2]]
	r.Mul(r, new(big.Rat).SetInt64(mult))
	if !r.IsInt() {
		return 0, fmt.Errorf("invalid quantity %q: not a whole number of bytes", s)
	}
	if !r.Num().IsInt64() {
		return 0, fmt.Errorf("invalid quantity %q: too large", s)
	}
	return Quantity(r.Num().Int64()), nil
}

// UnmarshalYAML accepts an integer (bytes) or a string with a suffix.
func (q *Quantity) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode || n.ShortTag() == "!!null" {
		return fmt.Errorf("expected a quantity like \"10Gi\", got %s", describe(n))
	}
	v, err := ParseQuantity(n.Value)
	if err != nil {
		return err
	}
	*q = v
	return nil
}

// String writes the largest binary suffix that is exact, else plain bytes.
func (q Quantity) String() string {
	for _, u := range []struct {
		suffix string
		size   int64
	}{{"Pi", 1 << 50}, {"Ti", 1 << 40}, {"Gi", 1 << 30}, {"Mi", 1 << 20}, {"Ki", 1 << 10}} {
		if q != 0 && int64(q)%u.size == 0 {
			return strconv.FormatInt(int64(q)/u.size, 10) + u.suffix
		}
	}
	return strconv.FormatInt(int64(q), 10)
}

// MarshalYAML writes String's form, which ParseQuantity reads back exactly.
func (q Quantity) MarshalYAML() (any, error) { return q.String(), nil }

// Duration is a time.Duration written as a Go duration string ("5m", "10s").
type Duration time.Duration

// UnmarshalYAML accepts a Go duration string; a bare number is refused
// because its unit would be a guess.
func (d *Duration) UnmarshalYAML(n *yaml.Node) error {
	if n.Kind != yaml.ScalarNode || n.ShortTag() != "!!str" {
		return fmt.Errorf("expected a duration string like \"10s\", got %s", describe(n))
	}
	v, err := time.ParseDuration(n.Value)
	if err != nil {
		return fmt.Errorf("invalid duration %q: want a Go duration such as \"30s\" or \"5m\"", n.Value)
	}
	*d = Duration(v)
	return nil
}

// MarshalYAML writes the Go duration string.
func (d Duration) MarshalYAML() (any, error) { return time.Duration(d).String(), nil }

// D returns d as a time.Duration.
func (d Duration) D() time.Duration { return time.Duration(d) }

// describe names a node's kind for type errors.
func describe(n *yaml.Node) string {
	switch n.Kind {
	case yaml.MappingNode:
		return "a mapping"
	case yaml.SequenceNode:
		return "a list"
	case yaml.AliasNode:
		return "an alias"
	case yaml.DocumentNode:
		return "a document"
	}
	if n.ShortTag() == "!!null" {
		return "null"
	}
	v := n.Value
	if len(v) > 40 {
		v = v[:40] + "..."
	}
	return strconv.Quote(v)
}
