package devicemodel

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/util/validation"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/mig"
)

// inventory is a simulated node's inventory.
func inventory(t *testing.T, profile string, opts ...sim.Option) *gpu.Inventory {
	t.Helper()
	_, inv := simtest.NodeInventory(t, profile, opts...)
	return inv
}

func TestDevicesFromInventory(t *testing.T) {
	whole := inventory(t, "dgx-a100")
	migged := inventory(t, "dgx-h100-mig")
	switching := inventory(t, "pcie-4gpu")
	switching.GPUs[1].MIG.Pending = true // a mode change waiting for a reset
	unknown := inventory(t, "pcie-4gpu")
	unknown.GPUs[2].Unread = []gpu.Fact{gpu.FactMIGMode}

	tests := []struct {
		name      string
		inv       *gpu.Inventory
		unhealthy map[string]string
		want      int
		check     func(t *testing.T, ds []Device)
	}{
		{name: "whole GPUs", inv: whole, want: 8, check: func(t *testing.T, ds []Device) {
			d := ds[0]
			if d.Name != "gpu-0" || d.Type != TypeGPU || d.UUID != whole.GPUs[0].UUID || d.Architecture != "Ampere" ||
				d.CC != (gpu.ComputeCapability{Major: 8}) || d.MemoryBytes != whole.GPUs[0].MemoryBytes || d.DriverVersion == "" {
				t.Errorf("gpu-0: %+v", d)
			}
			if d.CDIDevice() != "nvidia.com/gpu="+whole.GPUs[0].UUID {
				t.Errorf("CDI device %q", d.CDIDevice())
			}
		}},
		{name: "MIG devices, not their GPUs", inv: migged, want: 56, check: func(t *testing.T, ds []Device) {
			for _, d := range ds {
				if d.Type != TypeMIG || d.Profile != "1g.10gb" || d.ParentUUID == "" || !strings.HasPrefix(d.UUID, "MIG-") ||
					!strings.HasPrefix(d.Name, fmt.Sprintf("gpu-%d-mig-", d.ParentIndex)) {
					t.Fatalf("MIG device %+v", d)
				}
			}
		}},
		{name: "unhealthy marked, a MIG device by its GPU", inv: migged, unhealthy: map[string]string{migged.GPUs[3].UUID: "XID 79"}, want: 56,
			check: func(t *testing.T, ds []Device) {
				bad := 0
				for _, d := range ds {
					if d.Unhealthy != "" {
						bad++
						if d.ParentIndex != 3 || d.Unhealthy != "XID 79" {
							t.Errorf("unhealthy %+v", d)
						}
					}
				}
				if bad != 7 {
					t.Errorf("%d unhealthy, want GPU 3's 7", bad)
				}
			}},
		{name: "a GPU changing MIG mode is neither", inv: switching, want: 3, check: func(t *testing.T, ds []Device) {
			if slices.ContainsFunc(ds, func(d Device) bool { return d.Name == "gpu-1" }) {
				t.Errorf("gpu-1 offered while its MIG mode changes")
			}
		}},
		{name: "a GPU whose MIG mode is unread is neither", inv: unknown, want: 3},
		{name: "no inventory", inv: nil, want: 0},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ds := Devices(tt.inv, nil, tt.unhealthy)
			if len(ds) != tt.want {
				t.Fatalf("%d devices, want %d", len(ds), tt.want)
			}
			if !slices.IsSortedFunc(ds, func(a, b Device) int { return strings.Compare(a.Name, b.Name) }) {
				t.Errorf("not sorted by name")
			}
			if tt.check != nil {
				tt.check(t, ds)
			}
		})
	}
}

