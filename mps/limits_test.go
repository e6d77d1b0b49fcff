package mps

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu"
)

func TestMaxClientsAndValidateReplicas(t *testing.T) {
	tests := []struct {
		cc       gpu.ComputeCapability
		max      int
		replicas int
		wantErr  string
	}{
		{gpu.ComputeCapability{Major: 9}, 48, 48, ""},
		{gpu.ComputeCapability{Major: 8}, 48, 49, "above the 48 clients"},
		{gpu.ComputeCapability{Major: 7}, 48, 20, ""},
		{gpu.ComputeCapability{Major: 6, Minor: 1}, 16, 16, ""},
		{gpu.ComputeCapability{Major: 6}, 16, 17, "above the 16 clients"},
		{gpu.ComputeCapability{Major: 3, Minor: 5}, 16, 2, ""},
		{gpu.ComputeCapability{Major: 3}, 0, 2, "not supported"},
		{gpu.ComputeCapability{Major: 8}, 48, 0, "at least 1"},
	}
	for _, tt := range tests {
		if got := MaxClients(tt.cc); got != tt.max {
			t.Errorf("MaxClients(%s) = %d, want %d", tt.cc, got, tt.max)
		}
		err := ValidateReplicas(tt.replicas, tt.cc)
		if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("ValidateReplicas(%d, %s) = %v, want error containing %q", tt.replicas, tt.cc, err, tt.wantErr)
		}
	}
}

func TestDefaultDaemon(t *testing.T) {
	tests := []struct {
		replicas int
		want     Daemon
	}{
		{4, Daemon{Device: "GPU-a", Index: 1, ActiveThreadPercentage: 25, PinnedMemLimitBytes: 10 << 30}},
		{3, Daemon{Device: "GPU-a", Index: 1, ActiveThreadPercentage: 33, PinnedMemLimitBytes: 40 << 30 / 3}},
		{200, Daemon{Device: "GPU-a", Index: 1, ActiveThreadPercentage: 1, PinnedMemLimitBytes: 40 << 30 / 200}},
		{0, Daemon{Device: "GPU-a", Index: 1}},
	}
	for _, tt := range tests {
		if got := DefaultDaemon("GPU-a", 1, 40<<30, tt.replicas); got != tt.want {
			t.Errorf("DefaultDaemon(replicas %d) = %+v, want %+v", tt.replicas, got, tt.want)
		}
	}
}

func TestDaemonValidate(t *testing.T) {
	tests := []struct {
		d       Daemon
		wantErr string
	}{
		{Daemon{Device: "GPU-a", ActiveThreadPercentage: 100, PinnedMemLimitBytes: 1 << 20}, ""},
		{Daemon{}, "empty device"},
		{Daemon{Device: "GPU-a", ActiveThreadPercentage: 101}, "0..100"},
		{Daemon{Device: "GPU-a", ActiveThreadPercentage: -1}, "0..100"},
		{Daemon{Device: "GPU-a", PinnedMemLimitBytes: 1000}, "below 1 MiB"},
		// Its pipe and log directories would be the MPS root's own (found by
		// FuzzParseDesiredFile).
		{Daemon{Device: "."}, `device "." names no folder of its own`},
		{Daemon{Device: "./"}, ""}, // folder "._"
	}
	for _, tt := range tests {
		err := tt.d.Validate()
		if tt.wantErr == "" && err != nil || tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)) {
			t.Errorf("%+v.Validate() = %v, want error containing %q", tt.d, err, tt.wantErr)
		}
	}
}

