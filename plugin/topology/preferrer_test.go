package topology

import (
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/plugin/topology/topotest"
)

func uuids(profile string, idx ...int) []string {
	out := make([]string, len(idx))
	for k, i := range idx {
		out[k] = topotest.UUID(profile, i)
	}
	return out
}

func TestPreferredWholeGPUs(t *testing.T) {
	v100 := topotest.DGX1V100()
	pv := NewGPUPreferrer(v100.Inventory(), PolicyTopology)
	// GPU 1 failed to enumerate: positions 0,1,2 hold GPU indices 0,2,3, and
	// GPU 3 (position 2) has the 2-lane link to GPU 0.
	holed := v100.Inventory()
	holed.GPUs = []gpu.GPU{holed.GPUs[0], holed.GPUs[2], holed.GPUs[3]}
	holed.Topology = subTopology(v100.Topology, 0, 2, 3)
	ph := NewGPUPreferrer(holed, PolicyDistributed)

	name := v100.Name
	tests := []struct {
		name        string
		p           *Preferrer
		avail, must []string
		size        int
		want        []string
	}{
		{"issue example", pv, uuids(name, 4, 3, 2, 1), uuids(name, 1), 2, uuids(name, 1, 2)},
		{"duplicates in available", pv, uuids(name, 0, 0, 5, 3), nil, 2, uuids(name, 0, 3)},
		{"index differs from position", ph, uuids(name, 0, 2, 3), uuids(name, 0), 2, uuids(name, 0, 3)},
		{"unknown must kept, known searched", pv, append(uuids(name, 4, 5, 7), "GPU-new"), []string{"GPU-new"}, 3,
			append([]string{"GPU-new"}, uuids(name, 4, 7)...)},
		{"unknown fills last", pv, append(uuids(name, 4), "GPU-b", "GPU-a"), nil, 2,
			append(uuids(name, 4), "GPU-a")},
		{"must fills size", pv, uuids(name, 0, 1, 2), uuids(name, 2), 1, uuids(name, 2)},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := tt.p.Preferred(tt.avail, tt.must, tt.size)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got, tt.want) {
				t.Fatalf("got %v, want %v", got, tt.want)
			}
		})
	}
}

func subTopology(t *gpu.Topology, keep ...int) *gpu.Topology {
	n := len(keep)
	out := &gpu.Topology{Level: make([][]gpu.LinkLevel, n), DirectLanes: make([][]int, n),
		SwitchLanes: make([]int, n), Fabric: make([]int, n)}
	for a, i := range keep {
		out.SwitchLanes[a], out.Fabric[a] = t.SwitchLanes[i], t.Fabric[i]
		out.Level[a] = make([]gpu.LinkLevel, n)
		out.DirectLanes[a] = make([]int, n)
		for b, j := range keep {
			out.Level[a][b], out.DirectLanes[a][b] = t.Level[i][j], t.DirectLanes[i][j]
		}
	}
	return out
}

func TestPreferredErrors(t *testing.T) {
	p := NewGPUPreferrer(topotest.PCIe8GPU().Inventory(), PolicyTopology)
	a := uuids("pcie-8gpu", 0, 1, 2)
	tests := []struct {
		name        string
		avail, must []string
		size        int
		want        string
	}{
		{"size", a, nil, 0, "allocation size 0"},
		{"must not available", a, []string{"GPU-x"}, 1, `must-include device "GPU-x" is not available`},
		{"must exceeds size", a, a, 2, "3 must-include devices exceed allocation size 2"},
		{"not enough", a, nil, 4, "3 devices available, 4 requested"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			_, err := p.Preferred(tt.avail, tt.must, tt.size)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want %q", err, tt.want)
			}
		})
	}
}

// replicas returns per devices on each GPU of p, ID "<gpu>::<k>".
func replicas(p topotest.Profile, per int) []catalog.Device {
	var devs []catalog.Device
	for i := range p.Topology.Len() {
		for k := range per {
			devs = append(devs, catalog.Device{ID: fmt.Sprintf("%d::%d", i, k), GPU: i})
		}
	}
	return devs
}

func gpusOf(ids []string) []string {
	out := make([]string, len(ids))
	for k, id := range ids {
		out[k], _, _ = strings.Cut(id, "::")
	}
	return out
}

