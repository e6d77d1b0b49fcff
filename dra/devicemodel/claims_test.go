package devicemodel_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/dra/schedsim"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

// simPool is what the agent would publish for a simulated node: its devices
// as they are, or (dynamic) every MIG-capable GPU's MIG devices on demand.
func simPool(t *testing.T, profile string, dynamic bool) (*gpu.Inventory, *devicemodel.Pool) {
	t.Helper()
	n, err := sim.New(profile)
	if err != nil {
		t.Fatal(err)
	}
	n.Init()
	t.Cleanup(func() { n.Shutdown() })
	inv, err := gpu.New(n, gpu.Options{})
	if err != nil {
		t.Fatal(err)
	}
	profiles := map[string]mig.Profiles{}
	for _, g := range inv.GPUs {
		if !g.MIGCapable {
			continue
		}
		dev, _ := n.DeviceGetHandleByIndex(g.Index)
		ps, err := mig.QueryProfiles(dev, g.MemoryBytes)
		if err != nil {
			t.Fatalf("gpu %d: %v", g.Index, err)
		}
		profiles[g.Name] = ps
	}
	if !dynamic {
		return inv, &devicemodel.Pool{Devices: devicemodel.Devices(inv, profiles, nil), GPUOrder: devicemodel.PublishOrder(inv)}
	}
	p := &devicemodel.Pool{}
	bases := devicemodel.GPUBases(inv)
	for i, g := range inv.GPUs {
		devs, set := devicemodel.Partitions(devicemodel.Dynamic{GPU: g, Profiles: profiles[g.Name], Whole: !g.MIG.Current}, bases[i])
		p.Devices = append(p.Devices, devs...)
		p.CounterSets = append(p.CounterSets, set)
	}
	return inv, p
}

// deviceClasses are the classes gpu-agent installs.
func deviceClasses(t *testing.T) []*resourceapi.DeviceClass {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "..", "deploy", "manifests", "dra", "deviceclasses.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var out []*resourceapi.DeviceClass
	for _, doc := range bytes.Split(b, []byte("\n---\n")) {
		c := &resourceapi.DeviceClass{}
		if err := yaml.UnmarshalStrict(doc, c); err != nil {
			t.Fatalf("device class: %v", err)
		}
		out = append(out, c)
	}
	return out
}

func readClaims(t *testing.T, name string) []*resourceapi.ResourceClaim {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	var out []*resourceapi.ResourceClaim
	for _, doc := range bytes.Split(b, []byte("\n---\n")) {
		c := &resourceapi.ResourceClaim{}
		if err := yaml.UnmarshalStrict(doc, c); err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		c.UID = types.UID("uid-" + c.Name)
		c.Namespace = "default"
		schedsim.Default(c)
		out = append(out, c)
	}
	return out
}

// TestClaimsAsNVIDIAUsersWriteThem allocates testdata/claims.yaml with the
// scheduler's allocator and CEL compiler against the slices the driver
// publishes: an attribute or capacity a selector names and no device has
// is a CEL runtime error there, and fails the claim.
func TestClaimsAsNVIDIAUsersWriteThem(t *testing.T) {
	classes := deviceClasses(t)
	for _, claim := range readClaims(t, "claims.yaml") {
		t.Run(claim.Name, func(t *testing.T) {
			node := claim.Annotations["test.gpu-agent.io/node"]
			profile, mode, _ := strings.Cut(node, " ")
			inv, pool := simPool(t, profile, mode == "dynamic")
			res := devicemodel.Resources("node-a", pool, 1, devicemodel.Dropped{})
			for _, sl := range res.Pools["node-a"].Slices {
				for _, d := range sl.Devices {
					if k := len(d.Attributes) + len(d.Capacity); k > resourceapi.ResourceSliceMaxAttributesAndCapacitiesPerDevice {
						t.Errorf("%s: %d attributes and capacities, the API takes %d", d.Name, k, resourceapi.ResourceSliceMaxAttributesAndCapacitiesPerDevice)
					}
				}
			}
			n := schedsim.New("node-a", devicemodel.DriverName, res, classes)

			results, err := n.Allocate(context.Background(), claim)
			want := claim.Annotations["test.gpu-agent.io/want"]
			switch {
			case want == "error":
				if err == nil || errors.Is(err, schedsim.ErrUnsatisfiable) {
					t.Fatalf("allocated (%v), want the allocator's error", err)
				}
				return
			case want == "unsatisfiable":
				if !errors.Is(err, schedsim.ErrUnsatisfiable) {
					t.Fatalf("got %v, %v; want unsatisfiable", results, err)
				}
				return
			case err != nil:
				t.Fatalf("Allocate: %v", err)
			}
			got := results[0].Devices.Results
			if strconv.Itoa(len(got)) != want {
				t.Fatalf("%d devices %v, want %s", len(got), got, want)
			}
			var gpus []gpu.GPU
			for _, r := range got {
				d, ok := pool.Device(r.Device)
				if !ok {
					t.Fatalf("allocated %q, not in the pool", r.Device)
				}
				g, _ := inv.GPUByUUID(d.UUID)
				if d.Type == devicemodel.TypeMIG {
					g, _ = inv.GPUByUUID(d.ParentUUID)
				}
				gpus = append(gpus, g)
			}
			checkAligned(t, inv, claim.Annotations["test.gpu-agent.io/check"], gpus)
		})
	}
}

