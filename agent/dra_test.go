package agent

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

// draRecorder is the DRA driver as the loop sees it: it keeps the pools.
type draRecorder struct {
	mu    sync.Mutex
	pools []*devicemodel.Pool
}

func (r *draRecorder) Publish(p *devicemodel.Pool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.pools = append(r.pools, p)
}

func (r *draRecorder) last() *devicemodel.Pool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if len(r.pools) == 0 {
		return nil
	}
	return r.pools[len(r.pools)-1]
}

func withDRA(r *draRecorder) harnessOption {
	return func(h *harness) { h.opts.DRA = r }
}

// prepare runs one Prepare request through a Step and returns its answer.
func (h *harness) prepare(claims ...dra.Claim) map[types.UID]dra.Prepared {
	h.t.Helper()
	reply := make(chan map[types.UID]dra.Prepared, 1)
	h.step(ClaimsPrepare{Claims: claims, Reply: reply})
	select {
	case r := <-reply:
		return r
	default:
		h.t.Fatal("Step did not answer the Prepare request")
		return nil
	}
}

func (h *harness) unprepare(refs ...dra.ClaimRef) map[types.UID]error {
	h.t.Helper()
	reply := make(chan map[types.UID]error, 1)
	h.step(ClaimsUnprepare{Claims: refs, Reply: reply})
	select {
	case r := <-reply:
		return r
	default:
		h.t.Fatal("Step did not answer the Unprepare request")
		return nil
	}
}

func claim(uid, name string, devices ...string) dra.Claim {
	c := dra.Claim{UID: types.UID(uid), Namespace: "default", Name: name}
	for i, d := range devices {
		c.Devices = append(c.Devices, dra.Allocated{Request: "gpu" + string(rune('0'+i)), Device: d})
	}
	return c
}

func poolNames(p *devicemodel.Pool) []string {
	var out []string
	for _, d := range p.Devices {
		out = append(out, d.Name)
	}
	return out
}

