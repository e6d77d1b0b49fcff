package ledger

import (
	"bytes"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/stateformat"
)

// allocLogFixture is an allocation log as the agents before versioned
// records wrote it (format 1.0, which names no version): a record from
// before resources and replicas were logged, one with a resource, one
// with replicas.
func allocLogFixture(t *testing.T) []byte {
	t.Helper()
	b, err := os.ReadFile("testdata/formats/allocations-1.0.log")
	if err != nil {
		t.Fatal(err)
	}
	return b
}

func TestAllocLogReadsUnversioned(t *testing.T) {
	got, bad, err := DecodeAllocLog(allocLogFixture(t))
	if err != nil || len(bad) > 0 {
		t.Fatalf("DecodeAllocLog: %v, %v", bad, err)
	}
	at := time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)
	want := map[string]AllocEntry{
		"MIG-0a7f3d7e-1c2b-5e8a-9d4f-3b6c2a1e0f9d": {At: at.Add(-2 * time.Minute)},
		"MIG-4d8e4448-3d1c-589e-88fe-694e46139c1d": {At: at, Resource: "nvidia.com/mig-1g.5gb"},
		"GPU-20199cc1-da40-52ae-9716-ea5fc45e7072": {At: at.Add(1500 * time.Millisecond), Resource: "nvidia.com/gpu.shared", Replica: true},
		"GPU-6c4b1e53-2cef-56a6-ba2b-eb50059e4deb": {At: at.Add(1500 * time.Millisecond), Resource: "nvidia.com/gpu.shared"},
	}
	if len(got) != len(want) {
		t.Fatalf("read %v, want %v", got, want)
	}
	for id, w := range want {
		if g := got[id]; !g.At.Equal(w.At) || g.Resource != w.Resource || g.Replica != w.Replica {
			t.Errorf("%s read as %+v, want %+v", id, g, w)
		}
	}
}

// Issue 29, defect 5: a record with a field this build does not know was
// skipped, so a rollback forgot every allocation the newer agent made.
// A record of a newer minor format is read without the fields it added.
func TestAllocLogReadsNewerMinor(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, AllocLogFile)
	newer := `{"at":"2026-11-23T12:00:02Z","ids":["GPU-new"],"resource":"nvidia.com/gpu","version":1,"minor":3,"container":{"index":0}}` + "\n"
	if err := os.WriteFile(path, append(allocLogFixture(t), newer...), 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := New(Options{StateDir: dir, Now: newClock().Now})
	if err != nil {
		t.Fatal(err)
	}
	got := l.Allocations()
	if _, ok := got["GPU-new"]; !ok || len(got) != 5 {
		t.Fatalf("restored %v, want the fixture's 4 and GPU-new", got)
	}
	// Written back in the format this build writes, all of it.
	again, bad, err := DecodeAllocLog(readFile(t, path))
	if len(again) != 5 || len(bad) > 0 || err != nil {
		t.Fatalf("log rewritten as %v, %v, %v", again, bad, err)
	}
}

// An allocation log this build writes of allocations an older agent made
// is in the older agent's format, so that a rollback reads it: today that
// is format 1.0, without a version.
func TestAllocLogWritesUnversioned(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, AllocLogFile)
	if err := os.WriteFile(path, allocLogFixture(t), 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := New(Options{StateDir: dir, Now: newClock().Now})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Allocate([]string{"GPU-more"}); err != nil {
		t.Fatal(err)
	}
	b := readFile(t, path)
	if bytes.Contains(b, []byte(`"version"`)) || bytes.Contains(b, []byte(`"minor"`)) || bytes.Count(b, []byte("\n")) != 5 {
		t.Fatalf("log written as\n%s", b)
	}
}

// A record of a newer major format means something this build cannot tell:
// the log is neither read nor rewritten (the newer agent, rolled forward
// again, reads it whole), nothing is set aside, Allocate is refused, and
// the error names the file, the record's format and what this build reads.
func TestAllocLogRefusesNewerMajor(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, AllocLogFile)
	content := append(allocLogFixture(t), `{"version":2,"at":"2026-11-23T12:00:02Z","devices":[{"id":"GPU-new"}]}`+"\n"...)
	if err := os.WriteFile(path, content, 0o600); err != nil {
		t.Fatal(err)
	}
	l, err := New(Options{StateDir: dir, Now: newClock().Now})
	var newer *stateformat.NewerError
	if !errors.As(err, &newer) || newer.Found != (stateformat.Version{Major: 2}) {
		t.Fatalf("New: %v, want a newer format refused", err)
	}
	for _, want := range []string{path, "line 4", "format 2.0, written by a newer gpu-agent; this build reads 1.0, and any newer 1.x"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if err := l.Allocate([]string{"GPU-other"}); !errors.Is(err, ErrLogUnavailable) {
		t.Fatalf("Allocate = %v, want ErrLogUnavailable", err)
	}
	if got := readFile(t, path); !bytes.Equal(got, content) {
		t.Fatalf("log now\n%s\nwant it left as it was", got)
	}
	if _, err := os.Stat(path + ".unreadable"); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("log set aside: %v", err)
	}
}

// The record Allocate appends by hand is the one json.Marshal makes, the
// version fields included once records name one.
func TestAppendRecordVersioned(t *testing.T) {
	at := time.Date(2026, 11, 23, 12, 0, 0, 5, time.UTC)
	for _, rec := range []allocRecord{
		{At: at, IDs: []string{"GPU-a"}},
		{At: at, IDs: []string{"GPU-a", "GPU-b"}, Version: 1, Minor: 2, Resource: "nvidia.com/gpu", Replicas: []string{"GPU-b"}},
		{At: at, IDs: []string{"GPU-a"}, Version: 2},
	} {
		got, err := appendRecord(nil, rec)
		if err != nil {
			t.Fatal(err)
		}
		want, _ := json.Marshal(rec)
		if string(got) != string(want)+"\n" {
			t.Errorf("appendRecord = %s, json.Marshal = %s", got, want)
		}
	}
}
