package imex

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/gpu"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"
)

// DriverName is the DRA driver of compute domains, as NVIDIA names it, so
// that its DeviceClasses select this node's devices.
const DriverName = "compute-domain.nvidia.com"

// The device attributes NVIDIA's DeviceClasses select on
// (compute-domain-daemon.nvidia.com: type == "daemon";
// compute-domain-default-channel.nvidia.com: type == "channel" && id == 0).
const (
	AttrType      = "type"
	AttrID        = "id"
	TypeChannel   = "channel"
	TypeDaemon    = "daemon"
	DaemonDevice  = "daemon-0"
	channelPrefix = "channel-"
)

// The taints on the channel devices.
const (
	// TaintFabric: the node's GPUs are not (or not fully) in their NVLink
	// fabric; the value names the GPUs and why.
	TaintFabric = DriverName + "/fabric"
	// TaintIMEX: IMEX daemons cannot be run on the node (the program is
	// missing, or daemons keep failing).
	TaintIMEX = DriverName + "/imex"
)

// slicesMax is how many devices one ResourceSlice holds: the API server's
// limit for slices with taints (ResourceSliceMaxDevicesWithAdvancedFeatures),
// so a taint never makes a slice too large.
const slicesMax = resourceapi.ResourceSliceMaxDevicesWithAdvancedFeatures

// ChannelName is channel device id's name.
func ChannelName(id int) string { return channelPrefix + strconv.Itoa(id) }

// channelID is the id of a channel device's name.
func channelID(name string) (int, bool) {
	s, ok := strings.CutPrefix(name, channelPrefix)
	if !ok {
		return 0, false
	}
	n, err := strconv.Atoi(s)
	if err != nil || n < 0 || ChannelName(n) != name {
		return 0, false
	}
	return n, true
}

// Fault is why the channels are tainted, and how.
type Fault struct {
	Key    string                        `json:"key"`
	Why    string                        `json:"why"`
	Effect resourceapi.DeviceTaintEffect `json:"effect"`
}

// Fabric is what the inventory says of the node's NVLink fabric.
type Fabric struct {
	// Attached: a GPU reports fabric info (it is a multi-node NVLink
	// GPU), whatever its state; only such nodes serve the driver.
	Attached bool
	// Clique is the GPUs' clique ("<cluster UUID>.<clique id>"), "" when
	// none is complete or the GPUs disagree.
	Clique string
	// Faults are the fabric's problems, one per kind, most severe first.
	Faults []Fault
}

// FabricOf reads the fabric from the inventory. A GPU whose registration
// is not complete or failed, or that reports its fabric unhealthy, taints
// the channels NoExecute: memory imported over it fails, so the pods using
// them are better rescheduled. Limited capacity (degraded bandwidth, a
// route in recovery) taints them NoSchedule: running jobs go on slower. GPUs
// in different cliques are an error of the node's setup, NoExecute too.
func FabricOf(inv *gpu.Inventory) Fabric {
	var f Fabric
	if inv == nil {
		return f
	}
	var broken, limited []string
	cliques := map[string]bool{}
	for _, g := range inv.GPUs {
		if g.Fabric == nil {
			continue
		}
		f.Attached = true
		fb := g.Fabric
		switch {
		case fb.State != gpu.FabricCompleted:
			broken = append(broken, fmt.Sprintf("GPU %d: fabric registration %s", g.Index, fb.State))
		case fb.Error != "":
			broken = append(broken, fmt.Sprintf("GPU %d: fabric registration failed: %s", g.Index, fb.Error))
		case fb.Health == gpu.FabricUnhealthy:
			broken = append(broken, fmt.Sprintf("GPU %d: fabric unhealthy (%s)", g.Index, strings.Join(fb.Conditions, ", ")))
		case fb.Health == gpu.FabricLimitedCapacity:
			limited = append(limited, fmt.Sprintf("GPU %d: fabric at limited capacity (%s)", g.Index, strings.Join(fb.Conditions, ", ")))
		}
		if c := fb.Clique(); c != "" {
			cliques[c] = true
		}
	}
	switch len(cliques) {
	case 1:
		for c := range cliques {
			f.Clique = c
		}
	case 0:
	default:
		all := make([]string, 0, len(cliques))
		for c := range cliques {
			all = append(all, c)
		}
		slices.Sort(all)
		broken = append(broken, "GPUs in different cliques: "+strings.Join(all, ", "))
	}
	if len(broken) > 0 {
		f.Faults = append(f.Faults, Fault{Key: TaintFabric, Why: strings.Join(broken, "; "), Effect: resourceapi.DeviceTaintEffectNoExecute})
	} else if len(limited) > 0 {
		f.Faults = append(f.Faults, Fault{Key: TaintFabric, Why: strings.Join(limited, "; "), Effect: resourceapi.DeviceTaintEffectNoSchedule})
	}
	return f
}

// Pool is what the node offers through the driver: channels 0..Channels-1
// and the daemon device, with the faults the channels carry as taints.
type Pool struct {
	Channels int
	Faults   []Fault
}

// Equal reports whether two pools publish the same slices.
func (p Pool) Equal(o Pool) bool { return p.Channels == o.Channels && slices.Equal(p.Faults, o.Faults) }

// Dropped says which fields of the slices the API server drops (their
// feature is off there), so that they are not published.
type Dropped struct {
	// Taints: DRADeviceTaints (1.34 and 1.35 by default).
	Taints bool
	// BindingConditions: DRADeviceBindingConditions (before 1.36).
	BindingConditions bool
	// Sharing: DRAConsumableCapacity (before 1.36), whose
	// allowMultipleAllocations lets the scheduler give one channel device,
	// or the daemon device, to several claims. Without it both are
	// published as ordinary devices, and since NVIDIA's default channel
	// class selects channel-0 alone, a node serves one channel claim and
	// one daemon claim at a time.
	Sharing bool
}

