package timeslice

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// fakeSMI writes a program that logs its arguments to a file and exits
// with code.
func fakeSMI(t *testing.T, code string) (bin, log string) {
	t.Helper()
	dir := t.TempDir()
	bin, log = filepath.Join(dir, "nvidia-smi"), filepath.Join(dir, "calls")
	script := "#!/bin/sh\necho \"$@\" >> " + log + "\necho 'said so' >&2\nexit " + code + "\n"
	if err := os.WriteFile(bin, []byte(script), 0o755); err != nil {
		t.Fatal(err)
	}
	return bin, log
}

func TestSetInterval(t *testing.T) {
	tests := []struct {
		name      string
		code      string
		level     int
		wantCalls string
		wantErr   string
	}{
		{"Long", "0", 3, "-i GPU-1 -c DEFAULT\ncompute-policy -i GPU-1 --set-timeslice 3\n", ""},
		{"Default", "0", 0, "-i GPU-1 -c DEFAULT\ncompute-policy -i GPU-1 --set-timeslice 0\n", ""},
		{"refused by nvidia-smi", "3", 2, "-i GPU-1 -c DEFAULT\n", "gpu GPU-1: compute mode DEFAULT: "},
		{"out of range", "0", 4, "", "time-slice level 4: must be 0..3"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			bin, log := fakeSMI(t, tt.code)
			err := Interval{Binary: bin}.SetInterval("GPU-1", tt.level)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want %q", err, tt.wantErr)
				}
				if tt.code != "0" && !strings.Contains(err.Error(), "said so") {
					t.Errorf("error %v lacks nvidia-smi's message", err)
				}
			} else if err != nil {
				t.Fatal(err)
			}
			calls, _ := os.ReadFile(log)
			if string(calls) != tt.wantCalls {
				t.Errorf("calls %q, want %q", calls, tt.wantCalls)
			}
		})
	}
}
