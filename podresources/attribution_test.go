package podresources

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/internal/testwait"
	"google.golang.org/grpc"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

func pod(ns, name, container, resource string, ids ...string) *podresourcesv1.PodResources {
	return &podresourcesv1.PodResources{Namespace: ns, Name: name, Containers: []*podresourcesv1.ContainerResources{{
		Name: container, Devices: []*podresourcesv1.ContainerDevices{{ResourceName: resource, DeviceIds: ids}},
	}}}
}

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

func runClient(t *testing.T, opts Options) *Client {
	t.Helper()
	p := NewClient(opts)
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

func TestClientCachesAndRefreshes(t *testing.T) {
	kubelet, sock, _ := startKubelet(t)
	kubelet.set(pod("ns", "p1", "c", "nvidia.com/gpu", "GPU-a"))
	p := runClient(t, Options{Socket: sock, MinInterval: 50 * time.Millisecond, MaxAge: time.Hour})

	testwait.For(t, "first List", func() bool { return len(p.Attribution().Holders("GPU-a")) == 1 })
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
	testwait.For(t, "refresh after Invalidate", func() bool { return len(p.Attribution().Holders("GPU-b")) == 1 })

	// A burst of Invalidates is rate limited to about one List per MinInterval.
	start := kubelet.calls.Load()
	t0 := time.Now()
	for range 200 {
		p.Invalidate()
		// The pause is what is under test, not a wait for an event: the
		// burst must span several MinIntervals of the client's real
		// timers, which the bound below is measured against.
		time.Sleep(time.Millisecond)
	}
	elapsed := time.Since(t0)
	limit := int64(elapsed/(50*time.Millisecond)) + 2
	if got := kubelet.calls.Load() - start; got > limit {
		t.Errorf("%d List calls in %v, want at most %d", got, elapsed, limit)
	}
}

func TestClientMaxAge(t *testing.T) {
	kubelet, sock, _ := startKubelet(t)
	kubelet.set(pod("ns", "p1", "c", "nvidia.com/gpu", "GPU-a"))
	p := runClient(t, Options{Socket: sock, MinInterval: 10 * time.Millisecond, MaxAge: 30 * time.Millisecond})
	testwait.For(t, "first List", func() bool { return len(p.Attribution().Holders("GPU-a")) == 1 })
	// The pod ends; without any Invalidate, MaxAge picks it up.
	kubelet.set()
	testwait.For(t, "refresh by age", func() bool { return len(p.Attribution().Holders("GPU-a")) == 0 })
}

func TestClientKeepsLastOnError(t *testing.T) {
	kubelet, sock, stop := startKubelet(t)
	kubelet.set(pod("ns", "p1", "c", "nvidia.com/gpu", "GPU-a"))
	p := runClient(t, Options{Socket: sock, MinInterval: 10 * time.Millisecond, MaxAge: 20 * time.Millisecond, Timeout: 200 * time.Millisecond})
	testwait.For(t, "first List", func() bool { return len(p.Attribution().Holders("GPU-a")) == 1 })
	n := p.Lists()
	stop() // the kubelet goes away: every List fails from now on
	testwait.For(t, "failed refreshes", func() bool { return p.Lists() > n+2 })
	if len(p.Attribution().Holders("GPU-a")) != 1 {
		t.Error("a failing kubelet wiped the attribution")
	}
}

// Defect: a relative --pod-resources-socket failed with "invalid
// (non-empty) authority".
func TestClientRelativeSocket(t *testing.T) {
	kubelet, sock, _ := startKubelet(t)
	kubelet.set(pod("ns", "p1", "c", "nvidia.com/gpu", "GPU-a"))
	wd, _ := os.Getwd()
	t.Chdir(filepath.Dir(sock))
	defer os.Chdir(wd)
	p := runClient(t, Options{Socket: filepath.Base(sock), MaxAge: time.Hour})
	a, err := p.Refresh(context.Background())
	if err != nil || len(a.Holders("GPU-a")) != 1 {
		t.Fatalf("Refresh through a relative socket path: %v", err)
	}
}

// A kubelet that accepts and then never answers: Refresh fails within its
// timeout (the loop then destroys nothing) instead of hanging.
func TestClientRefreshHangingKubelet(t *testing.T) {
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

	p := runClient(t, Options{Socket: sock, Timeout: 100 * time.Millisecond, MaxAge: time.Hour})
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
func TestClientRefreshNeedsRun(t *testing.T) {
	_, sock, _ := startKubelet(t)
	p := NewClient(Options{Socket: sock, Timeout: 50 * time.Millisecond})
	if _, err := p.Refresh(context.Background()); err == nil {
		t.Error("Refresh answered without Run")
	}
}

// draPod is a pod whose container holds the given devices of one claim
// (driver gpu.nvidia.com, pool node-1).
func draPod(ns, name, container, claim string, devices ...string) *podresourcesv1.PodResources {
	dr := &podresourcesv1.DynamicResource{ClaimName: claim, ClaimNamespace: ns}
	for _, d := range devices {
		dr.ClaimResources = append(dr.ClaimResources, &podresourcesv1.ClaimResource{DriverName: "gpu.nvidia.com", PoolName: "node-1", DeviceName: d})
	}
	return &podresourcesv1.PodResources{Namespace: ns, Name: name, Containers: []*podresourcesv1.ContainerResources{{
		Name: container, DynamicResources: []*podresourcesv1.DynamicResource{dr},
	}}}
}

func TestAttributionReadsDynamicResources(t *testing.T) {
	dp := pod("ml", "plugin", "c", "nvidia.com/gpu", "GPU-a")
	twice := draPod("ml", "p", "c", "claim", "gpu-0", "gpu-0") // two requests, one device
	other := draPod("ml", "nic", "c", "nic-claim", "eth0")
	other.Containers[0].DynamicResources[0].ClaimResources[0].DriverName = "nic.example.com"
	tests := []struct {
		name string
		pods []*podresourcesv1.PodResources
		want []string // "container pod claim driver/pool/device"
	}{
		{"none", []*podresourcesv1.PodResources{dp}, nil},
		{"one claim, two devices", []*podresourcesv1.PodResources{draPod("ml", "p", "c", "claim", "gpu-1", "gpu-0")},
			[]string{"c p ml/claim gpu.nvidia.com/node-1/gpu-0", "c p ml/claim gpu.nvidia.com/node-1/gpu-1"}},
		{"a device twice in a claim is listed once", []*podresourcesv1.PodResources{twice}, []string{"c p ml/claim gpu.nvidia.com/node-1/gpu-0"}},
		{"two claims of a shared device", []*podresourcesv1.PodResources{draPod("ml", "a", "c", "ca", "gpu-0"), draPod("ml", "b", "c", "cb", "gpu-0")},
			[]string{"c a ml/ca gpu.nvidia.com/node-1/gpu-0", "c b ml/cb gpu.nvidia.com/node-1/gpu-0"}},
		{"every driver is listed", []*podresourcesv1.PodResources{other}, []string{"c nic ml/nic-claim nic.example.com/node-1/eth0"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := NewAttribution(append([]*podresourcesv1.PodResources{dp}, tt.pods...), IsGPUResource)
			var got []string
			for _, h := range a.DRAHolds() {
				got = append(got, strings.Join([]string{h.Container, h.Pod, h.ClaimNamespace + "/" + h.ClaimName, h.Driver + "/" + h.Pool + "/" + h.Device}, " "))
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("DRAHolds = %q, want %q", got, tt.want)
			}
			// Claims are the ledger's business through Prepare: what the
			// ledger reads of an attribution is the device plugin's only.
			plain := NewAttribution([]*podresourcesv1.PodResources{dp}, IsGPUResource)
			if !a.Same(plain) || len(a.Holders("gpu-0")) != 0 || a.Held("GPU-a") != 1 || len(a.Allocations()) != 1 {
				t.Errorf("DRA holdings changed the device plugin's view: same %v, allocations %v", a.Same(plain), a.Allocations())
			}
		})
	}
}
