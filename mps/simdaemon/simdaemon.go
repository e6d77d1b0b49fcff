// Package simdaemon stands in for nvidia-cuda-mps-control on simulated nodes,
// where there is no CUDA to run the real one. It speaks the part of the
// control protocol gpu-agent speaks (a control socket and a pid file in the
// pipe directory, the default and per-server limit commands,
// get_server_list, quit) and keeps the limits it is given, so that MPS
// sharing can be tried, watched and tested without a GPU.
//
// What it was started with and every command but the health check go to
// control.log in the log directory. No CUDA client ever starts an MPS
// server on a simulated node; a simulation that wants the daemon to have
// some lists their pids in the file ServersFile of the pipe directory, one
// a line, and the daemon answers get_server_list with them and takes the
// per-server limit commands for them.
package simdaemon

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
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

// Names the real program uses in its pipe and log directories, so that the
// agent's supervisor and a person reading them find what they expect.
const (
	socketName  = "control"
	pidFileName = "nvidia-cuda-mps-control.pid"
	logName     = "control.log"
	// ServersFile, in the pipe directory, lists the MPS servers the
	// simulated node runs (pids, one a line); absent, none.
	ServersFile = "sim-servers"
)

// Env is what the control program learns from its environment, as the real
// one does.
type Env struct {
	PipeDir string // CUDA_MPS_PIPE_DIRECTORY
	LogDir  string // CUDA_MPS_LOG_DIRECTORY
	// Device is CUDA_VISIBLE_DEVICES: the one device the daemon serves.
	Device string
}

// EnvFrom reads Env through getenv (os.Getenv).
func EnvFrom(getenv func(string) string) (Env, error) {
	e := Env{PipeDir: getenv("CUDA_MPS_PIPE_DIRECTORY"), LogDir: getenv("CUDA_MPS_LOG_DIRECTORY"), Device: getenv("CUDA_VISIBLE_DEVICES")}
	if e.PipeDir == "" || e.LogDir == "" {
		return Env{}, errors.New("CUDA_MPS_PIPE_DIRECTORY and CUDA_MPS_LOG_DIRECTORY must be set")
	}
	return e, nil
}

