package main

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
	"sigs.k8s.io/yaml"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

// driverName is the DRA driver gpu-agent publishes as.
const driverName = "gpu.nvidia.com"

// baselineModel is measured in every run: the default model's whole GPUs alone, without counters, which is
// what a node publishing 8 plain GPUs looks like to the scheduler (derived, see wholeGPUsOnly).
const baselineModel = "whole-gpus-only"

// baselineAgain is the baseline measured a second time, after every model of a fleet size.
const baselineAgain = baselineModel + "-again"

// model is one way a node's agent is configured: the config file it is given (none: the built-in default).
type model struct {
	Name string
	// Manifest is the ConfigMap manifest (deploy/examples) whose config.yaml the agent reads; "" runs the
	// agent without --config.
	Manifest string
}

// template is what one agent published for its node: the slices every fleet node gets a copy of.
type template struct {
	Model  string
	Slices []resourceapi.ResourceSlice
	// Derived says how the slices were made when no agent published them as they are.
	Derived string
}

// stats are a node's devices and counters as its slices offer them.
type stats struct {
	Slices, Devices, CounterSets, Counters int
	// MaxCounters is the most counters one set holds.
	MaxCounters int
}

func (t template) stats() stats {
	var s stats
	for _, sl := range t.Slices {
		s.Slices++
		s.Devices += len(sl.Spec.Devices)
		s.CounterSets += len(sl.Spec.SharedCounters)
		for _, cs := range sl.Spec.SharedCounters {
			s.Counters += len(cs.Counters)
			s.MaxCounters = max(s.MaxCounters, len(cs.Counters))
		}
	}
	return s
}

// attr reads a device attribute of the driver's domain as a string (ints formatted), whether the slice names
// it qualified or not, as CEL's device.attributes['gpu.nvidia.com'] does.
func attr(d resourceapi.Device, name string) (string, bool) {
	for _, key := range []resourceapi.QualifiedName{resourceapi.QualifiedName(name), resourceapi.QualifiedName(driverName + "/" + name)} {
		v, ok := d.Attributes[key]
		if !ok {
			continue
		}
		switch {
		case v.StringValue != nil:
			return *v.StringValue, true
		case v.IntValue != nil:
			return fmt.Sprint(*v.IntValue), true
		case v.BoolValue != nil:
			return fmt.Sprint(*v.BoolValue), true
		case v.VersionValue != nil:
			return *v.VersionValue, true
		}
	}
	return "", false
}

// devices lists the template's devices.
func (t template) devices() []resourceapi.Device {
	var ds []resourceapi.Device
	for _, s := range t.Slices {
		ds = append(ds, s.Spec.Devices...)
	}
	return ds
}

// wholeGPUsOnly derives the baseline from the default model's slices: its devices of type gpu, without
// their consumption of counters, in one slice of a pool of one, and no counter sets. Derived rather than
// published by an agent configured for it, so that the one difference from the default model is the MIG
// placements and the counters.
func wholeGPUsOnly(def template) (template, error) {
	var gpus []resourceapi.Device
	for _, d := range def.devices() {
		if typ, _ := attr(d, "type"); typ == "gpu" {
			d = *d.DeepCopy()
			d.ConsumesCounters = nil
			gpus = append(gpus, d)
		}
	}
	if len(gpus) == 0 {
		return template{}, fmt.Errorf("%s: the default model's slices have no device of type gpu", baselineModel)
	}
	var first *resourceapi.ResourceSlice
	for i := range def.Slices {
		if len(def.Slices[i].Spec.Devices) > 0 {
			first = &def.Slices[i]
			break
		}
	}
	s := first.DeepCopy()
	s.Spec.Devices = gpus
	s.Spec.SharedCounters = nil
	s.Spec.Pool.Generation = 1
	s.Spec.Pool.ResourceSliceCount = 1
	return template{Model: baselineModel, Slices: []resourceapi.ResourceSlice{*s},
		Derived: "the default model's slices, its type=gpu devices only, without ConsumesCounters and counter sets"}, nil
}

// derivedModels are measured from another model's slices, changed, rather than from what an agent publishes:
// each names the model it is derived from (whose agent runs, measured or not) and how.
var derivedModels = map[string]struct {
	From   string
	Derive func(template) (template, error)
}{
	nvidiaShapeModel: {From: "static-mig", Derive: nvidiaShape},
}

// nvidiaShapeModel is static MIG's devices as NVIDIA's DRA driver shapes MIG devices (see nvidiaShape): what the
// same layout costs the scheduler with the driver gpu-agent replaces.
const nvidiaShapeModel = "static-mig-nvidia-shape"

