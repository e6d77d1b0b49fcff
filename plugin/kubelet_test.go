package plugin

import (
	"context"
	"errors"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

// fakeKubelet is the kubelet side of the device plugin protocol, as far as
// the plugin can observe it: a Registration server on kubelet.sock that dials
// the plugin's endpoint back before accepting, and records what it accepted.
type fakeKubelet struct {
	pluginapi.UnimplementedRegistrationServer
	dir  string
	srv  *grpc.Server
	regs chan *pluginapi.RegisterRequest

	mu   sync.Mutex
	fail int // Register calls still to refuse
}

// startKubelet starts a kubelet the way the real one starts: it first removes
// every socket in dir (the plugins' too), then listens on kubelet.sock.
func startKubelet(t testing.TB, dir string) *fakeKubelet {
	t.Helper()
	entries, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		if e.Type()&fs.ModeSocket != 0 {
			if err := os.Remove(filepath.Join(dir, e.Name())); err != nil {
				t.Fatal(err)
			}
		}
	}
	lis, err := net.Listen("unix", filepath.Join(dir, kubeletSocket))
	if err != nil {
		t.Fatal(err)
	}
	k := &fakeKubelet{dir: dir, srv: grpc.NewServer(), regs: make(chan *pluginapi.RegisterRequest, 100)}
	pluginapi.RegisterRegistrationServer(k.srv, k)
	go func() { _ = k.srv.Serve(lis) }()
	t.Cleanup(k.stop)
	return k
}

// stop closes kubelet.sock (its listener unlinks the path).
func (k *fakeKubelet) stop() { k.srv.Stop() }

// failNext makes the next n Register calls fail.
func (k *fakeKubelet) failNext(n int) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.fail = n
}

func (k *fakeKubelet) Register(ctx context.Context, req *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	k.mu.Lock()
	if k.fail > 0 {
		k.fail--
		k.mu.Unlock()
		return nil, status.Error(codes.Unavailable, "injected registration failure")
	}
	k.mu.Unlock()
	// The real kubelet refuses a plugin it cannot dial.
	conn, err := grpc.NewClient("unix://"+filepath.Join(k.dir, req.GetEndpoint()), grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, err
	}
	defer conn.Close()
	ctx, cancel := context.WithTimeout(ctx, time.Second)
	defer cancel()
	if _, err := pluginapi.NewDevicePluginClient(conn).GetDevicePluginOptions(ctx, &pluginapi.Empty{}); err != nil {
		return nil, status.Errorf(codes.Unavailable, "dial plugin %s: %v", req.GetEndpoint(), err)
	}
	k.regs <- req
	return &pluginapi.Empty{}, nil
}

// waitRegister returns the next accepted RegisterRequest, failing after d.
func (k *fakeKubelet) waitRegister(t testing.TB, d time.Duration) *pluginapi.RegisterRequest {
	t.Helper()
	select {
	case req := <-k.regs:
		return req
	case <-time.After(d):
		t.Fatalf("no registration within %v", d)
		return nil
	}
}

// waitRegistered collects accepted registrations until every name in names
// has registered, failing after d.
func (k *fakeKubelet) waitRegistered(t testing.TB, d time.Duration, names ...string) map[string]*pluginapi.RegisterRequest {
	t.Helper()
	got := map[string]*pluginapi.RegisterRequest{}
	deadline := time.After(d)
	for len(got) < len(names) {
		select {
		case req := <-k.regs:
			got[req.GetResourceName()] = req
		case <-deadline:
			t.Fatalf("registered within %v: %v; want %v", d, keys(got), names)
		}
	}
	for _, n := range names {
		if got[n] == nil {
			t.Fatalf("registered %v, want %v", keys(got), names)
		}
	}
	return got
}

func keys[V any](m map[string]V) []string {
	var out []string
	for k := range m {
		out = append(out, k)
	}
	return out
}

// dialPlugin returns a device plugin client for the socket at path, as the
// kubelet would dial it.
func dialPlugin(t testing.TB, path string) pluginapi.DevicePluginClient {
	t.Helper()
	conn, err := grpc.NewClient("unix://"+path, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return pluginapi.NewDevicePluginClient(conn)
}

// shortDir returns a fresh directory with a short path: unix socket paths
// are limited to 108 bytes and t.TempDir's can be longer.
func shortDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "dp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// startManager runs a Manager on dir serving cat until the test ends; the
// cleanup checks that Run returns nil.
func startManager(t testing.TB, dir string, cat *catalog.Catalog) (*Manager, context.CancelFunc) {
	t.Helper()
	return startManagerWith(t, cat, Options{Dir: dir})
}

// startManagerWith is startManager with options (Dir set by the caller).
func startManagerWith(t testing.TB, cat *catalog.Catalog, opts Options) (*Manager, context.CancelFunc) {
	t.Helper()
	m, stop := runManager(t, cat, opts)
	for _, name := range cat.Names() {
		// The socket file appears at bind, before listen: until then a
		// connection is refused, and a fail-fast RPC fails.
		p := filepath.Join(opts.Dir, DefaultSocketName(name))
		testwait.For(t, "socket "+p+" served", func() bool {
			c, err := net.Dial("unix", p)
			if err != nil {
				return false
			}
			c.Close()
			return true
		})
	}
	return m, stop
}

// runManager runs a Manager until the test ends, without waiting for its
// sockets; the cleanup checks that Run returns nil.
func runManager(t testing.TB, cat *catalog.Catalog, opts Options) (*Manager, context.CancelFunc) {
	t.Helper()
	opts.RetryBackoff = 10 * time.Millisecond
	m, err := NewManager(opts)
	if err != nil {
		t.Fatal(err)
	}
	m.Update(cat)
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- m.Run(ctx) }()
	var once sync.Once
	stop := func() {
		once.Do(func() {
			cancel()
			select {
			case err := <-errc:
				if err != nil {
					t.Errorf("Run: %v", err)
				}
			case <-time.After(5 * time.Second):
				t.Error("Run did not return within 5s of cancel")
			}
		})
	}
	t.Cleanup(stop)
	return m, stop
}

func isNotExist(err error) bool { return errors.Is(err, fs.ErrNotExist) }
