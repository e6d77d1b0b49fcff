package agent

import (
	"errors"
	"fmt"
	"maps"
	"strings"
	"sync"
	"testing"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/kube"
)

// cluster records what the agent tells the API side.
type cluster struct {
	mu     sync.Mutex
	labels map[string]string
	events []string // "Warning Reason: message"
}

func (c *cluster) SetLabels(l map[string]string) {
	c.mu.Lock()
	c.labels = maps.Clone(l)
	c.mu.Unlock()
}

func (c *cluster) Event(warning bool, reason, message string) {
	typ := "Normal"
	if warning {
		typ = "Warning"
	}
	c.mu.Lock()
	c.events = append(c.events, fmt.Sprintf("%s %s: %s", typ, reason, message))
	c.mu.Unlock()
}

func (c *cluster) State() kube.State { return kube.State{API: kube.APIReachable} }

// took returns the events recorded since the last call.
func (c *cluster) took() []string {
	c.mu.Lock()
	defer c.mu.Unlock()
	ev := c.events
	c.events = nil
	return ev
}

func withCluster(c *cluster) harnessOption { return func(h *harness) { h.opts.Cluster = c } }

func TestNodeLabels(t *testing.T) {
	tests := []struct {
		name    string
		profile string
		opts    []sim.Option
		config  string
		want    map[string]string // a subset that must match
		absent  []string
	}{
		{name: "whole A100s", profile: "dgx-a100", config: wholeGPUs, want: map[string]string{
			LabelPresent: "true", LabelProduct: "NVIDIA-A100-SXM4-40GB", LabelCount: "8", LabelMemory: "40960",
			LabelFamily: "ampere", LabelComputeMajor: "8", LabelComputeMinor: "0", LabelMIGCapable: "true",
			LabelMIGStrategy: "none", LabelSharing: "none", LabelReplicas: "1", LabelMPSCapable: "false",
			"nvidia.com/cuda.driver.major": "550", "nvidia.com/cuda.driver-version.full": "550.54.15",
		}, absent: []string{LabelMIGConfigState}},
		{name: "time-slicing shares the product", profile: "dgx-a100", config: sliced2, want: map[string]string{
			LabelProduct: "NVIDIA-A100-SXM4-40GB-SHARED", LabelSharing: "time-slicing", LabelReplicas: "2",
		}},
		{name: "renamed replicas keep the product", profile: "dgx-a100",
			config: "version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        resources:\n        - name: nvidia.com/gpu\n          rename: nvidia.com/gpu.shared\n          replicas: 4\n",
			want:   map[string]string{LabelProduct: "NVIDIA-A100-SXM4-40GB", LabelReplicas: "4"}},
		{name: "V100 has no MIG", profile: "dgx1-v100", config: wholeGPUs, want: map[string]string{
			LabelFamily: "volta", LabelMIGCapable: "false"}, absent: []string{LabelMIGStrategy}},
		{name: "mixed MIG: per-profile counts", profile: "dgx-h100-mig", config: mixedNoMIG, want: map[string]string{
			LabelMIGStrategy: "mixed", "nvidia.com/mig-1g.10gb.count": "56", "nvidia.com/mig-1g.10gb.slices.gi": "1",
			LabelFamily: "hopper", LabelProduct: "NVIDIA-H100-80GB-HBM3"}},
		{name: "single MIG: the GPU labels describe the MIG devices", profile: "dgx-h100-mig",
			config: "version: v1\nconfigs:\n  default:\n    mig:\n      strategy: single\n", want: map[string]string{
				LabelMIGStrategy: "single", LabelCount: "56", LabelProduct: "NVIDIA-H100-80GB-HBM3-MIG-1g.10gb"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := &cluster{}
			h := newHarness(t, simNode(t, tt.profile, tt.opts...), withCluster(c))
			h.config(tt.config)
			for k, v := range tt.want {
				if c.labels[k] != v {
					t.Errorf("%s=%q, want %q", k, c.labels[k], v)
				}
			}
			for _, k := range tt.absent {
				if v, ok := c.labels[k]; ok {
					t.Errorf("%s=%q, want no such label", k, v)
				}
			}
			for k, v := range c.labels {
				if len(v) > 63 || strings.ContainsAny(v, " +/") {
					t.Errorf("%s=%q is not a valid label value", k, v)
				}
			}
		})
	}
}