func TestContainerSpec(t *testing.T) {
	tests := []struct {
		name       string
		shm        string
		d          Daemon
		wantEnv    map[string]string
		wantMounts []catalog.Mount
	}{
		{
			name: "limits and shm",
			shm:  "/run/gpu-agent/shm",
			d:    Daemon{Device: "GPU-a", ActiveThreadPercentage: 25, PinnedMemLimitBytes: 10<<30 + 123},
			wantEnv: map[string]string{
				"CUDA_MPS_PIPE_DIRECTORY":           "/mps/GPU-a/pipe",
				"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "25",
				"CUDA_MPS_PINNED_DEVICE_MEM_LIMIT":  "0=10240M",
			},
			wantMounts: []catalog.Mount{
				{HostPath: "/mps/GPU-a/pipe", ContainerPath: "/mps/GPU-a/pipe"},
				{HostPath: "/run/gpu-agent/shm", ContainerPath: "/dev/shm"},
			},
		},
		{
			name:       "no limits, no shm, old MIG UUID",
			d:          Daemon{Device: "MIG-GPU-x/1/0"},
			wantEnv:    map[string]string{"CUDA_MPS_PIPE_DIRECTORY": "/mps/MIG-GPU-x_1_0/pipe"},
			wantMounts: []catalog.Mount{{HostPath: "/mps/MIG-GPU-x_1_0/pipe", ContainerPath: "/mps/MIG-GPU-x_1_0/pipe"}},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			env, mounts := ContainerSpec("/mps", tt.shm, tt.d)
			if !maps.Equal(env, tt.wantEnv) {
				t.Errorf("env = %v, want %v", env, tt.wantEnv)
			}
			if !slices.Equal(mounts, tt.wantMounts) {
				t.Errorf("mounts = %+v, want %+v", mounts, tt.wantMounts)
			}
		})
	}
}

// Devices whose folders under the root would be one (an old MIG UUID's
// slashes become underscores) cannot both have a daemon: the second would
// take the first's pipe directory and pid file.
func TestValidateDaemonsOneFolderEach(t *testing.T) {
	for _, pair := range [][2]string{{"MIG-GPU-x/1/0", "MIG-GPU-x_1_0"}, {"a..b", "a_b"}, {"GPU-a", "GPU-a"}} {
		_, err := validateDaemons([]Daemon{{Device: pair[0]}, {Device: pair[1], Index: 1}})
		if err == nil || !strings.Contains(err.Error(), pair[0]) || !strings.Contains(err.Error(), pair[1]) {
			t.Errorf("validateDaemons(%q, %q) = %v, want an error naming both", pair[0], pair[1], err)
		}
	}
	if _, err := validateDaemons([]Daemon{{Device: "MIG-GPU-x/1/0"}, {Device: "MIG-GPU-x/2/0"}}); err != nil {
		t.Errorf("two MIG devices of one GPU: %v", err)
	}
}

// The longest daemon list Set takes is one desired.json and health.json can
// hold: every field set, the reason as long as it gets, with separators.
func TestMaxDaemonsFitHostFiles(t *testing.T) {
	daemons := make([]Daemon, maxDaemons)
	health := HealthFile{Version: FileVersion, Interval: Duration(time.Second), Devices: map[string]DeviceHealth{}}
	for i := range daemons {
		daemons[i] = Daemon{Device: fmt.Sprintf("MIG-%d", i), Index: i, ActiveThreadPercentage: 1, PinnedMemLimitBytes: 1 << 30}
		health.Devices[daemons[i].Device] = DeviceHealth{PID: 1, Generation: 1,
			Reason: "pid 1 from the pid file never answered as an mps daemon in 3 checks; starting a new one"}
	}
	if _, err := validateDaemons(daemons); err != nil {
		t.Fatal(err)
	}
	desired := DesiredFile{Version: FileVersion, Generation: 1, Daemons: daemons}
	for name, v := range map[string]any{"desired.json": desired, "health.json": health} {
		b, err := json.MarshalIndent(v, "", "  ")
		if err != nil {
			t.Fatal(err)
		}
		if n := jsonValues(b); n > maxHostFileValues || len(b) > maxHostFileBytes {
			t.Errorf("%s of %d devices: %d bytes, %d values; the readers take %d and %d", name, maxDaemons, len(b), n, maxHostFileBytes, maxHostFileValues)
		}
	}
	if _, err := validateDaemons(append(daemons, Daemon{Device: "GPU-one-more"})); err == nil {
		t.Errorf("%d daemons accepted", maxDaemons+1)
	}
}

func TestDirNameStaysUnderRoot(t *testing.T) {
	for _, dev := range []string{"../../etc", "MIG-GPU-x/1/0", "a/../../b"} {
		if got := PipeDir("/mps", dev); !strings.HasPrefix(got, "/mps/") || strings.Count(got, "/") != 3 {
			t.Errorf("PipeDir(/mps, %q) = %q, want one folder under /mps", dev, got)
		}
	}
}