// Launch starts the daemon as the real `nvidia-cuda-mps-control -d` does:
// in the background, in a session of its own so that it outlives its
// launcher, and returns once it answers, or with its error once it exits
// without. self is the command line that runs Serve (the agent's own binary
// and subcommand). The daemon writes errors to the launcher's stderr, which
// the agent's supervisor points at a file.
func Launch(self []string, env Env, timeout time.Duration) error {
	if len(self) == 0 {
		return errors.New("launch: no command to run the daemon with")
	}
	cmd := exec.Command(self[0], self[1:]...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("launch %s: %w", self[0], err)
	}
	// Reaped whatever happens: a launcher that lives on (tests) must not
	// keep a zombie.
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	deadline := time.Now().Add(timeout)
	for {
		if _, err := Control(env, "get_server_list"); err == nil {
			return nil
		}
		select {
		case err := <-exited:
			return fmt.Errorf("launch: the daemon (pid %d) exited before it answered: %v", cmd.Process.Pid, err)
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("launch: the daemon (pid %d) did not answer in %s on %s", cmd.Process.Pid, timeout, filepath.Join(env.PipeDir, socketName))
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// dial connects to the daemon's control socket. A unix socket address holds
// at most 108 bytes, which a deep MPS root under a home folder exceeds; the
// socket is then reached through /proc/self/fd/N, the pipe directory opened.
func dial(pipeDir string) (net.Conn, error) {
	addr := &net.UnixAddr{Name: filepath.Join(pipeDir, socketName), Net: "unix"}
	if len(addr.Name) < 100 {
		return net.DialUnix("unix", nil, addr)
	}
	dir, err := os.Open(pipeDir)
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	return net.Dial("unix", fmt.Sprintf("/proc/self/fd/%d/%s", dir.Fd(), socketName))
}

// Control sends cmds to the daemon of env, one a line, and returns what it
// answered, as the real program's client mode does with its stdin.
func Control(env Env, cmds ...string) (string, error) {
	c, err := dial(env.PipeDir)
	if err != nil {
		return "", fmt.Errorf("cannot find MPS control daemon process in %s: %w", env.PipeDir, err)
	}
	defer c.Close()
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := io.WriteString(c, strings.Join(cmds, "\n")+"\n"); err != nil {
		return "", fmt.Errorf("mps control %s: %w", env.PipeDir, err)
	}
	_ = c.(*net.UnixConn).CloseWrite()
	out, err := io.ReadAll(c)
	if err != nil {
		return "", fmt.Errorf("mps control %s: %w", env.PipeDir, err)
	}
	return string(out), nil
}

// Daemon is one stand-in control daemon: its socket and the limits it was
// given.
type Daemon struct {
	env     Env
	l       net.Listener
	logFile *os.File
	log     io.Writer

	mu sync.Mutex
	// threads is the default active thread percentage (100: MPS's
	// default); memLimit the default pinned memory limit per device
	// ordinal, as given ("10240M").
	threads  string
	memLimit map[string]string
}

// Listen makes the daemon of env: it binds the control socket, writes its
// pid file and opens control.log in the log directory, as the real daemon
// does. Serve then answers.
func Listen(env Env) (*Daemon, error) {
	for _, dir := range []string{env.PipeDir, env.LogDir} {
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return nil, fmt.Errorf("mps stand-in: %w", err)
		}
	}
	logf, err := os.OpenFile(filepath.Join(env.LogDir, logName), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return nil, fmt.Errorf("mps stand-in: %w", err)
	}
	sock := filepath.Join(env.PipeDir, socketName)
	_ = os.Remove(sock) // a killed daemon's socket; the supervisor checks the pid file for a live one
	l, err := listen(env.PipeDir)
	if err != nil {
		logf.Close()
		return nil, fmt.Errorf("mps stand-in: listen on %s: %w", sock, err)
	}
	pidFile := filepath.Join(env.PipeDir, pidFileName)
	if err := os.WriteFile(pidFile, []byte(strconv.Itoa(os.Getpid())+"\n"), 0o644); err != nil {
		l.Close()
		logf.Close()
		return nil, fmt.Errorf("mps stand-in: %w", err)
	}
	d := &Daemon{env: env, l: l, logFile: logf, log: logf, threads: "100.0", memLimit: map[string]string{}}
	// The environment too: the agent's supervisor sets each daemon's, and
	// a person (or test) reading the log can check it did.
	d.logf("stand-in MPS control daemon started for device %q (pid %d): CUDA_VISIBLE_DEVICES=%s CUDA_MPS_PIPE_DIRECTORY=%s CUDA_MPS_LOG_DIRECTORY=%s",
		env.Device, os.Getpid(), env.Device, env.PipeDir, env.LogDir)
	return d, nil
}

// Serve answers clients until one sends quit or ctx ends; then it closes
// the socket and removes it and the pid file. get_server_list answers the
// servers ServersFile lists, none without it.
func (d *Daemon) Serve(ctx context.Context) error {
	defer d.logFile.Close()
	defer os.Remove(filepath.Join(d.env.PipeDir, pidFileName))
	defer os.Remove(filepath.Join(d.env.PipeDir, socketName))
	quit := make(chan struct{})
	var once sync.Once
	go func() {
		select {
		case <-ctx.Done():
		case <-quit:
		}
		d.l.Close()
	}()
	var conns sync.WaitGroup
	defer conns.Wait()
	for {
		c, err := d.l.Accept()
		if err != nil {
			select {
			case <-quit:
				d.logf("stopped on quit")
				return nil
			default:
			}
			if ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("mps stand-in: accept: %w", err)
		}
		conns.Add(1)
		go func() {
			defer conns.Done()
			defer c.Close()
			if d.session(c, c) {
				once.Do(func() { close(quit) })
			}
		}()
	}
}

// listen binds the control socket, through the folder's descriptor when its
// path is too long for a unix socket address (see dial).
func listen(pipeDir string) (net.Listener, error) {
	sock := filepath.Join(pipeDir, socketName)
	if len(sock) < 100 {
		return net.Listen("unix", sock)
	}
	dir, err := os.Open(pipeDir)
	if err != nil {
		return nil, err
	}
	defer dir.Close()
	return net.Listen("unix", fmt.Sprintf("/proc/self/fd/%d/%s", dir.Fd(), socketName))
}

// session answers the commands of one client connection; it reports
// whether the client asked the daemon to quit.
func (d *Daemon) session(r io.Reader, w io.Writer) (quit bool) {
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		if line != "get_server_list" {
			// The supervisor's health check, every few seconds: logged,
			// it would grow the log without telling anything.
			d.logf("%s", line)
		}
		answer, q := d.do(line)
		if answer != "" {
			fmt.Fprintln(w, answer)
		}
		if q {
			return true
		}
	}
	return false
}

// do carries out one control command and returns its answer (possibly
// none) and whether it was quit. Arguments are checked as the real program
// checks them: a percentage from 1 to 100, a memory limit with a unit.
func (d *Daemon) do(line string) (answer string, quit bool) {
	f := strings.Fields(line)
	if len(f) == 0 {
		return "", false
	}
	d.mu.Lock()
	defer d.mu.Unlock()
	args := f[1:]
	switch f[0] {
	case "quit":
		return "", true
	case "get_server_list":
		return strings.Join(d.servers(), "\n"), false
	case "get_client_list":
		return "", false
	case "set_default_active_thread_percentage":
		if len(args) != 1 {
			return "usage: set_default_active_thread_percentage <1-100>", false
		}
		p, err := percentage(args[0])
		if err != nil {
			return err.Error(), false
		}
		d.threads = p
		return p, false
	case "get_default_active_thread_percentage":
		return d.threads, false
	case "set_default_device_pinned_mem_limit":
		if len(args) != 2 {
			return "usage: set_default_device_pinned_mem_limit <device> <limit, e.g. 1024M>", false
		}
		if err := memoryLimit(args[1]); err != nil {
			return err.Error(), false
		}
		d.memLimit[args[0]] = args[1]
		return "", false
	case "get_default_device_pinned_mem_limit":
		if len(args) != 1 {
			return "usage: get_default_device_pinned_mem_limit <device>", false
		}
		if l, ok := d.memLimit[args[0]]; ok {
			return l, false
		}
		return "0M", false
	case "set_active_thread_percentage", "set_device_pinned_mem_limit":
		// Per server: those ServersFile lists.
		if len(args) == 0 {
			return "usage: " + f[0] + " <server pid> ...", false
		}
		if !slices.Contains(d.servers(), args[0]) {
			return fmt.Sprintf("Server %s not found", args[0]), false
		}
		if f[0] == "set_active_thread_percentage" {
			if len(args) != 2 {
				return "usage: set_active_thread_percentage <server pid> <1-100>", false
			}
			p, err := percentage(args[1])
			if err != nil {
				return err.Error(), false
			}
			return p, false
		}
		if len(args) != 3 {
			return "usage: set_device_pinned_mem_limit <server pid> <device> <limit, e.g. 1024M>", false
		}
		if err := memoryLimit(args[2]); err != nil {
			return err.Error(), false
		}
		return "", false
	}
	return fmt.Sprintf("Unrecognized command %q", f[0]), false
}

// servers are the pids ServersFile lists (none when it is absent or
// unreadable): what the simulation says runs on the device.
func (d *Daemon) servers() []string {
	b, err := os.ReadFile(filepath.Join(d.env.PipeDir, ServersFile))
	if err != nil {
		return nil
	}
	var out []string
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil && pid > 0 {
			out = append(out, strconv.Itoa(pid))
		}
	}
	return out
}

