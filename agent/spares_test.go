package agent

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"k8s.io/apimachinery/pkg/types"
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

const migSpareLayout = "version: v1\nconfigs:\n  default:\n    dra:\n      migOnDemand:\n        enabled: true\n        spareGPUs: 1\n        spareLayout: {\"1g.10gb\": 2, \"2g.20gb\": 1, \"3g.40gb\": 1}\n"

// face is what a pool offers of one GPU: whole (and whether tainted
// closing), and its partitions (profile@start, and whether tainted).
type face struct {
	whole, wholeClosing bool
	parts               []string
	partsClosing        bool
}

func faceOf(p *devicemodel.Pool, gpuIndex int) face {
	var f face
	for _, d := range p.Devices {
		switch {
		case d.Type == devicemodel.TypeGPU && d.Index == gpuIndex:
			f.whole, f.wholeClosing = true, d.Closing
		case d.Partition && d.ParentIndex == gpuIndex:
			f.parts = append(f.parts, fmt.Sprintf("%s@%d", d.Profile, d.Placement.Start))
			f.partsClosing = f.partsClosing || d.Closing
		}
	}
	slices.Sort(f.parts)
	return f
}

// Under spareLayout (spareGPUs: 1 on a DGX H100, publish order 0 1 2 3 5 4
// 6 7, so GPU 7 is the spare) a spare offers the layout and not the GPU
// whole, and the node publishes no counter set once it has settled: no two
// of its devices can clash. Every change of face goes through the grace,
// the face left tainted and the other not yet published. Right after a
// start with no record, every GPU offers both, tainted, on counters; a
// restart from the checkpoint offers what the agent before did.
func TestDRAMIGSpareLayout(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	dir := t.TempDir()
	h := newHarnessIn(t, node, dir, withDRA(rec), withMIG())
	layout := []string{"1g.10gb@?", "1g.10gb@?", "2g.20gb@?", "3g.40gb@?"}
	check := func(h *harness, rec *draRecorder, step string, want map[int]face, counterSets int) {
		t.Helper()
		p := rec.last()
		for i := range 8 {
			w, ok := want[i]
			if !ok {
				w = face{whole: true} // whole, untainted
			}
			got := faceOf(p, i)
			// "?" stands for any start: the planner places the layout.
			if len(w.parts) == len(got.parts) {
				for k := range w.parts {
					if strings.HasSuffix(w.parts[k], "@?") && strings.HasPrefix(got.parts[k], strings.TrimSuffix(w.parts[k], "?")) {
						w.parts[k] = got.parts[k]
					}
				}
			}
			if got.whole != w.whole || got.wholeClosing != w.wholeClosing || got.partsClosing != w.partsClosing || !slices.Equal(got.parts, w.parts) {
				t.Fatalf("%s: GPU %d offers %+v, want %+v", step, i, got, w)
			}
		}
		if len(p.CounterSets) != counterSets {
			t.Fatalf("%s: %d counter sets, want %d", step, len(p.CounterSets), counterSets)
		}
	}
	spare := face{parts: layout}

	h.config(migSpareLayout)
	all := map[int]face{}
	for i := range 8 {
		f := faceOf(rec.last(), i)
		if !f.whole || !f.wholeClosing || !f.partsClosing || len(f.parts) != 19 {
			t.Fatalf("at start with no record: GPU %d offers %+v, want whole and all 19 partitions, tainted", i, f)
		}
		all[i] = f
	}
	if st := h.a.Status().DRA; len(st.Opening) != 8 || len(st.Closing) != 8 {
		t.Errorf("/status at start: opening %+v, closing %+v; want all 8 both", st.Opening, st.Closing)
	}
	h.clock.Advance(closeGrace - time.Second)
	h.step(Tick{})
	check(h, rec, "before the grace is over", all, 8)
	h.clock.Advance(time.Second)
	h.step(Tick{})
	check(h, rec, "after the grace", map[int]face{7: spare}, 0)
	settled := faceOf(rec.last(), 7).parts
	t.Logf("the spare layout on an H100: %v", settled)

	// A claim takes a 1g.10gb of the layout: GPU 7 keeps the rest, and
	// GPU 6 is offered whole, tainted, for the grace; then its layout.
	part := "gpu-7-mig-1g10gb-" + strings.TrimPrefix(settled[0], "1g.10gb@")
	if r := h.prepare(claim("uid-a", "a", part))["uid-a"]; r.Err != nil {
		t.Fatalf("claim on the spare's %s: %v", part, r.Err)
	}
	check(h, rec, "spare taken", map[int]face{7: spare, 6: {whole: true, wholeClosing: true}}, 0)
	if st := h.a.Status().DRA; len(st.Opening) != 1 || st.Opening[0].GPU != 6 || !st.Opening[0].At.Equal(h.clock.Now().Add(closeGrace)) {
		t.Errorf("/status: opening %+v, want GPU 6 a grace from now", st.Opening)
	}
	h.clock.Advance(closeGrace)
	h.step(Tick{})
	check(h, rec, "next spare open", map[int]face{7: spare, 6: spare}, 0)

	// Restarted from its checkpoint, the agent offers the same at once.
	// The checkpoint says 4.1, the minor that added the record.
	if cp, err := LoadCheckpoint(dir); err != nil || cp.Minor != 1 || cp.Spares == nil || len(cp.Spares.Open) != 2 {
		t.Fatalf("checkpoint: %+v, %v; want minor 1 with 2 spares open", cp, err)
	}
	rec2 := &draRecorder{}
	h2 := newHarnessIn(t, node, dir, withDRA(rec2), withMIG(), withCheckpoint())
	h2.clock.Advance(2 * closeGrace)
	h2.config(migSpareLayout)
	check(h2, rec2, "restarted", map[int]face{7: spare, 6: spare}, 0)

	// The claim goes: 7 and 6 both free spares, one too many. 6 closes
	// (7 comes later in the publish order): its layout tainted, then whole.
	h2.unprepare(dra.ClaimRef{UID: "uid-a", Namespace: "default", Name: "a"})
	check(h2, rec2, "spare freed", map[int]face{7: spare, 6: {parts: layout, partsClosing: true}}, 0)
	h2.clock.Advance(closeGrace)
	h2.step(Tick{})
	check(h2, rec2, "surplus closed", map[int]face{7: spare}, 0)

	// A claim given 6's layout partition before the scheduler saw the
	// taint is still prepared. GPU 6 was offered whole since: the rest of
	// its layout waits out the grace.
	if r := h2.prepare(claim("uid-b", "b", "gpu-6-mig-3g40gb-4"))["uid-b"]; r.Err != nil {
		t.Fatalf("claim on a partition closed since: %v", r.Err)
	}
	check(h2, rec2, "closed partition prepared", map[int]face{7: spare, 6: {parts: []string{"3g.40gb@4"}}}, 0)
	h2.clock.Advance(closeGrace)
	h2.step(Tick{})
	check(h2, rec2, "its layout back", map[int]face{7: spare, 6: spare}, 0)

	// GPU 6 freed is a surplus spare, closing. A claim then holds the
	// spare, 7, whole (given it from a pool that old): no partition beside
	// it, and 6, still offering its layout, is the spare again at once.
	h2.unprepare(dra.ClaimRef{UID: "uid-b", Namespace: "default", Name: "b"})
	check(h2, rec2, "GPU 6 freed", map[int]face{7: spare, 6: {parts: layout, partsClosing: true}}, 0)
	if r := h2.prepare(claim("uid-c", "c", "gpu-7"))["uid-c"]; r.Err != nil {
		t.Fatalf("whole-GPU claim on the spare: %v", r.Err)
	}
	check(h2, rec2, "spare held whole", map[int]face{6: spare}, 0)
	// Released within the grace: 7's layout was offered too lately for
	// its whole device to be offered untainted yet. 6, a spare all along,
	// stays the spare.
	h2.unprepare(dra.ClaimRef{UID: "uid-c", Namespace: "default", Name: "c"})
	check(h2, rec2, "held whole, freed", map[int]face{6: spare, 7: {parts: layout, partsClosing: true}}, 0)
	h2.clock.Advance(closeGrace)
	h2.step(Tick{})
	check(h2, rec2, "settled", map[int]face{6: spare}, 0)
}