// The DRA side as a table: what the pool offers, what a claim gets, and how
// the device plugin and DRA keep out of each other's way through the one
// ledger.
func TestDRAClaimsTable(t *testing.T) {
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "dgx-a100"), withDRA(rec))
	h.config(wholeGPUs)
	if p := rec.last(); p == nil || len(p.Devices) != 8 || p.Devices[0].Name != "gpu-0" || p.Devices[0].Type != devicemodel.TypeGPU {
		t.Fatalf("pool after the first config: %v", rec.last())
	}
	uuid := func(i int) string { return findGPU(h, i).ID }
	d0 := rec.last().Devices[0]
	if d0.UUID != uuid(0) || d0.ProductName != "NVIDIA A100-SXM4-40GB" || d0.Architecture != "Ampere" || d0.MemoryBytes == 0 || d0.PCIBusID == "" {
		t.Errorf("gpu-0 attributes: %+v", d0)
	}

	// The device plugin allocates GPU 0: DRA stops offering it at once, before
	// the kubelet lists the container.
	before := h.a.PlanPasses()
	if err := h.allocate(ResourceGPU, uuid(0)); err != nil {
		t.Fatal(err)
	}
	if _, ok := rec.last().Device("gpu-0"); ok || h.a.PlanPasses()-before != 1 {
		t.Errorf("gpu-0 allocated through the device plugin: %d passes, pool %v; want one pass, without it", h.a.PlanPasses()-before, poolNames(rec.last()))
	}
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU, uuid(0))})
	if _, ok := rec.last().Device("gpu-0"); ok {
		t.Errorf("gpu-0 held through the device plugin is still in the DRA pool: %v", poolNames(rec.last()))
	}

	rows := []struct {
		name    string
		claim   dra.Claim
		passes  int64
		wantErr string // "" = prepared
	}{
		{"a whole GPU", claim("uid-a", "a", "gpu-1"), 1, ""},
		{"the same claim again: the same answer, nothing planned", claim("uid-a", "a", "gpu-1"), 0, ""},
		{"another claim on the same device", claim("uid-b", "b", "gpu-1"), 0, "in use by ResourceClaim default/a"},
		{"a device the device plugin holds", claim("uid-c", "c", "gpu-0"), 0, `device "gpu-0" is not offered`},
		{"an unknown device", claim("uid-d", "d", "gpu-99"), 0, `device "gpu-99" is not offered`},
		{"no device of ours", claim("uid-e", "e"), 0, "no device of driver gpu.nvidia.com"},
		{"two devices", claim("uid-f", "f", "gpu-2", "gpu-3"), 1, ""},
	}
	for _, r := range rows {
		before := h.a.PlanPasses()
		got := h.prepare(r.claim)[r.claim.UID]
		if passes := h.a.PlanPasses() - before; passes != r.passes {
			t.Errorf("%s: %d plan passes, want %d", r.name, passes, r.passes)
		}
		if r.wantErr != "" {
			if got.Err == nil || !strings.Contains(got.Err.Error(), r.wantErr) {
				t.Errorf("%s: %+v, want an error containing %q", r.name, got, r.wantErr)
			}
			continue
		}
		if got.Err != nil || len(got.Devices) != len(r.claim.Devices) {
			t.Fatalf("%s: %+v, want %d devices", r.name, got, len(r.claim.Devices))
		}
		for i, pd := range got.Devices {
			dev, _ := rec.last().Device(r.claim.Devices[i].Device)
			if want := "nvidia.com/gpu=" + dev.UUID; len(pd.CDIDevices) != 1 || pd.CDIDevices[0] != want || pd.Requests[0] != r.claim.Devices[i].Request {
				t.Errorf("%s: device %d: %+v, want CDI device %s for request %s", r.name, i, pd, want, r.claim.Devices[i].Request)
			}
			// The device plugin no longer gives it out.
			if cd := findGPU(h, dev.Index); cd.Healthy || !strings.Contains(cd.Reason, "ResourceClaim default/"+r.claim.Name+" through DRA") {
				t.Errorf("%s: the device plugin still offers %s: %+v", r.name, dev.Name, cd)
			}
		}
	}

	// A fatal XID: the device stays in the pool, marked unhealthy (a taint),
	// and no claim gets it.
	h.step(HealthChanged{State: xidState(uuid(4), 48)})
	if d, _ := rec.last().Device("gpu-4"); d.Unhealthy == "" {
		t.Errorf("gpu-4 after XID 48: %+v, want unhealthy", d)
	}
	if got := h.prepare(claim("uid-g", "g", "gpu-4"))["uid-g"]; got.Err == nil || !strings.Contains(got.Err.Error(), "unhealthy") {
		t.Errorf("claim on an unhealthy device: %+v", got)
	}

	// Released: the device plugin offers it again; an unknown claim is
	// already released.
	out := h.unprepare(dra.ClaimRef{UID: "uid-a", Namespace: "default", Name: "a"}, dra.ClaimRef{UID: "uid-zz", Namespace: "default", Name: "zz"})
	if out["uid-a"] != nil || out["uid-zz"] != nil || len(out) != 2 {
		t.Errorf("unprepare: %v", out)
	}
	if cd := findGPU(h, 1); !cd.Healthy {
		t.Errorf("GPU 1 after its claim was released: %+v", cd)
	}
	if st := h.a.Status().DRA; st == nil || len(st.Claims) != 1 || !strings.HasPrefix(st.Claims[0], "default/f: gpu-2, gpu-3") || len(st.Unhealthy) != 1 {
		t.Errorf("/status dra: %+v", st)
	}
}

