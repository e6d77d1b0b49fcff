package main

import (
	"bytes"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/agent"
)

// After a rollback past a change of a state file's major format, the agent
// does not start without what the file records, which would destroy what
// it protects, nor set it aside, which would lose it for the newer agent
// rolled forward again: it exits, saying which file, its format, the
// formats this build reads and what to do, and leaves the file as it is.
func TestRunRefusesNewerMajorFormat(t *testing.T) {
	for _, tc := range []struct {
		file, content, says string
	}{
		{agent.CheckpointFile, `{"version":9,"minor":1,"written":"2026-11-23T00:00:00Z"}`, "format 9.1, written by a newer gpu-agent; this build reads 1.0 to 4."},
		{agent.AllocLogFile, `{"version":3,"at":"2026-11-23T00:00:00Z","devices":[]}` + "\n", "line 1: format 3.0, written by a newer gpu-agent; this build reads 1."},
	} {
		t.Run(tc.file, func(t *testing.T) {
			dir := t.TempDir()
			state := filepath.Join(dir, "state")
			if err := os.Mkdir(state, 0o755); err != nil {
				t.Fatal(err)
			}
			path := filepath.Join(state, tc.file)
			if err := os.WriteFile(path, []byte(tc.content), 0o600); err != nil {
				t.Fatal(err)
			}
			code, _, stderr := run(t, "run", "--backend", "sim:pcie-4gpu", "--state-dir", state, "--listen", "127.0.0.1:0",
				"--device-plugin-dir", filepath.Join(dir, "dp"), "--mps-root", filepath.Join(dir, "mps"),
				"--pod-resources-socket", filepath.Join(dir, "pr.sock"), "--node-name", "n1")
			if code != 1 {
				t.Fatalf("exit %d, want 1; stderr:\n%s", code, stderr)
			}
			for _, want := range []string{path, tc.says, "left as it is for the agent that wrote it"} {
				if !strings.Contains(stderr, want) {
					t.Errorf("stderr does not say %q:\n%s", want, stderr)
				}
			}
			if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, []byte(tc.content)) {
				t.Fatalf("%s now %q, %v; want it left as it was", tc.file, got, err)
			}
			if _, err := os.Stat(path + ".unreadable"); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("set aside: %v", err)
			}
		})
	}
}
