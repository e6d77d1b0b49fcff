package agent

import (
	"slices"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

const migOnDemandSpare = "version: v1\nconfigs:\n  default:\n    dra:\n      migOnDemand: {enabled: true, spareGPUs: 1}\n"

// openGPUs sums up which GPUs of a pool offer partitions: open (untainted)
// and closing (tainted gpu.nvidia.com/closing), by index; and the GPUs
// whose whole device draws on counters.
func openGPUs(p *devicemodel.Pool) (open, closing, counting []int) {
	add := func(s *[]int, i int) {
		if !slices.Contains(*s, i) {
			*s = append(*s, i)
		}
	}
	for _, d := range p.Devices {
		switch {
		case d.Partition && d.Closing:
			add(&closing, d.ParentIndex)
		case d.Partition:
			add(&open, d.ParentIndex)
		case d.Type == devicemodel.TypeGPU && len(d.Consumes) > 0:
			add(&counting, d.Index)
		}
	}
	for _, s := range [][]int{open, closing, counting} {
		slices.Sort(s)
	}
	return open, closing, counting
}

// With spareGPUs: 1 on a DGX H100 (publish order 0 1 2 3 5 4 6 7), GPU 7
// is the spare. Right after a start every GPU may have offered partitions,
// so the others close through the grace; a claim taking the spare opens the
// next one at once; a claim given a partition of a GPU closed since is still
// prepared; a freed spare makes one surplus, which closes a grace later; a
// GPU a claim holds whole stops offering partitions at once; a cordoned
// spare is replaced.
func TestDRAMIGOnDemandSpares(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	h := newHarness(t, node, withDRA(rec), withMIG())
	check := func(step string, wantOpen, wantClosing []int) {
		t.Helper()
		open, closing, counting := openGPUs(rec.last())
		if !slices.Equal(open, wantOpen) || !slices.Equal(closing, wantClosing) {
			t.Fatalf("%s: GPUs with partitions %v, closing %v; want %v, closing %v", step, open, closing, wantOpen, wantClosing)
		}
		// Only a GPU that offers partitions has a counter set, drawn on by
		// its whole device when that is offered.
		all := append(slices.Clone(open), closing...)
		if len(rec.last().CounterSets) != len(all) {
			t.Errorf("%s: %d counter sets for %d GPUs with partitions", step, len(rec.last().CounterSets), len(all))
		}
		for _, i := range counting {
			if !slices.Contains(all, i) {
				t.Errorf("%s: GPU %d is offered whole drawing on counters, without partitions", step, i)
			}
		}
	}

	h.config(migOnDemandSpare)
	check("at start", []int{7}, []int{0, 1, 2, 3, 4, 5, 6})
	st := h.a.Status().DRA
	if len(st.OpenGPUs) != 8 || len(st.Closing) != 7 || st.Closing[0].GPU != 0 || !st.Closing[0].At.Equal(h.clock.Now().Add(closeGrace)) {
		t.Errorf("/status at start: open %v, closing %+v; want all 8 open, 0-6 closing a grace from now", st.OpenGPUs, st.Closing)
	}
	h.clock.Advance(closeGrace - time.Second)
	h.step(Tick{})
	check("before the grace is over", []int{7}, []int{0, 1, 2, 3, 4, 5, 6})
	h.clock.Advance(time.Second)
	h.step(Tick{})
	check("after the grace", []int{7}, nil)
	if st := h.a.Status().DRA; !slices.Equal(st.OpenGPUs, []int{7}) || len(st.Closing) != 0 {
		t.Errorf("/status after the grace: open %v, closing %+v; want GPU 7 alone", st.OpenGPUs, st.Closing)
	}
	if whole, _ := partitionsOf(rec.last(), 0); !whole {
		t.Fatal("GPU 0 is not offered whole")
	}

	// The spare is taken: GPU 6 opens at once.
	if r := h.prepare(claim("uid-a", "a", "gpu-7-mig-1g10gb-6"))["uid-a"]; r.Err != nil {
		t.Fatalf("claim on the spare: %v", r.Err)
	}
	check("spare taken", []int{6, 7}, nil)

	// The scheduler gave a claim a partition of GPU 0 while it was
	// published: prepared all the same, and GPU 0 now has a MIG device.
	if r := h.prepare(claim("uid-b", "b", "gpu-0-mig-3g40gb-4"))["uid-b"]; r.Err != nil {
		t.Fatalf("claim on a GPU closed since: %v", r.Err)
	}
	check("partition of a closed GPU prepared", []int{0, 6, 7}, nil)

	// GPU 7's claim goes: 7 and 6 are both free and open, one too many.
	// 6 closes (7 comes later in the publish order), a grace later.
	h.unprepare(dra.ClaimRef{UID: "uid-a", Namespace: "default", Name: "a"})
	check("spare freed", []int{0, 7}, []int{6})
	h.clock.Advance(closeGrace)
	h.step(Tick{})
	check("surplus closed", []int{0, 7}, nil)

	// A claim holds the spare whole: its partitions go at once (the claim
	// takes every counter they draw on), and GPU 6 opens.
	if r := h.prepare(claim("uid-c", "c", "gpu-7"))["uid-c"]; r.Err != nil {
		t.Fatalf("whole-GPU claim on the spare: %v", r.Err)
	}
	check("spare held whole", []int{0, 6}, nil)
	if whole, _ := partitionsOf(rec.last(), 7); !whole {
		t.Error("GPU 7, held whole by a claim, left the pool")
	}

	// GPU 0's claim goes too: 0 and 6 free, 6 is kept (later in the order).
	h.unprepare(dra.ClaimRef{UID: "uid-b", Namespace: "default", Name: "b"})
	check("GPU 0 freed", []int{6}, []int{0})
	h.clock.Advance(closeGrace)
	h.step(Tick{})
	check("GPU 0 closed", []int{6}, nil)

	// The spare is cordoned: its partitions carry a taint plain claims do
	// not tolerate, so GPU 4 opens (the next from the end of the order, 7
	// being held whole), and 6 closes through the grace.
	h.step(CordonChanged{GPUs: []string{"6"}})
	check("spare cordoned", []int{4}, []int{6})
}
