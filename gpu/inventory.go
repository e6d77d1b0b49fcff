package gpu

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// Options tunes New.
type Options struct {
	// NUMANode returns the NUMA node of a PCI device (bus id in sysfs form
	// "0000:07:00.0"); nil means ask NVML (Device.GetNumaNodeId). -1 = unknown.
	NUMANode func(busID string) (int, error)
	// PCIeRoot returns the PCIe root complex of a PCI device ("pci0000:00");
	// nil means derive it from the topology (GPU.PCIeRoot).
	PCIeRoot func(busID string) (string, error)
	// FabricInfo reads a GPU's NVLink fabric info; nil reads it without
	// NVML's versioned call (a device's own GetGpuFabricInfoV3, as the
	// simulated node's, else version 1). The real backend sets
	// NVMLFabricInfo, which only the real library's devices may be given.
	FabricInfo FabricReader
	// Logger receives what New skips or degrades; nil discards.
	Logger *slog.Logger
}

// SysfsNUMA reads <root>/bus/pci/devices/<bus>/numa_node (root normally
// "/sys"). The real backend uses it because GetNumaNodeId needs a recent
// driver, while sysfs has had the answer for every PCI device for years.
func SysfsNUMA(root string) func(busID string) (int, error) {
	return func(busID string) (int, error) {
		// The bus id becomes a path element: refuse anything that could step
		// outside the devices directory.
		if busID == "" || busID == "." || busID == ".." || strings.ContainsAny(busID, "/\\\x00") {
			return -1, fmt.Errorf("numa node: invalid pci bus id %q", busID)
		}
		dir := filepath.Join(root, "bus", "pci", "devices", busID)
		b, err := os.ReadFile(filepath.Join(dir, "numa_node"))
		if errors.Is(err, fs.ErrNotExist) {
			// Kernels built without CONFIG_NUMA have no numa_node attribute at
			// all; that is "unknown", not a failure, as long as the device is there.
			if _, serr := os.Stat(dir); serr == nil {
				return -1, nil
			}
		}
		if err != nil {
			return -1, fmt.Errorf("numa node of %s: %w", busID, err)
		}
		n, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil {
			return -1, fmt.Errorf("numa node of %s: %w", busID, err)
		}
		if n < 0 {
			n = -1
		}
		return n, nil
	}
}

// SysfsPCIeRoot reads the root complex of a PCI device from where
// <root>/bus/pci/devices/<bus> links to: the kernel places every device under
// <root>/devices/pci<domain>:<bus>/..., the name DRA drivers of NICs publish
// as resource.kubernetes.io/pcieRoot too.
func SysfsPCIeRoot(root string) func(busID string) (string, error) {
	return func(busID string) (string, error) {
		if busID == "" || busID == "." || busID == ".." || strings.ContainsAny(busID, "/\\\x00") {
			return "", fmt.Errorf("pcie root: invalid pci bus id %q", busID)
		}
		link := filepath.Join(root, "bus", "pci", "devices", busID)
		target, err := os.Readlink(link)
		if err != nil {
			return "", fmt.Errorf("pcie root of %s: %w", busID, err)
		}
		r, err := pcieRootOfLink(root, link, target)
		if err != nil {
			return "", fmt.Errorf("pcie root of %s: %w", busID, err)
		}
		return r, nil
	}
}

// pcieRootOfLink is the root complex a device's sysfs link (link, pointing
// at target) names: the first element under <root>/devices, "pci" and more.
func pcieRootOfLink(root, link, target string) (string, error) {
	if !filepath.IsAbs(target) {
		target = filepath.Join(filepath.Dir(link), target)
	}
	rel, err := filepath.Rel(filepath.Join(root, "devices"), filepath.Clean(target))
	if err != nil {
		return "", err
	}
	first, _, _ := strings.Cut(filepath.ToSlash(rel), "/")
	if !strings.HasPrefix(first, "pci") || first == "pci" {
		return "", fmt.Errorf("%s is not under a root complex", target)
	}
	return first, nil
}