// nvidiaShape derives from the static MIG model's slices the MIG devices NVIDIA's DRA driver
// (kubernetes-sigs/dra-driver-nvidia-gpu, cmd/gpu-kubelet-plugin) publishes for the same layout: the same
// attributes but index, which that driver no longer publishes, and beside the same capacities one
// memorySlice<i> capacity of 1 per memory slice the device's placement spans. gpu-agent's slices do not say
// where a device is placed: its number of memory slices is its memory over the smallest MIG device's of the
// node (1, 2 and 4 for an H100's 1g.10gb, 2g.20gb and 3g.40gb), laid end to end from slice 0 on each GPU in the
// slice's order. Which slices a device spans does not change what it costs the scheduler; how many does, as
// past 8 capacities its map doubles. Device names stay gpu-agent's (NVIDIA's are a few bytes longer).
func nvidiaShape(static template) (template, error) {
	var smallest int64
	for _, d := range static.devices() {
		if typ, _ := attr(d, "type"); typ != "mig" {
			continue
		}
		if m, ok := d.Capacity["memory"]; ok && (smallest == 0 || m.Value.Value() < smallest) {
			smallest = m.Value.Value()
		}
	}
	if smallest <= 0 {
		return template{}, fmt.Errorf("%s: the static-mig model's slices have no MIG device with memory", nvidiaShapeModel)
	}
	next := map[string]int{} // the next free memory slice of each GPU, by parentUUID
	out := template{Model: nvidiaShapeModel,
		Derived: "static-mig's slices, each MIG device without index and with one memorySlice<i> capacity per memory slice it spans, as NVIDIA's DRA driver publishes MIG devices"}
	for _, s := range static.Slices {
		s := *s.DeepCopy()
		for i := range s.Spec.Devices {
			d := &s.Spec.Devices[i]
			if typ, _ := attr(*d, "type"); typ != "mig" {
				continue
			}
			delete(d.Attributes, "index")
			delete(d.Attributes, driverName+"/index")
			parent, _ := attr(*d, "parentUUID")
			m := d.Capacity["memory"]
			n := max(1, int((m.Value.Value()+smallest/2)/smallest))
			for k := range n {
				d.Capacity[resourceapi.QualifiedName(fmt.Sprintf("memorySlice%d", next[parent]+k))] = resourceapi.DeviceCapacity{Value: *resource.NewQuantity(1, resource.BinarySI)}
			}
			next[parent] += n
		}
		out.Slices = append(out.Slices, s)
	}
	return out, nil
}

// configFromManifest writes the config.yaml key of a ConfigMap manifest (deploy/examples holds such files) to
// dir and returns its path: `gpu-agent run --config` reads a config file, the ConfigMap's mounted key, not a
// manifest.
func configFromManifest(manifest, dir string) (string, error) {
	b, err := os.ReadFile(manifest)
	if err != nil {
		return "", err
	}
	var cm corev1.ConfigMap
	if err := yaml.UnmarshalStrict(b, &cm); err != nil {
		return "", fmt.Errorf("%s: not a ConfigMap manifest: %w", manifest, err)
	}
	if cm.Kind != "ConfigMap" {
		return "", fmt.Errorf("%s: kind %q, want ConfigMap", manifest, cm.Kind)
	}
	cfg, ok := cm.Data["config.yaml"]
	if !ok {
		return "", fmt.Errorf("%s: no data key config.yaml (the key the DaemonSet mounts)", manifest)
	}
	path := filepath.Join(dir, "config.yaml")
	return path, os.WriteFile(path, []byte(cfg), 0o644)
}

// agentRun is what running the agent for a template needs.
type agentRun struct {
	Agent   string // gpu-agent binary
	Backend string // e.g. sim:dgx-h100
	Dir     string // the agent's own directory of this run
	// Kubeconfig reaches the API server as an admin: the agent's own RBAC and admission policy are not what
	// is measured.
	Kubeconfig string
	Settle     time.Duration // how long the slices must stay unchanged
	Timeout    time.Duration
	Logf       func(string, ...any)
}

