package agent

import (
	"slices"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/kube"
)

// The cordon annotation is written by anyone who may annotate the Node:
// whatever its value, each entry either cordons a GPU of the node (each GPU
// once, named as written) or is reported unknown, and only GPUs it names are
// cordoned.
func FuzzCordonAnnotation(f *testing.F) {
	for _, s := range []string{"", "0", "1, GPU-b", "GPU-a,0,,7", " , GPU-z ,01", "\x00,\xff"} {
		f.Add(s)
	}
	inv := &gpu.Inventory{GPUs: []gpu.GPU{{Index: 0, UUID: "GPU-a"}, {Index: 1, UUID: "GPU-b"}}}
	f.Fuzz(func(t *testing.T, value string) {
		list := kube.SplitCordon(value)
		for _, e := range list {
			if e == "" || strings.Contains(e, ",") || strings.TrimSpace(e) != e {
				t.Fatalf("SplitCordon(%q) gave entry %q", value, e)
			}
		}
		if again := kube.SplitCordon(strings.Join(list, ",")); !slices.Equal(again, list) {
			t.Fatalf("SplitCordon is not stable: %q then %q", list, again)
		}
		c := Snapshot{Inventory: inv, Cordoned: list}.Cordon()
		seen := map[string]bool{}
		for _, g := range c.GPUs {
			if seen[g.UUID] || !slices.Contains(list, g.As) || g.As != g.UUID && g.As != []string{"0", "1"}[g.Index] {
				t.Fatalf("%q: cordoned %+v", value, c.GPUs)
			}
			seen[g.UUID] = true
		}
		for _, u := range c.Unknown {
			if !slices.Contains(list, u) || slices.ContainsFunc(c.GPUs, func(g CordonedGPU) bool { return g.As == u }) {
				t.Fatalf("%q: unknown %q", value, c.Unknown)
			}
		}
		if len(c.GPUs)+len(c.Unknown) > len(list) {
			t.Fatalf("%q: more results than entries: %+v", value, c)
		}
	})
}
