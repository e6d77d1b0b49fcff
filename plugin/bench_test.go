package plugin

import (
	"context"
	"path/filepath"
	"slices"
	"testing"
	"time"

	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// minSamples is how many round trips the percentiles are computed over,
// whatever b.N is.
const minSamples = 10_000

func reportPercentiles(b *testing.B, lat []time.Duration) {
	b.Helper()
	slices.Sort(lat)
	pct := func(p float64) float64 { return float64(lat[int(p*float64(len(lat)-1))].Nanoseconds()) }
	b.ReportMetric(pct(0.50), "p50-ns")
	b.ReportMetric(pct(0.99), "p99-ns")
}

// BenchmarkAllocateRoundTrip is one kubelet Allocate call for one GPU over
// the real unix socket, as the kubelet makes it at container creation.
func BenchmarkAllocateRoundTrip(b *testing.B) {
	dir := shortDir(b)
	startManager(b, dir, testCatalog())
	c := dialPlugin(b, filepath.Join(dir, sockGPU))
	ctx := context.Background()
	req := allocReq([]string{"GPU-b"})
	call := func() time.Duration {
		start := time.Now()
		if _, err := c.Allocate(ctx, req); err != nil {
			b.Fatal(err)
		}
		return time.Since(start)
	}
	call() // connect outside the measurement

	lat := make([]time.Duration, 0, max(b.N, minSamples))
	b.ReportAllocs()
	b.ResetTimer()
	for range b.N {
		lat = append(lat, call())
	}
	b.StopTimer()
	for len(lat) < minSamples {
		lat = append(lat, call())
	}
	reportPercentiles(b, lat)
}

// BenchmarkHealthUpdateLatency is the time from Update with one device
// turned unhealthy (or healthy again) to the kubelet's ListAndWatch stream
// receiving the new list.
func BenchmarkHealthUpdateLatency(b *testing.B) {
	dir := shortDir(b)
	healthy := testCatalog()
	sick := withHealth(healthy, resGPU, "GPU-c", false, "XID 79")
	m, _ := startManager(b, dir, healthy)
	ctx, cancel := context.WithCancel(context.Background())
	b.Cleanup(cancel)
	s, err := dialPlugin(b, filepath.Join(dir, sockGPU)).ListAndWatch(ctx, &pluginapi.Empty{})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := s.Recv(); err != nil {
		b.Fatal(err)
	}

	lat := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := range b.N {
		next, want := sick, pluginapi.Unhealthy
		if i%2 == 1 {
			next, want = healthy, pluginapi.Healthy
		}
		start := time.Now()
		m.Update(next)
		resp, err := s.Recv()
		if err != nil {
			b.Fatal(err)
		}
		lat = append(lat, time.Since(start))
		if got := resp.GetDevices()[2].GetHealth(); got != want {
			b.Fatalf("update %d: GPU-c is %s, want %s", i, got, want)
		}
	}
	b.StopTimer()
	reportPercentiles(b, lat)
}
