package imex

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
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

// DaemonSpec is the IMEX daemon one domain needs on this node.
type DaemonSpec struct {
	// Domain is the ComputeDomain's UID; Name its namespace/name, for
	// the config's comment and logs.
	Domain string
	Name   string
	// BindIP is this node's address in the domain's node list.
	BindIP string
	// Nodes are the addresses of the domain's nodes in this node's clique,
	// by index: the node list.
	Nodes []string
	// ServerPort and CmdPort are the domain's own ports (serverPorts).
	ServerPort, CmdPort int
}

// DaemonState is where one domain's daemon stands.
type DaemonState struct {
	PID   int  `json:"pid,omitempty"`
	Ready bool `json:"ready"`
	// Reason says why it is not ready (the control program's answer, a
	// failed start).
	Reason string `json:"reason,omitempty"`
	// Failures counts its failed starts and exits in a row.
	Failures int `json:"failures,omitempty"`
}

// SupervisorOptions configure a Supervisor.
type SupervisorOptions struct {
	// Binary and Args start a daemon (Args, then -c <config>): nvidia-imex,
	// or `gpu-agent imex-sim` on simulated nodes. CtlBinary and CtlArgs
	// query one (-c <config> -q): nvidia-imex-ctl, or `gpu-agent
	// imex-ctl-sim`.
	Binary    string
	Args      []string
	CtlBinary string
	CtlArgs   []string
	// Dir holds one folder per domain: imexd.cfg, nodes.cfg, the pid and
	// the daemon's output.
	Dir string
	// Interval is how often daemons are checked (default 2s).
	Interval time.Duration
	// CmdOnBindIP puts a daemon's command port on its node's own address
	// rather than 127.0.0.1. Simulated nodes sharing one host each have a
	// loopback address of their own; on 127.0.0.1 the daemons of one
	// domain on two such nodes would take the same port. A real node
	// keeps the command port local.
	CmdOnBindIP bool
	Logger      *slog.Logger
}

// Supervisor keeps one IMEX daemon per domain running, as a process of its
// own session: like MPS control daemons, IMEX daemons outlive the agent
// (the imports of running jobs go through them), and an agent that starts
// adopts the daemons its pid files name. A node list that changes is
// rewritten and the daemon told with SIGUSR1 (it resolves its peers
// again) once it has answered a query; a changed address or port
// restarts it.
type Supervisor struct {
	opts    SupervisorOptions
	log     *slog.Logger
	wake    chan struct{}
	changes chan struct{}

	mu      sync.Mutex
	want    map[string]DaemonSpec
	running map[string]*daemonProc
	states  map[string]DaemonState
}

type daemonProc struct {
	spec DaemonSpec
	pid  int
	// exited is closed when a child of ours exits; nil for an adopted one.
	exited chan struct{}
	// retryAt: after a failure, when to start again.
	retryAt time.Time
	// answered: the daemon has answered a query since it started (or was
	// adopted), so it is past its start-up and handles SIGUSR1. A signal
	// sent earlier can land before its handler is in place, and be lost
	// or end the process.
	answered bool
	// reload: the node list changed and the daemon has not been told yet.
	reload bool
}

