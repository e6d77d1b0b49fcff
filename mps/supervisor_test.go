package mps

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/internal/testwait"
	"github.com/gpu-agent/gpu-agent/mps/simdaemon"
)

// fakeBinary is the control program the tests' supervisors run: this test
// binary, which TestMain makes the product's stand-in (mps/simdaemon) when
// its first argument is controlSim, as gpu-agent runs itself on simulated
// nodes (gpu-agent mps-control-sim).
var fakeBinary string

// controlSim is the argument that makes this test binary the stand-in.
const controlSim = "mps-control-sim"

func TestMain(m *testing.M) {
	self, err := os.Executable()
	if err == nil {
		// Daemons are told apart by /proc/PID/exe, which names the real path.
		fakeBinary, err = filepath.EvalSymlinks(self)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if len(os.Args) > 1 && os.Args[1] == controlSim {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
		err := simdaemon.Main(ctx, []string{fakeBinary, controlSim}, os.Args[2:], os.Getenv, os.Stdin, os.Stdout)
		stop()
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// argsOf are the arguments that come before the control program's own for
// binary: the stand-in's subcommand for this test binary.
func argsOf(binary string) []string {
	if binary == fakeBinary {
		return []string{controlSim}
	}
	return nil
}

// serveServers makes the simulated node run MPS servers pids on dev's
// daemon (simdaemon.ServersFile).
func serveServers(t *testing.T, root, dev string, pids ...int) {
	t.Helper()
	var b strings.Builder
	for _, pid := range pids {
		fmt.Fprintln(&b, pid)
	}
	if err := os.MkdirAll(PipeDir(root, dev), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(PipeDir(root, dev), simdaemon.ServersFile), []byte(b.String()), 0o644); err != nil {
		t.Fatal(err)
	}
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
	// passes receives (coalesced) after each pass of Run.
	passes chan struct{}
}

// start runs a supervisor over a fresh root with fast checks, after Setting
// daemons. Cleanup stops it and kills the daemons it leaves.
func start(t *testing.T, binary string, daemons ...Daemon) *harness {
	t.Helper()
	return startWith(t, binary, 2*time.Second, daemons...)
}

func startWith(t *testing.T, binary string, cmdTimeout time.Duration, daemons ...Daemon) *harness {
	t.Helper()
	h := newHarness(t, newRoot(t), binary, cmdTimeout)
	h.set(t, daemons...)
	h.run(t)
	return h
}

// newRoot makes a root for daemons. Run leaves its daemons running, so
// cleanup kills those still there, after every later cleanup (Run's end).
func newRoot(t *testing.T) string {
	t.Helper()
	// Unix socket paths are limited to 108 bytes; t.TempDir can be too long.
	root, err := os.MkdirTemp("", "mps")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		killDaemonsUnder(root)
		os.RemoveAll(root)
	})
	return root
}

// killDaemonsUnder kills the stand-in daemons whose pipe directory is under
// root. They are found by their environment, not their pid files: a launch
// that timed out leaves a daemon no pid file names, and a pid file may name a
// pid since reused.
func killDaemonsUnder(root string) {
	dirs, _ := filepath.Glob("/proc/[0-9]*")
	for _, dir := range dirs {
		pid, err := strconv.Atoi(filepath.Base(dir))
		if err != nil {
			continue
		}
		if exe, err := os.Readlink(filepath.Join(dir, "exe")); err != nil || exe != fakeBinary || pid == os.Getpid() {
			continue
		}
		env, err := os.ReadFile(filepath.Join(dir, "environ"))
		if err == nil && bytes.Contains(append([]byte{0}, env...), []byte("\x00CUDA_MPS_PIPE_DIRECTORY="+root+"/")) {
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// newHarness makes a supervisor over root (which may hold daemons an earlier
// one left) and neither Sets nor runs it.
func newHarness(t *testing.T, root, binary string, cmdTimeout time.Duration) *harness {
	t.Helper()
	h := &harness{root: root, clock: &clock{now: time.Unix(1000, 0)}, done: make(chan error, 1), passes: make(chan struct{}, 1)}
	h.sup = NewSupervisor(Options{
		Binary: binary, Args: argsOf(binary), Root: root, Interval: 10 * time.Millisecond, RestartBackoff: time.Second,
		CommandTimeout: cmdTimeout, StopTimeout: 2 * time.Second, Now: h.clock.Now,
	})
	h.sup.reconciled = func() {
		select {
		case h.passes <- struct{}{}:
		default:
		}
	}
	return h
}

func (h *harness) set(t *testing.T, daemons ...Daemon) {
	t.Helper()
	if err := h.sup.Set(daemons); err != nil {
		t.Fatal(err)
	}
}

// run starts Run; cleanup ends it.
func (h *harness) run(t *testing.T) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	h.cancel = cancel
	go func() { h.done <- h.sup.Run(ctx) }()
	t.Cleanup(func() { h.stop(t) })
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

// waitPasses waits until Run has ended at least n passes after the call.
func (h *harness) waitPasses(t *testing.T, n int) {
	t.Helper()
	// A value already buffered may predate the call; it does not count.
	select {
	case <-h.passes:
	default:
	}
	for range n {
		select {
		case <-h.passes:
		case <-time.After(10 * time.Second):
			t.Fatalf("Run made no pass in 10s")
		}
	}
}

// answers reports whether d's daemon under h's root answers a command.
func (h *harness) answers(d Daemon) error {
	// Run has ended or runs elsewhere; a bare Supervisor asks on its own.
	s := NewSupervisor(Options{Binary: fakeBinary, Args: argsOf(fakeBinary), Root: h.root, CommandTimeout: 5 * time.Second})
	return s.ping(context.Background(), s.daemonTarget(d))
}

func (h *harness) waitHealthy(t *testing.T, dev string, want bool) string {
	t.Helper()
	var reason string
	testwait.For(t, fmt.Sprintf("%s healthy=%v", dev, want), func() bool {
		var ok bool
		ok, reason = h.sup.Healthy(dev)
		return ok == want
	})
	return reason
}

// commands are the commands dev's daemons took, in order, from their
// control.log ("[time] command"; the daemon's own lines left out), each
// with its spaces as underscores.
func (h *harness) commands(t *testing.T, dev string) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(LogDir(h.root, dev), "control.log"))
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	var out []string
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		_, cmd, ok := strings.Cut(line, "] ")
		if !ok || strings.HasPrefix(cmd, "stand-in MPS control daemon started") || cmd == "stopped on quit" {
			continue
		}
		out = append(out, strings.ReplaceAll(cmd, " ", "_"))
	}
	return out
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

	// The daemon logs the environment it was started with.
	env, err := os.ReadFile(filepath.Join(LogDir(h.root, a.Device), "control.log"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		"CUDA_VISIBLE_DEVICES=GPU-aaaa",
		"CUDA_MPS_PIPE_DIRECTORY=" + filepath.Join(h.root, "GPU-aaaa", "pipe"),
		"CUDA_MPS_LOG_DIRECTORY=" + filepath.Join(h.root, "GPU-aaaa", "log"),
	} {
		if !slices.Contains(strings.Fields(string(env)), want) {
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
	h.waitHealthy(t, d.Device, false)
	select {
	case <-h.sup.Changes():
	case <-time.After(5 * time.Second):
		t.Error("no change notified when the daemon died")
	}
	// A check that asks while the kill lands says "not answering" first
	// (a kill is not instant); the next finds the daemon gone.
	var reason string
	testwait.For(t, "the daemon reported as exited", func() bool {
		_, reason = h.sup.Healthy(d.Device)
		return strings.Contains(reason, "exited")
	})
	// The clock stands still: many checks pass, the backoff does not.
	h.waitPasses(t, 5)
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
	// On a loaded machine a launch can outlast so short a timeout: let the
	// restarts that follow happen.
	testwait.For(t, "daemon healthy", func() bool {
		h.clock.Advance(time.Minute)
		ok, _ := h.sup.Healthy(d.Device)
		return ok
	})
	old := h.pid(t, d.Device)
	if err := syscall.Kill(old, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	reason := h.waitHealthy(t, d.Device, false)
	if !strings.Contains(reason, "not answering") {
		t.Errorf("reason %q, want not answering", reason)
	}
	testwait.For(t, "hung daemon killed", func() bool { return !alive(old) })
	// The supervisor dates the restart after the kill; keep time moving
	// until it happens rather than guess when the backoff starts.
	testwait.For(t, "replacement healthy", func() bool {
		h.clock.Advance(time.Minute)
		ok, _ := h.sup.Healthy(d.Device)
		return ok
	})
	if pid := h.pid(t, d.Device); pid == old {
		t.Errorf("daemon not replaced: pid %d", pid)
	}
}

func TestLimitsChangeLiveWithoutRestart(t *testing.T) {
	d := Daemon{Device: "GPU-live", ActiveThreadPercentage: 50}
	h := start(t, fakeBinary, d)
	h.waitHealthy(t, d.Device, true)
	pid := h.pid(t, d.Device)
	serveServers(t, h.root, d.Device, 4242) // a client started one

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
	testwait.For(t, "new limits applied", func() bool {
		cmds := h.commands(t, d.Device)
		return !slices.ContainsFunc(want, func(w string) bool { return count(cmds, w) != 1 })
	})
	if got := h.pid(t, d.Device); got != pid {
		t.Errorf("daemon restarted (pid %d → %d) for a limit change", pid, got)
	}
	h.waitPasses(t, 3) // several checks: limits are not re-sent each time
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
	testwait.For(t, "removed daemon gone", func() bool { return !alive(pidB) })
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

func TestCancelLeavesDaemonsRunning(t *testing.T) {
	devs := []Daemon{{Device: "GPU-c1"}, {Device: "GPU-c2", ActiveThreadPercentage: 10}}
	h := start(t, fakeBinary, devs...)
	var pids []int
	for _, d := range devs {
		h.waitHealthy(t, d.Device, true)
		pids = append(pids, h.pid(t, d.Device))
	}
	h.stop(t)
	for i, d := range devs {
		if !alive(pids[i]) {
			t.Errorf("%s daemon (pid %d) gone after cancel", d.Device, pids[i])
		}
		if err := h.answers(d); err != nil {
			t.Errorf("%s daemon does not answer after cancel: %v", d.Device, err)
		}
		if n := count(h.commands(t, d.Device), "quit"); n != 0 {
			t.Errorf("%s got quit %d times on cancel", d.Device, n)
		}
	}
}

// An agent upgrade: the next supervisor keeps the daemon and its limits, and
// only a config without the device quits it.
func TestNextSupervisorAdoptsDaemon(t *testing.T) {
	d := Daemon{Device: "GPU-next", ActiveThreadPercentage: 30, PinnedMemLimitBytes: 1 << 30}
	h := start(t, fakeBinary, d)
	h.waitHealthy(t, d.Device, true)
	pid := h.pid(t, d.Device)
	h.stop(t)
	if !alive(pid) {
		t.Fatalf("daemon (pid %d) gone after cancel", pid)
	}
	if err := h.answers(d); err != nil {
		t.Fatalf("daemon does not answer after cancel: %v", err)
	}

	next := newHarness(t, h.root, fakeBinary, 2*time.Second)
	next.set(t, d)
	next.run(t)
	next.waitHealthy(t, d.Device, true)
	if got := next.pid(t, d.Device); got != pid || !alive(pid) {
		t.Errorf("pid %d after adoption (alive %v), want the running %d", got, alive(pid), pid)
	}
	// Healthy comes after the limits were looked at, so a re-send would
	// already show.
	for _, c := range []string{"set_default_active_thread_percentage 30", "set_default_device_pinned_mem_limit 0 1024M"} {
		if n := count(next.commands(t, d.Device), c); n != 1 {
			t.Errorf("%q sent %d times, want once: the adopted daemon already has it", c, n)
		}
	}

	next.set(t)
	testwait.For(t, "dropped daemon gone", func() bool { return !alive(pid) })
	if cmds := next.commands(t, d.Device); count(cmds, "quit") != 1 || cmds[len(cmds)-1] != "quit" {
		t.Errorf("commands %v: want quit last", cmds)
	}
	if ok, reason := next.sup.Healthy(d.Device); ok || !strings.Contains(reason, "no mps daemon") {
		t.Errorf("Healthy(dropped) = %v, %q", ok, reason)
	}
}

func TestAdoptedDaemonGetsChangedLimits(t *testing.T) {
	d := Daemon{Device: "GPU-change", ActiveThreadPercentage: 30}
	h := start(t, fakeBinary, d)
	h.waitHealthy(t, d.Device, true)
	pid := h.pid(t, d.Device)
	h.stop(t)
	serveServers(t, h.root, d.Device, 4242) // a client started one

	d.ActiveThreadPercentage = 40
	next := newHarness(t, h.root, fakeBinary, 2*time.Second)
	next.set(t, d)
	next.run(t)
	next.waitHealthy(t, d.Device, true)
	if got := next.pid(t, d.Device); got != pid {
		t.Errorf("daemon restarted (pid %d → %d) for a limit change", pid, got)
	}
	cmds := next.commands(t, d.Device)
	for _, c := range []string{"set_default_active_thread_percentage 40", "set_active_thread_percentage 4242 40"} {
		if count(cmds, c) != 1 {
			t.Errorf("commands %v: want %q once", cmds, c)
		}
	}
}

// A daemon whose limits the previous agent never recorded (it ended between
// start and apply) gets them from the next one.
func TestAdoptedDaemonWithoutRecordGetsLimits(t *testing.T) {
	root := newRoot(t)
	d := Daemon{Device: "GPU-adopt", ActiveThreadPercentage: 30}
	prev := NewSupervisor(Options{Binary: fakeBinary, Args: argsOf(fakeBinary), Root: root})
	pid, err := prev.start(context.Background(), d)
	if err != nil {
		t.Fatal(err)
	}

	h := newHarness(t, root, fakeBinary, 2*time.Second)
	h.set(t, d)
	h.run(t)
	h.waitHealthy(t, d.Device, true)
	if got := h.pid(t, d.Device); got != pid {
		t.Errorf("pid %d, want the adopted %d", got, pid)
	}
	if count(h.commands(t, d.Device), "set_default_active_thread_percentage 30") != 1 {
		t.Errorf("limits not applied to the adopted daemon: %v", h.commands(t, d.Device))
	}
	h.stop(t)
	if !alive(pid) {
		t.Error("adopted daemon stopped on cancel")
	}
}

// A daemon busy when the next agent comes is waited for, not replaced.
func TestAdoptedDaemonHealthyOnceItAnswers(t *testing.T) {
	d := Daemon{Device: "GPU-slow"}
	h := start(t, fakeBinary, d)
	h.waitHealthy(t, d.Device, true)
	pid := h.pid(t, d.Device)
	h.stop(t)
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}

	// Unanswered checks take the command timeout each: three of them
	// would replace the daemon, so the test has two to resume it in.
	next := newHarness(t, h.root, fakeBinary, 3*time.Second)
	next.set(t, d)
	next.run(t)
	testwait.For(t, "adopted daemon reported not answering", func() bool {
		ok, reason := next.sup.Healthy(d.Device)
		return !ok && strings.Contains(reason, "not answering")
	})
	if err := syscall.Kill(pid, syscall.SIGCONT); err != nil {
		t.Fatal(err)
	}
	next.waitHealthy(t, d.Device, true)
	if got := next.pid(t, d.Device); got != pid {
		t.Errorf("daemon replaced (pid %d → %d) instead of adopted", pid, got)
	}
}

// An agent that has not got its config yet must not guess which daemons
// are still wanted.
func TestSupervisorWithoutSetLeavesDaemonsAlone(t *testing.T) {
	d := Daemon{Device: "GPU-alone"}
	h := start(t, fakeBinary, d)
	h.waitHealthy(t, d.Device, true)
	pid := h.pid(t, d.Device)
	h.stop(t)

	next := newHarness(t, h.root, fakeBinary, 2*time.Second)
	next.run(t)
	next.waitPasses(t, 3)
	next.stop(t)
	if !alive(pid) || count(next.commands(t, d.Device), "quit") != 0 {
		t.Errorf("daemon (pid %d) stopped by a supervisor that was never Set (alive %v, commands %v)",
			pid, alive(pid), next.commands(t, d.Device))
	}
	if err := next.answers(d); err != nil {
		t.Errorf("daemon does not answer: %v", err)
	}
	if ok, reason := next.sup.Healthy(d.Device); ok || !strings.Contains(reason, "no mps daemon") {
		t.Errorf("Healthy without Set = %v, %q", ok, reason)
	}
}

func TestFirstSetQuitsLeftoverDaemons(t *testing.T) {
	keep, drop := Daemon{Device: "GPU-keep"}, Daemon{Device: "MIG-GPU-drop/1/0"}
	h := start(t, fakeBinary, keep, drop)
	h.waitHealthy(t, keep.Device, true)
	h.waitHealthy(t, drop.Device, true)
	pidKeep, pidDrop := h.pid(t, keep.Device), h.pid(t, drop.Device)
	h.stop(t)

	next := newHarness(t, h.root, fakeBinary, 2*time.Second)
	next.run(t)
	next.waitPasses(t, 2)
	if !alive(pidDrop) {
		t.Fatal("leftover daemon quit before the first Set")
	}
	next.set(t, keep)
	testwait.For(t, "leftover daemon gone", func() bool { return !alive(pidDrop) })
	if cmds := next.commands(t, drop.Device); count(cmds, "quit") != 1 || cmds[len(cmds)-1] != "quit" {
		t.Errorf("leftover's commands %v: want quit last", cmds)
	}
	next.waitHealthy(t, keep.Device, true)
	if got := next.pid(t, keep.Device); got != pidKeep || count(next.commands(t, keep.Device), "quit") != 0 {
		t.Errorf("kept daemon not adopted: pid %d (was %d), commands %v", got, pidKeep, next.commands(t, keep.Device))
	}
}

func TestStopAllQuitsEveryDaemonUnderRoot(t *testing.T) {
	a, b := Daemon{Device: "GPU-s1"}, Daemon{Device: "GPU-s2", ActiveThreadPercentage: 10}
	h := start(t, fakeBinary, a, b)
	h.waitHealthy(t, a.Device, true)
	h.waitHealthy(t, b.Device, true)
	pidA, pidB := h.pid(t, a.Device), h.pid(t, b.Device)
	if err := h.sup.StopAll(context.Background()); err == nil {
		t.Error("StopAll while Run runs: no error")
	}
	if !alive(pidA) || !alive(pidB) {
		t.Fatal("a refused StopAll stopped daemons")
	}
	h.stop(t)

	// The supervisor's own daemons.
	if err := h.sup.StopAll(context.Background()); err != nil {
		t.Fatal(err)
	}
	for _, pid := range []int{pidA, pidB} {
		if alive(pid) {
			t.Errorf("daemon (pid %d) runs after StopAll", pid)
		}
	}
	for _, d := range []Daemon{a, b} {
		if count(h.commands(t, d.Device), "quit") != 1 {
			t.Errorf("%s got no quit", d.Device)
		}
		if ok, reason := h.sup.Healthy(d.Device); ok || !strings.Contains(reason, "stopped") {
			t.Errorf("Healthy(%s) after StopAll = %v, %q", d.Device, ok, reason)
		}
	}

	// Daemons an earlier agent left, by a supervisor that never ran.
	c := Daemon{Device: "GPU-s3"}
	h2 := start(t, fakeBinary, c)
	h2.waitHealthy(t, c.Device, true)
	pidC := h2.pid(t, c.Device)
	h2.stop(t)
	fresh := NewSupervisor(Options{Binary: fakeBinary, Args: argsOf(fakeBinary), Root: h2.root, StopTimeout: 2 * time.Second})
	if err := fresh.StopAll(context.Background()); err != nil {
		t.Fatal(err)
	}
	if alive(pidC) || count(h2.commands(t, c.Device), "quit") != 1 {
		t.Errorf("leftover daemon (pid %d) not quit by StopAll", pidC)
	}
}

func TestMissingBinaryIsUnhealthyWithReason(t *testing.T) {
	h := start(t, filepath.Join(t.TempDir(), "nope"), Daemon{Device: "GPU-x"})
	reason := h.waitHealthy(t, "GPU-x", false)
	testwait.For(t, "start failure reported", func() bool {
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

// A pid file is one line; readPID reads at most maxSmallFile bytes of it.
func TestReadPID(t *testing.T) {
	tests := []struct {
		content string
		pid     int
		wantErr string
	}{
		{"4242\n", 4242, ""},
		{" 7 ", 7, ""},
		{"0", 0, `bad pid "0"`},
		{"-3\n", 0, `bad pid "-3"`},
		{"12\n13\n", 0, "bad pid"},
		{strings.Repeat(" ", maxSmallFile) + "7", 0, "larger than 4096 bytes"},
	}
	for _, tt := range tests {
		path := filepath.Join(t.TempDir(), pidFileName)
		if err := os.WriteFile(path, []byte(tt.content), 0o644); err != nil {
			t.Fatal(err)
		}
		pid, err := readPID(path)
		if pid != tt.pid || tt.wantErr == "" && err != nil ||
			tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr) || !strings.Contains(err.Error(), path)) {
			t.Errorf("readPID(%.20q) = %d, %v; want %d, error naming the file and containing %q", tt.content, pid, err, tt.pid, tt.wantErr)
		}
	}
}
