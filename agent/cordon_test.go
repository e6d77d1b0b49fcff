package agent

import (
	"slices"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

func uuids(t *testing.T, h *harness) []string {
	t.Helper()
	inv, err := h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, g := range inv.GPUs {
		out = append(out, g.UUID)
	}
	return out
}

// What the annotation names, resolved against the GPUs the node knows: a
// UUID or a decimal index, each GPU once, a GPU kept unread included; the
// rest is unknown.
func TestSnapshotCordon(t *testing.T) {
	inv := &gpu.Inventory{GPUs: []gpu.GPU{{Index: 0, UUID: "GPU-a"}, {Index: 1, UUID: "GPU-b"}}}
	failed := map[string]FailedGPU{"GPU-c": {GPU: gpu.GPU{Index: 2, UUID: "GPU-c"}}}
	for _, tt := range []struct {
		name        string
		list        []string
		wantGPUs    []int
		wantUnknown []string
	}{
		{"none", nil, nil, nil},
		{"index", []string{"1"}, []int{1}, nil},
		{"uuid", []string{"GPU-a"}, []int{0}, nil},
		{"the same GPU twice", []string{"GPU-b", "1"}, []int{1}, nil},
		{"a GPU kept unread", []string{"2"}, []int{2}, nil},
		{"sorted by index", []string{"GPU-c", "0"}, []int{0, 2}, nil},
		{"unknown", []string{"7", "GPU-z", "01", "-0", " 1"}, nil, []string{"7", "GPU-z", "01", "-0", " 1"}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := Snapshot{Inventory: inv, Failed: failed, Cordoned: tt.list}.Cordon()
			var got []int
			for _, g := range c.GPUs {
				got = append(got, g.Index)
			}
			if !slices.Equal(got, tt.wantGPUs) || !slices.Equal(c.Unknown, tt.wantUnknown) {
				t.Errorf("GPUs %v unknown %q; want %v, %q", got, c.Unknown, tt.wantGPUs, tt.wantUnknown)
			}
		})
	}
}

// Cordoning GPUs withdraws all their devices from new work, through the
// device plugin and DRA, while a container that holds one keeps it; an
// entry naming no GPU is reported once; uncordoning brings them back.
func TestCordonWithdrawsAndRestores(t *testing.T) {
	c := &cluster{}
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "dgx-a100"), withCluster(c), withDRA(rec))
	h.config(sliced2)
	u := uuids(t, h)
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU, u[1]+"::0")})
	c.took()

	h.step(CordonChanged{GPUs: []string{"1", u[3], "GPU-nope"}})
	for _, d := range h.pub.last().Resources[ResourceGPU].Devices {
		cordoned := d.GPU == 1 || d.GPU == 3
		if cordoned != (!d.Healthy && d.Reason == ReasonCordoned) || !cordoned && !d.Healthy {
			t.Errorf("device %s on GPU %d: healthy %v (%s)", d.ID, d.GPU, d.Healthy, d.Reason)
		}
	}
	if _, ok := h.device(ResourceGPU, u[1]+"::0"); !ok {
		t.Errorf("the held replica is no longer advertised")
	}
	for _, d := range rec.last().Devices {
		cordoned := d.Index == 1 || d.Index == 3
		if cordoned != (d.Cordoned == ReasonCordoned) || d.Unhealthy != "" || d.Evict {
			t.Errorf("DRA device %s: cordoned %q, unhealthy %q, evict %v", d.Name, d.Cordoned, d.Unhealthy, d.Evict)
		}
	}
	st := h.a.Status().Cordon
	if st == nil || len(st.GPUs) != 2 || st.GPUs[0] != (CordonedGPU{Index: 1, UUID: u[1], As: "1"}) || st.GPUs[1].As != u[3] ||
		!slices.Equal(st.Unknown, []string{"GPU-nope"}) {
		t.Errorf("/status cordon %+v", st)
	}
	if ev := c.took(); len(ev) != 1 || !strings.Contains(ev[0], "Warning "+ReasonCordonUnknown) || !strings.Contains(ev[0], "GPU-nope") {
		t.Errorf("events %q; want one warning naming GPU-nope", ev)
	}

	// The same list again (a resync of the Node) is no news.
	passes := h.a.PlanPasses()
	h.step(CordonChanged{GPUs: []string{"1", u[3], "GPU-nope"}})
	h.step(Tick{})
	if ev := c.took(); len(ev) != 0 || h.a.PlanPasses()-passes != 1 {
		t.Errorf("the same annotation again: events %q, %d passes (want none, and 1 for the tick)", ev, h.a.PlanPasses()-passes)
	}

	h.step(CordonChanged{})
	for _, d := range h.pub.last().Resources[ResourceGPU].Devices {
		if !d.Healthy {
			t.Errorf("after uncordon, device %s is unhealthy: %s", d.ID, d.Reason)
		}
	}
	for _, d := range rec.last().Devices {
		if d.Unhealthy != "" || d.Cordoned != "" {
			t.Errorf("after uncordon, DRA device %s: unhealthy %q, cordoned %q", d.Name, d.Unhealthy, d.Cordoned)
		}
	}
	if st := h.a.Status().Cordon; st != nil {
		t.Errorf("after uncordon, /status cordon %+v", st)
	}
}

