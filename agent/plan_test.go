package agent

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

func testInventory() *gpu.Inventory {
	return &gpu.Inventory{GPUs: []gpu.GPU{
		{Index: 0, UUID: "GPU-b", Minor: 0, NUMANode: 1},
		{Index: 1, UUID: "GPU-a", Minor: 1, NUMANode: -1},
		{Index: 2, UUID: "GPU-c", Minor: 2, NUMANode: 0, MIGCapable: true, MIG: gpu.MIGMode{Current: true, Pending: true}},
		{Index: 3, UUID: "GPU-d", Minor: 7, NUMANode: 0, MIGCapable: true, MIG: gpu.MIGMode{Current: false, Pending: true}},
	}}
}

func TestPlanCatalogWholeGPUs(t *testing.T) {
	tests := []struct {
		name        string
		in          PlanInput
		wantIDs     []string
		wantNodes   map[string][]string // device ID -> device nodes
		wantCommon  []string
		wantHealthy map[string]bool
	}{
		{
			name:        "MIG-enabled GPU without instances withheld (mixed), pending-only change still served, sorted by ID",
			in:          PlanInput{Inventory: testInventory(), MIGStrategy: config.MIGStrategyMixed},
			wantIDs:     []string{"GPU-a", "GPU-b", "GPU-d"},
			wantNodes:   map[string][]string{"GPU-a": nil, "GPU-b": nil, "GPU-d": nil},
			wantHealthy: map[string]bool{"GPU-a": true, "GPU-b": true, "GPU-d": true},
		},
		{
			name:        "device specs only when asked, by minor number",
			in:          PlanInput{Inventory: testInventory(), MIGStrategy: config.MIGStrategyMixed, PassDeviceSpecs: true},
			wantIDs:     []string{"GPU-a", "GPU-b", "GPU-d"},
			wantNodes:   map[string][]string{"GPU-a": {"/dev/nvidia1"}, "GPU-b": {"/dev/nvidia0"}, "GPU-d": {"/dev/nvidia7"}},
			wantCommon:  []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"},
			wantHealthy: map[string]bool{"GPU-a": true, "GPU-b": true, "GPU-d": true},
		},
		{
			name:        "unhealthy GPU stays listed, marked unhealthy",
			in:          PlanInput{Inventory: testInventory(), MIGStrategy: config.MIGStrategyMixed, Unhealthy: map[string]string{"GPU-b": "XID 79"}},
			wantIDs:     []string{"GPU-a", "GPU-b", "GPU-d"},
			wantNodes:   map[string][]string{"GPU-a": nil, "GPU-b": nil, "GPU-d": nil},
			wantHealthy: map[string]bool{"GPU-a": true, "GPU-b": false, "GPU-d": true},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := PlanCatalog(tt.in)
			if err != nil {
				t.Fatal(err)
			}
			r, ok := c.Resources[ResourceGPU]
			if !ok {
				t.Fatalf("no %s resource; got %v", ResourceGPU, c.Names())
			}
			var ids []string
			for _, d := range r.Devices {
				ids = append(ids, d.ID)
				if d.Spec.VisibleID != d.ID {
					t.Errorf("%s: VisibleID %q, want the UUID", d.ID, d.Spec.VisibleID)
				}
				if !slices.Equal(d.Spec.DeviceNodes, tt.wantNodes[d.ID]) {
					t.Errorf("%s: device nodes %v, want %v", d.ID, d.Spec.DeviceNodes, tt.wantNodes[d.ID])
				}
				if d.Healthy != tt.wantHealthy[d.ID] {
					t.Errorf("%s: healthy %v, want %v", d.ID, d.Healthy, tt.wantHealthy[d.ID])
				}
				if !d.Healthy && d.Reason == "" {
					t.Errorf("%s: unhealthy without a reason", d.ID)
				}
			}
			if !slices.Equal(ids, tt.wantIDs) {
				t.Errorf("IDs %v, want %v", ids, tt.wantIDs)
			}
			if !slices.Equal(r.Common.DeviceNodes, tt.wantCommon) {
				t.Errorf("common device nodes %v, want %v", r.Common.DeviceNodes, tt.wantCommon)
			}
			b, _ := r.Device("GPU-b")
			if b.NUMANode != 1 || b.GPU != 0 {
				t.Errorf("GPU-b: numa %d gpu %d, want 1 and 0", b.NUMANode, b.GPU)
			}
		})
	}
}

