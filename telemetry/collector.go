package telemetry

import (
	"cmp"
	"maps"
	"slices"
	"strconv"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// Sources the Collector reads; each is a cache another loop keeps fresh, so
// a scrape never calls NVML or the kubelet.
type (
	// SampleSource is the Sampler.
	SampleSource interface{ Snapshot() *Snapshot }
	// HealthSource is the Watcher.
	HealthSource interface{ State() *health.State }
	// AttributionSource is PodResources (or a fake in tests).
	AttributionSource interface {
		Attribution() *podresources.Attribution
	}
	// CatalogSource returns the catalog last published to the kubelet.
	CatalogSource interface{ Catalog() *catalog.Catalog }
	// DRASource says which of the node's devices a device held through a
	// DRA claim is: the agent, from its prepared claims and DRA pool. It
	// answers false for another driver's device, another node's pool, or
	// a claim the agent has not prepared.
	DRASource interface {
		DRADevice(h podresources.DRAHold) (DRADevice, bool)
	}
)

// DRADevice is the node's device behind a device of the DRA pool.
type DRADevice struct {
	// UUID is the GPU's, or the MIG device's.
	UUID string
	// MIGProfile is the MIG device's profile ("1g.10gb"); "" for a GPU.
	MIGProfile string
	// MPSActiveThreads is the claim's CUDA_MPS_ACTIVE_THREAD_PERCENTAGE
	// on a device shared by MPS; 0 otherwise.
	MPSActiveThreads int
}

// CollectorOptions wire a Collector; only Samples is required.
type CollectorOptions struct {
	Samples     SampleSource
	Health      HealthSource
	Attribution AttributionSource
	Catalog     CatalogSource
	// DRA attributes devices held through DRA claims (nil: none are).
	DRA DRASource
	// Hostname fills dcgm-exporter's Hostname label (the node name).
	Hostname string
	// Holders is each holder's own use of its devices (nil: no per-holder
	// series, and every holder of a device carries the device's figures).
	Holders HolderSource
}

// dcgmLabels are dcgm-exporter's labels, in its order. One metric family
// needs one label set, so labels a series lacks (GPU_I_* on a whole GPU, pod
// labels on an unallocated device, dra_* on a device no claim holds) are
// empty, which PromQL treats as absent. The holder's labels come last, in
// the order of holderLabels.
var dcgmLabels = append([]string{"gpu", "UUID", "pci_bus_id", "device", "modelName", "GPU_I_PROFILE", "GPU_I_ID",
	"Hostname", "DCGM_FI_DRIVER_VERSION"}, holderLabelNames...)

// holderLabelNames are the labels that say who holds a device: the
// container, and for a device held through a DRA claim dcgm-exporter's
// DRA labels (with KUBERNETES_ENABLE_DRA): the claim, the driver, pool
// and device of its allocation result, and for a MIG device its profile
// and UUID.
var holderLabelNames = []string{"container", "namespace", "pod",
	"dra_claim_name", "dra_claim_namespace", "dra_driver_name", "dra_pool_name", "dra_device_name",
	"dra_mig_profile", "dra_mig_device_uuid"}

// seriesHolder is one holder of a device as its series name it: a
// container, and the claim it holds the device through (none for the
// device plugin). A device shared by claims has one series per claim.
type seriesHolder struct {
	podresources.Holder
	claim      podresources.DRAHold // zero for the device plugin
	migProfile string
	migUUID    string
}

func (s seriesHolder) compare(o seriesHolder) int {
	return cmp.Or(s.claim.Compare(o.claim), s.Holder.Compare(o.Holder), cmp.Compare(s.migProfile, o.migProfile), cmp.Compare(s.migUUID, o.migUUID))
}

// values writes s's labels into lv, in holderLabelNames' order.
func (s seriesHolder) values(lv []string) {
	copy(lv, []string{s.Container, s.Namespace, s.Pod, s.claim.ClaimName, s.claim.ClaimNamespace, s.claim.Driver,
		s.claim.Pool, s.claim.Device, s.migProfile, s.migUUID})
}

// holdersOf is who holds each device (by GPU or MIG UUID), through the
// device plugin or DRA.
type holdersOf struct {
	attr *podresources.Attribution
	dra  map[string][]seriesHolder
	// mpsLimits is the active-thread percentage of a claim's MPS client.
	mpsLimits map[holderKey]int
}

// newHoldersOf resolves the DRA holdings of attr through src.
func newHoldersOf(attr *podresources.Attribution, src DRASource) holdersOf {
	h := holdersOf{attr: attr, dra: map[string][]seriesHolder{}, mpsLimits: map[holderKey]int{}}
	if src == nil {
		return h
	}
	for _, d := range attr.DRAHolds() {
		dev, ok := src.DRADevice(d)
		if !ok || dev.UUID == "" {
			continue
		}
		s := seriesHolder{Holder: d.Holder, claim: d}
		if dev.MIGProfile != "" {
			s.migProfile, s.migUUID = dev.MIGProfile, dev.UUID
		}
		h.dra[dev.UUID] = append(h.dra[dev.UUID], s)
		if dev.MPSActiveThreads > 0 {
			h.mpsLimits[holderKey{dev.UUID, s}] = dev.MPSActiveThreads
		}
	}
	return h
}

// series returns the holders of the devices, one per container and claim,
// sorted; nil when none.
func (h holdersOf) series(uuids ...string) []seriesHolder {
	var out []seriesHolder
	for _, u := range uuids {
		for _, c := range h.attr.Holders(u) {
			out = append(out, seriesHolder{Holder: c})
		}
		out = append(out, h.dra[u]...)
	}
	slices.SortFunc(out, seriesHolder.compare)
	return slices.CompactFunc(out, func(a, b seriesHolder) bool { return a.compare(b) == 0 })
}

// containers counts the distinct containers holding the devices.
func (h holdersOf) containers(uuids ...string) int {
	seen := map[podresources.Holder]bool{}
	for _, s := range h.series(uuids...) {
		seen[s.Holder] = true
	}
	return len(seen)
}

type dcgmDef struct {
	field Field
	name  string
	help  string
	typ   prometheus.ValueType
	// mig: NVML gives the value per MIG device (or GPU instance) too.
	mig  bool
	desc *prometheus.Desc
}

// dcgmDefs are the dcgm-exporter fields NVML can supply, with its names,
// types and units, so existing dashboards keep working. A field NVML does
// not give for a device (NOT_SUPPORTED) has no series there, never a 0:
//   - ENC_UTIL, DEC_UTIL: GPUs without the engine (A100 and H100 have no
//     NVENC) and every MIG-enabled GPU, for which NVML refuses them;
//   - MEMORY_TEMP: GPUs without HBM (GDDR boards such as the L40S);
//   - NVLINK_BANDWIDTH_TOTAL: GPUs without NVLink;
//   - VGPU_LICENSE_STATUS: everywhere but in vGPU guests;
//   - GPU_UTIL, MEM_COPY_UTIL: MIG-enabled GPUs (NVML refuses them);
//   - DCGM_FI_PROF_*: GPUs older than Hopper (A100, V100, L40S), because
//     NVML's only source of them is GPM (GPU Performance Monitoring),
//     Hopper and newer. dcgm-exporter reads them from DCGM's own
//     profiling module, which gpu-agent does not have. On a MIG-enabled
//     Hopper GPU they exist per GPU instance too (GPM samples GPU
//     instances) where NVML gives them per instance: the engine, SM,
//     pipe and DRAM ratios; PCIe and NVLink traffic only per GPU.
//     An A100 in MIG mode thus has no utilization series at all, neither
//     per GPU (NVML refuses it) nor per instance (no GPM).
var dcgmDefs = []dcgmDef{
	{field: FieldSMClock, name: "DCGM_FI_DEV_SM_CLOCK", help: "SM clock frequency in MHz.", typ: prometheus.GaugeValue},
	{field: FieldMemClock, name: "DCGM_FI_DEV_MEM_CLOCK", help: "Memory clock frequency in MHz.", typ: prometheus.GaugeValue},
	{field: FieldGPUTemp, name: "DCGM_FI_DEV_GPU_TEMP", help: "GPU temperature in degrees C.", typ: prometheus.GaugeValue},
	{field: FieldMemTemp, name: "DCGM_FI_DEV_MEMORY_TEMP", help: "HBM memory temperature in degrees C.", typ: prometheus.GaugeValue},
	{field: FieldPower, name: "DCGM_FI_DEV_POWER_USAGE", help: "Power draw in W.", typ: prometheus.GaugeValue},
	{field: FieldEnergy, name: "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", help: "Energy consumed since the driver was loaded, in mJ.", typ: prometheus.CounterValue},
	{field: FieldPCIeReplays, name: "DCGM_FI_DEV_PCIE_REPLAY_COUNTER", help: "PCIe packets the link had to send again (replays).", typ: prometheus.CounterValue},
	{field: FieldGPUUtil, name: "DCGM_FI_DEV_GPU_UTIL", help: "GPU utilization in %.", typ: prometheus.GaugeValue},
	{field: FieldMemCopyUtil, name: "DCGM_FI_DEV_MEM_COPY_UTIL", help: "Memory (copy) utilization in %.", typ: prometheus.GaugeValue},
	{field: FieldEncUtil, name: "DCGM_FI_DEV_ENC_UTIL", help: "Video encoder (NVENC) utilization in %.", typ: prometheus.GaugeValue},
	{field: FieldDecUtil, name: "DCGM_FI_DEV_DEC_UTIL", help: "Video decoder (NVDEC) utilization in %.", typ: prometheus.GaugeValue},
	{field: FieldFBFree, name: "DCGM_FI_DEV_FB_FREE", help: "Free framebuffer memory in MiB.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldFBUsed, name: "DCGM_FI_DEV_FB_USED", help: "Used framebuffer memory in MiB.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldFBReserved, name: "DCGM_FI_DEV_FB_RESERVED", help: "Framebuffer memory the driver and firmware reserve, in MiB.", typ: prometheus.GaugeValue},
	{field: FieldNVLinkBandwidth, name: "DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", help: "NVLink traffic over all links, sent and received, protocol overhead included, in KiB.", typ: prometheus.CounterValue},
	{field: FieldVGPULicense, name: "DCGM_FI_DEV_VGPU_LICENSE_STATUS", help: "1 when the vGPU feature is licensed, 0 when not (vGPU guests only).", typ: prometheus.GaugeValue},
	{field: FieldECCSBEVolatile, name: "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", help: "Single-bit ECC errors since the last reset.", typ: prometheus.CounterValue},
	{field: FieldECCDBEVolatile, name: "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", help: "Double-bit ECC errors since the last reset.", typ: prometheus.CounterValue},
	{field: FieldECCSBEAggregate, name: "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", help: "Single-bit ECC errors over the GPU's lifetime.", typ: prometheus.CounterValue},
	{field: FieldECCDBEAggregate, name: "DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", help: "Double-bit ECC errors over the GPU's lifetime.", typ: prometheus.CounterValue},
	{field: FieldRemappedUncorrectable, name: "DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", help: "Rows remapped for uncorrectable errors.", typ: prometheus.CounterValue},
	{field: FieldRemappedCorrectable, name: "DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", help: "Rows remapped for correctable errors.", typ: prometheus.CounterValue},
	{field: FieldRemapFailure, name: "DCGM_FI_DEV_ROW_REMAP_FAILURE", help: "1 when a row remapping failed.", typ: prometheus.GaugeValue},
	{field: FieldRemapPending, name: "DCGM_FI_DEV_ROW_REMAP_PENDING", help: "1 when a remapped row waits for a GPU reset.", typ: prometheus.GaugeValue},
	{field: FieldGrEngineActive, name: "DCGM_FI_PROF_GR_ENGINE_ACTIVE", help: "Fraction of time (0-1) the graphics/compute engine was busy, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldSMActive, name: "DCGM_FI_PROF_SM_ACTIVE", help: "Fraction (0-1) of SM cycles with at least one warp resident, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldSMOccupancy, name: "DCGM_FI_PROF_SM_OCCUPANCY", help: "Resident warps as a fraction (0-1) of the SMs' maximum, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldTensorActive, name: "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", help: "Fraction (0-1) of cycles a tensor pipe was busy, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldDRAMActive, name: "DCGM_FI_PROF_DRAM_ACTIVE", help: "Device memory bandwidth used, as a fraction (0-1) of the maximum, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldFP64Active, name: "DCGM_FI_PROF_PIPE_FP64_ACTIVE", help: "Fraction (0-1) of cycles the FP64 pipes were busy, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldFP32Active, name: "DCGM_FI_PROF_PIPE_FP32_ACTIVE", help: "Fraction (0-1) of cycles the FP32 pipes were busy, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldFP16Active, name: "DCGM_FI_PROF_PIPE_FP16_ACTIVE", help: "Fraction (0-1) of cycles the FP16 pipes were busy, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldPCIeTxBytes, name: "DCGM_FI_PROF_PCIE_TX_BYTES", help: "PCIe bytes/s sent by the GPU, headers included, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldPCIeRxBytes, name: "DCGM_FI_PROF_PCIE_RX_BYTES", help: "PCIe bytes/s received by the GPU, headers included, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldNVLinkTxBytes, name: "DCGM_FI_PROF_NVLINK_TX_BYTES", help: "NVLink bytes/s sent over all links, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
	{field: FieldNVLinkRxBytes, name: "DCGM_FI_PROF_NVLINK_RX_BYTES", help: "NVLink bytes/s received over all links, over the sampling interval.", typ: prometheus.GaugeValue, mig: true},
}

// Collector is a prometheus.Collector for the node's GPUs: dcgm-exporter's
// metrics from the Sampler's cache, attributed to pods, plus gpu-agent's own
// health, MIG and sharing metrics. Register it on the agent's registry.
type Collector struct {
	opts CollectorOptions
	defs []dcgmDef
	xid  *prometheus.Desc

	healthy, causes, xids, gpuXIDs, ecc *prometheus.Desc
	migMode, migDevices                 *prometheus.Desc
	holders, held, replicas, allocs     *prometheus.Desc
	sampleTime                          *prometheus.Desc

	holderSM, holderMem, holderEnc, holderDec *prometheus.Desc
	holderFB, holderProcs, holderIdle         *prometheus.Desc
	holderAvg, holderTime                     *prometheus.Desc
	holderMPSLimit, holderMPSUsed             *prometheus.Desc

	cache seriesCache
}

// NewCollector returns a collector reading opts' sources.
func NewCollector(opts CollectorOptions) *Collector {
	c := &Collector{opts: opts, defs: slices.Clone(dcgmDefs)}
	for i := range c.defs {
		c.defs[i].desc = prometheus.NewDesc(c.defs[i].name, c.defs[i].help, dcgmLabels, nil)
	}
	c.xid = prometheus.NewDesc("DCGM_FI_DEV_XID_ERRORS", "The latest XID the GPU reported (0: none since the agent started).", dcgmLabels, nil)
	dev := []string{"gpu", "UUID", "GPU_I_PROFILE", "GPU_I_ID"}
	gpuL := []string{"gpu", "UUID"}
	c.healthy = prometheus.NewDesc("gpu_agent_device_healthy", "1 when the GPU or MIG device (and its replicas) is healthy, 0 when the health watcher marked it; a GPU instance split into compute instances counts as one device.", dev, nil)
	c.causes = prometheus.NewDesc("gpu_agent_health_causes", "Active reasons for devices of a GPU to be unhealthy, by kind and what clears them.", append(slices.Clone(gpuL), "kind", "class"), nil)
	c.xids = prometheus.NewDesc("gpu_agent_xid_events_total", "XID events seen since the agent started, fatal or not.", append(slices.Clone(gpuL), "xid"), nil)
	// Per GPU, at 0 from the start: rate() and increase() miss a series'
	// first sample, so a per-XID series born at 1 would never count.
	c.gpuXIDs = prometheus.NewDesc("gpu_agent_gpu_xid_events_total", "XID events of any XID seen on the GPU since the agent started; 0 from the start.", gpuL, nil)
	c.ecc = prometheus.NewDesc("gpu_agent_ecc_events_total", "ECC error events seen since the agent started.", append(slices.Clone(gpuL), "type"), nil)
	c.migMode = prometheus.NewDesc("gpu_agent_mig_mode", "1 when MIG mode is on; state current is in force, pending applies after a GPU reset.", append(slices.Clone(gpuL), "state"), nil)
	c.migDevices = prometheus.NewDesc("gpu_agent_mig_devices", "MIG devices on the GPU, by profile.", append(slices.Clone(gpuL), "profile"), nil)
	c.holders = prometheus.NewDesc("gpu_agent_device_holders", "Containers holding the GPU or MIG device, a replica of it, or a DRA claim on it.", dev, nil)
	c.held = prometheus.NewDesc("gpu_agent_device_allocated_ids", "Allocated IDs of the device: 1 for the device itself, or how many of its replicas.", dev, nil)
	c.replicas = prometheus.NewDesc("gpu_agent_replicas", "Replicas offered of a device under a shared resource.", []string{"resource", "UUID"}, nil)
	c.allocs = prometheus.NewDesc("gpu_agent_allocated_devices", "Device IDs of a resource a container holds.", []string{"resource", "namespace", "pod", "container"}, nil)
	c.sampleTime = prometheus.NewDesc("gpu_agent_metrics_sample_timestamp_seconds", "When the GPU metrics were last sampled from NVML.", nil, nil)
	hl := append(slices.Clone(dev), holderLabelNames...)
	c.holderSM = prometheus.NewDesc("gpu_agent_holder_sm_util_percent", "SM utilization (%) of the holder's processes on the device since the previous sample (NVML's per-process samples; on a device with one holder and no per-process figures, the device's).", hl, nil)
	c.holderMem = prometheus.NewDesc("gpu_agent_holder_mem_util_percent", "Memory bandwidth utilization (%) of the holder's processes on the device since the previous sample.", hl, nil)
	c.holderEnc = prometheus.NewDesc("gpu_agent_holder_enc_util_percent", "Video encoder utilization (%) of the holder's processes on the device since the previous sample.", hl, nil)
	c.holderDec = prometheus.NewDesc("gpu_agent_holder_dec_util_percent", "Video decoder utilization (%) of the holder's processes on the device since the previous sample.", hl, nil)
	c.holderFB = prometheus.NewDesc("gpu_agent_holder_fb_used_bytes", "Framebuffer memory the holder's processes hold on the device, in bytes.", hl, nil)
	c.holderProcs = prometheus.NewDesc("gpu_agent_holder_processes", "Processes of the holder running on the device.", hl, nil)
	c.holderIdle = prometheus.NewDesc("gpu_agent_holder_idle_seconds", "Seconds since the holder last used the device (or since the agent first saw it hold the device, if never), across agent restarts.", hl, nil)
	c.holderAvg = prometheus.NewDesc("gpu_agent_holder_sm_util_avg_percent", "Mean SM utilization (%) of the holder on the device over the time it held it within the window (1h, 24h; to within 5 minutes), across agent restarts.", append(slices.Clone(hl), "window"), nil)
	c.holderMPSLimit = prometheus.NewDesc("gpu_agent_holder_mps_active_thread_limit_percent", "The holder's MPS active-thread limit on the device (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE: its replica's, or its claim's share), in %; MPS clients only.", hl, nil)
	c.holderMPSUsed = prometheus.NewDesc("gpu_agent_holder_mps_limit_used_percent", "The holder's SM utilization as a % of its MPS active-thread limit; not capped: SM % is a part of the time, the limit a part of the SMs, so a client whose kernels run all the time reads over 100.", hl, nil)
	c.holderTime = prometheus.NewDesc("gpu_agent_holder_sample_timestamp_seconds", "When the holders' processes were last sampled.", nil, nil)
	return c
}

// Describe sends every metric's description.
func (c *Collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range c.defs {
		ch <- d.desc
	}
	for _, d := range []*prometheus.Desc{c.xid, c.healthy, c.causes, c.xids, c.gpuXIDs, c.ecc, c.migMode, c.migDevices,
		c.holders, c.held, c.replicas, c.allocs, c.sampleTime,
		c.holderSM, c.holderMem, c.holderEnc, c.holderDec, c.holderFB, c.holderProcs, c.holderIdle, c.holderAvg, c.holderMPSLimit, c.holderMPSUsed, c.holderTime} {
		ch <- d
	}
}

// collectInputs are what one Collect reads: the sources' snapshots, each
// immutable once published, so that the same inputs give the same series
// (Exposition renders only when one of them changed).
type collectInputs struct {
	snap *Snapshot
	st   *health.State
	attr *podresources.Attribution
	cat  *catalog.Catalog
	uses *HolderSnapshot
}

// inputs reads the sources now.
func (c *Collector) inputs() collectInputs {
	in := collectInputs{snap: c.opts.Samples.Snapshot()}
	if c.opts.Health != nil {
		in.st = c.opts.Health.State()
	}
	if c.opts.Attribution != nil {
		in.attr = c.opts.Attribution.Attribution()
	}
	if c.opts.Catalog != nil {
		in.cat = c.opts.Catalog.Catalog()
	}
	if c.opts.Holders != nil {
		in.uses = c.opts.Holders.Holders()
	}
	return in
}

// Collect implements [prometheus.Collector.Collect]: it reads the caches
// and sends the metrics.
func (c *Collector) Collect(ch chan<- prometheus.Metric) { c.collect(ch, c.inputs()) }

// collect sends the metrics of in.
func (c *Collector) collect(ch chan<- prometheus.Metric, in collectInputs) {
	c.cache.rotate()
	snap, st, attr, uses := in.snap, in.st, in.attr, in.uses
	if !snap.Time.IsZero() {
		ch <- c.cache.metric(c.sampleTime, prometheus.GaugeValue, float64(snap.Time.UnixNano())/1e9)
	}
	served := servedHealth(in.cat)
	holders := newHoldersOf(attr, c.opts.DRA)
	split := newHolderSplit(uses)
	lv := make([]string, len(dcgmLabels))
	for i := range snap.GPUs {
		g := &snap.GPUs[i]
		idx := strconv.Itoa(g.Index)
		lv[0], lv[1], lv[2], lv[3], lv[4] = idx, g.UUID, g.PCIBusID, "nvidia"+strconv.Itoa(g.Minor), g.Name
		lv[5], lv[6], lv[7], lv[8] = "", "", c.opts.Hostname, snap.DriverVersion
		c.gpuAgent(ch, g, idx, st, attr, holders, served)
		if g.Lost {
			continue // no value beats a stale one
		}
		// A MIG-enabled GPU is never allocated whole: its series carry no pod.
		var hs []seriesHolder
		if !g.MIG.Current {
			hs = holders.series(g.UUID)
		}
		for j := range c.defs {
			d := &c.defs[j]
			if v, ok := g.Values.Get(d.field); ok {
				c.emit(ch, d.desc, d.typ, v, lv, hs, split.of(d.field, hs, g.UUID))
			}
		}
		var last uint64
		if s, ok := st.Stats(g.UUID); ok {
			last = s.LastXID
		}
		c.emit(ch, c.xid, prometheus.GaugeValue, float64(last), lv, hs, nil)
		for k := range g.Instances {
			in := &g.Instances[k]
			// Framebuffer and GPM belong to the GPU instance, which the
			// labels name: its compute instances (MIG devices of a 1c.*
			// profile) share one series, held by whoever holds any of them.
			if slices.ContainsFunc(g.Instances[:k], func(o MIGSample) bool { return o.GI == in.GI }) {
				continue
			}
			lv[5], lv[6] = in.Profile, strconv.Itoa(in.GI)
			uuids := []string{in.UUID}
			for _, o := range g.Instances[k+1:] {
				if o.GI == in.GI {
					uuids = append(uuids, o.UUID)
				}
			}
			hs := holders.series(uuids...)
			for j := range c.defs {
				d := &c.defs[j]
				if !d.mig {
					continue
				}
				if v, ok := in.Values.Get(d.field); ok {
					c.emit(ch, d.desc, d.typ, v, lv, hs, split.of(d.field, hs, uuids...))
				}
			}
		}
	}
	c.sharing(ch, in.cat, attr)
	c.holderUse(ch, uses)
}

// emit sends one series per holder, or one without holder labels when none.
// own, when not nil, gives a holder's own value in place of the device's.
func (c *Collector) emit(ch chan<- prometheus.Metric, d *prometheus.Desc, typ prometheus.ValueType, v float64, lv []string, hs []seriesHolder, own func(seriesHolder) (float64, bool)) {
	tail := lv[len(lv)-len(holderLabelNames):]
	if len(hs) == 0 {
		seriesHolder{}.values(tail)
		ch <- c.cache.metric(d, typ, v, lv...)
		return
	}
	for _, h := range hs {
		h.values(tail)
		x := v
		if own != nil {
			if hv, ok := own(h); ok {
				x = hv
			}
		}
		ch <- c.cache.metric(d, typ, x, lv...)
	}
}

// gpuAgent sends gpu-agent's own per-GPU metrics.
func (c *Collector) gpuAgent(ch chan<- prometheus.Metric, g *GPUSample, idx string, st *health.State, attr *podresources.Attribution, hs holdersOf, served map[string]bool) {
	// device sends the metrics of the devices its labels name: a GPU, or
	// a GPU instance with every MIG device (compute instance) in it.
	device := func(profile, gi string, uuids ...string) {
		h, held := 1.0, 0
		holders := hs.containers(uuids...)
		for _, uuid := range uuids {
			if ok, offered := served[uuid]; offered {
				// What the kubelet was told, so the metric and the node's
				// allocatable never disagree.
				if !ok {
					h = 0
				}
			} else if _, bad := st.Unhealthy(uuid); bad {
				h = 0
			}
			held += attr.Held(uuid)
		}
		ch <- c.cache.metric(c.healthy, prometheus.GaugeValue, h, idx, g.UUID, profile, gi)
		ch <- c.cache.metric(c.holders, prometheus.GaugeValue, float64(holders), idx, g.UUID, profile, gi)
		ch <- c.cache.metric(c.held, prometheus.GaugeValue, float64(held), idx, g.UUID, profile, gi)
	}
	device("", "", g.UUID)
	profiles := map[string]int{}
	for k, in := range g.Instances {
		profiles[in.Profile]++
		if slices.ContainsFunc(g.Instances[:k], func(o MIGSample) bool { return o.GI == in.GI }) {
			continue
		}
		uuids := []string{in.UUID}
		for _, o := range g.Instances[k+1:] {
			if o.GI == in.GI {
				uuids = append(uuids, o.UUID)
			}
		}
		device(in.Profile, strconv.Itoa(in.GI), uuids...)
	}
	for _, p := range slices.Sorted(maps.Keys(profiles)) {
		ch <- c.cache.metric(c.migDevices, prometheus.GaugeValue, float64(profiles[p]), idx, g.UUID, p)
	}
	ch <- c.cache.metric(c.migMode, prometheus.GaugeValue, b2f(g.MIG.Current), idx, g.UUID, "current")
	ch <- c.cache.metric(c.migMode, prometheus.GaugeValue, b2f(g.MIG.Pending), idx, g.UUID, "pending")
	if st == nil {
		return
	}
	type kc struct{ kind, class string }
	counts := map[kc]int{}
	for _, cs := range st.CausesOf(g.UUID) {
		counts[kc{string(cs.Kind), cs.Class.String()}]++
	}
	for _, k := range slices.SortedFunc(maps.Keys(counts), func(a, b kc) int {
		return cmp.Or(strings.Compare(a.kind, b.kind), strings.Compare(a.class, b.class))
	}) {
		ch <- c.cache.metric(c.causes, prometheus.GaugeValue, float64(counts[k]), idx, g.UUID, k.kind, k.class)
	}
	if s, ok := st.Stats(g.UUID); ok {
		var all uint64
		for _, x := range slices.Sorted(maps.Keys(s.XIDs)) {
			ch <- c.cache.metric(c.xids, prometheus.CounterValue, float64(s.XIDs[x]), idx, g.UUID, strconv.FormatUint(x, 10))
			all += s.XIDs[x]
		}
		ch <- c.cache.metric(c.gpuXIDs, prometheus.CounterValue, float64(all), idx, g.UUID)
		ch <- c.cache.metric(c.ecc, prometheus.CounterValue, float64(s.SingleBitEvents), idx, g.UUID, "single-bit")
		ch <- c.cache.metric(c.ecc, prometheus.CounterValue, float64(s.DoubleBitEvents), idx, g.UUID, "double-bit")
	}
}

// servedHealth maps each GPU or MIG UUID the published catalog offers (as
// itself or as replicas) to whether every device it backs is healthy.
func servedHealth(cat *catalog.Catalog) map[string]bool {
	out := map[string]bool{}
	if cat == nil {
		return out
	}
	for _, r := range cat.Resources {
		for _, d := range r.Devices {
			uuid := d.Spec.VisibleID
			if uuid == "" {
				uuid, _, _ = strings.Cut(d.ID, "::")
			}
			ok, seen := out[uuid]
			out[uuid] = d.Healthy && (ok || !seen)
		}
	}
	return out
}

// sharing sends replicas per shared device and allocations per container.
func (c *Collector) sharing(ch chan<- prometheus.Metric, cat *catalog.Catalog, attr *podresources.Attribution) {
	if cat != nil {
		for _, name := range cat.Names() {
			counts := map[string]int{}
			for _, d := range cat.Resources[name].Devices {
				if base, _, ok := strings.Cut(d.ID, "::"); ok {
					counts[base]++
				}
			}
			for _, uuid := range slices.Sorted(maps.Keys(counts)) {
				ch <- c.cache.metric(c.replicas, prometheus.GaugeValue, float64(counts[uuid]), name, uuid)
			}
		}
	}
	for _, a := range attr.Allocations() {
		ch <- c.cache.metric(c.allocs, prometheus.GaugeValue, float64(a.Devices), a.Resource, a.Holder.Namespace, a.Holder.Pod, a.Holder.Container)
	}
}
