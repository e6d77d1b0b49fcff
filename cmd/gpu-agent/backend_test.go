package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// An agent restarted on the same state file finds the MIG layout the last
// one made, as it would on real GPUs.
func TestSimBackendStateFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sim-state.json")
	spec := "sim:dgx-a100,mig-enabled,state=" + path
	be, err := openBackend(spec, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	d, r := be.Lib.DeviceGetHandleByIndex(2)
	if r != nvml.SUCCESS {
		t.Fatalf("GPU 2: %v", r)
	}
	info, _ := d.GetGpuInstanceProfileInfo(nvml.GPU_INSTANCE_PROFILE_7_SLICE)
	if _, r := d.CreateGpuInstance(&info); r != nvml.SUCCESS {
		t.Fatalf("CreateGpuInstance: %v", r)
	}
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("state file: %v", err)
	}
	if _, err := openBackend(spec, "", nil); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Errorf("second backend on one state file: %v, want refused", err)
	}
	be.Close()

	// No mig-enabled this time: the file, not the option, says how the GPUs are.
	be, err = openBackend("sim:dgx-a100,state="+path, "", nil)
	if err != nil {
		t.Fatalf("reopen after Close: %v", err)
	}
	defer be.Close()
	d, _ = be.Lib.DeviceGetHandleByIndex(2)
	if _, r := d.GetGpuInstanceById(1); r != nvml.SUCCESS {
		t.Errorf("GPU instance after reopen: %v", r)
	}
}

func TestSimBackendSpecErrors(t *testing.T) {
	tests := []struct {
		spec string
		want string
	}{
		{"sim:dgx-a100,state=", "state= needs a file path"},
		{"sim:dgx-a100,state", `unknown sim option "state" (want mig-enabled, immediate-mig-mode, state=<path>, crash-after=<n>)`},
		{"sim:dgx-a100,mig=on", `unknown sim option "mig=on"`},
	}
	for _, tt := range tests {
		_, err := openBackend(tt.spec, "", nil)
		var ue usageError
		if !errors.As(err, &ue) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("openBackend(%q): %v, want a usage error containing %q", tt.spec, err, tt.want)
		}
	}
	// A file the sim cannot read is not a usage error, and names the file.
	bad := filepath.Join(t.TempDir(), "s.json")
	if err := os.WriteFile(bad, []byte(`{"version":1,"profile":"dgx-h100","gpus":[]}`), 0o644); err != nil {
		t.Fatal(err)
	}
	_, err := openBackend("sim:dgx-a100,state="+bad, "", nil)
	if err == nil || !strings.Contains(err.Error(), bad) || !strings.Contains(err.Error(), `profile "dgx-h100"`) {
		t.Errorf("wrong-profile state file: %v", err)
	}
}

// Every goroutine of the agent may fail at once (issue 23, defect 14: a
// channel of 8 for up to 13 goroutines, drained only after all returned,
// could block the 9th failure, and with it shutdown, forever).
func TestGroupCollectsEveryFailure(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	g := &group{cancel: cancel}
	const n = 40
	for i := range n {
		g.Go(fmt.Sprintf("goroutine %d", i), func() error {
			<-ctx.Done() // all fail together, once the first did
			return errors.New("failed")
		})
	}
	g.Go("first", func() error { return errors.New("the first failure") })
	err := g.Wait()
	if err == nil {
		t.Fatal("no error")
	}
	for i := range n {
		if !strings.Contains(err.Error(), fmt.Sprintf("goroutine %d: failed", i)) {
			t.Fatalf("error of goroutine %d missing from %v", i, err)
		}
	}
	if !strings.Contains(err.Error(), "first: the first failure") {
		t.Fatalf("first failure missing from %v", err)
	}
}

// The simulated node logs through the agent's logger: with --log-format
// json, the crash-after kill is announced in JSON like every other line,
// naming its component.
func TestSimLogsInAgentFormat(t *testing.T) {
	bin := agentBinary(t)
	dir := t.TempDir()
	cfg := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(cfg, []byte(`version: v1
configs:
  default:
    mig:
      strategy: mixed
      devices:
      - devices: all
        mig-enabled: true
        mig-devices: {"1g.5gb": 7}
`), 0o644); err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(bin, "run", "--backend", "sim:dgx-a100,immediate-mig-mode,crash-after=1,state="+filepath.Join(dir, "sim.json"),
		"--config", cfg, "--device-plugin-dir", filepath.Join(dir, "dp"), "--state-dir", filepath.Join(dir, "state"),
		"--mps-root", filepath.Join(dir, "mps"), "--pod-resources-socket", filepath.Join(dir, "podres.sock"),
		"--listen", "127.0.0.1:0", "--node-name", "n1", "--log-format", "json")
	var logs bytes.Buffer
	cmd.Stderr = &logs
	err := cmd.Run()
	var exit *exec.ExitError
	if !errors.As(err, &exit) || exit.Sys().(syscall.WaitStatus).Signal() != syscall.SIGKILL {
		t.Fatalf("agent: %v, want killed by crash-after\n%s", err, logs.String())
	}
	crashed := false
	for _, line := range strings.Split(strings.TrimSpace(logs.String()), "\n") {
		var rec map[string]any
		if err := json.Unmarshal([]byte(line), &rec); err != nil {
			t.Errorf("log line not JSON: %q", line)
			continue
		}
		if strings.Contains(fmt.Sprint(rec["msg"]), "crashing the process") {
			crashed = rec["component"] == "sim"
		}
	}
	if !crashed {
		t.Errorf("no JSON line of component sim announced the crash:\n%s", logs.String())
	}
}
