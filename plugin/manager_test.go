package plugin

import (
	"context"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

var (
	sockGPU    = DefaultSocketName(resGPU)
	sockShared = DefaultSocketName(resShared)
)

func TestRegistration(t *testing.T) {
	dir := shortDir(t)
	k := startKubelet(t, dir)
	m, _ := startManager(t, dir, testCatalog())

	got := k.waitRegistered(t, 2*time.Second, resGPU, resShared)
	for name, sock := range map[string]string{resGPU: sockGPU, resShared: sockShared} {
		req := got[name]
		if req.GetVersion() != "v1beta1" || req.GetEndpoint() != sock ||
			!req.GetOptions().GetGetPreferredAllocationAvailable() || req.GetOptions().GetPreStartRequired() {
			t.Errorf("RegisterRequest for %s = %v", name, req)
		}
		fi, err := os.Stat(filepath.Join(dir, sock))
		if err != nil {
			t.Fatal(err)
		}
		if fi.Mode()&os.ModeSocket == 0 || fi.Mode().Perm() != 0o600 {
			t.Errorf("%s: mode %v, want socket 0600", sock, fi.Mode())
		}
	}
	testwait.For(t, "Ready", m.Ready)
	st := m.Status()
	if len(st) != 2 || st[0].Name != resGPU || st[1].Name != resShared {
		t.Fatalf("Status = %+v", st)
	}
	want := ResourceStatus{Name: resGPU, Socket: filepath.Join(dir, sockGPU), Registered: true, Devices: 4, Healthy: 4}
	st[0].RegisteredAt = time.Time{}
	if st[0] != want {
		t.Errorf("Status[0] = %+v, want %+v", st[0], want)
	}

	c := dialPlugin(t, filepath.Join(dir, sockGPU))
	opts, err := c.GetDevicePluginOptions(context.Background(), &pluginapi.Empty{})
	if err != nil || opts.GetPreStartRequired() || !opts.GetGetPreferredAllocationAvailable() {
		t.Errorf("GetDevicePluginOptions = %v, %v", opts, err)
	}
	if _, err := c.PreStartContainer(context.Background(), &pluginapi.PreStartContainerRequest{DevicesIds: []string{"GPU-a"}}); err != nil {
		t.Errorf("PreStartContainer: %v", err)
	}
}

type wantDevice struct {
	id     string
	health string
	numa   int64 // -1: no topology
}

func deviceList(t *testing.T, resp *pluginapi.ListAndWatchResponse) []wantDevice {
	t.Helper()
	var out []wantDevice
	for _, d := range resp.GetDevices() {
		w := wantDevice{id: d.GetID(), health: d.GetHealth(), numa: -1}
		if d.GetTopology() != nil {
			nodes := d.GetTopology().GetNodes()
			if len(nodes) != 1 {
				t.Fatalf("device %s: topology %v, want one node", d.GetID(), d.GetTopology())
			}
			w.numa = nodes[0].GetID()
		}
		out = append(out, w)
	}
	return out
}

// watch opens a ListAndWatch stream and returns a function that reads the
// next response, failing after d.
func watch(t *testing.T, c pluginapi.DevicePluginClient) (next func(d time.Duration) (*pluginapi.ListAndWatchResponse, error)) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	s, err := c.ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		t.Fatal(err)
	}
	type result struct {
		r   *pluginapi.ListAndWatchResponse
		err error
	}
	ch := make(chan result, 16)
	go func() {
		for {
			r, err := s.Recv()
			ch <- result{r, err}
			if err != nil {
				return
			}
		}
	}()
	return func(d time.Duration) (*pluginapi.ListAndWatchResponse, error) {
		t.Helper()
		select {
		case res := <-ch:
			return res.r, res.err
		case <-time.After(d):
			return nil, context.DeadlineExceeded
		}
	}
}

