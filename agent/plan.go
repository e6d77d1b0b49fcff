package agent

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mps"
	"github.com/gpu-agent/gpu-agent/plugin/topology"
	"github.com/gpu-agent/gpu-agent/timeslice"
)

// ResourceGPU is the whole-GPU resource name pods written for NVIDIA's stack request.
const ResourceGPU = "nvidia.com/gpu"

// resourceMIGPrefix names a MIG profile's resource under the mixed strategy.
const resourceMIGPrefix = "nvidia.com/mig-"

// Control device nodes every CUDA container needs besides its /dev/nvidiaN.
var controlDeviceNodes = []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"}

// PlanInput is everything the catalog is derived from. It is a pure value: the
// same input always plans the same catalog.
type PlanInput struct {
	Inventory *gpu.Inventory
	// ConfigName names the selected config in error messages (field paths).
	ConfigName string
	// PassDeviceSpecs adds /dev/nvidia* device nodes to Allocate responses
	// (needed where the container runtime does not inject them itself).
	PassDeviceSpecs bool
	// MIGStrategy decides how MIG-enabled GPUs are offered: none ("" too)
	// ignores MIG and offers each such GPU whole as nvidia.com/gpu, as
	// NVIDIA's plugin does; single offers its MIG devices as nvidia.com/gpu,
	// mixed as nvidia.com/mig-<profile>.
	MIGStrategy config.MIGStrategy
	// DeviceIDStrategy is how a device is named to the container runtime
	// (NVIDIA_VISIBLE_DEVICES): config.DeviceIDStrategyUUID ("" too) or
	// config.DeviceIDStrategyIndex ("0", "<gpu>:<mig>"). Device IDs the
	// kubelet sees are UUIDs either way, as in NVIDIA's plugin.
	DeviceIDStrategy string
	// Env is added to every container given a device of any resource
	// (NVIDIA_GDS=enabled and the like, config.DevicePlugin.ContainerEnv).
	Env map[string]string
	// Delivery is how containers are told their devices (the config's
	// device list strategies).
	Delivery catalog.Delivery
	// Sharing turns selected devices into replicas.
	Sharing config.Sharing
	// Unhealthy maps a GPU or MIG UUID to the reason it is unhealthy.
	Unhealthy map[string]string
	// Failed are GPUs of an earlier inventory that the latest one could not
	// read (lost, NVML errors), keyed by UUID with the reason. They stay
	// offered, unhealthy: a device that vanishes from ListAndWatch looks to
	// the kubelet like a removal, not a failure, and nobody is told why.
	Failed map[string]FailedGPU
	// Scorer ranks GPU sets for GetPreferredAllocation (nil: plugin default).
	Scorer *topology.Scorer
	// MPS is where MPS daemons live and how they are doing.
	MPS MPSInput
}

// MPSInput is what planning MPS sharing needs besides the config.
type MPSInput struct {
	// Root holds each daemon's pipe and log directories (--mps-root).
	Root string
	// ShmDir is the host directory mounted as /dev/shm in MPS clients ("":
	// none), shared with the daemons.
	ShmDir string
	// Healthy says whether the daemon of a device answers (nil: assume so).
	Healthy func(device string) (bool, string)
}

// Planned is what the node should offer and run.
type Planned struct {
	Catalog *catalog.Catalog
	// MPSDaemons are the MPS control daemons the catalog's MPS replicas need.
	MPSDaemons []mps.Daemon
	// Warnings name config fields this node could not honour although the
	// rest of the config applies (a sharing entry for a resource the node
	// does not offer), one sentence each, for the log and /status.
	Warnings []string
}

// PlanCatalog decides what the node offers. MIG-enabled GPUs are offered as
// their MIG devices under the single and mixed strategies, and whole under
// none, as NVIDIA's plugin does (with a warning: CUDA cannot use such a GPU
// without its MIG devices). An error names the config field that cannot be
// applied to this node; the caller keeps serving what it served before.
func PlanCatalog(in PlanInput) (*catalog.Catalog, error) {
	p, err := PlanResources(in)
	return p.Catalog, err
}

