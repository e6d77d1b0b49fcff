package bench

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"math/bits"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/dra/schedsim"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/plugin/topology"
)

var draTable = flag.String("dra-table", "", "run the DRA topology comparison and write its markdown table to this file")

// draProfiles are the simulated nodes with partial NVLink (cube-mesh islands)
// and none (PCIe switches only).
var draProfiles = []string{"two-islands-16", "dgx1-v100", "pcie-8gpu", "pcie-4gpu"}

// gpuClass is the DeviceClass NVIDIA's driver and gpu-agent install for
// whole GPUs.
var gpuClass = &resourceapi.DeviceClass{
	ObjectMeta: metav1.ObjectMeta{Name: "gpu.nvidia.com"},
	Spec: resourceapi.DeviceClassSpec{Selectors: []resourceapi.DeviceSelector{{CEL: &resourceapi.CELDeviceSelector{
		Expression: "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
	}}}},
}

// countClaim asks for n whole GPUs, optionally all with one value of
// matchAttribute.
func countClaim(n int, matchAttribute string) *resourceapi.ResourceClaim {
	c := &resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{Name: "c", Namespace: "default", UID: "uid-c"},
		Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: []resourceapi.DeviceRequest{{
			Name: "gpus", Exactly: &resourceapi.ExactDeviceRequest{
				DeviceClassName: gpuClass.Name, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: int64(n),
			},
		}}}},
	}
	if matchAttribute != "" {
		a := resourceapi.FullyQualifiedName(matchAttribute)
		c.Spec.Devices.Constraints = []resourceapi.DeviceConstraint{{Requests: []string{"gpus"}, MatchAttribute: &a}}
	}
	return c
}

// draNode is one simulated node, its scorer and its pool in two orders.
type draNode struct {
	name            string
	inv             *gpu.Inventory
	scorer          *topology.Scorer
	byIndex, ranked *devicemodel.Pool
}

func loadDRA(t *testing.T, profile string) draNode {
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
	devs := devicemodel.Devices(inv, nil, nil)
	return draNode{
		name: profile, inv: inv, scorer: topology.FromInventory(inv, topology.PolicyTopology),
		byIndex: &devicemodel.Pool{Devices: devs},
		ranked:  &devicemodel.Pool{Devices: devs, GPUOrder: devicemodel.PublishOrder(inv)},
	}
}

// lanes is the NVLink lanes inside a set of GPU positions.
func (n draNode) lanes(set []int) int {
	l := 0
	for i, a := range set {
		for _, b := range set[i+1:] {
			l += n.inv.Topology.Lanes(a, b)
		}
	}
	return l
}

// draOutcome counts, for one way of allocating, the requests whose set has
// the most NVLink lanes possible and those with the best full score.
type draOutcome struct{ nvlinkOpt, scoreOpt, failed int }

func (o *draOutcome) add(n draNode, set []int, bestLanes int, bestScore int64) {
	if set == nil {
		o.failed++
		return
	}
	if n.lanes(set) == bestLanes {
		o.nvlinkOpt++
	}
	if n.scorer.Score(set) == bestScore {
		o.scoreOpt++
	}
}

func (n draNode) optimal(set []int, bestLanes int, bestScore int64) string {
	if set != nil && n.lanes(set) == bestLanes && n.scorer.Score(set) == bestScore {
		return "yes"
	}
	return "no"
}

// schedule allocates claim on pool with the GPUs outside avail held, and
// returns the positions it got (nil: unsatisfiable).
func schedule(t *testing.T, n draNode, pool *devicemodel.Pool, avail uint64, claim *resourceapi.ResourceClaim) []int {
	t.Helper()
	node := schedsim.New("node-a", devicemodel.DriverName, devicemodel.Resources("node-a", pool, 1, devicemodel.Dropped{}), []*resourceapi.DeviceClass{gpuClass})
	for i, g := range n.inv.GPUs {
		if avail&(1<<i) == 0 {
			node.Hold(devicemodel.DriverName, "node-a", devicemodel.GPUName(g.Index))
		}
	}
	results, err := node.Allocate(context.Background(), claim)
	if errors.Is(err, schedsim.ErrUnsatisfiable) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var set []int
	for _, r := range results[0].Devices.Results {
		var idx int
		if _, err := fmt.Sscanf(r.Device, "gpu-%d", &idx); err != nil {
			t.Fatal(err)
		}
		set = append(set, idx) // sims enumerate every GPU: index = position
	}
	return set
}

