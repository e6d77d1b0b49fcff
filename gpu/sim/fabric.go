package sim

import (
	"errors"
	"fmt"
	"strconv"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/uuid"
)

// WithClique places the node in NVLink domain and clique id, as the
// rack's fabric manager would: every node built with the same id reports
// the same cluster UUID (derived from id) and clique id in its GPUs'
// fabric info, so they form one multi-node NVLink domain; nodes with
// another id are in another. Only fabric-attached profiles (gb200-tray)
// take it; without it they are in clique 1.
func WithClique(id uint32) Option {
	return func(o *options) { o.clique, o.cliqueSet = id, true }
}

// defaultClique is the clique of a fabric-attached node built without
// WithClique: any one id will do, as long as nodes agree on it.
const defaultClique = 1

// FabricFault is what is wrong with one GPU's attachment to the NVLink
// fabric; its zero value is nothing: registration completed with
// SUCCESS, every health bit false.
type FabricFault struct {
	// State, when not zero, is the registration's state instead of
	// GPU_FABRIC_STATE_COMPLETED: GPU_FABRIC_STATE_NOT_STARTED or
	// GPU_FABRIC_STATE_IN_PROGRESS (a fabric GPU never reports
	// NOT_SUPPORTED, so zero stands for completed). A GPU whose
	// registration is not complete reports no cluster UUID or clique.
	State nvml.GpuFabricState
	// Status is the outcome of a completed registration (zero: SUCCESS),
	// an NVML error such as ERROR_NOT_READY when the fabric manager
	// refused the GPU.
	Status nvml.Return
	// DegradedBandwidth: some of the GPU's NVLinks are down; the fabric
	// runs at reduced bandwidth (health summary LIMITED_CAPACITY).
	DegradedBandwidth bool
	// RouteRecovery: the fabric is recovering a route (LIMITED_CAPACITY).
	RouteRecovery bool
	// RouteUnhealthy: a route is broken (health summary UNHEALTHY).
	RouteUnhealthy bool
}

func (f FabricFault) validate() error {
	switch f.State {
	case 0, nvml.GPU_FABRIC_STATE_COMPLETED, nvml.GPU_FABRIC_STATE_NOT_STARTED, nvml.GPU_FABRIC_STATE_IN_PROGRESS:
	default:
		return fmt.Errorf("fabric state %d: want NOT_STARTED (1), IN_PROGRESS (2) or COMPLETED (3)", f.State)
	}
	if f.Status != nvml.SUCCESS && returnName(f.Status) == "" {
		return fmt.Errorf("fabric status %d is not an NVML error the sim knows", f.Status)
	}
	return nil
}

// SetFabricFault replaces what is wrong with the GPU's fabric attachment
// (the zero FabricFault clears it). It is kept in the state file, as the
// fabric's view of a GPU outlives the agent; a reset or reboot does not
// clear it (the fabric manager, not the GPU, decides). Profiles that are
// not fabric-attached refuse it.
func (n *Node) SetFabricFault(gpu int, f FabricFault) error {
	if !n.spec.fabric {
		return fmt.Errorf("sim %s: not attached to an NVLink fabric (fabric-attached profiles: %s)", n.spec.name, fabricProfiles())
	}
	if err := f.validate(); err != nil {
		return fmt.Errorf("sim %s: gpu %d: %w", n.spec.name, gpu, err)
	}
	if f.State == nvml.GPU_FABRIC_STATE_COMPLETED {
		f.State = 0
	}
	return n.update(gpu, func(g *gpuState) error {
		g.fabric = f
		return nil
	})
}

// fabricProfiles names the profiles WithClique and SetFabricFault take.
func fabricProfiles() string {
	var names []string
	for _, p := range Profiles() {
		for _, s := range nodeSpecs {
			if s.name == p.Name && s.fabric {
				names = append(names, s.name)
			}
		}
	}
	if len(names) == 0 {
		return "none"
	}
	return fmt.Sprint(names)
}

