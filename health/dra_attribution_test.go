package health

import (
	"slices"
	"strings"
	"testing"

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

func TestAttributionReadsDynamicResources(t *testing.T) {
	dp := pod("ml", "plugin", "c", "nvidia.com/gpu", "GPU-a")
	twice := draPod("ml", "p", "c", "claim", "gpu-0", "gpu-0") // two requests, one device
	other := draPod("ml", "nic", "c", "nic-claim", "eth0")
	other.Containers[0].DynamicResources[0].ClaimResources[0].DriverName = "nic.example.com"
	tests := []struct {
		name string
		pods []*podresourcesv1.PodResources
		want []string // "container pod claim driver/pool/device"
	}{
		{"none", []*podresourcesv1.PodResources{dp}, nil},
		{"one claim, two devices", []*podresourcesv1.PodResources{draPod("ml", "p", "c", "claim", "gpu-1", "gpu-0")},
			[]string{"c p ml/claim gpu.nvidia.com/node-1/gpu-0", "c p ml/claim gpu.nvidia.com/node-1/gpu-1"}},
		{"a device twice in a claim is listed once", []*podresourcesv1.PodResources{twice}, []string{"c p ml/claim gpu.nvidia.com/node-1/gpu-0"}},
		{"two claims of a shared device", []*podresourcesv1.PodResources{draPod("ml", "a", "c", "ca", "gpu-0"), draPod("ml", "b", "c", "cb", "gpu-0")},
			[]string{"c a ml/ca gpu.nvidia.com/node-1/gpu-0", "c b ml/cb gpu.nvidia.com/node-1/gpu-0"}},
		{"every driver is listed", []*podresourcesv1.PodResources{other}, []string{"c nic ml/nic-claim nic.example.com/node-1/eth0"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			a := NewAttribution(append([]*podresourcesv1.PodResources{dp}, tt.pods...), IsGPUResource)
			var got []string
			for _, h := range a.DRAHolds() {
				got = append(got, strings.Join([]string{h.Container, h.Pod, h.ClaimNamespace + "/" + h.ClaimName, h.Driver + "/" + h.Pool + "/" + h.Device}, " "))
			}
			if !slices.Equal(got, tt.want) {
				t.Errorf("DRAHolds = %q, want %q", got, tt.want)
			}
			// Claims are the ledger's business through Prepare: what the
			// ledger reads of an attribution is the device plugin's only.
			plain := NewAttribution([]*podresourcesv1.PodResources{dp}, IsGPUResource)
			if !a.Same(plain) || len(a.Holders("gpu-0")) != 0 || a.Held("GPU-a") != 1 || len(a.Allocations()) != 1 {
				t.Errorf("DRA holdings changed the device plugin's view: same %v, allocations %v", a.Same(plain), a.Allocations())
			}
		})
	}
}

// fixedDRA resolves "<claim namespace>/<claim>/<device>" of gpu.nvidia.com
// in pool node-1.
type fixedDRA map[string]DRADevice

func (f fixedDRA) DRADevice(h DRAHold) (DRADevice, bool) {
	if h.Driver != "gpu.nvidia.com" || h.Pool != "node-1" {
		return DRADevice{}, false
	}
	d, ok := f[h.ClaimNamespace+"/"+h.ClaimName+"/"+h.Device]
	return d, ok
}

func TestCollectorLabelsDRAHolders(t *testing.T) {
	clk := newClock()
	n, inv := goldenNode(t, clk)
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
			c := NewCollector(CollectorOptions{Samples: s, Attribution: fixedAttribution{NewAttribution(tt.pods, IsGPUResource)}, DRA: src})
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
