package gpu_test

import (
	"fmt"
	"math/rand/v2"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// failingLib wraps an NVML (a simulated node) so that chosen calls on the
// handles it hands out fail. Calls are named by method, with "mig." for MIG
// device handles, "gi." for GPU instances and "ci." for compute instances:
// "GetMigMode", "mig.GetUUID", "gi.GetInfo".
type failingLib struct {
	nvml.Interface
	// gpus are the GPU indexes whose handles fail; nil: every GPU.
	gpus []int
	mu   sync.Mutex
	// fail answers, for each call made, the error it returns instead of
	// running (SUCCESS: it runs).
	fail func(call string) nvml.Return
}

func (l *failingLib) failed(call string) nvml.Return {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.fail(call)
}

// once fails the first call named call with ret, and nothing else.
func once(call string, ret nvml.Return) func(string) nvml.Return {
	done := false
	return func(c string) nvml.Return {
		if c != call || done {
			return nvml.SUCCESS
		}
		done = true
		return ret
	}
}

func (l *failingLib) DeviceGetHandleByIndex(i int) (nvml.Device, nvml.Return) {
	d, ret := l.Interface.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS || (l.gpus != nil && !slices.Contains(l.gpus, i)) {
		return d, ret
	}
	return &failingDevice{Device: d, l: l}, ret
}

// failingDevice is a GPU handle, or with mig set a MIG device handle.
type failingDevice struct {
	nvml.Device
	l   *failingLib
	mig bool
}

func (d *failingDevice) failed(name string) nvml.Return {
	if d.mig {
		name = "mig." + name
	}
	return d.l.failed(name)
}

func (d *failingDevice) GetUUID() (string, nvml.Return) {
	if r := d.failed("GetUUID"); r != nvml.SUCCESS {
		return "", r
	}
	return d.Device.GetUUID()
}

func (d *failingDevice) GetMemoryInfo() (nvml.Memory, nvml.Return) {
	if r := d.failed("GetMemoryInfo"); r != nvml.SUCCESS {
		return nvml.Memory{}, r
	}
	return d.Device.GetMemoryInfo()
}

func (d *failingDevice) GetCudaComputeCapability() (int, int, nvml.Return) {
	if r := d.failed("GetCudaComputeCapability"); r != nvml.SUCCESS {
		return 0, 0, r
	}
	return d.Device.GetCudaComputeCapability()
}

func (d *failingDevice) GetNumaNodeId() (int, nvml.Return) {
	if r := d.failed("GetNumaNodeId"); r != nvml.SUCCESS {
		return 0, r
	}
	return d.Device.GetNumaNodeId()
}

// GetMigMode fails the way the driver does: zero modes with the error.
func (d *failingDevice) GetMigMode() (int, int, nvml.Return) {
	if r := d.failed("GetMigMode"); r != nvml.SUCCESS {
		return 0, 0, r
	}
	return d.Device.GetMigMode()
}

func (d *failingDevice) GetMaxMigDeviceCount() (int, nvml.Return) {
	if r := d.failed("GetMaxMigDeviceCount"); r != nvml.SUCCESS {
		return 0, r
	}
	return d.Device.GetMaxMigDeviceCount()
}

func (d *failingDevice) GetMigDeviceHandleByIndex(k int) (nvml.Device, nvml.Return) {
	if r := d.failed("GetMigDeviceHandleByIndex"); r != nvml.SUCCESS {
		return nil, r
	}
	m, ret := d.Device.GetMigDeviceHandleByIndex(k)
	if ret != nvml.SUCCESS {
		return m, ret
	}
	return &failingDevice{Device: m, l: d.l, mig: true}, ret
}

func (d *failingDevice) GetGpuInstanceId() (int, nvml.Return) {
	if r := d.failed("GetGpuInstanceId"); r != nvml.SUCCESS {
		return 0, r
	}
	return d.Device.GetGpuInstanceId()
}

func (d *failingDevice) GetComputeInstanceId() (int, nvml.Return) {
	if r := d.failed("GetComputeInstanceId"); r != nvml.SUCCESS {
		return 0, r
	}
	return d.Device.GetComputeInstanceId()
}

func (d *failingDevice) GetGpuInstanceProfileInfo(p int) (nvml.GpuInstanceProfileInfo, nvml.Return) {
	if r := d.failed("GetGpuInstanceProfileInfo"); r != nvml.SUCCESS {
		return nvml.GpuInstanceProfileInfo{}, r
	}
	return d.Device.GetGpuInstanceProfileInfo(p)
}

func (d *failingDevice) GetGpuInstanceById(id int) (nvml.GpuInstance, nvml.Return) {
	if r := d.failed("GetGpuInstanceById"); r != nvml.SUCCESS {
		return nil, r
	}
	gi, ret := d.Device.GetGpuInstanceById(id)
	if ret != nvml.SUCCESS {
		return gi, ret
	}
	return &failingGI{GpuInstance: gi, l: d.l}, ret
}

func (d *failingDevice) GetGpuInstances(info *nvml.GpuInstanceProfileInfo) ([]nvml.GpuInstance, nvml.Return) {
	if r := d.failed("GetGpuInstances"); r != nvml.SUCCESS {
		return nil, r
	}
	gis, ret := d.Device.GetGpuInstances(info)
	out := make([]nvml.GpuInstance, len(gis))
	for i, gi := range gis {
		out[i] = &failingGI{GpuInstance: gi, l: d.l}
	}
	return out, ret
}

// GetTopologyCommonAncestor hands the simulator its own handle: it tells
// GPUs apart by handle.
func (d *failingDevice) GetTopologyCommonAncestor(other nvml.Device) (nvml.GpuTopologyLevel, nvml.Return) {
	if o, ok := other.(*failingDevice); ok {
		other = o.Device
	}
	return d.Device.GetTopologyCommonAncestor(other)
}

type failingGI struct {
	nvml.GpuInstance
	l *failingLib
}

func (gi *failingGI) GetInfo() (nvml.GpuInstanceInfo, nvml.Return) {
	if r := gi.l.failed("gi.GetInfo"); r != nvml.SUCCESS {
		return nvml.GpuInstanceInfo{}, r
	}
	return gi.GpuInstance.GetInfo()
}

func (gi *failingGI) GetComputeInstanceById(id int) (nvml.ComputeInstance, nvml.Return) {
	if r := gi.l.failed("gi.GetComputeInstanceById"); r != nvml.SUCCESS {
		return nil, r
	}
	ci, ret := gi.GpuInstance.GetComputeInstanceById(id)
	if ret != nvml.SUCCESS {
		return ci, ret
	}
	return &failingCI{ComputeInstance: ci, l: gi.l}, ret
}

func (gi *failingGI) GetComputeInstanceProfileInfo(p, eng int) (nvml.ComputeInstanceProfileInfo, nvml.Return) {
	if r := gi.l.failed("gi.GetComputeInstanceProfileInfo"); r != nvml.SUCCESS {
		return nvml.ComputeInstanceProfileInfo{}, r
	}
	return gi.GpuInstance.GetComputeInstanceProfileInfo(p, eng)
}

func (gi *failingGI) GetComputeInstances(info *nvml.ComputeInstanceProfileInfo) ([]nvml.ComputeInstance, nvml.Return) {
	if r := gi.l.failed("gi.GetComputeInstances"); r != nvml.SUCCESS {
		return nil, r
	}
	return gi.GpuInstance.GetComputeInstances(info)
}

type failingCI struct {
	nvml.ComputeInstance
	l *failingLib
}

func (ci *failingCI) GetInfo() (nvml.ComputeInstanceInfo, nvml.Return) {
	if r := ci.l.failed("ci.GetInfo"); r != nvml.SUCCESS {
		return nvml.ComputeInstanceInfo{}, r
	}
	return ci.ComputeInstance.GetInfo()
}

// simNode starts a simulated node and stops it with the test.
func simNode(t *testing.T, profile string, opts ...sim.Option) *sim.Node {
	t.Helper()
	n, err := sim.New(profile, opts...)
	if err != nil {
		t.Fatal(err)
	}
	if r := n.Init(); r != nvml.SUCCESS {
		t.Fatal(r)
	}
	t.Cleanup(func() { n.Shutdown() })
	return n
}

type giSpec struct {
	profile, start int
	ciSlices       []uint32
}

// partition gives GPU i of n GPU instances (profile index and start), each
// split into compute instances of ciSlices (none: a GPU instance without a
// compute instance).
func partition(t *testing.T, n *sim.Node, i int, gis ...giSpec) {
	t.Helper()
	dev, ret := n.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	for _, spec := range gis {
		info, ret := dev.GetGpuInstanceProfileInfo(spec.profile)
		if ret != nvml.SUCCESS {
			t.Fatalf("profile %d: %v", spec.profile, ret)
		}
		pls, ret := dev.GetGpuInstancePossiblePlacements(&info)
		if ret != nvml.SUCCESS || len(pls) == 0 {
			t.Fatalf("profile %d placements: %v", spec.profile, ret)
		}
		pl := nvml.GpuInstancePlacement{Start: uint32(spec.start), Size: pls[0].Size}
		gi, ret := dev.CreateGpuInstanceWithPlacement(&info, &pl)
		if ret != nvml.SUCCESS {
			t.Fatalf("profile %d at %d: %v", spec.profile, spec.start, ret)
		}
		for _, want := range spec.ciSlices {
			made := false
			for p := range nvml.COMPUTE_INSTANCE_PROFILE_COUNT {
				ci, ret := gi.GetComputeInstanceProfileInfo(p, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
				if ret == nvml.SUCCESS && ci.SliceCount == want {
					if _, ret := gi.CreateComputeInstance(&ci); ret != nvml.SUCCESS {
						t.Fatalf("compute instance of %d slices: %v", want, ret)
					}
					made = true
					break
				}
			}
			if !made {
				t.Fatalf("no compute instance profile of %d slices", want)
			}
		}
	}
}

// partitionedA100 is a dgx-a100 whose GPU 0 holds a 2g.10gb split into two
// 1c.2g.10gb MIG devices, a 3g.20gb, a 1g.5gb, and a 1g.5gb GPU instance
// without a compute instance: four MIG devices in seven slots.
func partitionedA100(t *testing.T) *sim.Node {
	n := simNode(t, "dgx-a100", sim.WithMIGEnabled())
	partition(t, n, 0,
		giSpec{nvml.GPU_INSTANCE_PROFILE_2_SLICE, 0, []uint32{1, 1}},
		giSpec{nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, []uint32{3}},
		giSpec{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 2, []uint32{1}},
		giSpec{nvml.GPU_INSTANCE_PROFILE_1_SLICE, 3, nil},
	)
	return n
}

func TestNewSeesGPUInstancesWithoutCI(t *testing.T) {
	n := partitionedA100(t)
	inv, err := gpu.New(n, gpu.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.Errors) != 0 {
		t.Fatalf("errors %v", inv.Errors)
	}
	g := inv.GPUs[0]
	var got []string
	for _, in := range g.Instances {
		got = append(got, fmt.Sprintf("%s@%d gi %d", in.Profile, in.Placement.Start, in.GI))
	}
	if want := []string{"1c.2g.10gb@0 gi 1", "1c.2g.10gb@0 gi 1", "3g.20gb@4 gi 2", "1g.5gb@2 gi 3"}; !slices.Equal(got, want) {
		t.Errorf("instances %v, want %v", got, want)
	}
	want := []gpu.GPUInstance{{GI: 4, Profile: "1g.5gb", GIProfileID: nvml.GPU_INSTANCE_PROFILE_1_SLICE, Placement: gpu.Placement{Start: 3, Size: 1}}}
	if !reflect.DeepEqual(g.GIsWithoutCI, want) {
		t.Errorf("GIsWithoutCI = %+v, want %+v", g.GIsWithoutCI, want)
	}
	if g.Unread != nil {
		t.Errorf("complete read has Unread %v", g.Unread)
	}
	for _, other := range inv.GPUs[1:] {
		if other.GIsWithoutCI != nil || other.Instances != nil {
			t.Errorf("gpu %d: %+v %+v", other.Index, other.Instances, other.GIsWithoutCI)
		}
	}
}

// TestNewOneFailedCall fails one NVML call while GPU 0 of partitionedA100
// is read. A failure must never pass for an answer: the GPU either reads as
// before or names, in Unread, every fact the failure left unknown, so that
// the agent keeps its last record of them instead of, say, advertising a
// partitioned GPU as a whole one. NOT_SUPPORTED is an answer and marks
// nothing.
func TestNewOneFailedCall(t *testing.T) {
	const (
		mode = gpu.FactMIGMode
		ins  = gpu.FactInstances
		bare = gpu.FactGIsWithoutCI
	)
	tests := []struct {
		call string
		ret  nvml.Return
		// want are the facts left unread (nil: none, and no error).
		want []gpu.Fact
		// instances and bare are how many MIG devices and GPU instances
		// without a compute instance the GPU then lists.
		instances, bare int
		// check, if set, looks further at the GPU.
		check func(t *testing.T, g gpu.GPU)
	}{
		{call: "GetMigMode", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{mode, ins, bare}, check: func(t *testing.T, g gpu.GPU) {
			if g.MIGCapable || g.MIG.Current || !g.MIGUnknown() {
				t.Errorf("MIG %v/%+v, MIGUnknown %v: want zero values marked unknown", g.MIGCapable, g.MIG, g.MIGUnknown())
			}
		}},
		{call: "GetMigMode", ret: nvml.ERROR_TIMEOUT, want: []gpu.Fact{mode, ins, bare}},
		{call: "GetMaxMigDeviceCount", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, bare: 1},
		{call: "GetMigDeviceHandleByIndex", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		{call: "GetMigDeviceHandleByIndex", ret: nvml.ERROR_NOT_SUPPORTED, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		{call: "GetMigDeviceHandleByIndex", ret: nvml.ERROR_INSUFFICIENT_RESOURCES, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		{call: "mig.GetUUID", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		{call: "mig.GetGpuInstanceId", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		{call: "mig.GetComputeInstanceId", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		{call: "GetGpuInstanceById", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		{call: "gi.GetInfo", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		// The first profile asked for is 1g.5gb: the 1g.5gb MIG device
		// cannot be named and the walk for bare GPU instances misses it.
		{call: "GetGpuInstanceProfileInfo", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins, bare}, instances: 3},
		{call: "gi.GetComputeInstanceById", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		{call: "ci.GetInfo", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		{call: "gi.GetComputeInstanceProfileInfo", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, instances: 3, bare: 1},
		// The size falls back to the profile's, but it is not what was read.
		{call: "mig.GetMemoryInfo", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{ins}, instances: 4, bare: 1},
		{call: "GetGpuInstances", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{bare}, instances: 4},
		{call: "gi.GetComputeInstances", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{bare}, instances: 4},
		{call: "GetCudaComputeCapability", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{gpu.FactComputeCapability}, instances: 4, bare: 1},
		{call: "GetNumaNodeId", ret: nvml.ERROR_UNKNOWN, want: []gpu.Fact{gpu.FactNUMANode}, instances: 4, bare: 1},

		// Answers, not failures.
		{call: "GetMigMode", ret: nvml.ERROR_NOT_SUPPORTED, check: func(t *testing.T, g gpu.GPU) {
			if g.MIGCapable || g.MIGUnknown() {
				t.Errorf("NOT_SUPPORTED: MIGCapable %v, MIGUnknown %v; want a GPU without MIG", g.MIGCapable, g.MIGUnknown())
			}
		}},
		{call: "GetMaxMigDeviceCount", ret: nvml.ERROR_NOT_SUPPORTED, bare: 1},
		{call: "mig.GetMemoryInfo", ret: nvml.ERROR_NOT_SUPPORTED, instances: 4, bare: 1},
		{call: "GetCudaComputeCapability", ret: nvml.ERROR_NOT_SUPPORTED, instances: 4, bare: 1},
		{call: "GetNumaNodeId", ret: nvml.ERROR_NOT_SUPPORTED, instances: 4, bare: 1},
	}
	for _, tt := range tests {
		t.Run(tt.call+" "+tt.ret.Error(), func(t *testing.T) {
			n := partitionedA100(t)
			before, err := gpu.New(n, gpu.Options{})
			if err != nil || len(before.Errors) != 0 {
				t.Fatalf("clean read: %v %v", err, before.Errors)
			}
			lib := &failingLib{Interface: n, gpus: []int{0}, fail: once(tt.call, tt.ret)}
			inv, err := gpu.New(lib, gpu.Options{})
			if err != nil {
				t.Fatal(err)
			}
			g, ok := inv.GPUByUUID(before.GPUs[0].UUID)
			if !ok {
				t.Fatalf("GPU left out: %v", inv.Errors)
			}
			if !slices.Equal(g.Unread, tt.want) {
				t.Errorf("Unread = %v, want %v (errors %v)", g.Unread, tt.want, inv.Errors)
			}
			if len(g.Instances) != tt.instances || len(g.GIsWithoutCI) != tt.bare {
				t.Errorf("%d instances and %d bare GPU instances, want %d and %d", len(g.Instances), len(g.GIsWithoutCI), tt.instances, tt.bare)
			}
			if tt.want == nil && len(inv.Errors) > 0 {
				t.Errorf("an answer recorded as an error: %v", inv.Errors)
			}
			if tt.want != nil {
				if len(inv.Errors) == 0 {
					t.Fatal("failure not recorded")
				}
				for _, e := range inv.Errors {
					if e.Index != 0 || e.UUID != g.UUID || !strings.Contains(e.Error(), tt.ret.Error()) {
						t.Errorf("error %q does not name the GPU and the failure", e.Error())
					}
				}
			}
			// What was read is right as far as it goes.
			for _, in := range g.Instances {
				if !slices.ContainsFunc(before.GPUs[0].Instances, func(b gpu.MIGInstance) bool {
					return b.UUID == in.UUID && b.Profile == in.Profile && b.Placement == in.Placement
				}) {
					t.Errorf("instance %+v was not there", in)
				}
			}
			for _, other := range inv.GPUs[1:] {
				if other.Unread != nil {
					t.Errorf("gpu %d marked %v", other.Index, other.Unread)
				}
			}
			if tt.check != nil {
				tt.check(t, g)
			}
		})
	}
}

// TestNewFlakyNVMLNeverReadsWrong reads a MIG node many times with 2% of
// the calls on every handle failing (seeded, so every run sees the same
// failures): each GPU is either left out and named in Errors, or equal to
// the clean read in every fact its Unread does not name.
func TestNewFlakyNVMLNeverReadsWrong(t *testing.T) {
	n := simNode(t, "dgx-h100-mig")
	// A GPU instance without a compute instance on GPU 3 (all slices of
	// the others are taken).
	dev, _ := n.DeviceGetHandleByIndex(3)
	mig, ret := dev.GetMigDeviceHandleByIndex(6)
	if ret != nvml.SUCCESS {
		t.Fatal(ret)
	}
	giID, _ := mig.GetGpuInstanceId()
	ciID, _ := mig.GetComputeInstanceId()
	gi, _ := dev.GetGpuInstanceById(giID)
	ci, _ := gi.GetComputeInstanceById(ciID)
	if r := ci.Destroy(); r != nvml.SUCCESS {
		t.Fatal(r)
	}
	clean, err := gpu.New(n, gpu.Options{})
	if err != nil || len(clean.Errors) != 0 || len(clean.GPUs[3].GIsWithoutCI) != 1 {
		t.Fatalf("clean read: %v %v %+v", err, clean.Errors, clean.GPUs[3].GIsWithoutCI)
	}

	const snapshots = 60
	marked, leftOut := 0, 0
	for seed := range uint64(snapshots) {
		rng := rand.New(rand.NewPCG(seed, 2))
		lib := &failingLib{Interface: n, fail: func(string) nvml.Return {
			if rng.IntN(50) == 0 {
				return nvml.ERROR_UNKNOWN
			}
			return nvml.SUCCESS
		}}
		inv, err := gpu.New(lib, gpu.Options{})
		if err != nil {
			t.Fatal(err)
		}
		for _, want := range clean.GPUs {
			g, ok := inv.GPUByUUID(want.UUID)
			if !ok {
				leftOut++
				if !slices.ContainsFunc(inv.Errors, func(e gpu.DeviceError) bool { return e.Index == want.Index }) {
					t.Errorf("seed %d: gpu %d left out without an error", seed, want.Index)
				}
				continue
			}
			if g.Unread != nil {
				marked++
			}
			if bad := unmarkedDifferences(g, want); len(bad) > 0 {
				t.Errorf("seed %d: gpu %d differs from the clean read in %v, Unread %v (errors %v)", seed, g.Index, bad, g.Unread, inv.Errors)
			}
		}
	}
	// The failure rate must have reached the MIG reads, or nothing was tested.
	if marked == 0 {
		t.Fatalf("no GPU was marked in %d snapshots", snapshots)
	}
	t.Logf("%d GPU reads marked partial, %d left out, of %d", marked, leftOut, snapshots*len(clean.GPUs))
}

// unmarkedDifferences lists the fields in which g differs from the clean
// read want without Unread saying so.
func unmarkedDifferences(g, want gpu.GPU) []string {
	var bad []string
	differs := func(field string, same bool, facts ...gpu.Fact) {
		if !same && !g.Unknown(facts...) {
			bad = append(bad, field)
		}
	}
	differs("ComputeCapability", g.ComputeCapability == want.ComputeCapability, gpu.FactComputeCapability)
	differs("NUMANode", g.NUMANode == want.NUMANode, gpu.FactNUMANode)
	differs("Brand", g.Brand == want.Brand, gpu.FactBrand)
	differs("MIG mode", g.MIGCapable == want.MIGCapable && g.MIG == want.MIG, gpu.FactMIGMode)
	differs("Instances", reflect.DeepEqual(g.Instances, want.Instances), gpu.FactMIGMode, gpu.FactInstances)
	differs("GIsWithoutCI", reflect.DeepEqual(g.GIsWithoutCI, want.GIsWithoutCI), gpu.FactMIGMode, gpu.FactGIsWithoutCI)
	rest, wantRest := g, want
	for _, x := range []*gpu.GPU{&rest, &wantRest} {
		x.ComputeCapability, x.NUMANode, x.Brand, x.MIGCapable, x.MIG = gpu.ComputeCapability{}, 0, "", false, gpu.MIGMode{}
		x.Instances, x.GIsWithoutCI, x.Unread = nil, nil, nil
		// Without sysfs the PCIe root is derived from the topology, which a
		// failed pair read or a GPU left out changes, as it changes Topology.
		x.PCIeRoot = ""
	}
	differs("identity", reflect.DeepEqual(rest, wantRest))
	return bad
}
