package mig

import (
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// oracle lists every set of pairwise disjoint (profile, placement) pairs: a
// different algorithm from place's ordered search, used to check it.
func oracle(order []Profile) [][]newInstance {
	var all []newInstance
	for _, p := range order {
		for _, pl := range p.Placements {
			all = append(all, newInstance{p, pl})
		}
	}
	var out [][]newInstance
	var rec func(i int, occ uint32, cur []newInstance)
	rec = func(i int, occ uint32, cur []newInstance) {
		if i == len(all) {
			out = append(out, slices.Clone(cur))
			return
		}
		rec(i+1, occ, cur)
		if occ&mask(all[i].pl) == 0 {
			rec(i+1, occ|mask(all[i].pl), append(cur, all[i]))
		}
	}
	rec(0, 0, nil)
	return out
}

func TestPlacementSearchMatchesBruteForce(t *testing.T) {
	for _, node := range []string{"dgx-a100", "dgx-h100"} {
		t.Run(node, func(t *testing.T) {
			r := newRig(t, node, sim.WithMIGEnabled())
			ps := r.profiles(0)
			order := ps.ordered()
			sets := oracle(order)
			rng := rand.New(rand.NewPCG(1, 2))
			checked, feasible := 0, 0
			for range 400 {
				// Split a random valid set into kept (fixed) and needed ones;
				// add a random extra need that may or may not fit.
				base := sets[rng.IntN(len(sets))]
				var occ uint32
				needCounts := map[string]int{}
				for _, in := range base {
					if rng.IntN(2) == 0 {
						occ |= mask(in.pl)
					} else {
						needCounts[in.profile.Name]++
					}
				}
				if rng.IntN(2) == 0 {
					needCounts[order[rng.IntN(len(order))].Name]++
				}
				got, ok := place(ps, occ, need(ps, needCounts, nil))
				// Brute force: any set disjoint from occ with exactly those counts.
				var bestScore []int
				for _, s := range sets {
					c := map[string]int{}
					var m uint32
					for _, in := range s {
						c[in.profile.Name]++
						m |= mask(in.pl)
					}
					if m&occ != 0 || !equalCounts(c, needCounts) {
						continue
					}
					if sc := usability(order, occ|m); bestScore == nil || better(sc, bestScore) {
						bestScore = sc
					}
				}
				checked++
				if ok != (bestScore != nil) {
					t.Fatalf("occ %08b need %v: search found=%t, brute force found=%t", occ, needCounts, ok, bestScore != nil)
				}
				if !ok {
					continue
				}
				feasible++
				if !slices.Equal(got.score, bestScore) {
					t.Fatalf("occ %08b need %v: search score %v, best %v", occ, needCounts, got.score, bestScore)
				}
				var m uint32
				for _, in := range got.create {
					if (m|occ)&mask(in.pl) != 0 {
						t.Fatalf("search overlaps: %v", got.create)
					}
					m |= mask(in.pl)
				}
			}
			if feasible == 0 || feasible == checked {
				t.Fatalf("cases not mixed: %d feasible of %d", feasible, checked)
			}
		})
	}
}

func equalCounts(a, b map[string]int) bool {
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	for k, v := range b {
		if a[k] != v {
			return false
		}
	}
	return true
}