// mig.config.state follows mig-manager's meaning: pending while a GPU waits,
// success once every GPU has the layout.
func TestMIGConfigStateLabelAndEvents(t *testing.T) {
	c := &cluster{}
	h := newHarness(t, simNode(t, "dgx-h100-mig"), withMIG(), withCluster(c))
	h.config(mixedNoMIG)
	if _, ok := c.labels[LabelMIGConfigState]; ok {
		t.Errorf("mig.config.state without a layout: %v", c.labels[LabelMIGConfigState])
	}
	victim := h.pub.last().Resources["nvidia.com/mig-1g.10gb"].Devices[0]
	h.hold.hold("nvidia.com/mig-1g.10gb", victim.ID)
	c.took()
	h.config(mixedLayout(`{"7g.80gb": 1}`))
	if got := c.labels[LabelMIGConfigState]; got != MIGConfigPending {
		t.Errorf("one GPU held: mig.config.state=%q, want pending", got)
	}
	ev := strings.Join(c.took(), "\n")
	if strings.Count(ev, "Normal "+ReasonMIGApplied) != 7 || !strings.Contains(ev, "Normal "+ReasonMIGPending) || !strings.Contains(ev, "ml/trainer") {
		t.Errorf("events:\n%s\nwant 7 MIGApplied and a MIGPending naming the holder", ev)
	}
	h.step(HoldingsChanged{Attribution: h.hold.hold("nvidia.com/mig-1g.10gb")})
	if got := c.labels[LabelMIGConfigState]; got != MIGConfigSuccess {
		t.Errorf("released: mig.config.state=%q, want success", got)
	}
	// Repeating the same state says nothing new.
	c.took()
	h.step(Tick{})
	if ev := c.took(); len(ev) != 0 {
		t.Errorf("a resync with nothing new recorded events: %v", ev)
	}
}

// Events: a rejected config, a GPU turning unhealthy and recovering, once each.
func TestClusterEvents(t *testing.T) {
	c := &cluster{}
	h := newHarness(t, simNode(t, "pcie-4gpu"), withCluster(c))
	h.config(wholeGPUs)
	c.took()
	h.config(badField)
	h.config(badField) // the same error again: no second Event
	if ev := c.took(); len(ev) != 1 || !strings.HasPrefix(ev[0], "Warning "+ReasonConfigRejected) || !strings.Contains(ev[0], "passDeviceSpec") {
		t.Errorf("events %v, want one GPUConfigRejected naming the field", ev)
	}
	sick := findGPU(h, 1).ID
	h.step(HealthChanged{State: xidState(sick, 48)})
	h.step(Tick{})
	if ev := c.took(); len(ev) != 1 || !strings.HasPrefix(ev[0], "Warning "+ReasonGPUUnhealthy) || !strings.Contains(ev[0], sick) {
		t.Errorf("events %v, want one GPUUnhealthy for %s", ev, sick)
	}
	h.step(HealthChanged{State: health.RestoredState(nil, "")})
	if ev := c.took(); len(ev) != 1 || !strings.HasPrefix(ev[0], "Normal "+ReasonGPURecovered) {
		t.Errorf("events %v, want one GPURecovered", ev)
	}
	if st := h.a.Status(); st.Cluster.API != kube.APIReachable || st.Cluster.ConfigMap != nil {
		t.Errorf("status cluster %+v, want the publisher's state and no ConfigMap", st.Cluster)
	}
}