// New builds the snapshot from an initialised nvml.Interface. It fails only
// when nothing can be enumerated (DeviceGetCount fails). A GPU whose identity
// (handle, UUID, name, memory, PCI info, minor number) cannot be read, or that
// reports ERROR_GPU_IS_LOST on any call, is left out and recorded in
// Inventory.Errors. Failures of optional facts (NUMA node, compute capability,
// MIG mode, one MIG instance, one topology pair or NVLink) are recorded too,
// but the GPU stays with that fact at its "unknown" value; the GPU's own
// facts are then also named in its GPU.Unread, which says what a consumer
// must do about them.
func New(lib nvml.Interface, opts Options) (*Inventory, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	b := &builder{lib: lib, log: log, numa: opts.NUMANode, pcieRoot: opts.PCIeRoot, fabric: opts.FabricInfo}
	if b.fabric == nil {
		b.fabric = defaultFabricInfo
	}

	count, ret := lib.DeviceGetCount()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("nvml DeviceGetCount: %w", ret)
	}
	inv := &Inventory{GPUs: []GPU{}}
	if v, ret := lib.SystemGetDriverVersion(); ret == nvml.SUCCESS {
		inv.DriverVersion = v
	} else {
		log.Debug("driver version unavailable", "error", ret.Error())
	}
	if v, ret := lib.SystemGetCudaDriverVersion(); ret == nvml.SUCCESS && v > 0 {
		// NVML encodes 12.4 as 12040.
		inv.CUDADriverVersion = fmt.Sprintf("%d.%d", v/1000, v%1000/10)
	} else {
		log.Debug("CUDA driver version unavailable", "error", ret.Error())
	}

	devs := make([]nvml.Device, 0, count)
	for i := range count {
		g, dev, ok := b.readGPU(i)
		if !ok {
			continue
		}
		inv.GPUs = append(inv.GPUs, g)
		devs = append(devs, dev)
	}
	inv.Topology = b.topology(devs, inv.GPUs)
	if b.pcieRoot == nil {
		derivePCIeRoots(inv.GPUs, inv.Topology)
	}
	inv.Errors = b.errs
	return inv, nil
}

type builder struct {
	lib  nvml.Interface
	log  *slog.Logger
	numa func(string) (int, error)
	// pcieRoot is Options.PCIeRoot.
	pcieRoot func(string) (string, error)
	// fabric is Options.FabricInfo or its default.
	fabric FabricReader
	// errs in the order they happened: GPU by GPU, then topology, so that
	// two snapshots of the same node list them identically.
	errs []DeviceError
}

// gpuReader reads one GPU; its errors carry the GPU's index and, once known, UUID.
type gpuReader struct {
	b    *builder
	idx  int
	uuid string
	dev  nvml.Device
	// lost is set by the first ERROR_GPU_IS_LOST: the GPU is then left out.
	lost bool
	// unread collects GPU.Unread.
	unread []Fact
	// giProfiles lists the GPU instance profiles the GPU offers, by
	// GPU_INSTANCE_PROFILE_* index; filled on first use (giProfilesRead).
	giProfiles     []giProfile
	giProfilesRead bool
	// giProfileFailures are the profile indexes NVML failed to answer for,
	// which giProfiles therefore lacks.
	giProfileFailures []giProfileFailure
}

type giProfile struct {
	index int
	info  nvml.GpuInstanceProfileInfo
}

type giProfileFailure struct {
	index int
	ret   nvml.Return
}

// readGIProfiles lists the GPU's GPU instance profiles once per GPU: both
// resolving instances' profile ids and finding GPU instances without compute
// instances go through every profile. A failure is kept for those readers
// to record, each with the fact it leaves unknown.
func (r *gpuReader) readGIProfiles() {
	if r.giProfilesRead {
		return
	}
	r.giProfilesRead = true
	for p := range nvml.GPU_INSTANCE_PROFILE_COUNT {
		info, ret := r.dev.GetGpuInstanceProfileInfo(p)
		switch ret {
		case nvml.SUCCESS:
			r.giProfiles = append(r.giProfiles, giProfile{index: p, info: info})
		case nvml.ERROR_NOT_SUPPORTED, nvml.ERROR_INVALID_ARGUMENT:
			// Not offered by this GPU (older drivers say INVALID_ARGUMENT).
		default:
			r.giProfileFailures = append(r.giProfileFailures, giProfileFailure{index: p, ret: ret})
			if ret == nvml.ERROR_GPU_IS_LOST {
				return
			}
		}
	}
}

// giProfileByID resolves a GPU instance's ProfileId. Drivers report their
// own ids there (19 for A100 1g.5gb), not the GPU_INSTANCE_PROFILE_* index,
// so the profiles are listed once per GPU and matched on info.Id. An id not
// among them is NOT_FOUND only when every profile answered; otherwise the
// failure that may have hidden it is returned.
func (r *gpuReader) giProfileByID(id uint32) (giProfile, nvml.Return) {
	r.readGIProfiles()
	for _, p := range r.giProfiles {
		if p.info.Id == id {
			return p, nvml.SUCCESS
		}
	}
	if len(r.giProfileFailures) > 0 {
		return giProfile{}, r.giProfileFailures[0].ret
	}
	return giProfile{}, nvml.ERROR_NOT_FOUND
}

