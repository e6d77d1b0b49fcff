package agent

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mps"
)

// setMPS is an MPS control whose daemons answer once they are set, as the
// supervisor's do once started.
type setMPS struct {
	mu      sync.Mutex
	daemons []mps.Daemon
}

func (f *setMPS) Set(d []mps.Daemon) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.daemons = slices.Clone(d)
	return nil
}

func (f *setMPS) Healthy(device string) (bool, string) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, d := range f.daemons {
		if d.Device == device {
			return true, ""
		}
	}
	return false, "no mps daemon for this device"
}

func (f *setMPS) daemon(device string) (mps.Daemon, bool) {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, d := range f.daemons {
		if d.Device == device {
			return d, true
		}
	}
	return mps.Daemon{}, false
}

// slicer records the time slices set.
type slicer struct{ set []string }

func (s *slicer) SetInterval(uuid string, level int) error {
	s.set = append(s.set, fmt.Sprintf("%s=%d", uuid, level))
	return nil
}

// withConfig gives each of c's requests NVIDIA's opaque config raw, from
// the claim, applying to requests (none: all).
func withConfig(c dra.Claim, source resourceapi.AllocationConfigSource, raw string, requests ...string) dra.Claim {
	cfgs := []resourceapi.DeviceAllocationConfiguration{{Source: source, Requests: requests,
		DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{Driver: devicemodel.DriverName}}}}
	cfgs[0].Opaque.Parameters.Raw = []byte(raw)
	c.Configs = append(c.Configs, devicemodel.ConfigsOf(cfgs)...)
	for i := range c.Configs {
		c.Configs[i].Field = fmt.Sprintf("config[%d]", i)
	}
	return c
}

const (
	gpuMPS = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":` +
		`{"defaultActiveThreadPercentage":30,"defaultPinnedDeviceMemoryLimit":"2Gi","defaultPerDevicePinnedMemoryLimit":{"1":"3Gi"}}}}`
	gpuMPSPlain = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`
	gpuTS       = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing"}}`
	gpuTSLong   = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Long"}}}`
	gpuTSShort  = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Short"}}}`
)

var fromClaim, fromClass = resourceapi.AllocationConfigSourceClaim, resourceapi.AllocationConfigSourceClass

