package devicemodel

import (
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/mig"
)

// The counters a dynamic GPU publishes, pruned, allow exactly the sets of
// MIG devices the GPU can hold together: every set the scheduler could
// allocate from the partitions is one NVML (the simulated GPU's placement
// and engine rules) creates, and every set NVML creates is one the scheduler
// allows. Each MIG model of the simulated nodes, free and with random
// placements blocked and random allow-lists, and the whole GPU excludes
// every partition.
func TestPartitionCountersExactAgainstNVML(t *testing.T) {
	seen := map[string]bool{}
	rounds := 0 // rounds with a choice to check: more than the empty set
	for _, p := range sim.Profiles() {
		n, inv := simtest.NodeInventory(t, p.Name, sim.WithMIGEnabled())
		if len(inv.GPUs) == 0 || !inv.GPUs[0].MIGCapable || seen[inv.GPUs[0].Name] {
			continue
		}
		g := inv.GPUs[0]
		seen[g.Name] = true
		dev, ret := n.DeviceGetHandleByIndex(0)
		if ret != nvml.SUCCESS {
			t.Fatal(ret)
		}
		profiles, err := mig.QueryProfiles(dev, g.MemoryBytes)
		if err != nil {
			t.Fatal(err)
		}
		rng := rand.New(rand.NewPCG(uint64(len(g.Name)), 7))
		for round := range 16 {
			t.Run(fmt.Sprintf("%s/%d", p.Name, round), func(t *testing.T) {
				// Instances no claim made, of random profiles, block their
				// placements; the GPU is read again with them.
				var made []nvml.GpuInstance
				if round > 0 {
					made = blockRandom(t, rng, dev, profiles)
				}
				defer func() {
					for _, gi := range made {
						gi.Destroy()
					}
				}()
				inv, err := gpu.New(n, gpu.Options{})
				if err != nil {
					t.Fatal(err)
				}
				g := inv.GPUs[0]
				dyn := Dynamic{GPU: g, Profiles: profiles, Whole: len(made) == 0}
				for _, gi := range g.GIsWithoutCI {
					dyn.Blocked = append(dyn.Blocked, gi.Placement)
				}
				if round >= 8 {
					names := slices.Sorted(maps.Keys(profiles))
					dyn.Offered = []string{names[rng.IntN(len(names))], names[rng.IntN(len(names))]}
				}
				// A claim made a profile of one instance per GPU (offered at
				// its last placement) at another placement: it stays offered
				// beside the last, on counters that keep the two apart.
				var kept string
				if round%2 == 1 || round == 0 {
					for _, name := range slices.Sorted(maps.Keys(profiles)) {
						if p := profiles[name]; p.Info.InstanceCount == 1 && len(p.Placements) > 1 && dyn.Offered == nil {
							pl := p.Placements[rng.IntN(len(p.Placements)-1)]
							dyn.Made = append(dyn.Made, ProfileAt{Profile: name, Placement: pl})
							kept = PartitionName(0, name, pl.Start)
							break
						}
					}
				}
				devs, set := Partitions(dyn, Device{})
				if kept != "" && len(dyn.Blocked) == 0 && !slices.ContainsFunc(devs, func(d Device) bool { return d.Name == kept }) {
					t.Errorf("%s, made by a claim, is not offered: %v", kept, devs)
				}
				for _, d := range devs {
					if d.Partition && profiles[d.Profile].Info.InstanceCount == 1 && d.Name != kept &&
						d.Placement != profiles[d.Profile].Placements[len(profiles[d.Profile].Placements)-1] {
						t.Errorf("%s offered: one instance fits, and it is not at the last placement", d.Name)
					}
				}
				if checkExact(t, dev, devs, set) > 1 {
					rounds++
				}
			})
		}
	}
	if len(seen) < 4 || rounds < 8*len(seen) {
		t.Fatalf("%d MIG models checked (%v), %d rounds with more than one set: the check says little", len(seen), seen, rounds)
	}
}