// ciProfileByID does the same for a GPU instance's compute instance profiles.
func ciProfileByID(gi nvml.GpuInstance, id uint32) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
	failed := nvml.ERROR_NOT_FOUND
	for p := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		info, ret := gi.GetComputeInstanceProfileInfo(p, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		switch {
		case ret == nvml.ERROR_GPU_IS_LOST:
			return info, ret
		case ret == nvml.SUCCESS && info.Id == id:
			return info, ret
		case ret != nvml.SUCCESS && ret != nvml.ERROR_NOT_SUPPORTED && ret != nvml.ERROR_INVALID_ARGUMENT:
			failed = ret
		}
	}
	return nvml.ComputeInstanceProfileInfo{}, failed
}

func (r *gpuReader) record(call string, err string) {
	r.b.errs = append(r.b.errs, DeviceError{Index: r.idx, UUID: r.uuid, Call: call, Err: err})
}

// must handles a call the GPU cannot be listed without: false means the GPU is
// left out (and the failure recorded).
func (r *gpuReader) must(call string, ret nvml.Return) bool {
	if ret == nvml.SUCCESS {
		return true
	}
	r.record(call, ret.Error())
	if ret == nvml.ERROR_GPU_IS_LOST {
		r.lost = true
	}
	return false
}

// optional handles a call whose answer the GPU can do without: false means
// use the "unknown" value. NOT_SUPPORTED is an answer, not an error; any
// other failure is recorded and leaves facts unread; a lost GPU is fatal
// whichever call notices it.
func (r *gpuReader) optional(call string, ret nvml.Return, facts ...Fact) bool {
	switch ret {
	case nvml.SUCCESS:
		return true
	case nvml.ERROR_NOT_SUPPORTED:
		return false
	}
	r.failed(call, ret, facts...)
	return false
}

// failed records a call that did not answer and the facts it leaves unread.
func (r *gpuReader) failed(call string, ret nvml.Return, facts ...Fact) {
	if ret == nvml.ERROR_GPU_IS_LOST {
		r.lost = true
	}
	r.record(call, ret.Error())
	r.miss(facts...)
}

func (r *gpuReader) miss(facts ...Fact) {
	for _, f := range facts {
		if !slices.Contains(r.unread, f) {
			r.unread = append(r.unread, f)
		}
	}
}

func (b *builder) readGPU(i int) (GPU, nvml.Device, bool) {
	r := &gpuReader{b: b, idx: i}
	g, ok := r.read()
	if !ok || r.lost {
		b.log.Warn("gpu left out of inventory", "index", i, "uuid", r.uuid)
		if r.lost {
			for k := range b.errs {
				if b.errs[k].Index == i {
					b.errs[k].Lost = true
				}
			}
		}
		return GPU{}, nil, false
	}
	for _, f := range factOrder {
		if slices.Contains(r.unread, f) {
			g.Unread = append(g.Unread, f)
		}
	}
	return g, r.dev, true
}

func (r *gpuReader) read() (GPU, bool) {
	g := GPU{Index: r.idx, NUMANode: -1}
	dev, ret := r.b.lib.DeviceGetHandleByIndex(r.idx)
	if !r.must("DeviceGetHandleByIndex", ret) {
		return g, false
	}
	r.dev = dev
	if g.UUID, ret = dev.GetUUID(); !r.must("GetUUID", ret) {
		return g, false
	}
	r.uuid = g.UUID
	if g.Name, ret = dev.GetName(); !r.must("GetName", ret) {
		return g, false
	}
	mem, ret := dev.GetMemoryInfo()
	if !r.must("GetMemoryInfo", ret) {
		return g, false
	}
	g.MemoryBytes = mem.Total
	pci, ret := dev.GetPciInfo()
	if !r.must("GetPciInfo", ret) {
		return g, false
	}
	bus, err := pciBusID(pci)
	if err != nil {
		// Keep the GPU: the bus id only feeds NUMA and NVLink peer lookup.
		r.record("GetPciInfo", err.Error())
	}
	g.PCIBusID = bus
	g.PCIDeviceID = pci.PciDeviceId
	if g.Minor, ret = dev.GetMinorNumber(); !r.must("GetMinorNumber", ret) {
		return g, false
	}

	if major, minor, ret := dev.GetCudaComputeCapability(); r.optional("GetCudaComputeCapability", ret, FactComputeCapability) {
		g.ComputeCapability = ComputeCapability{Major: major, Minor: minor}
	}
	g.NUMANode = r.numaNode(g.PCIBusID)
	if brand, ret := dev.GetBrand(); r.optional("GetBrand", ret, FactBrand) {
		g.Brand = brandName(brand)
	}
	if r.b.pcieRoot != nil && g.PCIBusID != "" {
		root, err := r.b.pcieRoot(g.PCIBusID)
		if err != nil {
			// Only DRA's alignment attribute needs it: worth a debug line,
			// not a fact the GPU is unread for.
			r.b.log.Debug("pcie root unavailable", "gpu", g.Index, "error", err)
		}
		g.PCIeRoot = root
	}

	if info, ret := r.b.fabric(dev); r.optional("GetGpuFabricInfoV", ret, FactFabric) {
		f, err := DecodeFabric(info)
		if err != nil {
			// A driver newer than this build: the GPU is listed, its
			// fabric unknown rather than guessed.
			r.record("GetGpuFabricInfoV", err.Error())
			r.miss(FactFabric)
		}
		g.Fabric = f
	}

	// A failed GetMigMode says nothing about MIG: the GPU keeps its zero MIG
	// fields, marked unread, so that no consumer mistakes a partitioned GPU
	// for a whole one and withdraws the MIG devices pods hold.
	cur, pend, ret := dev.GetMigMode()
	if r.optional("GetMigMode", ret, FactMIGMode, FactInstances, FactGIsWithoutCI) {
		g.MIGCapable = true
		g.MIG = MIGMode{Current: cur == nvml.DEVICE_MIG_ENABLE, Pending: pend == nvml.DEVICE_MIG_ENABLE}
	}
	if g.MIG.Current {
		var listed bool
		g.Instances, listed = r.migInstances(g.MemoryBytes)
		if !r.lost {
			g.GIsWithoutCI = r.gisWithoutCI(g.Instances, listed, g.MemoryBytes)
		}
	}
	return g, !r.lost
}

