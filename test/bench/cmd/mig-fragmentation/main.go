// Command mig-fragmentation measures how placement choice fragments a MIG GPU
// under a random stream of MIG device requests and releases: how often a
// request fails although the GPU has enough free memory and compute slices
// for it, when placements are chosen
//
//   - first-fit, lowest start first: the first free placement of the
//     profile in a ResourceSlice listing placements in ascending order (the
//     scheduler's allocator tries devices in a slice's order and takes the
//     first that fits);
//   - first-fit, highest first: the same with placements listed from the top
//     down, the order gpu-agent's DRA driver publishes them in;
//   - by gpu-agent's planner (mig.MakePlan), which keeps the existing
//     instances and searches the placement that leaves the most usable space.
//
// Usage: go run ./cmd/mig-fragmentation [-profile dgx-h100] [-runs 2000] [-steps 200] [-seed 1]
package main

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"slices"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

type instance struct {
	profile string
	pl      gpu.Placement
}

type strategy struct {
	name  string
	place func(profiles mig.Profiles, have []instance, want string) (gpu.Placement, bool)
}

func main() {
	profile := flag.String("profile", "dgx-h100", "simulated node whose GPU 0's MIG profiles to use")
	runs := flag.Int("runs", 2000, "random request streams")
	steps := flag.Int("steps", 200, "requests and releases per stream")
	seed := flag.Uint64("seed", 1, "random seed")
	flag.Parse()
	profiles, err := loadProfiles(*profile)
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	// Requests: mostly small slices, some large, as on a shared inference node.
	var names []string
	var weights []int
	for _, p := range profiles {
		if p.Info.SliceCount == 0 || len(p.Placements) == 0 || p.Name[len(p.Name)-3:] == "+me" {
			continue
		}
		names = append(names, p.Name)
	}
	slices.Sort(names)
	for _, n := range names {
		weights = append(weights, 8/int(profiles[n].Info.SliceCount)+1)
	}
	strategies := []strategy{
		{"first-fit, lowest start first", firstFit(false)},
		{"first-fit, highest first (as published)", firstFit(true)},
		{"gpu-agent planner (mig.MakePlan)", planner},
	}
	fmt.Printf("%s GPU 0, %d streams x %d steps, seed %d; requests weighted %v over %v\n", *profile, *runs, *steps, *seed, weights, names)
	fmt.Printf("%-40s %10s %14s %16s %16s\n", "placement", "requests", "failed w/ room", "4-slice failed", "7-slice failed")
	for _, s := range strategies {
		rng := rand.New(rand.NewPCG(*seed, 42)) // the same streams for every strategy
		var total, failRoom, big4, big4Fail, big7, big7Fail int
		for range *runs {
			var have []instance
			for range *steps {
				if len(have) > 0 && rng.IntN(2) == 0 {
					i := rng.IntN(len(have))
					have = slices.Delete(have, i, i+1)
					continue
				}
				want := pick(rng, names, weights)
				p := profiles[want]
				total++
				room := hasRoom(profiles, have, p)
				pl, ok := s.place(profiles, have, want)
				if p.Info.SliceCount == 4 {
					big4++
				}
				if p.Info.SliceCount == 7 {
					big7++
				}
				if !ok {
					if room {
						failRoom++
						if p.Info.SliceCount == 4 {
							big4Fail++
						}
						if p.Info.SliceCount == 7 {
							big7Fail++
						}
					}
					continue
				}
				have = append(have, instance{want, pl})
			}
		}
		fmt.Printf("%-40s %10d %13.2f%% %15.2f%% %15.2f%%\n", s.name, total, pct(failRoom, total), pct(big4Fail, big4), pct(big7Fail, big7))
	}
}

func pct(a, b int) float64 {
	if b == 0 {
		return 0
	}
	return 100 * float64(a) / float64(b)
}