func checkAligned(t *testing.T, inv *gpu.Inventory, check string, gpus []gpu.GPU) {
	t.Helper()
	for i, a := range gpus {
		for _, b := range gpus[i+1:] {
			switch check {
			case "nvlink":
				if inv.Topology.Lanes(a.Index, b.Index) == 0 {
					t.Errorf("GPUs %d and %d have no NVLink", a.Index, b.Index)
				}
			case "pcie-root":
				if a.PCIeRoot != b.PCIeRoot {
					t.Errorf("GPUs %d and %d under %s and %s", a.Index, b.Index, a.PCIeRoot, b.PCIeRoot)
				}
			case "numa":
				if a.NUMANode != b.NUMANode {
					t.Errorf("GPUs %d and %d on NUMA nodes %d and %d", a.Index, b.Index, a.NUMANode, b.NUMANode)
				}
			}
		}
	}
}

// A MIG device the config shares (time-slicing replicas) carries its
// engines as capacities too; each claim must take none of them by default,
// or the first would take all and the device could not be shared.
func TestSharedMIGDeviceTakesEveryShare(t *testing.T) {
	_, pool := simPool(t, "dgx-h100-mig", false)
	for i := range pool.Devices {
		pool.Devices[i].Shares = 3
	}
	n := schedsim.New("node-a", devicemodel.DriverName, devicemodel.Resources("node-a", pool, 1, devicemodel.Dropped{}), deviceClasses(t))
	claims := readClaims(t, "claims.yaml")
	var byCapacity *resourceapi.ResourceClaim
	for _, c := range claims {
		if c.Name == "static-mig-by-capacity" {
			byCapacity = c
		}
	}
	if byCapacity == nil {
		t.Fatal("no claim static-mig-by-capacity in testdata/claims.yaml")
	}
	onDevice := map[string]int{}
	for i := range 3 * len(pool.Devices) {
		c := byCapacity.DeepCopy()
		c.Name, c.UID = fmt.Sprintf("share-%d", i), types.UID(fmt.Sprintf("uid-share-%d", i))
		results, err := n.Allocate(context.Background(), c)
		if err != nil {
			t.Fatalf("claim %d: %v", i, err)
		}
		onDevice[results[0].Devices.Results[0].Device]++
	}
	for name, k := range onDevice {
		if k != 3 {
			t.Errorf("%s shared by %d claims, want 3", name, k)
		}
	}
	if _, err := n.Allocate(context.Background(), byCapacity); !errors.Is(err, schedsim.ErrUnsatisfiable) {
		t.Errorf("a claim beyond every share: %v, want unsatisfiable", err)
	}
}

