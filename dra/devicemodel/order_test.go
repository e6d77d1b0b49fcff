package devicemodel_test

import (
	"slices"
	"testing"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu/simtest"
)

// TestPublishOrder checks that every prefix a plain count claim would take
// on a free node is a well-connected set.
func TestPublishOrder(t *testing.T) {
	tests := []struct {
		profile string
		// prefixes: for a count N, the sets (as sorted GPU indexes) the
		// first N must be one of.
		prefixes map[int][][]int
	}{
		{profile: "dgx1-v100", prefixes: map[int][][]int{
			// The cube-mesh's 2-lane pairs, and its fully connected quads.
			2: {{0, 3}, {0, 4}, {1, 2}, {1, 5}, {2, 3}, {4, 7}, {5, 6}, {6, 7}},
			4: {{0, 1, 2, 3}, {4, 5, 6, 7}},
		}},
		{profile: "two-islands-16", prefixes: map[int][][]int{
			4: {{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}},
			8: {{0, 1, 2, 3, 4, 5, 6, 7}, {8, 9, 10, 11, 12, 13, 14, 15}},
		}},
		{profile: "pcie-8gpu", prefixes: map[int][][]int{
			2: {{0, 1}, {2, 3}, {4, 5}, {6, 7}},
			4: {{0, 1, 2, 3}, {4, 5, 6, 7}},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.profile, func(t *testing.T) {
			_, inv := simtest.NodeInventory(t, tt.profile)
			order := devicemodel.PublishOrder(inv)
			if got := slices.Sorted(slices.Values(order)); len(got) != len(inv.GPUs) || got[0] != 0 || got[len(got)-1] != len(inv.GPUs)-1 {
				t.Fatalf("order %v is not a permutation of the GPUs", order)
			}
			for n, sets := range tt.prefixes {
				prefix := slices.Sorted(slices.Values(order[:n]))
				if !slices.ContainsFunc(sets, func(s []int) bool { return slices.Equal(s, prefix) }) {
					t.Errorf("first %d GPUs %v, want one of %v (order %v)", n, prefix, sets, order)
				}
			}
		})
	}
}

func BenchmarkPublishOrder(b *testing.B) {
	_, inv := simtest.NodeInventory(b, "two-islands-16")
	for b.Loop() {
		devicemodel.PublishOrder(inv)
	}
}
