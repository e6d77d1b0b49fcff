package usage

import (
	"fmt"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// BenchmarkScrape is one scrape's per-process work on an 8-GPU node with
// 100 GPU processes, each in a pod of its own: NVML's process lists and
// utilization samples (10 s of them per process, the default interval),
// the owner of every PID from /proc (start time read, cgroup cached) and
// its pod's names. The goal is under 10 ms per scrape:
//
//	go test ./usage -run '^$' -bench Scrape -benchmem
func BenchmarkScrape(b *testing.B) {
	for _, tc := range []struct {
		profile string
		mig     bool
	}{{"dgx-h100", false}, {"dgx-h100-mig", true}} {
		b.Run(tc.profile, func(b *testing.B) {
			n, clk, inv := newSim(b, tc.profile)
			proc := fakeProc{b, b.TempDir()}
			var pods []*corev1.Pod
			for i := range 100 {
				pid := uint32(100_000 + i)
				p := sim.Process{PID: pid, GI: sim.NoInstance, CI: sim.NoInstance, MemoryBytes: 1 << 30, SM: uint32(i % 100), Mem: 10}
				if tc.mig {
					p.GI = uint32(i/8%7 + 1) // 7 1g.10gb instances, ids 1 to 7, on each GPU
					p.CI = 0
				}
				if err := n.StartProcess(i%8, p); err != nil {
					b.Fatal(err)
				}
				podUID := fmt.Sprintf("%08x-0000-4000-8000-%012x", i, i)
				ctr := fmt.Sprintf("%064x", i+1)
				proc.set(pid, "python3", uint64(1000+i),
					"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod"+sdUID(podUID)+".slice/cri-containerd-"+ctr+".scope\n")
				pods = append(pods, &corev1.Pod{
					ObjectMeta: metav1.ObjectMeta{Namespace: "team", Name: fmt.Sprintf("job-%d", i), UID: types.UID(podUID)},
					Status:     corev1.PodStatus{ContainerStatuses: []corev1.ContainerStatus{{Name: "main", ContainerID: "containerd://" + ctr}}},
				})
			}
			s := NewSampler(n)
			r := NewResolver(proc.root)
			idx := NewPodIndex(pods)
			scrape := func() int {
				clk.t = clk.t.Add(10 * time.Second)
				samples, err := s.Sample(inv)
				if err != nil {
					b.Fatal(err)
				}
				named := 0
				for _, ps := range samples {
					o, err := r.Resolve(ps.PID)
					if err != nil {
						b.Fatal(err)
					}
					if _, ok := idx.Lookup(o); ok {
						named++
					}
				}
				return named
			}
			if got := scrape(); got != 100 {
				b.Fatalf("%d processes named, want 100", got)
			}
			for b.Loop() {
				scrape()
			}
		})
	}
}

func sdUID(uid string) string {
	out := []byte(uid)
	for i, c := range out {
		if c == '-' {
			out[i] = '_'
		}
	}
	return string(out)
}
