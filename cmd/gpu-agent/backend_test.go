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

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
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
		{"sim:dgx-a100,state", `unknown sim option "state" (want mig-enabled, immediate-mig-mode, state=<path>, crash-after=<n>, clique=<id>, imex-channels=<n>, root=<dir>)`},
		{"sim:dgx-a100,mig=on", `unknown sim option "mig=on"`},
		{"sim:", "no profile after sim:"},
		{"sim:gb200-tray,clique=", `clique="": want a clique id, 0 to 4294967295`},
		{"sim:gb200-tray,clique=-1", `clique="-1": want a clique id`},
		{"sim:gb200-tray,clique=4294967296", `clique="4294967296"`},
		{"sim:gb200-tray,clique=1,clique=2", "clique given twice"},
		{"sim:dgx-h100,clique=1", `clique= needs a fabric-attached profile (one with gb200 in its name), not "dgx-h100"`},
		{"sim:gb200-tray,imex-channels=x", `imex-channels="x": want a channel count, 0 to 1048576 (the driver's default is 2048)`},
		{"sim:gb200-tray,imex-channels=-3", `imex-channels="-3"`},
		{"sim:gb200-tray,root=", "root= needs a directory"},
		{"sim:gb200-tray,mig-enabled,mig-enabled", "mig-enabled given twice"},
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

// Nodes given one clique share an NVLink domain; another clique is
// another; root= gets the driver's IMEX files.
func TestSimBackendClique(t *testing.T) {
	open := func(spec string) *backend {
		t.Helper()
		be, err := openBackend(spec, "", nil)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(be.Close)
		return be
	}
	root := t.TempDir()
	a := open("sim:gb200-tray,clique=3,imex-channels=4,root=" + root)
	b := open("sim:gb200-tray,clique=3")
	c := open("sim:gb200-tray,clique=4")
	cliqueOf := func(be *backend) string {
		t.Helper()
		inv, err := gpu.New(be.Lib, be.InventoryOptions)
		if err != nil {
			t.Fatal(err)
		}
		return inv.GPUs[0].Fabric.Clique()
	}
	if ca, cb, cc := cliqueOf(a), cliqueOf(b), cliqueOf(c); ca == "" || ca != cb || ca == cc || !strings.HasSuffix(cc, ".4") {
		t.Errorf("cliques %q %q %q: want the first two equal, the third another", ca, cb, cc)
	}
	params, err := os.ReadFile(filepath.Join(root, sim.DriverParamsPath))
	if err != nil || !strings.Contains(string(params), "ImexChannelCount: 4\n") {
		t.Errorf("driver params: %q, %v", params, err)
	}
	if _, err := os.Stat(filepath.Join(root, sim.ProcDevicesPath)); err != nil {
		t.Error(err)
	}
}

// FuzzParseSimSpec reads any backend string. What it refuses is a usage
// error naming the string; what it accepts names the profile given, and
// builds a node or fails in the sim (an unknown profile, a clique on a
// profile without a fabric), never panics.
func FuzzParseSimSpec(f *testing.F) {
	for _, s := range []string{
		"sim:dgx-a100", "sim:sim:dgx-a100,mig-enabled", "sim:gb200-tray,clique=7,imex-channels=16",
		"sim:gb200-tray,clique=4294967295", "sim:gb200-tray,clique=1,clique=1", "sim:dgx-h100,clique=0",
		"sim:pcie-4gpu,crash-after=3,immediate-mig-mode", "sim:,", "sim:gb200-tray,,root=/x,", "sim:x,=,=",
	} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, spec string) {
		if strings.Contains(spec, "state=") || strings.Contains(spec, "root=") || strings.Contains(spec, "crash-after=") {
			// Files and a process kill are not for a fuzzer to make.
			if _, err := parseSimSpec(spec); err != nil {
				var ue usageError
				if !errors.As(err, &ue) {
					t.Fatalf("parseSimSpec(%q): %v is not a usage error", spec, err)
				}
			}
			return
		}
		ss, err := parseSimSpec(spec)
		if err != nil {
			var ue usageError
			if !errors.As(err, &ue) || !strings.Contains(err.Error(), fmt.Sprintf("%q", spec)) {
				t.Fatalf("parseSimSpec(%q): %v, want a usage error naming the spec", spec, err)
			}
			return
		}
		if ss.profile == "" || strings.Contains(ss.profile, ",") {
			t.Fatalf("parseSimSpec(%q): profile %q", spec, ss.profile)
		}
		n, err := sim.New(ss.profile, ss.opts...)
		if err == nil {
			n.Close()
		}
	})
}