// brandName spells NVML's brand as NVIDIA's own tools (go-nvlib, and with it
// NVIDIA's DRA driver) do, so a claim selecting on brand reads the same.
func brandName(b nvml.BrandType) string {
	switch b {
	case nvml.BRAND_QUADRO:
		return "Quadro"
	case nvml.BRAND_TESLA:
		return "Tesla"
	case nvml.BRAND_NVS:
		return "NVS"
	case nvml.BRAND_GRID:
		return "Grid"
	case nvml.BRAND_GEFORCE:
		return "GeForce"
	case nvml.BRAND_TITAN:
		return "Titan"
	case nvml.BRAND_NVIDIA_VAPPS:
		return "NvidiaVApps"
	case nvml.BRAND_NVIDIA_VPC:
		return "NvidiaVPC"
	case nvml.BRAND_NVIDIA_VCS:
		return "NvidiaVCS"
	case nvml.BRAND_NVIDIA_VWS:
		return "NvidiaVWS"
	case nvml.BRAND_NVIDIA_CLOUD_GAMING:
		return "NvidiaCloudGaming"
	case nvml.BRAND_QUADRO_RTX:
		return "QuadroRTX"
	case nvml.BRAND_NVIDIA_RTX:
		return "NvidiaRTX"
	case nvml.BRAND_NVIDIA:
		return "Nvidia"
	case nvml.BRAND_GEFORCE_RTX:
		return "GeForceRTX"
	case nvml.BRAND_TITAN_RTX:
		return "TitanRTX"
	}
	return ""
}

// derivePCIeRoots names a root complex for GPUs that share one by the
// topology (host bridge or closer), where sysfs is not read: "pci" and the
// domain and bus of the group's lowest bus id. A GPU without a bus id or a
// topology position gets none.
func derivePCIeRoots(gpus []GPU, t *Topology) {
	if t == nil || t.Len() != len(gpus) {
		return
	}
	uf := newUnionFind(len(gpus))
	for i := range gpus {
		for j := i + 1; j < len(gpus); j++ {
			if t.Level[i][j] <= LevelHostBridge {
				uf.union(i, j)
			}
		}
	}
	lowest := map[int]string{}
	for i, g := range gpus {
		if g.PCIBusID == "" {
			continue
		}
		r := uf.find(i)
		if b, ok := lowest[r]; !ok || g.PCIBusID < b {
			lowest[r] = g.PCIBusID
		}
	}
	for i := range gpus {
		if b, ok := lowest[uf.find(i)]; ok && gpus[i].PCIBusID != "" {
			gpus[i].PCIeRoot = "pci" + b[:len("0000:00")]
		}
	}
}

func (r *gpuReader) numaNode(bus string) int {
	if r.b.numa == nil {
		n, ret := r.dev.GetNumaNodeId()
		if !r.optional("GetNumaNodeId", ret, FactNUMANode) || n < 0 {
			return -1
		}
		return n
	}
	if bus == "" {
		return -1 // already recorded: NVML's bus id could not be parsed
	}
	n, err := r.b.numa(bus)
	if err != nil {
		r.record("NUMA node of "+bus, err.Error())
		r.miss(FactNUMANode)
		return -1
	}
	return n
}

