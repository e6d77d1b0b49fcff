package harness

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// Process is one daemon the suite started (containerd, the kubelet, gpu-agent). It is ended only through its
// own PID, never by name, because other engineers' processes share the machine.
type Process struct {
	Name    string
	LogPath string
	cmd     *exec.Cmd
	logFile *os.File
	done    chan struct{}
	waitErr error
}

// startProcess starts argv with stdout and stderr appended to logPath and records it in the ledger, so a
// later run can end it should this one die before its teardown.
func startProcess(name, logPath string, l *ledger, argv ...string) (*Process, error) {
	return startProcessEnv(name, logPath, l, nil, argv...)
}

// StartProcess starts argv as startProcess does, with env added to this process's own, recorded in no ledger:
// for programs outside the suite (the fleet benchmark) that start their own daemons. It dies with this process
// (SIGKILL), so none outlives a killed program.
func StartProcess(name, logPath string, env []string, argv ...string) (*Process, error) {
	return startProcessEnv(name, logPath, nil, env, argv...)
}

// startProcessEnv is startProcess with extra environment (added to this
// process's own).
func startProcessEnv(name, logPath string, l *ledger, env []string, argv ...string) (*Process, error) {
	f, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("%s: log: %w", name, err)
	}
	fmt.Fprintf(f, "=== %s: %s\n", time.Now().Format(time.RFC3339Nano), strings.Join(argv, " "))
	cmd := exec.Command(argv[0], argv[1:]...)
	if len(env) > 0 {
		cmd.Env = append(os.Environ(), env...)
	}
	cmd.Stdout, cmd.Stderr = f, f
	// SIGKILL the daemon when the test binary dies (go test's timeout, ^C), so none outlives the suite.
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if err := cmd.Start(); err != nil {
		f.Close()
		return nil, fmt.Errorf("%s: start %s: %w", name, argv[0], err)
	}
	p := &Process{Name: name, LogPath: logPath, cmd: cmd, logFile: f, done: make(chan struct{})}
	go func() {
		p.waitErr = cmd.Wait()
		f.Close()
		close(p.done)
	}()
	if l != nil {
		if err := l.add(cmd.Process.Pid); err != nil {
			p.Kill()
			return nil, fmt.Errorf("%s: %w", name, err)
		}
	}
	return p, nil
}

// PID is the process id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Exited reports whether the process has ended, and how.
func (p *Process) Exited() (bool, error) {
	select {
	case <-p.done:
		return true, p.waitErr
	default:
		return false, nil
	}
}

// Stop sends SIGTERM and waits up to grace before SIGKILL.
func (p *Process) Stop(grace time.Duration) error {
	if done, _ := p.Exited(); done {
		return nil
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil && !errors.Is(err, os.ErrProcessDone) {
		return fmt.Errorf("%s (pid %d): SIGTERM: %w", p.Name, p.PID(), err)
	}
	select {
	case <-p.done:
		return nil
	case <-time.After(grace):
	}
	p.Kill()
	return fmt.Errorf("%s (pid %d): still running %s after SIGTERM, killed", p.Name, p.PID(), grace)
}

// Kill sends SIGKILL and waits for the process to be reaped.
func (p *Process) Kill() {
	_ = p.cmd.Process.Signal(syscall.SIGKILL)
	<-p.done
}

// ledger records the run directory and the PIDs (with their start times, against PID reuse) of the current
// run in a file outside it. A run killed before teardown (go test -timeout, a panic in cleanup) leaves
// daemons, mounts and containerd shims behind; the next run reads the ledger and ends exactly those.
type ledger struct {
	path  string
	entry ledgerEntry
}

type ledgerEntry struct {
	RunDir string      `json:"runDir"`
	Procs  []ledgerPID `json:"procs"`
}

type ledgerPID struct {
	PID       int    `json:"pid"`
	StartTime uint64 `json:"startTime"` // field 22 of /proc/PID/stat, in clock ticks since boot
}

func newLedger(path, runDir string) (*ledger, error) {
	l := &ledger{path: path, entry: ledgerEntry{RunDir: runDir}}
	return l, l.save()
}

func (l *ledger) add(pid int) error {
	st, err := procStartTime(pid)
	if err != nil {
		return fmt.Errorf("ledger: pid %d: %w", pid, err)
	}
	l.entry.Procs = append(l.entry.Procs, ledgerPID{PID: pid, StartTime: st})
	return l.save()
}

func (l *ledger) save() error {
	b, err := json.Marshal(l.entry)
	if err != nil {
		return err
	}
	tmp := l.path + ".tmp"
	if err := os.WriteFile(tmp, b, 0o644); err != nil {
		return fmt.Errorf("ledger %s: %w", l.path, err)
	}
	return os.Rename(tmp, l.path)
}

// remove forgets the run after a clean teardown.
func (l *ledger) remove() error {
	if err := os.Remove(l.path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("ledger %s: %w", l.path, err)
	}
	return nil
}

// recoverLedger ends what an earlier, interrupted run left behind: its daemons (only if the PID still names
// the same process), the containerd shims that served its socket, and its mounts; then removes its directory.
func recoverLedger(path string, logf func(string, ...any)) error {
	b, err := os.ReadFile(path)
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("ledger %s: %w", path, err)
	}
	var e ledgerEntry
	if err := json.Unmarshal(b, &e); err != nil {
		return fmt.Errorf("ledger %s: %w", path, err)
	}
	logf("recovering from an interrupted run in %s", e.RunDir)
	for _, p := range e.Procs {
		if st, err := procStartTime(p.PID); err == nil && st == p.StartTime {
			logf("ending leftover pid %d", p.PID)
			_ = syscall.Kill(p.PID, syscall.SIGKILL)
		}
	}
	if e.RunDir != "" {
		killShims(e.RunDir, logf)
		time.Sleep(200 * time.Millisecond) // let the killed processes release their mounts
		if err := unmountUnder(e.RunDir); err != nil {
			return err
		}
		if err := os.RemoveAll(e.RunDir); err != nil {
			return fmt.Errorf("remove %s: %w", e.RunDir, err)
		}
	}
	return os.Remove(path)
}

