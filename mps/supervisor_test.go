package mps

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// fakeBinary is the stand-in control program built by TestMain.
var fakeBinary string

func TestMain(m *testing.M) {
	dir, err := os.MkdirTemp("", "fakemps")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	fakeBinary = filepath.Join(dir, "nvidia-cuda-mps-control")
	if out, err := exec.Command("go", "build", "-o", fakeBinary, "./testdata/fakemps").CombinedOutput(); err != nil {
		fmt.Fprintf(os.Stderr, "build fakemps: %v\n%s", err, out)
		os.Exit(1)
	}
	code := m.Run()
	os.RemoveAll(dir)
	os.Exit(code)
}

// clock is a manual clock: restart backoff only passes when a test says so.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

type harness struct {
	sup    *Supervisor
	root   string
	clock  *clock
	cancel context.CancelFunc
	done   chan error
}

// start runs a supervisor over a fresh root with fast checks. Cleanup stops
// it and kills any daemon a failed test left behind.
func start(t *testing.T, binary string, daemons ...Daemon) *harness {
	t.Helper()
	return startWith(t, binary, 2*time.Second, daemons...)
}

func startWith(t *testing.T, binary string, cmdTimeout time.Duration, daemons ...Daemon) *harness {
	t.Helper()
	// Unix socket paths are limited to 108 bytes; t.TempDir can be too long.
	root, err := os.MkdirTemp("", "mps")
	if err != nil {
		t.Fatal(err)
	}
	h := &harness{root: root, clock: &clock{now: time.Unix(1000, 0)}, done: make(chan error, 1)}
	h.sup = NewSupervisor(Options{
		Binary: binary, Root: root, Interval: 10 * time.Millisecond, RestartBackoff: time.Second,
		CommandTimeout: cmdTimeout, StopTimeout: 2 * time.Second, Now: h.clock.Now,
	})
	if err := h.sup.Set(daemons); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- h.sup.Run(ctx) }()
	t.Cleanup(func() {
		h.stop(t)
		dirs, _ := filepath.Glob(filepath.Join(root, "*", "pipe"))
		for _, dir := range dirs {
			if pid, err := readPID(filepath.Join(dir, pidFileName)); err == nil {
				_ = syscall.Kill(pid, syscall.SIGKILL)
			}
		}
		os.RemoveAll(root)
	})
	return h
}

func (h *harness) stop(t *testing.T) {
	t.Helper()
	h.cancel()
	select {
	case err := <-h.done:
		if err != nil {
			t.Errorf("Run returned %v", err)
		}
		h.done <- nil // later calls return at once
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return after cancel")
	}
}