// migInstances walks the MIG device slots. A slot that cannot be read is
// recorded and skipped, and the instances are marked unread: its profile
// decides the resource it would be served under, so a half-read instance is
// worse than a missing one, but a missing one must not be taken for gone.
// listed is false when the driver does not list MIG devices (NOT_SUPPORTED).
func (r *gpuReader) migInstances(gpuMemory uint64) (insts []MIGInstance, listed bool) {
	slots, ret := r.dev.GetMaxMigDeviceCount()
	if !r.optional("GetMaxMigDeviceCount", ret, FactInstances) {
		return nil, false
	}
	var out []MIGInstance
	for k := range slots {
		mig, ret := r.dev.GetMigDeviceHandleByIndex(k)
		if ret == nvml.ERROR_NOT_FOUND {
			continue // empty slot
		}
		if ret != nvml.SUCCESS {
			r.failed(fmt.Sprintf("GetMigDeviceHandleByIndex(%d)", k), ret, FactInstances)
			if r.lost {
				return nil, true
			}
			continue
		}
		inst, ok := r.migInstance(k, mig, gpuMemory)
		if r.lost {
			return nil, true
		}
		if ok {
			out = append(out, inst)
		}
	}
	slices.SortFunc(out, func(a, b MIGInstance) int {
		if a.GI != b.GI {
			return a.GI - b.GI
		}
		if a.CI != b.CI {
			return a.CI - b.CI
		}
		return a.Index - b.Index
	})
	return out, true
}

func (r *gpuReader) migInstance(k int, mig nvml.Device, gpuMemory uint64) (MIGInstance, bool) {
	inst := MIGInstance{Index: k}
	// call names the failing NVML call with the MIG slot it was for.
	call := func(name string) string { return fmt.Sprintf("mig %d: %s", k, name) }
	// A MIG device is useless to us without every one of these facts, so any
	// failure (NOT_SUPPORTED included) skips it. The slot holds a device all
	// the same, so the instances are unread, not complete without it.
	need := func(name string, ret nvml.Return) bool {
		if ret == nvml.SUCCESS {
			return true
		}
		r.failed(call(name), ret, FactInstances)
		return false
	}
	var ret nvml.Return
	if inst.UUID, ret = mig.GetUUID(); !need("GetUUID", ret) {
		return inst, false
	}
	if inst.GI, ret = mig.GetGpuInstanceId(); !need("GetGpuInstanceId", ret) {
		return inst, false
	}
	if inst.CI, ret = mig.GetComputeInstanceId(); !need("GetComputeInstanceId", ret) {
		return inst, false
	}
	gi, ret := r.dev.GetGpuInstanceById(inst.GI)
	if !need(fmt.Sprintf("GetGpuInstanceById(%d)", inst.GI), ret) {
		return inst, false
	}
	giInfo, ret := gi.GetInfo()
	if !need(fmt.Sprintf("gi %d: GetInfo", inst.GI), ret) {
		return inst, false
	}
	inst.Placement = Placement{Start: int(giInfo.Placement.Start), Size: int(giInfo.Placement.Size)}
	gp, ret := r.giProfileByID(giInfo.ProfileId)
	if !need(fmt.Sprintf("GetGpuInstanceProfileInfo (profile id %d)", giInfo.ProfileId), ret) {
		return inst, false
	}
	prof := gp.info
	inst.GIProfileID = gp.index
	inst.Profile = MIGProfileName(gp.index, prof, gpuMemory)

	ci, ret := gi.GetComputeInstanceById(inst.CI)
	if !need(fmt.Sprintf("gi %d: GetComputeInstanceById(%d)", inst.GI, inst.CI), ret) {
		return inst, false
	}
	ciInfo, ret := ci.GetInfo()
	if !need(fmt.Sprintf("gi %d ci %d: GetInfo", inst.GI, inst.CI), ret) {
		return inst, false
	}
	ciProf, ret := ciProfileByID(gi, ciInfo.ProfileId)
	if !need(fmt.Sprintf("gi %d: GetComputeInstanceProfileInfo (profile id %d)", inst.GI, ciInfo.ProfileId), ret) {
		return inst, false
	}
	if ciProf.SliceCount < prof.SliceCount {
		inst.Profile = fmt.Sprintf("%dc.%s", ciProf.SliceCount, inst.Profile)
	}

	// The MIG device's own memory is what a container sees; the profile's
	// size is the fallback for drivers that do not answer for MIG handles.
	// A failure other than NOT_SUPPORTED gets the fallback too, but marks
	// the instances unread: the size may differ from the last snapshot's.
	mem, ret := mig.GetMemoryInfo()
	if ret == nvml.SUCCESS {
		inst.MemoryBytes = mem.Total
		return inst, true
	}
	if ret != nvml.ERROR_NOT_SUPPORTED && !need("GetMemoryInfo", ret) && r.lost {
		return inst, false
	}
	inst.MemoryBytes = prof.MemorySizeMB << 20
	return inst, true
}