func TestResources(t *testing.T) {
	inv := inventory(t, "dgx-h100-mig")
	pool := &Pool{Devices: Devices(inv, nil, map[string]string{inv.GPUs[0].Instances[0].UUID: "XID 48"})}
	for _, taints := range []bool{true, false} {
		res := Resources("node-a", pool, 3, Dropped{Taints: !taints})
		p, ok := res.Pools["node-a"]
		if !ok || p.Generation != 3 || len(p.Slices) != 1 {
			t.Fatalf("pools %+v", res.Pools)
		}
		devs := p.Slices[0].Devices
		want := 56
		if !taints {
			want = 55
		}
		if len(devs) != want {
			t.Errorf("taints=%v: %d devices, want %d", taints, len(devs), want)
		}
		tainted := 0
		for _, d := range devs {
			if len(d.Taints) > 0 {
				tainted++
				if d.Taints[0].Key != TaintUnhealthy || d.Taints[0].Effect != resourceapi.DeviceTaintEffectNoSchedule {
					t.Errorf("taint %+v", d.Taints)
				}
			}
		}
		if tainted != want-55 {
			t.Errorf("taints=%v: %d tainted devices", taints, tainted)
		}
	}
	d := apiDevice(pool.Devices[1])
	attr := func(name string) resourceapi.DeviceAttribute { return d.Attributes[resourceapi.QualifiedName(name)] }
	if *attr("type").StringValue != "mig" || *attr("profile").StringValue != "1g.10gb" || *attr("parentUUID").StringValue != inv.GPUs[0].UUID ||
		*attr("productName").StringValue != inv.GPUs[0].Name || *attr("cudaComputeCapability").VersionValue != "9.0.0" ||
		*attr("architecture").StringValue != "Hopper" || attr("driverVersion").VersionValue == nil || *attr(string(AttrPCIBusID)).StringValue != inv.GPUs[0].PCIBusID {
		t.Errorf("attributes %+v", d.Attributes)
	}
	if q := d.Capacity["memory"].Value; q.Value() != int64(pool.Devices[1].MemoryBytes) {
		t.Errorf("memory capacity %s", q.String())
	}
}

// A device on a cordoned GPU carries a taint of its own, TaintCordoned,
// always NoSchedule (a cordon never evicts), not the unhealthy one; a
// device both unhealthy and cordoned carries both; where the API server
// drops taints it is left out; the health stream says it is cordoned
// (issue 29, defect 4b).
func TestResourcesCordoned(t *testing.T) {
	ns, nx := resourceapi.DeviceTaintEffectNoSchedule, resourceapi.DeviceTaintEffectNoExecute
	for _, tt := range []struct {
		name      string
		unhealthy string
		evict     bool
		cordoned  string
		want      []resourceapi.DeviceTaint
	}{
		{name: "healthy"},
		{name: "unhealthy", unhealthy: "XID 48", want: []resourceapi.DeviceTaint{{Key: TaintUnhealthy, Effect: ns}}},
		{name: "cordoned", cordoned: "cordoned", want: []resourceapi.DeviceTaint{{Key: TaintCordoned, Effect: ns}}},
		{name: "unhealthy, evicting, and cordoned", unhealthy: "XID 48", evict: true, cordoned: "cordoned",
			want: []resourceapi.DeviceTaint{{Key: TaintUnhealthy, Effect: nx}, {Key: TaintCordoned, Effect: ns}}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			d := apiDevice(Device{Name: "gpu-0", Type: TypeGPU, UUID: "GPU-0", Unhealthy: tt.unhealthy, Evict: tt.evict, Cordoned: tt.cordoned})
			if !slices.Equal(d.Taints, tt.want) {
				t.Errorf("taints %+v, want %+v", d.Taints, tt.want)
			}
		})
	}

	pool := &Pool{Devices: []Device{{Name: "gpu-0", Type: TypeGPU, UUID: "GPU-0"}, {Name: "gpu-1", Type: TypeGPU, UUID: "GPU-1", Index: 1, Cordoned: "cordoned"}}}
	var got []string
	for _, s := range Resources("node-a", pool, 1, Dropped{Taints: true}).Pools["node-a"].Slices {
		for _, d := range s.Devices {
			got = append(got, d.Name)
		}
	}
	if !slices.Equal(got, []string{"gpu-0"}) {
		t.Errorf("without taints the API server is given %v, want gpu-0 only", got)
	}
}

