package agent

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/stateformat"
)

// checkpointFixture is a checkpoint as the agents before minor versions
// wrote it (format 4.0): two GPUs of a simulated DGX H100 with MIG devices,
// a prepared claim, a health cause, a cordon and a GPU a MIG plan touched.
func checkpointFixture(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile("testdata/formats/checkpoint-4.0.json")
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestCheckpointReadsVersion4(t *testing.T) {
	cp, err := DecodeCheckpoint(checkpointFixture(t))
	if err != nil {
		t.Fatal(err)
	}
	if len(cp.GPUs) != 2 || len(cp.Claims) != 1 || len(cp.Health) != 1 || len(cp.Cordon) != 1 || len(cp.MIGTouched) != 1 || len(cp.FailedSince) != 1 || len(cp.DynamicMIG) != 1 {
		t.Fatalf("read %+v", cp)
	}
	// Written back as this build writes it, it is the same bytes: an agent
	// from before minor versions, rolled back to, reads it.
	out, err := json.MarshalIndent(cp, "", " ")
	if err != nil || !bytes.Equal(out, checkpointFixture(t)) {
		t.Fatalf("written back as\n%s (%v)", out, err)
	}
}

// Issue 29, defect 5: a checkpoint with a field this build does not know
// was set aside, so a rollback forgot the prepared claims and health
// causes the newer agent recorded. One of a newer minor format is read
// without the fields that minor added.
func TestCheckpointReadsNewerMinor(t *testing.T) {
	dir := t.TempDir()
	b := checkpointFixture(t)
	b = append([]byte(`{"minor":2,"computeDomains":{"cd-1":{"channels":[0]}},`), bytes.TrimPrefix(b, []byte("{"))...)
	if err := os.WriteFile(filepath.Join(dir, CheckpointFile), b, 0o644); err != nil {
		t.Fatal(err)
	}
	cp, err := LoadCheckpoint(dir)
	if err != nil {
		t.Fatal(err)
	}
	if len(cp.Claims) != 1 || len(cp.Health) != 1 || len(cp.GPUs) != 2 {
		t.Fatalf("read %d claims, %d health causes, %d GPUs; want 1, 1, 2", len(cp.Claims), len(cp.Health), len(cp.GPUs))
	}
}

// A checkpoint of a newer major format is not this build's to read or to
// set aside: it stays where it is for the build that wrote it, and the
// error (which the agent refuses to start on) names the file, its format
// and the formats this build reads.
func TestCheckpointNewerMajorKeptInPlace(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, CheckpointFile)
	b := []byte(`{"version":5,"written":"2026-11-23T00:00:00Z","claims":[{"uid":"u"}]}`)
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	cp, err := LoadCheckpoint(dir)
	var newer *stateformat.NewerError
	if cp != nil || !errors.As(err, &newer) {
		t.Fatalf("LoadCheckpoint = %+v, %v; want a newer format refused", cp, err)
	}
	for _, want := range []string{path, "format 5.0, written by a newer gpu-agent; this build reads 1.0 to 4"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if got, _ := os.ReadFile(path); !bytes.Equal(got, b) {
		t.Fatalf("checkpoint now %s, want it left as it was", got)
	}
	if _, err := os.Stat(path + ".unreadable"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("checkpoint set aside: %v", err)
	}
}