// Without an API the status says so.
func TestStandaloneStatus(t *testing.T) {
	h := newHarness(t, simNode(t, "pcie-4gpu"))
	h.config(wholeGPUs)
	if st := h.a.Status(); st.Cluster.API != kube.APIStandalone || st.Cluster.Labels != nil || st.Cluster.ConfigMap != nil {
		t.Errorf("status cluster %+v, want standalone", st.Cluster)
	}
}

// With the ConfigMap read through the API and mounted as a file, the API's
// content wins; when the ConfigMap is deleted the file takes over again.
// /status names the source in force and says why the ConfigMap is not.
func TestConfigSourcePrecedence(t *testing.T) {
	h := newHarness(t, simNode(t, "pcie-4gpu"), withCluster(&cluster{}), func(h *harness) { h.opts.ConfigMap = "gpu-agent/cfg" })
	file := func(y string) Event { return ConfigChanged{Update: config.Update{Data: []byte(y)}} }
	api := func(y string) Event { return ConfigChanged{Update: config.Update{Data: []byte(y)}, Source: SourceAPI} }
	const fromAPI = "ConfigMap gpu-agent/cfg (API)"
	steps := []struct {
		name   string
		ev     Event
		gpus   int // nvidia.com/gpu devices offered after
		source string
		reason string // why the ConfigMap is not in force ("": it is)
	}{
		{"the mounted file first", file(wholeGPUs), 4, "test.yaml", "no content read through the API (the ConfigMap is absent, or the API has not answered); the mounted file test.yaml serves"},
		{"the API wins", api(sliced2), 8, fromAPI, ""},
		{"a file edit does not override the API", file(wholeGPUs + "# edited\n"), 8, fromAPI, ""},
		{"the ConfigMap cannot be read: the file serves", ConfigChanged{Update: config.Update{Err: errors.New("too big")}, Source: SourceAPI}, 4, "test.yaml",
			"unreadable: too big; the mounted file test.yaml serves"},
		{"the API again", api(sliced2), 8, fromAPI, ""},
		{"the ConfigMap is deleted: back to the file", ConfigChanged{Source: SourceAPI}, 4, "test.yaml", "no content read through the API"},
	}
	for _, s := range steps {
		h.step(s.ev)
		if got := h.count(ResourceGPU); got != s.gpus {
			t.Errorf("%s: %d devices, want %d", s.name, got, s.gpus)
		}
		st := h.a.Status()
		if st.Config.Source != s.source {
			t.Errorf("%s: config source %q, want %q", s.name, st.Config.Source, s.source)
		}
		cm := st.Cluster.ConfigMap
		if cm == nil || cm.Name != "gpu-agent/cfg" || cm.InForce != (s.reason == "") || !strings.HasPrefix(cm.Reason, s.reason) || (s.reason == "") != (cm.Reason == "") {
			t.Errorf("%s: cluster.configMap %+v, want in force %v, reason %q", s.name, cm, s.reason == "", s.reason)
		}
	}
}

// With the ConfigMap as the only source, /status says what serves while its
// content is missing or unreadable.
func TestConfigMapOnlyStatus(t *testing.T) {
	h := newHarness(t, simNode(t, "pcie-4gpu"), withCluster(&cluster{}), func(h *harness) { h.opts.ConfigMap, h.opts.ConfigSource = "gpu-agent/cfg", "" })
	steps := []struct {
		name   string
		ev     Event
		reason string // "": in force
	}{
		{"nothing read yet", Tick{}, "no content read through the API (the ConfigMap is absent, or the API has not answered); nothing is served until a config arrives"},
		{"read", ConfigChanged{Update: config.Update{Data: []byte(sliced2)}, Source: SourceAPI}, ""},
		{"unreadable later: the config in force stays", ConfigChanged{Update: config.Update{Err: errors.New("too big")}, Source: SourceAPI},
			`unreadable: too big; config "default" (generation 1) stays in force`},
	}
	for _, s := range steps {
		h.step(s.ev)
		cm := h.a.Status().Cluster.ConfigMap
		if cm == nil || cm.InForce != (s.reason == "") || cm.Reason != s.reason {
			t.Errorf("%s: cluster.configMap %+v, want reason %q", s.name, cm, s.reason)
		}
	}
}