// Turning spareLayout on where MIG on demand was off: every GPU was offered
// whole only, so only the spare changes face, through the grace; the
// others stay whole, untainted. Turned off again, the layout goes at once
// (a config change is the admin's), and on again the spare waits again.
func TestDRAMIGSpareLayoutTurnedOn(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	h := newHarness(t, node, withDRA(rec), withMIG())
	h.config("version: v1\nconfigs:\n  default: {}\n")
	for i := range 8 {
		if got := faceOf(rec.last(), i); !reflect.DeepEqual(got, face{whole: true}) {
			t.Fatalf("off: GPU %d offers %+v, want whole", i, got)
		}
	}
	for round := range 2 {
		h.config(migSpareLayout)
		for i := range 8 {
			want := face{whole: true, wholeClosing: i == 7}
			if got := faceOf(rec.last(), i); !reflect.DeepEqual(got, want) {
				t.Fatalf("round %d, turned on: GPU %d offers %+v, want %+v", round, i, got, want)
			}
		}
		h.clock.Advance(closeGrace)
		h.step(Tick{})
		if got := faceOf(rec.last(), 7); got.whole || len(got.parts) != 4 || got.partsClosing || len(rec.last().CounterSets) != 0 {
			t.Fatalf("round %d, a grace later: GPU 7 offers %+v with %d counter sets, want its 4-device layout and none", round, got, len(rec.last().CounterSets))
		}
		h.config("version: v1\nconfigs:\n  default: {}\n")
		if got := faceOf(rec.last(), 7); !reflect.DeepEqual(got, face{whole: true}) {
			t.Fatalf("round %d, turned off: GPU 7 offers %+v, want whole", round, got)
		}
	}
}

