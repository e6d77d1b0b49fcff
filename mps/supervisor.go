package mps

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
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

	"github.com/gpu-agent/gpu-agent/atomicfile"
)

// DefaultBinary is the MPS control program looked up on PATH when
// Options.Binary is empty.
const DefaultBinary = "nvidia-cuda-mps-control"

// pidFileName is written by the control daemon into its pipe directory; it is
// how a daemon started with -d (which forks and lets the launcher exit) is
// found again, also by an agent that restarted.
const pidFileName = "nvidia-cuda-mps-control.pid"

// recordName is the agent's own file in a daemon's log directory: the limits
// it last applied and to which daemon, so that the next agent can tell
// whether an adopted daemon still needs them.
const recordName = "gpu-agent-limits.json"

// Options configure a Supervisor. Zero durations take the defaults noted.
type Options struct {
	// Binary is the control program; "" looks up DefaultBinary on PATH when
	// a daemon is first started.
	Binary string
	// Args come before the control program's own arguments (`-d`, or none
	// for a command): the subcommand of a stand-in such as `gpu-agent
	// mps-control-sim` on simulated nodes.
	Args []string
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
// get_server_list.
//
// Daemons outlive the agent on purpose, so that running MPS clients keep
// working through an agent restart or upgrade: they are not children of the
// agent, and ending Run leaves every daemon, and so every client, running.
// The next agent takes them over:
//   - Before its first successful Set nothing under Root is touched, however
//     long that takes: an agent that has not read its config yet cannot know
//     which daemons are still wanted.
//   - On the first reconcile after that Set, a daemon found through its pid
//     file under Root for a listed device is adopted, not restarted. Its
//     limits are re-applied only when they differ from those the previous
//     agent recorded for that very daemon, and it counts healthy once it
//     answers. Daemons found for devices that Set does not list are quit:
//     the config no longer shares those devices with MPS.
//   - From then on a daemon is quit only when Set drops its device, or by
//     StopAll, which stops every daemon under Root (uninstall).
//
// A pid file may name a reused pid, so a process is never killed on the word
// of a pid file alone: only a daemon this Supervisor launched or that has
// answered it.
//
// Set and Healthy may be called from any goroutine; only Run's goroutine, or
// StopAll's, touches the daemons, and Run and StopAll never overlap.
type Supervisor struct {
	opts    Options
	log     *slog.Logger
	kick    chan struct{}
	changes chan struct{}

	mu      sync.Mutex
	desired map[string]Daemon
	// wanted: Set has succeeded once, so desired is the config's word and
	// not just "nothing yet".
	wanted bool
	health map[string]status

	// running is held by Run and by StopAll for as long as they run, so that
	// only one of them owns the fields below.
	running sync.Mutex
	binary  string
	procs   map[string]*proc
	// swept: the daemons left under Root for devices not desired were quit.
	swept bool
	// reconciled, when set (tests), is called after each pass of Run.
	reconciled func()
}

type status struct {
	healthy bool
	reason  string
	// pid is the daemon's process (0: none runs) and carries the limits it
	// is known to have (Device "" until they were applied once); mps-host
	// reports both in health.json.
	pid     int
	carries Daemon
}

// proc is what Run knows about one device's daemon.
type proc struct {
	d   Daemon
	pid int
	// ours: pid is known to be this device's daemon, because this Supervisor
	// launched it or it answered; only then may it be killed.
	ours bool
	// dropped is the last pid given up on (killed, or never answered); a
	// pid file naming it is not adopted again.
	dropped int
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

// Set replaces the desired daemons: Run starts (or, after an agent restart,
// adopts) new ones, re-applies changed limits and quits the daemons of
// devices no longer listed; the first Set also lets Run quit the daemons an
// earlier agent left for devices it does not list. An invalid list is refused
// as a whole and the previous one stays (and a refused first Set does not
// count as one).
func (s *Supervisor) Set(daemons []Daemon) error {
	next, err := validateDaemons(daemons)
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.desired, s.wanted = next, true
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

// Run supervises until ctx is done and returns nil. It leaves every daemon
// running when it returns, for the next agent to adopt; StopAll is the way to
// stop them. Run refuses to start while another Run or StopAll runs.
func (s *Supervisor) Run(ctx context.Context) error {
	if !s.running.TryLock() {
		return errors.New("mps: supervisor already running (Run or StopAll)")
	}
	defer s.running.Unlock()
	t := time.NewTicker(s.opts.Interval)
	defer t.Stop()
	for {
		s.reconcile(ctx)
		if s.reconciled != nil {
			s.reconciled()
		}
		select {
		case <-ctx.Done():
			if n := len(s.procs); n > 0 {
				s.log.Info("leaving mps daemons running for the next agent", "daemons", n)
			}
			return nil
		case <-t.C:
		case <-s.kick:
		}
	}
}

func (s *Supervisor) reconcile(ctx context.Context) {
	s.mu.Lock()
	desired, wanted := maps.Clone(s.desired), s.wanted
	s.mu.Unlock()
	if !wanted {
		return
	}
	if !s.swept {
		s.swept = true
		s.quitLeftovers(ctx, desired)
	}

	for _, dev := range slices.Sorted(maps.Keys(s.procs)) {
		if _, ok := desired[dev]; !ok {
			p := s.procs[dev]
			if p.pid != 0 {
				if err := s.quit(ctx, s.daemonTarget(p.d), p.pid, p.ours); err != nil {
					s.log.Warn("mps daemon of a device no longer shared not stopped", "gpu", p.d.Index, "device", dev, "err", err)
				}
			}
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

// quitLeftovers quits the daemons under Root that an earlier agent ran for
// devices not in desired.
func (s *Supervisor) quitLeftovers(ctx context.Context, desired map[string]Daemon) {
	keep := make(map[string]bool, len(desired))
	for dev := range desired {
		keep[dirName(dev)] = true
	}
	for _, f := range s.found() {
		if keep[f.name] {
			continue
		}
		if ctx.Err() != nil {
			return
		}
		if err := s.quit(ctx, s.folderTarget(f.name), f.pid, false); err != nil {
			s.log.Warn("leftover mps daemon not stopped", "dir", filepath.Join(s.opts.Root, f.name), "pid", f.pid, "err", err)
		}
	}
}

// StopAll quits every MPS daemon under Root, those Run supervises and those
// an earlier agent left, and waits for them to exit; it is for uninstalling,
// as ending Run does not stop them. A daemon that does not exit within
// StopTimeout of its quit is killed. It returns an error for each daemon it
// could not stop, and refuses to run while Run runs (end Run first). A later
// Run starts the desired daemons again.
func (s *Supervisor) StopAll(ctx context.Context) error {
	if !s.running.TryLock() {
		return errors.New("mps: StopAll while the supervisor runs; end Run first")
	}
	defer s.running.Unlock()
	var errs []error
	done := map[int]bool{}
	for _, dev := range slices.Sorted(maps.Keys(s.procs)) {
		p := s.procs[dev]
		if p.pid != 0 {
			done[p.pid] = true
			if err := s.quit(ctx, s.daemonTarget(p.d), p.pid, p.ours); err != nil {
				errs = append(errs, err)
			}
		}
		delete(s.procs, dev)
		s.setHealth(dev, status{reason: "mps daemon stopped"})
	}
	for _, f := range s.found() {
		if done[f.pid] {
			continue
		}
		if err := s.quit(ctx, s.folderTarget(f.name), f.pid, false); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// leftover is a live daemon found under Root through its pid file; name is
// its device folder.
type leftover struct {
	name string
	pid  int
}

func (s *Supervisor) found() []leftover {
	entries, err := os.ReadDir(s.opts.Root)
	if err != nil {
		if !errors.Is(err, os.ErrNotExist) {
			s.log.Warn("cannot look for mps daemons", "root", s.opts.Root, "err", err)
		}
		return nil
	}
	var out []leftover
	for _, e := range entries {
		if !e.IsDir() {
			continue
		}
		pid, err := readPID(filepath.Join(s.opts.Root, e.Name(), "pipe", pidFileName))
		if err == nil && alive(pid) {
			out = append(out, leftover{name: e.Name(), pid: pid})
		}
	}
	return out
}

// supervise moves one device's daemon one step towards running, answering
// and carrying d's limits.
func (s *Supervisor) supervise(ctx context.Context, d Daemon) {
	p := s.procs[d.Device]
	if p == nil {
		p = &proc{}
		s.procs[d.Device] = p
	}
	p.d = d
	if p.pid != 0 && !alive(p.pid) {
		s.failed(d, p, fmt.Sprintf("mps daemon (pid %d) exited", p.pid))
		p.pid = 0
	}
	if p.pid == 0 {
		if s.opts.Now().Before(p.nextStart) {
			return
		}
		// Besides a daemon an earlier agent left, this finds one whose
		// launcher outlived CommandTimeout; launching another beside it
		// would orphan it.
		if !s.adopt(d, p) {
			pid, err := s.start(ctx, d)
			if err != nil {
				s.failed(d, p, err.Error())
				return
			}
			p.pid, p.ours, p.applied, p.unanswered = pid, true, Daemon{}, 0
		}
	}
	t := s.daemonTarget(d)
	err := s.ping(ctx, t)
	if err == nil {
		p.ours = true
		if p.applied != d {
			// A change cut short must not pass for the limits recorded
			// before it.
			s.record(d, 0)
			if err = s.apply(ctx, t, d); err == nil {
				p.applied = d
				s.record(d, p.pid)
			}
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
		s.setHealth(d.Device, status{reason: fmt.Sprintf("mps daemon (pid %d) not answering: %v", p.pid, err), pid: p.pid, carries: p.applied})
		if p.unanswered >= maxUnanswered {
			if p.ours {
				s.log.Warn("killing unresponsive mps daemon", "gpu", d.Index, "device", d.Device, "pid", p.pid, "err", err)
				_ = syscall.Kill(p.pid, syscall.SIGKILL)
				s.failed(d, p, fmt.Sprintf("mps daemon (pid %d) killed after %d unanswered checks", p.pid, p.unanswered))
			} else {
				// Its pid file may name a reused pid: leave the process
				// alone and run a daemon of our own.
				s.failed(d, p, fmt.Sprintf("pid %d from the pid file never answered as an mps daemon in %d checks; starting a new one", p.pid, p.unanswered))
			}
			// Its pid file still names it, and a killed process lingers
			// for a moment: do not adopt it back.
			p.pid, p.dropped = 0, p.pid
		}
		return
	}
	p.unanswered, p.attempts = 0, 0
	s.setHealth(d.Device, status{healthy: true, pid: p.pid, carries: p.applied})
}

// adopt takes over d's daemon when its pid file names a live process other
// than one p gave up on. Whether that is really the daemon shows in the
// checks that follow. Its limits count as applied only when an agent recorded
// applying exactly these to this very pid.
func (s *Supervisor) adopt(d Daemon, p *proc) bool {
	pid, err := readPID(filepath.Join(PipeDir(s.opts.Root, d.Device), pidFileName))
	if err != nil || pid == p.dropped || !alive(pid) {
		return false
	}
	p.pid, p.ours, p.applied, p.unanswered = pid, false, Daemon{}, 0
	b, err := readSmall(filepath.Join(LogDir(s.opts.Root, d.Device), recordName))
	if err == nil && carriesLimits(b, d, pid) {
		p.applied = d
	}
	s.log.Info("adopting running mps daemon", "gpu", d.Index, "device", d.Device, "pid", pid, "limitsApplied", p.applied == d)
	return true
}

// limitsRecord is the content of recordName.
type limitsRecord struct {
	PID                    int    `json:"pid"`
	ActiveThreadPercentage int    `json:"activeThreadPercentage"`
	PinnedMemLimitBytes    uint64 `json:"pinnedMemLimitBytes"`
}

func newRecord(d Daemon, pid int) limitsRecord {
	return limitsRecord{PID: pid, ActiveThreadPercentage: d.ActiveThreadPercentage, PinnedMemLimitBytes: d.PinnedMemLimitBytes}
}

// carriesLimits reports whether b, the content of a daemon's recordName,
// says that process pid (> 0) carries d's limits.
func carriesLimits(b []byte, d Daemon, pid int) bool {
	var rec limitsRecord
	return json.Unmarshal(b, &rec) == nil && rec == newRecord(d, pid)
}

// record notes that pid carries d's limits; pid 0 withdraws the note. Failing
// to note them is harmless (the next agent re-applies them); failing to
// withdraw is not, and is logged like it.
func (s *Supervisor) record(d Daemon, pid int) {
	path := filepath.Join(LogDir(s.opts.Root, d.Device), recordName)
	var err error
	if pid == 0 {
		if err = os.Remove(path); errors.Is(err, os.ErrNotExist) {
			err = nil
		}
	} else {
		// Atomic: a torn record would only cost a re-apply, but the
		// record shares its writer with the files mps-host keeps.
		b, _ := json.Marshal(newRecord(d, pid))
		err = atomicfile.Write(path, b)
	}
	if err != nil {
		s.log.Warn("cannot record applied mps limits", "gpu", d.Index, "device", d.Device, "err", err)
	}
}

// failed marks d unhealthy and schedules the next start with backoff.
func (s *Supervisor) failed(d Daemon, p *proc, reason string) {
	p.attempts++
	wait := s.opts.RestartBackoff << min(p.attempts-1, 5)
	p.nextStart = s.opts.Now().Add(wait)
	s.log.Warn("mps daemon down", "gpu", d.Index, "device", d.Device, "reason", reason, "retryIn", wait)
	s.setHealth(d.Device, status{reason: reason})
}

func (s *Supervisor) setHealth(dev string, st status) {
	s.mu.Lock()
	old, had := s.health[dev]
	s.health[dev] = st
	s.mu.Unlock()
	if !had || old.healthy != st.healthy {
		s.notify()
	}
}

// report returns the desired daemons (nil before the first Set) and the
// health of each, as one consistent view.
func (s *Supervisor) report() (map[string]Daemon, map[string]status) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.wanted {
		return nil, nil
	}
	return maps.Clone(s.desired), maps.Clone(s.health)
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

// start launches d's daemon with -d and waits for its pid file.
func (s *Supervisor) start(ctx context.Context, d Daemon) (int, error) {
	pipe, logDir := PipeDir(s.opts.Root, d.Device), LogDir(s.opts.Root, d.Device)
	for _, dir := range []string{pipe, logDir} {
		// Never remove these folders: containers bind-mount the pipe
		// directory, and a re-created one would be a different folder.
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return 0, fmt.Errorf("gpu %d (%s): mps: %w", d.Index, d.Device, err)
		}
	}
	bin, err := s.lookBinary()
	if err != nil {
		return 0, fmt.Errorf("gpu %d (%s): mps: %w", d.Index, d.Device, err)
	}
	// A stale pid file would be read as the new daemon's before it writes
	// its own, and a stale record could match the new daemon's pid.
	pidFile := filepath.Join(pipe, pidFileName)
	for _, f := range []string{pidFile, filepath.Join(logDir, recordName)} {
		if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
			return 0, fmt.Errorf("gpu %d (%s): mps: %w", d.Index, d.Device, err)
		}
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
	cmd := exec.CommandContext(cctx, bin, append(slices.Clone(s.opts.Args), "-d")...)
	cmd.Env = s.daemonTarget(d).env
	cmd.Stdout, cmd.Stderr = out, out
	launchErr := cmd.Run()
	if launchErr != nil && cctx.Err() == nil {
		msg, _ := os.ReadFile(out.Name())
		return 0, fmt.Errorf("gpu %d (%s): start %s -d: %w: %s", d.Index, d.Device, bin, launchErr, bytes.TrimSpace(msg))
	}
	// A launcher killed for taking too long may have forked the daemon
	// already; it is waited for like any, or the next start would orphan it.
	deadline := time.Now().Add(s.opts.CommandTimeout)
	for {
		pid, err := readPID(pidFile)
		if err == nil && alive(pid) {
			s.log.Info("started mps daemon", "gpu", d.Index, "device", d.Device, "pid", pid, "pipeDir", pipe)
			return pid, nil
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			if launchErr != nil {
				return 0, fmt.Errorf("gpu %d (%s): start %s -d: %w after %v, and no daemon wrote %s", d.Index, d.Device, bin, launchErr, s.opts.CommandTimeout, pidFile)
			}
			return 0, fmt.Errorf("gpu %d (%s): mps daemon wrote no live pid to %s: %v", d.Index, d.Device, pidFile, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// lookBinary is the control program, looked up on PATH the first time it is
// needed rather than at construction, so that an agent without MPS sharing
// does not need it.
func (s *Supervisor) lookBinary() (string, error) {
	if s.binary == "" {
		path, err := exec.LookPath(DefaultBinary)
		if err != nil {
			return "", err
		}
		s.binary = path
	}
	return s.binary, nil
}

// target is how to reach one daemon with the control program.
type target struct {
	name string // for errors
	env  []string
}

// daemonTarget reaches d's daemon. Its environment is also the daemon's own:
// the agent's (PATH, library paths) with the device pinned and the
// directories set.
func (s *Supervisor) daemonTarget(d Daemon) target {
	return target{
		name: fmt.Sprintf("gpu %d (%s)", d.Index, d.Device),
		env: append(s.baseEnv(),
			"CUDA_VISIBLE_DEVICES="+d.Device,
			"CUDA_MPS_PIPE_DIRECTORY="+PipeDir(s.opts.Root, d.Device),
			"CUDA_MPS_LOG_DIRECTORY="+LogDir(s.opts.Root, d.Device),
		),
	}
}

// folderTarget reaches a daemon found in the device folder name under Root,
// whose device is not known: folder names do not map back to device UUIDs.
func (s *Supervisor) folderTarget(name string) target {
	dir := filepath.Join(s.opts.Root, name)
	return target{
		name: "mps daemon in " + dir,
		env: append(s.baseEnv(),
			"CUDA_MPS_PIPE_DIRECTORY="+filepath.Join(dir, "pipe"),
			"CUDA_MPS_LOG_DIRECTORY="+filepath.Join(dir, "log"),
		),
	}
}

func (s *Supervisor) baseEnv() []string {
	return slices.DeleteFunc(os.Environ(), func(kv string) bool {
		return strings.HasPrefix(kv, "CUDA_VISIBLE_DEVICES=") ||
			strings.HasPrefix(kv, "CUDA_MPS_PIPE_DIRECTORY=") ||
			strings.HasPrefix(kv, "CUDA_MPS_LOG_DIRECTORY=")
	})
}

// control sends commands to t's daemon through one client invocation and
// returns what it printed.
func (s *Supervisor) control(ctx context.Context, t target, cmds ...string) (string, error) {
	bin, err := s.lookBinary()
	if err != nil {
		return "", fmt.Errorf("%s: mps control: %w", t.name, err)
	}
	cctx, cancel := context.WithTimeout(ctx, s.opts.CommandTimeout)
	defer cancel()
	cmd := exec.CommandContext(cctx, bin, s.opts.Args...)
	cmd.Env = t.env
	cmd.Stdin = strings.NewReader(strings.Join(cmds, "\n") + "\n")
	cmd.WaitDelay = time.Second
	out, err := cmd.CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("%s: mps control %q: %w: %s", t.name, cmds, err, bytes.TrimSpace(out))
	}
	return string(out), nil
}

func (s *Supervisor) ping(ctx context.Context, t target) error {
	_, err := s.control(ctx, t, "get_server_list")
	return err
}

// apply sets d's limits as the daemon's defaults and on every server it
// already runs, so a change reaches running clients' future contexts too.
func (s *Supervisor) apply(ctx context.Context, t target, d Daemon) error {
	cmds := limitCommands(d)
	if len(cmds) == 0 {
		return nil
	}
	out, err := s.control(ctx, t, append([]string{"get_server_list"}, cmds...)...)
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
		if _, err := s.control(ctx, t, perServer...); err != nil {
			return err
		}
	}
	s.log.Info("applied mps limits", "gpu", d.Index, "device", d.Device,
		"activeThreadPercentage", d.ActiveThreadPercentage, "pinnedMemLimitBytes", d.PinnedMemLimitBytes)
	return nil
}

// quit asks t's daemon, process pid, to quit and waits for it to exit. A
// daemon that does not exit within StopTimeout is killed if it took the quit
// or is ours; otherwise pid may not be an MPS daemon at all (a pid file
// outlives its daemon) and is left alone. An ended ctx abandons the stop
// without a kill: the agent is going away, not deciding that the daemon must.
func (s *Supervisor) quit(ctx context.Context, t target, pid int, ours bool) error {
	_, err := s.control(ctx, t, "quit")
	if ctx.Err() != nil {
		return fmt.Errorf("%s (pid %d): stop abandoned: %w", t.name, pid, ctx.Err())
	}
	if err != nil && !ours {
		if !alive(pid) {
			return nil
		}
		return fmt.Errorf("%s (pid %d) left running: it does not take quit, and the pid may not be an mps daemon: %w", t.name, pid, err)
	}
	if err != nil {
		s.log.Warn("mps quit failed", "daemon", t.name, "pid", pid, "err", err)
	}
	deadline := time.Now().Add(s.opts.StopTimeout)
	for alive(pid) {
		if time.Now().After(deadline) {
			s.log.Warn("mps daemon ignored quit; killing", "daemon", t.name, "pid", pid)
			_ = syscall.Kill(pid, syscall.SIGKILL)
			break
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s (pid %d): stop abandoned: %w", t.name, pid, ctx.Err())
		case <-time.After(10 * time.Millisecond):
		}
	}
	s.log.Info("stopped mps daemon", "daemon", t.name, "pid", pid)
	return nil
}

// maxSmallFile bounds what is read of a pid file or a limits record: each
// holds a line, and a file that does not must not be read whole.
const maxSmallFile = 4 << 10

// readSmall reads a pid file or limits record, at most maxSmallFile bytes.
func readSmall(path string) ([]byte, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, maxSmallFile+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if len(b) > maxSmallFile {
		return nil, fmt.Errorf("%s: larger than %d bytes", path, maxSmallFile)
	}
	return b, nil
}

func readPID(path string) (int, error) {
	b, err := readSmall(path)
	if err != nil {
		return 0, err
	}
	pid, err := parsePID(b)
	if err != nil {
		return 0, fmt.Errorf("%s: %w", path, err)
	}
	return pid, nil
}

// parsePID reads the content of a pid file: a positive process id and
// optional white space.
func parsePID(b []byte) (int, error) {
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("bad pid %q", bytes.TrimSpace(b))
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
