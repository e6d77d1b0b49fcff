package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/plugin"
	"github.com/gpu-agent/gpu-agent/telemetry"
)

type fixedStatus struct{ st *agent.Status }

func (f fixedStatus) Status() *agent.Status { return f.st }
func (f fixedStatus) Alive() bool           { return true }

type allRegistered struct{}

func (allRegistered) Status() []plugin.ResourceStatus { return nil }
func (allRegistered) Ready() bool                     { return true }

type noEvents struct{}

func (noEvents) Watched() []string { return nil }

type sampledGPU struct{}

func (sampledGPU) Snapshot() *telemetry.Snapshot {
	return &telemetry.Snapshot{GPUs: []telemetry.GPUSample{{}}}
}

// /readyz answers 503 while what must survive a restart cannot be written
// (issue 23, defect 10), naming the state dir and the error.
func TestReadyzStateNotSaved(t *testing.T) {
	for _, tc := range []struct {
		state *agent.StateStatus
		code  int
		body  string
	}{
		{nil, http.StatusOK, "ok"},
		{&agent.StateStatus{Dir: "/var/lib/gpu-agent"}, http.StatusOK, "ok"},
		{&agent.StateStatus{Dir: "/var/lib/gpu-agent", Error: "checkpoint: write /var/lib/gpu-agent/checkpoint.json: no space left on device"},
			http.StatusServiceUnavailable, "state not saved in /var/lib/gpu-agent: checkpoint: write /var/lib/gpu-agent/checkpoint.json: no space left on device"},
	} {
		st := &agent.Status{LastPass: time.Now(), GPUs: gpu.Show([]gpu.GPU{{UUID: "GPU-0"}}), State: tc.state}
		h := newHTTPHandler(fixedStatus{st}, allRegistered{}, noEvents{}, sampledGPU{}, nil, prometheus.NewRegistry(), nil, &backend{Name: "sim:x"})
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("GET", "/readyz", nil))
		body, _ := io.ReadAll(rec.Body)
		if rec.Code != tc.code || !strings.Contains(string(body), tc.body) {
			t.Errorf("state %+v: /readyz %d %q, want %d %q", tc.state, rec.Code, body, tc.code, tc.body)
		}
	}
}