// A claim whose config asks for MPS on GPUs the node's config does not
// share gets a daemon of its own on each, with the config's limits (the
// per-device one for the second device): Prepare first asks for the daemons
// and fails until they answer, then gives the containers the pipe directory
// and limits through the claim's CDI spec. The daemons survive a restart
// with the claim and go with it.
func TestDRAClaimConfigMPS(t *testing.T) {
	dir, state := t.TempDir(), t.TempDir()
	rec, ctl := &draRecorder{}, &setMPS{}
	node := simNode(t, "pcie-4gpu")
	h := newHarnessIn(t, node, state, withDRA(rec), withCDI(dir), func(h *harness) { h.opts.MPS = ctl })
	h.config(wholeGPUs)
	g1, _ := rec.last().Device("gpu-1")
	g2, _ := rec.last().Device("gpu-2")
	if g1.Shares > 1 || g1.MPS {
		t.Fatalf("gpu-1 %+v, want it unshared by the node's config", g1)
	}
	c := withConfig(claim("uid-m", "m", "gpu-1", "gpu-2"), fromClaim, gpuMPS)

	got := h.prepare(c)["uid-m"]
	if got.Err == nil || !strings.Contains(got.Err.Error(), "MPS control daemon is being started") {
		t.Fatalf("first Prepare: %+v, want it to wait for the daemon", got)
	}
	want := map[string]mps.Daemon{
		g1.UUID: {Device: g1.UUID, Index: 1, ActiveThreadPercentage: 30, PinnedMemLimitBytes: 2 << 30},
		g2.UUID: {Device: g2.UUID, Index: 2, ActiveThreadPercentage: 30, PinnedMemLimitBytes: 3 << 30},
	}
	// The first device's daemon is asked for; the claim fails there.
	if d, ok := ctl.daemon(g1.UUID); !ok || d != want[g1.UUID] {
		t.Fatalf("daemon of gpu-1: %+v (%v), want %+v", d, ok, want[g1.UUID])
	}
	got = h.prepare(c)["uid-m"]
	if got.Err == nil || !strings.Contains(got.Err.Error(), "gpu-2") {
		t.Fatalf("second Prepare: %+v, want it to wait for gpu-2's daemon", got)
	}
	got = h.prepare(c)["uid-m"]
	if got.Err != nil {
		t.Fatalf("Prepare once both daemons answer: %v", got.Err)
	}
	for i, dev := range []devicemodel.Device{g1, g2} {
		wantCDI := []string{dev.CDIDevice(), cdi.QualifiedName(cdi.ClaimDeviceName("uid-m", i))}
		if !slices.Equal(got.Devices[i].CDIDevices, wantCDI) {
			t.Errorf("%s: CDI devices %v, want %v", dev.Name, got.Devices[i].CDIDevices, wantCDI)
		}
	}
	spec := claimSpec(t, dir, "uid-m")
	if len(spec.Devices) != 2 {
		t.Fatalf("claim spec devices %+v, want one per GPU", spec.Devices)
	}
	for i, tt := range []struct {
		dev   devicemodel.Device
		limit string
	}{{g1, "0=2048M"}, {g2, "0=3072M"}} {
		want := []string{"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=30", "CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=" + tt.limit,
			"CUDA_MPS_PIPE_DIRECTORY=" + mps.PipeDir(h.opts.MPSRoot, tt.dev.UUID)}
		edits := spec.Devices[i].ContainerEdits
		if got := slices.Sorted(slices.Values(edits.Env)); !slices.Equal(got, want) {
			t.Errorf("%s client: env %v, want %v", tt.dev.Name, got, want)
		}
		if len(edits.Mounts) == 0 || edits.Mounts[0].ContainerPath != mps.PipeDir(h.opts.MPSRoot, tt.dev.UUID) {
			t.Errorf("%s client: mounts %+v, want its daemon's pipe directory", tt.dev.Name, edits.Mounts)
		}
	}
	for _, dev := range []devicemodel.Device{g1, g2} {
		if d, ok := ctl.daemon(dev.UUID); !ok || d != want[dev.UUID] {
			t.Errorf("daemon of %s: %+v (%v), want %+v", dev.Name, d, ok, want[dev.UUID])
		}
	}

	h2 := newHarnessIn(t, node, state, withDRA(&draRecorder{}), withCDI(dir), withCheckpoint(), func(h *harness) { h.opts.MPS = ctl })
	h2.config(wholeGPUs)
	if d, ok := ctl.daemon(g2.UUID); !ok || d != want[g2.UUID] {
		t.Errorf("after a restart, daemon of gpu-2: %+v (%v), want it kept for the claim", d, ok)
	}
	h2.unprepare(dra.ClaimRef{UID: "uid-m", Namespace: "default", Name: "m"})
	for _, dev := range []devicemodel.Device{g1, g2} {
		if d, ok := ctl.daemon(dev.UUID); ok {
			t.Errorf("after Unprepare, daemon of %s still wanted: %+v", dev.Name, d)
		}
	}
}

// A claim's MPS limits on a GPU the node's config shares by MPS replace
// those of its share in its containers' environment.
func TestDRAClaimConfigMPSOnSharedGPU(t *testing.T) {
	dir := t.TempDir()
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "pcie-4gpu"), withDRA(rec), withCDI(dir), withMPS(&fakeMPS{}))
	h.config("version: v1\nconfigs:\n  default:\n    sharing:\n      mps:\n        resources:\n        - name: nvidia.com/gpu\n          replicas: 4\n")
	c := withConfig(claim("uid-s", "s", "gpu-1"), fromClass,
		`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":10}}}`)
	c.Devices[0].ShareID = "share-s"
	if got := h.prepare(c)["uid-s"]; got.Err != nil {
		t.Fatal(got.Err)
	}
	env, _ := claimSpecEnv(t, dir, "uid-s")
	g1, _ := rec.last().Device("gpu-1")
	if env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] != "10" || env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] != fmt.Sprintf("0=%dM", g1.MemoryBytes/4>>20) {
		t.Errorf("env %v, want the config's 10%% and the share's memory", env)
	}
}

