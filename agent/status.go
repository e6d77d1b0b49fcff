package agent

import (
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/kube"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// Status is what /status serves and `gpu-agent status` prints.
type Status struct {
	Node    string `json:"node"`
	Backend string `json:"backend,omitempty"`
	// Build is what runs (filled by the HTTP layer).
	Build *BuildInfo `json:"build,omitempty"`
	// Cluster is the Kubernetes API side: whether the API answers, the
	// Node labels the agent owns, the ConfigMap read through it (API
	// "standalone" without one).
	Cluster ClusterStatus `json:"cluster"`
	Config  ConfigStatus  `json:"config"`
	// GPUs are shown with the PCI device id in hex, as configs write it.
	GPUs []gpu.Shown `json:"gpus"`
	// Unread are the GPUs known earlier that cannot be read now, offered
	// unhealthy: why, since when, and when one NVML no longer enumerates
	// is forgotten.
	Unread   []UnreadGPU     `json:"unreadGPUs,omitempty"`
	Errors   []string        `json:"inventoryErrors,omitempty"`
	Resource []ResourceState `json:"resources"`
	// Sharing lists each shared device: mode, replicas, limits and holders.
	Sharing []SharingState `json:"sharing,omitempty"`
	// MIG is each GPU's repartitioning state when the config has a layout.
	MIG []MIGState `json:"mig,omitempty"`
	// Conflicts are NVIDIA's components seen acting on this node (another
	// device plugin, mig-manager, GFD) and what the agent does about each
	// (docs/migrating.md).
	Conflicts []string `json:"conflicts,omitempty"`
	// Cordon lists the GPUs taken out of service by the Node's
	// gpu-agent.io/cordon annotation, and entries of it that name no GPU.
	Cordon *CordonStatus `json:"cordon,omitempty"`
	// DRA is what the node offers through DRA and which claims are
	// prepared (absent when DRA is off).
	DRA *DRAStatus `json:"dra,omitempty"`
	// CDI is the CDI spec the agent keeps (absent when it keeps none).
	CDI *CDIStatus `json:"cdi,omitempty"`
	// State is whether what must survive a restart is on disk (absent
	// without --state-dir).
	State *StateStatus `json:"state,omitempty"`
	// LastPass is the last catalog published; LastLoop the last turn of the
	// loop, published or not (liveness).
	LastPass time.Time `json:"lastPass"`
	LastLoop time.Time `json:"lastLoop"`
	// Health causes in force and the recent health event log.
	HealthCauses []health.Cause `json:"healthCauses,omitempty"`
	HealthLog    []health.Entry `json:"healthLog,omitempty"`
	// Filled by the HTTP layer from the plugin manager.
	Registrations []Registration `json:"registrations,omitempty"`
	// HealthEvents lists the GPUs NVML delivers health events for (filled
	// by the HTTP layer from the health watcher).
	HealthEvents []string `json:"healthEvents,omitempty"`
}

// ClusterStatus is the Kubernetes API side of the node.
type ClusterStatus struct {
	kube.State
	// ConfigMap is the ConfigMap read through the API (--configmap);
	// absent without one.
	ConfigMap *ConfigMapStatus `json:"configMap,omitempty"`
}

// ConfigMapStatus says whether the ConfigMap read through the API is the
// config source in force, and if not, why and what serves instead.
type ConfigMapStatus struct {
	Name    string `json:"name"`
	InForce bool   `json:"inForce"`
	Reason  string `json:"reason,omitempty"`
}

// BuildInfo says which gpu-agent build runs.
type BuildInfo struct {
	Version   string `json:"version"`
	Commit    string `json:"commit"`
	GoVersion string `json:"goVersion"`
}

// DRAStatus is the DRA side of the node.
type DRAStatus struct {
	// Devices are the pool's device names, Unhealthy those tainted
	// unhealthy, Cordoned those tainted cordoned (a device may be both).
	Devices   []string `json:"devices"`
	Unhealthy []string `json:"unhealthy,omitempty"`
	Cordoned  []string `json:"cordoned,omitempty"`
	// Claims are the prepared claims, "namespace/name: device, ...".
	Claims []string `json:"claims,omitempty"`
	// Releasing is what released claims left that is still to be undone,
	// "namespace/name: MIG device UUID, ..." (a CDI spec alone shows as
	// "namespace/name: CDI spec").
	Releasing []string `json:"releasing,omitempty"`
	// Slices: where ResourceSlice publishing stands (filled by the HTTP
	// layer from the driver).
	Slices *dra.Slices `json:"slices,omitempty"`
	// OpenGPUs, under migOnDemand.spareGPUs, are the GPUs (by index) that
	// offer MIG devices on demand, and Closing those of them whose
	// partitions go at the first pass after the time given (tainted
	// gpu.nvidia.com/closing until then). Absent without a spare limit.
	// Opening, under spareLayout, are GPUs offered whole, tainted, whose
	// layout replaces it at the first pass after the time given.
	OpenGPUs []int           `json:"migOpenGPUs,omitempty"`
	Closing  []ClosingMIGGPU `json:"migClosing,omitempty"`
	Opening  []ClosingMIGGPU `json:"migOpening,omitempty"`
}

// ClosingMIGGPU is a surplus spare GPU whose MIG devices on demand go At,
// or (Opening) a GPU offered whole until At, when its spare layout
// replaces it.
type ClosingMIGGPU struct {
	GPU int       `json:"gpu"`
	At  time.Time `json:"at"`
}

// UnreadGPU is a GPU known earlier that cannot be read now.
type UnreadGPU struct {
	Index  int       `json:"index"`
	UUID   string    `json:"uuid"`
	Name   string    `json:"name,omitempty"`
	Reason string    `json:"reason"`
	Since  time.Time `json:"since"`
	// ForgetAt is when it leaves the catalog (--forget-gone-gpus-after)
	// unless NVML enumerates it again or someone still holds it; zero for
	// a GPU NVML still enumerates, or when gone GPUs are never forgotten.
	ForgetAt time.Time `json:"forgetAt,omitzero"`
}

// StateStatus is the state dir: when the checkpoint was last written, and
// why the checkpoint or the allocation log cannot be written now.
type StateStatus struct {
	Dir               string    `json:"dir"`
	CheckpointWritten time.Time `json:"checkpointWritten,omitzero"`
	Error             string    `json:"error,omitempty"`
	ErrorSince        time.Time `json:"errorSince,omitzero"`
}

// ConfigStatus says which config is in force and whether the file's latest
// content was rejected.
type ConfigStatus struct {
	Source     string    `json:"source"`
	Name       string    `json:"name,omitempty"`
	SelectedBy string    `json:"selectedBy,omitempty"`
	Generation int       `json:"generation"`
	Warnings   []string  `json:"warnings,omitempty"`
	Error      string    `json:"error,omitempty"`
	ErrorSince time.Time `json:"errorSince,omitzero"`
	// Serving names what the node serves when it is not the selected
	// config: the last config that fitted this node, or the built-in
	// default (BuiltInConfigName) while no config has applied since start.
	// Error says why. Warnings are the file's (accepted but probably not
	// meant) and the plan's (what the config asks that this node cannot
	// do while the rest applies), each naming its field.
	Serving string `json:"serving,omitempty"`
}

// ResourceState is one served resource and its devices.
type ResourceState struct {
	Name    string        `json:"name"`
	Devices []DeviceState `json:"devices"`
}

// DeviceState is one device as served to the kubelet.
type DeviceState struct {
	ID       string `json:"id"`
	Healthy  bool   `json:"healthy"`
	Reason   string `json:"reason,omitempty"`
	GPU      int    `json:"gpu"`
	NUMANode int    `json:"numaNode"`
	// HeldBy names the container holding the device ("ns/pod (container)"),
	// from the kubelet's pod-resources API; empty when free or unknown.
	HeldBy string `json:"heldBy,omitempty"`
}

// SharingState is one physical (GPU or MIG) device shared as replicas.
type SharingState struct {
	Device   string `json:"device"`
	GPU      int    `json:"gpu"`
	Resource string `json:"resource"`
	// Mode is "timeSlicing" or "mps".
	Mode     string `json:"mode"`
	Replicas int    `json:"replicas"`
	// MPS per-client limits, as containers get them.
	ActiveThreadPercentage string   `json:"activeThreadPercentage,omitempty"`
	PinnedMemoryLimit      string   `json:"pinnedMemoryLimit,omitempty"`
	Holders                []string `json:"holders,omitempty"`
}

// Registration is the kubelet registration state of one resource.
type Registration struct {
	Resource     string    `json:"resource"`
	Socket       string    `json:"socket"`
	Registered   bool      `json:"registered"`
	RegisteredAt time.Time `json:"registeredAt,omitzero"`
	LastError    string    `json:"lastError,omitempty"`
}

// MIGState is one GPU's repartitioning state, for /status and metrics.
type MIGState struct {
	GPU    int    `json:"gpu"`
	UUID   string `json:"uuid"`
	Want   string `json:"want"`
	Phase  string `json:"phase"`
	Reason string `json:"reason,omitempty"`
	// ResetBlockers, on a GPU whose MIG mode change waits for a reset the
	// agent would do (mig.resetPolicy whenIdle), is what keeps it from the
	// reset: the pods and claims holding it, the processes on it.
	ResetBlockers []string `json:"resetBlockers,omitempty"`
}

func (a *Agent) publishStatus() {
	warnings := slices.Concat(a.warnings, a.planWarnings)
	serving := a.serving()
	a.metrics.configWarnings.Set(float64(len(warnings)))
	if serving == BuiltInConfigName {
		a.metrics.configFallback.Set(1)
	} else {
		a.metrics.configFallback.Set(0)
	}
	s := &Status{
		Node:     a.opts.NodeName,
		LastPass: a.lastPass,
		LastLoop: a.lastLoop,
		Config: ConfigStatus{
			Source:     a.opts.ConfigSource,
			Name:       a.selected.Name,
			SelectedBy: string(a.selected.Reason),
			Generation: a.gen,
			Serving:    serving,
			Warnings:   warnings,
		},
	}
	if a.file == nil {
		// No config yet: the built-in selection waiting in a.selected is
		// not in force.
		s.Config.Name, s.Config.SelectedBy = "", ""
	}
	if a.source == SourceAPI {
		s.Config.Source = configMapSource(a.opts.ConfigMap)
	}
	if s.Config.Source == "" {
		s.Config.Source = "built-in default"
	}
	if a.opts.DRA != nil {
		s.DRA = a.draStatus()
	}
	if a.opts.CDI != nil {
		c := a.cdiStatus
		s.CDI = &c
	}
	s.State = a.stateStatus()
	s.Cluster = a.clusterStatus()
	switch {
	case a.cfgErr.stands():
		s.Config.Error, s.Config.ErrorSince = a.cfgErr.err.Error(), a.cfgErr.since
	case a.selErr.stands():
		s.Config.Error, s.Config.ErrorSince = a.selErr.err.Error(), a.selErr.since
	case a.fitErr.stands():
		s.Config.Error, s.Config.ErrorSince = a.fitErr.err.Error(), a.fitErr.since
	case a.migErr.stands():
		s.Config.Error, s.Config.ErrorSince = a.migErr.err.Error(), a.migErr.since
	}
	s.MIG = a.migStatus()
	s.Conflicts = a.conflicts.Messages()
	if c := a.cordonStatus; len(c.GPUs) > 0 || len(c.Unknown) > 0 {
		s.Cordon = &c
	}
	for _, uuid := range slices.Sorted(maps.Keys(a.failed)) {
		f := a.failed[uuid]
		s.Unread = append(s.Unread, UnreadGPU{Index: f.GPU.Index, UUID: uuid, Name: f.GPU.Name, Reason: f.Reason, Since: f.Since, ForgetAt: a.forgetAt(f)})
	}
	slices.SortStableFunc(s.Unread, func(x, y UnreadGPU) int { return x.Index - y.Index })
	if a.inv != nil {
		s.GPUs = gpu.Show(a.inv.GPUs)
		for _, e := range a.inv.Errors {
			s.Errors = append(s.Errors, e.Error())
		}
	}
	if hs := a.health; hs != nil {
		s.HealthCauses = hs.Causes
		// The newest entries; the full log is bounded by the watcher.
		s.HealthLog = hs.Log[max(0, len(hs.Log)-20):]
	}
	if a.cat != nil {
		att := a.ledger.Holders()
		for _, name := range a.cat.Names() {
			s.Resource = append(s.Resource, resourceState(a.cat.Resources[name], att.HeldIDs(name)))
			s.Sharing = append(s.Sharing, sharingState(a.cat.Resources[name], att.HeldIDs(name))...)
		}
	}
	a.status.Store(s)
	a.draHeld.Store(newDRAHeld(a.opts.NodeName, a.ledger.Claims(), a.inv))
	a.publishClaimStatus()
}

func resourceState(r *catalog.Resource, held map[string]podresources.Holder) ResourceState {
	rs := ResourceState{Name: r.Name, Devices: make([]DeviceState, 0, len(r.Devices))}
	for _, d := range r.Devices {
		ds := DeviceState{ID: d.ID, Healthy: d.Healthy, Reason: d.Reason, GPU: d.GPU, NUMANode: d.NUMANode}
		if h, ok := held[d.ID]; ok {
			ds.HeldBy = h.String()
		}
		rs.Devices = append(rs.Devices, ds)
	}
	// By GPU for people; the catalog itself is ordered by ID for lookups.
	slices.SortStableFunc(rs.Devices, func(a, b DeviceState) int { return a.GPU - b.GPU })
	return rs
}

// sharingState groups a resource's replicas by the device they share.
func sharingState(r *catalog.Resource, held map[string]podresources.Holder) []SharingState {
	by := map[string]*SharingState{}
	var order []string
	for _, d := range r.Devices {
		if !d.Replica {
			continue
		}
		dev := d.Spec.VisibleID
		st := by[dev]
		if st == nil {
			st = &SharingState{Device: dev, GPU: d.GPU, Resource: r.Name, Mode: "timeSlicing"}
			if _, ok := d.Spec.Env["CUDA_MPS_PIPE_DIRECTORY"]; ok {
				st.Mode = "mps"
				st.ActiveThreadPercentage = d.Spec.Env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"]
				st.PinnedMemoryLimit = d.Spec.Env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"]
			}
			by[dev] = st
			order = append(order, dev)
		}
		st.Replicas++
		if h, ok := held[d.ID]; ok {
			st.Holders = append(st.Holders, d.ID+" by "+h.String())
		}
	}
	out := make([]SharingState, 0, len(order))
	for _, dev := range order {
		out = append(out, *by[dev])
	}
	slices.SortStableFunc(out, func(a, b SharingState) int { return a.GPU - b.GPU })
	return out
}

// clusterStatus is the API side as the publisher reports it, and whether
// the ConfigMap read through the API is in force.
func (a *Agent) clusterStatus() ClusterStatus {
	if a.opts.Cluster == nil {
		return ClusterStatus{State: kube.State{API: kube.APIStandalone}}
	}
	cs := ClusterStatus{State: a.opts.Cluster.State()}
	if a.opts.ConfigMap == "" {
		return cs
	}
	cm := &ConfigMapStatus{Name: a.opts.ConfigMap}
	u, read := a.sources[SourceAPI]
	cm.InForce = a.source == SourceAPI && read && u.Err == nil
	var fallback string
	switch {
	case a.source == SourceFile && a.opts.ConfigSource != "":
		fallback = "the mounted file " + a.opts.ConfigSource + " serves"
	case a.file == nil:
		fallback = "nothing is served until a config arrives"
	case a.gen == 0 || a.serving() == BuiltInConfigName:
		fallback = "the built-in default serves"
	default:
		fallback = fmt.Sprintf("config %q (generation %d) stays in force", a.selected.Name, a.gen)
	}
	switch {
	case cm.InForce:
	case read && u.Err != nil:
		cm.Reason = "unreadable: " + u.Err.Error() + "; " + fallback
	default:
		cm.Reason = "no content read through the API (the ConfigMap is absent, or the API has not answered); " + fallback
	}
	cs.ConfigMap = cm
	return cs
}

// configMapSource names the ConfigMap read through the API as a config
// source.
func configMapSource(name string) string {
	if name == "" {
		return "the ConfigMap, through the API"
	}
	return "ConfigMap " + name + " (API)"
}