// gisWithoutCI finds the GPU instances that have no compute instance. The
// MIG device slots cannot show them (a MIG device is a compute instance), so
// every GPU instance of every profile is listed, and one that no instance
// in insts names is asked for its compute instances. listed says whether
// insts are the MIG devices the driver listed.
func (r *gpuReader) gisWithoutCI(insts []MIGInstance, listed bool, gpuMemory uint64) []GPUInstance {
	seen := map[int]bool{}
	for _, in := range insts {
		seen[in.GI] = true
	}
	r.readGIProfiles()
	for _, f := range r.giProfileFailures {
		r.failed(fmt.Sprintf("GetGpuInstanceProfileInfo(%d)", f.index), f.ret, FactGIsWithoutCI)
		if r.lost {
			return nil
		}
	}
	var out []GPUInstance
	for _, p := range r.giProfiles {
		name := MIGProfileName(p.index, p.info, gpuMemory)
		gis, ret := r.dev.GetGpuInstances(&p.info)
		if ret == nvml.ERROR_NOT_SUPPORTED {
			continue
		}
		if ret != nvml.SUCCESS {
			r.failed(fmt.Sprintf("GetGpuInstances(%s)", name), ret, FactGIsWithoutCI)
			if r.lost {
				return nil
			}
			continue
		}
		for _, gi := range gis {
			info, ret := gi.GetInfo()
			if ret != nvml.SUCCESS {
				r.failed(fmt.Sprintf("GetGpuInstances(%s): GetInfo", name), ret, FactGIsWithoutCI)
				if r.lost {
					return nil
				}
				continue
			}
			id := int(info.Id)
			if seen[id] {
				continue
			}
			n, call, ret := countComputeInstances(gi)
			if ret != nvml.SUCCESS {
				r.failed(fmt.Sprintf("gi %d: %s", id, call), ret, FactGIsWithoutCI)
				if r.lost {
					return nil
				}
				continue
			}
			if n > 0 {
				// Its MIG devices are missing from insts: a slot that failed
				// (already recorded), or one created since the slots were read.
				if listed && !slices.Contains(r.unread, FactInstances) {
					r.record(fmt.Sprintf("gi %d", id), fmt.Sprintf("%d compute instance(s) but no MIG device listed", n))
					r.miss(FactInstances)
				}
				continue
			}
			out = append(out, GPUInstance{
				GI: id, Profile: name, GIProfileID: p.index,
				Placement: Placement{Start: int(info.Placement.Start), Size: int(info.Placement.Size)},
			})
		}
	}
	slices.SortFunc(out, func(a, b GPUInstance) int { return a.GI - b.GI })
	return out
}

// countComputeInstances counts gi's compute instances of every profile; on
// failure it names the call.
func countComputeInstances(gi nvml.GpuInstance) (int, string, nvml.Return) {
	n := 0
	for p := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		info, ret := gi.GetComputeInstanceProfileInfo(p, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT {
			continue // a profile this GPU instance cannot hold
		}
		if ret != nvml.SUCCESS {
			return 0, fmt.Sprintf("GetComputeInstanceProfileInfo(%d)", p), ret
		}
		cis, ret := gi.GetComputeInstances(&info)
		if ret != nvml.SUCCESS {
			return 0, fmt.Sprintf("GetComputeInstances(%d)", p), ret
		}
		n += len(cis)
	}
	return n, "", nvml.SUCCESS
}

// MIGProfileName names a GPU instance profile as users write it ("1g.10gb",
// "1g.5gb+me", "7g.80gb"). NVML's MemorySizeMB is what is left after the
// driver's reservations (4864 MiB on a 40 GB A100), so the advertised size is
// recovered the way NVIDIA's tools do it: take the profile's share of the
// GPU's memory, round it up to the next eighth (the memory slice), and round
// that many bytes to whole GB.
func MIGProfileName(profileID int, info nvml.GpuInstanceProfileInfo, gpuMemoryBytes uint64) string {
	return fmt.Sprintf("%dg.%dgb%s", info.SliceCount, migMemoryGB(info.MemorySizeMB, gpuMemoryBytes>>20), profileSuffix(profileID))
}

// migMemoryGB does MIGProfileName's rounding in integers so that the name
// never depends on floating point. The total is taken in whole GiB rounded
// up before the share is applied, as NVIDIA's tools do: an H200's 143771
// MiB count as 141 GiB, so half of it is 3g.71gb (70.2 GiB of the exact
// total would say 70), and a B200's 183359 MiB as 180, so an eighth is
// 1g.23gb.
func migMemoryGB(profileMiB, totalMiB uint64) uint64 {
	if totalMiB == 0 {
		return (profileMiB + 1023) / 1024
	}
	eighths := (8*profileMiB + totalMiB - 1) / totalMiB
	totalGiB := (totalMiB + 1023) / 1024
	// eighths/8 of totalGiB, rounded half up.
	return (eighths*totalGiB + 4) / 8
}

