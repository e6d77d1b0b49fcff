package mps

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// DefaultBinary is the MPS control program looked up on PATH when
// Options.Binary is empty.
const DefaultBinary = "nvidia-cuda-mps-control"

// pidFileName is written by the control daemon into its pipe directory; it is
// how a daemon started with -d (which forks and lets the launcher exit) is
// found again, also by an agent that restarted.
const pidFileName = "nvidia-cuda-mps-control.pid"

// Options configure a Supervisor. Zero durations take the defaults noted.
type Options struct {
	// Binary is the control program; "" looks up DefaultBinary on PATH when
	// a daemon is first started.
	Binary string
	// Root holds one folder per device with the pipe and log directories.
	Root   string
	Logger *slog.Logger
	// Interval between health checks (default 5s).
	Interval time.Duration
	// RestartBackoff is the wait before the first restart of a failed
	// daemon; it doubles per failed attempt up to 32 times (default 1s).
	RestartBackoff time.Duration
	// CommandTimeout bounds one control command or launch (default 10s).
	CommandTimeout time.Duration
	// StopTimeout is how long a daemon may take to exit after quit before it
	// is killed (default 10s).
	StopTimeout time.Duration
	// Now is the clock restart backoff is measured on (default time.Now).
	Now func() time.Time
}

// maxUnanswered is how many health checks in a row a live daemon may fail
// before it is killed and restarted: one miss can be a busy daemon, three is
// a hung one.
const maxUnanswered = 3

// Supervisor runs and watches the MPS control daemons of the devices it is
// given. Supervision works on the daemon as the real program runs it: the
// launcher (`-d`) forks the daemon and exits, the daemon writes its pid into
// the pipe directory, and every command is a separate invocation of the
// program that writes commands on stdin and talks to the daemon through the
// pipe directory. A daemon is healthy while its process lives and it answers
// get_server_list. Because daemons are not children of the agent, they
// survive an agent restart and are adopted again (limits re-applied), so
// running MPS clients keep working through an agent upgrade.
//
// Set may be called from any goroutine; only Run's goroutine touches the
// daemons.
type Supervisor struct {
	opts    Options
	log     *slog.Logger
	kick    chan struct{}
	changes chan struct{}

	mu      sync.Mutex
	desired map[string]Daemon
	health  map[string]status

	// Owned by Run's goroutine.
	binary string
	procs  map[string]*proc
}

type status struct {
	healthy bool
	reason  string
}

// proc is what Run knows about one device's daemon.
type proc struct {
	pid int
	// applied holds the limits the running daemon has; applied.Device is ""
	// until they were applied once.
	applied    Daemon
	attempts   int
	nextStart  time.Time
	unanswered int
}

