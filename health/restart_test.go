package health

import (
	"context"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"google.golang.org/grpc"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
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
	n := newNode(t, "dgx-a100")
	uuid := gpuUUID(t, n, 3)
	// An earlier agent saw XID 48 on GPU 3 with a volatile DBE count of 1.
	n.InjectXID(3, 48) // nobody registered: only the counters move
	saved := []SavedCause{{Cause: Cause{GPU: uuid, Index: 3, GI: AllInstances, CI: AllInstances, Kind: CauseXID, XID: 48,
		Class: ClassReset, Count: 1, Reason: "XID 48 (double-bit ECC error), needs GPU reset"}, DBEMax: 1, DBEKnown: true}}
	w, states := runFresh(t, n, WatcherOptions{Restore: saved})
	s := waitFor(t, states, "restored cause", func(s *State) bool { return bad(s, uuid) })
	if len(s.Causes) != 1 || s.Causes[0].XID != 48 {
		t.Errorf("causes after restore %+v, want just the XID 48 (the DBE count it explains adds none)", s.Causes)
	}
	if sv := s.Saved(); len(sv) != 1 || !sv[0].DBEKnown || sv[0].DBEMax != 1 {
		t.Errorf("saved %+v: the evidence must survive the next checkpoint too", sv)
	}
	// A reset while we watch clears it by the usual evidence.
	n.Reset(3)
	waitFor(t, states, "cleared by reset", func(s *State) bool { return !bad(s, uuid) })
	_ = w
}

// What earlier faults left in NVML marks the GPU when the watcher starts:
// the volatile DBE count, a pending recovery action, pending row remapping.
func TestWatcherReadsTracesOfEarlierFaults(t *testing.T) {
	n := newNode(t, "dgx-a100")
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
	s := waitFor(t, states, "causes from NVML's counters", func(s *State) bool { return len(s.Causes) == len(want) })
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
	n := newNode(t, "pcie-4gpu")
	uuid := gpuUUID(t, n, 2)
	w, states := runFresh(t, n, WatcherOptions{})
	eventually(t, "registered without an inventory", func() bool { return len(w.Watched()) == 4 })
	n.InjectXID(2, 79)
	waitFor(t, states, "XID 79 on GPU 2", func(s *State) bool { return bad(s, uuid) })
}

// Defect: a relative --pod-resources-socket failed with "invalid
// (non-empty) authority".
func TestPodResourcesRelativeSocket(t *testing.T) {
	kubelet, sock, _ := startKubelet(t)
	kubelet.set(pod("ns", "p1", "c", "nvidia.com/gpu", "GPU-a"))
	wd, _ := os.Getwd()
	t.Chdir(filepath.Dir(sock))
	defer os.Chdir(wd)
	p := runPodResources(t, PodResourcesOptions{Socket: filepath.Base(sock), MaxAge: time.Hour})
	a, err := p.Refresh(context.Background())
	if err != nil || len(a.Holders("GPU-a")) != 1 {
		t.Fatalf("Refresh through a relative socket path: %v", err)
	}
}

// A kubelet that accepts and then never answers: Refresh fails within its
// timeout (the loop then destroys nothing) instead of hanging.
func TestPodResourcesRefreshHangingKubelet(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "kubelet.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	release := make(chan struct{})
	srv := grpc.NewServer()
	podresourcesv1.RegisterPodResourcesListerServer(srv, hangingKubelet{release: release})
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(func() { close(release); srv.Stop() })

	p := runPodResources(t, PodResourcesOptions{Socket: sock, Timeout: 100 * time.Millisecond, MaxAge: time.Hour})
	_, err = p.Refresh(context.Background())
	if err == nil || !strings.Contains(err.Error(), "DeadlineExceeded") {
		t.Errorf("Refresh against a hanging kubelet: %v, want a deadline error", err)
	}
}

type hangingKubelet struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	release chan struct{}
}

func (h hangingKubelet) List(ctx context.Context, _ *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	select {
	case <-ctx.Done():
	case <-h.release:
	}
	return nil, ctx.Err()
}

// Refresh is served by Run's goroutine, the cache's only writer; without Run
// it fails rather than racing it.
func TestPodResourcesRefreshNeedsRun(t *testing.T) {
	_, sock, _ := startKubelet(t)
	p := NewPodResources(PodResourcesOptions{Socket: sock, Timeout: 50 * time.Millisecond})
	if _, err := p.Refresh(context.Background()); err == nil {
		t.Error("Refresh answered without Run")
	}
}

// Defect: /metrics lacked the DCGM series for a whole sampling interval
// after start (the first pass ran before the inventory arrived).
func TestSamplerSamplesAsSoonAsInventoryArrives(t *testing.T) {
	n := newNode(t, "pcie-4gpu")
	s := NewSampler(n, SamplerOptions{Interval: time.Hour})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = s.Run(ctx) }()
	defer func() { cancel(); <-done }()
	s.SetInventory(inventory(t, n))
	eventually(t, "a sample of every GPU", func() bool { return len(s.Snapshot().GPUs) == 4 })
}