// A shared device: allowMultipleAllocations, and a "shares" capacity a
// claim takes one of by default, up to all of them.
func TestResourcesSharedDevice(t *testing.T) {
	d := apiDevice(Device{Name: "gpu-0", Type: TypeGPU, UUID: "GPU-0", Shares: 4, MemoryBytes: 1 << 30})
	c, ok := d.Capacity[CapacityShares]
	if d.AllowMultipleAllocations == nil || !*d.AllowMultipleAllocations || !ok || c.Value.Value() != 4 || c.RequestPolicy == nil ||
		c.RequestPolicy.Default.Value() != 1 || c.RequestPolicy.ValidRange.Min.Value() != 1 || c.RequestPolicy.ValidRange.Max.Value() != 4 {
		t.Errorf("shared device: %+v", d)
	}
	// Memory is shared too: a claim takes none of it unless it asks (else the first would take it all).
	if m := d.Capacity["memory"]; m.RequestPolicy == nil || m.RequestPolicy.Default.Value() != 0 {
		t.Errorf("shared device's memory policy: %+v", m)
	}
	// MPS: the memory is pinned per client, an equal part by default, in whole MiB.
	mpsDev := apiDevice(Device{Name: "gpu-0", Type: TypeGPU, UUID: "GPU-0", Shares: 3, MPS: true, MemoryBytes: 1 << 30})
	if m := mpsDev.Capacity["memory"]; m.RequestPolicy == nil || m.RequestPolicy.Default.Value() != 341<<20 ||
		m.RequestPolicy.ValidRange.Min.Value() != 1<<20 || m.RequestPolicy.ValidRange.Step.Value() != 1<<20 {
		t.Errorf("MPS device's memory policy: %+v", m.RequestPolicy)
	}
	if e := apiDevice(Device{Name: "gpu-2", Type: TypeGPU, UUID: "GPU-2", Unhealthy: "XID 79", Evict: true}); len(e.Taints) != 1 || e.Taints[0].Effect != resourceapi.DeviceTaintEffectNoExecute {
		t.Errorf("evicting taint: %+v", e.Taints)
	}
	if e := apiDevice(Device{Name: "gpu-1", Type: TypeGPU, UUID: "GPU-1"}); e.AllowMultipleAllocations != nil || len(e.Capacity) != 1 {
		t.Errorf("exclusive device: %+v", e)
	}
}

// An MPS device's memory policy is one the API server accepts, or none: a
// policy it rejects takes the whole ResourceSlice with it.
func TestMPSMemoryPolicy(t *testing.T) {
	const mib = 1 << 20
	tests := []struct {
		name   string
		memory uint64
		shares int
		// want is the default part per claim; 0: no policy (a claim takes all
		// of the memory unless it asks for less).
		want int64
	}{
		{name: "1 GiB in 3", memory: 1 << 30, shares: 3, want: 341 * mib},
		{name: "80 GiB in 7", memory: 80 << 30, shares: 7, want: 11702 * mib},
		{name: "exactly 1 MiB each", memory: 2 * mib, shares: 2, want: mib},
		{name: "a part rounded down to 1 MiB", memory: 3*mib - 1, shares: 2, want: mib},
		{name: "a part just under 1 MiB", memory: 2*mib - 1, shares: 2},
		{name: "less than 1 MiB in all", memory: 512 << 10, shares: 2},
		{name: "more shares than MiB", memory: 100 * mib, shares: 101},
		{name: "no memory known", memory: 0, shares: 4},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			d := apiDevice(Device{Name: "gpu-0", Type: TypeGPU, UUID: "GPU-0", Shares: tt.shares, MPS: true, MemoryBytes: tt.memory})
			mem, ok := d.Capacity["memory"]
			if !ok || mem.Value.Value() != int64(tt.memory) {
				t.Fatalf("memory capacity %+v, want %d", mem, tt.memory)
			}
			if tt.want == 0 {
				if mem.RequestPolicy != nil {
					t.Errorf("policy %+v, want none", mem.RequestPolicy)
				}
				return
			}
			if mem.RequestPolicy == nil || mem.RequestPolicy.Default.Value() != tt.want {
				t.Fatalf("policy %+v, want default %d", mem.RequestPolicy, tt.want)
			}
			if err := validRangePolicy(mem); err != nil {
				t.Error(err)
			}
		})
	}
}

