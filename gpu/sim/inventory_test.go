package sim_test

import (
	"slices"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

func initNode(tb testing.TB, profile string, opts ...sim.Option) *sim.Node {
	tb.Helper()
	n, err := sim.New(profile, opts...)
	if err != nil {
		tb.Fatal(err)
	}
	if r := n.Init(); r != nvml.SUCCESS {
		tb.Fatalf("Init: %v", r)
	}
	tb.Cleanup(func() { n.Shutdown() })
	return n
}

func inventory(tb testing.TB, n *sim.Node) *gpu.Inventory {
	tb.Helper()
	inv, err := gpu.New(n, gpu.Options{})
	if err != nil {
		tb.Fatalf("gpu.New: %v", err)
	}
	if len(inv.Errors) != 0 {
		tb.Fatalf("inventory errors: %v", inv.Errors)
	}
	return inv
}

func TestInventoryOfEveryProfile(t *testing.T) {
	const (
		pix = gpu.LevelSingle
		pxb = gpu.LevelMultiple
		phb = gpu.LevelHostBridge
		nod = gpu.LevelNode
		sys = gpu.LevelSystem
	)
	tests := []struct {
		profile string
		count   int
		name    string
		numa    []int
		// level(i, j) for i != j
		level      func(i, j int) gpu.LinkLevel
		lanes      func(i, j int) int
		migCapable bool
	}{
		{"dgx-a100", 8, "NVIDIA A100-SXM4-40GB", []int{3, 3, 1, 1, 7, 7, 5, 5},
			func(i, j int) gpu.LinkLevel { return pick(i/2 == j/2, pxb, sys) }, func(int, int) int { return 12 }, true},
		{"dgx-h100", 8, "NVIDIA H100 80GB HBM3", []int{0, 0, 0, 0, 1, 1, 1, 1},
			func(i, j int) gpu.LinkLevel { return pick(i/2 == j/2, pxb, sys) }, func(int, int) int { return 18 }, true},
		{"dgx-a100-80gb", 8, "NVIDIA A100-SXM4-80GB", []int{3, 3, 1, 1, 7, 7, 5, 5},
			func(i, j int) gpu.LinkLevel { return pick(i/2 == j/2, pxb, sys) }, func(int, int) int { return 12 }, true},
		{"dgx-h200", 8, "NVIDIA H200", []int{0, 0, 0, 0, 1, 1, 1, 1},
			func(i, j int) gpu.LinkLevel { return pick(i/2 == j/2, pxb, sys) }, func(int, int) int { return 18 }, true},
		{"dgx-b200", 8, "NVIDIA B200", []int{0, 0, 0, 0, 1, 1, 1, 1},
			func(i, j int) gpu.LinkLevel { return pick(i/2 == j/2, pxb, sys) }, func(int, int) int { return 18 }, true},
		// The tray's GPUs reach each other only through the rack's
		// switches: 18 lanes each, none direct.
		{"gb200-tray", 4, "NVIDIA GB200", []int{0, 0, 1, 1},
			func(i, j int) gpu.LinkLevel { return pick(i/2 == j/2, nod, sys) }, func(int, int) int { return 18 }, true},
		{"pcie-a30x4", 4, "NVIDIA A30", []int{0, 0, 1, 1},
			func(i, j int) gpu.LinkLevel { return pick(i/2 == j/2, pix, sys) }, func(int, int) int { return 0 }, true},
		{"pcie-h100nvl-x2", 2, "NVIDIA H100 NVL", []int{0, 0},
			func(int, int) gpu.LinkLevel { return pix }, func(int, int) int { return 0 }, true},
		{"gh200", 1, "NVIDIA GH200 480GB", []int{0}, nil, nil, true},
		{"gh200-144g", 1, "NVIDIA GH200 144G HBM3e", []int{0}, nil, nil, true},
		{"dgx1-v100", 8, "Tesla V100-SXM2-32GB", []int{0, 0, 0, 0, 1, 1, 1, 1},
			func(i, j int) gpu.LinkLevel { return pick(i/2 == j/2, pix, pick(i/4 == j/4, phb, sys)) }, cubeMeshLanes, false},
		{"pcie-8gpu", 8, "NVIDIA L40S", []int{0, 0, 0, 0, 1, 1, 1, 1},
			func(i, j int) gpu.LinkLevel { return pick(i/2 == j/2, pix, pick(i/4 == j/4, nod, sys)) }, func(int, int) int { return 0 }, false},
		{"pcie-4gpu", 4, "NVIDIA L40S", []int{0, 0, 1, 1},
			func(i, j int) gpu.LinkLevel { return pick(i/2 == j/2, pix, sys) }, func(int, int) int { return 0 }, false},
		{"two-islands-16", 16, "Tesla V100-SXM2-32GB", []int{0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1},
			func(i, j int) gpu.LinkLevel {
				return pick(i/2 == j/2, pix, pick(i/4 == j/4, pxb, pick(i/8 == j/8, nod, sys)))
			},
			func(i, j int) int {
				if i/8 != j/8 {
					return 0
				}
				return cubeMeshLanes(i%8, j%8)
			}, false},
	}
	// Every node but the MIG variant (TestInventoryMIGProfileVariant) has a row.
	rows := map[string]bool{"dgx-h100-mig": true}
	for _, tt := range tests {
		rows[tt.profile] = true
	}
	for _, p := range sim.Profiles() {
		if !rows[p.Name] {
			t.Errorf("no row for node %s", p.Name)
		}
	}
	for _, tt := range tests {
		t.Run(tt.profile, func(t *testing.T) {
			inv := inventory(t, initNode(t, tt.profile))
			if len(inv.GPUs) != tt.count || inv.Topology.Len() != tt.count {
				t.Fatalf("%d GPUs, topology of %d; want %d", len(inv.GPUs), inv.Topology.Len(), tt.count)
			}
			for i, g := range inv.GPUs {
				if g.Index != i || g.Name != tt.name || g.NUMANode != tt.numa[i] || g.Minor != i || g.MIGCapable != tt.migCapable {
					t.Errorf("gpu %d: %+v", i, g)
				}
				for j := range inv.GPUs {
					if i == j {
						continue
					}
					if got, want := inv.Topology.Level[i][j], tt.level(i, j); got != want {
						t.Errorf("level %d-%d = %v, want %v", i, j, got, want)
					}
					if got, want := inv.Topology.Lanes(i, j), tt.lanes(i, j); got != want {
						t.Errorf("lanes %d-%d = %d, want %d", i, j, got, want)
					}
				}
			}
		})
	}
}

func pick(cond bool, a, b gpu.LinkLevel) gpu.LinkLevel {
	if cond {
		return a
	}
	return b
}

// cubeMeshLanes is the DGX-1 lane table as the brief gives it.
func cubeMeshLanes(i, j int) int {
	table := map[[2]int]int{
		{0, 1}: 1, {0, 2}: 1, {0, 3}: 2, {0, 4}: 2, {1, 2}: 2, {1, 3}: 1, {1, 5}: 2, {2, 3}: 2,
		{2, 6}: 1, {3, 7}: 1, {4, 5}: 1, {4, 6}: 1, {4, 7}: 2, {5, 6}: 2, {5, 7}: 1, {6, 7}: 2,
	}
	return table[[2]int{min(i, j), max(i, j)}]
}

func TestInventoryMIGInstances(t *testing.T) {
	n := initNode(t, "dgx-a100", sim.WithMIGEnabled())
	create := func(gpuIdx, profile int, start uint32, ciProfile int) {
		t.Helper()
		d, _ := n.DeviceGetHandleByIndex(gpuIdx)
		info, _ := d.GetGpuInstanceProfileInfo(profile)
		pls, _ := d.GetGpuInstancePossiblePlacements(&info)
		gi, r := d.CreateGpuInstanceWithPlacement(&info, &nvml.GpuInstancePlacement{Start: start, Size: pls[0].Size})
		if r != nvml.SUCCESS {
			t.Fatalf("gpu %d: create %d at %d: %v", gpuIdx, profile, start, r)
		}
		ci, _ := gi.GetComputeInstanceProfileInfo(ciProfile, nvml.COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED)
		if _, r := gi.CreateComputeInstance(&ci); r != nvml.SUCCESS {
			t.Fatalf("gpu %d: create CI: %v", gpuIdx, r)
		}
	}
	create(0, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4, nvml.COMPUTE_INSTANCE_PROFILE_3_SLICE)
	create(0, nvml.GPU_INSTANCE_PROFILE_1_SLICE_REV1, 0, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE)
	create(0, nvml.GPU_INSTANCE_PROFILE_2_SLICE, 2, nvml.COMPUTE_INSTANCE_PROFILE_1_SLICE)
	create(3, nvml.GPU_INSTANCE_PROFILE_7_SLICE, 0, nvml.COMPUTE_INSTANCE_PROFILE_7_SLICE)

	inv := inventory(t, n)
	type inst struct {
		profile string
		gi, ci  int
		start   int
		size    int
		mem     uint64
	}
	var got []inst
	for _, m := range inv.GPUs[0].Instances {
		got = append(got, inst{m.Profile, m.GI, m.CI, m.Placement.Start, m.Placement.Size, m.MemoryBytes >> 20})
	}
	want := []inst{
		{"3g.20gb", 1, 0, 4, 4, 19968},
		{"1g.5gb+me", 2, 0, 0, 1, 4864},
		{"1c.2g.10gb", 3, 0, 2, 2, 9856},
	}
	if !slices.Equal(got, want) {
		t.Errorf("GPU 0 instances %+v, want %+v", got, want)
	}
	if g := inv.GPUs[3]; len(g.Instances) != 1 || g.Instances[0].Profile != "7g.40gb" || !g.MIG.Current {
		t.Errorf("GPU 3 %+v", g)
	}
	if g := inv.GPUs[1]; len(g.Instances) != 0 || !g.MIG.Current || !g.MIGCapable {
		t.Errorf("GPU 1 %+v", g)
	}
}

func TestInventoryLeavesLostGPUOut(t *testing.T) {
	n := initNode(t, "pcie-4gpu")
	if err := n.SetLost(2, true); err != nil {
		t.Fatal(err)
	}
	inv, err := gpu.New(n, gpu.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.GPUs) != 3 || len(inv.Errors) == 0 || inv.Errors[0].Index != 2 {
		t.Errorf("GPUs %d, errors %v", len(inv.GPUs), inv.Errors)
	}
}

func BenchmarkInventoryTwoIslands16(b *testing.B) {
	n := initNode(b, "two-islands-16")
	b.ReportAllocs()
	for b.Loop() {
		if _, err := gpu.New(n, gpu.Options{}); err != nil {
			b.Fatal(err)
		}
	}
}

func TestInventoryMIGProfileVariant(t *testing.T) {
	n, err := sim.New("dgx-h100-mig")
	if err != nil {
		t.Fatal(err)
	}
	n.Init()
	defer n.Shutdown()
	inv, err := gpu.New(n, gpu.Options{})
	if err != nil {
		t.Fatal(err)
	}
	if len(inv.Errors) != 0 || len(inv.GPUs) != 8 {
		t.Fatalf("%d GPUs, errors %v", len(inv.GPUs), inv.Errors)
	}
	seen := map[string]bool{}
	for _, g := range inv.GPUs {
		if g.PCIDeviceID != 0x233010DE { // H100 SXM5, as MIG layouts' device-filter names it
			t.Errorf("GPU %d: PCI device id %#x", g.Index, g.PCIDeviceID)
		}
		if !g.MIG.Current || len(g.Instances) != 7 {
			t.Fatalf("GPU %d: MIG %+v with %d instances, want on with 7", g.Index, g.MIG, len(g.Instances))
		}
		for i, m := range g.Instances {
			if m.Profile != "1g.10gb" || m.Placement.Start != i || seen[m.UUID] {
				t.Errorf("GPU %d instance %d: %+v", g.Index, i, m)
			}
			seen[m.UUID] = true
		}
	}
	// A full GPU leaves no room: the layout obeys the same rules as later creates.
	d, _ := n.DeviceGetHandleByIndex(0)
	info, _ := d.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_1_SLICE)
	if _, r := d.CreateGpuInstance(&info); r != nvml.ERROR_INSUFFICIENT_RESOURCES {
		t.Errorf("an eighth 1g instance: %v, want ERROR_INSUFFICIENT_RESOURCES", r)
	}
}