// A restart between Prepare and the container's start: the claim is in the
// checkpoint, the next agent withholds its device from its first catalog
// and answers the kubelet's repeated Prepare the same way.
func TestDRAClaimsSurviveRestart(t *testing.T) {
	node := simNode(t, "dgx-a100")
	dir := t.TempDir()
	rec := &draRecorder{}
	h := newHarnessIn(t, node, dir, withDRA(rec))
	h.config(wholeGPUs)
	first := h.prepare(claim("uid-a", "a", "gpu-5"))["uid-a"]
	if first.Err != nil {
		t.Fatal(first.Err)
	}

	rec2 := &draRecorder{}
	h2 := newHarnessIn(t, node, dir, withDRA(rec2), withCheckpoint())
	h2.config(wholeGPUs)
	if cd := findGPU(h2, 5); cd.Healthy {
		t.Errorf("after the restart the device plugin offers the claimed GPU 5: %+v", cd)
	}
	again := h2.prepare(claim("uid-a", "a", "gpu-5"))["uid-a"]
	if again.Err != nil || len(again.Devices) != 1 || again.Devices[0].CDIDevices[0] != first.Devices[0].CDIDevices[0] {
		t.Errorf("Prepare after the restart: %+v, want %+v", again, first)
	}
	if got := h2.prepare(claim("uid-b", "b", "gpu-5"))["uid-b"]; got.Err == nil {
		t.Errorf("a second claim got GPU 5 after the restart: %+v", got)
	}
}

// A claim that cannot be checkpointed is refused, not half-prepared.
func TestDRAPrepareNeedsTheCheckpoint(t *testing.T) {
	rec := &draRecorder{}
	blocker := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(blocker, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	h := newHarnessIn(t, simNode(t, "pcie-4gpu"), filepath.Join(blocker, "state"), withDRA(rec))
	h.config(wholeGPUs)
	got := h.prepare(claim("uid-a", "a", "gpu-0"))["uid-a"]
	if got.Err == nil || !strings.Contains(got.Err.Error(), "checkpointed") {
		t.Fatalf("Prepare with an unwritable state dir: %+v, want refused", got)
	}
	if cd := findGPU(h, 0); !cd.Healthy {
		t.Errorf("the refused claim's GPU is withheld from the device plugin: %+v", cd)
	}
	if st := h.a.Status().DRA; len(st.Claims) != 0 {
		t.Errorf("refused claim listed: %v", st.Claims)
	}
}

// A MIG device a claim holds is never destroyed by a layout edit: its GPU
// waits, naming the claim.
func TestDRAClaimedMIGDeviceSurvivesLayoutEdit(t *testing.T) {
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithMIGEnabled()), withMIG(), withDRA(rec))
	h.config(mixedLayout(`{"1g.10gb": 2, "3g.40gb": 1}`))
	var target devicemodel.Device
	for _, d := range rec.last().Devices {
		if d.Type == devicemodel.TypeMIG && d.ParentIndex == 0 && d.Profile == "1g.10gb" {
			target = d
			break
		}
	}
	if target.Name == "" || target.ParentUUID == "" {
		t.Fatalf("no 1g.10gb MIG device on GPU 0 in the pool: %v", poolNames(rec.last()))
	}
	if got := h.prepare(claim("uid-m", "m", target.Name))["uid-m"]; got.Err != nil {
		t.Fatal(got.Err)
	}
	h.config(mixedLayout(`{"3g.40gb": 2}`))
	if st := h.migState(0); st.Phase != mig.PhasePending || !strings.Contains(st.Reason, "ResourceClaim default/m") {
		t.Errorf("GPU 0: %+v, want pending naming the claim", st)
	}
	if _, ok := rec.last().Device(target.Name); !ok {
		t.Errorf("claimed MIG device %s was destroyed: %v", target.Name, poolNames(rec.last()))
	}
	if st := h.migState(1); st.Phase != mig.PhaseApplied {
		t.Errorf("GPU 1: %+v, want applied", st)
	}
	h.unprepare(dra.ClaimRef{UID: "uid-m", Namespace: "default", Name: "m"})
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU)})
	if st := h.migState(0); st.Phase != mig.PhaseApplied {
		t.Errorf("GPU 0 after the claim was released: %+v, want applied", st)
	}
}

