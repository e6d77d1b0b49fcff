package mig

import (
	"math/rand/v2"
	"slices"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// TestCompareWithClearAndRecreate runs 20 layout edits on sim:dgx-h100 and
// counts the instances destroyed by the planner against mig-parted's way
// (every GPU whose layout changed is cleared and recreated).
func TestCompareWithClearAndRecreate(t *testing.T) {
	layouts := []string{
		"7x1g.10gb", "3x2g.20gb", "2x3g.40gb", "1x7g.80gb",
		"1x4g.40gb 1x3g.40gb", "1x3g.40gb 1x2g.20gb 2x1g.10gb",
		"1x3g.40gb 4x1g.10gb", "2x2g.20gb 3x1g.10gb", "4x1g.20gb",
		"1x4g.40gb 3x1g.10gb", "5x1g.10gb", "1x3g.40gb 2x1g.10gb",
	}
	r := newRig(t, "dgx-h100", sim.WithMIGEnabled())
	rng := rand.New(rand.NewPCG(7, 20))
	cur := make([]string, 8)
	for i := range cur {
		cur[i] = layouts[0]
		r.converge(i, want(cur[i]), nil)
	}
	ours, theirs, changedGPUs := 0, 0, 0
	var times []time.Duration
	for edit := range 20 {
		// Each edit changes one to three GPUs' layouts.
		next := slices.Clone(cur)
		for range 1 + rng.IntN(3) {
			next[rng.IntN(8)] = layouts[rng.IntN(len(layouts))]
		}
		start := time.Now()
		for i := range 8 {
			if next[i] == cur[i] {
				continue
			}
			changedGPUs++
			theirs += len(r.gpu(i).Instances)
			p, st := r.converge(i, want(next[i]), nil)
			if st.Phase != PhaseApplied {
				t.Fatalf("edit %d gpu %d: %+v", edit, i, st)
			}
			ours += p.Destroys()
			if got := counts(r.gpu(i)); !equalCounts(got, want(next[i]).Counts) {
				t.Fatalf("edit %d gpu %d: %v, want %s", edit, i, got, next[i])
			}
		}
		times = append(times, time.Since(start))
		cur = next
	}
	slices.Sort(times)
	t.Logf("20 edits, %d GPU layout changes: destroyed %d instances (clear-and-recreate: %d); apply time per edit median %v, max %v",
		changedGPUs, ours, theirs, times[len(times)/2], times[len(times)-1])
	if ours > theirs {
		t.Errorf("planner destroyed %d, more than clear-and-recreate's %d", ours, theirs)
	}
	if ours == theirs {
		t.Errorf("planner saved nothing over clear-and-recreate (%d)", ours)
	}
}