// draMasks are the availability masks a size is tried on: the free node,
// then every mask with at least size GPUs free (8 GPUs or fewer) or masks16
// random ones (16 GPUs).
func draMasks(gpus, size int, r *rand.Rand) []uint64 {
	all := uint64(1)<<gpus - 1
	out := []uint64{all}
	if gpus <= 8 {
		for m := uint64(1); m < all; m++ {
			if bits.OnesCount64(m) >= size {
				out = append(out, m)
			}
		}
		return out
	}
	for len(out) < 1+*masks16 {
		m := r.Uint64() & all
		if bits.OnesCount64(m) >= size && m != all {
			out = append(out, m)
		}
	}
	return out
}

func pctOf(k, n int) string {
	if n == 0 {
		return "–"
	}
	return fmt.Sprintf("%.1f%%", 100*float64(k)/float64(n))
}

// TestDRATopology compares, on simulated nodes with partial NVLink or none,
// the GPU sets a "count: N" claim gets from the scheduler's allocator (in
// slice order, as gpu-agent publishes now and as it published before: by
// GPU index; and with matchAttribute nvlinkClique) with the device plugin's
// GetPreferredAllocation answer, against the best set possible.
func TestDRATopology(t *testing.T) {
	if *draTable == "" {
		t.Skip("run with -dra-table FILE")
	}
	r := rand.New(rand.NewPCG(2026, 24))
	var b strings.Builder
	b.WriteString("| node | size | requests | NVLink-optimal: GetPreferredAllocation | allocator, GPUs by index | allocator, best set first | allocator + matchAttribute nvlinkClique (unsatisfiable) | free node optimal: by index / best set first | best score: GetPreferredAllocation | allocator by index | allocator best set first | allocator + matchAttribute pcieRoot (unsatisfiable) |\n")
	b.WriteString("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|\n")
	for _, name := range draProfiles {
		n := loadDRA(t, name)
		gpus := len(n.inv.GPUs)
		preferrer := topology.NewGPUPreferrer(n.inv, topology.PolicyTopology)
		for size := 2; size <= min(8, gpus); size++ {
			var plugin, byIndex, ranked, clique, root draOutcome
			freeIndex, freeRanked := "no", "no"
			masks := draMasks(gpus, size, r)
			for k, avail := range masks {
				best, err := n.scorer.Best(avail, 0, size)
				if err != nil {
					t.Fatal(err)
				}
				bestLanes, bestScore := n.lanes(best), n.scorer.Score(best)

				var ids []string
				for i, g := range n.inv.GPUs {
					if avail&(1<<i) != 0 {
						ids = append(ids, g.UUID)
					}
				}
				got, err := preferrer.Preferred(ids, nil, size)
				if err != nil {
					t.Fatal(err)
				}
				var set []int
				for _, id := range got {
					g, _ := n.inv.GPUByUUID(id)
					set = append(set, g.Index)
				}
				plugin.add(n, set, bestLanes, bestScore)

				is := schedule(t, n, n.byIndex, avail, countClaim(size, ""))
				byIndex.add(n, is, bestLanes, bestScore)
				rs := schedule(t, n, n.ranked, avail, countClaim(size, ""))
				ranked.add(n, rs, bestLanes, bestScore)
				if k == 0 {
					freeIndex, freeRanked = n.optimal(is, bestLanes, bestScore), n.optimal(rs, bestLanes, bestScore)
				}
				clique.add(n, schedule(t, n, n.ranked, avail, countClaim(size, "gpu.nvidia.com/nvlinkClique")), bestLanes, bestScore)
				root.add(n, schedule(t, n, n.ranked, avail, countClaim(size, "resource.kubernetes.io/pcieRoot")), bestLanes, bestScore)
			}
			req := len(masks)
			fmt.Fprintf(&b, "| %s | %d | %d | %s | %s | %s | %s (%s) | %s / %s | %s | %s | %s | %s (%s) |\n", name, size, req,
				pctOf(plugin.nvlinkOpt, req), pctOf(byIndex.nvlinkOpt, req), pctOf(ranked.nvlinkOpt, req),
				pctOf(clique.nvlinkOpt, req), pctOf(clique.failed, req), freeIndex, freeRanked,
				pctOf(plugin.scoreOpt, req), pctOf(byIndex.scoreOpt, req), pctOf(ranked.scoreOpt, req),
				pctOf(root.scoreOpt, req), pctOf(root.failed, req))
			t.Logf("%s size %d done", name, size)
		}
	}
	if err := os.WriteFile(*draTable, []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
}