// Requests are never merged: each caller waits for its own answer.
func TestInboxKeepsEveryClaimRequest(t *testing.T) {
	b := NewInbox()
	r1, r2 := make(chan map[types.UID]dra.Prepared, 1), make(chan map[types.UID]dra.Prepared, 1)
	b.Post(ClaimsPrepare{Claims: []dra.Claim{claim("1", "a", "gpu-0")}, Reply: r1})
	b.Post(Tick{})
	b.Post(ClaimsPrepare{Claims: []dra.Claim{claim("2", "b", "gpu-1")}, Reply: r2})
	b.Post(Tick{})
	if got := b.Drain(); len(got) != 3 {
		t.Errorf("queued %d events, want both requests and one tick: %v", len(got), got)
	}
}

const (
	draOnly     = "version: v1\nconfigs:\n  default:\n    devicePlugin:\n      enabled: false\n"
	twoPaths    = "version: v1\nconfigs:\n  default: {}\n  dra-only:\n    devicePlugin:\n      enabled: false\n"
	draOnlyNode = "dra-only"
)

// devicePlugin.enabled: false switches a node to DRA only, live: the device
// plugin's resources go (what containers hold stays, unhealthy, so the
// Node's allocatable is 0 and the scheduler maps nvidia.com/gpu requests to
// DRA), DRA offers every GPU no container holds; switching back, a claimed
// GPU stays withheld from the device plugin.
func TestDevicePluginSwitchedOffForDRA(t *testing.T) {
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "pcie-4gpu"), withDRA(rec))
	h.config(twoPaths)
	held := findGPU(h, 0).ID
	if err := h.allocate(ResourceGPU, held); err != nil {
		t.Fatal(err)
	}
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU, held)})

	h.step(LabelsChanged{Labels: map[string]string{"gpu-agent.io/config": draOnlyNode}})
	r := h.pub.last().Resources[ResourceGPU]
	if r == nil || len(r.Devices) != 1 || r.Devices[0].ID != held || r.Devices[0].Healthy {
		t.Fatalf("DRA only: the device plugin offers %+v; want only the held GPU, unhealthy", r)
	}
	if got := poolNames(rec.last()); len(got) != 3 || slices.Contains(got, "gpu-0") {
		t.Errorf("DRA only: pool %v, want the 3 GPUs no container holds", got)
	}
	if got := h.prepare(claim("uid-x", "x", "gpu-2"))["uid-x"]; got.Err != nil {
		t.Fatal(got.Err)
	}

	// The holder leaves; back to both paths: the claimed GPU stays withheld.
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU)})
	h.step(LabelsChanged{Labels: map[string]string{}})
	if n := h.count(ResourceGPU); n != 4 {
		t.Fatalf("back to the device plugin: %d GPUs, want 4", n)
	}
	if cd := findGPU(h, 2); cd.Healthy {
		t.Errorf("the claimed GPU 2 is offered by the device plugin again: %+v", cd)
	}
}

// Without --dra, a config that switches the device plugin off would leave
// the node offering nothing: it does not fit, naming the field, and the
// last good config stays.
func TestDevicePluginOffNeedsDRA(t *testing.T) {
	h := newHarness(t, simNode(t, "pcie-4gpu"))
	h.config(wholeGPUs)
	h.config(draOnly)
	st := h.a.Status().Config
	if h.count(ResourceGPU) != 4 || !strings.Contains(st.Error, "devicePlugin.enabled") {
		t.Errorf("%d GPUs, status %+v; want the last good config's 4 and the field named", h.count(ResourceGPU), st)
	}
}