// NewSupervisor returns a Supervisor with no daemons; call Set and Run.
func NewSupervisor(opts Options) *Supervisor {
	if opts.Interval <= 0 {
		opts.Interval = 5 * time.Second
	}
	if opts.RestartBackoff <= 0 {
		opts.RestartBackoff = time.Second
	}
	if opts.CommandTimeout <= 0 {
		opts.CommandTimeout = 10 * time.Second
	}
	if opts.StopTimeout <= 0 {
		opts.StopTimeout = 10 * time.Second
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Supervisor{
		opts:    opts,
		log:     log.With("component", "mps"),
		kick:    make(chan struct{}, 1),
		changes: make(chan struct{}, 1),
		desired: map[string]Daemon{},
		health:  map[string]status{},
		binary:  opts.Binary,
		procs:   map[string]*proc{},
	}
}

// Set replaces the desired daemons: Run starts new ones, re-applies changed
// limits and stops (quit) the daemons of devices no longer listed. An invalid
// list is refused as a whole and the previous one stays.
func (s *Supervisor) Set(daemons []Daemon) error {
	next := make(map[string]Daemon, len(daemons))
	for _, d := range daemons {
		if err := d.Validate(); err != nil {
			return err
		}
		if _, dup := next[d.Device]; dup {
			return fmt.Errorf("gpu %d (%s): mps daemon listed twice", d.Index, d.Device)
		}
		next[d.Device] = d
	}
	s.mu.Lock()
	s.desired = next
	s.mu.Unlock()
	select {
	case s.kick <- struct{}{}:
	default:
	}
	return nil
}

// Healthy reports whether device's daemon answers, and why not when it does
// not. Replicas of an unhealthy device must be offered as unhealthy.
func (s *Supervisor) Healthy(device string) (bool, string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if _, ok := s.desired[device]; !ok {
		return false, "no mps daemon for this device"
	}
	st, ok := s.health[device]
	if !ok {
		return false, "mps daemon starting"
	}
	return st.healthy, st.reason
}

// Changes receives a value (coalesced) whenever some daemon's health changes,
// so the agent can re-plan and republish its catalog.
func (s *Supervisor) Changes() <-chan struct{} { return s.changes }

// Run supervises until ctx is done, then stops every daemon it runs and
// returns nil.
func (s *Supervisor) Run(ctx context.Context) error {
	t := time.NewTicker(s.opts.Interval)
	defer t.Stop()
	for {
		s.reconcile(ctx)
		select {
		case <-ctx.Done():
			s.stopAll()
			return nil
		case <-t.C:
		case <-s.kick:
		}
	}
}

func (s *Supervisor) reconcile(ctx context.Context) {
	s.mu.Lock()
	desired := maps.Clone(s.desired)
	s.mu.Unlock()

	for _, dev := range slices.Sorted(maps.Keys(s.procs)) {
		if _, ok := desired[dev]; !ok {
			s.stop(dev, s.procs[dev])
			delete(s.procs, dev)
			s.forget(dev)
		}
	}
	for _, dev := range slices.Sorted(maps.Keys(desired)) {
		if ctx.Err() != nil {
			return
		}
		s.supervise(ctx, desired[dev])
	}
}

// supervise moves one device's daemon one step towards running, answering
// and carrying d's limits.
func (s *Supervisor) supervise(ctx context.Context, d Daemon) {
	p := s.procs[d.Device]
	if p == nil {
		p = &proc{}
		s.procs[d.Device] = p
	}
	if p.pid != 0 && !alive(p.pid) {
		s.failed(d, p, fmt.Sprintf("mps daemon (pid %d) exited", p.pid))
		p.pid = 0
	}
	if p.pid == 0 {
		if s.opts.Now().Before(p.nextStart) {
			return
		}
		pid, err := s.start(ctx, d)
		if err != nil {
			s.failed(d, p, err.Error())
			return
		}
		p.pid, p.applied, p.unanswered = pid, Daemon{}, 0
	}
	err := s.ping(ctx, d)
	if err == nil && p.applied != d {
		if err = s.apply(ctx, d); err == nil {
			p.applied = d
		}
	}
	if err != nil && !alive(p.pid) {
		// It died while we asked (a kill is not instant): say so, and
		// restart after the backoff like any exit.
		s.failed(d, p, fmt.Sprintf("mps daemon (pid %d) exited", p.pid))
		p.pid = 0
		return
	}
	if err != nil {
		p.unanswered++
		s.setHealth(d.Device, false, fmt.Sprintf("mps daemon (pid %d) not answering: %v", p.pid, err))
		if p.unanswered >= maxUnanswered {
			s.log.Warn("killing unresponsive mps daemon", "gpu", d.Index, "device", d.Device, "pid", p.pid, "err", err)
			_ = syscall.Kill(p.pid, syscall.SIGKILL)
			s.failed(d, p, fmt.Sprintf("mps daemon (pid %d) killed after %d unanswered checks", p.pid, p.unanswered))
			p.pid = 0
		}
		return
	}
	p.unanswered, p.attempts = 0, 0
	s.setHealth(d.Device, true, "")
}

// failed marks d unhealthy and schedules the next start with backoff.
func (s *Supervisor) failed(d Daemon, p *proc, reason string) {
	p.attempts++
	wait := s.opts.RestartBackoff << min(p.attempts-1, 5)
	p.nextStart = s.opts.Now().Add(wait)
	s.log.Warn("mps daemon down", "gpu", d.Index, "device", d.Device, "reason", reason, "retryIn", wait)
	s.setHealth(d.Device, false, reason)
}

func (s *Supervisor) setHealth(dev string, healthy bool, reason string) {
	s.mu.Lock()
	old, had := s.health[dev]
	s.health[dev] = status{healthy: healthy, reason: reason}
	s.mu.Unlock()
	if !had || old.healthy != healthy {
		s.notify()
	}
}

func (s *Supervisor) forget(dev string) {
	s.mu.Lock()
	delete(s.health, dev)
	s.mu.Unlock()
	s.notify()
}

func (s *Supervisor) notify() {
	select {
	case s.changes <- struct{}{}:
	default:
	}
}

// start adopts d's daemon if one already answers in its pipe directory (an
// agent restart), else launches one with -d and waits for its pid file.
func (s *Supervisor) start(ctx context.Context, d Daemon) (int, error) {
	pipe, logDir := PipeDir(s.opts.Root, d.Device), LogDir(s.opts.Root, d.Device)
	for _, dir := range []string{pipe, logDir} {
		// Never remove these folders: containers bind-mount the pipe
		// directory, and a re-created one would be a different folder.
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return 0, fmt.Errorf("gpu %d (%s): mps: %w", d.Index, d.Device, err)
		}
	}
	if s.binary == "" {
		path, err := exec.LookPath(DefaultBinary)
		if err != nil {
			return 0, fmt.Errorf("gpu %d (%s): mps: %w", d.Index, d.Device, err)
		}
		s.binary = path
	}
	pidFile := filepath.Join(pipe, pidFileName)
	if pid, err := readPID(pidFile); err == nil && alive(pid) && s.ping(ctx, d) == nil {
		s.log.Info("adopted running mps daemon", "gpu", d.Index, "device", d.Device, "pid", pid)
		return pid, nil
	}
	// A stale pid file would be read as the new daemon's before it writes its own.
	if err := os.Remove(pidFile); err != nil && !errors.Is(err, os.ErrNotExist) {
		return 0, fmt.Errorf("gpu %d (%s): mps: %w", d.Index, d.Device, err)
	}

	// The launcher's output goes to a file, not a pipe: the forked daemon
	// inherits it, and a pipe would keep Wait blocked for the daemon's life.
	out, err := os.Create(filepath.Join(logDir, "gpu-agent-launch.log"))
	if err != nil {
		return 0, fmt.Errorf("gpu %d (%s): mps: %w", d.Index, d.Device, err)
	}
	defer out.Close()
	cctx, cancel := context.WithTimeout(ctx, s.opts.CommandTimeout)
	defer cancel()
	cmd := exec.CommandContext(cctx, s.binary, "-d")
	cmd.Env = s.env(d)
	cmd.Stdout, cmd.Stderr = out, out
	if err := cmd.Run(); err != nil {
		msg, _ := os.ReadFile(out.Name())
		return 0, fmt.Errorf("gpu %d (%s): start %s -d: %w: %s", d.Index, d.Device, s.binary, err, bytes.TrimSpace(msg))
	}
	deadline := time.Now().Add(s.opts.CommandTimeout)
	for {
		pid, err := readPID(pidFile)
		if err == nil && alive(pid) {
			s.log.Info("started mps daemon", "gpu", d.Index, "device", d.Device, "pid", pid, "pipeDir", pipe)
			return pid, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return 0, fmt.Errorf("gpu %d (%s): mps daemon wrote no live pid to %s: %v", d.Index, d.Device, pidFile, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// env is the daemon's and every control client's environment: the agent's
// own (PATH, library paths) with the device pinned and the directories set.
func (s *Supervisor) env(d Daemon) []string {
	env := slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "CUDA_VISIBLE_DEVICES=") ||
			strings.HasPrefix(kv, "CUDA_MPS_PIPE_DIRECTORY=") ||
			strings.HasPrefix(kv, "CUDA_MPS_LOG_DIRECTORY=")
	})
	return append(env,
		"CUDA_VISIBLE_DEVICES="+d.Device,
		"CUDA_MPS_PIPE_DIRECTORY="+PipeDir(s.opts.Root, d.Device),
		"CUDA_MPS_LOG_DIRECTORY="+LogDir(s.opts.Root, d.Device),
	)
}

// control sends commands to d's daemon through one client invocation and
// returns what it printed.
func (s *Supervisor) control(ctx context.Context, d Daemon, cmds ...string) (string, error) {
	cctx, cancel := context.WithTimeout(ctx, s.opts.CommandTimeout)
	defer cancel()
	cmd := exec.CommandContext(cctx, s.binary)
	cmd.Env = s.env(d)
	cmd.Stdin = strings.NewReader(strings.Join(cmds, "\n") + "\n")
	cmd.WaitDelay = time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("gpu %d (%s): mps control %q: %w: %s", d.Index, d.Device, cmds, err, bytes.TrimSpace(out))
	}
	return string(out), nil
}

