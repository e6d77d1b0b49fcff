package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/agent"
)

// The status table says what /status says that an operator acts on: each
// fixture is a /status answer (testdata/status, decoded strictly so that it
// keeps to the schema) and the lines the table must show for it, spaces
// collapsed, or must not.
func TestWriteStatusFixtures(t *testing.T) {
	for _, tt := range []struct {
		fixture string
		want    []string
		absent  []string
	}{
		{
			fixture: "standalone-xid.json",
			want: []string{
				"Agent: gpu-agent v0.9.0-12-gf103057 (commit f103057e2c1d4b8a9f0e6d3c2b1a0f9e8d7c6b5a, go1.26.8)",
				"Config: the built-in default (no --config or ConfigMap given)",
				"Cluster: standalone, no Kubernetes API: no node labels, Events or ConfigMap",
				"CDI spec: none needed yet",
				"Health events: from NVML for every GPU",
				"GPU HEALTH CAUSE SINCE COUNT",
				"1 XID 79 (GPU has fallen off the bus), needs reboot 2026-11-25T22:22:52Z 1",
				"nvidia.com/gpu 2 1 not registered: waiting for the kubelet: .run/device-plugins/kubelet.sock does not exist",
			},
			absent: []string{"Node labels:", "ConfigMap:", "DRA"},
		},
		{
			fixture: "cluster-dra.json",
			want: []string{
				"Config: a100-ts (by node label gpu-agent.io/config) from ConfigMap gpu-agent/gpu-agent-config (API), generation 3",
				"Config warning: sharing.timeSlicing.resources[0].rename: nvidia.com/gpu-ts ignored, as NVIDIA's device plugin ignores it in its format: " +
					"the replicas are served as nvidia.com/gpu (line 6); gpu-agent's own format (version: v1 with configs:) honours rename",
				"Agent: gpu-agent v1.0.0 (commit 0c1d2e3f4a5b6c7d8e9f0a1b2c3d4e5f6a7b8c9d, go1.26.8)",
				"Cluster: API server reachable",
				"Node labels: 23 owned, written 2026-11-25T22:20:00Z",
				"ConfigMap: gpu-agent/gpu-agent-config, in force",
				"CDI spec: /var/run/cdi/gpu-agent.json, 3 devices",
				"DRA: 2 devices in the pool, 1 tainted unhealthy: gpu-1, 1 tainted cordoned: gpu-1",
				"DRA slices: generation 12 handed to the API server 2026-11-25T22:21:00Z",
				"ml/train-0 gpu-0",
				"ml/infer-7 MIG-5c0e9b6e-30a4-5cb5-9f0b-8a8e3e3f0a11",
				"nvidia.com/gpu 2 1 registered 2026-11-25T22:19:00Z",
			},
			absent: []string{"API error:", "NOT", "DRA claims: none", "DRA releasing: nothing", "Last loop turn:"},
		},
		{
			fixture: "cluster-unreachable.json",
			want: []string{
				// The config line names what serves, as config.serving does,
				// and the selected config as not applied.
				"Config: a100-ts from /etc/gpu-agent/config, generation 4; selected: a100-mig (by node label nvidia.com/device-plugin.config), not applied",
				`Config error: configs.a100-mig.sharing.timeSlicing.resources[0].devices[0]: "9" names no device (since 2026-11-25T22:21:30Z; serving a100-ts, the last config that fitted)`,
				"Cluster: API server UNREACHABLE (serving on; labels, Events and the ConfigMap wait)",
				`API error: node gpu-node-1: label node: Patch "https://10.96.0.1:443/api/v1/nodes/gpu-node-1": dial tcp 10.96.0.1:443: connect: connection refused`,
				`API error: configmap gpu-agent/gpu-agent-config: watch: Get "https://10.96.0.1:443/api/v1/namespaces/gpu-agent/configmaps": dial tcp 10.96.0.1:443: connect: connection refused`,
				`Node labels: 23 owned, written 2026-11-25T22:20:00Z; NOT UP TO DATE: Patch "https://10.96.0.1:443/api/v1/nodes/gpu-node-1": dial tcp 10.96.0.1:443: connect: connection refused`,
				"ConfigMap: gpu-agent/gpu-agent-config, NOT in force: no content read through the API (the ConfigMap is absent, or the API has not answered); the mounted file /etc/gpu-agent/config serves",
				"CDI spec: NOT WRITTEN: write /var/run/cdi/gpu-agent.json: read-only file system",
				"Health events: NONE from NVML for GPU 1 (GPU-f7ba3cb8-c82f-526e-b339-bca6cce9aaab): probed only",
				"DRA slices: NOT PUBLISHED: waiting for the API server since 2026-11-25T22:18:00Z",
				"DRA claims: none prepared",
				"DRA releasing: nothing left to undo",
			},
			absent: []string{"Config: a100-mig", "CLAIM (DRA)", "RELEASED CLAIM"},
		},
		{
			fixture: "waiting-for-config.json",
			want: []string{
				"Config: none in force yet (from /etc/gpu-agent/config)",
				"Last loop turn: 2026-11-25T22:23:30Z",
				"Cluster: connecting: the API server has not answered yet",
				"Node labels: 0 owned, never written; a change is being written",
				"ConfigMap: gpu-agent/gpu-agent-config, NOT in force: no content read through the API (the ConfigMap is absent, or the API has not answered); nothing is served until a config arrives",
			},
			// No build: an agent from before build info; the table makes none up.
			absent: []string{"Last reconcile:", "Config error:", "HEALTH CAUSE", "Agent:"},
		},
	} {
		t.Run(tt.fixture, func(t *testing.T) {
			st := readStatusFixture(t, filepath.Join("testdata", "status", tt.fixture))
			var b bytes.Buffer
			if err := writeStatus(&b, st); err != nil {
				t.Fatal(err)
			}
			spaces := regexp.MustCompile(`\s+`)
			var lines []string
			for _, l := range strings.Split(b.String(), "\n") {
				lines = append(lines, strings.TrimSpace(spaces.ReplaceAllString(l, " ")))
			}
			for _, w := range tt.want {
				if !slices.Contains(lines, w) {
					t.Errorf("no line %q in:\n%s", w, b.String())
				}
			}
			for _, a := range tt.absent {
				if strings.Contains(b.String(), a) {
					t.Errorf("%q shown in:\n%s", a, b.String())
				}
			}
		})
	}
}

// readStatusFixture decodes a /status answer, refusing fields agent.Status
// lacks: a fixture must not drift from what the agent serves.
func readStatusFixture(t *testing.T, path string) *agent.Status {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	var st agent.Status
	if err := dec.Decode(&st); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return &st
}