// Time-slicing: the interval is set on the GPU; claims sharing a GPU the
// node's config shares must agree on it; the claim's config beats the
// DeviceClass's.
func TestDRAClaimConfigTimeSlicing(t *testing.T) {
	rec, ts := &draRecorder{}, &slicer{}
	h := newHarness(t, simNode(t, "pcie-4gpu"), withDRA(rec), withMPS(&fakeMPS{}), func(h *harness) { h.opts.TimeSlice = ts })
	h.config(sliced2)
	g1, _ := rec.last().Device("gpu-1")
	shared := func(uid string) dra.Claim {
		c := claim(uid, uid, "gpu-1")
		c.Devices[0].ShareID = types.UID("share-" + uid)
		return c
	}
	// The class asks MPS, the claim time-slicing: the claim's wins.
	a := withConfig(withConfig(shared("uid-a"), fromClass, gpuMPS), fromClaim, gpuTSLong)
	if got := h.prepare(a)["uid-a"]; got.Err != nil {
		t.Fatal(got.Err)
	}
	if want := []string{g1.UUID + "=3"}; !slices.Equal(ts.set, want) {
		t.Errorf("time slices set %v, want %v", ts.set, want)
	}
	if got := h.prepare(withConfig(shared("uid-b"), fromClaim, gpuTSShort))["uid-b"]; got.Err == nil ||
		!strings.Contains(got.Err.Error(), "interval Short: ResourceClaim default/uid-a shares the GPU with interval Long") {
		t.Errorf("a claim asking another interval of the shared GPU: %+v", got)
	}
	if got := h.prepare(withConfig(shared("uid-c"), fromClaim, gpuTSLong))["uid-c"]; got.Err != nil {
		t.Errorf("a second claim asking the same interval: %v", got.Err)
	}
}

