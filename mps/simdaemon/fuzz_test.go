package simdaemon

import (
	"io"
	"strconv"
	"strings"
	"testing"
)

// FuzzCommand feeds any line to a daemon, as any process that can reach its
// socket may: it answers one line or none, quits only on quit, and keeps
// only limits the real program would take.
func FuzzCommand(f *testing.F) {
	for _, s := range []string{
		"set_default_active_thread_percentage 25", "set_default_active_thread_percentage 1e2", "set_default_active_thread_percentage NaN",
		"set_default_device_pinned_mem_limit 0 10240M", "get_default_device_pinned_mem_limit 0",
		"set_active_thread_percentage 1 2", "get_server_list", "quit", "quit now", "", " \t",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, line string) {
		d := &Daemon{log: io.Discard, threads: "100.0", memLimit: map[string]string{}}
		answer, quit := d.do(line)
		if strings.ContainsAny(answer, "\n\r") {
			t.Errorf("%q: answer %q spans lines", line, answer)
		}
		if f := strings.Fields(line); quit != (len(f) > 0 && f[0] == "quit") {
			t.Errorf("%q: quit %v", line, quit)
		}
		if p, err := strconv.ParseFloat(d.threads, 64); err != nil || !(p >= 1 && p <= 100) {
			t.Errorf("%q: keeps active thread percentage %q", line, d.threads)
		}
		for dev, l := range d.memLimit {
			if memoryLimit(l) != nil || strings.ContainsAny(dev, " \t\n") {
				t.Errorf("%q: keeps pinned memory limit %q for %q", line, l, dev)
			}
		}
	})
}
