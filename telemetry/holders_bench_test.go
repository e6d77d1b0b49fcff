package telemetry

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"runtime"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// BenchmarkHolderScrape is the per-holder work with 100 GPU processes on
// sim:dgx-h100, each the one process of a pod holding one of 13 replicas
// of its GPU, with a day of averages behind every holder:
//
//   - pass: the HolderTracker's pass (NVML's process lists and samples,
//     PID to pod through the sim's cgroups and the Pod index, the holders'
//     windows), off the scrape path, every 10 s;
//
//   - scrape: one /metrics request with every series, the DCGM ones
//     included (one per holder each: 36 fields × 100 holders), served from
//     the Exposition's rendering as the agent serves it, inflated (no
//     gzip asked for); -gzip and -protobuf as Prometheus may ask;
//     -uncached gathered and encoded at the scrape through a registry, as
//     before the Exposition;
//
//   - holder-series: the same with the per-holder series alone;
//
//   - render: the Exposition's rendering, off the scrape path, after each
//     sampler and tracker pass.
//
// The goal for the whole scrape is under 10 ms. On 2 shared cores
// (docs/holders.md, Cost): gzip 0.07 ms; scrape 3 ms and protobuf 4 ms
// (inflated); uncached 31 ms; render 31 ms.
//
//	go test ./telemetry -run '^$' -bench HolderScrape -benchmem -count=3
func BenchmarkHolderScrape(b *testing.B) {
	r := newHolderBench(b, 100)
	b.Run("pass", func(b *testing.B) {
		for b.Loop() {
			r.clk.Add(10 * time.Second)
			r.tr.Pass()
		}
	})
	r.s.Sample()
	holderSeries := NewCollector(CollectorOptions{Samples: NewSampler(nil, SamplerOptions{}), Holders: r.tr})
	for _, bc := range []struct {
		name   string
		h      http.Handler
		header http.Header
	}{
		{"scrape", exposed(r.col), nil},
		{"scrape-gzip", exposed(r.col), http.Header{"Accept-Encoding": {"gzip"}}},
		{"scrape-protobuf", exposed(r.col), http.Header{"Accept": {protobufAccept}}},
		{"scrape-uncached", uncached(r.col), nil},
		{"scrape-uncached-gzip", uncached(r.col), http.Header{"Accept-Encoding": {"gzip"}}},
		{"holder-series", exposed(holderSeries), nil},
		{"holder-series-uncached", uncached(holderSeries), nil},
	} {
		b.Run(bc.name, func(b *testing.B) { scrapeBench(b, bc.h, bc.header) })
	}
	b.Run("render", func(b *testing.B) {
		e := NewExposition(r.col)
		b.ReportAllocs()
		for b.Loop() {
			if err := e.Render(); err != nil {
				b.Fatal(err)
			}
		}
		c := e.cur.Load()
		b.ReportMetric(float64(c.text.size), "text-bytes")
		b.ReportMetric(float64(len(c.text.deflated)), "deflated-bytes")
	})
}

// BenchmarkExpositionSize is the worst case of issue 31, 8 GPUs × 48
// replicas each held by a container of its own with one process: the
// series of one rendering and the heap it keeps (the deflated text, and
// the deflated protobuf once a scraper asked for it), measured as live
// heap after a GC with and without it, its Collector's label cache
// (seriesCache) already filled by a first one.
//
//	go test ./telemetry -run '^$' -bench ExpositionSize -benchtime 1x
func BenchmarkExpositionSize(b *testing.B) {
	r := newHolderBench(b, 8*48)
	r.s.Sample()
	e := NewExposition(r.col)
	e.wantProto.Store(true)
	if err := e.Render(); err != nil {
		b.Fatal(err)
	}
	var before, after runtime.MemStats
	for b.Loop() {
		e.cur.Store(nil)
		runtime.GC()
		runtime.ReadMemStats(&before)
		if err := e.Render(); err != nil {
			b.Fatal(err)
		}
		runtime.GC()
		runtime.ReadMemStats(&after)
	}
	c := e.cur.Load()
	mfs, err := e.Gather()
	if err != nil {
		b.Fatal(err)
	}
	series := 0
	for _, mf := range mfs {
		series += len(mf.Metric)
	}
	b.ReportMetric(float64(series), "series")
	b.ReportMetric(float64(int64(after.HeapAlloc)-int64(before.HeapAlloc)), "retained-bytes")
	b.ReportMetric(float64(c.text.size), "text-bytes")
	b.ReportMetric(float64(len(c.text.deflated)), "text-deflated-bytes")
	b.ReportMetric(float64(c.proto.size), "proto-bytes")
	b.ReportMetric(float64(len(c.proto.deflated)), "proto-deflated-bytes")
}