// What cannot be honoured fails Prepare, naming the config and field.
func TestDRAClaimConfigRefused(t *testing.T) {
	const mps200G = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultPinnedDeviceMemoryLimit":"200Gi"}}}`
	const mpsBadKey = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultPerDevicePinnedMemoryLimit":{"GPU-nope":"1Gi"}}}}`
	const bogus = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"activeThreads":5}}}`
	tests := []struct {
		name   string
		config string // the node's
		noMPS  bool
		noTS   bool
		claim  dra.Claim
		want   string
	}{
		{"MPS on a GPU the node time-slices", sliced2, false, false, withConfig(claim("u", "u", "gpu-1"), fromClaim, gpuMPSPlain),
			"device gpu-1: config[0]: sharing.strategy MPS: the node's config shares this device by time-slicing"},
		{"time-slicing on a GPU the node shares by MPS", "version: v1\nconfigs:\n  default:\n    sharing:\n      mps:\n        resources:\n        - name: nvidia.com/gpu\n          replicas: 2\n",
			false, false, withConfig(claim("u", "u", "gpu-1"), fromClaim, gpuTS), "sharing.strategy TimeSlicing: the node's config shares this device by MPS"},
		{"MPS without daemons", wholeGPUs, true, false, withConfig(claim("u", "u", "gpu-1"), fromClaim, gpuMPSPlain), "this agent runs no MPS control daemons"},
		{"an interval the agent cannot set", wholeGPUs, false, true, withConfig(claim("u", "u", "gpu-1"), fromClaim, gpuTSLong),
			"config[0]: sharing.timeSlicingConfig.interval Long: this agent cannot set a GPU's time slice"},
		{"a pinned limit above the GPU's memory", wholeGPUs, false, false, withConfig(claim("u", "u", "gpu-1"), fromClaim, mps200G),
			"config[0]: sharing.mpsConfig: pinned memory limit 204800Mi is above the device's"},
		{"a per-device limit naming no device", wholeGPUs, false, false, withConfig(claim("u", "u", "gpu-1"), fromClaim, mpsBadKey),
			`config[0]: sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit["GPU-nope"]`},
		{"an unknown field", wholeGPUs, false, false, withConfig(claim("u", "u", "gpu-1"), fromClaim, bogus),
			`request "gpu0": status.allocation.devices.config[0] (from the claim): opaque.parameters: kind GpuConfig: unknown field "sharing.mpsConfig.activeThreads"`},
		{"a config for another request is not read", wholeGPUs, true, true, withConfig(claim("u", "u", "gpu-1"), fromClaim, bogus, "other"), ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			opts := []harnessOption{withDRA(&draRecorder{}), withCDI(t.TempDir())}
			if !tt.noMPS {
				opts = append(opts, withMPS(&fakeMPS{}))
			}
			if !tt.noTS {
				opts = append(opts, func(h *harness) { h.opts.TimeSlice = &slicer{} })
			}
			h := newHarness(t, simNode(t, "pcie-4gpu"), opts...)
			h.config(tt.config)
			got := h.prepare(tt.claim)[tt.claim.UID]
			if tt.want == "" {
				if got.Err != nil {
					t.Fatal(got.Err)
				}
				return
			}
			if got.Err == nil || !strings.Contains(got.Err.Error(), tt.want) {
				t.Fatalf("Prepare: %+v, want an error containing %q", got, tt.want)
			}
			if len(h.a.ledger.Claims()) != 0 {
				t.Errorf("a refused claim is in the ledger")
			}
		})
	}
}

// claimSpec reads claim uid's CDI spec.
func claimSpec(t *testing.T, dir, uid string) specs.Spec {
	t.Helper()
	data, err := os.ReadFile(dir + "/" + cdi.ClaimSpecName(uid) + ".json")
	if err != nil {
		t.Fatalf("claim %s: %v", uid, err)
	}
	var s specs.Spec
	if err := json.Unmarshal(data, &s); err != nil {
		t.Fatal(err)
	}
	return s
}

// On MIG devices made on demand MPS is refused (its daemon could only start
// once the device exists), a GpuConfig naming a MIG request is refused, and
// a MigDeviceConfig asking time-slicing makes the device as usual.
func TestDRAClaimConfigOnDemandMIG(t *testing.T) {
	const migMPS = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"MigDeviceConfig","sharing":{"strategy":"MPS"}}`
	const migTS = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"MigDeviceConfig","sharing":{"strategy":"TimeSlicing"}}`
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange()), withDRA(&draRecorder{}), withMIG(), withCDI(t.TempDir()), withMPS(&fakeMPS{}))
	h.config(migOnDemand)
	tests := []struct {
		name  string
		claim dra.Claim
		want  string
	}{
		{"MPS", withConfig(claim("u1", "u1", "gpu-0-mig-3g40gb-4"), fromClaim, migMPS),
			"device gpu-0-mig-3g40gb-4: config[0]: sharing.strategy MPS: not on a MIG device made on demand"},
		{"a GpuConfig for the request", withConfig(claim("u2", "u2", "gpu-0-mig-3g40gb-4"), fromClaim, gpuMPSPlain, "gpu0"),
			`request "gpu0": config[0]: kind GpuConfig cannot apply to request "gpu0", a mig device (use MigDeviceConfig)`},
		{"time-slicing", withConfig(claim("u3", "u3", "gpu-0-mig-3g40gb-4"), fromClaim, migTS), ""},
	}
	for _, tt := range tests {
		got := h.prepare(tt.claim)[tt.claim.UID]
		if tt.want == "" {
			if got.Err != nil || !strings.HasPrefix(got.Devices[0].CDIDevices[0], "nvidia.com/gpu=MIG-") {
				t.Errorf("%s: %+v, want a MIG device made", tt.name, got)
			}
			continue
		}
		if got.Err == nil || !strings.Contains(got.Err.Error(), tt.want) {
			t.Errorf("%s: %+v, want an error containing %q", tt.name, got, tt.want)
		}
	}
}

// The same through the real MPS supervisor running the stand-in control
// program: the daemon started for the claim gets the config's limits as its
// defaults, and Prepare succeeds once it answers.
func TestDRAClaimConfigMPSDaemon(t *testing.T) {
	bin, args := mpsStandIn(t)
	root, err := os.MkdirTemp("", "mps") // unix socket paths are short; t.TempDir can be too long
	if err != nil {
		t.Fatal(err)
	}
	sup := mps.NewSupervisor(mps.Options{Binary: bin, Args: args, Root: root, StopTimeout: 5 * time.Second})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- sup.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		<-done
		if err := sup.StopAll(context.Background()); err != nil {
			t.Error(err)
		}
		os.RemoveAll(root)
	})

	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "pcie-4gpu"), withDRA(rec), withCDI(t.TempDir()), func(h *harness) { h.opts.MPS, h.opts.MPSRoot = sup, root })
	h.config(wholeGPUs)
	g1, _ := rec.last().Device("gpu-1")
	c := withConfig(claim("uid-d", "d", "gpu-1"), fromClaim, `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig",`+
		`"sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":30,"defaultPinnedDeviceMemoryLimit":"2Gi"}}}`)
	if got := h.prepare(c)["uid-d"]; got.Err == nil || !strings.Contains(got.Err.Error(), "MPS control daemon is being started") {
		t.Fatalf("Prepare before the daemon started: %+v", got)
	}
	deadline := time.After(30 * time.Second)
	for ok := false; !ok; ok, _ = sup.Healthy(g1.UUID) {
		select {
		case <-sup.Changes():
		case <-deadline:
			_, why := sup.Healthy(g1.UUID)
			t.Fatalf("the claim's daemon never answered: %s", why)
		}
	}
	if got := h.prepare(c)["uid-d"]; got.Err != nil {
		t.Fatalf("Prepare once the daemon answers: %v", got.Err)
	}
	cmds, err := os.ReadFile(filepath.Join(mps.LogDir(root, g1.UUID), "control.log"))
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"set_default_active_thread_percentage 30", "set_default_device_pinned_mem_limit 0 2048M"} {
		if !strings.Contains(string(cmds), want) {
			t.Errorf("the daemon's commands %q lack %q", cmds, want)
		}
	}
}