// procStartTime reads a process's start time, which together with its PID names it uniquely.
func procStartTime(pid int) (uint64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// comm (field 2) may hold spaces and parentheses; the fields after the last ')' are plain.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: malformed", pid)
	}
	fields := strings.Fields(string(b[i+1:]))
	// fields[0] is field 3 (state), so field 22 is fields[19].
	if len(fields) < 20 {
		return 0, fmt.Errorf("/proc/%d/stat: too few fields", pid)
	}
	return strconv.ParseUint(fields[19], 10, 64)
}

// killShims SIGKILLs the containerd shims that served a containerd under runDir. Shims daemonise away from
// containerd, so they are found by the socket address in their arguments, which is unique to that run.
func killShims(runDir string, logf func(string, ...any)) {
	for _, pid := range shimPIDs(runDir) {
		logf("ending leftover containerd shim pid %d", pid)
		_ = syscall.Kill(pid, syscall.SIGKILL)
	}
}

// killMPSDaemons ends the MPS control daemons (the stand-in's) whose pipe
// directory is under mpsRoot: they outlive gpu-agent on purpose (an agent
// upgrade must not kill MPS clients), so only the suite's teardown ends them.
func killMPSDaemons(mpsRoot string, logf func(string, ...any)) {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return
	}
	for _, ent := range entries {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", ent.Name(), "environ"))
		if err != nil {
			continue
		}
		for _, kv := range strings.Split(string(b), "\x00") {
			if dir, ok := strings.CutPrefix(kv, "CUDA_MPS_PIPE_DIRECTORY="); ok && strings.HasPrefix(dir, mpsRoot+"/") {
				logf("ending MPS daemon pid %d (%s)", pid, dir)
				_ = syscall.Kill(pid, syscall.SIGKILL)
				break
			}
		}
	}
}

func shimPIDs(runDir string) []int {
	entries, err := os.ReadDir("/proc")
	if err != nil {
		return nil
	}
	var pids []int
	for _, ent := range entries {
		pid, err := strconv.Atoi(ent.Name())
		if err != nil {
			continue
		}
		b, err := os.ReadFile(filepath.Join("/proc", ent.Name(), "cmdline"))
		if err != nil {
			continue
		}
		args := strings.Split(string(b), "\x00")
		if len(args) == 0 || !strings.Contains(filepath.Base(args[0]), "containerd-shim") {
			continue
		}
		for _, a := range args {
			if strings.HasPrefix(a, runDir+"/") {
				pids = append(pids, pid)
				break
			}
		}
	}
	return pids
}

// mountsUnder lists the mount points at or below dir, deepest first, from /proc/self/mountinfo.
func mountsUnder(dir string) ([]string, error) {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	return parseMountsUnder(string(b), dir), nil
}

func parseMountsUnder(mountinfo, dir string) []string {
	dir = filepath.Clean(dir)
	var out []string
	for _, line := range strings.Split(mountinfo, "\n") {
		f := strings.Fields(line)
		if len(f) < 5 {
			continue
		}
		mp := unescapeMountinfo(f[4])
		if mp == dir || strings.HasPrefix(mp, dir+"/") {
			out = append(out, mp)
		}
	}
	sort.SliceStable(out, func(i, j int) bool { return len(out[i]) > len(out[j]) })
	return out
}

// unescapeMountinfo undoes the kernel's octal escapes (\040 for a space) in mountinfo paths.
func unescapeMountinfo(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+3 < len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// unmountUnder detaches every mount at or below dir. The kubelet bind-mounts its --root-dir onto itself (once
// per start, so they stack) and containerd leaves rootfs and shm mounts; repeat until none are left.
func unmountUnder(dir string) error {
	for range 20 {
		mps, err := mountsUnder(dir)
		if err != nil {
			return fmt.Errorf("unmount under %s: %w", dir, err)
		}
		if len(mps) == 0 {
			return nil
		}
		for _, mp := range mps {
			if err := syscall.Unmount(mp, syscall.MNT_DETACH); err != nil && !errors.Is(err, syscall.EINVAL) && !errors.Is(err, syscall.ENOENT) {
				return fmt.Errorf("unmount %s: %w", mp, err)
			}
		}
	}
	mps, _ := mountsUnder(dir)
	return fmt.Errorf("unmount under %s: still mounted after 20 rounds: %v", dir, mps)
}