// TestInventoryAlignmentGroups checks what DRA publishes for aligned sets on
// the simulated nodes: NVLink cliques (every pair linked) and PCIe roots
// (derived from the topology: host bridge or closer), plus the identity
// attributes NVIDIA's claims select on.
func TestInventoryAlignmentGroups(t *testing.T) {
	tests := []struct {
		profile      string
		cliques      []int
		rootGroups   []int // GPUs with equal numbers share a root
		architecture string
		brand        string
	}{
		{profile: "dgx1-v100", cliques: []int{0, 0, 0, 0, 1, 1, 1, 1}, rootGroups: []int{0, 0, 0, 0, 1, 1, 1, 1}, architecture: "Volta", brand: "Tesla"},
		{profile: "two-islands-16",
			cliques:    []int{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3},
			rootGroups: []int{0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3}, architecture: "Volta", brand: "Tesla"},
		{profile: "dgx-h100", cliques: []int{0, 0, 0, 0, 0, 0, 0, 0}, rootGroups: []int{0, 0, 1, 1, 2, 2, 3, 3}, architecture: "Hopper", brand: "Nvidia"},
		{profile: "pcie-8gpu", cliques: []int{-1, -1, -1, -1, -1, -1, -1, -1}, rootGroups: []int{0, 0, 1, 1, 2, 2, 3, 3}, architecture: "Ada Lovelace"},
		{profile: "dgx-b200", cliques: []int{0, 0, 0, 0, 0, 0, 0, 0}, rootGroups: []int{0, 0, 1, 1, 2, 2, 3, 3}, architecture: "Blackwell", brand: "Nvidia"},
	}
	for _, tt := range tests {
		t.Run(tt.profile, func(t *testing.T) {
			inv := inventory(t, initNode(t, tt.profile))
			if got := inv.Topology.NVLinkCliques(); !slices.Equal(got, tt.cliques) {
				t.Errorf("NVLinkCliques = %v, want %v", got, tt.cliques)
			}
			byGroup := map[int]string{}
			roots := map[string]int{}
			for i, g := range inv.GPUs {
				if g.PCIeRoot == "" {
					t.Fatalf("GPU %d has no PCIe root", i)
				}
				if r, ok := byGroup[tt.rootGroups[i]]; ok && r != g.PCIeRoot {
					t.Errorf("GPU %d under %s, want %s with its group", i, g.PCIeRoot, r)
				}
				if k, ok := roots[g.PCIeRoot]; ok && k != tt.rootGroups[i] {
					t.Errorf("GPU %d shares %s with group %d, want group %d alone", i, g.PCIeRoot, k, tt.rootGroups[i])
				}
				byGroup[tt.rootGroups[i]], roots[g.PCIeRoot] = g.PCIeRoot, tt.rootGroups[i]
				if a := g.ComputeCapability.Architecture(); a != tt.architecture {
					t.Errorf("GPU %d architecture %q, want %q", i, a, tt.architecture)
				}
				if tt.brand != "" && g.Brand != tt.brand {
					t.Errorf("GPU %d brand %q, want %q", i, g.Brand, tt.brand)
				}
			}
			if inv.CUDADriverVersion != "12.4" {
				t.Errorf("CUDADriverVersion = %q, want 12.4", inv.CUDADriverVersion)
			}
		})
	}
}

