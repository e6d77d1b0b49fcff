package plugin

import (
	"context"
	"errors"
	"log/slog"
	"net"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

func TestForeignSockets(t *testing.T) {
	dir, err := os.MkdirTemp("", "fp") // short: a socket path has a length limit
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	listen := func(name string) *net.UnixListener {
		l, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(dir, name), Net: "unix"})
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	live := listen("nvidia-gpu.sock")
	defer live.Close()
	mig := listen("nvidia-mig-1g.10gb.sock")
	defer mig.Close()
	ours := listen("gpu-agent-nvidia.com_gpu.sock")
	defer ours.Close()
	kubelet := listen("kubelet.sock")
	defer kubelet.Close()
	stale := listen("nvidia-gpu.shared.sock")
	stale.SetUnlinkOnClose(false)
	stale.Close() // the file stays, nobody listens: a plugin that died
	if err := os.WriteFile(filepath.Join(dir, "nvidia-file.sock"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	got := ForeignSockets(dir)
	want := map[string]string{
		"nvidia.com/gpu":         filepath.Join(dir, "nvidia-gpu.sock"),
		"nvidia.com/mig-1g.10gb": filepath.Join(dir, "nvidia-mig-1g.10gb.sock"),
	}
	if len(got) != len(want) {
		t.Fatalf("got %v, want %v", got, want)
	}
	for k, v := range want {
		if got[k] != v {
			t.Errorf("%s: %q, want %q", k, got[k], v)
		}
	}
	if ForeignSockets(filepath.Join(dir, "missing")) != nil {
		t.Error("a missing directory lists sockets")
	}
}

// Another plugin registers a resource we serve, and the agent takes it out
// of the catalog: the kubelet drops the resource's latest plugin when an
// older plugin's stream ends, so our server and stream stay, silent, until
// the other plugin is gone; then the resource is served and registered
// again.
func TestYieldKeepsStreamUntilOtherPluginGone(t *testing.T) {
	const res = "nvidia.com/gpu"
	dir := shortDir(t)
	k := startKubelet(t, dir)
	var rec logRecorder
	full := &catalog.Catalog{Resources: map[string]*catalog.Resource{res: {Name: res, Devices: []catalog.Device{gpuDevice(0, 0)}}}}
	m, _ := startManagerWith(t, full, Options{Dir: dir, Logger: slog.New(rec.handler())})
	k.waitRegistered(t, 2*time.Second, res)
	testwait.For(t, "registered", m.Ready)
	ours := filepath.Join(dir, DefaultSocketName(res))
	next := watch(t, dialPlugin(t, ours)) // the kubelet's stream
	if _, err := next(time.Second); err != nil {
		t.Fatal(err)
	}

	other, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(dir, "nvidia-gpu.sock"), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	m.Update(&catalog.Catalog{Resources: map[string]*catalog.Resource{}})
	defer func() {
		if t.Failed() {
			rec.mu.Lock()
			for _, r := range rec.recs {
				t.Logf("%s %v", r.msg, r.attrs)
			}
			rec.mu.Unlock()
		}
	}()
	testwait.For(t, "the resource left to the other plugin", func() bool {
		return len(rec.named("another device plugin registered this resource after us: it is left to that plugin; our stream to the kubelet stays open and silent, as ending it would make the kubelet drop that plugin too", res)) == 1
	})
	if resp, err := next(200 * time.Millisecond); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the kubelet's stream after yielding: %v, %v; want it open and silent", resp, err)
	}
	if _, err := os.Stat(ours); err != nil {
		t.Fatalf("our socket after yielding: %v", err)
	}
	if st := m.Status(); len(st) != 0 {
		t.Errorf("Status lists %+v; the resource is not ours to offer", st)
	}

	other.Close() // the other plugin is gone
	m.Update(full)
	if _, err := next(2 * time.Second); err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the old stream: %v; want it ended before registering again", err)
	}
	if req := k.waitRegister(t, 2*time.Second); req.GetResourceName() != res {
		t.Fatalf("registration after the other plugin left: %v", req)
	}
	testwait.For(t, "Ready again", m.Ready)
}

// A resource another plugin serves that we never registered (it was there
// first) is simply not served: no server, no socket.
func TestYieldOnlyWhatWasRegistered(t *testing.T) {
	const res = "nvidia.com/gpu"
	dir := shortDir(t)
	other, err := net.ListenUnix("unix", &net.UnixAddr{Name: filepath.Join(dir, "nvidia-gpu.sock"), Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	defer other.Close()
	full := &catalog.Catalog{Resources: map[string]*catalog.Resource{res: {Name: res, Devices: []catalog.Device{gpuDevice(0, 0)}}}}
	// No kubelet: the resource is served but never registered.
	m, _ := startManagerWith(t, full, Options{Dir: dir})
	m.Update(&catalog.Catalog{Resources: map[string]*catalog.Resource{}})
	testwait.For(t, "the unregistered resource removed", func() bool {
		_, err := os.Stat(filepath.Join(dir, DefaultSocketName(res)))
		return isNotExist(err)
	})
}
