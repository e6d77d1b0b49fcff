package main

import (
	"bytes"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"
)

// userHZ is the unit of /proc/<pid>/stat's utime and stime: USER_HZ, which Linux fixes at 100 for user
// space on every architecture Kubernetes runs on (sysconf(_SC_CLK_TCK) reports it; Go's standard library
// has no sysconf).
const userHZ = 100

// cpuTime is the CPU time (user + system) process pid has used so far.
func cpuTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	return parseCPUTime(b)
}

// parseCPUTime reads utime and stime (fields 14 and 15) from the content of /proc/<pid>/stat.
func parseCPUTime(stat []byte) (time.Duration, error) {
	// comm (field 2) may hold spaces and parentheses; the fields after the last ')' are plain, starting
	// with field 3.
	i := bytes.LastIndexByte(stat, ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc stat: no ')' after comm")
	}
	f := strings.Fields(string(stat[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc stat: %d fields after comm, want at least 13", len(f))
	}
	var ticks uint64
	for _, s := range f[11:13] { // fields 14 (utime) and 15 (stime)
		n, err := strconv.ParseUint(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc stat: %w", err)
		}
		ticks += n
	}
	return time.Duration(ticks) * time.Second / userHZ, nil
}

// memory is a process's resident set size now (VmRSS) and at its peak (VmHWM), in bytes.
type memory struct{ RSS, HWM uint64 }

func readMemory(pid int) (memory, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return memory{}, err
	}
	return parseMemory(b)
}

// parseMemory reads VmRSS and VmHWM ("VmHWM:    123456 kB") from the content of /proc/<pid>/status.
func parseMemory(status []byte) (memory, error) {
	var m memory
	found := 0
	for _, line := range strings.Split(string(status), "\n") {
		key, val, ok := strings.Cut(line, ":")
		if !ok || (key != "VmRSS" && key != "VmHWM") {
			continue
		}
		f := strings.Fields(val)
		if len(f) != 2 || f[1] != "kB" {
			return memory{}, fmt.Errorf("/proc status: %s: %q, want '<n> kB'", key, strings.TrimSpace(val))
		}
		n, err := strconv.ParseUint(f[0], 10, 64)
		if err != nil {
			return memory{}, fmt.Errorf("/proc status: %s: %w", key, err)
		}
		if key == "VmRSS" {
			m.RSS = n << 10
		} else {
			m.HWM = n << 10
		}
		found++
	}
	if found != 2 {
		return memory{}, fmt.Errorf("/proc status: VmRSS or VmHWM missing (a kernel thread, or the process exited)")
	}
	return m, nil
}

// resetPeakRSS sets the process's VmHWM back to its current RSS (writing 5 to clear_refs, Linux 4.0 and
// later), so that a peak read later is the peak of what happened since: the API server lives through
// several scenarios, each of which reports its own peak.
func resetPeakRSS(pid int) error {
	return os.WriteFile(fmt.Sprintf("/proc/%d/clear_refs", pid), []byte("5"), 0)
}

// parseHeapAlloc reads HeapAlloc, in bytes, from a Go heap profile in text form (pprof's heap?debug=1, whose
// runtime.MemStats lines read "# HeapAlloc = 123456").
func parseHeapAlloc(profile []byte) (uint64, error) {
	for _, line := range strings.Split(string(profile), "\n") {
		v, ok := strings.CutPrefix(strings.TrimSpace(line), "# HeapAlloc = ")
		if !ok {
			continue
		}
		n, err := strconv.ParseUint(strings.TrimSpace(v), 10, 64)
		if err != nil {
			return 0, fmt.Errorf("heap profile: HeapAlloc: %w", err)
		}
		return n, nil
	}
	return 0, fmt.Errorf("heap profile: no HeapAlloc line (not a text heap profile?)")
}
