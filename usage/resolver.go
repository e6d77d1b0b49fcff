package usage

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"syscall"
)

// maxProcFile bounds what is read of a /proc file: a cgroup file of every
// v1 hierarchy with long systemd paths is a few KB, a stat line under 1 KB.
const maxProcFile = 64 << 10

// ErrGone is returned for a process that ended (or whose PID was taken by
// another) while it was being resolved.
var ErrGone = errors.New("process gone")

// Resolver finds the pod and container of host PIDs from the host's /proc.
// It caches each PID's owner with the process's start time and reads the
// cgroup again only when the PID belongs to a new process (PIDs are
// reused). Not safe for concurrent use.
type Resolver struct {
	root  string
	cache map[uint32]resolved
}

type resolved struct {
	start uint64
	owner Owner
}

// NewResolver reads processes under root: the host's /proc as the agent's
// container mounts it (such as /host/proc), "/proc" with hostPID, or a
// directory of test files laid out alike.
func NewResolver(root string) *Resolver {
	return &Resolver{root: root, cache: map[uint32]resolved{}}
}

// Resolve returns the owner of pid; an Owner with no PodUID for a process
// in no pod. A process that does not exist (or ended meanwhile) is ErrGone.
func (r *Resolver) Resolve(pid uint32) (Owner, error) {
	start, err := r.startTime(pid)
	if err != nil {
		return Owner{}, err
	}
	if c, ok := r.cache[pid]; ok && c.start == start {
		return c.owner, nil
	}
	data, err := r.read(pid, "cgroup")
	if err != nil {
		return Owner{}, err
	}
	// The PID may have been reused between the two reads: the cgroup read
	// is the process's only if it still has the start time read before.
	if again, err := r.startTime(pid); err != nil || again != start {
		return Owner{}, fmt.Errorf("pid %d: %w (its start time changed)", pid, ErrGone)
	}
	o := ParseCgroup(string(data))
	r.cache[pid] = resolved{start: start, owner: o}
	return o, nil
}

// Retain forgets the PIDs live does not hold, so the cache holds only
// processes NVML still reports.
func (r *Resolver) Retain(live func(pid uint32) bool) {
	for pid := range r.cache {
		if !live(pid) {
			delete(r.cache, pid)
		}
	}
}

func (r *Resolver) startTime(pid uint32) (uint64, error) {
	data, err := r.read(pid, "stat")
	if err != nil {
		return 0, err
	}
	start, err := ParseStartTime(data)
	if err != nil {
		return 0, fmt.Errorf("pid %d: %s: %w", pid, filepath.Join(r.root, strconv.FormatUint(uint64(pid), 10), "stat"), err)
	}
	return start, nil
}

// read returns /proc/<pid>/<name> under the root, bounded.
func (r *Resolver) read(pid uint32, name string) ([]byte, error) {
	path := filepath.Join(r.root, strconv.FormatUint(uint64(pid), 10), name)
	f, err := os.Open(path)
	if errors.Is(err, fs.ErrNotExist) || errors.Is(err, syscall.ESRCH) {
		return nil, fmt.Errorf("pid %d: %w", pid, ErrGone)
	}
	if err != nil {
		return nil, fmt.Errorf("pid %d: %w", pid, err)
	}
	defer f.Close()
	data, err := io.ReadAll(io.LimitReader(f, maxProcFile+1))
	switch {
	case errors.Is(err, syscall.ESRCH):
		// The process exited and was reaped while its file was open.
		return nil, fmt.Errorf("pid %d: %w", pid, ErrGone)
	case err != nil:
		return nil, fmt.Errorf("pid %d: %s: %w", pid, path, err)
	case len(data) > maxProcFile:
		return nil, fmt.Errorf("pid %d: %s: larger than %d bytes", pid, path, maxProcFile)
	}
	return data, nil
}

// ParseStartTime reads the start time (field 22, clock ticks since boot)
// from the content of /proc/<pid>/stat. The command name (field 2) is in
// parentheses and may hold spaces and parentheses itself, so the fields
// are counted from its last ')'.
func ParseStartTime(stat []byte) (uint64, error) {
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, errors.New("no command name")
	}
	fields := bytes.Fields(stat[i+1:])
	// fields[0] is field 3 (state), so field 22 is fields[19].
	const at = 22 - 3
	if len(fields) <= at {
		return 0, fmt.Errorf("%d fields after the command name, want at least %d", len(fields), at+1)
	}
	v, err := strconv.ParseUint(string(fields[at]), 10, 64)
	if err != nil {
		return 0, fmt.Errorf("start time: %w", err)
	}
	return v, nil
}

// CgroupSource gives the cgroup of processes /proc does not have: a
// simulated node's (sim.Node.ProcessCgroup), whose PIDs are made up.
type CgroupSource interface {
	ProcessCgroup(pid uint32) (string, bool)
}

// SimResolver resolves a PID from the cgroup Src sets for it, and
// otherwise through Next (the host's /proc; nil: the process is ErrGone).
// A simulated node runs both kinds: made-up PIDs with a cgroup, and the
// real PIDs of workloads that register themselves (e2e).
type SimResolver struct {
	Src  CgroupSource
	Next *Resolver
}

// Resolve returns the owner of pid, as Resolver.Resolve.
func (r SimResolver) Resolve(pid uint32) (Owner, error) {
	if cg, ok := r.Src.ProcessCgroup(pid); ok {
		return ParseCgroup(cg), nil
	}
	if r.Next == nil {
		return Owner{}, fmt.Errorf("pid %d: %w", pid, ErrGone)
	}
	return r.Next.Resolve(pid)
}

// Retain is Resolver.Retain of Next.
func (r SimResolver) Retain(live func(pid uint32) bool) {
	if r.Next != nil {
		r.Next.Retain(live)
	}
}