// profileSuffix marks the profile variants that share a slice count with the
// plain profile but differ in media engines or graphics support.
func profileSuffix(profileID int) string {
	switch profileID {
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, nvml.GPU_INSTANCE_PROFILE_2_SLICE_REV1:
		return "+me"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_ALL_ME, nvml.GPU_INSTANCE_PROFILE_2_SLICE_ALL_ME:
		return "+me.all"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_NO_ME, nvml.GPU_INSTANCE_PROFILE_2_SLICE_NO_ME:
		return "-me"
	case nvml.GPU_INSTANCE_PROFILE_1_SLICE_GFX, nvml.GPU_INSTANCE_PROFILE_2_SLICE_GFX,
		nvml.GPU_INSTANCE_PROFILE_3_SLICE_GFX, nvml.GPU_INSTANCE_PROFILE_4_SLICE_GFX:
		return "+gfx"
	}
	return ""
}

// pciBusID returns NVML's PCI address in sysfs form.
func pciBusID(p nvml.PciInfo) (string, error) {
	raw := cString(p.BusId[:])
	if raw == "" {
		raw = cString(p.BusIdLegacy[:])
	}
	if raw == "" {
		return "", errors.New("empty pci bus id")
	}
	return NormalizeBusID(raw)
}

func cString(b []int8) string {
	var sb strings.Builder
	for _, c := range b {
		if c == 0 {
			break
		}
		sb.WriteByte(byte(c))
	}
	return sb.String()
}

// NormalizeBusID converts a PCI address to the form sysfs uses, lower case
// with a 4-digit domain: NVML writes "00000000:07:00.0" (8-digit domain, upper
// case hex), sysfs and the kubelet "0000:07:00.0". A domain above 0xffff (VMD)
// keeps its extra digits, as in sysfs. An address without a domain gets 0000.
func NormalizeBusID(s string) (string, error) {
	parts := strings.Split(strings.TrimSpace(s), ":")
	if len(parts) == 2 {
		parts = append([]string{"0"}, parts...)
	}
	if len(parts) != 3 {
		return "", fmt.Errorf("pci bus id %q: want domain:bus:device.function", s)
	}
	devfn := strings.Split(parts[2], ".")
	if len(devfn) != 2 {
		return "", fmt.Errorf("pci bus id %q: want domain:bus:device.function", s)
	}
	fields := []struct {
		s    string
		bits int
		name string
	}{{parts[0], 32, "domain"}, {parts[1], 8, "bus"}, {devfn[0], 5, "device"}, {devfn[1], 3, "function"}}
	var v [4]uint64
	for i, f := range fields {
		if f.s == "" || len(f.s) > 8 {
			return "", fmt.Errorf("pci bus id %q: bad %s %q", s, f.name, f.s)
		}
		n, err := strconv.ParseUint(f.s, 16, f.bits)
		if err != nil {
			return "", fmt.Errorf("pci bus id %q: bad %s %q", s, f.name, f.s)
		}
		v[i] = n
	}
	return fmt.Sprintf("%04x:%02x:%02x.%x", v[0], v[1], v[2], v[3]), nil
}

// topology reads the pair levels and NVLinks of the listed GPUs (devs[i] is
// gpus[i]). Nothing here fails the inventory: a pair NVML cannot answer for is
// recorded and treated as the most distant.
func (b *builder) topology(devs []nvml.Device, gpus []GPU) *Topology {
	n := len(gpus)
	t := &Topology{
		Level:       make([][]LinkLevel, n),
		DirectLanes: make([][]int, n),
		SwitchLanes: make([]int, n),
		Fabric:      make([]int, n),
	}
	for i := range n {
		t.Level[i] = make([]LinkLevel, n)
		t.DirectLanes[i] = make([]int, n)
	}
	record := func(i int, call string, err string) {
		b.errs = append(b.errs, DeviceError{Index: gpus[i].Index, UUID: gpus[i].UUID, Call: call, Err: err})
	}

	unsupported := false
	for i := range n {
		t.Level[i][i] = LevelInternal
		for j := i + 1; j < n; j++ {
			lvl, ret := devs[i].GetTopologyCommonAncestor(devs[j])
			l := LinkLevel(lvl)
			switch {
			case ret == nvml.ERROR_NOT_SUPPORTED:
				unsupported = true
				l = LevelSystem
			case ret != nvml.SUCCESS:
				record(i, fmt.Sprintf("GetTopologyCommonAncestor(gpu %d)", gpus[j].Index), ret.Error())
				l = LevelSystem
			case l.String() == "?":
				b.log.Warn("unknown topology level, using SYS", "gpu", gpus[i].Index, "peer", gpus[j].Index, "level", int(lvl))
				l = LevelSystem
			}
			t.Level[i][j], t.Level[j][i] = l, l
		}
	}
	if unsupported {
		b.log.Info("NVML cannot tell the PCIe topology; treating every pair as SYS")
	}

	byBus := make(map[string]int, n)
	for i, g := range gpus {
		if g.PCIBusID != "" {
			byBus[g.PCIBusID] = i
		}
	}
	// Union-find over GPUs (0..n-1) and NVSwitches (n..): GPUs that reach a
	// common switch, directly or through other GPUs' switches, share a fabric.
	uf := newUnionFind(n)
	switches := map[string]int{}
	onSwitch := make([]bool, n)
	for i := range n {
		b.nvlinks(t, i, devs[i], gpus, byBus, record, func(bus string) {
			s, ok := switches[bus]
			if !ok {
				s = uf.add()
				switches[bus] = s
			}
			uf.union(i, s)
			onSwitch[i] = true
		})
	}
	// Fabric ids are numbered in GPU order so equal nodes get equal ids.
	fabric := map[int]int{}
	for i := range n {
		t.Fabric[i] = -1
		if !onSwitch[i] {
			continue
		}
		root := uf.find(i)
		id, ok := fabric[root]
		if !ok {
			id = len(fabric)
			fabric[root] = id
		}
		t.Fabric[i] = id
	}
	return t
}