func partitionsOf(p *devicemodel.Pool, gpuIndex int) (whole bool, parts []string) {
	for _, d := range p.Devices {
		switch {
		case d.Type == devicemodel.TypeGPU && d.Index == gpuIndex:
			whole = true
		case d.Partition && d.ParentIndex == gpuIndex:
			parts = append(parts, d.Name)
		}
	}
	return whole, parts
}

// Dynamic MIG: an idle H100 with MIG off is offered whole and as every
// profile at every placement, all drawing on its counters; a claim for a
// 3g and one for a 4g create them (MIG mode on first), a 7g then fails
// without touching anything, the device plugin no longer offers the GPU;
// released, the instances go, MIG goes off, and the 7g fits.
func TestDRADynamicMIG(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	dir := t.TempDir()
	h := newHarnessIn(t, node, dir, withDRA(rec), withMIG())
	h.config(migOnDemand)
	whole, parts := partitionsOf(rec.last(), 0)
	// 1g.10gb+me, of which one fits, at its last placement only.
	if !whole || len(parts) != 19 || len(rec.last().CounterSets) != 8 || !slices.Contains(parts, "gpu-0-mig-1g10gb-plus-me-6") {
		t.Fatalf("GPU 0: whole %v, %d partitions %v, %d counter sets; want whole, 19 (7+1+4+3+2+1+1), 8", whole, len(parts), parts, len(rec.last().CounterSets))
	}
	// The counters that keep placements apart, less those the others imply
	// (devicemodel.pruneCounters): on an H100 memory slices 0-6; the one
	// OFA too while 1g.10gb+me was offered beside 1g.10gb+me.
	set := rec.last().CounterSets[0].Counters
	if len(set) != 7 || set["memory-slice-0"] != 1 || hasKey(set, "ofa-engines") || hasKey(set, "memory-slice-7") || hasKey(set, "compute-slices") {
		t.Errorf("GPU 0's counters %v", set)
	}
	if d, _ := rec.last().Device("gpu-0-mig-3g40gb-4"); d.Consumes["memory-slice-4"] != 1 || d.Consumes["memory-slice-3"] != 0 || len(d.Consumes) != 3 {
		t.Errorf("3g.40gb at 4 consumes %v, want memory slices 4-6", d.Consumes)
	}

	a := h.prepare(claim("uid-3g", "three", "gpu-0-mig-3g40gb-4"))["uid-3g"]
	if a.Err != nil || len(a.Devices) != 1 || !strings.HasPrefix(a.Devices[0].CDIDevices[0], "nvidia.com/gpu=MIG-") {
		t.Fatalf("3g claim: %+v", a)
	}
	b := h.prepare(claim("uid-4g", "four", "gpu-0-mig-4g40gb-0"))["uid-4g"]
	if b.Err != nil {
		t.Fatalf("4g claim: %v", b.Err)
	}
	inv, err := h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	if g := inv.GPUs[0]; !g.MIG.Current || len(g.Instances) != 2 {
		t.Fatalf("GPU 0 after two claims: MIG %v, instances %+v", g.MIG, g.Instances)
	}
	if cd := findGPU(h, 0); cd.Healthy {
		t.Errorf("the device plugin still offers GPU 0 whole: %+v", cd)
	}
	whole, parts = partitionsOf(rec.last(), 0)
	if whole || len(parts) != 19 {
		t.Errorf("GPU 0 in MIG mode: whole %v, %d partitions; want not whole, all 19 names kept", whole, len(parts))
	}
	c := h.prepare(claim("uid-7g", "seven", "gpu-0-mig-7g80gb-0"))["uid-7g"]
	if c.Err == nil || !strings.Contains(c.Err.Error(), "already occupies") {
		t.Errorf("7g claim on a busy GPU: %+v", c)
	}
	if inv, _ := h.opts.Observer.Inventory(); len(inv.GPUs[0].Instances) != 2 {
		t.Errorf("the failed 7g claim changed GPU 0: %+v", inv.GPUs[0].Instances)
	}

	// A restart keeps both claims: nothing is blocked, nothing destroyed.
	rec2 := &draRecorder{}
	h2 := newHarnessIn(t, node, dir, withDRA(rec2), withMIG(), withCheckpoint())
	h2.config(migOnDemand)
	if again := h2.prepare(claim("uid-3g", "three", "gpu-0-mig-3g40gb-4"))["uid-3g"]; again.Err != nil || again.Devices[0].CDIDevices[0] != a.Devices[0].CDIDevices[0] {
		t.Errorf("3g claim after a restart: %+v, want %+v", again, a)
	}
	if _, parts := partitionsOf(rec2.last(), 0); len(parts) != 19 {
		t.Errorf("after the restart GPU 0 offers %d partitions, want 19 (the claims' instances block nothing)", len(parts))
	}

	h2.unprepare(dra.ClaimRef{UID: "uid-3g", Namespace: "default", Name: "three"}, dra.ClaimRef{UID: "uid-4g", Namespace: "default", Name: "four"})
	inv, _ = h2.opts.Observer.Inventory()
	if g := inv.GPUs[0]; g.MIG.Current || len(g.Instances) != 0 {
		t.Fatalf("GPU 0 after the releases: MIG %v, instances %+v; want MIG off, none", g.MIG, g.Instances)
	}
	if whole, _ := partitionsOf(rec2.last(), 0); !whole {
		t.Errorf("GPU 0 is not offered whole again")
	}
	if cd := findGPU(h2, 0); !cd.Healthy {
		t.Errorf("the device plugin does not offer GPU 0 again: %+v", cd)
	}
	if c := h2.prepare(claim("uid-7g", "seven", "gpu-0-mig-7g80gb-0"))["uid-7g"]; c.Err != nil {
		t.Errorf("7g claim once the GPU is free: %v", c.Err)
	}
}

