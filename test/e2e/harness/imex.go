package harness

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
)

// What the ComputeDomain tests (test/e2e and test/e2e/controlplane) read of a domain and of the IMEX daemons
// the agents run for it.

// DomainStatusNodes is a ComputeDomain's status.nodes by node name (none for a nil domain).
func DomainStatusNodes(cd *unstructured.Unstructured) map[string]map[string]any {
	out := map[string]map[string]any{}
	if cd == nil {
		return out
	}
	list, _, _ := unstructured.NestedSlice(cd.Object, "status", "nodes")
	for _, e := range list {
		if m, ok := e.(map[string]any); ok {
			name, _ := m["name"].(string)
			out[name] = m
		}
	}
	return out
}

// IMEXDaemonPID reads the pid file an agent whose --state-dir is stateDir keeps for its IMEX daemon of domain.
func IMEXDaemonPID(stateDir, domain string) (int, error) {
	b, err := os.ReadFile(filepath.Join(stateDir, "imex", domain, "pid"))
	if err != nil {
		return 0, err
	}
	return strconv.Atoi(strings.TrimSpace(string(b)))
}

// ProcessAlive reports whether pid is a process that has not exited (a zombie has).
func ProcessAlive(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	return i > 0 && i+2 < len(s) && s[i+2] != 'Z'
}

// KillIMEXDaemons ends the IMEX daemons a failed run left under the agent state dir of node: they run in
// sessions of their own and outlive the agent by design.
func KillIMEXDaemons(t testing.TB, node, stateDir string) {
	files, _ := filepath.Glob(filepath.Join(stateDir, "imex", "*", "pid"))
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			continue
		}
		if pid, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && ProcessAlive(pid) {
			t.Logf("%s: killing IMEX daemon %d left running (%s)", node, pid, f)
			_ = syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

// fatalError ends a WaitFor at once; other errors of a condition (an API call that failed) are retried.
type fatalError struct{ error }

// Fatal makes err end a WaitFor at once.
func Fatal(err error) error { return fatalError{err} }

// WaitFor polls cond every 100ms until it is true, returns an error made by Fatal, or limit (or ctx) ends.
func WaitFor(ctx context.Context, what string, limit time.Duration, cond func() (bool, error)) error {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	var last error
	for {
		ok, err := cond()
		if ok {
			return nil
		}
		if f := (fatalError{}); errors.As(err, &f) {
			return fmt.Errorf("%s: %w", what, f.error)
		}
		if err != nil {
			last = err
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%s: not within %s (last error: %v)", what, limit, last)
		case <-time.After(100 * time.Millisecond):
		}
	}
}