// PlanResources is PlanCatalog plus the MPS daemons its replicas need.
func PlanResources(in PlanInput) (Planned, error) {
	c := &catalog.Catalog{Resources: map[string]*catalog.Resource{}}
	if in.Inventory == nil {
		return Planned{Catalog: c}, nil
	}
	unhealthy := in.Unhealthy
	gpus := slices.Clone(in.Inventory.GPUs)
	if len(in.Failed) > 0 {
		unhealthy = maps.Clone(in.Unhealthy)
		if unhealthy == nil {
			unhealthy = map[string]string{}
		}
		for _, uuid := range slices.Sorted(maps.Keys(in.Failed)) {
			f := in.Failed[uuid]
			gpus = append(gpus, f.GPU)
			unhealthy[uuid] = f.Reason
		}
	}
	add := func(name string, d catalog.Device) {
		r := c.Resources[name]
		if r == nil {
			r = &catalog.Resource{Name: name, Delivery: in.Delivery}
			if in.PassDeviceSpecs {
				r.Common.DeviceNodes = slices.Clone(controlDeviceNodes)
			}
			if len(in.Env) > 0 {
				r.Common.Env = maps.Clone(in.Env)
			}
			c.Resources[name] = r
		}
		if reason, bad := unhealthy[d.ID]; bad {
			d.Healthy, d.Reason = false, reason
		} else if reason, bad := unhealthy[d.Spec.VisibleID]; bad {
			d.Healthy, d.Reason = false, reason
		}
		r.Devices = append(r.Devices, d)
	}
	var warnings []string
	// index is each device's name under deviceIDStrategy index, by UUID:
	// the NVML index of a GPU, "<gpu>:<mig>" for a MIG device, where <mig>
	// is its GetMigDeviceHandleByIndex index, as NVIDIA's plugin numbers
	// them and the container runtime reads them.
	index := map[string]string{}
	var wholeMIG []string
	for _, g := range gpus {
		nodes := []string(nil)
		if in.PassDeviceSpecs {
			nodes = []string{fmt.Sprintf("/dev/nvidia%d", g.Minor)}
		}
		index[g.UUID] = strconv.Itoa(g.Index)
		none := in.MIGStrategy == config.MIGStrategyNone || in.MIGStrategy == ""
		if !g.MIG.Current || none {
			if g.MIG.Current {
				wholeMIG = append(wholeMIG, strconv.Itoa(g.Index))
			}
			add(ResourceGPU, catalog.Device{ID: g.UUID, Healthy: true, NUMANode: g.NUMANode, GPU: g.Index,
				Spec: catalog.AllocateSpec{VisibleID: g.UUID, DeviceNodes: nodes}})
			continue
		}
		for _, m := range g.Instances {
			index[m.UUID] = fmt.Sprintf("%d:%d", g.Index, m.Index)
			name := ResourceGPU
			if in.MIGStrategy == config.MIGStrategyMixed {
				name = MIGResourceName(m.Profile)
			}
			d := catalog.Device{ID: m.UUID, Healthy: true, NUMANode: g.NUMANode, GPU: g.Index,
				Spec: catalog.AllocateSpec{VisibleID: m.UUID, DeviceNodes: nodes}}
			// A fault on the parent GPU takes its instances with it.
			if reason, bad := unhealthy[g.UUID]; bad {
				d.Healthy, d.Reason = false, reason
			}
			add(name, d)
		}
	}
	if len(wholeMIG) > 0 {
		// NVIDIA's strategy none makes no difference between MIG-enabled
		// GPUs and others; say what that gives a container.
		warnings = append(warnings, fmt.Sprintf("configs.%s.mig.strategy: none offers MIG-enabled GPU(s) %s whole as %s, as NVIDIA's plugin does; "+
			"CUDA cannot use such a GPU without its MIG devices: use single or mixed to offer those instead",
			in.ConfigName, strings.Join(wholeMIG, ", "), ResourceGPU))
	}
	daemons, shareWarnings, err := applySharing(c, in)
	if err != nil {
		return Planned{}, err
	}
	warnings = append(warnings, shareWarnings...)
	for name, r := range c.Resources {
		if len(r.Devices) == 0 {
			delete(c.Resources, name) // a resource without devices would register and offer nothing
			continue
		}
		if in.DeviceIDStrategy == config.DeviceIDStrategyIndex {
			for i := range r.Devices {
				r.Devices[i].Spec.RuntimeID = index[r.Devices[i].Spec.VisibleID]
			}
		}
		slices.SortFunc(r.Devices, func(a, b catalog.Device) int { return cmp.Compare(a.ID, b.ID) })
		if in.Scorer != nil {
			r.Preferred = topology.NewPreferrer(in.Scorer, r.Devices)
		}
	}
	return Planned{Catalog: c, MPSDaemons: daemons, Warnings: warnings}, nil
}

// MIGResourceName is the mixed-strategy resource of a MIG profile: NVIDIA's
// names, with "+" (not allowed in resource names) written as ".".
func MIGResourceName(profile string) string {
	return resourceMIGPrefix + strings.ReplaceAll(profile, "+", ".")
}