// blockRandom makes up to two GPU instances of random profiles at random
// free placements.
func blockRandom(t *testing.T, rng *rand.Rand, dev nvml.Device, ps mig.Profiles) []nvml.GpuInstance {
	t.Helper()
	names := slices.Sorted(maps.Keys(ps))
	var out []nvml.GpuInstance
	for range 1 + rng.IntN(2) {
		p := ps[names[rng.IntN(len(names))]]
		if len(p.Placements) == 0 {
			continue
		}
		b := p.Placements[rng.IntN(len(p.Placements))]
		info, ret := dev.GetGpuInstanceProfileInfo(p.Index)
		if ret != nvml.SUCCESS {
			t.Fatalf("profile %s: %v", p.Name, ret)
		}
		pl := nvml.GpuInstancePlacement{Start: uint32(b.Start), Size: uint32(b.Size)}
		if gi, ret := dev.CreateGpuInstanceWithPlacement(&info, &pl); ret == nvml.SUCCESS {
			out = append(out, gi)
		}
	}
	return out
}

// checkExact compares the sets of partitions the counters allow with those
// NVML creates, and returns how many sets there are.
func checkExact(t *testing.T, dev nvml.Device, devs []Device, set CounterSet) int {
	t.Helper()
	var parts []Device
	var whole *Device
	for i := range devs {
		if devs[i].Partition {
			parts = append(parts, devs[i])
		} else {
			whole = &devs[i]
		}
	}
	if whole != nil {
		for _, p := range parts {
			if fitsCounters(set.Counters, []Device{*whole, p}) {
				t.Errorf("the whole GPU and %s fit the counters %v together", p.Name, set.Counters)
			}
		}
	}
	model := map[string]bool{}
	var walk func(from int, chosen []Device)
	walk = func(from int, chosen []Device) {
		model[setKey(chosen)] = true
		for i := from; i < len(parts); i++ {
			next := append(slices.Clone(chosen), parts[i])
			if fitsCounters(set.Counters, next) {
				walk(i+1, next)
			}
		}
	}
	walk(0, nil)

	// NVML's sets of the offered partitions, beside the blocking instances.
	truth := map[string]bool{}
	var nwalk func(from int, chosen []Device)
	nwalk = func(from int, chosen []Device) {
		truth[setKey(chosen)] = true
		for i := from; i < len(parts); i++ {
			info, ret := dev.GetGpuInstanceProfileInfo(parts[i].ProfileIndex)
			if ret != nvml.SUCCESS {
				t.Fatalf("profile %s: %v", parts[i].Profile, ret)
			}
			pl := nvml.GpuInstancePlacement{Start: uint32(parts[i].Placement.Start), Size: uint32(parts[i].Placement.Size)}
			gi, ret := dev.CreateGpuInstanceWithPlacement(&info, &pl)
			if ret != nvml.SUCCESS {
				continue
			}
			nwalk(i+1, append(slices.Clone(chosen), parts[i]))
			if ret := gi.Destroy(); ret != nvml.SUCCESS {
				t.Fatalf("destroy %s: %v", parts[i].Name, ret)
			}
		}
	}
	nwalk(0, nil)
	for k := range model {
		if !truth[k] {
			t.Errorf("the counters %v allow {%s}, which NVML cannot hold", set.Counters, k)
		}
	}
	for k := range truth {
		if !model[k] {
			t.Errorf("NVML holds {%s}, which the counters %v refuse", k, set.Counters)
		}
	}
	return len(model)
}

func fitsCounters(limits map[string]int64, devs []Device) bool {
	sum := map[string]int64{}
	for _, d := range devs {
		for name, v := range d.Consumes {
			limit, ok := limits[name]
			if !ok {
				return false // a counter the set does not have: the API server refuses the slice
			}
			if sum[name] += v; sum[name] > limit {
				return false
			}
		}
	}
	return true
}

func setKey(devs []Device) string {
	names := make([]string, len(devs))
	for i, d := range devs {
		names[i] = d.Name
	}
	slices.Sort(names)
	return strings.Join(names, ",")
}