func TestPlanCatalogNoWholeGPUs(t *testing.T) {
	inv := &gpu.Inventory{GPUs: []gpu.GPU{{Index: 0, UUID: "GPU-x", MIGCapable: true, MIG: gpu.MIGMode{Current: true}}}}
	for name, in := range map[string]PlanInput{"all MIG": {Inventory: inv, MIGStrategy: config.MIGStrategyMixed}, "no inventory": {}} {
		c, _ := PlanCatalog(in)
		if len(c.Resources) != 0 {
			t.Errorf("%s: resources %v, want none (an empty resource would register with no devices)", name, c.Names())
		}
	}
}

func TestSameCatalog(t *testing.T) {
	a, _ := PlanCatalog(PlanInput{Inventory: testInventory()})
	b, _ := PlanCatalog(PlanInput{Inventory: testInventory()})
	if !sameCatalog(a, b) {
		t.Fatal("identical plans differ")
	}
	c, _ := PlanCatalog(PlanInput{Inventory: testInventory(), Unhealthy: map[string]string{"GPU-a": "lost"}})
	if sameCatalog(a, c) {
		t.Fatal("health change not seen as a change")
	}
	if sameCatalog(a, &catalog.Catalog{Resources: map[string]*catalog.Resource{}}) {
		t.Fatal("removal not seen as a change")
	}
}

func TestAgentPreferredUsesTopology(t *testing.T) {
	h := newHarness(t, simNode(t, "dgx1-v100"))
	h.config(wholeGPUs)
	r := h.pub.last().Resources[ResourceGPU]
	if r.Preferred == nil {
		t.Fatal("no topology preferrer on nvidia.com/gpu")
	}
	uuid := map[int]string{}
	for _, d := range r.Devices {
		uuid[d.GPU] = d.ID
	}
	// The cube-mesh case from the topology issue: of {1,2,3,4} with 1 required,
	// {1,2} (2 NVLink lanes) beats {1,4} (no NVLink).
	got, err := r.Preferred.Preferred([]string{uuid[1], uuid[2], uuid[3], uuid[4]}, []string{uuid[1]}, 2)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) != 2 || !slices.Contains(got, uuid[1]) || !slices.Contains(got, uuid[2]) {
		t.Errorf("preferred %v, want GPUs 1 and 2 (%s, %s)", got, uuid[1], uuid[2])
	}
	// The scorer is built once per inventory and policy, not per pass.
	first := h.a.scorer.byPol
	h.step(HealthChanged{})
	if len(first) != 1 || h.a.scorer.byPol[topologyPolicy(t, "topology")] != first[topologyPolicy(t, "topology")] {
		t.Errorf("scorer rebuilt for an unchanged inventory")
	}
}

func migInventory() *gpu.Inventory {
	inv := testInventory()
	inv.GPUs[2].Instances = []gpu.MIGInstance{
		{UUID: "MIG-1", Profile: "3g.20gb", GI: 1},
		{UUID: "MIG-2", Profile: "1g.5gb+me", GI: 2},
	}
	return inv
}

func boolPtr(b bool) *bool { return &b }

