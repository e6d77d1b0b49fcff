package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// An agent restarted on the same state file finds the MIG layout the last
// one made, as it would on real GPUs.
func TestSimBackendStateFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "sim-state.json")
	spec := "sim:dgx-a100,mig-enabled,state=" + path
	be, err := openBackend(spec, "")
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
	if _, err := openBackend(spec, ""); err == nil || !strings.Contains(err.Error(), "in use") {
		t.Errorf("second backend on one state file: %v, want refused", err)
	}
	be.Close()

	// No mig-enabled this time: the file, not the option, says how the GPUs are.
	be, err = openBackend("sim:dgx-a100,state="+path, "")
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
		_, err := openBackend(tt.spec, "")
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
	_, err := openBackend("sim:dgx-a100,state="+bad, "")
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
