package agent

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// What LoadCheckpoint trusts: this version and the ones before it (version
// 1 had no DRA claims, version 3 no cordon and no GPUs touched by MIG
// plans); anything else is set aside, never guessed at.
func TestLoadCheckpointVersions(t *testing.T) {
	tests := []struct {
		name, body string
		wantErr    string // "" = read
		claims     int
		allocated  int
		cordon     int
		touched    int
	}{
		{name: "version 1, before DRA", body: `{"version":1,"node":"n","written":"2026-11-23T00:00:00Z","allocated":{"MIG-a":"2026-11-23T00:00:00Z"}}`, allocated: 1},
		{name: "version 2 with a claim", body: `{"version":2,"node":"n","written":"2026-11-23T00:00:00Z","claims":{"uid-a":{"namespace":"default","name":"a","devices":[{"requests":["gpu"],"device":"gpu-0","cdiDevices":["nvidia.com/gpu=GPU-0"],"uuid":"GPU-0"}],"at":"2026-11-23T00:00:00Z"}}}`, claims: 1},
		{name: "version 3, before the cordon", body: `{"version":3,"node":"n","written":"2026-11-23T00:00:00Z","dynamicMIG":["GPU-0"]}`},
		{name: "version 4 with a cordon", body: `{"version":4,"node":"n","written":"2026-11-23T00:00:00Z","cordon":["1","GPU-a"]}`, cordon: 2},
		{name: "version 4 with GPUs MIG plans touched", body: `{"version":4,"node":"n","written":"2026-11-23T00:00:00Z","gpus":[{"index":0,"uuid":"GPU-a"}],"migTouched":["GPU-a"]}`, touched: 1},
		{name: "version 0", body: `{"version":0,"written":"2026-11-23T00:00:00Z"}`, wantErr: "format 0.0"},
		{name: "an unknown field", body: `{"version":1,"written":"2026-11-23T00:00:00Z","bogus":1}`, wantErr: "unknown field"},
		{name: "torn", body: `{"version":2,"wri`, wantErr: "unexpected end of JSON input"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, CheckpointFile)
			if err := os.WriteFile(path, []byte(tt.body), 0o644); err != nil {
				t.Fatal(err)
			}
			cp, err := LoadCheckpoint(dir)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want one containing %q", err, tt.wantErr)
				}
				if _, serr := os.Stat(path + ".unreadable"); serr != nil {
					t.Errorf("not set aside: %v", serr)
				}
				if _, serr := os.Stat(path); !errors.Is(serr, os.ErrNotExist) {
					t.Errorf("still in place: %v", serr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(cp.Claims) != tt.claims || len(cp.Allocated) != tt.allocated || len(cp.Cordon) != tt.cordon || len(cp.MIGTouched) != tt.touched {
				t.Errorf("read %d claims, %d allocations, %d cordoned GPUs and %d touched by MIG plans, want %d, %d, %d and %d",
					len(cp.Claims), len(cp.Allocated), len(cp.Cordon), len(cp.MIGTouched), tt.claims, tt.allocated, tt.cordon, tt.touched)
			}
		})
	}
}

// A checkpoint that is not a regular file is refused at once and set aside
// (issue 23, defect 4: a FIFO blocked the start forever, before any
// listener and deaf to SIGTERM).
func TestLoadCheckpointRefusesNonRegular(t *testing.T) {
	for _, tc := range []struct {
		name string
		make func(path string) error
		want string
	}{
		{"a named pipe", func(p string) error { return syscall.Mkfifo(p, 0o644) }, "not a regular file (a named pipe)"},
		{"a directory", func(p string) error { return os.Mkdir(p, 0o755) }, "not a regular file (a directory)"},
		{"a link to /dev/zero", func(p string) error { return os.Symlink("/dev/zero", p) }, "not a regular file (a character device)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			path := filepath.Join(dir, CheckpointFile)
			if err := tc.make(path); err != nil {
				t.Fatal(err)
			}
			done := make(chan error, 1)
			go func() { _, err := LoadCheckpoint(dir); done <- err }()
			var err error
			select {
			case err = <-done:
			case <-time.After(30 * time.Second): // only a failure waits this long
				t.Fatal("LoadCheckpoint still blocked after 30 s")
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "set aside") {
				t.Fatalf("err %v, want one saying %q and that it was set aside", err, tc.want)
			}
			if _, serr := os.Lstat(path); !errors.Is(serr, os.ErrNotExist) {
				t.Errorf("still in place: %v", serr)
			}
		})
	}
}

// Issue 23, defect 10: a checkpoint that cannot be written was visible only
// in the log. /status says why and since when, gpu_agent_state_saved is 0
// and the failures are counted; all clear again once a write succeeds.
func TestCheckpointFailureVisible(t *testing.T) {
	reg := prometheus.NewRegistry()
	dir := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	h := newHarnessIn(t, simNode(t, "pcie-4gpu"), dir, func(h *harness) { h.opts.Registerer = reg })
	h.config(wholeGPUs)
	if st := h.a.Status().State; st == nil || st.Error != "" || st.CheckpointWritten.IsZero() {
		t.Fatalf("state %+v, want the checkpoint written", st)
	}
	if err := os.RemoveAll(dir); err != nil { // even root cannot write there now
		t.Fatal(err)
	}
	h.clock.Advance(time.Minute)
	failedAt := h.clock.Now()
	h.step(HealthChanged{State: xidState(h.a.inv.GPUs[0].UUID, 79)}) // a cause to checkpoint
	h.clock.Advance(time.Minute)
	h.step(Tick{})
	st := h.a.Status().State
	if st == nil || !strings.Contains(st.Error, "checkpoint: ") || !strings.Contains(st.Error, "no such file or directory") || !st.ErrorSince.Equal(failedAt) {
		t.Fatalf("state %+v, want the checkpoint's error since %v", st, failedAt)
	}
	if got := testutil.ToFloat64(h.a.metrics.stateSaved); got != 0 {
		t.Errorf("gpu_agent_state_saved = %v, want 0", got)
	}
	if n, err := testutil.GatherAndCount(reg, "gpu_agent_state_write_failures_total"); err != nil || n != 2 {
		t.Errorf("gpu_agent_state_write_failures_total: %d series, %v", n, err)
	}
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	h.step(Tick{})
	if st := h.a.Status().State; st.Error != "" || testutil.ToFloat64(h.a.metrics.stateSaved) != 1 {
		t.Errorf("after the dir came back: state %+v", st)
	}
	if got := h.a.metrics.ckptFailures.Load(); got != 2 {
		t.Errorf("%d checkpoint write failures counted, want 2 (one per turn of the loop)", got)
	}
}
