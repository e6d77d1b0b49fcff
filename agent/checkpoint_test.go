package agent

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// What LoadCheckpoint trusts: this version and the one before it (version 1
// had no DRA claims); anything else is set aside, never guessed at.
func TestLoadCheckpointVersions(t *testing.T) {
	tests := []struct {
		name, body string
		wantErr    string // "" = read
		claims     int
		allocated  int
	}{
		{name: "version 1, before DRA", body: `{"version":1,"node":"n","written":"2026-11-23T00:00:00Z","allocated":{"MIG-a":"2026-11-23T00:00:00Z"}}`, allocated: 1},
		{name: "version 2 with a claim", body: `{"version":2,"node":"n","written":"2026-11-23T00:00:00Z","claims":{"uid-a":{"namespace":"default","name":"a","devices":[{"requests":["gpu"],"device":"gpu-0","cdiDevices":["nvidia.com/gpu=GPU-0"],"uuid":"GPU-0"}],"at":"2026-11-23T00:00:00Z"}}}`, claims: 1},
		{name: "a newer version", body: `{"version":4,"written":"2026-11-23T00:00:00Z"}`, wantErr: "version 4"},
		{name: "an unknown field", body: `{"version":1,"written":"2026-11-23T00:00:00Z","bogus":1}`, wantErr: "unknown field"},
		{name: "torn", body: `{"version":2,"wri`, wantErr: "unexpected EOF"},
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
			if len(cp.Claims) != tt.claims || len(cp.Allocated) != tt.allocated {
				t.Errorf("read %d claims and %d allocations, want %d and %d", len(cp.Claims), len(cp.Allocated), tt.claims, tt.allocated)
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
