package health

import (
	"context"
	"log/slog"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

// Defect: every resync planned twice because setInventory marked the state
// changed even when nothing had.
func TestSetInventoryUnchangedIsNoChange(t *testing.T) {
	tr := newTracker(Policy{}, slog.New(slog.DiscardHandler))
	tr.setInventory(testInventory())
	if !tr.changed {
		t.Fatal("first inventory not a change")
	}
	tr.changed = false
	tr.setInventory(testInventory())
	if tr.changed {
		t.Error("the same inventory again marked the state changed")
	}
	inv := testInventory()
	inv.GPUs[0].Instances = inv.GPUs[0].Instances[:1]
	tr.setInventory(inv)
	if !tr.changed {
		t.Error("a MIG layout change was not a change")
	}
}

// runFresh runs a new watcher (an agent restart) with opts until the test ends.
func runFresh(t *testing.T, lib nvml.Interface, opts WatcherOptions) (*Watcher, <-chan *State) {
	t.Helper()
	states := make(chan *State, 1024)
	opts.WaitTimeout = 5 * time.Millisecond
	opts.OnChange = func(s *State) { states <- s }
	w := NewWatcher(lib, Policy{ProbeInterval: 20 * time.Millisecond}, opts)
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() { defer wg.Done(); _ = w.Run(ctx) }()
	t.Cleanup(func() { cancel(); wg.Wait() })
	return w, states
}

// Defect: health was forgotten on restart. Checkpointed causes come back,
// with the evidence that later clears them.
func TestWatcherRestoresCheckpointedCauses(t *testing.T) {
	n := simtest.Node(t, "dgx-a100")
	uuid := gpuUUID(t, n, 3)
	// An earlier agent saw XID 48 on GPU 3 with a volatile DBE count of 1.
	n.InjectXID(3, 48) // nobody registered: only the counters move
	saved := []SavedCause{{Cause: Cause{GPU: uuid, Index: 3, GI: AllInstances, CI: AllInstances, Kind: CauseXID, XID: 48,
		Class: ClassReset, Count: 1, Reason: "XID 48 (double-bit ECC error), needs GPU reset"}, DBEMax: 1, DBEKnown: true}}
	w, states := runFresh(t, n, WatcherOptions{Restore: saved})
	s := testwait.Receive(t, "restored cause", states, func(s *State) bool { return bad(s, uuid) })
	if len(s.Causes) != 1 || s.Causes[0].XID != 48 {
		t.Errorf("causes after restore %+v, want just the XID 48 (the DBE count it explains adds none)", s.Causes)
	}
	if sv := s.Saved(); len(sv) != 1 || !sv[0].DBEKnown || sv[0].DBEMax != 1 {
		t.Errorf("saved %+v: the evidence must survive the next checkpoint too", sv)
	}
	// A reset while we watch clears it by the usual evidence.
	n.Reset(3)
	testwait.Receive(t, "cleared by reset", states, func(s *State) bool { return !bad(s, uuid) })
	_ = w
}

// What earlier faults left in NVML marks the GPU when the watcher starts:
// the volatile DBE count, a pending recovery action, pending row remapping.
func TestWatcherReadsTracesOfEarlierFaults(t *testing.T) {
	n := simtest.Node(t, "dgx-a100")
	if err := n.SetECC(1, 0, 2); err != nil {
		t.Fatal(err)
	}
	if err := n.SetRecoveryAction(2, nvml.GPU_RECOVERY_ACTION_NODE_REBOOT); err != nil {
		t.Fatal(err)
	}
	if err := n.SetRemappedRows(5, 1, 1, true, false); err != nil {
		t.Fatal(err)
	}
	_, states := runFresh(t, n, WatcherOptions{})
	want := map[int]CauseKind{1: CauseDoubleBitECC, 2: CauseRecoveryAction, 5: CauseRemapPending}
	s := testwait.Receive(t, "causes from NVML's counters", states, func(s *State) bool { return len(s.Causes) == len(want) })
	for _, c := range s.Causes {
		if want[c.Index] != c.Kind {
			t.Errorf("cause %+v, want kind %s on GPU %d", c, want[c.Index], c.Index)
		}
	}
	for _, c := range s.Causes {
		if c.Index == 2 && c.Class != ClassReboot {
			t.Errorf("%+v: a node-reboot recovery action needs a reboot", c)
		}
	}
	for _, i := range []int{0, 3, 4, 6, 7} {
		if bad(s, gpuUUID(t, n, i)) {
			t.Errorf("GPU %d marked without a trace", i)
		}
	}
}

// Defect: faults that arrived before the first inventory (when events were
// registered) were lost. The watcher registers on its own at start.
func TestWatcherSeesEventsBeforeFirstInventory(t *testing.T) {
	n := simtest.Node(t, "pcie-4gpu")
	uuid := gpuUUID(t, n, 2)
	w, states := runFresh(t, n, WatcherOptions{})
	testwait.For(t, "registered without an inventory", func() bool { return len(w.Watched()) == 4 })
	n.InjectXID(2, 79)
	testwait.Receive(t, "XID 79 on GPU 2", states, func(s *State) bool { return bad(s, uuid) })
}

// A reboot under a running watcher (a simulated node's /sim/reboot) clears
// every cause raised before it, the XID 79 that needed it included, and
// reads again what outlives a reboot: a failed row remapping.
func TestWatcherRebootClearsCauses(t *testing.T) {
	n := simtest.Node(t, "dgx-a100")
	uuid2, uuid5 := gpuUUID(t, n, 2), gpuUUID(t, n, 5)
	w, states := runFresh(t, n, WatcherOptions{BootID: n.BootID})
	testwait.For(t, "registered", func() bool { return len(w.Watched()) == 8 })
	n.InjectXID(2, 79)
	n.InjectXID(5, 48)
	testwait.Receive(t, "XID 79 on GPU 2 and 48 on GPU 5", states, func(s *State) bool { return bad(s, uuid2) && bad(s, uuid5) })
	// Set while the watcher runs: no event says so, only the reboot's
	// fresh read of NVML finds it.
	if err := n.SetRemappedRows(5, 0, 1, false, true); err != nil {
		t.Fatal(err)
	}
	if err := n.Reboot(); err != nil {
		t.Fatal(err)
	}
	s := testwait.Receive(t, "the XIDs cleared by the reboot", states, func(s *State) bool {
		return !bad(s, uuid2) && len(s.Causes) == 1 && s.Causes[0].Kind == CauseRemapFailure
	})
	if s.Causes[0].GPU != uuid5 {
		t.Errorf("row remapping failure on %s, want GPU 5", s.Causes[0].GPU)
	}
	if sv := s.Saved(); len(sv) != 1 || sv[0].Boot != n.BootID() {
		t.Errorf("saved %+v: want the remapping failure, of the new boot %s", sv, n.BootID())
	}
	cleared := 0
	for _, e := range s.Log {
		if e.Action == ActionHealthy && strings.Contains(e.Message, "the node rebooted") {
			cleared++
		}
	}
	if cleared != 2 {
		t.Errorf("%d log entries say a reboot cleared a cause, want 2:\n%+v", cleared, s.Log)
	}
}

// Checkpointed causes of another boot are not restored: the node rebooted
// while no agent ran, and the reboot reset the GPUs. Those of this boot, and
// those checkpointed without a boot, are; the latter then belong to it.
func TestWatcherRestoresOnlyThisBoot(t *testing.T) {
	n := simtest.Node(t, "pcie-4gpu")
	boot := n.BootID()
	cause := func(i int, b string) SavedCause {
		return SavedCause{Cause: Cause{GPU: gpuUUID(t, n, i), Index: i, GI: AllInstances, CI: AllInstances, Kind: CauseXID, XID: 79,
			Class: ClassReboot, Count: 1, Reason: "XID 79 (GPU has fallen off the bus), needs reboot"}, Boot: b}
	}
	saved := []SavedCause{cause(0, "an-earlier-boot"), cause(1, boot), cause(2, "")}
	for _, tt := range []struct {
		name string
		got  *State
	}{
		// The agent's stand-in until the watcher reports.
		{"RestoredState", RestoredState(saved, boot)},
		{"watcher", func() *State {
			_, states := runFresh(t, n, WatcherOptions{Restore: saved, BootID: n.BootID})
			return testwait.Receive(t, "restored", states, func(s *State) bool { return bad(s, gpuUUID(t, n, 1)) && bad(s, gpuUUID(t, n, 2)) })
		}()},
	} {
		if bad(tt.got, gpuUUID(t, n, 0)) || !bad(tt.got, gpuUUID(t, n, 1)) || !bad(tt.got, gpuUUID(t, n, 2)) {
			t.Errorf("%s: causes %+v; want GPUs 1 and 2 unhealthy, not 0 (its cause is of another boot)", tt.name, tt.got.Causes)
		}
	}
	_, states := runFresh(t, n, WatcherOptions{Restore: saved, BootID: n.BootID})
	s := testwait.Receive(t, "restored", states, func(s *State) bool { return bad(s, gpuUUID(t, n, 2)) })
	for _, c := range s.Saved() {
		if c.Boot != boot {
			t.Errorf("saved %+v: want it of this boot %s", c, boot)
		}
	}
	if !slices.ContainsFunc(s.Log, func(e Entry) bool {
		return e.Index == 0 && strings.Contains(e.Message, "not restored from the checkpoint") && strings.Contains(e.Message, "the node rebooted since")
	}) {
		t.Errorf("no log entry says GPU 0's cause was not restored:\n%+v", s.Log)
	}
	// Without a boot id (not Linux, an older simulated state file) every
	// cause is restored, as before.
	if rs := RestoredState(saved, ""); len(rs.Causes) != 3 {
		t.Errorf("RestoredState without a boot id: %d causes, want all 3", len(rs.Causes))
	}
}
