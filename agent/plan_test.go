package agent

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
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
			name:        "MIG-enabled GPU withheld, pending-only change still served, sorted by ID",
			in:          PlanInput{Inventory: testInventory()},
			wantIDs:     []string{"GPU-a", "GPU-b", "GPU-d"},
			wantNodes:   map[string][]string{"GPU-a": nil, "GPU-b": nil, "GPU-d": nil},
			wantHealthy: map[string]bool{"GPU-a": true, "GPU-b": true, "GPU-d": true},
		},
		{
			name:        "device specs only when asked, by minor number",
			in:          PlanInput{Inventory: testInventory(), PassDeviceSpecs: true},
			wantIDs:     []string{"GPU-a", "GPU-b", "GPU-d"},
			wantNodes:   map[string][]string{"GPU-a": {"/dev/nvidia1"}, "GPU-b": {"/dev/nvidia0"}, "GPU-d": {"/dev/nvidia7"}},
			wantCommon:  []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"},
			wantHealthy: map[string]bool{"GPU-a": true, "GPU-b": true, "GPU-d": true},
		},
		{
			name:        "unhealthy GPU stays listed, marked unhealthy",
			in:          PlanInput{Inventory: testInventory(), Unhealthy: map[string]string{"GPU-b": "XID 79"}},
			wantIDs:     []string{"GPU-a", "GPU-b", "GPU-d"},
			wantNodes:   map[string][]string{"GPU-a": nil, "GPU-b": nil, "GPU-d": nil},
			wantHealthy: map[string]bool{"GPU-a": true, "GPU-b": false, "GPU-d": true},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := PlanCatalog(tt.in)
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
	for name, in := range map[string]PlanInput{"all MIG": {Inventory: inv}, "no inventory": {}} {
		c := PlanCatalog(in)
		if len(c.Resources) != 0 {
			t.Errorf("%s: resources %v, want none (an empty resource would register with no devices)", name, c.Names())
		}
	}
}

func TestSameCatalog(t *testing.T) {
	a := PlanCatalog(PlanInput{Inventory: testInventory()})
	b := PlanCatalog(PlanInput{Inventory: testInventory()})
	if !sameCatalog(a, b) {
		t.Fatal("identical plans differ")
	}
	c := PlanCatalog(PlanInput{Inventory: testInventory(), Unhealthy: map[string]string{"GPU-a": "lost"}})
	if sameCatalog(a, c) {
		t.Fatal("health change not seen as a change")
	}
	if sameCatalog(a, &catalog.Catalog{Resources: map[string]*catalog.Resource{}}) {
		t.Fatal("removal not seen as a change")
	}
}

func TestAgentPreferredUsesTopology(t *testing.T) {
	node, err := sim.New("dgx1-v100")
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	rec := newRecorder()
	a := New(Options{Lib: node, Publisher: rec, ResyncInterval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go a.Run(ctx)
	rec.wait(t)
	r := rec.last().Resources[ResourceGPU]
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
	// The same preferrer is reused while the inventory is unchanged.
	if a.preferrerForTest() != a.preferrerForTest() {
		t.Error("preferrer rebuilt without an inventory change")
	}
}