// A cordoned GPU keeps the layout it has: the config's layout is applied to
// the others, and to it once it is uncordoned.
func TestCordonHoldsMIGLayout(t *testing.T) {
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithMIGEnabled()), withMIG())
	h.step(CordonChanged{GPUs: []string{"2"}})
	h.config(mixedLayout(`{"1g.10gb": 7}`))
	if st := h.migState(2); st.Phase != mig.PhasePending || !strings.Contains(st.Reason, "cordoned") {
		t.Errorf("GPU 2's MIG state %+v; want pending, saying it is cordoned", st)
	}
	if st := h.migState(1); st.Phase != mig.PhaseApplied {
		t.Errorf("GPU 1's MIG state %+v; want applied", st)
	}
	if n := h.count("nvidia.com/mig-1g.10gb"); n != 49 {
		t.Errorf("%d 1g.10gb devices, want 49 (7 GPUs × 7)", n)
	}
	inv, err := h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	if n := len(inv.GPUs[2].Instances); n != 0 {
		t.Errorf("the cordoned GPU 2 got %d instances", n)
	}

	// Cordoning a GPU already at its layout changes nothing there.
	h.step(CordonChanged{GPUs: []string{"1", "2"}})
	if st := h.migState(1); st.Phase != mig.PhaseApplied {
		t.Errorf("GPU 1, cordoned at its layout: MIG state %+v; want applied", st)
	}
	h.step(CordonChanged{})
	if st := h.migState(2); st.Phase != mig.PhaseApplied {
		t.Errorf("after uncordon GPU 2's MIG state %+v; want applied", st)
	}
	if n := h.count("nvidia.com/mig-1g.10gb"); n != 56 {
		t.Errorf("after uncordon %d 1g.10gb devices, want 56", n)
	}
}

// DRA makes no MIG device on a cordoned GPU: its partitions are tainted and
// a claim the scheduler gave one before the cordon fails to prepare,
// leaving the GPU as it was.
func TestCordonDynamicMIG(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	h := newHarness(t, node, withDRA(rec), withMIG())
	h.config(migOnDemand)
	h.step(CordonChanged{GPUs: []string{"0"}})
	n := 0
	for _, d := range rec.last().Devices {
		on0 := d.ParentIndexOrSelf() == 0
		if on0 != (d.Cordoned == ReasonCordoned) || d.Unhealthy != "" {
			t.Errorf("DRA device %s: cordoned %q, unhealthy %q", d.Name, d.Cordoned, d.Unhealthy)
		}
		if on0 && d.Partition {
			n++
		}
	}
	if n != 19 {
		t.Errorf("%d of GPU 0's partitions tainted, want 19", n)
	}
	got := h.prepare(claim("uid-3g", "three", "gpu-0-mig-3g40gb-4"))["uid-3g"]
	if got.Err == nil || !strings.Contains(got.Err.Error(), "gpu-0-mig-3g40gb-4 is on GPU 0 (") || !strings.Contains(got.Err.Error(), devicemodel.TaintCordoned) {
		t.Errorf("claim of a cordoned GPU's partition: %+v; want refused naming the GPU and the cordon's taint", got)
	}
	inv, err := h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	if g := inv.GPUs[0]; g.MIG.Current || len(g.Instances) != 0 {
		t.Errorf("GPU 0 changed: MIG %v, instances %+v", g.MIG, g.Instances)
	}
	if got := h.prepare(claim("uid-3g1", "three", "gpu-1-mig-3g40gb-4"))["uid-3g1"]; got.Err != nil {
		t.Errorf("claim on GPU 1: %v", got.Err)
	}
}

