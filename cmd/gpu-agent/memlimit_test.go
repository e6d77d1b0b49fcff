package main

import (
	"io/fs"
	"log/slog"
	"os"
	"runtime/debug"
	"testing"
)

func TestCgroupMemoryLimit(t *testing.T) {
	for _, tt := range []struct {
		in      string
		want    int64
		wantErr bool
	}{
		{"134217728\n", 128 << 20, false},
		{"max\n", 0, false},
		{"9223372036854771712\n", 0, false}, // cgroup v1 without a limit
		{"", 0, true},
		{"-1", 0, true},
		{"128Mi", 0, true},
	} {
		got, err := cgroupMemoryLimit(tt.in)
		if got != tt.want || (err != nil) != tt.wantErr {
			t.Errorf("cgroupMemoryLimit(%q) = %d, %v; want %d, error %v", tt.in, got, err, tt.want, tt.wantErr)
		}
	}
}

// The runtime's soft limit is set under the container's, from the first
// cgroup file there is, and left alone without a limit.
func TestSetMemoryLimit(t *testing.T) {
	t.Setenv("GOMEMLIMIT", "") // t.Setenv restores it; unset below
	prev := debug.SetMemoryLimit(-1)
	t.Cleanup(func() { debug.SetMemoryLimit(prev) })
	for _, tt := range []struct {
		name  string
		files map[string]string
		want  int64
	}{
		{"cgroup v2", map[string]string{cgroupMemoryFiles[0]: "134217728\n"}, 96 << 20},
		{"cgroup v1", map[string]string{cgroupMemoryFiles[1]: "268435456\n"}, 192 << 20},
		{"no limit", map[string]string{cgroupMemoryFiles[0]: "max\n"}, 0},
		{"no cgroup files", nil, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			unsetenv(t, "GOMEMLIMIT")
			debug.SetMemoryLimit(prev)
			read := func(p string) ([]byte, error) {
				if c, ok := tt.files[p]; ok {
					return []byte(c), nil
				}
				return nil, fs.ErrNotExist
			}
			if got := setMemoryLimit(slog.New(slog.DiscardHandler), read); got != tt.want {
				t.Errorf("set %d, want %d", got, tt.want)
			}
			if tt.want != 0 {
				if got := debug.SetMemoryLimit(-1); got != tt.want {
					t.Errorf("runtime limit %d, want %d", got, tt.want)
				}
			}
		})
	}
}

// unsetenv removes key for the rest of the test (t.Setenv only sets):
// t.Setenv first, so that the test restores the old value at its end.
func unsetenv(t *testing.T, key string) {
	t.Helper()
	t.Setenv(key, "")
	if err := os.Unsetenv(key); err != nil {
		t.Fatal(err)
	}
}
