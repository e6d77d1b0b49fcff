// Package proc reads what the bench commands measure of a process from /proc.
package proc

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// CPUTime is the user and system time pid has used, from /proc/PID/stat.
func CPUTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The fields after the command name, which is in parentheses.
	_, rest, _ := strings.Cut(string(b), ") ")
	f := strings.Fields(rest)
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	var ticks int64
	for _, s := range f[11:13] { // utime, stime
		n, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, err
		}
		ticks += n
	}
	const clkTck = 100 // USER_HZ: 100 on x86 and arm
	return time.Duration(ticks) * time.Second / clkTck, nil
}
