// Command hostile-rss runs `gpu-agent run` on a simulated node against each
// hostile config a careless admin (or an attacker with ConfigMap edit
// rights) can produce, and prints the agent's peak RSS for each: the number
// the chart's memory limit (128Mi) must stay above.
//
//	go run ./cmd/hostile-rss -agent ../../bin/gpu-agent [-hold 5s]
//
// Each run lasts -hold after the agent has read its config (it keeps
// serving); its peak RSS is then read from /proc/PID/status (VmHWM, which
// exec resets, unlike wait4's ru_maxrss: that one also counts the pages the
// child shared with this process before exec).
package main

import (
	"flag"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"text/tabwriter"
	"time"
)

type input struct {
	name string
	// make writes the config at path (a file, a symlink, a FIFO, ...).
	make func(path string) error
}

func write(content string) func(string) error {
	return func(p string) error { return os.WriteFile(p, []byte(content), 0o644) }
}

func timeSliced(replicas string) string {
	return "version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources:\n        - name: nvidia.com/gpu\n          replicas: " + replicas + "\n"
}

func inputs() []input {
	flat := "version: v1\nconfigs: {}\nx: [" + strings.Repeat("a,", (1<<20-40)/2) + "a]\n"
	laughs := func() string {
		var b strings.Builder
		b.WriteString("version: v1\nlaughs:\n  l0: &l0 {passDeviceSpecs: true}\n")
		for i := 1; i < 9; i++ {
			fmt.Fprintf(&b, "  l%d: &l%d {<<: [", i, i)
			for j := range 10 {
				if j > 0 {
					b.WriteString(", ")
				}
				fmt.Fprintf(&b, "*l%d", i-1)
			}
			b.WriteString("]}\n")
		}
		b.WriteString("configs:\n  default: {devicePlugin: *l8}\n")
		return b.String()
	}()
	return []input{
		{"whole GPUs (baseline)", write("version: v1\nconfigs:\n  default: {}\n")},
		{"replicas: 1024 (the maximum)", write(timeSliced("1024"))},
		{"replicas: 100000", write(timeSliced("100000"))},
		{"replicas: 1000000000", write(timeSliced("1000000000"))},
		{"1 MiB flat list (densest YAML at the size limit)", write(flat)},
		{"billion laughs", write(laughs)},
		{"50 MB config", write("version: v1\nconfigs:\n  default: {}\n# " + strings.Repeat("x", 50<<20) + "\n")},
		{"symlink to /dev/zero", func(p string) error { return os.Symlink("/dev/zero", p) }},
		{"FIFO", func(p string) error { return syscall.Mkfifo(p, 0o644) }},
	}
}

func main() {
	agent := flag.String("agent", "bin/gpu-agent", "gpu-agent binary")
	hold := flag.Duration("hold", 5*time.Second, "how long each agent runs")
	profile := flag.String("backend", "sim:dgx-a100", "backend")
	flag.Parse()
	tw := tabwriter.NewWriter(os.Stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "INPUT\tPEAK RSS\tCONFIG ERROR")
	for _, in := range inputs() {
		rss, cfgErr, err := run(*agent, *profile, *hold, in)
		if err != nil {
			fmt.Fprintf(tw, "%s\tdied\t%s\n", in.name, err)
			tw.Flush()
			continue
		}
		fmt.Fprintf(tw, "%s\t%.1f MiB\t%s\n", in.name, float64(rss)/1024, cfgErr)
		tw.Flush()
	}
}

// run returns the agent's peak RSS in KiB and the config error it reported.
func run(agent, backend string, hold time.Duration, in input) (int64, string, error) {
	dir, err := os.MkdirTemp("", "hostile-rss-")
	if err != nil {
		return 0, "", err
	}
	defer os.RemoveAll(dir)
	for _, d := range []string{"dp", "state", "mps", "config"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return 0, "", err
		}
	}
	cfg := filepath.Join(dir, "config", "config.yaml")
	if err := in.make(cfg); err != nil {
		return 0, "", err
	}
	logPath := filepath.Join(dir, "agent.log")
	logf, err := os.Create(logPath)
	if err != nil {
		return 0, "", err
	}
	defer logf.Close()
	cmd := exec.Command(agent, "run", "--backend", backend, "--config", cfg,
		"--device-plugin-dir", filepath.Join(dir, "dp"), "--pod-resources-socket", filepath.Join(dir, "pr.sock"),
		"--state-dir", filepath.Join(dir, "state"), "--mps-root", filepath.Join(dir, "mps"), "--listen", "127.0.0.1:0")
	cmd.Stdout, cmd.Stderr = logf, logf
	if err := cmd.Start(); err != nil {
		return 0, "", err
	}
	time.Sleep(hold)
	rss, err := vmHWM(cmd.Process.Pid)
	if err != nil {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		log, _ := os.ReadFile(logPath)
		why := "exited early"
		if strings.Contains(string(log), "out of memory") {
			why = "out of memory"
		}
		return 0, "", fmt.Errorf("%s", why)
	}
	_ = cmd.Process.Signal(syscall.SIGTERM)
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case <-done:
	case <-time.After(20 * time.Second):
		_ = cmd.Process.Kill()
		<-done
	}
	log, _ := os.ReadFile(logPath)
	return rss, firstConfigError(string(log)), nil
}

// vmHWM is the process's peak RSS in KiB.
func vmHWM(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "VmHWM:"); ok {
			var kb int64
			_, err := fmt.Sscanf(strings.TrimSpace(v), "%d kB", &kb)
			return kb, err
		}
	}
	return 0, fmt.Errorf("no VmHWM in /proc/%d/status", pid)
}

// firstConfigError is the first "config rejected" line's error, shortened.
func firstConfigError(log string) string {
	for _, l := range strings.Split(log, "\n") {
		if !strings.Contains(l, "config rejected") && !strings.Contains(l, "config file unreadable") {
			continue
		}
		if _, e, ok := strings.Cut(l, "error="); ok {
			if len(e) > 90 {
				e = e[:90] + "..."
			}
			return e
		}
		return "(rejected)"
	}
	return "-"
}
