package agent

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
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
		{name: "a newer version", body: `{"version":3,"written":"2026-11-23T00:00:00Z"}`, wantErr: "version 3"},
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