// nvlinks counts GPU i's active NVLink lanes into t and reports each switch it
// reaches (by normalised bus id) to onSwitch.
func (b *builder) nvlinks(t *Topology, i int, dev nvml.Device, gpus []GPU, byBus map[string]int,
	record func(int, string, string), onSwitch func(string)) {
	for link := range nvml.NVLINK_MAX_LINKS {
		state, ret := dev.GetNvLinkState(link)
		// NVML answers INVALID_ARGUMENT past the GPU's last link and
		// NOT_SUPPORTED when it has none: either way there are no more.
		if ret == nvml.ERROR_NOT_SUPPORTED || ret == nvml.ERROR_INVALID_ARGUMENT {
			return
		}
		if ret != nvml.SUCCESS {
			record(i, fmt.Sprintf("GetNvLinkState(link %d)", link), ret.Error())
			if ret == nvml.ERROR_GPU_IS_LOST {
				return
			}
			continue
		}
		if state != nvml.FEATURE_ENABLED {
			continue
		}
		typ, typRet := dev.GetNvLinkRemoteDeviceType(link)
		if typRet != nvml.SUCCESS && typRet != nvml.ERROR_NOT_SUPPORTED {
			record(i, fmt.Sprintf("GetNvLinkRemoteDeviceType(link %d)", link), typRet.Error())
			continue
		}
		pci, pciRet := dev.GetNvLinkRemotePciInfo(link)
		var remote string
		if pciRet == nvml.SUCCESS {
			raw := cString(pci.BusId[:])
			var err error
			if remote, err = NormalizeBusID(raw); err != nil {
				remote = raw
			}
		}
		if typRet == nvml.SUCCESS && typ == nvml.NVLINK_DEVICE_TYPE_SWITCH {
			t.SwitchLanes[i]++
			if pciRet != nvml.SUCCESS {
				record(i, fmt.Sprintf("GetNvLinkRemotePciInfo(link %d)", link), pciRet.Error())
				continue
			}
			onSwitch(remote)
			continue
		}
		if typRet == nvml.SUCCESS && typ != nvml.NVLINK_DEVICE_TYPE_GPU {
			b.log.Debug("nvlink to a device that is neither GPU nor switch, ignored", "gpu", gpus[i].Index, "link", link, "type", int(typ))
			continue
		}
		// A GPU lane, or (older drivers, no remote type) possibly one.
		if pciRet != nvml.SUCCESS {
			record(i, fmt.Sprintf("GetNvLinkRemotePciInfo(link %d)", link), pciRet.Error())
			continue
		}
		peer, ok := byBus[remote]
		if !ok || peer == i {
			b.log.Warn("nvlink to an unknown device, ignored", "gpu", gpus[i].Index, "link", link, "remote", remote)
			continue
		}
		t.DirectLanes[i][peer]++
	}
}

type unionFind struct {
	parent []int
	size   []int
}

func newUnionFind(n int) *unionFind {
	u := &unionFind{}
	for range n {
		u.add()
	}
	return u
}

func (u *unionFind) add() int {
	u.parent = append(u.parent, len(u.parent))
	u.size = append(u.size, 1)
	return len(u.parent) - 1
}

func (u *unionFind) find(x int) int {
	for u.parent[x] != x {
		u.parent[x] = u.parent[u.parent[x]]
		x = u.parent[x]
	}
	return x
}

func (u *unionFind) union(a, b int) {
	a, b = u.find(a), u.find(b)
	if a == b {
		return
	}
	if u.size[a] < u.size[b] {
		a, b = b, a
	}
	u.parent[b] = a
	u.size[a] += u.size[b]
}