// validRangePolicy checks a capacity's range policy as the API server does
// (k8s.io/api resource/v1 CapacityRequestPolicyRange).
func validRangePolicy(c resourceapi.DeviceCapacity) error {
	p := c.RequestPolicy
	if p.Default == nil || p.ValidRange == nil || p.ValidRange.Min == nil {
		return fmt.Errorf("policy %+v: default and min are required", p)
	}
	capacity, def, lo := c.Value.Value(), p.Default.Value(), p.ValidRange.Min.Value()
	switch {
	case lo < 0 || lo > capacity:
		return fmt.Errorf("min %d outside 0..capacity %d", lo, capacity)
	case def < lo:
		return fmt.Errorf("default %d below min %d", def, lo)
	case p.ValidRange.Max != nil && (def > p.ValidRange.Max.Value() || p.ValidRange.Max.Value() > capacity):
		return fmt.Errorf("default %d or capacity %d against max %d", def, capacity, p.ValidRange.Max.Value())
	}
	if p.ValidRange.Step != nil {
		step := p.ValidRange.Step.Value()
		if step <= 0 || lo+step > capacity || (def-lo)%step != 0 {
			return fmt.Errorf("step %d: min %d + step beyond capacity %d, or default %d not min plus steps", step, lo, capacity, def)
		}
	}
	return nil
}

func TestSemver(t *testing.T) {
	for in, want := range map[string]string{"550.54.15": "550.54.15", "535.104": "535.104.0", "": "", "abc": "", "570": ""} {
		got, ok := semver(in)
		if got != want || ok != (want != "") {
			t.Errorf("semver(%q) = %q, %v; want %q", in, got, ok, want)
		}
	}
}

// A node whose GPUs all make MIG devices on demand: counter sets in slices
// of their own, at most 8 each; counting devices at most 64 per slice; every
// device's consumption names its own GPU's set.
func TestResourcesPartitionable(t *testing.T) {
	n, inv := simtest.NodeInventory(t, "dgx-h100")
	profiles := simtest.Profiles(t, n, inv.GPUs[0])
	pool := &Pool{}
	for _, g := range append(slices.Clone(inv.GPUs), inv.GPUs...) { // 16 GPUs' worth
		devs, set := Partitions(Dynamic{GPU: g, Profiles: profiles, Whole: true}, Device{ProductName: g.Name})
		pool.Devices = append(pool.Devices, devs...)
		pool.CounterSets = append(pool.CounterSets, set)
	}
	res := Resources("node-a", pool, 1, Dropped{}).Pools["node-a"].Slices
	var counterSlices, devices int
	for i, s := range res {
		if len(s.SharedCounters) > 0 && len(s.Devices) > 0 {
			t.Errorf("slice %d has both counters and devices", i)
		}
		if len(s.SharedCounters) > 8 || len(s.Devices) > 64 {
			t.Errorf("slice %d: %d counter sets, %d devices", i, len(s.SharedCounters), len(s.Devices))
		}
		if len(s.SharedCounters) > 0 {
			counterSlices++
		}
		for _, d := range s.Devices {
			devices++
			if len(d.ConsumesCounters) != 1 || !strings.HasPrefix(d.ConsumesCounters[0].CounterSet, "gpu-") {
				t.Errorf("device %s consumes %+v", d.Name, d.ConsumesCounters)
			}
		}
	}
	// Each GPU's devices in one slice; a profile's placements from the top down (the scheduler takes the
	// first that fits).
	where := map[string][2]int{}
	for i, s := range res {
		for j, d := range s.Devices {
			where[d.Name] = [2]int{i, j}
		}
	}
	for idx := range 8 {
		first := where[fmt.Sprintf("gpu-%d", idx)][0]
		for name, at := range where {
			if strings.HasPrefix(name, fmt.Sprintf("gpu-%d-", idx)) && at[0] != first {
				t.Errorf("GPU %d's devices span slices %d and %d", idx, first, at[0])
			}
		}
	}
	if hi, lo := where["gpu-0-mig-1g10gb-6"], where["gpu-0-mig-1g10gb-0"]; hi[1] >= lo[1] {
		t.Errorf("1g.10gb at 6 is published at %d, after the one at 0 (%d)", hi[1], lo[1])
	}
	// Per H100, whole and 19 partitions: 1g.10gb+me, of which one fits,
	// at its last placement only.
	if counterSlices != 2 || devices != 16*20 {
		t.Errorf("%d counter slices, %d devices; want 2 and %d", counterSlices, devices, 16*20)
	}
	whole := pool.Devices[slices.IndexFunc(pool.Devices, func(d Device) bool { return d.Type == TypeGPU })]
	if len(whole.Consumes) != len(pool.CounterSets[0].Counters) {
		t.Errorf("the whole GPU consumes %v, not every counter of %v", whole.Consumes, pool.CounterSets[0].Counters)
	}
}