// A mig-parted file as the GPU Operator ships it, mounted as is: without a
// label the node serves its whole GPUs; labelling it
// nvidia.com/mig.config=<entry> repartitions it, in one step.
func TestStepMIGConfigLabel(t *testing.T) {
	const migParted = "version: v1\nmig-configs:\n  all-disabled:\n  - devices: all\n    mig-enabled: false\n" +
		"  all-1g.10gb:\n  - device-filter: [\"0x233010DE\"]\n    devices: all\n    mig-enabled: true\n    mig-devices: {\"1g.10gb\": 7}\n"
	c := &cluster{}
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithMIGEnabled()), withMIG(), withCluster(c))
	h.config(migParted)
	if h.a.Status().Config.Error != "" {
		t.Fatalf("status %+v", h.a.Status().Config)
	}
	passes := h.a.PlanPasses()
	h.step(LabelsChanged{Labels: map[string]string{"nvidia.com/mig.config": "all-1g.10gb"}})
	if n := h.count("nvidia.com/mig-1g.10gb"); n != 56 {
		t.Fatalf("after the label: %v, want 56 1g.10gb", resourceSummary(h.pub.last()))
	}
	if got := c.labels[LabelMIGConfigState]; got != MIGConfigSuccess {
		t.Errorf("mig.config.state=%q, want success", got)
	}
	if p := h.a.PlanPasses() - passes; p > 2 {
		t.Errorf("%d plan passes for one label change, want at most 2 (plan, apply, plan)", p)
	}
	h.step(LabelsChanged{Labels: map[string]string{"nvidia.com/mig.config": "all-2g"}})
	if st := h.a.Status(); !strings.Contains(st.Config.Error, "all-2g") || h.count("nvidia.com/mig-1g.10gb") != 56 {
		t.Errorf("an unknown entry: error %q, %d devices; want the error named and the layout kept", st.Config.Error, h.count("nvidia.com/mig-1g.10gb"))
	}
}

// Defect (found in review): a change of nvidia.com/mig.config alone did not
// replan (the selection was compared by config pointer), and a label error
// stayed on /status after the label was fixed.
func TestStepMIGLabelAloneReplans(t *testing.T) {
	const file = "version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\nmig-configs:\n" +
		"  all-1g:\n  - devices: all\n    mig-enabled: true\n    mig-devices: {\"1g.10gb\": 7}\n" +
		"  all-7g:\n  - devices: all\n    mig-enabled: true\n    mig-devices: {\"7g.80gb\": 1}\n"
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithMIGEnabled()), withMIG())
	h.config(file)
	h.step(LabelsChanged{Labels: map[string]string{"nvidia.com/mig.config": "all-1g"}})
	if n := h.count("nvidia.com/mig-1g.10gb"); n != 56 {
		t.Fatalf("all-1g: %v", resourceSummary(h.pub.last()))
	}
	h.step(LabelsChanged{Labels: map[string]string{"nvidia.com/mig.config": "all-7g"}})
	if n := h.count("nvidia.com/mig-7g.80gb"); n != 8 {
		t.Fatalf("all-7g: %v", resourceSummary(h.pub.last()))
	}
	h.step(LabelsChanged{Labels: map[string]string{"nvidia.com/mig.config": "all-2g"}})
	if !strings.Contains(h.a.Status().Config.Error, "all-2g") {
		t.Fatalf("unknown entry: status error %q", h.a.Status().Config.Error)
	}
	h.step(LabelsChanged{Labels: map[string]string{"nvidia.com/mig.config": "all-7g"}})
	if e := h.a.Status().Config.Error; e != "" {
		t.Errorf("label fixed, status still says %q", e)
	}
}
