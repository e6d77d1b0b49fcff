package main

import (
	"bytes"
	"context"
	"encoding/json"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/mps"
)

// mpsRoot makes a short MPS root (unix socket paths are limited to 108
// bytes) whose daemons cleanup kills: they outlive mps-host on purpose.
// The daemons are the product's stand-in, run by this test binary
// (TestMain), which mps-host runs as `--mps-binary mps-control-sim`.
func mpsRoot(t *testing.T) string {
	t.Helper()
	fake, err := os.Executable()
	if err == nil {
		fake, err = filepath.EvalSymlinks(fake)
	}
	if err != nil {
		t.Fatal(err)
	}
	root, err := os.MkdirTemp("", "mps")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		killFakeDaemons(fake, root)
		os.RemoveAll(root)
	})
	return root
}

// killFakeDaemons kills the stand-in daemons (run by the executable fake)
// whose pipe directory is under root, found by executable and environment
// rather than pid files.
func killFakeDaemons(fake, root string) {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, dir := range dirs {
		pid, err := strconv.Atoi(filepath.Base(dir))
		if err != nil {
			continue
		}
		if exe, err := os.Readlink(filepath.Join(dir, "exe")); err != nil || exe != fake || pid == os.Getpid() {
			continue
		}
		env, err := os.ReadFile(filepath.Join(dir, "environ"))
		if err == nil && bytes.Contains(append([]byte{0}, env...), []byte("\x00CUDA_MPS_PIPE_DIRECTORY="+root+"/")) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// command is one runMain in the background; stop ends it as SIGTERM would.
type command struct {
	cancel context.CancelFunc
	done   chan int
	stderr *syncBuffer
}

func startCommand(t *testing.T, args ...string) *command {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	c := &command{cancel: cancel, done: make(chan int, 1), stderr: &syncBuffer{}}
	go func() { c.done <- runMain(ctx, args, &syncBuffer{}, c.stderr) }()
	t.Cleanup(func() {
		c.stop(t)
		if t.Failed() {
			t.Logf("%s log:\n%s", args[0], c.stderr.String())
		}
	})
	return c
}

func (c *command) stop(t *testing.T) int {
	t.Helper()
	c.cancel()
	select {
	case code := <-c.done:
		c.done <- code
		return code
	case <-time.After(15 * time.Second):
		t.Fatal("command did not return within 15s of cancel")
		return -1
	}
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// waitRemote waits on r's change signal until dev's health is want.
func waitRemote(t *testing.T, r *mps.Remote, dev string, want bool, reason string) string {
	t.Helper()
	deadline := time.After(15 * time.Second)
	for {
		ok, why := r.Healthy(dev)
		if ok == want && strings.Contains(why, reason) {
			return why
		}
		select {
		case <-r.Changes():
		case <-deadline:
			t.Fatalf("%s: healthy=%v %q; waited 15s for healthy=%v with %q", dev, ok, why, want, reason)
		}
	}
}

func pidFile(t *testing.T, root, dev string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(mps.PipeDir(root, dev), "nvidia-cuda-mps-control.pid"))
	if err != nil {
		t.Fatal(err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// `gpu-agent mps-host` runs the daemons an agent's Remote asks for, leaves
// them when it stops, and the next mps-host adopts them.
func TestMPSHostCommand(t *testing.T) {
	root := mpsRoot(t)
	host := startCommand(t, "mps-host", "--mps-root", root, "--mps-binary", mpsControlSimCommand, "--interval", "50ms")
	r := mps.NewRemote(mps.RemoteOptions{Root: root, Poll: 20 * time.Millisecond})
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go r.Run(ctx)

	d := mps.Daemon{Device: "GPU-cmd", ActiveThreadPercentage: 50}
	if err := r.Set([]mps.Daemon{d}); err != nil {
		t.Fatal(err)
	}
	waitRemote(t, r, d.Device, true, "")
	pid := pidFile(t, root, d.Device)

	if code := host.stop(t); code != 0 {
		t.Fatalf("mps-host exited %d after cancel:\n%s", code, host.stderr.String())
	}
	waitRemote(t, r, d.Device, false, "stopped")
	if err := syscall.Kill(pid, 0); err != nil {
		t.Fatalf("daemon (pid %d) gone with mps-host: %v", pid, err)
	}
	for _, want := range []string{"gpu-agent mps-host starting", "started mps daemon", "left running"} {
		if !strings.Contains(host.stderr.String(), want) {
			t.Errorf("mps-host log lacks %q:\n%s", want, host.stderr.String())
		}
	}

	next := startCommand(t, "mps-host", "--mps-root", root, "--mps-binary", mpsControlSimCommand, "--interval", "50ms")
	waitRemote(t, r, d.Device, true, "")
	if got := pidFile(t, root, d.Device); got != pid {
		t.Errorf("pid %d after the mps-host restart, want %d adopted", got, pid)
	}
	if !strings.Contains(next.stderr.String(), "adopting running mps daemon") {
		t.Errorf("next mps-host log does not say it adopted the daemon:\n%s", next.stderr.String())
	}
}

func TestMPSHostUsage(t *testing.T) {
	tests := []struct {
		env  string
		args []string
		code int
		want string
	}{
		{"", []string{"mps-host", "--interval", "0s"}, 2, "--interval 0s"},
		{"", []string{"mps-host", "extra"}, 2, "unexpected arguments: extra"},
		{"", []string{"mps-host", "--log-format", "xml"}, 2, "--log-format"},
		{"GPU_AGENT_MPS_HOST=maybe", []string{"run"}, 2, `GPU_AGENT_MPS_HOST "maybe"`},
		{"GPU_AGENT_MPS_INTERVAL=soon", []string{"mps-host"}, 2, "GPU_AGENT_MPS_INTERVAL"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " ")+" "+tt.env, func(t *testing.T) {
			if name, val, ok := strings.Cut(tt.env, "="); ok {
				t.Setenv(name, val)
			}
			code, _, stderr := run(t, tt.args...)
			if code != tt.code || !strings.Contains(stderr, tt.want) {
				t.Errorf("exit %d stderr %q; want exit %d mentioning %q", code, stderr, tt.code, tt.want)
			}
		})
	}
	code, out, errOut := run(t, "mps-host", "--help")
	if code != 0 || !strings.Contains(errOut, "[GPU_AGENT_MPS_INTERVAL]") {
		t.Errorf("mps-host --help: exit %d\n%s%s", code, out, errOut)
	}
	code, _, errOut = run(t, "run", "--help")
	if code != 0 || !strings.Contains(errOut, "-mps-host\n") || !strings.Contains(errOut, "[GPU_AGENT_MPS_HOST]") {
		t.Errorf("run --help does not list --mps-host [GPU_AGENT_MPS_HOST]:\n%s", errOut)
	}
}

const mpsTestConfig = `version: v1
configs:
  default:
    sharing:
      mps:
        resources:
        - name: nvidia.com/gpu
          rename: nvidia.com/gpu.mps
          replicas: 2
`

// `gpu-agent run --mps-host` starts no daemon itself: it asks mps-host
// through desired.json and offers the replicas unhealthy until mps-host
// reports the daemons, healthy after. Stopping the agent leaves them.
func TestRunWithMPSHost(t *testing.T) {
	root := mpsRoot(t)
	dir, err := os.MkdirTemp("", "ga")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	pluginDir := filepath.Join(dir, "dp")
	if err := os.Mkdir(pluginDir, 0o755); err != nil {
		t.Fatal(err)
	}
	startFakeKubelet(t, pluginDir)
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte(mpsTestConfig), 0o644); err != nil {
		t.Fatal(err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := ln.Addr().String()
	ln.Close()
	// A clean environment: the agent must not find the stand-in on its own.
	t.Setenv("GPU_AGENT_MPS_BINARY", filepath.Join(dir, "no-mps-control"))
	ag := startCommand(t, "run", "--mps-host", "--backend", "sim:pcie-4gpu", "--device-plugin-dir", pluginDir,
		"--listen", addr, "--state-dir", filepath.Join(dir, "state"), "--node-name", "n1", "--config", cfg,
		"--mps-root", root, "--mps-shm-dir", filepath.Join(dir, "shm"), "--resync", "1s")

	mpsDevices := func(st *agent.Status) []agent.DeviceState {
		for _, r := range st.Resource {
			if r.Name == "nvidia.com/gpu.mps" {
				return r.Devices
			}
		}
		return nil
	}
	all := func(st *agent.Status, healthy bool, reason string) bool {
		devs := mpsDevices(st)
		for _, d := range devs {
			if d.Healthy != healthy || !strings.Contains(d.Reason, reason) {
				return false
			}
		}
		return len(devs) == 8
	}
	st := waitStatus(t, addr, "replicas unhealthy without mps-host", func(st *agent.Status) bool {
		return all(st, false, "mps-host not running")
	})
	desired, err := mps.ReadDesiredFile(filepath.Join(root, mps.DesiredFileName))
	if err != nil {
		t.Fatalf("the agent did not ask mps-host for daemons: %v", err)
	}
	if len(desired.Daemons) != 4 {
		t.Errorf("desired.json lists %d daemons, want one per GPU (4): %+v", len(desired.Daemons), desired.Daemons)
	}
	if entries, _ := filepath.Glob(filepath.Join(root, "*", "pipe")); len(entries) != 0 {
		t.Errorf("the agent made daemon directories itself: %v (status %+v)", entries, mpsDevices(st))
	}

	startCommand(t, "mps-host", "--mps-root", root, "--mps-binary", mpsControlSimCommand, "--interval", "100ms")
	waitStatus(t, addr, "replicas healthy with mps-host", func(st *agent.Status) bool { return all(st, true, "") })
	pids := map[string]int{}
	for _, d := range desired.Daemons {
		pids[d.Device] = pidFile(t, root, d.Device)
	}

	if code := ag.stop(t); code != 0 {
		t.Fatalf("agent exited %d", code)
	}
	for dev, pid := range pids {
		if err := syscall.Kill(pid, 0); err != nil {
			t.Errorf("%s daemon (pid %d) gone with the agent: %v", dev, pid, err)
		}
	}
}

// waitStatus polls the agent's /status until cond holds.
func waitStatus(t *testing.T, addr, what string, cond func(*agent.Status) bool) *agent.Status {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	var last agent.Status
	for time.Now().Before(deadline) {
		resp, err := http.Get("http://" + addr + "/status")
		if err == nil {
			var st agent.Status
			err = json.NewDecoder(resp.Body).Decode(&st)
			resp.Body.Close()
			if err == nil {
				if cond(&st) {
					return &st
				}
				last = st
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	t.Fatalf("agent /status never %s; last resources %+v", what, last.Resource)
	return nil
}
