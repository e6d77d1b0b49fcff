package main

import (
	"encoding/json"
	"fmt"
	"net/http"
	"runtime"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/plugin"
	"github.com/gpu-agent/gpu-agent/telemetry"
)

// statusSource is what the HTTP endpoints read from the agent.
type statusSource interface {
	Status() *agent.Status
	Alive() bool
}

// registrations is what they read from the plugin manager.
type registrations interface {
	Status() []plugin.ResourceStatus
	Ready() bool
}

// eventWatch is what they read from the health watcher.
type eventWatch interface{ Watched() []string }

// sampled is what /readyz reads from the metrics sampler.
type sampled interface{ Snapshot() *telemetry.Snapshot }

// newHTTPHandler serves /metrics, /healthz, /readyz, /status and, on a
// simulated node only, the /sim/ fault injection endpoints. draSlices is
// the DRA driver's publishing state (nil without DRA). /metrics serves
// reg's series and gpuMetrics' (nil: reg's alone).
func newHTTPHandler(ag statusSource, mgr registrations, hw eventWatch, samples sampled, draSlices func() dra.Slices, reg *prometheus.Registry, gpuMetrics *telemetry.Exposition, be *backend) http.Handler {
	mux := http.NewServeMux()
	build := buildInfo()
	metrics := promhttp.HandlerFor(reg, promhttp.HandlerOpts{Registry: reg})
	if gpuMetrics != nil {
		metrics = telemetry.MetricsHandler(reg, gpuMetrics)
	}
	mux.Handle("GET /metrics", fewAtATime(runtime.GOMAXPROCS(0), metrics))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		if !ag.Alive() {
			http.Error(w, "reconcile loop has not completed a pass recently", http.StatusServiceUnavailable)
			return
		}
		fmt.Fprintln(w, "ok")
	})
	mux.HandleFunc("GET /readyz", func(w http.ResponseWriter, _ *http.Request) {
		st := ag.Status()
		switch {
		case st.LastPass.IsZero():
			http.Error(w, "no reconcile pass yet", http.StatusServiceUnavailable)
		case !mgr.Ready():
			http.Error(w, "not every resource is registered with the kubelet", http.StatusServiceUnavailable)
		case st.State != nil && st.State.Error != "":
			// Allocate and Prepare are refused while what they record
			// cannot be written: a restart would forget it.
			http.Error(w, "state not saved in "+st.State.Dir+": "+st.State.Error, http.StatusServiceUnavailable)
		case len(st.GPUs) > 0 && !hasSamples(samples.Snapshot()):
			// Not ready, not in the Service's endpoints, not scraped: the
			// first scrape then already has the DCGM series.
			http.Error(w, "GPU metrics not sampled yet", http.StatusServiceUnavailable)
		default:
			fmt.Fprintln(w, "ok")
		}
	})
	mux.HandleFunc("GET /status", func(w http.ResponseWriter, _ *http.Request) {
		st := *ag.Status()
		st.Backend = be.Name
		st.Build = &build
		st.Registrations = nil
		for _, r := range mgr.Status() {
			st.Registrations = append(st.Registrations, agent.Registration{
				Resource: r.Name, Socket: r.Socket, Registered: r.Registered,
				RegisteredAt: r.RegisteredAt, LastError: r.LastError,
			})
		}
		st.HealthEvents = hw.Watched()
		if st.DRA != nil && draSlices != nil {
			d := *st.DRA // the loop's published status is shared: a copy
			s := draSlices()
			d.Slices = &s
			st.DRA = &d
		}
		w.Header().Set("Content-Type", "application/json")
		enc := json.NewEncoder(w)
		enc.SetIndent("", "  ")
		_ = enc.Encode(&st)
	})
	if be.Sim != nil {
		mux.Handle("/sim/", be.Sim.Handler())
	}
	return mux
}

// fewAtATime lets at most n requests into h at once; the others wait their
// turn, parked, for as long as their clients do. Rendering /metrics is
// CPU-bound: more renders at once than the runtime has threads to run them
// finish none sooner, and each is one more runnable goroutine that a
// probe's goroutine (and the HTTP accept loop) queues behind. With every
// slot of the connection limit rendering, that queue made probes wait
// most of their second (issue 23).
func fewAtATime(n int, h http.Handler) http.Handler {
	turns := make(chan struct{}, n)
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		select {
		case turns <- struct{}{}:
		case <-r.Context().Done():
			http.Error(w, "gave up waiting for its turn", http.StatusServiceUnavailable)
			return
		}
		defer func() { <-turns }()
		h.ServeHTTP(w, r)
	})
}

func hasSamples(s *telemetry.Snapshot) bool { return s != nil && len(s.GPUs) > 0 }