// NewSupervisor returns a supervisor that runs nothing until Set and Run.
func NewSupervisor(opts SupervisorOptions) *Supervisor {
	if opts.Interval <= 0 {
		opts.Interval = 2 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	return &Supervisor{opts: opts, log: opts.Logger, wake: make(chan struct{}, 1), changes: make(chan struct{}, 1),
		want: map[string]DaemonSpec{}, running: map[string]*daemonProc{}, states: map[string]DaemonState{}}
}

// Set makes specs the daemons wanted; the others are stopped.
func (s *Supervisor) Set(specs []DaemonSpec) {
	s.mu.Lock()
	s.want = map[string]DaemonSpec{}
	for _, sp := range specs {
		s.want[sp.Domain] = sp
	}
	s.mu.Unlock()
	select {
	case s.wake <- struct{}{}:
	default:
	}
}

// State is domain's daemon's state.
func (s *Supervisor) State(domain string) DaemonState {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.states[domain]
}

// Changes signals when a daemon's state changed.
func (s *Supervisor) Changes() <-chan struct{} { return s.changes }

// Run supervises until ctx ends; the daemons keep running after.
func (s *Supervisor) Run(ctx context.Context) error {
	t := time.NewTicker(s.opts.Interval)
	defer t.Stop()
	for {
		s.reconcile(ctx)
		select {
		case <-ctx.Done():
			return nil
		case <-s.wake:
		case <-t.C:
		}
	}
}

// StopAll stops every daemon this supervisor runs or finds a pid file of
// (uninstall, and tests).
func (s *Supervisor) StopAll() {
	s.Set(nil)
	s.reconcile(context.Background())
}

func (s *Supervisor) domainDir(domain string) string { return filepath.Join(s.opts.Dir, domain) }

func (s *Supervisor) reconcile(ctx context.Context) {
	s.mu.Lock()
	want := s.want
	s.mu.Unlock()
	// Daemons left by an earlier agent: adopt the wanted, stop the others.
	entries, _ := os.ReadDir(s.opts.Dir)
	for _, e := range entries {
		d := e.Name()
		if _, ok := s.running[d]; ok || !e.IsDir() {
			continue
		}
		pid := s.adoptable(d)
		if _, wanted := want[d]; wanted && pid > 0 {
			s.running[d] = &daemonProc{pid: pid, spec: s.recordedSpec(d)}
			s.log.Info("IMEX daemon adopted", "domain", d, "pid", pid)
			continue
		}
		if _, wanted := want[d]; !wanted {
			if pid > 0 {
				stopPID(pid, nil)
			}
			_ = os.RemoveAll(s.domainDir(d))
		}
	}
	for d, p := range s.running {
		if _, wanted := want[d]; !wanted {
			stopPID(p.pid, p.exited)
			delete(s.running, d)
			_ = os.RemoveAll(s.domainDir(d))
			s.setState(d, DaemonState{}, true)
			s.log.Info("IMEX daemon stopped", "domain", d)
		}
	}
	for _, d := range sortedKeys(want) {
		s.keep(ctx, want[d])
	}
}

// keep brings domain's daemon to spec and asks whether it is ready.
func (s *Supervisor) keep(ctx context.Context, spec DaemonSpec) {
	d := spec.Domain
	p := s.running[d]
	if p != nil && !p.alive() {
		st := s.State(d)
		st.Failures++
		st.Ready, st.PID, st.Reason = false, 0, "the daemon exited"
		s.setState(d, st, false)
		s.log.Warn("IMEX daemon exited", "domain", d, "pid", p.pid, "failures", st.Failures)
		p.pid, p.retryAt = 0, time.Now().Add(backoff(st.Failures))
	}
	if p != nil && p.pid > 0 && (p.spec.BindIP != spec.BindIP || p.spec.ServerPort != spec.ServerPort || p.spec.CmdPort != spec.CmdPort) {
		stopPID(p.pid, p.exited)
		p.pid = 0
	}
	if err := s.writeFiles(spec); err != nil {
		s.fail(d, p, "config: "+err.Error())
		return
	}
	switch {
	case p != nil && p.pid > 0:
		if !slices.Equal(p.spec.Nodes, spec.Nodes) {
			// The daemon rereads its node list and resolves it again on
			// SIGUSR1, sent once it has answered a query (below).
			p.reload = true
			s.log.Info("IMEX daemon node list changed", "domain", d, "nodes", spec.Nodes)
		}
		p.spec = spec
	case p != nil && time.Now().Before(p.retryAt):
		return
	default:
		pid, exited, err := s.start(spec)
		if err != nil {
			if p == nil {
				p = &daemonProc{spec: spec}
				s.running[d] = p
			}
			s.fail(d, p, err.Error())
			return
		}
		if p == nil {
			p = &daemonProc{}
			s.running[d] = p
		}
		// It reads the node list as it is now: nothing to tell it yet.
		p.spec, p.pid, p.exited, p.answered, p.reload = spec, pid, exited, false, false
		s.log.Info("IMEX daemon started", "domain", d, "pid", pid, "nodes", spec.Nodes)
	}
	ready, why, answered := s.query(ctx, d)
	p.answered = p.answered || answered
	if p.reload {
		// Ready or not, its answer is about the old node list.
		ready, why = false, "IMEX daemon: node list changed, not yet reread"
		if p.answered {
			if err := syscall.Kill(p.pid, syscall.SIGUSR1); err != nil {
				s.log.Warn("IMEX daemon: SIGUSR1", "domain", d, "err", err)
			} else {
				p.reload = false
				s.log.Info("IMEX daemon told to reread its node list", "domain", d, "pid", p.pid)
			}
		}
	}
	st := s.State(d)
	st.PID, st.Ready, st.Reason = p.pid, ready, why
	if ready {
		st.Failures = 0
	}
	s.setState(d, st, false)
}

func (s *Supervisor) fail(d string, p *daemonProc, why string) {
	st := s.State(d)
	st.Failures++
	st.Ready, st.Reason = false, why
	s.setState(d, st, false)
	if p != nil {
		p.retryAt = time.Now().Add(backoff(st.Failures))
	}
	s.log.Error("IMEX daemon", "domain", d, "err", why, "failures", st.Failures)
}

// backoff is the wait before restart n: 1s doubling to at most a minute.
func backoff(n int) time.Duration {
	return min(time.Second<<min(n, 6), time.Minute)
}

func (s *Supervisor) setState(d string, st DaemonState, drop bool) {
	s.mu.Lock()
	old, had := s.states[d]
	if drop {
		delete(s.states, d)
	} else {
		s.states[d] = st
	}
	s.mu.Unlock()
	if old != st || had == drop {
		select {
		case s.changes <- struct{}{}:
		default:
		}
	}
}

// configText is a domain's IMEX config, in nvidia-imex's format, its
// command port on cmdIP.
func configText(spec DaemonSpec, nodesPath, cmdIP string) []byte {
	var b bytes.Buffer
	fmt.Fprintf(&b, "# IMEX daemon of ComputeDomain %s (%s), written by gpu-agent.\n", spec.Name, spec.Domain)
	fmt.Fprintf(&b, "DAEMONIZE=0\nSERVER_PORT=%d\nBIND_INTERFACE_IP=%s\nIMEX_NODE_CONFIG_FILE=%s\n", spec.ServerPort, spec.BindIP, nodesPath)
	fmt.Fprintf(&b, "IMEX_CMD_PORT=%d\nIMEX_CMD_BIND_INTERFACE_IP=%s\nIMEX_CMD_ENABLED=1\nIMEX_WAIT_FOR_QUORUM=RECOVERY\n", spec.CmdPort, cmdIP)
	return b.Bytes()
}

// cmdIP is where spec's daemon takes commands (CmdOnBindIP).
func (s *Supervisor) cmdIP(spec DaemonSpec) string {
	if s.opts.CmdOnBindIP && spec.BindIP != "" {
		return spec.BindIP
	}
	return "127.0.0.1"
}

func (s *Supervisor) writeFiles(spec DaemonSpec) error {
	dir := s.domainDir(spec.Domain)
	if err := os.MkdirAll(dir, 0o750); err != nil {
		return err
	}
	nodesPath := filepath.Join(dir, "nodes.cfg")
	files := map[string][]byte{
		nodesPath:                        []byte(strings.Join(spec.Nodes, "\n") + "\n"),
		filepath.Join(dir, "imexd.cfg"):  configText(spec, nodesPath, s.cmdIP(spec)),
		filepath.Join(dir, "domain.txt"): []byte(spec.Name + "\n"),
	}
	for path, data := range files {
		if old, err := os.ReadFile(path); err == nil && bytes.Equal(old, data) {
			continue
		}
		if err := atomicfile.Write(path, data); err != nil {
			return err
		}
	}
	return nil
}

// recordedSpec reads back what an adopted daemon was started with, enough
// to tell a changed node list or port.
func (s *Supervisor) recordedSpec(d string) DaemonSpec {
	spec := DaemonSpec{Domain: d}
	if b, err := os.ReadFile(filepath.Join(s.domainDir(d), "nodes.cfg")); err == nil {
		spec.Nodes = strings.Fields(string(b))
	}
	if b, err := os.ReadFile(filepath.Join(s.domainDir(d), "imexd.cfg")); err == nil {
		for line := range strings.Lines(string(b)) {
			k, v, _ := strings.Cut(strings.TrimSpace(line), "=")
			n, _ := strconv.Atoi(v)
			switch k {
			case "SERVER_PORT":
				spec.ServerPort = n
			case "IMEX_CMD_PORT":
				spec.CmdPort = n
			case "BIND_INTERFACE_IP":
				spec.BindIP = v
			}
		}
	}
	return spec
}

func (s *Supervisor) start(spec DaemonSpec) (int, chan struct{}, error) {
	if s.opts.Binary == "" {
		return 0, nil, errors.New("no IMEX daemon program")
	}
	dir := s.domainDir(spec.Domain)
	out, err := os.OpenFile(filepath.Join(dir, "daemon.log"), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o640)
	if err != nil {
		return 0, nil, err
	}
	defer out.Close()
	cmd := exec.Command(s.opts.Binary, append(slices.Clone(s.opts.Args), "-c", filepath.Join(dir, "imexd.cfg"))...)
	cmd.Stdout, cmd.Stderr = out, out
	// A session of its own: the agent's end (or its container's signals)
	// do not end the daemon.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	if err := cmd.Start(); err != nil {
		return 0, nil, fmt.Errorf("start %s: %w", s.opts.Binary, err)
	}
	exited := make(chan struct{})
	go func() { _ = cmd.Wait(); close(exited) }()
	pid := cmd.Process.Pid
	if err := atomicfile.Write(filepath.Join(dir, "pid"), []byte(strconv.Itoa(pid)+"\n")); err != nil {
		stopPID(pid, exited)
		return 0, nil, err
	}
	return pid, exited, nil
}