// droppedFeatures are the features whose fields Dropped latches, with
// what the node loses while each is off, in the order /status lists them.
var droppedFeatures = []struct{ name, effect string }{
	{"DRADeviceTaints", "the channels of a faulty fabric are left out of the ResourceSlices"},
	{"DRADeviceBindingConditions", "channel claims are bound at once, and Prepare waits for the domain's daemon"},
	{"DRAConsumableCapacity", "channels and the daemon device are published without allowMultipleAllocations: one channel claim per node " +
		"(NVIDIA's default channel class selects channel-0 alone), so a second domain's pod, or a second pod of one domain, waits for another node; " +
		"likewise one daemon claim per node, so a second domain's daemon claim waits for another node"},
}

// flag is the field of x that latches feature, nil for a feature it does
// not know.
func (x *Dropped) flag(feature string) *bool {
	switch feature {
	case "DRADeviceTaints":
		return &x.Taints
	case "DRADeviceBindingConditions":
		return &x.BindingConditions
	case "DRAConsumableCapacity":
		return &x.Sharing
	}
	return nil
}

// FeatureOff is a feature the API server has been seen to drop the
// fields of, and what the node loses while it is off.
type FeatureOff struct {
	Feature string `json:"feature"`
	Effect  string `json:"effect"`
}

// effect is what the node loses while feature is off.
func (x Dropped) effect(feature string) string {
	for _, f := range droppedFeatures {
		if f.name == feature {
			return f.effect
		}
	}
	return ""
}

// Off lists the latched features (nil when none is).
func (x Dropped) Off() []FeatureOff {
	var out []FeatureOff
	for _, f := range droppedFeatures {
		if *x.flag(f.name) {
			out = append(out, FeatureOff{Feature: f.name, Effect: f.effect})
		}
	}
	return out
}

// Resources are the pool's ResourceSlices for the controller: the daemon
// device first, then the channels in id order, slicesMax a slice. Without
// taints (the API server drops them) a faulty pool publishes no channel at
// all, since one would be handed out as healthy. Where the API server
// keeps them, each channel carries the binding conditions of the contract
// with the controller: the scheduler allocates a channel claim and binds
// its pod only once the controller says the domain's daemon on the node is
// ready (ConditionDaemonReady), or allocates elsewhere when the node
// cannot join (ConditionDaemonFailed), so Prepare never waits.
//
// Each channel allows multiple allocations (DRAConsumableCapacity) where
// the API server keeps the field: NVIDIA's default channel class selects
// channel-0 alone, and every workload claim on the node, of any domain,
// is allocated that one device (a share of it, with a shareID of its
// own). The device is a name the class can select, not a host channel:
// Prepare gives each claim its domain's channel. No capacity is
// published, so the shares are not counted: the host channels a node
// can give out are limited by Prepare, which refuses a domain when all
// are held by others.
//
// The daemon device allows multiple allocations too, for the same
// reason: NVIDIA's daemon class selects type "daemon", which is daemon-0
// alone, and a node may run the daemons of several domains (one per
// domain, on ports of their own). Each domain's daemon claim is a share
// of daemon-0; Prepare takes the domain from the claim's
// ComputeDomainDaemonConfig, not from the device, so each gets its own
// domain's identity. The daemon device has no binding condition: its
// claim is what starts the daemon, so waiting for the daemon would never
// end.
func Resources(node string, p Pool, gen int64, drop Dropped) resourceslice.DriverResources {
	noTaints := drop.Taints
	daemon := resourceapi.Device{Name: DaemonDevice, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
		AttrType: {StringValue: ptr.To(TypeDaemon)}, AttrID: {IntValue: ptr.To[int64](0)},
	}}
	if !drop.Sharing {
		daemon.AllowMultipleAllocations = ptr.To(true)
	}
	devices := []resourceapi.Device{daemon}
	var taints []resourceapi.DeviceTaint
	for _, f := range p.Faults {
		taints = append(taints, resourceapi.DeviceTaint{Key: f.Key, Value: taintValue(f.Why), Effect: f.Effect})
	}
	channels := p.Channels
	if noTaints && len(taints) > 0 {
		channels = 0
	}
	for i := range channels {
		d := resourceapi.Device{Name: ChannelName(i), Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			AttrType: {StringValue: ptr.To(TypeChannel)}, AttrID: {IntValue: ptr.To(int64(i))},
		}}
		if len(taints) > 0 && !noTaints {
			d.Taints = slices.Clone(taints)
		}
		if !drop.Sharing {
			d.AllowMultipleAllocations = ptr.To(true)
		}
		if !drop.BindingConditions {
			d.BindingConditions = []string{ConditionDaemonReady}
			d.BindingFailureConditions = []string{ConditionDaemonFailed}
		}
		devices = append(devices, d)
	}
	var out []resourceslice.Slice
	for chunk := range slices.Chunk(devices, slicesMax) {
		out = append(out, resourceslice.Slice{Devices: chunk})
	}
	return resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		node: {Generation: gen, Slices: out},
	}}
}

// taintValue fits why into a taint's value: a label value (63
// characters of [A-Za-z0-9._-]); the whole reason is on /status.
func taintValue(why string) string {
	var b strings.Builder
	for _, c := range why {
		switch {
		case b.Len() == 63:
			return strings.Trim(b.String(), "-_.")
		case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9', c == '.', c == '_':
			b.WriteRune(c)
		default:
			if s := b.String(); s != "" && s[len(s)-1] != '-' {
				b.WriteByte('-')
			}
		}
	}
	return strings.Trim(b.String(), "-_.")
}