func TestListAndWatch(t *testing.T) {
	dir := shortDir(t)
	m, _ := startManager(t, dir, testCatalog())
	next := watch(t, dialPlugin(t, filepath.Join(dir, sockGPU)))

	resp, err := next(2 * time.Second)
	if err != nil {
		t.Fatal(err)
	}
	want := []wantDevice{{"GPU-a", "Healthy", 0}, {"GPU-b", "Healthy", 0}, {"GPU-c", "Healthy", 1}, {"GPU-d", "Healthy", -1}}
	if got := deviceList(t, resp); !reflect.DeepEqual(got, want) {
		t.Errorf("devices = %v, want %v", got, want)
	}

	// A health change reaches the open stream as a full list.
	m.Update(withHealth(testCatalog(), resGPU, "GPU-c", false, "XID 48"))
	resp, err = next(time.Second)
	if err != nil {
		t.Fatalf("no update after a health change: %v", err)
	}
	want[2].health = "Unhealthy"
	if got := deviceList(t, resp); !reflect.DeepEqual(got, want) {
		t.Errorf("devices = %v, want %v", got, want)
	}
	if st := m.Status(); st[0].Healthy != 3 || st[0].Devices != 4 {
		t.Errorf("Status after health change = %+v", st[0])
	}

	// Only the Preferrer changes: replaced in place, no stream update.
	cat := withHealth(testCatalog(), resGPU, "GPU-c", false, "XID 48")
	cat.Resources[resGPU].Preferred = preferFunc(func([]string, []string, int) ([]string, error) {
		return []string{"GPU-d"}, nil
	})
	m.Update(cat)
	c := dialPlugin(t, filepath.Join(dir, sockGPU))
	testwait.For(t, "new Preferrer in use", func() bool {
		r, err := c.GetPreferredAllocation(context.Background(), &pluginapi.PreferredAllocationRequest{
			ContainerRequests: []*pluginapi.ContainerPreferredAllocationRequest{prefReq([]string{"GPU-a", "GPU-d"}, nil, 1)},
		})
		return err == nil && reflect.DeepEqual(r.GetContainerResponses()[0].GetDeviceIDs(), []string{"GPU-d"})
	})
	if resp, err := next(100 * time.Millisecond); err == nil {
		t.Errorf("stream update although the devices did not change: %v", resp)
	}
}