func TestPlanCatalogSharingAndMIG(t *testing.T) {
	ts := func(rs ...config.ReplicatedResource) config.Sharing {
		return config.Sharing{TimeSlicing: &config.TimeSlicing{Resources: rs}}
	}
	tests := []struct {
		name    string
		in      PlanInput
		want    map[string][]string // resource -> device IDs
		max     map[string]int      // resource -> MaxPerContainer
		wantErr string
	}{
		{
			name: "all GPUs time-sliced in place",
			in: PlanInput{MIGStrategy: config.MIGStrategyMixed,
				Sharing: ts(config.ReplicatedResource{Name: ResourceGPU, Devices: config.ReplicaDevices{All: true}, Replicas: 2})},
			want: map[string][]string{ResourceGPU: {"GPU-a::0", "GPU-a::1", "GPU-b::0", "GPU-b::1", "GPU-d::0", "GPU-d::1"}},
		},
		{
			name: "some GPUs renamed, the rest stay whole; limit only when asked",
			in: PlanInput{MIGStrategy: config.MIGStrategyMixed, Sharing: config.Sharing{TimeSlicing: &config.TimeSlicing{FailRequestsGreaterThanOne: boolPtr(true),
				Resources: []config.ReplicatedResource{{Name: ResourceGPU, Rename: "nvidia.com/gpu.shared",
					Devices: config.ReplicaDevices{List: []string{"3"}}, Replicas: 3}}}}},
			want: map[string][]string{ResourceGPU: {"GPU-a", "GPU-b"}, "nvidia.com/gpu.shared": {"GPU-d::0", "GPU-d::1", "GPU-d::2"}},
			max:  map[string]int{ResourceGPU: 0, "nvidia.com/gpu.shared": 1},
		},
		{
			name: "mixed strategy: one resource per profile, + written as .",
			in:   PlanInput{Inventory: migInventory(), MIGStrategy: config.MIGStrategyMixed},
			want: map[string][]string{ResourceGPU: {"GPU-a", "GPU-b", "GPU-d"}, "nvidia.com/mig-3g.20gb": {"MIG-1"}, "nvidia.com/mig-1g.5gb.me": {"MIG-2"}},
		},
		{
			name: "single strategy: MIG devices are nvidia.com/gpu",
			in:   PlanInput{Inventory: migInventory(), MIGStrategy: config.MIGStrategySingle},
			want: map[string][]string{ResourceGPU: {"GPU-a", "GPU-b", "GPU-d", "MIG-1", "MIG-2"}},
		},
		{
			name: "MIG devices time-sliced",
			in: PlanInput{Inventory: migInventory(), MIGStrategy: config.MIGStrategyMixed,
				Sharing: ts(config.ReplicatedResource{Name: "nvidia.com/mig-3g.20gb", Devices: config.ReplicaDevices{All: true}, Replicas: 2})},
			want: map[string][]string{ResourceGPU: {"GPU-a", "GPU-b", "GPU-d"}, "nvidia.com/mig-3g.20gb": {"MIG-1::0", "MIG-1::1"}, "nvidia.com/mig-1g.5gb.me": {"MIG-2"}},
		},
		{
			name:    "unknown GPU index names the field",
			in:      PlanInput{Sharing: ts(config.ReplicatedResource{Name: ResourceGPU, Devices: config.ReplicaDevices{List: []string{"9"}}, Replicas: 2})},
			wantErr: `configs.default.sharing.timeSlicing.resources[0].devices[0]: "9" names no device`,
		},
		{
			// As NVIDIA's plugin does; the warning is tested in compat_plan_test.go.
			name: "resource the node does not offer: skipped, the rest served",
			in: PlanInput{MIGStrategy: config.MIGStrategyMixed,
				Sharing: ts(config.ReplicatedResource{Name: "nvidia.com/mig-1g.10gb", Devices: config.ReplicaDevices{All: true}, Replicas: 2})},
			want: map[string][]string{ResourceGPU: {"GPU-a", "GPU-b", "GPU-d"}},
		},
		{
			name: "rename onto another offered resource",
			in: PlanInput{Inventory: migInventory(), MIGStrategy: config.MIGStrategyMixed,
				Sharing: ts(config.ReplicatedResource{Name: "nvidia.com/mig-3g.20gb", Rename: ResourceGPU, Devices: config.ReplicaDevices{All: true}, Replicas: 2})},
			wantErr: "resources[0].rename: nvidia.com/gpu is already offered",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if tt.in.Inventory == nil {
				tt.in.Inventory = testInventory()
			}
			tt.in.ConfigName = "default"
			c, err := PlanCatalog(tt.in)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := map[string][]string{}
			for name, r := range c.Resources {
				for _, d := range r.Devices {
					got[name] = append(got[name], d.ID)
					if parent, _, ok := strings.Cut(d.ID, "::"); ok && d.Spec.VisibleID != parent {
						t.Errorf("%s: visible %q, want %q", d.ID, d.Spec.VisibleID, parent)
					}
				}
				if want, ok := tt.max[name]; ok && r.MaxPerContainer != want {
					t.Errorf("%s: MaxPerContainer %d, want %d", name, r.MaxPerContainer, want)
				}
			}
			if len(got) != len(tt.want) {
				t.Errorf("resources %v, want %v", got, tt.want)
			}
			for name, ids := range tt.want {
				if !slices.Equal(got[name], ids) {
					t.Errorf("%s: %v, want %v", name, got[name], ids)
				}
			}
		})
	}
}

