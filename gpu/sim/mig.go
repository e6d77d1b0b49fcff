package sim

import (
	"slices"
	"strconv"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// maxMIGDevices is how many MIG devices the GPU can have at once: as many
// as its smallest profile fits (7 on A100 and later, 4 on A30).
func (m *model) maxMIGDevices() int {
	n := 0
	for _, p := range m.mig {
		if p.slice == 1 {
			n = max(n, int(p.count))
		}
	}
	return n
}

// gpuInstance is one MIG GPU instance (an nvml.GpuInstance handle). Guarded
// by Node.mu; the handle turns invalid once destroyed.
type gpuInstance struct {
	mockGpuInstance
	n         *Node
	g         *gpuState
	id        int
	prof      *giProfile
	placement nvml.GpuInstancePlacement
	cis       []*computeInstance // ordered by id
	destroyed bool
	// util and memUtil are the instance's load (SetInstanceUtilization),
	// act its integral (telemetry.go).
	util, memUtil uint32
	act           activity
}

type mockGpuInstance struct{ *mock.GpuInstance }

// computeInstance is one compute instance of a GPU instance, with the MIG
// device handle that stands for it.
type computeInstance struct {
	mockComputeInstance
	gi        *gpuInstance
	id        int
	prof      nvml.ComputeInstanceProfileInfo
	placement nvml.ComputeInstancePlacement
	dev       *device
	destroyed bool
}

type mockComputeInstance struct{ *mock.ComputeInstance }

var (
	_ nvml.GpuInstance     = (*gpuInstance)(nil)
	_ nvml.ComputeInstance = (*computeInstance)(nil)
)

// profileID is the id the node reports for p: the one real drivers report
// (19 for A100 1g.5gb), which is not the GPU_INSTANCE_PROFILE_* index used to
// ask for it. Callers that confuse the two fail here as on hardware.
func (n *Node) profileID(p *giProfile) uint32 { return p.hwID }

func (n *Node) giProfileInfo(p *giProfile) nvml.GpuInstanceProfileInfo {
	return nvml.GpuInstanceProfileInfo{
		Id: n.profileID(p), IsP2pSupported: 0, SliceCount: p.slice, InstanceCount: p.count,
		MultiprocessorCount: p.sms, CopyEngineCount: p.ce, DecoderCount: p.dec, EncoderCount: p.enc,
		JpegCount: p.jpeg, OfaCount: p.ofa, MemorySizeMB: p.memMiB,
	}
}

// migProfile resolves a profile info argument to this model's profile.
func (d *device) migProfile(info *nvml.GpuInstanceProfileInfo) (*giProfile, nvml.Return) {
	if info == nil {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	for i := range d.model().mig {
		if p := &d.model().mig[i]; d.n.profileID(p) == info.Id {
			return p, nvml.SUCCESS
		}
	}
	return nil, nvml.ERROR_INVALID_ARGUMENT
}

// lockMIG is lock for the MIG calls of a GPU handle: the node lock is held
// on return (the caller unlocks), and the result says whether the call may
// proceed on this model and, with needEnabled, in the current MIG mode.
func (d *device) lockMIG(call string, needEnabled bool) nvml.Return {
	if r := d.lock(call, false); r != nvml.SUCCESS {
		return r
	}
	return d.migGate(needEnabled)
}

func (d *device) migGate(needEnabled bool) nvml.Return {
	if d.model().mig == nil || (needEnabled && !d.g.migCurrent) {
		return nvml.ERROR_NOT_SUPPORTED
	}
	return nvml.SUCCESS
}

func boolInt(b bool) int {
	if b {
		return nvml.DEVICE_MIG_ENABLE
	}
	return nvml.DEVICE_MIG_DISABLE
}

// GetMigMode returns (current, pending).
func (d *device) GetMigMode() (int, int, nvml.Return) {
	r := d.lockMIG("GetMigMode", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, 0, r
	}
	return boolInt(d.g.migCurrent), boolInt(d.g.migPending), nvml.SUCCESS
}

// SetMigMode returns (activationStatus, return) like go-nvml. A change is
// refused with ERROR_IN_USE while GPU instances exist. Without
// WithImmediateMIGModeChange it stays pending until Reset and the activation
// status is ERROR_RESET_REQUIRED; with it, it applies at once unless
// processes run on the GPU (activation status ERROR_IN_USE, still pending).
func (d *device) SetMigMode(mode int) (nvml.Return, nvml.Return) {
	r := d.lockMIG("SetMigMode", false)
	defer d.n.mu.Unlock()
	if r == nvml.SUCCESS && mode != nvml.DEVICE_MIG_DISABLE && mode != nvml.DEVICE_MIG_ENABLE {
		r = nvml.ERROR_INVALID_ARGUMENT
	}
	g := d.g
	want := mode == nvml.DEVICE_MIG_ENABLE
	if r == nvml.SUCCESS && want != g.migCurrent && len(g.gis) > 0 {
		r = nvml.ERROR_IN_USE
	}
	if r != nvml.SUCCESS {
		return r, r
	}
	activation := nvml.SUCCESS
	switch {
	case want == g.migCurrent:
	case !d.n.opts.migImmediate:
		activation = nvml.ERROR_RESET_REQUIRED
	case len(g.procs) > 0:
		activation = nvml.ERROR_IN_USE
	}
	r = d.n.mutate(g, "SetMigMode", func() {
		g.migPending = want
		if activation == nvml.SUCCESS {
			g.migCurrent = want
		}
	})
	if r != nvml.SUCCESS {
		return r, r
	}
	return activation, nvml.SUCCESS
}

// GetGpuInstanceProfileInfo takes a GPU_INSTANCE_PROFILE_* value; callers
// probe from 0 until INVALID_ARGUMENT, and profiles the model lacks answer
// NOT_SUPPORTED. It works whatever the MIG mode.
func (d *device) GetGpuInstanceProfileInfo(profile int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
	r := d.lockMIG("GetGpuInstanceProfileInfo", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.GpuInstanceProfileInfo{}, r
	}
	if profile < 0 || profile >= nvml.GPU_INSTANCE_PROFILE_COUNT {
		return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_INVALID_ARGUMENT
	}
	for i := range d.model().mig {
		if p := &d.model().mig[i]; p.enum == profile {
			return d.n.giProfileInfo(p), nvml.SUCCESS
		}
	}
	return nvml.GpuInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
}

// GetGpuInstancePossiblePlacements lists every placement of the profile,
// occupied or not, whatever the MIG mode (as NVML documents).
func (d *device) GetGpuInstancePossiblePlacements(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstancePlacement, nvml.Return) {
	r := d.lockMIG("GetGpuInstancePossiblePlacements", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	p, r := d.migProfile(info)
	if r != nvml.SUCCESS {
		return nil, r
	}
	out := make([]nvml.GpuInstancePlacement, len(p.starts))
	for i, s := range p.starts {
		out[i] = nvml.GpuInstancePlacement{Start: s, Size: p.size}
	}
	return out, nvml.SUCCESS
}

// occupied is the mask of memory slices held by GPU instances.
func (g *gpuState) occupied() uint32 {
	var m uint32
	for _, gi := range g.gis {
		m |= sliceMask(gi.placement.Start, gi.placement.Size)
	}
	return m
}

func sliceMask(start, size uint32) uint32 { return ((1 << size) - 1) << start }

func (g *gpuState) countOf(p *giProfile) uint32 {
	var c uint32
	for _, gi := range g.gis {
		if gi.prof == p {
			c++
		}
	}
	return c
}

// ofaLeft says whether an instance of p still gets the optical flow
// accelerators it needs. A GPU has as many as its full-size profile (one on
// every MIG model) and only the +me profiles take one, so an A30 can have a
// 1g.6gb+me or a 2g.12gb+me, not both: the "one with media extensions" of
// each row of the MIG User Guide's A30 table is one per GPU.
func (g *gpuState) ofaLeft(p *giProfile, m *model) bool {
	if p.ofa == 0 {
		return true
	}
	var total, used uint32
	for _, q := range m.mig {
		total = max(total, q.ofa)
	}
	for _, gi := range g.gis {
		used += gi.prof.ofa
	}
	return used+p.ofa <= total
}

// freeStarts are the placements of p that overlap no GPU instance. A
// profile's placements never overlap each other, so all of them can be
// created together.
func (g *gpuState) freeStarts(p *giProfile) []uint32 {
	occ := g.occupied()
	var out []uint32
	for _, s := range p.starts {
		if occ&sliceMask(s, p.size) == 0 {
			out = append(out, s)
		}
	}
	return out
}

// GetGpuInstanceRemainingCapacity counts how many more instances of the
// profile fit, bounded by its per-GPU count and, for the +me profiles, the
// GPU's optical flow accelerator.
func (d *device) GetGpuInstanceRemainingCapacity(info *nvml.GpuInstanceProfileInfo) (int, nvml.Return) {
	r := d.lockMIG("GetGpuInstanceRemainingCapacity", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	p, r := d.migProfile(info)
	if r != nvml.SUCCESS {
		return 0, r
	}
	left := int(p.count) - int(d.g.countOf(p))
	if !d.g.ofaLeft(p, d.n.spec.model) {
		left = 0
	}
	return max(0, min(left, len(d.g.freeStarts(p)))), nvml.SUCCESS
}

// CreateGpuInstance takes the first free placement of the profile.
func (d *device) CreateGpuInstance(info *nvml.GpuInstanceProfileInfo) (nvml.GpuInstance, nvml.Return) {
	r := d.lockMIG("CreateGpuInstance", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	p, r := d.migProfile(info)
	if r != nvml.SUCCESS {
		return nil, r
	}
	free := d.g.freeStarts(p)
	if len(free) == 0 {
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	return d.createGI("CreateGpuInstance", p, free[0])
}

// CreateGpuInstanceWithPlacement: a placement that is not one of the
// profile's possible ones is an invalid argument; one overlapping an
// existing instance is INSUFFICIENT_RESOURCES.
func (d *device) CreateGpuInstanceWithPlacement(info *nvml.GpuInstanceProfileInfo, pl *nvml.GpuInstancePlacement) (nvml.GpuInstance, nvml.Return) {
	r := d.lockMIG("CreateGpuInstanceWithPlacement", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	p, r := d.migProfile(info)
	if r != nvml.SUCCESS {
		return nil, r
	}
	if pl == nil || pl.Size != p.size || !slices.Contains(p.starts, pl.Start) {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if d.g.occupied()&sliceMask(pl.Start, pl.Size) != 0 {
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	return d.createGI("CreateGpuInstanceWithPlacement", p, pl.Start)
}

// createGI gives the instance the lowest free id from 1 (real drivers derive
// ids from the placement; nothing may rely on either scheme).
func (d *device) createGI(call string, p *giProfile, start uint32) (nvml.GpuInstance, nvml.Return) {
	g := d.g
	if g.countOf(p) >= p.count || !g.ofaLeft(p, d.n.spec.model) {
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	id := 1
	for _, gi := range g.gis { // ordered by id
		if gi.id == id {
			id++
		}
	}
	var gi *gpuInstance
	if r := d.n.mutate(g, call, func() { gi = d.n.addGI(g, id, p, start) }); r != nvml.SUCCESS {
		return nil, r
	}
	return gi, nvml.SUCCESS
}

// addGI makes GPU instance id at start, which the caller checked is free;
// callers hold n.mu.
func (n *Node) addGI(g *gpuState, id int, p *giProfile, start uint32) *gpuInstance {
	gi := &gpuInstance{
		mockGpuInstance: mockGpuInstance{&mock.GpuInstance{}},
		n:               n, g: g, id: id, prof: p,
		placement: nvml.GpuInstancePlacement{Start: start, Size: p.size},
	}
	fillFuncs(gi.GpuInstance, func(call string) nvml.Return {
		n.mu.Lock()
		defer n.mu.Unlock()
		if r := gi.check("GpuInstance" + call); r != nvml.SUCCESS {
			return r
		}
		return nvml.ERROR_NOT_SUPPORTED
	})
	g.gis = append(g.gis, gi)
	slices.SortFunc(g.gis, func(a, b *gpuInstance) int { return a.id - b.id })
	return gi
}

// GetGpuInstances lists the instances of one profile, by id.
func (d *device) GetGpuInstances(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstance, nvml.Return) {
	r := d.lockMIG("GetGpuInstances", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	p, r := d.migProfile(info)
	if r != nvml.SUCCESS {
		return nil, r
	}
	out := []nvml.GpuInstance{}
	for _, gi := range d.g.gis {
		if gi.prof == p {
			out = append(out, gi)
		}
	}
	return out, nvml.SUCCESS
}

// GetGpuInstanceById returns ERROR_NOT_FOUND for ids not in use.
func (d *device) GetGpuInstanceById(id int) (nvml.GpuInstance, nvml.Return) {
	r := d.lockMIG("GetGpuInstanceById", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	for _, gi := range d.g.gis {
		if gi.id == id {
			return gi, nvml.SUCCESS
		}
	}
	return nil, nvml.ERROR_NOT_FOUND
}

// GetMaxMigDeviceCount is 7 on MIG-capable GPUs.
func (d *device) GetMaxMigDeviceCount() (int, nvml.Return) {
	r := d.lockMIG("GetMaxMigDeviceCount", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	return d.n.spec.model.maxMIGDevices(), nvml.SUCCESS
}

// GetMigDeviceHandleByIndex counts compute instances in GI id, then CI id,
// order; past the last one it is ERROR_NOT_FOUND.
func (d *device) GetMigDeviceHandleByIndex(index int) (nvml.Device, nvml.Return) {
	r := d.lockMIG("GetMigDeviceHandleByIndex", false)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	if index < 0 || index >= d.n.spec.model.maxMIGDevices() {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	i := 0
	for _, gi := range d.g.gis {
		for _, ci := range gi.cis {
			if i == index {
				return ci.dev, nvml.SUCCESS
			}
			i++
		}
	}
	return nil, nvml.ERROR_NOT_FOUND
}

// IsMigDeviceHandle tells MIG device handles from GPU handles.
func (d *device) IsMigDeviceHandle() (bool, nvml.Return) {
	return get(d, "IsMigDeviceHandle", true, func() bool { return d.ci != nil })
}

// GetGpuInstanceId is only answered on MIG device handles.
func (d *device) GetGpuInstanceId() (int, nvml.Return) {
	r := d.lock("GetGpuInstanceId", true)
	defer d.n.mu.Unlock()
	if r == nvml.SUCCESS && d.ci == nil {
		r = nvml.ERROR_NOT_SUPPORTED
	}
	if r != nvml.SUCCESS {
		return 0, r
	}
	return d.ci.gi.id, nvml.SUCCESS
}

// GetComputeInstanceId is only answered on MIG device handles.
func (d *device) GetComputeInstanceId() (int, nvml.Return) {
	r := d.lock("GetComputeInstanceId", true)
	defer d.n.mu.Unlock()
	if r == nvml.SUCCESS && d.ci == nil {
		r = nvml.ERROR_NOT_SUPPORTED
	}
	if r != nvml.SUCCESS {
		return 0, r
	}
	return d.ci.id, nvml.SUCCESS
}

// GetDeviceHandleFromMigDeviceHandle: a GPU handle is an invalid argument.
func (d *device) GetDeviceHandleFromMigDeviceHandle() (nvml.Device, nvml.Return) {
	r := d.lock("GetDeviceHandleFromMigDeviceHandle", true)
	defer d.n.mu.Unlock()
	if r == nvml.SUCCESS && d.ci == nil {
		r = nvml.ERROR_INVALID_ARGUMENT
	}
	if r != nvml.SUCCESS {
		return nil, r
	}
	return d.g.handle, nvml.SUCCESS
}

// check gates every GPU instance call; callers hold n.mu. call is the
// nvml.Interface name of the method (GpuInstanceDestroy), as FailCalls
// names it: the bare names clash with ComputeInstance's.
func (gi *gpuInstance) check(call string) nvml.Return {
	if r := gi.n.ready(); r != nvml.SUCCESS {
		return r
	}
	if r := gi.n.injected(gi.g, call); r != nvml.SUCCESS {
		return r
	}
	if gi.g.lost {
		return nvml.ERROR_GPU_IS_LOST
	}
	if gi.destroyed {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return nvml.SUCCESS
}

// lock takes the node lock, which the caller releases, and runs check.
func (gi *gpuInstance) lock(call string) nvml.Return {
	gi.n.mu.Lock()
	return gi.check(call)
}

// GetInfo describes the instance.
func (gi *gpuInstance) GetInfo() (nvml.GpuInstanceInfo, nvml.Return) {
	r := gi.lock("GpuInstanceGetInfo")
	defer gi.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.GpuInstanceInfo{}, r
	}
	return nvml.GpuInstanceInfo{
		Device: gi.g.handle, Id: uint32(gi.id), ProfileId: gi.n.profileID(gi.prof), Placement: gi.placement,
	}, nvml.SUCCESS
}

// Destroy fails with ERROR_IN_USE while compute instances or processes exist.
func (gi *gpuInstance) Destroy() nvml.Return {
	r := gi.lock("GpuInstanceDestroy")
	defer gi.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return r
	}
	if len(gi.cis) > 0 {
		return nvml.ERROR_IN_USE
	}
	for _, p := range gi.g.procs {
		if p.GpuInstanceId == uint32(gi.id) {
			return nvml.ERROR_IN_USE
		}
	}
	return gi.n.mutate(gi.g, "GpuInstanceDestroy", func() {
		gi.destroyed = true
		gi.g.gis = slices.DeleteFunc(gi.g.gis, func(x *gpuInstance) bool { return x == gi })
	})
}

// ciSlices maps the COMPUTE_INSTANCE_PROFILE_* values the sim models to
// their compute slices.
func ciSlices(profile int) (uint32, bool) {
	switch profile {
	case nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE:
		return 1, true
	case nvml.COMPUTE_INSTANCE_PROFILE_2_SLICE:
		return 2, true
	case nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE:
		return 3, true
	case nvml.COMPUTE_INSTANCE_PROFILE_4_SLICE:
		return 4, true
	case nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE:
		return 7, true
	}
	return 0, false
}

// ciStarts are where a compute instance of size slices may start within a
// GPU instance of giSlices compute slices; like GPU instance placements, the
// starts of one size never overlap.
func ciStarts(size, giSlices uint32) []uint32 {
	var cands []uint32
	switch size {
	case 1:
		cands = []uint32{0, 1, 2, 3, 4, 5, 6}
	case 2:
		cands = []uint32{0, 2, 4}
	case 3:
		cands = []uint32{0, 4}
	default:
		cands = []uint32{0}
	}
	var out []uint32
	for _, s := range cands {
		if s+size <= giSlices {
			out = append(out, s)
		}
	}
	return out
}

// ciProfile returns what a compute instance profile looks like in this GI,
// or NOT_SUPPORTED when it does not fit.
func (gi *gpuInstance) ciProfile(profile int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
	size, ok := ciSlices(profile)
	if !ok || size > gi.prof.slice {
		return nvml.ComputeInstanceProfileInfo{}, nvml.ERROR_NOT_SUPPORTED
	}
	sms := size * gi.n.spec.model.mig[0].sms
	if size == gi.prof.slice {
		sms = gi.prof.sms
	}
	p := gi.prof
	return nvml.ComputeInstanceProfileInfo{
		Id: uint32(profile), SliceCount: size, InstanceCount: uint32(len(ciStarts(size, p.slice))),
		MultiprocessorCount: sms, SharedCopyEngineCount: p.ce, SharedDecoderCount: p.dec,
		SharedEncoderCount: p.enc, SharedJpegCount: p.jpeg, SharedOfaCount: p.ofa,
	}, nvml.SUCCESS
}

// ciArg resolves a compute instance profile info argument.
func (gi *gpuInstance) ciArg(info *nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
	if info == nil || info.Id >= nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
		return nvml.ComputeInstanceProfileInfo{}, nvml.ERROR_INVALID_ARGUMENT
	}
	return gi.ciProfile(int(info.Id))
}

// GetComputeInstanceProfileInfo supports the shared engine profile, the
// only one NVML defines.
func (gi *gpuInstance) GetComputeInstanceProfileInfo(profile, engProfile int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
	r := gi.lock("GpuInstanceGetComputeInstanceProfileInfo")
	defer gi.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.ComputeInstanceProfileInfo{}, r
	}
	if profile < 0 || profile >= nvml.COMPUTE_INSTANCE_PROFILE_COUNT ||
		engProfile < 0 || engProfile >= nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_COUNT {
		return nvml.ComputeInstanceProfileInfo{}, nvml.ERROR_INVALID_ARGUMENT
	}
	return gi.ciProfile(profile)
}

// GetComputeInstancePossiblePlacements lists every placement, occupied or not.
func (gi *gpuInstance) GetComputeInstancePossiblePlacements(info *nvml.ComputeInstanceProfileInfo) ([]nvml.ComputeInstancePlacement, nvml.Return) {
	r := gi.lock("GpuInstanceGetComputeInstancePossiblePlacements")
	defer gi.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	p, r := gi.ciArg(info)
	if r != nvml.SUCCESS {
		return nil, r
	}
	var out []nvml.ComputeInstancePlacement
	for _, s := range ciStarts(p.SliceCount, gi.prof.slice) {
		out = append(out, nvml.ComputeInstancePlacement{Start: s, Size: p.SliceCount})
	}
	return out, nvml.SUCCESS
}

func (gi *gpuInstance) ciFreeStarts(size uint32) []uint32 {
	var occ uint32
	for _, ci := range gi.cis {
		occ |= sliceMask(ci.placement.Start, ci.placement.Size)
	}
	var out []uint32
	for _, s := range ciStarts(size, gi.prof.slice) {
		if occ&sliceMask(s, size) == 0 {
			out = append(out, s)
		}
	}
	return out
}

// GetComputeInstanceRemainingCapacity counts free placements of the profile.
func (gi *gpuInstance) GetComputeInstanceRemainingCapacity(info *nvml.ComputeInstanceProfileInfo) (int, nvml.Return) {
	r := gi.lock("GpuInstanceGetComputeInstanceRemainingCapacity")
	defer gi.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return 0, r
	}
	p, r := gi.ciArg(info)
	if r != nvml.SUCCESS {
		return 0, r
	}
	return len(gi.ciFreeStarts(p.SliceCount)), nvml.SUCCESS
}

// CreateComputeInstance takes the first free placement.
func (gi *gpuInstance) CreateComputeInstance(info *nvml.ComputeInstanceProfileInfo) (nvml.ComputeInstance, nvml.Return) {
	r := gi.lock("GpuInstanceCreateComputeInstance")
	defer gi.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	p, r := gi.ciArg(info)
	if r != nvml.SUCCESS {
		return nil, r
	}
	free := gi.ciFreeStarts(p.SliceCount)
	if len(free) == 0 {
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	return gi.createCI("GpuInstanceCreateComputeInstance", p, free[0])
}

// CreateComputeInstanceWithPlacement follows the GPU instance rules.
func (gi *gpuInstance) CreateComputeInstanceWithPlacement(info *nvml.ComputeInstanceProfileInfo, pl *nvml.ComputeInstancePlacement) (nvml.ComputeInstance, nvml.Return) {
	r := gi.lock("GpuInstanceCreateComputeInstanceWithPlacement")
	defer gi.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	p, r := gi.ciArg(info)
	if r != nvml.SUCCESS {
		return nil, r
	}
	if pl == nil || pl.Size != p.SliceCount || !slices.Contains(ciStarts(p.SliceCount, gi.prof.slice), pl.Start) {
		return nil, nvml.ERROR_INVALID_ARGUMENT
	}
	if !slices.Contains(gi.ciFreeStarts(p.SliceCount), pl.Start) {
		return nil, nvml.ERROR_INSUFFICIENT_RESOURCES
	}
	return gi.createCI("GpuInstanceCreateComputeInstanceWithPlacement", p, pl.Start)
}

// createCI gives the compute instance the lowest free id from 0.
func (gi *gpuInstance) createCI(call string, p nvml.ComputeInstanceProfileInfo, start uint32) (nvml.ComputeInstance, nvml.Return) {
	id := 0
	for _, ci := range gi.cis { // ordered by id
		if ci.id == id {
			id++
		}
	}
	var ci *computeInstance
	if r := gi.n.mutate(gi.g, call, func() { ci = gi.addCI(id, p, start) }); r != nvml.SUCCESS {
		return nil, r
	}
	return ci, nvml.SUCCESS
}

// addCI makes compute instance id at start, which the caller checked is
// free; callers hold n.mu.
func (gi *gpuInstance) addCI(id int, p nvml.ComputeInstanceProfileInfo, start uint32) *computeInstance {
	ci := &computeInstance{
		mockComputeInstance: mockComputeInstance{&mock.ComputeInstance{}},
		gi:                  gi, id: id, prof: p,
		placement: nvml.ComputeInstancePlacement{Start: start, Size: p.SliceCount},
	}
	n := gi.n
	fillFuncs(ci.ComputeInstance, func(call string) nvml.Return {
		n.mu.Lock()
		defer n.mu.Unlock()
		if r := ci.check("ComputeInstance" + call); r != nvml.SUCCESS {
			return r
		}
		return nvml.ERROR_NOT_SUPPORTED
	})
	ci.dev = n.newDevice(gi.g, ci)
	gi.cis = append(gi.cis, ci)
	slices.SortFunc(gi.cis, func(a, b *computeInstance) int { return a.id - b.id })
	return ci
}

// GetComputeInstances lists the compute instances of one profile, by id.
func (gi *gpuInstance) GetComputeInstances(info *nvml.ComputeInstanceProfileInfo) ([]nvml.ComputeInstance, nvml.Return) {
	r := gi.lock("GpuInstanceGetComputeInstances")
	defer gi.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	p, r := gi.ciArg(info)
	if r != nvml.SUCCESS {
		return nil, r
	}
	out := []nvml.ComputeInstance{}
	for _, ci := range gi.cis {
		if ci.prof.Id == p.Id {
			out = append(out, ci)
		}
	}
	return out, nvml.SUCCESS
}

// GetComputeInstanceById returns ERROR_NOT_FOUND for ids not in use.
func (gi *gpuInstance) GetComputeInstanceById(id int) (nvml.ComputeInstance, nvml.Return) {
	r := gi.lock("GpuInstanceGetComputeInstanceById")
	defer gi.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nil, r
	}
	for _, ci := range gi.cis {
		if ci.id == id {
			return ci, nvml.SUCCESS
		}
	}
	return nil, nvml.ERROR_NOT_FOUND
}

// profileName is how users write the MIG device: the GI profile, prefixed
// with "<n>c." when the compute instance is smaller than its GPU instance.
func (ci *computeInstance) profileName() string {
	if ci.prof.SliceCount == ci.gi.prof.slice {
		return ci.gi.prof.name
	}
	return strconv.Itoa(int(ci.prof.SliceCount)) + "c." + ci.gi.prof.name
}

// check gates every compute instance call; callers hold n.mu. call is
// named as in gpuInstance.check.
func (ci *computeInstance) check(call string) nvml.Return {
	n := ci.gi.n
	if r := n.ready(); r != nvml.SUCCESS {
		return r
	}
	if r := n.injected(ci.gi.g, call); r != nvml.SUCCESS {
		return r
	}
	if ci.gi.g.lost {
		return nvml.ERROR_GPU_IS_LOST
	}
	if ci.destroyed {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return nvml.SUCCESS
}

// GetInfo describes the compute instance; Device is the parent GPU.
func (ci *computeInstance) GetInfo() (nvml.ComputeInstanceInfo, nvml.Return) {
	n := ci.gi.n
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := ci.check("ComputeInstanceGetInfo"); r != nvml.SUCCESS {
		return nvml.ComputeInstanceInfo{}, r
	}
	return nvml.ComputeInstanceInfo{
		Device: ci.gi.g.handle, GpuInstance: ci.gi, Id: uint32(ci.id), ProfileId: ci.prof.Id, Placement: ci.placement,
	}, nvml.SUCCESS
}

// Destroy fails with ERROR_IN_USE while processes run in the instance.
func (ci *computeInstance) Destroy() nvml.Return {
	n := ci.gi.n
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := ci.check("ComputeInstanceDestroy"); r != nvml.SUCCESS {
		return r
	}
	for _, p := range ci.gi.g.procs {
		if p.GpuInstanceId == uint32(ci.gi.id) && p.ComputeInstanceId == uint32(ci.id) {
			return nvml.ERROR_IN_USE
		}
	}
	return n.mutate(ci.gi.g, "ComputeInstanceDestroy", func() {
		ci.destroyed = true
		ci.gi.cis = slices.DeleteFunc(ci.gi.cis, func(x *computeInstance) bool { return x == ci })
	})
}

// destroyAll drops every instance, as a GPU reset does; callers hold n.mu.
func (g *gpuState) destroyAll() {
	for _, gi := range g.gis {
		for _, ci := range gi.cis {
			ci.destroyed = true
		}
		gi.cis = nil
		gi.destroyed = true
	}
	g.gis = nil
}
