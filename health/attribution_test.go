package health

import (
	"context"
	"net"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// fakeKubelet serves pod-resources List on a real unix socket.
type fakeKubelet struct {
	podresourcesv1.UnimplementedPodResourcesListerServer
	mu    sync.Mutex
	pods  []*podresourcesv1.PodResources
	calls atomic.Int64
}

func (f *fakeKubelet) List(context.Context, *podresourcesv1.ListPodResourcesRequest) (*podresourcesv1.ListPodResourcesResponse, error) {
	f.calls.Add(1)
	f.mu.Lock()
	defer f.mu.Unlock()
	return &podresourcesv1.ListPodResourcesResponse{PodResources: slices.Clone(f.pods)}, nil
}

func (f *fakeKubelet) set(pods ...*podresourcesv1.PodResources) {
	f.mu.Lock()
	f.pods = pods
	f.mu.Unlock()
}

func startKubelet(t *testing.T) (*fakeKubelet, string, func()) {
	t.Helper()
	sock := filepath.Join(t.TempDir(), "kubelet.sock")
	lis, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer()
	f := &fakeKubelet{}
	podresourcesv1.RegisterPodResourcesListerServer(srv, f)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return f, sock, srv.Stop
}

func runPodResources(t *testing.T, opts PodResourcesOptions) *PodResources {
	t.Helper()
	p := NewPodResources(opts)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := p.Run(ctx); err != nil {
			t.Errorf("Run: %v", err)
		}
	}()
	t.Cleanup(func() { cancel(); <-done })
	return p
}

func eventually(t *testing.T, what string, ok func() bool) {
	t.Helper()
	deadline := time.Now().Add(5 * time.Second)
	for !ok() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for: %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestAttributionReplicasAndMIG(t *testing.T) {
	a := NewAttribution([]*podresourcesv1.PodResources{
		pod("a", "p1", "c1", "nvidia.com/gpu", "GPU-x::0", "GPU-x::1"),
		pod("b", "p2", "c2", "nvidia.com/gpu", "GPU-x::2"),
		pod("b", "p3", "c3", "nvidia.com/mig-1g.10gb", "MIG-y"),
		pod("b", "p4", "c4", "nvidia.com/mig-1g.10gb.shared", "MIG-z::0"),
		pod("c", "p5", "c5", "vendor.io/fpga", "GPU-x::3"),
	}, IsGPUResource)
	tests := []struct {
		uuid    string
		holders []Holder
		held    int
	}{
		{"GPU-x", []Holder{{"a", "p1", "c1"}, {"b", "p2", "c2"}}, 3},
		{"MIG-y", []Holder{{"b", "p3", "c3"}}, 1},
		{"MIG-z", []Holder{{"b", "p4", "c4"}}, 1},
		{"GPU-free", nil, 0},
	}
	for _, tt := range tests {
		if got := a.Holders(tt.uuid); !slices.Equal(got, tt.holders) {
			t.Errorf("Holders(%s) = %v, want %v", tt.uuid, got, tt.holders)
		}
		if got := a.Held(tt.uuid); got != tt.held {
			t.Errorf("Held(%s) = %d, want %d", tt.uuid, got, tt.held)
		}
	}
	allocs := a.Allocations()
	if len(allocs) != 4 || allocs[0].Resource != "nvidia.com/gpu" || allocs[0].Devices != 2 {
		t.Errorf("Allocations = %+v", allocs)
	}
	var nilA *Attribution
	if nilA.Holders("GPU-x") != nil || nilA.Held("GPU-x") != 0 || nilA.Allocations() != nil {
		t.Error("nil Attribution must be empty")
	}
}

func TestPodResourcesCachesAndRefreshes(t *testing.T) {
	kubelet, sock, _ := startKubelet(t)
	kubelet.set(pod("ns", "p1", "c", "nvidia.com/gpu", "GPU-a"))
	p := runPodResources(t, PodResourcesOptions{Socket: sock, MinInterval: 50 * time.Millisecond, MaxAge: time.Hour})

	eventually(t, "first List", func() bool { return len(p.Attribution().Holders("GPU-a")) == 1 })
	// Reading the cache (what a scrape does) never calls the kubelet.
	before := kubelet.calls.Load()
	for range 1000 {
		p.Attribution()
	}
	if got := kubelet.calls.Load(); got != before {
		t.Errorf("reading the cache made %d List calls", got-before)
	}

	// An allocation changes the answer; Invalidate makes it visible.
	kubelet.set(pod("ns", "p1", "c", "nvidia.com/gpu", "GPU-a"), pod("ns", "p2", "c", "nvidia.com/gpu", "GPU-b::0"))
	p.Invalidate()
	eventually(t, "refresh after Invalidate", func() bool { return len(p.Attribution().Holders("GPU-b")) == 1 })

	// A burst of Invalidates is rate limited to about one List per MinInterval.
	start := kubelet.calls.Load()
	t0 := time.Now()
	for range 200 {
		p.Invalidate()
		time.Sleep(time.Millisecond)
	}
	elapsed := time.Since(t0)
	limit := int64(elapsed/(50*time.Millisecond)) + 2
	if got := kubelet.calls.Load() - start; got > limit {
		t.Errorf("%d List calls in %v, want at most %d", got, elapsed, limit)
	}
}

func TestPodResourcesMaxAge(t *testing.T) {
	kubelet, sock, _ := startKubelet(t)
	kubelet.set(pod("ns", "p1", "c", "nvidia.com/gpu", "GPU-a"))
	p := runPodResources(t, PodResourcesOptions{Socket: sock, MinInterval: 10 * time.Millisecond, MaxAge: 30 * time.Millisecond})
	eventually(t, "first List", func() bool { return len(p.Attribution().Holders("GPU-a")) == 1 })
	// The pod ends; without any Invalidate, MaxAge picks it up.
	kubelet.set()
	eventually(t, "refresh by age", func() bool { return len(p.Attribution().Holders("GPU-a")) == 0 })
}

func TestPodResourcesKeepsLastOnError(t *testing.T) {
	kubelet, sock, stop := startKubelet(t)
	kubelet.set(pod("ns", "p1", "c", "nvidia.com/gpu", "GPU-a"))
	p := runPodResources(t, PodResourcesOptions{Socket: sock, MinInterval: 10 * time.Millisecond, MaxAge: 20 * time.Millisecond, Timeout: 200 * time.Millisecond})
	eventually(t, "first List", func() bool { return len(p.Attribution().Holders("GPU-a")) == 1 })
	n := p.Lists()
	stop() // the kubelet goes away: every List fails from now on
	eventually(t, "failed refreshes", func() bool { return p.Lists() > n+2 })
	if len(p.Attribution().Holders("GPU-a")) != 1 {
		t.Error("a failing kubelet wiped the attribution")
	}
}
