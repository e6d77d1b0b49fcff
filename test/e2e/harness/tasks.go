package harness

import (
	"bufio"
	"context"
	"fmt"
	"strconv"
	"strings"
)

// TaskPID returns the host PID of containerd task id (a container's first process, the one its command runs
// as), from `ctr tasks ls`. That is the PID a GPU process of the container has in NVML's answers, which name
// host PIDs: a process cannot learn it from inside its own PID namespace, so the suite reads it here.
func (e *Env) TaskPID(ctx context.Context, id string) (int, error) {
	out, err := e.ctr(ctx, "tasks", "ls")
	if err != nil {
		return 0, fmt.Errorf("ctr tasks ls: %w", err)
	}
	pid, ok := parseTaskPIDs(out)[id]
	if !ok {
		return 0, fmt.Errorf("containerd task %s: not running", id)
	}
	return pid, nil
}

// parseTaskPIDs reads `ctr tasks ls` (TASK PID STATUS) into the PIDs of the RUNNING tasks, by task ID.
func parseTaskPIDs(out string) map[string]int {
	pids := map[string]int{}
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) != 3 || f[2] != "RUNNING" {
			continue
		}
		if pid, err := strconv.Atoi(f[1]); err == nil && pid > 0 {
			pids[f[0]] = pid
		}
	}
	return pids
}