func percentage(s string) (string, error) {
	v, err := strconv.ParseFloat(s, 64)
	if err != nil || !(v >= 1 && v <= 100) { // NaN too
		return "", fmt.Errorf("invalid active thread percentage %q: want 1 to 100", s)
	}
	return strconv.FormatFloat(v, 'f', 1, 64), nil
}

func memoryLimit(s string) error {
	num := strings.TrimRight(s, "KMGkmg")
	if num == s || num == "" {
		return fmt.Errorf("invalid pinned memory limit %q: want a size with a unit, e.g. 1024M", s)
	}
	if _, err := strconv.ParseUint(num, 10, 64); err != nil {
		return fmt.Errorf("invalid pinned memory limit %q: want a size with a unit, e.g. 1024M", s)
	}
	return nil
}

func (d *Daemon) logf(format string, args ...any) {
	fmt.Fprintf(d.log, "[%s] %s\n", time.Now().UTC().Format("2006-01-02 15:04:05.000"), fmt.Sprintf(format, args...))
}

// Main is the control program's command line, as the real program's: -d
// starts the daemon of the environment's pipe directory in the background
// (self is the command line that runs this program, to which Main adds
// --daemon), --daemon is that daemon, and no argument sends the lines of
// stdin to the daemon and prints its answers.
func Main(ctx context.Context, self, args []string, getenv func(string) string, stdin io.Reader, stdout io.Writer) error {
	env, err := EnvFrom(getenv)
	if err != nil {
		return err
	}
	switch {
	case len(args) == 1 && args[0] == "-d":
		return Launch(append(slices.Clone(self), "--daemon"), env, 10*time.Second)
	case len(args) == 1 && args[0] == "--daemon":
		d, err := Listen(env)
		if err != nil {
			return err
		}
		return d.Serve(ctx)
	case len(args) == 0:
		in, err := io.ReadAll(io.LimitReader(stdin, 1<<20))
		if err != nil {
			return err
		}
		out, err := Control(env, strings.Split(strings.TrimRight(string(in), "\n"), "\n")...)
		if err != nil {
			return err
		}
		_, err = io.WriteString(stdout, out)
		return err
	}
	return &UsageError{Args: args}
}

// UsageError is a command line Main does not take.
type UsageError struct{ Args []string }

func (e *UsageError) Error() string {
	return fmt.Sprintf("unexpected arguments %q: want -d or none (commands on stdin)", strings.Join(e.Args, " "))
}
