package main

import (
	"io"
	"path/filepath"
	"testing"
)

// A simulated node run without path flags stays off the host: HTTP on
// loopback, the kubelet's and the agent's directories under ./.run (what
// `make run` passes). Whatever is given, by flag or variable, wins, and a
// real node keeps the real defaults.
func TestSimDefaults(t *testing.T) {
	for _, v := range []string{"GPU_AGENT_BACKEND", "GPU_AGENT_LISTEN", "GPU_AGENT_STATE_DIR", "GPU_AGENT_DEVICE_PLUGIN_DIR",
		"GPU_AGENT_POD_RESOURCES_SOCKET", "GPU_AGENT_MPS_ROOT"} {
		t.Setenv(v, "")
	}
	dir := t.TempDir()
	t.Chdir(dir)
	run := filepath.Join(dir, ".run")
	type paths struct{ listen, stateDir, pluginDir, podResources, mpsRoot string }
	sandbox := paths{"127.0.0.1:9400", filepath.Join(run, "state"), filepath.Join(run, "device-plugins"),
		filepath.Join(run, "pod-resources.sock"), filepath.Join(run, "mps")}
	host := paths{":9400", "/var/lib/gpu-agent", "/var/lib/kubelet/device-plugins",
		"/var/lib/kubelet/pod-resources/kubelet.sock", "/run/gpu-agent/mps"}
	tests := []struct {
		name  string
		env   map[string]string
		args  []string
		want  paths
		moved int
	}{
		{name: "sim, nothing given", args: []string{"--backend", "sim:dgx-a100"}, want: sandbox, moved: 5},
		{name: "sim by variable", env: map[string]string{"GPU_AGENT_BACKEND": "sim:dgx-a100"}, want: sandbox, moved: 5},
		{name: "sim, the DaemonSet's flags (the defaults' values, given)",
			args: []string{"--backend=sim:dgx-a100", "--listen=:9400", "--state-dir=/var/lib/gpu-agent",
				"--device-plugin-dir=/var/lib/kubelet/device-plugins", "--pod-resources-socket=/var/lib/kubelet/pod-resources/kubelet.sock",
				"--mps-root=/run/gpu-agent/mps"},
			want: host},
		{name: "sim, some given by variable", args: []string{"--backend", "sim:dgx-a100"},
			env:  map[string]string{"GPU_AGENT_LISTEN": ":19400", "GPU_AGENT_STATE_DIR": "/srv/state"},
			want: paths{":19400", "/srv/state", sandbox.pluginDir, sandbox.podResources, sandbox.mpsRoot}, moved: 3},
		{name: "nvml", args: []string{"--backend", "nvml"}, want: host},
		{name: "default backend", want: host},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			for k, v := range tc.env {
				t.Setenv(k, v)
			}
			f, moved, err := parseRun(tc.args, io.Discard)
			if err != nil {
				t.Fatal(err)
			}
			got := paths{f.listen, f.stateDir, f.pluginDir, f.podResources, f.mpsRoot}
			if got != tc.want || len(moved) != tc.moved {
				t.Errorf("got %+v, moved %q; want %+v, %d moved", got, moved, tc.want, tc.moved)
			}
		})
	}
}