// A spare layout the GPU model cannot hold: every GPU stays whole, and the
// config's warnings name the field, the GPU and why.
func TestDRAMIGSpareLayoutUnfit(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	h := newHarness(t, node, withDRA(rec), withMIG())
	h.config(strings.Replace(migSpareLayout, `{"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}`, `{"4g.40gb": 1, "7g.80gb": 1}`, 1))
	h.clock.Advance(closeGrace)
	h.step(Tick{})
	for i := range 8 {
		if got := faceOf(rec.last(), i); !reflect.DeepEqual(got, face{whole: true}) {
			t.Errorf("GPU %d offers %+v, want whole", i, got)
		}
	}
	ws := h.a.Status().Config.Warnings
	if len(ws) != 1 || !strings.HasPrefix(ws[0], "configs.default.dra.migOnDemand.spareLayout: GPUs 0, 1, 2, 3, 4, 5, 6, 7 (NVIDIA H100 80GB HBM3): ") ||
		!strings.Contains(ws[0], "needs 12 memory slices") || !strings.HasSuffix(ws[0], "; offered whole only") {
		t.Errorf("warnings %q, want one for the model, naming the field and why", ws)
	}
}

// MIG on demand on counters under a control plane whose scheduler gathers
// every node's counter sets at every node (1.36) is a warning naming the
// field, the version and the way out; not on 1.37, nor with spareLayout,
// nor before the version is known.
func TestDRAMIGOnDemandCountersWarning(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	h := newHarness(t, node, withDRA(rec), withMIG())
	warned := func() bool {
		for _, w := range h.a.Status().Config.Warnings {
			if strings.HasPrefix(w, "configs.default.dra.migOnDemand: the control plane is Kubernetes v1.36.3,") && strings.Contains(w, "set spareLayout") {
				return true
			}
		}
		return false
	}
	for _, tc := range []struct {
		step, config, version string
		want                  bool
	}{
		{"version not known", migOnDemandSpare, "", false},
		{"1.36, on counters", migOnDemandSpare, "v1.36.3", true},
		{"1.37, on counters", migOnDemandSpare, "v1.37.2", false},
		{"1.36, spare layout", migSpareLayout, "v1.36.3", false},
		{"1.36, MIG on demand off", "version: v1\nconfigs:\n  default: {}\n", "v1.36.3", false},
	} {
		h.config(tc.config)
		h.step(ControlPlaneChanged{Version: tc.version})
		if got := warned(); got != tc.want {
			t.Errorf("%s: warned %v, want %v; warnings %q", tc.step, got, tc.want, h.a.Status().Config.Warnings)
		}
	}
}