// The scheduler's allocator gives a device on a cordoned GPU only to a
// request that tolerates the cordon's own taint: tolerating unhealthy
// devices is not enough (issue 29, defect 4b).
func TestCordonedDevicesNeedTheirToleration(t *testing.T) {
	_, pool := simPool(t, "pcie-4gpu", false)
	for i := range pool.Devices {
		pool.Devices[i].Cordoned = "cordoned"
	}
	n := schedsim.New("node-a", devicemodel.DriverName, devicemodel.Resources("node-a", pool, 1, devicemodel.Dropped{}), deviceClasses(t))
	for _, tt := range []struct {
		name string
		keys []string
		ok   bool
	}{
		{"no toleration", nil, false},
		{"the unhealthy taint", []string{devicemodel.TaintUnhealthy}, false},
		{"the cordon", []string{devicemodel.TaintCordoned}, true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			r := resourceapi.DeviceRequest{Name: "gpu", Exactly: &resourceapi.ExactDeviceRequest{DeviceClassName: "gpu.nvidia.com"}}
			for _, k := range tt.keys {
				r.Exactly.Tolerations = append(r.Exactly.Tolerations, resourceapi.DeviceToleration{Key: k, Operator: resourceapi.DeviceTolerationOpExists})
			}
			c := &resourceapi.ResourceClaim{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{r}}}}
			c.Name, c.Namespace, c.UID = "c", "default", types.UID("uid-"+tt.name)
			schedsim.Default(c)
			_, err := n.Allocate(context.Background(), c)
			if tt.ok && err != nil || !tt.ok && !errors.Is(err, schedsim.ErrUnsatisfiable) {
				t.Errorf("Allocate: %v; want allocated %v", err, tt.ok)
			}
			n.Release()
		})
	}
}

// With dra.migDeviceAttributes as deploy/examples/mig-h100-balanced-lean.yaml
// keeps them, MIG claims by profile, by capacity and on one GPU still
// allocate; one that selects a MIG device by an attribute left out fails
// as a key nobody publishes does, while whole GPUs keep it.
func TestClaimsOnLeanMIGDevices(t *testing.T) {
	keep := []string{"uuid", "parentUUID", "productName", "cudaComputeCapability", "resource.kubernetes.io/pcieRoot", "resource.kubernetes.io/numaNode"}
	byName := map[string]*resourceapi.ResourceClaim{}
	for _, c := range readClaims(t, "claims.yaml") {
		byName[c.Name] = c
	}
	byArchitecture := byName["mig-by-profile"].DeepCopy()
	byArchitecture.Name, byArchitecture.UID = "mig-by-architecture", "uid-mig-by-architecture"
	byArchitecture.Spec.Devices.Requests[0].Exactly.Selectors[0].CEL.Expression = "device.attributes['gpu.nvidia.com'].architecture == 'Hopper'"
	for _, tt := range []struct {
		claim   *resourceapi.ResourceClaim
		profile string // the simulated node
		devices int    // 0: the allocator's error
	}{
		{byName["mig-by-profile"], "dgx-h100-mig", 1},
		{byName["static-mig-by-capacity"], "dgx-h100-mig", 1},
		{byName["two-mig-on-one-gpu"], "dgx-h100-mig", 2},
		{byName["gpu-by-product-and-architecture"], "dgx-h100", 1},
		{byArchitecture, "dgx-h100-mig", 0},
	} {
		t.Run(tt.claim.Name, func(t *testing.T) {
			_, pool := simPool(t, tt.profile, false)
			pool.MIGAttributes = keep
			n := schedsim.New("node-a", devicemodel.DriverName, devicemodel.Resources("node-a", pool, 1, devicemodel.Dropped{}), deviceClasses(t))
			results, err := n.Allocate(context.Background(), tt.claim)
			switch {
			case tt.devices == 0:
				if err == nil || errors.Is(err, schedsim.ErrUnsatisfiable) {
					t.Fatalf("allocated %v (%v), want the allocator's error", results, err)
				}
			case err != nil:
				t.Fatalf("Allocate: %v", err)
			case len(results[0].Devices.Results) != tt.devices:
				t.Fatalf("%d devices, want %d", len(results[0].Devices.Results), tt.devices)
			}
		})
	}
	_, full := simPool(t, "dgx-h100-mig", false)
	n := schedsim.New("node-a", devicemodel.DriverName, devicemodel.Resources("node-a", full, 1, devicemodel.Dropped{}), deviceClasses(t))
	if _, err := n.Allocate(context.Background(), byArchitecture); err != nil {
		t.Errorf("%s with every attribute: %v", byArchitecture.Name, err)
	}
}