func waitFor(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (h *harness) waitHealthy(t *testing.T, dev string, want bool) string {
	t.Helper()
	var reason string
	waitFor(t, fmt.Sprintf("%s healthy=%v", dev, want), func() bool {
		var ok bool
		ok, reason = h.sup.Healthy(dev)
		return ok == want
	})
	return reason
}

func (h *harness) commands(t *testing.T, dev string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(LogDir(h.root, dev), "commands.log"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	return strings.Fields(strings.ReplaceAll(strings.TrimSpace(string(b)), " ", "_"))
}

func (h *harness) pid(t *testing.T, dev string) int {
	t.Helper()
	pid, err := readPID(filepath.Join(PipeDir(h.root, dev), pidFileName))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

func count(cmds []string, cmd string) int {
	n := 0
	for _, c := range cmds {
		if c == strings.ReplaceAll(cmd, " ", "_") {
			n++
		}
	}
	return n
}

func TestStartsDaemonsWithEnvDirsAndLimits(t *testing.T) {
	a := Daemon{Device: "GPU-aaaa", Index: 0, ActiveThreadPercentage: 50, PinnedMemLimitBytes: 8 << 30}
	b := Daemon{Device: "MIG-bbbb", Index: 1}
	h := start(t, fakeBinary, a, b)
	h.waitHealthy(t, a.Device, true)
	h.waitHealthy(t, b.Device, true)
	select {
	case <-h.sup.Changes():
	default:
		t.Error("no change notified after daemons became healthy")
	}

	env, err := os.ReadFile(filepath.Join(LogDir(h.root, a.Device), "env.log"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"CUDA_VISIBLE_DEVICES=GPU-aaaa",
		"CUDA_MPS_PIPE_DIRECTORY=" + filepath.Join(h.root, "GPU-aaaa", "pipe"),
		"CUDA_MPS_LOG_DIRECTORY=" + filepath.Join(h.root, "GPU-aaaa", "log"),
	} {
		if !slices.Contains(strings.Split(string(env), "\n"), want) {
			t.Errorf("daemon env lacks %s:\n%s", want, env)
		}
	}
	cmds := h.commands(t, a.Device)
	for _, want := range []string{"set_default_active_thread_percentage 50", "set_default_device_pinned_mem_limit 0 8192M"} {
		if count(cmds, want) != 1 {
			t.Errorf("%s commands %v: want %q once", a.Device, cmds, want)
		}
	}
	for _, c := range h.commands(t, b.Device) {
		if strings.HasPrefix(c, "set_") {
			t.Errorf("%s has no limits but got %s", b.Device, c)
		}
	}
}

func TestKilledDaemonRestartsAfterBackoffWithLimits(t *testing.T) {
	d := Daemon{Device: "GPU-kill", ActiveThreadPercentage: 25, PinnedMemLimitBytes: 1 << 30}
	h := start(t, fakeBinary, d)
	h.waitHealthy(t, d.Device, true)
	old := h.pid(t, d.Device)
	<-h.sup.Changes()

	if err := syscall.Kill(old, syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	reason := h.waitHealthy(t, d.Device, false)
	if !strings.Contains(reason, "exited") {
		t.Errorf("reason %q, want it to say the daemon exited", reason)
	}
	select {
	case <-h.sup.Changes():
	case <-time.After(5 * time.Second):
		t.Error("no change notified when the daemon died")
	}
	// The clock stands still: many checks pass, the backoff does not.
	time.Sleep(100 * time.Millisecond)
	if ok, _ := h.sup.Healthy(d.Device); ok {
		t.Fatal("healthy again before the restart backoff passed")
	}
	h.clock.Advance(time.Second)
	h.waitHealthy(t, d.Device, true)
	if pid := h.pid(t, d.Device); pid == old || !alive(pid) {
		t.Errorf("pid after restart %d (old %d): want a new live daemon", pid, old)
	}
	if n := count(h.commands(t, d.Device), "set_default_active_thread_percentage 25"); n != 2 {
		t.Errorf("thread percentage applied %d times, want 2 (start and restart)", n)
	}
}

func TestHungDaemonIsKilledAndRestarted(t *testing.T) {
	d := Daemon{Device: "GPU-hung"}
	// A stopped process still accepts connections (the kernel queues them)
	// but never answers, like a hung daemon.
	h := startWith(t, fakeBinary, 200*time.Millisecond, d)
	h.waitHealthy(t, d.Device, true)
	old := h.pid(t, d.Device)
	if err := syscall.Kill(old, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	reason := h.waitHealthy(t, d.Device, false)
	if !strings.Contains(reason, "not answering") {
		t.Errorf("reason %q, want not answering", reason)
	}
	waitFor(t, "hung daemon killed", func() bool { return !alive(old) })
	// The supervisor dates the restart after the kill; keep time moving
	// until it happens rather than guess when the backoff starts.
	waitFor(t, "replacement healthy", func() bool {
		h.clock.Advance(time.Minute)
		ok, _ := h.sup.Healthy(d.Device)
		return ok
	})
	if pid := h.pid(t, d.Device); pid == old {
		t.Errorf("daemon not replaced: pid %d", pid)
	}
}

func TestLimitsChangeLiveWithoutRestart(t *testing.T) {
	t.Setenv("FAKEMPS_SERVER_PIDS", "4242")
	d := Daemon{Device: "GPU-live", ActiveThreadPercentage: 50}
	h := start(t, fakeBinary, d)
	h.waitHealthy(t, d.Device, true)
	pid := h.pid(t, d.Device)

	d.ActiveThreadPercentage, d.PinnedMemLimitBytes = 20, 4<<30
	if err := h.sup.Set([]Daemon{d}); err != nil {
		t.Fatal(err)
	}
	want := []string{
		"set_default_active_thread_percentage 20",
		"set_default_device_pinned_mem_limit 0 4096M",
		"set_active_thread_percentage 4242 20",
		"set_device_pinned_mem_limit 4242 0 4096M",
	}
	waitFor(t, "new limits applied", func() bool {
		cmds := h.commands(t, d.Device)
		return !slices.ContainsFunc(want, func(w string) bool { return count(cmds, w) != 1 })
	})
	if got := h.pid(t, d.Device); got != pid {
		t.Errorf("daemon restarted (pid %d → %d) for a limit change", pid, got)
	}
	time.Sleep(50 * time.Millisecond) // several checks: limits are not re-sent each time
	if n := count(h.commands(t, d.Device), "set_default_active_thread_percentage 20"); n != 1 {
		t.Errorf("limit sent %d times, want once", n)
	}
}

func TestRemovedDeviceIsQuit(t *testing.T) {
	a, b := Daemon{Device: "GPU-keep"}, Daemon{Device: "GPU-drop"}
	h := start(t, fakeBinary, a, b)
	h.waitHealthy(t, a.Device, true)
	h.waitHealthy(t, b.Device, true)
	pidA, pidB := h.pid(t, a.Device), h.pid(t, b.Device)

	if err := h.sup.Set([]Daemon{a}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "removed daemon gone", func() bool { return !alive(pidB) })
	if cmds := h.commands(t, b.Device); count(cmds, "quit") != 1 || cmds[len(cmds)-1] != "quit" {
		t.Errorf("removed daemon's commands %v: want quit last", cmds)
	}
	if ok, reason := h.sup.Healthy(b.Device); ok || !strings.Contains(reason, "no mps daemon") {
		t.Errorf("Healthy(removed) = %v, %q", ok, reason)
	}
	if !alive(pidA) || count(h.commands(t, a.Device), "quit") != 0 {
		t.Error("kept daemon was stopped")
	}
}

func TestCancelStopsEveryDaemon(t *testing.T) {
	devs := []Daemon{{Device: "GPU-c1"}, {Device: "GPU-c2", ActiveThreadPercentage: 10}}
	h := start(t, fakeBinary, devs...)
	var pids []int
	for _, d := range devs {
		h.waitHealthy(t, d.Device, true)
		pids = append(pids, h.pid(t, d.Device))
	}
	h.stop(t)
	for i, d := range devs {
		if alive(pids[i]) {
			t.Errorf("%s daemon (pid %d) still runs after cancel", d.Device, pids[i])
		}
		if count(h.commands(t, d.Device), "quit") != 1 {
			t.Errorf("%s got no quit", d.Device)
		}
	}
}

func TestAdoptsRunningDaemon(t *testing.T) {
	root, err := os.MkdirTemp("", "mps")
	if err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(root)
	d := Daemon{Device: "GPU-adopt", ActiveThreadPercentage: 30}
	// A daemon left by a previous agent process.
	prev := NewSupervisor(Options{Binary: fakeBinary, Root: root})
	prev.binary = fakeBinary
	pid, err := prev.start(context.Background(), d)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Kill(pid, syscall.SIGKILL)

	sup := NewSupervisor(Options{Binary: fakeBinary, Root: root, Interval: 10 * time.Millisecond})
	if err := sup.Set([]Daemon{d}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error)
	go func() { done <- sup.Run(ctx) }()
	waitFor(t, "adopted daemon healthy", func() bool { ok, _ := sup.Healthy(d.Device); return ok })
	h := &harness{root: root}
	if got := h.pid(t, d.Device); got != pid {
		t.Errorf("pid %d, want the adopted %d", got, pid)
	}
	if count(h.commands(t, d.Device), "set_default_active_thread_percentage 30") != 1 {
		t.Errorf("limits not re-applied to the adopted daemon: %v", h.commands(t, d.Device))
	}
	cancel()
	<-done
	if alive(pid) {
		t.Error("adopted daemon not stopped on cancel")
	}
}

func TestMissingBinaryIsUnhealthyWithReason(t *testing.T) {
	h := start(t, filepath.Join(t.TempDir(), "nope"), Daemon{Device: "GPU-x"})
	reason := h.waitHealthy(t, "GPU-x", false)
	waitFor(t, "start failure reported", func() bool {
		_, reason = h.sup.Healthy("GPU-x")
		return strings.Contains(reason, " -d: ")
	})
	if !strings.Contains(reason, "GPU-x") {
		t.Errorf("reason %q does not name the device", reason)
	}
}

func TestSetRefusesInvalidListAndKeepsPrevious(t *testing.T) {
	s := NewSupervisor(Options{Root: "/nonexistent"})
	if err := s.Set([]Daemon{{Device: "GPU-a"}}); err != nil {
		t.Fatal(err)
	}
	for _, bad := range [][]Daemon{
		{{Device: "GPU-b"}, {Device: "GPU-b"}},
		{{Device: "GPU-b", ActiveThreadPercentage: 150}},
	} {
		if err := s.Set(bad); err == nil {
			t.Errorf("Set(%+v) accepted", bad)
		}
	}
	if _, reason := s.Healthy("GPU-a"); reason != "mps daemon starting" {
		t.Errorf("GPU-a after refused Sets: %q, want still desired (starting)", reason)
	}
}