// Partition names are DNS labels, one per profile and placement: a +me
// profile and a -me one (Blackwell has both) must not share a name.
func TestPartitionName(t *testing.T) {
	tests := []struct {
		gpu     int
		profile string
		start   int
		want    string
	}{
		{0, "3g.40gb", 4, "gpu-0-mig-3g40gb-4"},
		{0, "1g.24gb", 6, "gpu-0-mig-1g24gb-6"},
		{0, "1g.24gb+me", 6, "gpu-0-mig-1g24gb-plus-me-6"},
		{0, "1g.24gb-me", 6, "gpu-0-mig-1g24gb-me-6"},
		{0, "1g.24gb+me.all", 6, "gpu-0-mig-1g24gb-plus-me-all-6"},
		{0, "1g.24gb+gfx", 6, "gpu-0-mig-1g24gb-plus-gfx-6"},
		{0, "2g.48gb-me", 4, "gpu-0-mig-2g48gb-me-4"},
		{31, "7g.180gb", 0, "gpu-31-mig-7g180gb-0"},
	}
	seen := map[string]string{}
	for _, tt := range tests {
		got := PartitionName(tt.gpu, tt.profile, tt.start)
		if got != tt.want {
			t.Errorf("PartitionName(%d, %q, %d) = %q, want %q", tt.gpu, tt.profile, tt.start, got, tt.want)
		}
		if errs := validation.IsDNS1123Label(got); len(errs) > 0 {
			t.Errorf("%s: not a DNS label: %v", got, errs)
		}
		key := fmt.Sprintf("%d %s %d", tt.gpu, tt.profile, tt.start)
		if other, dup := seen[got]; dup {
			t.Errorf("%s and %s are both named %s", other, key, got)
		}
		seen[got] = key
	}
}

// Every simulated MIG model: each GPU's devices on demand (the whole GPU,
// every profile at every placement) have distinct names that are DNS labels.
func TestPartitionNamesOfEveryModel(t *testing.T) {
	models := map[string]bool{}
	for _, node := range sim.Profiles() {
		n, inv := simtest.NodeInventory(t, node.Name)
		for _, g := range inv.GPUs {
			profiles := simtest.Profiles(t, n, g)
			if len(profiles) == 0 {
				continue
			}
			models[g.Name] = true
			devs, _ := Partitions(Dynamic{GPU: g, Profiles: profiles, Whole: true}, Device{})
			seen := map[string]string{}
			for _, d := range devs {
				if errs := validation.IsDNS1123Label(d.Name); len(errs) > 0 {
					t.Errorf("%s GPU %d: %q is not a DNS label: %v", node.Name, g.Index, d.Name, errs)
				}
				what := fmt.Sprintf("%s at %d", d.Profile, d.Placement.Start)
				if other, dup := seen[d.Name]; dup {
					t.Errorf("%s GPU %d: %s and %s are both named %s", node.Name, g.Index, other, what, d.Name)
				}
				seen[d.Name] = what
			}
		}
	}
	// A100 40 and 80 GB, A30, H100, H100 NVL, H200, both GH200s, B200.
	if len(models) < 9 {
		t.Errorf("only %d MIG models simulated: %v", len(models), slices.Sorted(maps.Keys(models)))
	}
}