// ClusterUUID is the NVLink domain's cluster UUID of a node in clique id
// (WithClique), as its GPUs report it.
func ClusterUUID(id uint32) uuid.UUID {
	return uuid.NewSHA1(uuidNamespace, []byte("nvlink-domain/"+strconv.FormatUint(uint64(id), 10)))
}

// health is NVML's health mask and summary for f: every field this NVML
// version defines is reported (never NOT_SUPPORTED), as on GB200.
func (f FabricFault) health() (mask uint32, summary uint8) {
	bit := func(v bool, shift uint32) uint32 {
		if v {
			return nvml.GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE << shift // every TRUE is 1
		}
		return nvml.GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_FALSE << shift // every FALSE is 2
	}
	mask = bit(f.DegradedBandwidth, nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW) |
		bit(f.RouteRecovery, nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY) |
		bit(f.RouteUnhealthy, nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY) |
		bit(false, nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY) |
		nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NONE<<nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION |
		bit(true, nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_PARTITION_ASSIGNED)
	switch {
	case f.RouteUnhealthy:
		summary = nvml.GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY
	case f.DegradedBandwidth || f.RouteRecovery:
		summary = nvml.GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY
	default:
		summary = nvml.GPU_FABRIC_HEALTH_SUMMARY_HEALTHY
	}
	return mask, summary
}

// fabricInfo is the version 3 answer for g; callers hold n.mu and have
// checked the profile is fabric-attached.
func (n *Node) fabricInfo(g *gpuState) nvml.GpuFabricInfo_v3 {
	f := g.fabric
	info := nvml.GpuFabricInfo_v3{
		Version: nvml.STRUCT_VERSION(nvml.GpuFabricInfo_v3{}, 3),
		State:   nvml.GPU_FABRIC_STATE_COMPLETED,
		Status:  uint32(f.Status),
	}
	info.HealthMask, info.HealthSummary = f.health()
	if f.State != 0 {
		// Registration under way: NVML has no domain to report yet,
		// and its status means nothing until it completes.
		info.State = uint8(f.State)
		return info
	}
	info.ClusterUuid = n.clusterUUID
	info.CliqueId = n.opts.clique
	return info
}

