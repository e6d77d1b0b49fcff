package plugin

import (
	"net"
	"os"
	"path/filepath"
	"testing"
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
