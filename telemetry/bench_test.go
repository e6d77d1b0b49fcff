package telemetry

import (
	"fmt"
	"net/http"
	"net/http/httptest"
	"testing"
	"time"

	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// BenchmarkScrape measures one /metrics request on sim:dgx-h100 with 7 MIG
// devices per GPU, each shared as 4 replicas held by 4 different pods, as
// the agent serves it: from the Exposition's rendering (0.2 ms of CPU on 2
// shared cores; gathered and encoded at each scrape through a registry, as
// before the Exposition, 16 ms).
//
//	go test ./telemetry -run '^$' -bench 'Scrape$' -benchmem
func BenchmarkScrape(b *testing.B) {
	clk := simtest.NewClock()
	n := simtest.Node(b, "dgx-h100", sim.WithMIGEnabled(), sim.WithClock(clk.Now))
	simtest.CreateMIG(b, n, 7)
	inv := simtest.Inventory(b, n)

	s := newSampler(n, clk)
	s.SetInventory(inv)
	s.Sample()
	st := watchedHealth(b, n, inv, func() {}, func(s *health.State) bool { return s != nil })

	var pods []*podresourcesv1.PodResources
	res := &catalog.Resource{Name: "nvidia.com/mig-1g.10gb.shared"}
	for _, g := range inv.GPUs {
		for _, in := range g.Instances {
			for r := range 4 {
				id := fmt.Sprintf("%s::%d", in.UUID, r)
				res.Devices = append(res.Devices, catalog.Device{ID: id})
				pods = append(pods, pod("team", fmt.Sprintf("job-%d-%d-%d", g.Index, in.GI, r), "main", res.Name, id))
			}
		}
	}
	c := NewCollector(CollectorOptions{
		Samples: s, Health: fixedState{st},
		Attribution: fixedAttribution{podresources.NewAttribution(pods, podresources.IsGPUResource)},
		Catalog:     fixedCatalog{&catalog.Catalog{Resources: map[string]*catalog.Resource{res.Name: res}}},
		Hostname:    "node-1",
	})
	h := exposed(c)
	req := httptest.NewRequest(http.MethodGet, "/metrics", nil)

	first := httptest.NewRecorder()
	h.ServeHTTP(first, req)
	b.ReportAllocs()
	b.ResetTimer()
	for b.Loop() {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		if rec.Code != http.StatusOK {
			b.Fatal(rec.Code)
		}
	}
	// After the loop: ResetTimer drops metrics reported before it.
	b.ReportMetric(float64(first.Body.Len()), "bytes/scrape")
}

// BenchmarkSample measures one sampling pass (the NVML side, off the scrape path).
func BenchmarkSample(b *testing.B) {
	clk := simtest.NewClock()
	n := simtest.Node(b, "dgx-h100", sim.WithMIGEnabled(), sim.WithClock(clk.Now))
	simtest.CreateMIG(b, n, 7)
	s := newSampler(n, clk)
	s.SetInventory(simtest.Inventory(b, n))
	s.Sample() // GPM's first samples
	b.ReportAllocs()
	for b.Loop() {
		clk.Add(10 * time.Second) // a pass an interval after the last: every GPM source samples
		s.Sample()
	}
}
