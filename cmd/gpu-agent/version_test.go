package main

import (
	"encoding/json"
	"io"
	"net/http/httptest"
	"os/exec"
	"regexp"
	"runtime/debug"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/gpu"
)

// testVersion and testCommit are what agentBinary links in, as the
// Makefile does. A build that stamps VCS information (GOFLAGS without
// -buildvcs=false) reports the checkout's commit instead.
const (
	testVersion = "v0.0.0-test"
	testCommit  = "0000000000000000000000000000000000000abc"
)

// builtCommit matches the commit a binary agentBinary built reports.
const builtCommit = `[0-9a-f]{40}(-dirty)?`

func TestBuildInfoFrom(t *testing.T) {
	vcs := func(rev, modified string) *debug.BuildInfo {
		return &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"},
			Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: rev}, {Key: "vcs.modified", Value: modified}}}
	}
	for _, tt := range []struct {
		name            string
		version, commit string
		info            *debug.BuildInfo
		want            agent.BuildInfo
	}{
		{"make build in a checkout", "v1.2.0", "", vcs("abc123", "false"), agent.BuildInfo{Version: "v1.2.0", Commit: "abc123", GoVersion: "go1.26.8"}},
		{"modified tree", "v1.2.0-dirty", "", vcs("abc123", "true"), agent.BuildInfo{Version: "v1.2.0-dirty", Commit: "abc123-dirty", GoVersion: "go1.26.8"}},
		{"image: no .git, commit linked", "v1.2.0", "def456", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}},
			agent.BuildInfo{Version: "v1.2.0", Commit: "def456", GoVersion: "go1.26.8"}},
		{"go install of a release", "", "", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "v1.3.0"}},
			agent.BuildInfo{Version: "v1.3.0", Commit: "unknown", GoVersion: "go1.26.8"}},
		{"plain go build, no VCS", "", "", &debug.BuildInfo{GoVersion: "go1.26.8", Main: debug.Module{Version: "(devel)"}},
			agent.BuildInfo{Version: "dev", Commit: "unknown", GoVersion: "go1.26.8"}},
	} {
		if got := buildInfoFrom(tt.version, tt.commit, tt.info); got != tt.want {
			t.Errorf("%s: %+v, want %+v", tt.name, got, tt.want)
		}
	}
}

func TestVersionCommand(t *testing.T) {
	b := buildInfo()
	want := "gpu-agent " + b.Version + " (commit " + b.Commit + ", " + b.GoVersion + ")\n"
	for _, args := range [][]string{{"version"}, {"--version"}} {
		code, out, errOut := run(t, args...)
		if code != 0 || out != want {
			t.Errorf("%v: exit %d, %q %q; want %q", args, code, out, errOut, want)
		}
	}
	if code, _, errOut := run(t, "version", "extra"); code != 2 || !strings.Contains(errOut, "unexpected arguments") {
		t.Errorf("version extra: exit %d, %q; want a usage error", code, errOut)
	}
	// The binary as the Makefile links it reports the linked version and
	// the commit of this checkout.
	out, err := exec.Command(agentBinary(t), "--version").Output()
	if err != nil || !regexp.MustCompile(`^gpu-agent `+regexp.QuoteMeta(testVersion)+` \(commit `+builtCommit+`, go1\.\d+`).Match(out) {
		t.Errorf("built binary --version: %q, %v; want %s and a commit", out, err, testVersion)
	}
}

// /status carries the build, and /metrics the gpu_agent_build_info series,
// once registered as the agent registers it.
func TestBuildInfoServed(t *testing.T) {
	b := buildInfo()
	reg := prometheus.NewRegistry()
	reg.MustRegister(newBuildInfoMetric(b))
	st := &agent.Status{LastPass: time.Now(), GPUs: gpu.Show([]gpu.GPU{{UUID: "GPU-0"}})}
	h := newHTTPHandler(fixedStatus{st}, allRegistered{}, noEvents{}, sampledGPU{}, nil, reg, nil, &backend{Name: "sim:x"})

	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/status", nil))
	var got agent.Status
	if err := json.NewDecoder(rec.Body).Decode(&got); err != nil || got.Build == nil || *got.Build != b {
		t.Errorf("/status build %+v (%v), want %+v", got.Build, err, b)
	}

	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	body, _ := io.ReadAll(rec.Body)
	want := `gpu_agent_build_info{commit="` + b.Commit + `",goversion="` + b.GoVersion + `",version="` + b.Version + `"} 1`
	if !strings.Contains(string(body), want+"\n") {
		t.Errorf("/metrics lacks %s:\n%s", want, grepLines(string(body), "gpu_agent_build_info"))
	}
}