func TestAllocateOverSocket(t *testing.T) {
	dir := shortDir(t)
	m, _ := startManager(t, dir, testCatalog())
	c := dialPlugin(t, filepath.Join(dir, sockShared))
	ctx := context.Background()

	resp, err := c.Allocate(ctx, allocReq([]string{"GPU-a::0", "GPU-a::1"}))
	if err != nil {
		t.Fatal(err)
	}
	checkContainer(t, resp.GetContainerResponses()[0], wantContainer{
		env:     map[string]string{"NVIDIA_VISIBLE_DEVICES": "GPU-a", "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "50"},
		devices: []string{"/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia0"},
		mounts:  []string{"/usr/lib/libcuda.so"},
	})

	_, err = c.Allocate(ctx, allocReq([]string{"GPU-a::0"}, []string{"GPU-q::0"}))
	if status.Code(err) != codes.NotFound || !strings.Contains(err.Error(), `"GPU-q::0"`) || !strings.Contains(err.Error(), resShared) {
		t.Errorf("unknown ID: err = %v, want NotFound naming the ID and %s", err, resShared)
	}

	// Allocate answers from the catalog current at call time.
	m.Update(withHealth(testCatalog(), resShared, "GPU-b::0", false, "GPU lost"))
	testwait.For(t, "unhealthy device refused", func() bool {
		_, err := c.Allocate(ctx, allocReq([]string{"GPU-b::0"}))
		return status.Code(err) == codes.FailedPrecondition && strings.Contains(err.Error(), "GPU lost")
	})
}

func TestOnAllocateCalledAfterSuccessOnly(t *testing.T) {
	dir := shortDir(t)
	var mu sync.Mutex
	var got []string
	var gotIDs []string
	startManagerWith(t, testCatalog(), Options{Dir: dir, OnAllocate: func(res string, ids []string) {
		mu.Lock()
		got = append(got, res)
		gotIDs = append(gotIDs, ids...)
		mu.Unlock()
	}})
	c := dialPlugin(t, filepath.Join(dir, sockShared))
	if _, err := c.Allocate(context.Background(), allocReq([]string{"GPU-q::0"})); err == nil {
		t.Fatal("unknown ID allocated")
	}
	if _, err := c.Allocate(context.Background(), allocReq([]string{"GPU-a::0"})); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if len(got) != 1 || got[0] != resShared || len(gotIDs) != 1 || gotIDs[0] != "GPU-a::0" {
		t.Errorf("OnAllocate calls %v with %v, want one for %s with GPU-a::0 (refused allocations do not count)", got, gotIDs, resShared)
	}
}

func TestResourceAddedAndRemoved(t *testing.T) {
	dir := shortDir(t)
	k := startKubelet(t, dir)
	m, _ := startManager(t, dir, testCatalog())
	k.waitRegistered(t, 2*time.Second, resGPU, resShared)
	next := watch(t, dialPlugin(t, filepath.Join(dir, sockShared)))
	if _, err := next(time.Second); err != nil {
		t.Fatal(err)
	}

	cat := testCatalog()
	delete(cat.Resources, resShared)
	const resMIG = "example.com/mig-1g.10gb"
	cat.Resources[resMIG] = &catalog.Resource{Name: resMIG, Devices: []catalog.Device{gpuDevice(5, 1)}}
	m.Update(cat)

	req := k.waitRegister(t, 2*time.Second)
	if req.GetResourceName() != resMIG || req.GetEndpoint() != DefaultSocketName(resMIG) {
		t.Errorf("registration after adding %s: %v", resMIG, req)
	}
	testwait.For(t, "removed resource's socket gone", func() bool {
		_, err := os.Stat(filepath.Join(dir, sockShared))
		return isNotExist(err)
	})
	if _, err := next(time.Second); err == nil {
		t.Error("ListAndWatch stream of the removed resource still open")
	}
	testwait.For(t, "Ready with the new catalog", m.Ready)
	var names []string
	for _, st := range m.Status() {
		names = append(names, st.Name)
	}
	if want := []string{resGPU, resMIG}; !reflect.DeepEqual(names, want) {
		t.Errorf("Status names = %v, want %v", names, want)
	}
}

func TestKubeletRestart(t *testing.T) {
	dir := shortDir(t)
	k := startKubelet(t, dir)
	m, _ := startManager(t, dir, testCatalog())
	k.waitRegistered(t, 2*time.Second, resGPU, resShared)
	testwait.For(t, "Ready", m.Ready)

	k.stop()
	// startKubelet deletes every socket, ours too, before creating kubelet.sock.
	start := time.Now()
	k2 := startKubelet(t, dir)
	k2.waitRegistered(t, time.Second, resGPU, resShared)
	t.Logf("re-registered %v after the kubelet restart", time.Since(start))

	// The registered endpoint is a new, working server.
	next := watch(t, dialPlugin(t, filepath.Join(dir, sockGPU)))
	resp, err := next(time.Second)
	if err != nil || len(resp.GetDevices()) != 4 {
		t.Fatalf("ListAndWatch on the new socket: %v, %v", resp, err)
	}
	testwait.For(t, "Ready after restart", m.Ready)
	// The restart must not set off a loop of re-serving: once settled, no
	// further registrations arrive.
	select {
	case req := <-k2.regs:
		t.Errorf("extra registration after settling: %v", req)
	case <-time.After(200 * time.Millisecond):
	}
}

func TestKubeletStartsAfterManager(t *testing.T) {
	dir := shortDir(t)
	m, _ := startManager(t, dir, testCatalog())
	testwait.For(t, "waiting for the kubelet in Status", func() bool {
		st := m.Status()
		return len(st) == 2 && !st[0].Registered && strings.Contains(st[0].LastError, "waiting for the kubelet")
	})
	if m.Ready() {
		t.Error("Ready without a kubelet")
	}
	k := startKubelet(t, dir)
	k.waitRegistered(t, time.Second, resGPU, resShared)
	testwait.For(t, "Ready", m.Ready)
}

func TestOwnSocketRemoved(t *testing.T) {
	dir := shortDir(t)
	k := startKubelet(t, dir)
	startManager(t, dir, testCatalog())
	k.waitRegistered(t, 2*time.Second, resGPU, resShared)

	if err := os.Remove(filepath.Join(dir, sockGPU)); err != nil {
		t.Fatal(err)
	}
	req := k.waitRegister(t, time.Second)
	if req.GetResourceName() != resGPU {
		t.Errorf("re-registered %s, want %s", req.GetResourceName(), resGPU)
	}
	next := watch(t, dialPlugin(t, filepath.Join(dir, sockGPU)))
	if _, err := next(time.Second); err != nil {
		t.Fatalf("re-created socket does not serve: %v", err)
	}
}

func TestRegistrationRetry(t *testing.T) {
	dir := shortDir(t)
	k := startKubelet(t, dir)
	k.failNext(3)
	m, _ := startManager(t, dir, &catalog.Catalog{Resources: map[string]*catalog.Resource{resGPU: testCatalog().Resources[resGPU]}})
	testwait.For(t, "registration error in Status", func() bool {
		st := m.Status()
		return len(st) == 1 && strings.Contains(st[0].LastError, "injected registration failure")
	})
	k.waitRegister(t, 2*time.Second)
	testwait.For(t, "Registered and error cleared", func() bool {
		st := m.Status()
		return st[0].Registered && st[0].LastError == "" && !st[0].RegisteredAt.IsZero()
	})
}

func TestRunStopsAndCleansUp(t *testing.T) {
	dir := shortDir(t)
	k := startKubelet(t, dir)
	// A socket of ours left by a crashed run, and another plugin's.
	for _, name := range []string{"gpu-agent-stale.sock", "other-vendor.sock"} {
		lis, err := net.Listen("unix", filepath.Join(dir, name))
		if err != nil {
			t.Fatal(err)
		}
		lis.(*net.UnixListener).SetUnlinkOnClose(false)
		lis.Close()
	}
	m, stop := startManager(t, dir, testCatalog())
	k.waitRegistered(t, 2*time.Second, resGPU, resShared)
	next := watch(t, dialPlugin(t, filepath.Join(dir, sockGPU)))
	if _, err := next(time.Second); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, "gpu-agent-stale.sock")); !isNotExist(err) {
		t.Errorf("stale socket of ours not removed at start: %v", err)
	}

	stop() // cancels Run and checks it returned nil
	if _, err := next(time.Second); err == nil {
		t.Error("ListAndWatch stream still open after Run returned")
	}
	var left []string
	entries, _ := os.ReadDir(dir)
	for _, e := range entries {
		left = append(left, e.Name())
	}
	if want := []string{kubeletSocket, "other-vendor.sock"}; !reflect.DeepEqual(left, want) {
		t.Errorf("left in dir after Run: %v, want %v", left, want)
	}
	if m.Ready() {
		t.Error("Ready after Run returned")
	}
}