// adoptable is the pid of a live daemon that domain d's pid file names
// and whose command line is this folder's config; 0 if none.
func (s *Supervisor) adoptable(d string) int {
	b, err := atomicfile.ReadFile(filepath.Join(s.domainDir(d), "pid"), 64)
	if err != nil {
		return 0
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 1 || syscall.Kill(pid, 0) != nil {
		return 0
	}
	cmdline, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "cmdline"))
	if err != nil || !bytes.Contains(cmdline, []byte(filepath.Join(s.domainDir(d), "imexd.cfg"))) {
		return 0
	}
	return pid
}

func (p *daemonProc) alive() bool {
	if p.pid == 0 {
		return true // waiting for a restart, not a new exit
	}
	if p.exited != nil {
		select {
		case <-p.exited:
			return false
		default:
			return true
		}
	}
	return syscall.Kill(p.pid, 0) == nil
}

// query asks domain d's daemon whether it is READY.
// query asks domain d's daemon whether it is ready (nvidia-imex-ctl -q):
// ready, why not, and whether the daemon answered at all (READY or
// UNAVAILABLE, rather than the control program failing to reach it).
func (s *Supervisor) query(ctx context.Context, d string) (bool, string, bool) {
	if s.opts.CtlBinary == "" {
		return false, "no IMEX control program", false
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, s.opts.CtlBinary, append(slices.Clone(s.opts.CtlArgs), "-c", filepath.Join(s.domainDir(d), "imexd.cfg"), "-q")...)
	out, err := cmd.Output()
	answer := strings.TrimSpace(string(out))
	if err == nil && answer == "READY" {
		return true, "", true
	}
	answered := answer == "UNAVAILABLE"
	if answer == "" && err != nil {
		answer = err.Error()
	}
	return false, "IMEX daemon: " + answer, answered
}

// stopPID ends a daemon: SIGTERM, then SIGKILL after 5 s.
func stopPID(pid int, exited chan struct{}) {
	if pid <= 0 || syscall.Kill(pid, syscall.SIGTERM) != nil {
		return
	}
	deadline := time.After(5 * time.Second)
	for {
		if exited != nil {
			select {
			case <-exited:
				return
			case <-deadline:
				_ = syscall.Kill(pid, syscall.SIGKILL)
				<-exited
				return
			}
		}
		if syscall.Kill(pid, 0) != nil {
			return
		}
		select {
		case <-deadline:
			_ = syscall.Kill(pid, syscall.SIGKILL)
			return
		case <-time.After(50 * time.Millisecond):
		}
	}
}

func sortedKeys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	slices.Sort(out)
	return out
}
