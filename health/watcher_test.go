package health

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

// runWatcher starts w on lib until the test ends; states receives each State.
func runWatcher(t *testing.T, lib nvml.Interface, p Policy) (*Watcher, <-chan *State) {
	t.Helper()
	states := make(chan *State, 1024)
	w := NewWatcher(lib, p, WatcherOptions{
		WaitTimeout: 5 * time.Millisecond,
		OnChange:    func(s *State) { states <- s },
	})
	w.SetInventory(simtest.Inventory(t, lib))
	ctx, cancel := context.WithCancel(context.Background())
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		if err := w.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); wg.Wait() })
	return w, states
}

func bad(s *State, id string) bool { _, b := s.Unhealthy(id); return b }

// waitRegistered waits until every GPU is registered for XIDs, so injected
// events are not lost (the sim delivers only to registered sets).
func waitRegistered(t *testing.T, w *Watcher, n *sim.Node, gpus int) {
	t.Helper()
	for i := range gpus {
		uuid := gpuUUID(t, n, i)
		testwait.For(t, fmt.Sprintf("gpu %d registered for events", i), func() bool { return slices.Contains(w.Watched(), uuid) })
	}
}

func gpuUUID(t *testing.T, n *sim.Node, i int) string {
	t.Helper()
	d, r := n.DeviceGetHandleByIndex(i)
	if r != nvml.SUCCESS {
		t.Fatalf("handle %d: %v", i, r)
	}
	u, r := d.GetUUID()
	if r != nvml.SUCCESS {
		t.Fatalf("uuid %d: %v", i, r)
	}
	return u
}

func TestWatcherMIGEventMarksMatchingInstances(t *testing.T) {
	n := simtest.Node(t, "dgx-h100", sim.WithMIGEnabled())
	simtest.CreateMIG(t, n, 3)
	inv := simtest.Inventory(t, n)
	w, states := runWatcher(t, n, Policy{ProbeInterval: time.Hour})
	waitRegistered(t, w, n, len(inv.GPUs))

	g := inv.GPUs[2]
	target := g.Instances[1]
	if err := n.InjectEvent(sim.Event{GPU: 2, Type: nvml.EventTypeXidCriticalError, Data: 48,
		GI: uint32(target.GI), CI: sim.NoInstance}); err != nil {
		t.Fatal(err)
	}
	s := testwait.Receive(t, "MIG device marked", states, func(s *State) bool { return bad(s, target.UUID) })
	for _, in := range g.Instances {
		if in.UUID != target.UUID && bad(s, in.UUID) {
			t.Errorf("sibling %s (GI %d) marked by an event on GI %d", in.UUID, in.GI, target.GI)
		}
	}
	if !bad(s, target.UUID+"::2") {
		t.Error("replica of the failing MIG device not marked")
	}
	for _, other := range inv.GPUs {
		if other.Index != 2 && bad(s, other.UUID) {
			t.Errorf("gpu %d marked by gpu 2's event", other.Index)
		}
	}

	// A GPU-wide XID marks every instance on GPU 5.
	if err := n.InjectXID(5, 79); err != nil {
		t.Fatal(err)
	}
	s = testwait.Receive(t, "GPU 5 marked", states, func(s *State) bool { return bad(s, inv.GPUs[5].UUID) })
	for _, in := range inv.GPUs[5].Instances {
		if !bad(s, in.UUID) {
			t.Errorf("MIG device %s of GPU 5 not marked by a GPU-wide XID", in.UUID)
		}
	}
}

func TestWatcherResetRecovery(t *testing.T) {
	n := simtest.Node(t, "dgx-h100")
	inv := simtest.Inventory(t, n)
	w, states := runWatcher(t, n, Policy{ProbeInterval: 10 * time.Millisecond})
	waitRegistered(t, w, n, len(inv.GPUs))
	uuid := inv.GPUs[1].UUID

	if err := n.SetECC(1, 0, 3); err != nil {
		t.Fatal(err)
	}
	if err := n.InjectEvent(sim.Event{GPU: 1, Type: nvml.EventTypeDoubleBitEccError, GI: sim.NoInstance, CI: sim.NoInstance}); err != nil {
		t.Fatal(err)
	}
	testwait.Receive(t, "double-bit ECC marks GPU 1", states, func(s *State) bool { return bad(s, uuid) })
	// A probe records the counter before the reset: recovery is judged
	// by it dropping.
	testwait.For(t, "a probe recording GPU 1's double-bit count", func() bool {
		return slices.ContainsFunc(w.State().Saved(), func(c SavedCause) bool { return c.GPU == uuid && c.DBEKnown && c.DBEMax == 3 })
	})
	if !bad(w.State(), uuid) {
		t.Fatal("GPU recovered before any reset")
	}
	if err := n.Reset(1); err != nil {
		t.Fatal(err)
	}
	s := testwait.Receive(t, "GPU 1 healthy after reset", states, func(s *State) bool { return !bad(s, uuid) })
	if last := s.Log[len(s.Log)-1]; !strings.Contains(last.Message, "was reset") {
		t.Errorf("recovery log %q does not say why", last.Message)
	}
}