func TestRunTwice(t *testing.T) {
	dir := shortDir(t)
	m, _ := startManager(t, dir, testCatalog())
	testwait.For(t, "socket served", func() bool {
		_, err := os.Stat(filepath.Join(dir, sockGPU))
		return err == nil
	})
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	if err := m.Run(ctx); err == nil || !strings.Contains(err.Error(), "already running") {
		t.Errorf("second Run = %v, want already running", err)
	}
}

func TestSocketNameCollision(t *testing.T) {
	dir := shortDir(t)
	cat := testCatalog()
	m, err := NewManager(Options{Dir: dir, SocketName: func(string) string { return "same.sock" }})
	if err != nil {
		t.Fatal(err)
	}
	m.Update(cat)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- m.Run(ctx) }()
	defer func() {
		cancel()
		if err := <-done; err != nil {
			t.Error(err)
		}
	}()
	testwait.For(t, "collision reported", func() bool {
		st := m.Status()
		return len(st) == 2 && strings.Contains(st[1].LastError, "taken")
	})
	// The first resource is served on the shared name, the second is not.
	resp, err := dialPlugin(t, filepath.Join(dir, "same.sock")).Allocate(context.Background(), allocReq([]string{"GPU-a"}))
	if err != nil || len(resp.GetContainerResponses()) != 1 {
		t.Errorf("first resource not served: %v", err)
	}
}

// Compile-time check that the test double is a full Registration server.
var _ pluginapi.RegistrationServer = (*fakeKubelet)(nil)