// An A100 needs a GPU reset to turn MIG on: with MIG off it stays a whole
// GPU; with MIG on (and no layout) its MIG devices are made on demand, and
// an existing instance no claim made blocks its placement.
func TestDRADynamicMIGResetRule(t *testing.T) {
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "dgx-a100"), withDRA(rec), withMIG())
	h.config(wholeGPUs)
	if whole, parts := partitionsOf(rec.last(), 0); !whole || len(parts) != 0 || len(rec.last().CounterSets) != 0 {
		t.Errorf("A100 with MIG off: whole %v, partitions %v; want whole only", whole, parts)
	}

	rec2 := &draRecorder{}
	node := simNode(t, "dgx-a100", sim.WithMIGEnabled())
	h2 := newHarness(t, node, withDRA(rec2), withMIG())
	h2.config(mixedLayout(`{"7g.40gb": 1}`)) // lay out every GPU ...
	h2.config(wholeGPUs)                     // ... then let DRA have them: the 7g instances stay and block
	if whole, parts := partitionsOf(rec2.last(), 0); whole || len(parts) != 0 {
		t.Errorf("A100 with a 7g instance: whole %v, partitions %v; want none (all slices taken)", whole, parts)
	}
	var static int
	for _, d := range rec2.last().Devices {
		if d.Type == devicemodel.TypeMIG && !d.Partition {
			static++
		}
	}
	if static != 8 {
		t.Errorf("%d existing MIG devices offered, want the 8 7g instances", static)
	}
}

// MIG mode goes back off only on a GPU where a claim turned it on: one an
// admin turned on stays on when its last on-demand device goes.
func TestDRADynamicMIGLeavesAdminMIGOn(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithMIGEnabled(), sim.WithImmediateMIGModeChange())
	h := newHarness(t, node, withDRA(rec), withMIG())
	h.config(migOnDemand)
	if got := h.prepare(claim("uid-1", "one", "gpu-2-mig-1g10gb-6"))["uid-1"]; got.Err != nil {
		t.Fatal(got.Err)
	}
	h.unprepare(dra.ClaimRef{UID: "uid-1", Namespace: "default", Name: "one"})
	inv, err := h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	if g := inv.GPUs[2]; !g.MIG.Current || len(g.Instances) != 0 {
		t.Errorf("GPU 2 after the release: MIG %+v, instances %v; want MIG still on, none", g.MIG, g.Instances)
	}
}