// A spareLayout key of compute slices alone ("1g") is each model's plain
// profile of that many with the least memory, among migOnDemand.profiles
// where given; a full name stands for itself, and both add up.
func TestSpareCounts(t *testing.T) {
	balanced := map[string]int{"1g": 2, "2g": 1, "3g": 1}
	for _, tc := range []struct {
		node     string
		layout   map[string]int
		profiles []string
		want     map[string]int
		err      string
	}{
		{node: "dgx-h100", layout: balanced, want: map[string]int{"1g.10gb": 2, "2g.20gb": 1, "3g.40gb": 1}},
		{node: "dgx-a100", layout: balanced, want: map[string]int{"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}},
		{node: "dgx-b200", layout: balanced, want: map[string]int{"1g.23gb": 2, "2g.45gb": 1, "3g.90gb": 1}},
		{node: "pcie-a30x4", layout: balanced, err: `spareLayout "3g": no MIG profile of 3 compute slices offered`},
		{node: "pcie-a30x4", layout: map[string]int{"1g": 2, "2g": 1}, want: map[string]int{"1g.6gb": 2, "2g.12gb": 1}},
		{node: "dgx-h100", layout: map[string]int{"1g": 1, "3g": 1}, profiles: []string{"1g.20gb", "3g.40gb"}, want: map[string]int{"1g.20gb": 1, "3g.40gb": 1}},
		{node: "dgx-h100", layout: map[string]int{"1g": 1, "1g.10gb": 2, "7g": 1}, want: map[string]int{"1g.10gb": 3, "7g.80gb": 1}},
	} {
		t.Run(fmt.Sprintf("%s/%v/%v", tc.node, tc.layout, tc.profiles), func(t *testing.T) {
			n, inv := simtest.NodeInventory(t, tc.node, sim.WithMIGEnabled())
			ps := simtest.Profiles(t, n, inv.GPUs[0])
			od := &config.MIGOnDemand{Enabled: true, SpareGPUs: 1, SpareLayout: tc.layout, Profiles: tc.profiles}
			got, err := spareCounts(od, ps)
			if tc.err != "" {
				if err == nil || err.Error() != tc.err {
					t.Fatalf("got %v, %v; want the error %q", got, err, tc.err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tc.want) {
				t.Fatalf("got %v, %v; want %v", got, err, tc.want)
			}
		})
	}
}

// A +me partition, offered at its last placement only, stays offered where
// a claim holds one elsewhere (made by an earlier version of the agent):
// the claim's allocation names it, and the scheduler counts what it
// consumes only while it is published.
func TestDynamicKeepsHeldPlusMe(t *testing.T) {
	s := nodeSnapshot(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	s.DRA, s.MIGApplies = true, true
	s.Selected = selectYAML(t, migOnDemand)
	g := s.Inventory.GPUs[0]
	held := gpu.Placement{Start: 2, Size: 1}
	s.Holdings.Claims = map[types.UID]PreparedClaim{"uid-1": {Devices: []PreparedClaimDevice{
		{Created: true, Parent: g.UUID, Profile: "1g.10gb+me", Placement: held}}}}
	plusMe := func(dyn devicemodel.Dynamic) []string {
		devs, _ := devicemodel.Partitions(dyn, devicemodel.Device{})
		var out []string
		for _, d := range devs {
			if d.Profile == "1g.10gb+me" {
				out = append(out, d.Name)
			}
		}
		return out
	}
	dyns := dynamicGPUs(s)
	if got := plusMe(dyns[0]); !slices.Equal(got, []string{"gpu-0-mig-1g10gb-plus-me-2", "gpu-0-mig-1g10gb-plus-me-6"}) {
		t.Errorf("GPU 0 offers +me partitions %v; want the one the claim holds at 2 and the last, at 6", got)
	}
	if got := plusMe(dyns[1]); !slices.Equal(got, []string{"gpu-1-mig-1g10gb-plus-me-6"}) {
		t.Errorf("GPU 1 offers +me partitions %v; want the last only", got)
	}
}