// noEvents hides NVML events, as on drivers or containers without them.
type noEvents struct{ nvml.Interface }

func (noEvents) EventSetCreate() (nvml.EventSet, nvml.Return) { return nil, nvml.ERROR_NOT_SUPPORTED }

func TestWatcherLostProbeWithoutEvents(t *testing.T) {
	n := simtest.Node(t, "pcie-4gpu")
	inv := simtest.Inventory(t, n)
	_, states := runWatcher(t, noEvents{n}, Policy{ProbeInterval: 10 * time.Millisecond})
	uuid := inv.GPUs[3].UUID

	if err := n.SetLost(3, true); err != nil {
		t.Fatal(err)
	}
	s := testwait.Receive(t, "lost GPU found by the probe", states, func(s *State) bool { return bad(s, uuid) })
	if len(s.Causes) != 1 || s.Causes[0].Kind != CauseLost {
		t.Errorf("causes = %+v, want one %s", s.Causes, CauseLost)
	}
	for _, g := range inv.GPUs[:3] {
		if bad(s, g.UUID) {
			t.Errorf("gpu %d marked by gpu 3's loss", g.Index)
		}
	}
	if err := n.SetLost(3, false); err != nil {
		t.Fatal(err)
	}
	testwait.Receive(t, "GPU healthy once it answers", states, func(s *State) bool { return !bad(s, uuid) })
}

// partialEvents wraps one GPU so that it reports no supported-event mask and
// refuses any mask holding single-bit ECC, as some boards do.
type partialEvents struct {
	nvml.Interface
	uuid string
}

type noSBEDevice struct{ nvml.Device }

func (noSBEDevice) GetSupportedEventTypes() (uint64, nvml.Return) { return 0, nvml.ERROR_NOT_SUPPORTED }

func (d noSBEDevice) RegisterEvents(mask uint64, set nvml.EventSet) nvml.Return {
	if mask&nvml.EventTypeSingleBitEccError != 0 {
		return nvml.ERROR_NOT_SUPPORTED
	}
	return d.Device.RegisterEvents(mask, set)
}

func (p partialEvents) DeviceGetHandleByUUID(uuid string) (nvml.Device, nvml.Return) {
	d, r := p.Interface.DeviceGetHandleByUUID(uuid)
	if r == nvml.SUCCESS && uuid == p.uuid {
		return noSBEDevice{d}, r
	}
	return d, r
}

func TestWatcherSkipsUnsupportedEventTypesPerGPU(t *testing.T) {
	n := simtest.Node(t, "pcie-4gpu")
	inv := simtest.Inventory(t, n)
	lib := partialEvents{Interface: n, uuid: inv.GPUs[0].UUID}
	w, states := runWatcher(t, lib, Policy{ProbeInterval: time.Hour})
	waitRegistered(t, w, n, len(inv.GPUs))
	if err := n.InjectXID(0, 48); err != nil {
		t.Fatal(err)
	}
	testwait.Receive(t, "XID on the partial GPU still marks it", states, func(s *State) bool { return bad(s, inv.GPUs[0].UUID) })
	if err := n.InjectEvent(sim.Event{GPU: 1, Type: nvml.EventTypeSingleBitEccError, GI: sim.NoInstance, CI: sim.NoInstance}); err != nil {
		t.Fatal(err)
	}
	testwait.Receive(t, "single-bit ECC counted on a full GPU", states, func(s *State) bool {
		st, _ := s.Stats(inv.GPUs[1].UUID)
		return st.SingleBitEvents == 1
	})
}

func TestWatcherChangesSignal(t *testing.T) {
	n := simtest.Node(t, "pcie-4gpu")
	inv := simtest.Inventory(t, n)
	w, states := runWatcher(t, n, Policy{ProbeInterval: 10 * time.Millisecond})
	waitRegistered(t, w, n, len(inv.GPUs))
	for len(w.Changes()) > 0 { // drain what start-up published
		<-w.Changes()
	}
	if err := n.InjectXID(2, 48); err != nil {
		t.Fatal(err)
	}
	testwait.Receive(t, "XID 48 marks GPU 2", states, func(s *State) bool { return bad(s, inv.GPUs[2].UUID) })
	select {
	case <-w.Changes():
	case <-time.After(5 * time.Second):
		t.Fatal("no change signalled for a new State")
	}
	if _, bad := w.State().Unhealthy(inv.GPUs[2].UUID); !bad {
		t.Error("State() after the signal does not show the change")
	}
}