// noFabric answers the fabric calls of a profile without a fabric:
// NOT_SUPPORTED, or why not even that. FailCalls reaches it, SetFlaky does
// not: the fabric read the inventory makes then draws nothing from a
// seeded flaky source, and the runs other profiles' soak tests were tuned
// on stay as they were. Fabric-attached GPUs take both.
func (d *device) noFabric(call string) nvml.Return {
	d.n.mu.Lock()
	defer d.n.mu.Unlock()
	if r := d.n.ready(); r != nvml.SUCCESS {
		return r
	}
	if r := d.n.injectedCall(d.g, call); r != nvml.SUCCESS {
		return r
	}
	switch {
	case d.g.lost:
		return nvml.ERROR_GPU_IS_LOST
	case d.ci != nil && d.ci.destroyed:
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return nvml.ERROR_NOT_SUPPORTED
}

// GetGpuFabricInfo is nvmlDeviceGetGpuFabricInfo (version 1, no health):
// NOT_SUPPORTED on GPUs that are not fabric-attached and on MIG devices.
func (d *device) GetGpuFabricInfo() (nvml.GpuFabricInfo, nvml.Return) {
	if !d.n.spec.fabric {
		return nvml.GpuFabricInfo{}, d.noFabric("GetGpuFabricInfo")
	}
	r := d.lock("GetGpuFabricInfo", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.GpuFabricInfo{}, r
	}
	v3 := d.n.fabricInfo(d.g)
	return nvml.GpuFabricInfo{ClusterUuid: v3.ClusterUuid, Status: v3.Status, CliqueId: v3.CliqueId, State: v3.State}, nvml.SUCCESS
}

// GetGpuFabricInfoV3 answers what nvmlDeviceGetGpuFabricInfoV answers
// for a version 3 struct, with the health mask and summary. go-nvml's
// GetGpuFabricInfoV returns a handler whose V2 and V3 call the real
// library whatever the device, and which no other package can build, so
// the sim cannot answer through it (its GetGpuFabricInfoV must not be
// used); readers take this method where a device has it (gpu.Options).
func (d *device) GetGpuFabricInfoV3() (nvml.GpuFabricInfo_v3, nvml.Return) {
	if !d.n.spec.fabric {
		return nvml.GpuFabricInfo_v3{}, d.noFabric("GetGpuFabricInfoV")
	}
	r := d.lock("GetGpuFabricInfoV", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.GpuFabricInfo_v3{}, r
	}
	return d.n.fabricInfo(d.g), nvml.SUCCESS
}

// fabricRecord is a GPU's FabricFault in the state file.
type fabricRecord struct {
	// State is "not-started" or "in-progress"; "" is completed.
	State string `json:"state,omitempty"`
	// Status is an NVML error name ("ERROR_NOT_READY"); "" is SUCCESS.
	Status            string `json:"status,omitempty"`
	DegradedBandwidth bool   `json:"degraded_bw,omitempty"`
	RouteRecovery     bool   `json:"route_recovery,omitempty"`
	RouteUnhealthy    bool   `json:"route_unhealthy,omitempty"`
}

// fabricStateNames are the registration states as the state file and
// the HTTP API spell them.
var fabricStateNames = map[string]nvml.GpuFabricState{
	"not-started": nvml.GPU_FABRIC_STATE_NOT_STARTED,
	"in-progress": nvml.GPU_FABRIC_STATE_IN_PROGRESS,
	"completed":   nvml.GPU_FABRIC_STATE_COMPLETED,
}

// ParseFabricState reads a registration state as the state file and the
// HTTP API spell it: "not-started", "in-progress" or "completed".
func ParseFabricState(s string) (nvml.GpuFabricState, error) {
	st, ok := fabricStateNames[s]
	if !ok {
		return 0, fmt.Errorf("fabric state %q: want not-started, in-progress or completed", s)
	}
	return st, nil
}

func fabricStateName(st nvml.GpuFabricState) string {
	for name, v := range fabricStateNames {
		if v == st {
			return name
		}
	}
	return strconv.Itoa(int(st))
}

func (f FabricFault) record() *fabricRecord {
	if f == (FabricFault{}) {
		return nil
	}
	r := &fabricRecord{DegradedBandwidth: f.DegradedBandwidth, RouteRecovery: f.RouteRecovery, RouteUnhealthy: f.RouteUnhealthy}
	if f.State != 0 {
		r.State = fabricStateName(f.State)
	}
	if f.Status != nvml.SUCCESS {
		r.Status = returnName(f.Status)
	}
	return r
}

func (r *fabricRecord) fault() (FabricFault, error) {
	if r == nil {
		return FabricFault{}, nil
	}
	f := FabricFault{DegradedBandwidth: r.DegradedBandwidth, RouteRecovery: r.RouteRecovery, RouteUnhealthy: r.RouteUnhealthy}
	if r.State != "" {
		st, err := ParseFabricState(r.State)
		if err != nil {
			return f, err
		}
		if st == nvml.GPU_FABRIC_STATE_COMPLETED {
			// What this sim writes is what it reads back.
			return f, errors.New(`state "completed" is the default: leave it out`)
		}
		f.State = st
	}
	if r.Status != "" {
		ret, err := parseReturn(r.Status)
		if err != nil {
			return f, fmt.Errorf("fabric status: %w", err)
		}
		f.Status = ret
	}
	if *r == (fabricRecord{}) {
		return f, errors.New(`empty "fabric": leave it out`)
	}
	return f, nil
}
