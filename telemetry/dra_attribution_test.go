package telemetry

import (
	"slices"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu/simtest"
	"github.com/gpu-agent/gpu-agent/podresources"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// draPod is a pod whose container holds the given devices of one claim
// (driver gpu.nvidia.com, pool node-1).
func draPod(ns, name, container, claim string, devices ...string) *podresourcesv1.PodResources {
	dr := &podresourcesv1.DynamicResource{ClaimName: claim, ClaimNamespace: ns}
	for _, d := range devices {
		dr.ClaimResources = append(dr.ClaimResources, &podresourcesv1.ClaimResource{DriverName: "gpu.nvidia.com", PoolName: "node-1", DeviceName: d})
	}
	return &podresourcesv1.PodResources{Namespace: ns, Name: name, Containers: []*podresourcesv1.ContainerResources{{
		Name: container, DynamicResources: []*podresourcesv1.DynamicResource{dr},
	}}}
}

// fixedDRA resolves "<claim namespace>/<claim>/<device>" of gpu.nvidia.com
// in pool node-1.
type fixedDRA map[string]DRADevice

func (f fixedDRA) DRADevice(h podresources.DRAHold) (DRADevice, bool) {
	if h.Driver != "gpu.nvidia.com" || h.Pool != "node-1" {
		return DRADevice{}, false
	}
	d, ok := f[h.ClaimNamespace+"/"+h.ClaimName+"/"+h.Device]
	return d, ok
}

func TestCollectorLabelsDRAHolders(t *testing.T) {
	clk := simtest.NewClock()
	n, inv := goldenNode(t, clk, nil)
	s := newSampler(n, clk)
	s.SetInventory(inv)
	s.Sample()
	g1, mig := inv.GPUs[1], inv.GPUs[0].Instances[0]
	src := fixedDRA{
		"ml/whole/gpu-1":      {UUID: g1.UUID},
		"ml/share-a/gpu-1":    {UUID: g1.UUID},
		"ml/share-b/gpu-1":    {UUID: g1.UUID},
		"ml/mig/gpu-0-mig-x":  {UUID: mig.UUID, MIGProfile: mig.Profile},
		"ml/unmade/gpu-0-p-0": {}, // a MIG device not made yet
	}
	gi := itoa(mig.GI)
	tests := []struct {
		name   string
		pods   []*podresourcesv1.PodResources
		filter string   // series of DCGM_FI_DEV_FB_USED with this label
		want   []string // their holder labels, in holderLabelNames' order
	}{
		{"a whole GPU", []*podresourcesv1.PodResources{draPod("ml", "p", "c", "whole", "gpu-1")}, `gpu="1"`,
			[]string{"c ml p whole ml gpu.nvidia.com node-1 gpu-1 - -"}},
		{"a shared GPU has a series per claim", []*podresourcesv1.PodResources{
			draPod("ml", "pb", "c", "share-b", "gpu-1"), draPod("ml", "pa", "c", "share-a", "gpu-1")}, `gpu="1"`,
			[]string{"c ml pa share-a ml gpu.nvidia.com node-1 gpu-1 - -", "c ml pb share-b ml gpu.nvidia.com node-1 gpu-1 - -"}},
		{"a MIG device names its profile and UUID", []*podresourcesv1.PodResources{draPod("ml", "p", "c", "mig", "gpu-0-mig-x")}, `GPU_I_ID="` + gi + `"`,
			[]string{"c ml p mig ml gpu.nvidia.com node-1 gpu-0-mig-x " + mig.Profile + " " + mig.UUID}},
		{"device plugin and DRA holders side by side", []*podresourcesv1.PodResources{
			pod("web", "dp", "s", "nvidia.com/gpu", g1.UUID), draPod("ml", "p", "c", "whole", "gpu-1")}, `gpu="1"`,
			[]string{"c ml p whole ml gpu.nvidia.com node-1 gpu-1 - -", "s web dp - - - - - - -"}},
		{"a claim the agent did not prepare", []*podresourcesv1.PodResources{draPod("ml", "p", "c", "stranger", "gpu-1")}, `gpu="1"`,
			[]string{"- - - - - - - - - -"}},
		{"a MIG device not made yet", []*podresourcesv1.PodResources{draPod("ml", "p", "c", "unmade", "gpu-0-p-0")}, `GPU_I_ID="` + gi + `"`,
			[]string{"- - - - - - - - - -"}},
		{"another pool", func() []*podresourcesv1.PodResources {
			p := draPod("ml", "p", "c", "whole", "gpu-1")
			p.Containers[0].DynamicResources[0].ClaimResources[0].PoolName = "node-2"
			return []*podresourcesv1.PodResources{p}
		}(), `gpu="1"`, []string{"- - - - - - - - - -"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := NewCollector(CollectorOptions{Samples: s, Attribution: fixedAttribution{podresources.NewAttribution(tt.pods, podresources.IsGPUResource)}, DRA: src})
			out := scrape(t, c, nil) // fails on duplicate series
			var got []string
			for _, l := range strings.Split(out, "\n") {
				if !strings.HasPrefix(l, "DCGM_FI_DEV_FB_USED{") || !strings.Contains(l, tt.filter) {
					continue
				}
				var vals []string
				for _, name := range holderLabelNames {
					_, rest, _ := strings.Cut(l, ","+name+`="`)
					if strings.HasPrefix(l, "DCGM_FI_DEV_FB_USED{"+name+`="`) {
						_, rest, _ = strings.Cut(l, "{"+name+`="`)
					}
					v, _, _ := strings.Cut(rest, `"`)
					vals = append(vals, cmpOr(v, "-"))
				}
				got = append(got, strings.Join(vals, " "))
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("holders of the series:\n got %q\nwant %q", got, tt.want)
			}
		})
	}
}

func cmpOr(v, empty string) string {
	if v == "" {
		return empty
	}
	return v
}