func TestPlanCatalogParentFaultMarksMIGAndReplicas(t *testing.T) {
	c, err := PlanCatalog(PlanInput{Inventory: migInventory(), MIGStrategy: config.MIGStrategyMixed,
		Unhealthy: map[string]string{"GPU-c": "XID 79", "GPU-a": "XID 48"},
		Sharing: config.Sharing{TimeSlicing: &config.TimeSlicing{Resources: []config.ReplicatedResource{
			{Name: ResourceGPU, Devices: config.ReplicaDevices{List: []string{"GPU-a"}}, Replicas: 2}}}}})
	if err != nil {
		t.Fatal(err)
	}
	for name, r := range c.Resources {
		for _, d := range r.Devices {
			wantBad := strings.HasPrefix(d.ID, "MIG-") || strings.HasPrefix(d.ID, "GPU-a")
			if d.Healthy == wantBad {
				t.Errorf("%s %s: healthy %v", name, d.ID, d.Healthy)
			}
		}
	}
}

func mpsInventory() *gpu.Inventory {
	return &gpu.Inventory{GPUs: []gpu.GPU{
		{Index: 0, UUID: "GPU-a", NUMANode: 0, MemoryBytes: 40 << 30, ComputeCapability: gpu.ComputeCapability{Major: 8}},
		{Index: 1, UUID: "GPU-b", NUMANode: 0, MemoryBytes: 40 << 30, ComputeCapability: gpu.ComputeCapability{Major: 8}},
		{Index: 2, UUID: "GPU-old", NUMANode: 0, MemoryBytes: 16 << 30, ComputeCapability: gpu.ComputeCapability{Major: 6}},
	}}
}