func TestPreferredShared(t *testing.T) {
	v100 := topotest.DGX1V100()
	devs := replicas(v100, 4)
	all := make([]string, len(devs))
	for k, d := range devs {
		all[k] = d.ID
	}
	without := func(drop ...string) []string {
		return slices.DeleteFunc(slices.Clone(all), func(id string) bool { return slices.Contains(drop, id) })
	}
	tests := []struct {
		name   string
		policy Policy
		avail  []string
		must   []string
		size   int
		gpus   []string // GPU of each answer device, in pick order
	}{
		{"distributed spreads", PolicyDistributed, all, nil, 3, []string{"0", "3", "2"}},
		{"distributed avoids used GPUs", PolicyDistributed, without("0::0", "1::0", "3::1"), nil, 2, []string{"2", "6"}},
		{"packed fills one GPU", PolicyPacked, all, nil, 5, []string{"0", "0", "0", "0", "3"}},
		{"packed starts on the fullest", PolicyPacked, without("5::0", "5::1", "2::0"), nil, 2, []string{"5", "5"}},
		{"packed stays with must", PolicyPacked, all, []string{"6::2"}, 2, []string{"6", "6"}},
		{"topology spills to best link", PolicyTopology, all, []string{"1::0"}, 6, []string{"1", "1", "1", "1", "2", "2"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p := NewPreferrer(FromInventory(v100.Inventory(), tt.policy), devs)
			got, err := p.Preferred(tt.avail, tt.must, tt.size)
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(gpusOf(got), tt.gpus) {
				t.Fatalf("got %v (GPUs %v), want GPUs %v", got, gpusOf(got), tt.gpus)
			}
			checkAnswer(t, got, tt.avail, tt.must, tt.size)
		})
	}
}

func checkAnswer(t *testing.T, got, avail, must []string, size int) {
	t.Helper()
	if len(got) != size {
		t.Fatalf("got %d devices %v, want %d", len(got), got, size)
	}
	seen := map[string]bool{}
	for _, id := range got {
		if seen[id] || !slices.Contains(avail, id) {
			t.Fatalf("answer %v: %q repeated or not available", got, id)
		}
		seen[id] = true
	}
	for _, id := range must {
		if !seen[id] {
			t.Fatalf("answer %v lacks must-include %q", got, id)
		}
	}
}

// Any valid request gets a valid answer, whatever the policy and sharing.
func TestPreferredAlwaysValid(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, prof := range topotest.Profiles() {
		for _, per := range []int{1, 3} {
			devs := replicas(prof, per)
			devs = append(devs, catalog.Device{ID: "elsewhere", GPU: 99})
			for _, pol := range []Policy{PolicyTopology, PolicyPacked, PolicyDistributed} {
				p := NewPreferrer(FromInventory(prof.Inventory(), pol), devs)
				for range 200 {
					var avail []string
					for _, d := range devs {
						if r.IntN(3) > 0 {
							avail = append(avail, d.ID)
						}
					}
					if r.IntN(4) == 0 {
						avail = append(avail, "unknown-id")
					}
					if len(avail) == 0 {
						continue
					}
					size := 1 + r.IntN(len(avail))
					must := avail[:r.IntN(min(size, 3)+1)]
					perm := slices.Clone(avail)
					r.Shuffle(len(perm), func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
					got, err := p.Preferred(perm, must, size)
					if err != nil {
						t.Fatalf("%s per %d %s: %v", prof.Name, per, pol, err)
					}
					checkAnswer(t, got, avail, must, size)
				}
			}
		}
	}
}

func TestParsePolicy(t *testing.T) {
	for in, want := range map[string]Policy{"": PolicyTopology, "topology": PolicyTopology, "packed": PolicyPacked, "distributed": PolicyDistributed} {
		if got, err := ParsePolicy(in); err != nil || got != want {
			t.Errorf("ParsePolicy(%q) = %q, %v; want %q", in, got, err, want)
		}
	}
	if _, err := ParsePolicy("spread"); err == nil || !strings.Contains(err.Error(), `"spread"`) {
		t.Errorf("ParsePolicy(spread) err = %v", err)
	}
	if New(topotest.PCIe8GPU().Topology, "bogus").Policy() != PolicyTopology {
		t.Error("unknown policy is not treated as topology")
	}
}
