package main

import (
	"errors"
	"fmt"
	"io/fs"
	"log/slog"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
)

// memoryLimitShare is the part of the container's memory limit the Go
// runtime aims to stay under: the rest is the binary's own pages (about
// 57 MB of a DaemonSet pod's RSS, page cache the kernel can take back) and
// what the runtime cannot count.
const memoryLimitShare = 0.75

// cgroupMemoryFiles are where a container's memory limit is read: cgroup
// v2's memory.max, then cgroup v1's limit_in_bytes.
var cgroupMemoryFiles = []string{"/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"}

// cgroupMemoryLimit parses a cgroup memory limit file's content: the limit
// in bytes, or 0 where there is none ("max"; cgroup v1's page-rounded
// "unlimited", above any real machine's memory).
func cgroupMemoryLimit(content string) (int64, error) {
	s := strings.TrimSpace(content)
	if s == "max" {
		return 0, nil
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v <= 0 {
		return 0, fmt.Errorf("not a memory limit: %q", s)
	}
	if v >= 1<<62 {
		return 0, nil
	}
	return v, nil
}

// setMemoryLimit gives the Go runtime a soft memory limit under the
// container's (memoryLimitShare of it), so that the garbage collector works
// harder as the heap nears it rather than letting the kernel kill the pod
// at its limit. GOMEMLIMIT, where set, wins (the runtime read it at start).
// read reads a file (os.ReadFile); it returns the limit set, 0 if none.
func setMemoryLimit(log *slog.Logger, read func(string) ([]byte, error)) int64 {
	if _, ok := os.LookupEnv("GOMEMLIMIT"); ok {
		log.Info("Go memory limit from GOMEMLIMIT", "bytes", debug.SetMemoryLimit(-1))
		return 0
	}
	for _, path := range cgroupMemoryFiles {
		b, err := read(path)
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			log.Warn("cannot read the container's memory limit; the Go runtime has none", "file", path, "error", err)
			return 0
		}
		limit, err := cgroupMemoryLimit(string(b))
		if err != nil {
			log.Warn("cannot read the container's memory limit; the Go runtime has none", "file", path, "error", err)
			return 0
		}
		if limit == 0 {
			return 0
		}
		soft := int64(float64(limit) * memoryLimitShare)
		debug.SetMemoryLimit(soft)
		log.Info("Go memory limit set under the container's", "container", limit, "go", soft, "file", path)
		return soft
	}
	return 0
}