func TestPlanMPS(t *testing.T) {
	pct := 30
	limit := config.Quantity(8 << 30)
	entry := func(devs []string, replicas int) config.MPSResource {
		return config.MPSResource{ReplicatedResource: config.ReplicatedResource{Name: ResourceGPU, Rename: "nvidia.com/gpu.mps",
			Devices: config.ReplicaDevices{List: devs}, Replicas: replicas}}
	}
	custom := entry([]string{"1"}, 4)
	custom.ActiveThreadPercentage, custom.PinnedDeviceMemoryLimit = &pct, &limit
	in := PlanInput{Inventory: mpsInventory(), ConfigName: "default",
		MPS: MPSInput{Root: "/run/mps", ShmDir: "/dev/shm", Healthy: func(dev string) (bool, string) {
			return dev != "GPU-b", "not answering"
		}},
		Sharing: config.Sharing{MPS: &config.MPS{Resources: []config.MPSResource{entry([]string{"0"}, 2), custom}}}}
	// Two entries renaming onto one resource is refused by config validation; plan them apart.
	in.Sharing.MPS.Resources[1].Rename = "nvidia.com/gpu.mps-small"
	p, err := PlanResources(in)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.MPSDaemons) != 2 {
		t.Fatalf("daemons %+v, want one per shared GPU", p.MPSDaemons)
	}
	d0, d1 := p.MPSDaemons[0], p.MPSDaemons[1]
	if d0.Device != "GPU-a" || d0.ActiveThreadPercentage != 50 || d0.PinnedMemLimitBytes != 20<<30 {
		t.Errorf("GPU-a daemon %+v: want the defaults 100/2 %% and memory/2", d0)
	}
	if d1.Device != "GPU-b" || d1.ActiveThreadPercentage != 30 || d1.PinnedMemLimitBytes != 8<<30 {
		t.Errorf("GPU-b daemon %+v: want the overrides 30 %% and 8Gi", d1)
	}
	r := p.Catalog.Resources["nvidia.com/gpu.mps"]
	if r == nil || len(r.Devices) != 2 || r.MaxPerContainer != 1 {
		t.Fatalf("nvidia.com/gpu.mps: %+v; want 2 replicas limited to one per container (MPS default)", r)
	}
	env := r.Devices[0].Spec.Env
	if env["CUDA_MPS_PIPE_DIRECTORY"] == "" || env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "50" || env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == "" {
		t.Errorf("MPS env %v", env)
	}
	var shm bool
	for _, m := range r.Devices[0].Spec.Mounts {
		shm = shm || m.ContainerPath == "/dev/shm"
	}
	if !shm || r.Devices[0].Spec.VisibleID != "GPU-a" {
		t.Errorf("replica spec %+v: want /dev/shm mounted and the GPU visible", r.Devices[0].Spec)
	}
	for _, d := range p.Catalog.Resources["nvidia.com/gpu.mps-small"].Devices {
		if d.Healthy || !strings.Contains(d.Reason, "MPS daemon: not answering") {
			t.Errorf("%s: healthy %v reason %q; its daemon does not answer", d.ID, d.Healthy, d.Reason)
		}
	}
	if ids := p.Catalog.Resources[ResourceGPU].Devices; len(ids) != 1 || ids[0].ID != "GPU-old" {
		t.Errorf("whole GPUs left %+v, want GPU-old only", ids)
	}

	// Too many clients for the GPU generation: the error names the field and the GPU.
	in.Sharing.MPS.Resources = []config.MPSResource{entry([]string{"2"}, 20)}
	if _, err := PlanResources(in); err == nil || !strings.Contains(err.Error(), "sharing.mps.resources[0].replicas: GPU 2") {
		t.Errorf("20 MPS clients on a compute capability 6.0 GPU: %v", err)
	}
}

// A layout that does not fit fails alike on every GPU of the model: said
// once, the GPUs listed, and still a mig.ErrLayout.
func TestMIGFitErrorsGrouped(t *testing.T) {
	errs := []error{
		fmt.Errorf("configs.default.mig: gpu 0 (GPU-a): %w: 3× 3g.20gb exceeds", mig.ErrLayout),
		fmt.Errorf("configs.default.mig: gpu 1 (GPU-b): %w: 3× 3g.20gb exceeds", mig.ErrLayout),
		fmt.Errorf("configs.default.mig: gpu 2 (GPU-c): %w: 3× 3g.20gb exceeds", mig.ErrLayout),
		errors.New("configs.default.mig: gpu 3 (GPU-d): MIG profiles not read"),
	}
	err := groupGPUErrors(errs)
	want := "configs.default.mig: gpus 0, 1, 2: " + mig.ErrLayout.Error() + ": 3× 3g.20gb exceeds\nconfigs.default.mig: gpu 3 (GPU-d): MIG profiles not read"
	if err == nil || err.Error() != want || !errors.Is(err, mig.ErrLayout) {
		t.Errorf("grouped:\n%v\nwant:\n%s", err, want)
	}
}