func (s *Supervisor) ping(ctx context.Context, d Daemon) error {
	_, err := s.control(ctx, d, "get_server_list")
	return err
}

// apply sets d's limits as the daemon's defaults and on every server it
// already runs, so a change reaches running clients' future contexts too.
func (s *Supervisor) apply(ctx context.Context, d Daemon) error {
	cmds := limitCommands(d)
	if len(cmds) == 0 {
		return nil
	}
	out, err := s.control(ctx, d, append([]string{"get_server_list"}, cmds...)...)
	if err != nil {
		return err
	}
	var perServer []string
	for _, f := range strings.Fields(out) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 0 {
			perServer = append(perServer, serverCommands(d, pid)...)
		}
	}
	if len(perServer) > 0 {
		if _, err := s.control(ctx, d, perServer...); err != nil {
			return err
		}
	}
	s.log.Info("applied mps limits", "gpu", d.Index, "device", d.Device,
		"activeThreadPercentage", d.ActiveThreadPercentage, "pinnedMemLimitBytes", d.PinnedMemLimitBytes)
	return nil
}

// stop asks the daemon to quit and kills it if it has not exited in time.
func (s *Supervisor) stop(dev string, p *proc) {
	if p.pid == 0 {
		return
	}
	d := Daemon{Device: dev}
	// ctx is done when stopping everything; quit must still be sent.
	if _, err := s.control(context.Background(), d, "quit"); err != nil {
		s.log.Warn("mps quit failed", "device", dev, "pid", p.pid, "err", err)
	}
	deadline := time.Now().Add(s.opts.StopTimeout)
	for alive(p.pid) {
		if time.Now().After(deadline) {
			s.log.Warn("mps daemon ignored quit; killing", "device", dev, "pid", p.pid)
			_ = syscall.Kill(p.pid, syscall.SIGKILL)
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	s.log.Info("stopped mps daemon", "device", dev, "pid", p.pid)
	p.pid = 0
}

func (s *Supervisor) stopAll() {
	for _, dev := range slices.Sorted(maps.Keys(s.procs)) {
		s.stop(dev, s.procs[dev])
		delete(s.procs, dev)
	}
}

func readPID(path string) (int, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("%s: bad pid %q", path, bytes.TrimSpace(b))
	}
	return pid, nil
}

// alive reports whether pid runs. A zombie counts as dead: when the agent is
// PID 1 of its container, the forked daemon is reparented to it and lingers
// as a zombie after it exits.
func alive(pid int) bool {
	if err := syscall.Kill(pid, 0); err != nil && !errors.Is(err, syscall.EPERM) {
		return false
	}
	stat, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return !errors.Is(err, os.ErrNotExist)
	}
	// The state follows the parenthesised command name, which may hold spaces.
	if i := bytes.LastIndexByte(stat, ')'); i >= 0 && i+2 < len(stat) && stat[i+2] == 'Z' {
		// Reap it if it is our child (agent as PID 1); harmless otherwise.
		var ws syscall.WaitStatus
		_, _ = syscall.Wait4(pid, &ws, syscall.WNOHANG, nil)
		return false
	}
	return true
}