// cordonedInPool reports whether the DRA pool withdraws d for a cordon.
func cordonedInPool(d devicemodel.Device) bool { return d.Cordoned != "" }

// A cordon outlives an agent restart (issue 29, defect 4a): the first
// catalog and DRA pool of the agent restarted on the same state dir
// withdraw the cordoned GPU before its Node watch has answered, and the
// watch's answer then replaces the list, here with none.
func TestCordonSurvivesRestart(t *testing.T) {
	node := simNode(t, "dgx-a100")
	dir := t.TempDir()
	h := newHarnessIn(t, node, dir, withDRA(&draRecorder{}))
	h.config(wholeGPUs)
	u := uuids(t, h)
	h.step(CordonChanged{GPUs: []string{"1", u[3]}})

	rec := &draRecorder{}
	h2 := newHarnessIn(t, node, dir, withDRA(rec), withCheckpoint())
	h2.config(wholeGPUs)
	if n := h2.pub.published(); n != 1 {
		t.Fatalf("%d catalogs after the config, want the first one", n)
	}
	for _, d := range h2.pub.last().Resources[ResourceGPU].Devices {
		cordoned := d.GPU == 1 || d.GPU == 3
		if cordoned != (!d.Healthy && d.Reason == ReasonCordoned) {
			t.Errorf("first catalog after a restart: GPU %d healthy %v (%q); cordoned %v", d.GPU, d.Healthy, d.Reason, cordoned)
		}
	}
	if p := rec.last(); p == nil {
		t.Fatal("no DRA pool after the config")
	} else {
		for _, d := range p.Devices {
			if cordoned := d.Index == 1 || d.Index == 3; cordoned != cordonedInPool(d) {
				t.Errorf("first DRA pool after a restart: %s cordoned %q; want %v", d.Name, d.Cordoned, cordoned)
			}
		}
	}
	if st := h2.a.Status().Cordon; st == nil || len(st.GPUs) != 2 {
		t.Errorf("/status cordon after a restart %+v, want GPUs 1 and 3", st)
	}

	// The Node watch answers: the annotation was removed meanwhile.
	h2.step(CordonChanged{})
	for _, d := range h2.pub.last().Resources[ResourceGPU].Devices {
		if !d.Healthy {
			t.Errorf("after the Node watch's answer, GPU %d is unhealthy: %s", d.GPU, d.Reason)
		}
	}
	for _, d := range rec.last().Devices {
		if cordonedInPool(d) {
			t.Errorf("after the Node watch's answer, DRA device %s is cordoned", d.Name)
		}
	}
	cp, err := LoadCheckpoint(dir)
	if err != nil || len(cp.Cordon) != 0 {
		t.Errorf("checkpoint after the uncordon: %+v (%v), want no cordon", cp, err)
	}
}

