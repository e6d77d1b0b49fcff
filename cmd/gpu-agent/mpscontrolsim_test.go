package main

import (
	"context"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/mps"
	"github.com/gpu-agent/gpu-agent/mps/simdaemon"
)

// TestMain lets this test binary be the agent's own MPS and IMEX
// stand-ins: an agent run in-process starts `<this binary> mps-control-sim
// -d`, as the real agent starts itself.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && (os.Args[1] == mpsControlSimCommand || os.Args[1] == imexSimCommand) {
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, os.Interrupt)
		code := runMain(ctx, os.Args[1:], os.Stdout, os.Stderr)
		stop()
		os.Exit(code)
	}
	os.Exit(m.Run())
}

// On a simulated node, with no --mps-binary, the agent runs its own
// stand-in daemons: with docs/simulator.md's example the MPS replicas are healthy, and
// each daemon holds the limits every client of its GPU gets (half the SMs,
// 20 GiB). The daemons outlive the agent, as real ones do.
func TestRunSimMPSStandIn(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	if self, err = filepath.EvalSymlinks(self); err != nil {
		t.Fatal(err)
	}
	root, err := os.MkdirTemp("", "mps")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		killFakeDaemons(self, root)
		os.RemoveAll(root)
	})
	dir := t.TempDir()
	pluginDir := filepath.Join(dir, "dp")
	if err := os.Mkdir(pluginDir, 0o755); err != nil {
		t.Fatal(err)
	}
	startFakeKubelet(t, pluginDir)
	cfg := simMPSExample(t)
	addr := freeAddr(t)
	t.Setenv("GPU_AGENT_MPS_BINARY", "") // unset: the stand-in
	ag := startCommand(t, "run", "--backend", "sim:pcie-4gpu", "--device-plugin-dir", pluginDir,
		"--listen", addr, "--state-dir", filepath.Join(dir, "state"), "--node-name", "n1", "--config", cfg,
		"--mps-root", root, "--mps-shm-dir", filepath.Join(dir, "shm"))

	st := waitStatus(t, addr, "8 healthy MPS replicas", func(st *agent.Status) bool {
		for _, r := range st.Resource {
			if r.Name == "nvidia.com/gpu.mps" {
				healthy := 0
				for _, d := range r.Devices {
					if d.Healthy {
						healthy++
					}
				}
				return healthy == 8
			}
		}
		return false
	})
	if len(st.GPUs) != 4 {
		t.Fatalf("%d GPUs, want 4", len(st.GPUs))
	}
	pids := map[string]int{}
	for _, g := range st.GPUs {
		env := simdaemon.Env{PipeDir: mps.PipeDir(root, g.UUID), LogDir: mps.LogDir(root, g.UUID)}
		out, err := simdaemon.Control(env, "get_default_active_thread_percentage", "get_default_device_pinned_mem_limit 0")
		want := "50.0\n20480M\n" // as docs/simulator.md says
		if err != nil || out != want {
			t.Errorf("gpu %d daemon: %q, %v; want %q", g.Index, out, err, want)
		}
		pids[g.UUID] = pidFile(t, root, g.UUID)
	}
	if code := ag.stop(t); code != 0 {
		t.Fatalf("agent exited %d", code)
	}
	for dev, pid := range pids {
		if err := syscall.Kill(pid, 0); err != nil {
			t.Errorf("%s daemon (pid %d) gone with the agent: %v", dev, pid, err)
		}
	}
}

func TestMPSControlSimUsage(t *testing.T) {
	t.Setenv("CUDA_MPS_PIPE_DIRECTORY", t.TempDir())
	t.Setenv("CUDA_MPS_LOG_DIRECTORY", t.TempDir())
	for _, tt := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{mpsControlSimCommand, "--help"}, 0, "stand-in for nvidia-cuda-mps-control"},
		{[]string{mpsControlSimCommand, "-x"}, 2, `unexpected arguments "-x"`},
	} {
		code, out, errOut := run(t, tt.args...)
		if code != tt.code || !strings.Contains(out+errOut, tt.want) {
			t.Errorf("%v: exit %d, %q %q; want %d and %q", tt.args, code, out, errOut, tt.code, tt.want)
		}
	}
}

// freeAddr is a loopback address nothing listens on.
func freeAddr(t *testing.T) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	return ln.Addr().String()
}

// The MPS side's log lines name their component once (the mps package
// names it; the agent once did too, and every line said component=mps twice).
func TestMPSControlLogsComponentOnce(t *testing.T) {
	var logs syncBuffer
	log, err := newLogger(&logs, "info", "text")
	if err != nil {
		t.Fatal(err)
	}
	f := runFlags{mpsBinary: filepath.Join(t.TempDir(), "absent"), mpsBinarySet: true, mpsRoot: t.TempDir()}
	c, err := newMPSControl(f, false, log)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.Set([]mps.Daemon{{Device: "GPU-x", Index: 0, ActiveThreadPercentage: 50}}); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	<-c.Changes() // the daemon could not start: unhealthy
	cancel()
	<-done
	lines := strings.Split(strings.TrimSpace(logs.String()), "\n")
	for _, l := range lines {
		if n := strings.Count(l, "component=mps"); n != 1 {
			t.Errorf("component=mps %d times in %q", n, l)
		}
	}
	if !strings.Contains(logs.String(), "mps daemon down") {
		t.Errorf("no line says the daemon is down:\n%s", logs.String())
	}
}

// simMPSExample is the config of docs/simulator.md's MPS example, as a
// file.
func simMPSExample(t *testing.T) string {
	t.Helper()
	readme, err := os.ReadFile("../../docs/simulator.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(readme), "cat >.run/mps.yaml <<'EOF'")
	_, rest, ok2 := strings.Cut(rest, "\n")
	example, _, ok3 := strings.Cut(rest, "\nEOF\n")
	if !ok || !ok2 || !ok3 {
		t.Fatal("docs/simulator.md has no MPS example")
	}
	file := filepath.Join(t.TempDir(), "mps.yaml")
	if err := os.WriteFile(file, []byte(example), 0o644); err != nil {
		t.Fatal(err)
	}
	return file
}

// docs/simulator.md's example gives the 16 replicas it says on make run's node; the
// limits it says are checked on a running agent (TestRunSimMPSStandIn).
func TestSimDocMPSExample(t *testing.T) {
	code, out, stderr := run(t, "config", "validate", simMPSExample(t), "--backend", "sim:dgx-a100")
	if code != 0 || !regexp.MustCompile(`(?m)^nvidia\.com/gpu\.mps +16 `).MatchString(out) {
		t.Errorf("docs/simulator.md's MPS example: exit %d, want 16 replicas of nvidia.com/gpu.mps:\n%s%s", code, out, stderr)
	}
}

// A daemon that cannot start fails its launch at once, with its reason in
// the launcher's stderr, rather than after the launch timeout.
func TestMPSControlSimLaunchFails(t *testing.T) {
	notDir := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(notDir, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CUDA_MPS_PIPE_DIRECTORY", filepath.Join(notDir, "pipe"))
	t.Setenv("CUDA_MPS_LOG_DIRECTORY", filepath.Join(notDir, "log"))
	code, _, errOut := run(t, mpsControlSimCommand, "-d")
	if code != 1 || !strings.Contains(errOut, "exited before it answered") {
		t.Errorf("launch into a file: exit %d, %q; want the daemon's early exit reported", code, errOut)
	}
}