// BenchmarkHolderMemory is the heap the agent keeps for the worst case of
// issue 31 (8 GPUs × 48 replicas, each held by a container of its own
// with one process, a day of averages behind each), live after a GC:
//
//   - node-bytes: the simulated node and its 384 processes, in the
//     agent's heap only under --backend sim (NVML keeps its own, outside
//     Go's heap, on a real node);
//   - tracker-bytes: the holder tracker (its state, a day of buckets per
//     holder), the sampler's snapshot, the Pods and the kubelet's
//     allocations as the tracker reads them;
//   - exposition-bytes: the Collector and its Exposition after renders
//     and a scrape in each format (text, gzip, protobuf), the label cache
//     included;
//   - agent-bytes: tracker-bytes + exposition-bytes, what these holders
//     add to the agent's heap on a real node.
//
// The Go runtime lets the heap grow to twice what is live before it
// collects (GOGC=100) unless GOMEMLIMIT says otherwise.
//
//	go test ./telemetry -run '^$' -bench HolderMemory -benchtime 1x
func BenchmarkHolderMemory(b *testing.B) {
	heap := func() int64 {
		var m runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&m)
		return int64(m.HeapAlloc)
	}
	for b.Loop() {
		start := heap()
		var node int64
		r := newHolderBenchMarked(b, 8*48, func(string) { node = heap() })
		r.s.Sample()
		tracked := heap()
		e := NewExposition(r.col)
		h := MetricsHandler(prometheus.NewRegistry(), e)
		for range 2 {
			if err := e.Render(); err != nil {
				b.Fatal(err)
			}
			for _, header := range []http.Header{nil, {"Accept-Encoding": {"gzip"}}, {"Accept": {protobufAccept}, "Accept-Encoding": {"gzip"}}} {
				req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
				req.Header = header
				rec := httptest.NewRecorder()
				h.ServeHTTP(rec, req)
				if rec.Code != http.StatusOK {
					b.Fatal(rec.Code, rec.Body)
				}
			}
			r.clk.Add(10 * time.Second)
			r.tr.Pass()
			r.s.Sample()
		}
		exposed := heap()
		b.ReportMetric(float64(node-start), "node-bytes")
		b.ReportMetric(float64(tracked-node), "tracker-bytes")
		b.ReportMetric(float64(exposed-tracked), "exposition-bytes")
		b.ReportMetric(float64(exposed-node), "agent-bytes")
		runtime.KeepAlive(r)
		runtime.KeepAlive(e)
	}
}

// protobufAccept is what Prometheus sends when it prefers protobuf
// (scrape_protocols: [PrometheusProto, ...]).
const protobufAccept = "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=delimited;q=0.5,text/plain;version=0.0.4;q=0.1"

// exposed is col's /metrics as the agent serves it: rendered once per
// change of its sources (Exposition), beside an empty registry.
func exposed(col *Collector) http.Handler {
	e := NewExposition(col)
	if err := e.Render(); err != nil {
		panic(err)
	}
	return MetricsHandler(prometheus.NewRegistry(), e)
}

// uncached is col's /metrics gathered and encoded at each scrape, as it
// was before Exposition.
func uncached(col *Collector) http.Handler {
	reg := prometheus.NewRegistry()
	reg.MustRegister(col)
	return promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
}

func scrapeBench(b *testing.B, h http.Handler, header http.Header) {
	req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
	req.Header = header
	b.ReportAllocs()
	for b.Loop() {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK {
			b.Fatal(rec.Code)
		}
	}
}

type holderBench struct {
	clk  *simtest.Clock
	s    *Sampler
	tr   *HolderTracker
	col  *Collector
	pods []*corev1.Pod
}

func newHolderBench(b *testing.B, holders int) *holderBench {
	return newHolderBenchMarked(b, holders, func(string) {})
}

// newHolderBenchMarked is newHolderBench, calling mark("node") once the
// simulated node runs the processes, before anything of the agent's
// exists.
func newHolderBenchMarked(b *testing.B, holders int, mark func(stage string)) *holderBench {
	r := &holderRig{t: nil, clk: simtest.NewClock(), attr: &settableAttribution{}}
	r.n = simtest.Node(b, "dgx-h100", simClock(r.clk))
	r.inv = simtest.Inventory(b, r.n)
	var pods []*podresourcesv1.PodResources
	for i := range holders {
		g := r.inv.GPUs[i%8]
		w := newWorkload(i, "team", fmt.Sprintf("job-%d", i))
		r.pods = append(r.pods, w.pod())
		pods = append(pods, pod(w.ns, w.name, w.container, "nvidia.com/gpu.shared", fmt.Sprintf("%s::%d", g.UUID, i/8)))
		if err := r.n.StartProcess(i%8, simProcess(uint32(100_000+i), uint32(i%100), w)); err != nil {
			b.Fatal(err)
		}
	}
	mark("node")
	r.attr.a = podresources.NewAttribution(pods, nil)
	opts := HolderOptions{}
	opts.Owners, opts.Pods, opts.Attribution, opts.Now = simResolver(r.n), r, r.attr, r.clk.Now
	r.tr = NewHolderTracker(r.n, opts)
	r.tr.SetInventory(r.inv)
	// A day of passes behind every holder, so each has its 288 buckets.
	for range 24 * 12 {
		r.clk.Add(5 * time.Minute)
		r.tr.lastPass = r.clk.Now().Add(-10 * time.Second)
		r.tr.Pass()
	}
	r.s = newSampler(r.n, r.clk)
	r.s.SetInventory(r.inv)
	r.col = NewCollector(CollectorOptions{Samples: r.s, Attribution: r.attr, Holders: r.tr})
	if got := len(r.tr.Holders().Holders); got != holders {
		b.Fatalf("%d holders, want %d", got, holders)
	}
	return &holderBench{clk: r.clk, s: r.s, tr: r.tr, col: r.col, pods: r.pods}
}