// TestSliceOrder: within a slice the whole GPUs alternate with the first
// device of each MIG profile, the other MIG devices after, and within each
// kind (whole GPUs; one profile's existing MIG devices; one profile's
// partitions) the order is publishOrder's, so a claim is given the device
// it would be given without the interleaving.
func TestSliceOrder(t *testing.T) {
	n, inv := simtest.NodeInventory(t, "dgx-h100")
	profiles := simtest.Profiles(t, n, inv.GPUs[0])
	pool := &Pool{GPUOrder: []int{1, 0}}
	for _, g := range inv.GPUs[:2] {
		devs, set := Partitions(Dynamic{GPU: g, Profiles: profiles, Whole: true}, Device{ProductName: g.Name})
		pool.Devices = append(pool.Devices, devs...)
		pool.CounterSets = append(pool.CounterSets, set)
	}
	for i, p := range []string{"2g.20gb", "1g.10gb", "1g.10gb"} { // existing MIG devices of a third GPU
		pool.Devices = append(pool.Devices, Device{Name: MIGName(2, i, 0), Type: TypeMIG, Profile: p, ParentIndex: 2, Index: i,
			Placement: gpu.Placement{Start: 2 * i, Size: map[string]int{"2g.20gb": 2, "1g.10gb": 1}[p]}})
	}
	res := Resources("node-a", pool, 1, Dropped{}).Pools["node-a"].Slices
	var got []string
	for _, s := range res {
		for _, d := range s.Devices {
			got = append(got, d.Name)
		}
	}
	if len(got) != 2*20+3 {
		t.Fatalf("%d devices: %v", len(got), got)
	}
	// The head: whole GPUs in GPU order, each followed by the next kind's
	// first device: existing 1g, existing 2g, then the partitions' profiles.
	wantHead := []string{"gpu-1", MIGName(2, 1, 0), "gpu-0", MIGName(2, 0, 0), "gpu-1-mig-1g10gb-6"}
	if !slices.Equal(got[:len(wantHead)], wantHead) {
		t.Errorf("slice starts %v, want %v", got[:len(wantHead)], wantHead)
	}
	// Each kind in publishOrder: compare with the devices of that kind in
	// byGPU's order, which is publishOrder per GPU, GPUs in order.
	key := func(d Device) string {
		switch {
		case d.Partition:
			return "partition/" + d.Profile
		case d.Type == TypeMIG:
			return "mig/" + d.Profile
		}
		return "gpu"
	}
	byName := map[string]Device{}
	want := map[string][]string{}
	for _, group := range byGPU(pool.Devices, pool.GPUOrder) {
		for _, d := range group {
			byName[d.Name] = d
			want[key(d)] = append(want[key(d)], d.Name)
		}
	}
	have := map[string][]string{}
	for _, name := range got {
		have[key(byName[name])] = append(have[key(byName[name])], name)
	}
	for k, names := range want {
		if !slices.Equal(have[k], names) {
			t.Errorf("%s in the slices: %v, want %v", k, have[k], names)
		}
	}
}

// A spare layout beside whole GPUs (no more MIG devices than whole GPUs):
// each profile's devices come together after a whole GPU, so a claim for
// the second 1g.10gb walks no whole GPU after the first.
func TestSliceOrderFewMIG(t *testing.T) {
	var ds []Device
	for i := range 3 {
		ds = append(ds, Device{Name: GPUName(i), Type: TypeGPU, Index: i})
	}
	for _, p := range []struct {
		profile string
		start   int
	}{{"2g.20gb", 0}, {"1g.10gb", 3}, {"1g.10gb", 2}} {
		ds = append(ds, Device{Name: PartitionName(3, p.profile, p.start), Type: TypeMIG, Partition: true, Profile: p.profile,
			ParentIndex: 3, Placement: gpu.Placement{Start: p.start, Size: 1}})
	}
	var got []string
	for _, d := range sliceOrder(ds) {
		got = append(got, d.Name)
	}
	want := []string{"gpu-0", "gpu-3-mig-1g10gb-3", "gpu-3-mig-1g10gb-2", "gpu-1", "gpu-3-mig-2g20gb-0", "gpu-2"}
	if !slices.Equal(got, want) {
		t.Errorf("order %v, want %v", got, want)
	}
}

// No device carries more than maxAttributes attributes, nor more than 8
// capacities (a Go map's one group): past either the scheduler's decoded
// copy of every device of every node grows by half (see attributes). The
// richest of each kind: whole GPUs with NVLink and NUMA, existing MIG
// devices, MIG devices made on demand, shared GPUs.
func TestDeviceMapsStaySmall(t *testing.T) {
	n, inv := simtest.NodeInventory(t, "dgx-h100")
	profiles := simtest.Profiles(t, n, inv.GPUs[0])
	devs := Devices(inv, map[string]mig.Profiles{inv.GPUs[0].Name: profiles}, nil)
	parts, _ := Partitions(Dynamic{GPU: inv.GPUs[1], Profiles: profiles, Whole: true}, devs[1])
	devs = append(devs, parts...)
	made := parts[len(parts)-1]
	made.UUID, made.Index = "MIG-made", 0
	shared := devs[0]
	shared.Shares, shared.MPS = 4, true
	devs = append(devs, made, shared, Device{Name: "mig", Type: TypeMIG, UUID: "MIG-x", Index: 1, NUMANode: 0, PCIBusID: "0000:18:00.0",
		PCIeRoot: "pci0000:00", Architecture: "Hopper", Brand: "Nvidia", DriverVersion: "550.54.15", CUDADriverVersion: "12.4", Profile: "1g.10gb",
		ParentUUID: "GPU-x", Engines: &Engines{}})
	for _, d := range devs {
		a := apiDevice(d)
		if len(a.Attributes) > maxAttributes || len(a.Capacity) > 8 {
			t.Errorf("%s (%s): %d attributes, %d capacities; want at most %d and 8", d.Name, d.Type, len(a.Attributes), len(a.Capacity), maxAttributes)
		}
	}
}