// applySharing replaces the devices each time-slicing or MPS entry selects
// by their replicas, under the entry's rename or its own name, and returns
// the MPS daemons the MPS replicas need. An entry naming a resource this
// node does not offer is skipped with a warning, as NVIDIA's plugin skips
// it: one ConfigMap then serves unlike nodes (whole GPUs on one, MIG
// devices on another). Devices it names that the resource lacks are still
// an error, as there.
func applySharing(c *catalog.Catalog, in PlanInput) ([]mps.Daemon, []string, error) {
	field := fmt.Sprintf("configs.%s.sharing", in.ConfigName)
	type group struct {
		name, target string
		devs         []catalog.Device
		replicas     int
		limit        bool
	}
	var groups []group
	var warnings []string
	// take moves the devices an entry selects out of its resource and
	// returns where their replicas go; target "" (and a warning) when the
	// node does not offer the resource.
	take := func(f string, e config.ReplicatedResource) ([]catalog.Device, string, error) {
		src := c.Resources[e.Name]
		if src == nil {
			offers := "nothing"
			if names := c.Names(); len(names) > 0 {
				offers = strings.Join(names, ", ")
			}
			warnings = append(warnings, fmt.Sprintf("%s.name: this node offers no %s (it offers %s); the entry is skipped, as NVIDIA's plugin skips it",
				f, e.Name, offers))
			return nil, "", nil
		}
		sel, err := timeslice.Select(e.Devices, byGPU(src.Devices), f+".devices")
		if err != nil {
			return nil, "", err
		}
		target := cmp.Or(e.Rename, e.Name)
		if other := c.Resources[target]; target != e.Name && other != nil {
			return nil, "", fmt.Errorf("%s.rename: %s is already offered by this node; choose another name", f, target)
		}
		src.Devices = slices.DeleteFunc(src.Devices, func(d catalog.Device) bool {
			return slices.ContainsFunc(sel, func(s catalog.Device) bool { return s.ID == d.ID })
		})
		return sel, target, nil
	}
	if ts := in.Sharing.TimeSlicing; ts != nil {
		for i, e := range ts.Resources {
			sel, target, err := take(fmt.Sprintf("%s.timeSlicing.resources[%d]", field, i), e)
			if err != nil {
				return nil, nil, err
			}
			if target == "" {
				continue // skipped: the node does not offer the resource
			}
			groups = append(groups, group{name: e.Name, target: target, devs: sel, replicas: e.Replicas, limit: ts.FailsRequestsGreaterThanOne()})
		}
	}
	var daemons []mps.Daemon
	if m := in.Sharing.MPS; m != nil {
		for i, e := range m.Resources {
			f := fmt.Sprintf("%s.mps.resources[%d]", field, i)
			sel, target, err := take(f, e.ReplicatedResource)
			if err != nil {
				return nil, nil, err
			}
			if target == "" {
				continue // skipped: the node does not offer the resource
			}
			for j, d := range sel {
				g, mem := deviceOf(in.Inventory, d.Spec.VisibleID)
				if isMIG := g.UUID != "" && d.Spec.VisibleID != g.UUID; isMIG && m.RefuseMIGDevices {
					return nil, nil, fmt.Errorf("%s.name: %s is MIG device %s on GPU %d: NVIDIA's device plugin refuses MPS sharing of MIG devices, "+
						"and a config in its format is refused here too; write it in gpu-agent's format to share MIG devices with MPS",
						f, e.Name, d.Spec.VisibleID, g.Index)
				}
				if err := mps.ValidateReplicas(e.Replicas, g.ComputeCapability); err != nil {
					return nil, nil, fmt.Errorf("%s.replicas: GPU %d (%s): %w", f, g.Index, g.Name, err)
				}
				dm := mps.DefaultDaemon(d.Spec.VisibleID, d.GPU, mem, e.Replicas)
				if e.ActiveThreadPercentage != nil {
					dm.ActiveThreadPercentage = *e.ActiveThreadPercentage
				}
				if e.PinnedDeviceMemoryLimit != nil {
					dm.PinnedMemLimitBytes = uint64(*e.PinnedDeviceMemoryLimit)
				}
				if err := dm.Validate(); err != nil {
					return nil, nil, fmt.Errorf("%s: %w", f, err)
				}
				daemons = append(daemons, dm)
				env, mounts := mps.ContainerSpec(in.MPS.Root, in.MPS.ShmDir, dm)
				d.Spec.Env, d.Spec.Mounts = env, append(slices.Clone(d.Spec.Mounts), mounts...)
				if in.MPS.Healthy != nil && d.Healthy {
					if ok, why := in.MPS.Healthy(dm.Device); !ok {
						d.Healthy, d.Reason = false, "MPS daemon: "+why
					}
				}
				sel[j] = d
			}
			groups = append(groups, group{name: e.Name, target: target, devs: sel, replicas: e.Replicas, limit: m.FailsRequestsGreaterThanOne()})
		}
	}
	for _, g := range groups {
		r := c.Resources[g.target]
		if r == nil {
			r = &catalog.Resource{Name: g.target, Common: c.Resources[g.name].Common}
			c.Resources[g.target] = r
		}
		r.Devices = append(r.Devices, timeslice.Expand(g.devs, g.replicas)...)
		if g.limit {
			r.MaxPerContainer = 1
		}
	}
	return daemons, warnings, nil
}

// deviceOf finds the GPU that a GPU or MIG UUID belongs to, and the memory
// of that device (the instance's for a MIG device).
func deviceOf(inv *gpu.Inventory, uuid string) (gpu.GPU, uint64) {
	for _, g := range inv.GPUs {
		if g.UUID == uuid {
			return g, g.MemoryBytes
		}
		for _, m := range g.Instances {
			if m.UUID == uuid {
				return g, m.MemoryBytes
			}
		}
	}
	return gpu.GPU{}, 0
}

func byGPU(devs []catalog.Device) []catalog.Device {
	out := slices.Clone(devs)
	slices.SortStableFunc(out, func(a, b catalog.Device) int { return cmp.Compare(a.GPU, b.GPU) })
	return out
}