// tolerating is claim uid's allocation of device in node-a's pool, its
// request tolerating the taint keys given, as dra.ClaimOf reads it from
// the API.
func tolerating(uid, device string, admin bool, keys ...string) dra.Claim {
	r := resourceapi.DeviceRequestAllocationResult{Request: "gpu", Driver: devicemodel.DriverName, Pool: "node-a", Device: device, AdminAccess: &admin}
	for _, k := range keys {
		r.Tolerations = append(r.Tolerations, resourceapi.DeviceToleration{Key: k, Operator: resourceapi.DeviceTolerationOpExists})
	}
	return dra.ClaimOf(&resourceapi.ResourceClaim{
		ObjectMeta: metav1.ObjectMeta{UID: types.UID(uid), Namespace: "default", Name: uid},
		Status: resourceapi.ResourceClaimStatus{Allocation: &resourceapi.AllocationResult{Devices: resourceapi.DeviceAllocationResult{
			Results: []resourceapi.DeviceRequestAllocationResult{r},
		}}},
	}, "node-a")
}

// A cordon has a taint key of its own, gpu.nvidia.com/cordoned, always
// NoSchedule (issue 29, defect 4b): a claim that tolerates unhealthy
// devices is not given a cordoned one, a device both unhealthy and
// cordoned carries both taints, and Prepare refuses a cordoned device
// unless the request tolerates the cordon (or is admin access).
func TestCordonTaintKey(t *testing.T) {
	const cordonKey = "gpu.nvidia.com/cordoned"
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "dgx-a100"), withDRA(rec))
	// Unhealthy devices evict; cordoned ones must not.
	h.config("version: v1\nconfigs:\n  default:\n    health:\n      draTaintEffect: NoExecute\n")
	gpu1, gpu2 := findGPU(h, 1).ID, findGPU(h, 2).ID
	h.step(HealthChanged{State: xidState(gpu2, 48)})
	h.step(CordonChanged{GPUs: []string{"1", "2"}})

	taints := map[string][]string{}
	for _, s := range devicemodel.Resources("node-a", rec.last(), 1, devicemodel.Dropped{}).Pools["node-a"].Slices {
		for _, d := range s.Devices {
			for _, tt := range d.Taints {
				taints[d.Name] = append(taints[d.Name], string(tt.Key)+":"+string(tt.Effect))
			}
		}
	}
	for dev, want := range map[string][]string{
		"gpu-0": nil,
		"gpu-1": {cordonKey + ":NoSchedule"},
		"gpu-2": {devicemodel.TaintUnhealthy + ":NoExecute", cordonKey + ":NoSchedule"},
	} {
		if !slices.Equal(taints[dev], want) {
			t.Errorf("%s taints %q, want %q", dev, taints[dev], want)
		}
	}

	got := h.prepare(tolerating("uid-u", "gpu-1", false, devicemodel.TaintUnhealthy))["uid-u"]
	if got.Err == nil || !strings.Contains(got.Err.Error(), gpu1) || !strings.Contains(got.Err.Error(), "cordon") {
		t.Errorf("a request tolerating only the unhealthy taint, on cordoned gpu-1: %+v; want refused naming the GPU and the cordon", got)
	}
	if got := h.prepare(tolerating("uid-c", "gpu-1", false, cordonKey))["uid-c"]; got.Err != nil {
		t.Errorf("a request tolerating the cordon, on cordoned gpu-1: %v", got.Err)
	}
	if st := h.a.claimStatuses()["uid-c"]; len(st.Devices) != 1 || st.Devices[0].Unhealthy != ReasonCordoned {
		t.Errorf("claim status of uid-c %+v, want its device said cordoned", st)
	}
	got = h.prepare(tolerating("uid-c2", "gpu-2", false, cordonKey))["uid-c2"]
	if got.Err == nil || !strings.Contains(got.Err.Error(), "unhealthy") {
		t.Errorf("a request tolerating only the cordon, on unhealthy and cordoned gpu-2: %+v; want refused as unhealthy", got)
	}
	if got := h.prepare(tolerating("uid-b", "gpu-2", false, cordonKey, devicemodel.TaintUnhealthy))["uid-b"]; got.Err != nil {
		t.Errorf("a request tolerating both, on unhealthy and cordoned gpu-2: %v", got.Err)
	}
	if got := h.prepare(tolerating("uid-a", "gpu-1", true))["uid-a"]; got.Err != nil {
		t.Errorf("admin access to cordoned gpu-1: %v", got.Err)
	}
}
