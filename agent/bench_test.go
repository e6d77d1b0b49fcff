package agent

import (
	"fmt"
	"slices"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// BenchmarkPrepare times a DRA Prepare through the loop as the kubelet's
// call sees it: post, Step (decide, plan, checkpoint to the state dir),
// answer; then Unprepare. It reports the Prepare latency's p50 and p99.
//
//	go test -run '^$' -bench Prepare ./agent
func BenchmarkPrepare(b *testing.B) {
	const mpsShared = "version: v1\nconfigs:\n  default:\n    sharing:\n      mps:\n        resources:\n        - name: nvidia.com/gpu\n          replicas: 4\n"
	cases := []struct {
		name, profile, device, config string
		opts                          []sim.Option
		share                         bool
	}{
		{"whole-gpu", "dgx-a100", "gpu-3", wholeGPUs, nil, false},
		{"dynamic-mig-3g", "dgx-h100", "gpu-3-mig-3g40gb-4", migOnDemand, []sim.Option{sim.WithMIGEnabled()}, false},
		// An MPS share writes the claim's own CDI spec (and Unprepare removes it).
		{"mps-share", "pcie-4gpu", "gpu-3", mpsShared, nil, true},
	}
	for _, c := range cases {
		b.Run(c.name, func(b *testing.B) {
			rec := &draRecorder{}
			// As deployed: the node's CDI spec is kept on disk beside the DRA driver.
			h := newHarness(b, simNode(b, c.profile, c.opts...), withDRA(rec), withMIG(), withQuietLog(), withCDI(b.TempDir()), withMPS(&fakeMPS{}))
			h.config(c.config)
			if _, ok := rec.last().Device(c.device); !ok {
				b.Fatalf("no device %s in the pool", c.device)
			}
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := range b.N {
				uid := types.UID(fmt.Sprint("uid-", i))
				cl := claim(string(uid), "c", c.device)
				if c.share {
					cl.Devices[0].ShareID = types.UID("share-" + uid)
				}
				start := time.Now()
				reply := make(chan map[types.UID]dra.Prepared, 1)
				h.a.Step([]Event{ClaimsPrepare{Claims: []dra.Claim{cl}, Reply: reply}})
				if got := <-reply; got[uid].Err != nil {
					b.Fatal(got[uid].Err)
				}
				lat = append(lat, time.Since(start))
				done := make(chan map[types.UID]error, 1)
				h.a.Step([]Event{ClaimsUnprepare{Claims: []dra.ClaimRef{{UID: uid, Namespace: "default", Name: "c"}}, Reply: done}})
				<-done
			}
			b.StopTimer()
			slices.Sort(lat)
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
		})
	}
}