// publishedSlices runs gpu-agent with --dra for one Node it creates, as the DaemonSet runs it (every path
// moved into the run's directory), waits until the node's ResourceSlices form a complete pool and stay
// unchanged for Settle, stops the agent and returns them.
func publishedSlices(ctx context.Context, cs kubernetes.Interface, m model, nodeName string, r agentRun) (template, error) {
	ctx, cancel := context.WithTimeout(ctx, r.Timeout)
	defer cancel()
	dir := filepath.Join(r.Dir, m.Name)
	for _, d := range []string{"device-plugins", "pod-resources", "state", "mps", "cdi", "plugins/" + driverName, "plugins_registry"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return template{}, fmt.Errorf("agent for %s: %w", m.Name, err)
		}
	}
	if _, err := createNode(ctx, cs, nodeName); err != nil {
		return template{}, err
	}
	listen, err := freeAddr()
	if err != nil {
		return template{}, err
	}
	args := []string{r.Agent, "run", "--dra",
		"--kubeconfig", r.Kubeconfig,
		"--node-name", nodeName,
		// The simulated GPUs keep their state (MIG instances made for a layout) in a file of the run, and
		// change MIG mode at once: a real GPU waits for a reset (a node reboot) before a MIG layout applies,
		// and what a fleet publishes is the node after it.
		"--backend", r.Backend + ",immediate-mig-mode,state=" + filepath.Join(dir, "sim-state.json"),
		// No kubelet runs: the device plugin and pod-resources sockets are never answered, which the agent
		// logs and retries; its DRA driver publishes through the API server alone.
		"--device-plugin-dir", filepath.Join(dir, "device-plugins"),
		"--pod-resources-socket", filepath.Join(dir, "pod-resources", "kubelet.sock"),
		"--state-dir", filepath.Join(dir, "state"),
		"--mps-root", filepath.Join(dir, "mps"),
		"--cdi-spec-dir", filepath.Join(dir, "cdi"),
		"--dra-plugin-dir", filepath.Join(dir, "plugins", driverName),
		"--kubelet-registry-dir", filepath.Join(dir, "plugins_registry"),
		"--listen", listen,
		// A surplus spare GPU (migOnDemand.spareGPUs) closes at the first pass after its minute of grace.
		"--resync", "5s",
	}
	if m.Manifest != "" {
		cfg, err := configFromManifest(m.Manifest, dir)
		if err != nil {
			return template{}, fmt.Errorf("model %s: %w", m.Name, err)
		}
		args = append(args, "--config", cfg)
	}
	p, err := harness.StartProcess("gpu-agent", filepath.Join(dir, "gpu-agent.log"), nil, args...)
	if err != nil {
		return template{}, err
	}
	defer func() {
		if err := p.Stop(10 * time.Second); err != nil {
			r.Logf("model %s: %v", m.Name, err)
		}
	}()
	var last string
	var since time.Time
	var seen []resourceapi.ResourceSlice
	for {
		if done, werr := p.Exited(); done {
			return template{}, fmt.Errorf("model %s: gpu-agent exited: %v (see %s)", m.Name, werr, p.LogPath)
		}
		state, ss, err := poolState(ctx, cs, nodeName)
		switch {
		case err != nil:
			state = err.Error()
		case state != last:
			last, since = state, time.Now()
		case time.Since(since) >= r.Settle && !strings.HasPrefix(state, "!"):
			return template{Model: m.Name, Slices: ss}, nil
		}
		seen = ss
		select {
		case <-ctx.Done():
			return template{}, fmt.Errorf("model %s: the agent's ResourceSlices did not settle in %s (last: %d slices, %s; see %s)",
				m.Name, r.Timeout, len(seen), state, p.LogPath)
		case <-time.After(time.Second):
		}
	}
}

// poolState fingerprints a node's slices of the driver (names and resource versions) and the Node's MIG
// state label; a fingerprint starting with "!" is not final: no slice yet, an incomplete pool, or a MIG
// layout still being applied.
func poolState(ctx context.Context, cs kubernetes.Interface, nodeName string) (string, []resourceapi.ResourceSlice, error) {
	list, err := cs.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{
		FieldSelector: resourceapi.ResourceSliceSelectorNodeName + "=" + nodeName + "," + resourceapi.ResourceSliceSelectorDriver + "=" + driverName,
	})
	if err != nil {
		return "", nil, fmt.Errorf("list ResourceSlices of %s: %w", nodeName, err)
	}
	node, err := cs.CoreV1().Nodes().Get(ctx, nodeName, metav1.GetOptions{})
	if err != nil {
		return "", nil, fmt.Errorf("get Node %s: %w", nodeName, err)
	}
	ss := list.Items
	slices.SortFunc(ss, func(a, b resourceapi.ResourceSlice) int { return strings.Compare(a.Name, b.Name) })
	var parts []string
	var gen int64
	for _, s := range ss {
		parts = append(parts, s.Name+"@"+s.ResourceVersion)
		gen = max(gen, s.Spec.Pool.Generation)
	}
	fp := strings.Join(parts, ",")
	migState := node.Labels["nvidia.com/mig.config.state"]
	switch {
	case len(ss) == 0:
		return "!no slices", nil, nil
	case migState == "pending":
		return "!MIG layout pending:" + fp, ss, nil
	}
	var current []resourceapi.ResourceSlice
	for _, s := range ss {
		if s.Spec.Pool.Generation == gen {
			current = append(current, s)
		}
	}
	if int64(len(current)) != current[0].Spec.Pool.ResourceSliceCount || len(current) != len(ss) {
		return fmt.Sprintf("!pool generation %d: %d of %d slices (%d in all):%s", gen, len(current),
			current[0].Spec.Pool.ResourceSliceCount, len(ss), fp), ss, nil
	}
	for _, s := range ss {
		for _, d := range s.Spec.Devices {
			for _, t := range d.Taints {
				if t.Key == driverName+"/closing" {
					// A spare GPU closing (a minute after the agent's start): the node settles without it.
					return "!closing:" + fp, ss, nil
				}
			}
		}
	}
	return fp, ss, nil
}

// freeAddr is a free loopback address for the agent's HTTP server.
func freeAddr() (string, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return "", fmt.Errorf("free port: %w", err)
	}
	defer l.Close()
	return l.Addr().String(), nil
}