// The inventory reads the sim's fabric info: the clique as NVIDIA's DRA
// driver names it, and a fault injected on one GPU.
func TestInventoryFabric(t *testing.T) {
	n := initNode(t, "gb200-tray", sim.WithClique(12))
	if err := n.SetFabricFault(3, sim.FabricFault{DegradedBandwidth: true}); err != nil {
		t.Fatal(err)
	}
	inv := inventory(t, n)
	want := sim.ClusterUUID(12).String() + ".12"
	for i, g := range inv.GPUs {
		if c := g.Fabric.Clique(); c != want {
			t.Errorf("gpu %d: clique %q, want %q", i, c, want)
		}
		if wantBus := []string{"0008:01:00.0", "0009:01:00.0", "0018:01:00.0", "0019:01:00.0"}[i]; g.PCIBusID != wantBus {
			t.Errorf("gpu %d: bus %s, want %s", i, g.PCIBusID, wantBus)
		}
	}
	if f := inv.GPUs[3].Fabric; f.Health != gpu.FabricLimitedCapacity || !slices.Equal(f.Conditions, []string{"degraded-bandwidth"}) {
		t.Errorf("gpu 3 fabric %+v", f)
	}
	if f := inv.GPUs[0].Fabric; f.Health != gpu.FabricHealthy || f.Conditions != nil {
		t.Errorf("gpu 0 fabric %+v", f)
	}
	for _, g := range inventory(t, initNode(t, "dgx-h100")).GPUs {
		if g.Fabric != nil {
			t.Errorf("dgx-h100 gpu %d: fabric %+v", g.Index, g.Fabric)
		}
	}
}