// richMIG is a MIG device with every attribute a MIG device can have.
var richMIG = Device{Name: "gpu-0-mig-7-0", Type: TypeMIG, UUID: "MIG-x", Index: 1, NUMANode: 0, PCIBusID: "0000:18:00.0",
	PCIeRoot: "pci0000:00", Architecture: "Hopper", Brand: "Nvidia", DriverVersion: "550.54.15", CUDADriverVersion: "12.4",
	Profile: "1g.10gb", ParentUUID: "GPU-x", Engines: &Engines{}}

// The names the config accepts in dra.migDeviceAttributes are exactly the
// attributes a MIG device is published with: a name it accepts is never
// one that cannot be kept, and no attribute is beyond its reach.
func TestMIGAttributeNamesMatchConfig(t *testing.T) {
	var got []string
	for name := range apiDevice(richMIG).Attributes {
		got = append(got, string(name))
	}
	want := slices.Concat(config.MIGAttributesAlways, config.MIGAttributesOptional)
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Errorf("a MIG device's attributes %q, the config's names %q", got, want)
	}
}

// With dra.migDeviceAttributes, MIG devices (existing and made on demand)
// carry type, profile and the listed attributes only; whole GPUs keep
// theirs, and without it every MIG device keeps all.
func TestMIGAttributesKept(t *testing.T) {
	whole := Device{Name: "gpu-0", Type: TypeGPU, UUID: "GPU-x", ProductName: "H100", Architecture: "Hopper", PCIeRoot: "pci0000:00", NUMANode: 0, NVLinkClique: -1}
	part := richMIG
	part.Name, part.UUID, part.Index, part.Partition = "gpu-0-mig-1g10gb-6", "", -1, true
	keep := []string{"uuid", "parentUUID", "resource.kubernetes.io/pcieRoot"}
	names := func(p *Pool) map[string][]string {
		out := map[string][]string{}
		for _, s := range Resources("node", p, 1, Dropped{}).Pools["node"].Slices {
			for _, d := range s.Devices {
				for name := range d.Attributes {
					out[d.Name] = append(out[d.Name], string(name))
				}
				slices.Sort(out[d.Name])
			}
		}
		return out
	}
	all := &Pool{Devices: []Device{whole, part, richMIG}}
	lean := &Pool{Devices: all.Devices, MIGAttributes: keep}
	got, full := names(lean), names(all)
	for name, want := range map[string][]string{
		part.Name:    {"parentUUID", "profile", "resource.kubernetes.io/pcieRoot", "type"},
		richMIG.Name: {"parentUUID", "profile", "resource.kubernetes.io/pcieRoot", "type", "uuid"},
		whole.Name:   full[whole.Name],
	} {
		if !slices.Equal(got[name], want) {
			t.Errorf("%s: attributes %q, want %q", name, got[name], want)
		}
	}
	if len(full[richMIG.Name]) != len(config.MIGAttributesAlways)+len(config.MIGAttributesOptional) {
		t.Errorf("without migDeviceAttributes %s has %q, want every attribute", richMIG.Name, full[richMIG.Name])
	}
	if all.Equal(lean) || !lean.Equal(&Pool{Devices: all.Devices, MIGAttributes: slices.Clone(keep)}) {
		t.Error("Pool.Equal does not tell the attributes kept apart")
	}
	if (&Pool{MIGAttributes: []string{}}).Equal(&Pool{}) {
		t.Error("Pool.Equal takes keeping no attribute for keeping all")
	}
}
