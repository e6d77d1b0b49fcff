package telemetry

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

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
//     included (one per holder each: 36 fields × 100 holders);
//
//   - holder-series: one /metrics request with the per-holder series
//     alone, what the holders add to a scrape. The goal for the whole
//     scrape is under 10 ms.
//
//     go test ./telemetry -run '^$' -bench HolderScrape -benchmem
func BenchmarkHolderScrape(b *testing.B) {
	r := newHolderBench(b)
	b.Run("pass", func(b *testing.B) {
		for b.Loop() {
			r.clk.add(10 * time.Second)
			r.tr.Pass()
		}
	})
	r.s.Sample()
	for _, bc := range []struct {
		name string
		col  prometheus.Collector
	}{
		{"scrape", r.col},
		{"holder-series", NewCollector(CollectorOptions{Samples: NewSampler(nil, SamplerOptions{}), Holders: r.tr})},
	} {
		b.Run(bc.name, func(b *testing.B) { scrapeBench(b, bc.col) })
	}
}

func scrapeBench(b *testing.B, col prometheus.Collector) {
	reg := prometheus.NewRegistry()
	reg.MustRegister(col)
	h := promhttp.HandlerFor(reg, promhttp.HandlerOpts{})
	req := httptest.NewRequest(http.MethodGet, "/metrics", nil)
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
	clk  *fakeClock
	s    *Sampler
	tr   *HolderTracker
	col  *Collector
	pods []*corev1.Pod
}

func newHolderBench(b *testing.B) *holderBench {
	r := &holderRig{t: nil, clk: newClock(), attr: &settableAttribution{}}
	r.n = newNode(b, "dgx-h100", simClock(r.clk))
	r.inv = inventory(b, r.n)
	var pods []*podresourcesv1.PodResources
	for i := range 100 {
		g := r.inv.GPUs[i%8]
		w := newWorkload(i, "team", fmt.Sprintf("job-%d", i))
		r.pods = append(r.pods, w.pod())
		pods = append(pods, pod(w.ns, w.name, w.container, "nvidia.com/gpu.shared", fmt.Sprintf("%s::%d", g.UUID, i/8)))
		if err := r.n.StartProcess(i%8, simProcess(uint32(100_000+i), uint32(i%100), w)); err != nil {
			b.Fatal(err)
		}
	}
	r.attr.a = podresources.NewAttribution(pods, nil)
	opts := HolderOptions{}
	opts.Owners, opts.Pods, opts.Attribution, opts.Now = simResolver(r.n), r, r.attr, r.clk.now
	r.tr = NewHolderTracker(r.n, opts)
	r.tr.SetInventory(r.inv)
	// A day of passes behind every holder, so each has its 288 buckets.
	for range 24 * 12 {
		r.clk.add(5 * time.Minute)
		r.tr.lastPass = r.clk.now().Add(-10 * time.Second)
		r.tr.Pass()
	}
	r.s = newSampler(r.n, r.clk)
	r.s.SetInventory(r.inv)
	r.col = NewCollector(CollectorOptions{Samples: r.s, Attribution: r.attr, Holders: r.tr})
	if got := len(r.tr.Holders().Holders); got != 100 {
		b.Fatalf("%d holders, want 100", got)
	}
	return &holderBench{clk: r.clk, s: r.s, tr: r.tr, col: r.col, pods: r.pods}
}