func pick(rng *rand.Rand, names []string, weights []int) string {
	sum := 0
	for _, w := range weights {
		sum += w
	}
	r := rng.IntN(sum)
	for i, w := range weights {
		if r < w {
			return names[i]
		}
		r -= w
	}
	return names[len(names)-1]
}

func occupied(have []instance) uint32 {
	var m uint32
	for _, h := range have {
		m |= ((1 << uint(h.pl.Size)) - 1) << uint(h.pl.Start)
	}
	return m
}

// hasRoom: enough free memory slices and compute slices for p, placed or not.
func hasRoom(profiles mig.Profiles, have []instance, p mig.Profile) bool {
	memTotal, compTotal := 0, uint32(0)
	for _, q := range profiles {
		for _, pl := range q.Placements {
			memTotal = max(memTotal, pl.Start+pl.Size)
		}
		compTotal = max(compTotal, q.Info.SliceCount)
	}
	usedMem, usedComp := 0, uint32(0)
	for _, h := range have {
		usedMem += h.pl.Size
		usedComp += profiles[h.profile].Info.SliceCount
	}
	return memTotal-usedMem >= p.Placements[0].Size && compTotal-usedComp >= p.Info.SliceCount
}

func firstFit(fromTop bool) func(mig.Profiles, []instance, string) (gpu.Placement, bool) {
	return func(profiles mig.Profiles, have []instance, want string) (gpu.Placement, bool) {
		occ := occupied(have)
		pls := slices.Clone(profiles[want].Placements)
		if fromTop {
			slices.Reverse(pls)
		}
		used := uint32(0)
		for _, h := range have {
			used += profiles[h.profile].Info.SliceCount
		}
		if used+profiles[want].Info.SliceCount > maxCompute(profiles) {
			return gpu.Placement{}, false
		}
		for _, pl := range pls {
			if occ&(((1<<uint(pl.Size))-1)<<uint(pl.Start)) == 0 {
				return pl, true
			}
		}
		return gpu.Placement{}, false
	}
}

func maxCompute(profiles mig.Profiles) uint32 {
	var m uint32
	for _, p := range profiles {
		m = max(m, p.Info.SliceCount)
	}
	return m
}

// planner asks mig.MakePlan for the layout with one more instance of want,
// every existing instance held (it must not move).
func planner(profiles mig.Profiles, have []instance, want string) (gpu.Placement, bool) {
	g := gpu.GPU{Index: 0, UUID: "GPU-bench", MIGCapable: true, MIG: gpu.MIGMode{Current: true, Pending: true}}
	counts := map[string]int{want: 1}
	held := map[string]string{}
	for i, h := range have {
		uuid := fmt.Sprintf("MIG-%d", i)
		p := profiles[h.profile]
		g.Instances = append(g.Instances, gpu.MIGInstance{UUID: uuid, Profile: h.profile, GIProfileID: p.Index, GI: i + 1, Placement: h.pl})
		counts[h.profile]++
		held[uuid] = "a claim"
	}
	plan, st, err := mig.MakePlan(g, profiles, mig.Want{MIGEnabled: true, Counts: counts}, held)
	if err != nil || st.Phase == mig.PhaseFailed || st.Phase == mig.PhasePending {
		return gpu.Placement{}, false
	}
	for _, s := range plan.Steps {
		if s.Op == mig.OpCreate && s.Profile == want {
			return s.Placement, true
		}
	}
	return gpu.Placement{}, false
}

func loadProfiles(profile string) (mig.Profiles, error) {
	n, err := sim.New(profile)
	if err != nil {
		return nil, err
	}
	n.Init()
	dev, ret := n.DeviceGetHandleByIndex(0)
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("device 0: %v", ret)
	}
	mem, ret := dev.GetMemoryInfo()
	if ret != nvml.SUCCESS {
		return nil, fmt.Errorf("memory: %v", ret)
	}
	return mig.QueryProfiles(dev, mem.Total)
}