// Time-slicing through DRA: with the config's 2 replicas, each GPU may be
// shared by two claims (consumable capacity "shares"); a third is refused,
// and the device plugin offers neither replica meanwhile.
func TestDRASharedGPU(t *testing.T) {
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "pcie-4gpu"), withDRA(rec))
	h.config(sliced2)
	d, _ := rec.last().Device("gpu-1")
	if d.Shares != 2 {
		t.Fatalf("gpu-1 shares %d, want the config's 2 replicas", d.Shares)
	}
	shared := func(uid, name, share string) dra.Claim {
		c := claim(uid, name, "gpu-1")
		c.Devices[0].ShareID = types.UID(share)
		return c
	}
	for _, c := range []dra.Claim{shared("uid-a", "a", "share-a"), shared("uid-b", "b", "share-b")} {
		got := h.prepare(c)[c.UID]
		if got.Err != nil || got.Devices[0].ShareID != c.Devices[0].ShareID {
			t.Fatalf("claim %s: %+v", c.Name, got)
		}
	}
	if got := h.prepare(shared("uid-c", "c", "share-c"))["uid-c"]; got.Err == nil || !strings.Contains(got.Err.Error(), "holding 2 of its 2 shares") {
		t.Errorf("a third claim on a 2-share GPU: %+v", got)
	}
	// Shares count, not claims: one claim that took both leaves none.
	h.unprepare(dra.ClaimRef{UID: "uid-a", Namespace: "default", Name: "a"}, dra.ClaimRef{UID: "uid-b", Namespace: "default", Name: "b"})
	both := shared("uid-d", "d", "share-d")
	both.Devices[0].SharesTaken = 2
	if got := h.prepare(both)["uid-d"]; got.Err != nil {
		t.Fatalf("a claim taking both shares: %v", got.Err)
	}
	if got := h.prepare(shared("uid-e", "e", "share-e"))["uid-e"]; got.Err == nil || !strings.Contains(got.Err.Error(), "holding 2 of its 2 shares") {
		t.Errorf("a claim on a GPU whose 2 shares one claim took: %+v", got)
	}
	for _, dev := range h.pub.last().Resources[ResourceGPU].Devices {
		if dev.GPU == 1 && dev.Healthy {
			t.Errorf("the device plugin offers %s of the shared GPU 1", dev.ID)
		}
	}
}

// health.draTaintEffect: NoExecute: an unhealthy device's taint evicts.
func TestDRATaintEffect(t *testing.T) {
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "pcie-4gpu"), withDRA(rec))
	h.config(wholeGPUs)
	uuid := findGPU(h, 2).ID
	h.step(HealthChanged{State: xidState(uuid, 48)})
	if d, _ := rec.last().Device("gpu-2"); d.Unhealthy == "" || d.Evict {
		t.Errorf("default: gpu-2 %+v, want unhealthy, NoSchedule", d)
	}
	h.config("version: v1\nconfigs:\n  default:\n    health:\n      draTaintEffect: NoExecute\n")
	if d, _ := rec.last().Device("gpu-2"); !d.Evict {
		t.Errorf("draTaintEffect NoExecute: gpu-2 %+v, want evicting", d)
	}
	h.config("version: v1\nconfigs:\n  default:\n    health:\n      draTaintEffect: Evict\n")
	if st := h.a.Status().Config; !strings.Contains(st.Error, "configs.default.health.draTaintEffect") {
		t.Errorf("a bad value: %+v, want the field named", st)
	}
}
