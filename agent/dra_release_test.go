package agent

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
	"k8s.io/apimachinery/pkg/types"
)

// gpuOf reads GPU i as NVML shows it now (not through the agent's
// observer, whose reads a test may make fail).
func gpuOf(t *testing.T, h *harness, i int) gpu.GPU {
	t.Helper()
	inv, err := mig.NewObserver(h.node, gpu.Options{}).Inventory()
	if err != nil {
		t.Fatal(err)
	}
	return inv.GPUs[i]
}

// intentLeft is a node where claim uid-1's 3g.40gb at 4 on GPU 0 failed
// because the GPU could not be read right after the creation: the device
// may exist, and the claim's intent stands.
func intentLeft(t *testing.T) (*harness, *draRecorder) {
	t.Helper()
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	fo := &flakyObserver{}
	h := newHarness(t, node, withDRA(rec), withMIG(), withFlakyObserver(node, fo))
	h.config(migOnDemand)
	fo.failNext = 1 // the read after the creation
	if got := h.prepare(claim("uid-1", "one", "gpu-0-mig-3g40gb-4"))["uid-1"]; got.Err == nil {
		t.Fatalf("Prepare with GPU 0 unreadable after the creation: %+v, want an error", got)
	}
	return h, rec
}

// A claim that fails after one of its MIG devices was made leaves nothing
// behind: the device is destroyed and the GPU goes back to MIG off.
func TestDRAFailedClaimUndoesItsMIGDevice(t *testing.T) {
	for _, tt := range []struct {
		name   string
		second string
		err    string
	}{
		{"second device not offered", "gpu-42", "not offered"},
		{"second device overlaps the first", "gpu-0-mig-7g80gb-0", "already occupies"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			rec := &draRecorder{}
			h := newHarness(t, simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange()), withDRA(rec), withMIG())
			h.config(migOnDemand)
			c := claim("uid-1", "two", "gpu-0-mig-3g40gb-4", tt.second)
			c.Devices[1].Request = "second"
			got := h.prepare(c)["uid-1"]
			if got.Err == nil || !strings.Contains(got.Err.Error(), tt.err) {
				t.Fatalf("Prepare: %+v, want an error saying %q", got, tt.err)
			}
			if g := gpuOf(t, h, 0); g.MIG.Current || len(g.Instances) != 0 {
				t.Errorf("GPU 0 after the failed claim: MIG %v, instances %+v; want MIG off, none", g.MIG, g.Instances)
			}
			if st := h.a.Status().DRA; len(st.Claims) != 0 || len(st.Releasing) != 0 {
				t.Errorf("/status dra %+v, want no claim and nothing releasing", st)
			}
		})
	}
}

// A MIG device that cannot be destroyed when its claim is released is
// withheld both ways, remembered across a restart, and destroyed on a
// later resync.
func TestDRAReleaseRetriedUntilDone(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	dir := t.TempDir()
	h := newHarnessIn(t, node, dir, withDRA(rec), withMIG())
	h.config(migOnDemand)
	got := h.prepare(claim("uid-1", "one", "gpu-0-mig-3g40gb-4"))["uid-1"]
	if got.Err != nil {
		t.Fatal(got.Err)
	}
	uuid := strings.TrimPrefix(got.Devices[0].CDIDevices[0], devicemodel.CDIKind+"=")
	if err := node.FailCalls(0, "GpuInstanceDestroy", nvml.ERROR_IN_USE, -1); err != nil {
		t.Fatal(err)
	}
	if errs := h.unprepare(dra.ClaimRef{UID: "uid-1", Namespace: "default", Name: "one"}); errs["uid-1"] != nil {
		t.Fatalf("Unprepare: %v", errs["uid-1"])
	}
	// The compute instance went, its GPU instance could not: no MIG
	// device, but the slices are still taken.
	if g := gpuOf(t, h, 0); len(g.Instances) != 0 || len(g.GIsWithoutCI) != 1 {
		t.Fatalf("GPU 0 instances %+v, bare GPU instances %+v; want the GPU instance that could not be destroyed", g.Instances, g.GIsWithoutCI)
	}
	if st := h.a.Status().DRA; len(st.Releasing) != 1 || !strings.Contains(st.Releasing[0], uuid) {
		t.Errorf("/status dra releasing %v, want %s", st.Releasing, uuid)
	}
	if _, parts := partitionsOf(rec.last(), 0); len(parts) != 10 || slices.Contains(parts, "gpu-0-mig-3g40gb-4") {
		// 19 partitions less the 9 that touch slices 4-7 (1g.10gb at 4,
		// 5, 6; 1g.10gb+me at 6; 1g.20gb at 4, 6; 2g, 3g at 4; 7g).
		t.Errorf("GPU 0 offers %d partitions %v while its released device is still there; want 10", len(parts), parts)
	}
	for _, d := range rec.last().Devices {
		if d.UUID == uuid {
			t.Errorf("the released device is offered through DRA: %s", d.Name)
		}
	}
	if cd := findGPU(h, 0); cd.Healthy {
		t.Errorf("the device plugin offers GPU 0 while a released device is being destroyed: %+v", cd)
	}

	// A restart remembers it; the next resync that can destroy it does.
	h2 := newHarnessIn(t, node, dir, withDRA(&draRecorder{}), withMIG(), withCheckpoint())
	h2.config(migOnDemand)
	h2.step(Tick{})
	if g := gpuOf(t, h2, 0); len(g.GIsWithoutCI) != 1 {
		t.Fatalf("GPU 0 bare GPU instances %+v while destroying still fails", g.GIsWithoutCI)
	}
	if err := node.FailCalls(0, "GpuInstanceDestroy", nvml.ERROR_IN_USE, 0); err != nil {
		t.Fatal(err)
	}
	h2.step(Tick{})
	if g := gpuOf(t, h2, 0); g.MIG.Current || len(g.Instances) != 0 {
		t.Errorf("GPU 0 after the retry: MIG %v, instances %+v; want MIG off, none", g.MIG, g.Instances)
	}
	if st := h2.a.Status().DRA; len(st.Releasing) != 0 {
		t.Errorf("/status dra releasing %v after the retry, want none", st.Releasing)
	}
	if cd := findGPU(h2, 0); !cd.Healthy {
		t.Errorf("the device plugin does not offer GPU 0 again: %+v", cd)
	}
	cp, err := LoadCheckpoint(dir)
	if err != nil || len(cp.Releasing) != 0 {
		t.Errorf("checkpoint releasing %+v (%v), want none", cp.Releasing, err)
	}
}

type crash struct{}

// flakyObserver fails the next failNext inventory reads, as NVML may.
type flakyObserver struct {
	Observer
	failNext int
}

func (f *flakyObserver) Inventory() (*gpu.Inventory, error) {
	if f.failNext > 0 {
		f.failNext--
		return nil, errors.New("NVML hiccup")
	}
	return f.Observer.Inventory()
}

func withFlakyObserver(node *sim.Node, fo *flakyObserver) harnessOption {
	return func(h *harness) {
		fo.Observer = mig.NewObserver(node, gpu.Options{})
		h.opts.Observer = fo
	}
}

// An agent killed right after NVML made a claim's MIG device, before the
// claim reached the checkpoint, leaves no orphan: the next agent finds the
// intents recorded first and, once it has read the GPUs, destroys the
// devices and turns MIG off again; the kubelet's retry then gets fresh ones.
func TestDRACrashBetweenCreateAndCheckpoint(t *testing.T) {
	for _, tt := range []struct {
		name       string
		crashAfter int // NVML changes: MIG mode on, GPU instance, compute instance per GPU
		devices    []string
		failReads  int // the restarted agent's first reads that fail
	}{
		{"one device", 3, []string{"gpu-0-mig-3g40gb-4"}, 0},
		{"one device, first reads fail", 3, []string{"gpu-0-mig-3g40gb-4"}, 2},
		{"second device of a claim", 4, []string{"gpu-0-mig-3g40gb-4", "gpu-1-mig-3g40gb-4"}, 0},
	} {
		t.Run(tt.name, func(t *testing.T) {
			dir := t.TempDir()
			state := filepath.Join(dir, "gpus.json")
			node, err := sim.New("dgx-h100", sim.WithImmediateMIGModeChange(), sim.WithStateFile(state), sim.WithCrashAfter(tt.crashAfter, func() { panic(crash{}) }))
			if err != nil {
				t.Fatal(err)
			}
			node.Init()
			h := newHarnessIn(t, node, dir, withDRA(&draRecorder{}), withMIG())
			h.config(migOnDemand)
			c := claim("uid-1", "one", tt.devices...)
			for i := range c.Devices {
				c.Devices[i].Request = fmt.Sprintf("r%d", i)
			}
			func() {
				defer func() {
					if r := recover(); r != (crash{}) {
						t.Fatalf("recovered %v, want the simulated crash", r)
					}
				}()
				h.prepare(c)
			}()
			node.Close()

			node2, err := sim.New("dgx-h100", sim.WithImmediateMIGModeChange(), sim.WithStateFile(state))
			if err != nil {
				t.Fatal(err)
			}
			node2.Init()
			t.Cleanup(func() { node2.Close() })
			fo := &flakyObserver{failNext: tt.failReads}
			h2 := newHarnessIn(t, node2, dir, withDRA(&draRecorder{}), withMIG(), withCheckpoint(), withFlakyObserver(node2, fo))
			if g := gpuOf(t, h2, 0); len(g.Instances) != 1 {
				t.Fatalf("after the crash GPU 0 has instances %+v, want the one made before it", g.Instances)
			}
			h2.config(migOnDemand)
			for range tt.failReads {
				h2.step(Tick{})
			}
			for i := range tt.devices {
				if g := gpuOf(t, h2, i); g.MIG.Current || len(g.Instances) != 0 {
					t.Errorf("GPU %d after the restart: MIG %v, instances %+v; want MIG off, none", i, g.MIG, g.Instances)
				}
			}
			got := h2.prepare(c)["uid-1"]
			if got.Err != nil {
				t.Fatalf("the kubelet's retry: %v", got.Err)
			}
			if g := gpuOf(t, h2, 0); len(g.Instances) != 1 {
				t.Errorf("GPU 0 instances %+v after the retry, want one", g.Instances)
			}
			if st := h2.a.Status().DRA; len(st.Releasing) != 0 {
				t.Errorf("/status dra releasing %v, want none once the claim is checkpointed", st.Releasing)
			}
		})
	}
}

// A GPU that cannot be read right after its MIG device was made fails the
// claim and keeps the intent; the device is destroyed once the GPU reads
// again, and both the device plugin and DRA offer the GPU as it then is.
func TestDRAUnreadableAfterCreate(t *testing.T) {
	h, rec := intentLeft(t)
	if st := h.a.Status().DRA; len(st.Releasing) != 1 {
		t.Errorf("/status dra releasing %v, want the intent kept", st.Releasing)
	}
	h.step(Tick{})
	if g := gpuOf(t, h, 0); g.MIG.Current || len(g.Instances) != 0 {
		t.Errorf("GPU 0 once readable: MIG %v, instances %+v; want MIG off, none", g.MIG, g.Instances)
	}
	if whole, _ := partitionsOf(rec.last(), 0); !whole {
		t.Errorf("GPU 0 is not offered whole through DRA again")
	}
	if got := h.prepare(claim("uid-1", "one", "gpu-0-mig-3g40gb-4"))["uid-1"]; got.Err != nil {
		t.Errorf("the kubelet's retry: %v", got.Err)
	}
}

// A claim that fails but leaves something on the node (a bare GPU instance
// NVML would not destroy, MIG on) is planned for at once: the device plugin
// withholds the GPU, DRA blocks the slices.
func TestDRAFailedPrepareReplans(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	h := newHarness(t, node, withDRA(rec), withMIG())
	h.config(migOnDemand)
	if err := node.FailCalls(0, "GpuInstanceDestroy", nvml.ERROR_IN_USE, -1); err != nil {
		t.Fatal(err)
	}
	c := claim("uid-1", "two", "gpu-0-mig-3g40gb-4", "gpu-42")
	c.Devices[1].Request = "second"
	if got := h.prepare(c)["uid-1"]; got.Err == nil {
		t.Fatalf("Prepare: %+v, want refused", got)
	}
	if g := gpuOf(t, h, 0); len(g.GIsWithoutCI) != 1 {
		t.Fatalf("GPU 0 bare GPU instances %+v, want the one NVML would not destroy", g.GIsWithoutCI)
	}
	if cd := findGPU(h, 0); cd.Healthy {
		t.Errorf("the device plugin offers GPU 0 whole with a GPU instance left on it: %+v", cd)
	}
	if whole, parts := partitionsOf(rec.last(), 0); whole || slices.Contains(parts, "gpu-0-mig-3g40gb-4") {
		t.Errorf("DRA offers GPU 0 whole %v or the taken placement among %v", whole, parts)
	}
}

// After a reboot the MIG devices made for claims are gone, and so are the
// claims' CDI specs (a tmpfs): the kubelet prepares its claims again, and
// gets devices and specs that exist, not the answer from before (a device
// the sim makes again at the same place gets the same UUID).
func TestDRAPreparedClaimCheckedAfterReboot(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	dir := t.TempDir()
	cdiDir := t.TempDir()
	h := newHarnessIn(t, node, dir, withDRA(rec), withMIG(), withCDI(cdiDir))
	h.config(migOnDemand)
	before := h.prepare(claim("uid-1", "one", "gpu-0-mig-3g40gb-4"))["uid-1"]
	if before.Err != nil {
		t.Fatal(before.Err)
	}
	if err := node.Reset(0); err != nil { // MIG instances do not outlive it
		t.Fatal(err)
	}
	h2 := newHarnessIn(t, node, dir, withDRA(&draRecorder{}), withMIG(), withCDI(cdiDir), withCheckpoint())
	// Before its config the agent has not read the GPUs: the answer from
	// before the reboot is not given.
	if early := h2.prepare(claim("uid-1", "one", "gpu-0-mig-3g40gb-4"))["uid-1"]; early.Err == nil {
		t.Errorf("Prepare before the config: %+v, want refused", early)
	}
	h2.config(migOnDemand)
	after := h2.prepare(claim("uid-1", "one", "gpu-0-mig-3g40gb-4"))["uid-1"]
	if after.Err != nil {
		t.Fatal(after.Err)
	}
	g := gpuOf(t, h2, 0)
	if len(g.Instances) != 1 || devicemodel.CDIKind+"="+g.Instances[0].UUID != after.Devices[0].CDIDevices[0] {
		t.Errorf("GPU 0 instances %+v, answer %v", g.Instances, after.Devices[0].CDIDevices)
	}
	if names := specNames(t, cdiDir); !slices.Contains(names, g.Instances[0].UUID) {
		t.Errorf("the new device is not in the CDI spec %v", names)
	}
}

// Until its config is in force (awaited from a ConfigMap) the agent has not
// read the GPUs, so it prepares no claim; the kubelet asks again.
func TestDRAPrepareWaitsForConfig(t *testing.T) {
	h := newHarness(t, simNode(t, "pcie-4gpu"), withDRA(&draRecorder{}))
	got := h.prepare(claim("uid-1", "one", "gpu-0"))["uid-1"]
	if got.Err == nil || !strings.Contains(got.Err.Error(), "no config in force") {
		t.Fatalf("Prepare before the config: %+v, want refused", got)
	}
	h.config(wholeGPUs)
	if got := h.prepare(claim("uid-1", "one", "gpu-0"))["uid-1"]; got.Err != nil {
		t.Errorf("Prepare once the config is in force: %v", got.Err)
	}
}

// Admin access (monitoring) gets the device as it is, beside whoever holds
// it, and holds nothing itself; a request that tolerates the unhealthy
// taint gets the unhealthy device the scheduler gave it on purpose.
func TestDRAAdminAccessAndTolerations(t *testing.T) {
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "pcie-4gpu"), withDRA(rec))
	h.config(wholeGPUs)
	held := h.prepare(claim("uid-a", "a", "gpu-0"))["uid-a"]
	if held.Err != nil {
		t.Fatal(held.Err)
	}
	admin := claim("uid-admin", "watch", "gpu-0")
	admin.Devices[0].AdminAccess = true
	got := h.prepare(admin)["uid-admin"]
	if got.Err != nil || got.Devices[0].CDIDevices[0] != held.Devices[0].CDIDevices[0] {
		t.Fatalf("admin access to a held GPU: %+v, want %v", got, held.Devices[0].CDIDevices)
	}
	if got := h.prepare(claim("uid-b", "b", "gpu-0"))["uid-b"]; got.Err == nil || !strings.Contains(got.Err.Error(), "in use by ResourceClaim default/a") {
		t.Errorf("a second claim on the held GPU: %+v, want refused naming claim a", got)
	}
	h.unprepare(dra.ClaimRef{UID: "uid-a", Namespace: "default", Name: "a"})
	if cd := findGPU(h, 0); !cd.Healthy {
		t.Errorf("an admin-access claim withholds GPU 0 from the device plugin: %+v", cd)
	}
	if got := h.prepare(claim("uid-b", "b", "gpu-0"))["uid-b"]; got.Err != nil {
		t.Errorf("a claim beside an admin-access one: %v", got.Err)
	}

	h.step(HealthChanged{State: xidState(findGPU(h, 2).ID, 48)})
	if got := h.prepare(claim("uid-c", "c", "gpu-2"))["uid-c"]; got.Err == nil || !strings.Contains(got.Err.Error(), "unhealthy") {
		t.Errorf("an unhealthy GPU without a toleration: %+v, want refused", got)
	}
	tolerant := claim("uid-d", "d", "gpu-2")
	tolerant.Devices[0].ToleratesUnhealthy = true
	if got := h.prepare(tolerant)["uid-d"]; got.Err != nil {
		t.Errorf("an unhealthy GPU the request tolerates: %v", got.Err)
	}
}

// Admin access to an on-demand MIG device gets the instance a claim made
// there, and makes none itself.
func TestDRAAdminAccessDynamicMIG(t *testing.T) {
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange()), withDRA(&draRecorder{}), withMIG())
	h.config(migOnDemand)
	admin := claim("uid-admin", "watch", "gpu-0-mig-3g40gb-4")
	admin.Devices[0].AdminAccess = true
	if got := h.prepare(admin)["uid-admin"]; got.Err == nil || !strings.Contains(got.Err.Error(), "admin access creates none") {
		t.Errorf("admin access to a MIG device no one made: %+v", got)
	}
	if g := gpuOf(t, h, 0); g.MIG.Current {
		t.Errorf("admin access turned MIG on: %+v", g.MIG)
	}
	made := h.prepare(claim("uid-1", "one", "gpu-0-mig-3g40gb-4"))["uid-1"]
	if made.Err != nil {
		t.Fatal(made.Err)
	}
	if got := h.prepare(admin)["uid-admin"]; got.Err != nil || got.Devices[0].CDIDevices[0] != made.Devices[0].CDIDevices[0] {
		t.Errorf("admin access to the MIG device a claim made: %+v, want %v", got, made.Devices[0].CDIDevices)
	}
}

// An intent left by a failed attempt (its GPU could not be read after the
// creation) outlives a later attempt of the same claim: one that succeeds
// on another GPU, and one whose own intent could not be checkpointed. The
// device is destroyed, and MIG turned off, at the next good read.
func TestDRAEarlierIntentSurvivesRetries(t *testing.T) {
	for _, tt := range []struct {
		name  string
		retry func(t *testing.T, h *harness)
	}{
		{"retried on another GPU", func(t *testing.T, h *harness) {
			h.unprepare(dra.ClaimRef{UID: "uid-1", Namespace: "default", Name: "one"})
			if got := h.prepare(claim("uid-1", "one", "gpu-1-mig-3g40gb-4"))["uid-1"]; got.Err != nil {
				t.Fatalf("the retry on GPU 1: %v", got.Err)
			}
		}},
		{"retry's intent not checkpointed", func(t *testing.T, h *harness) {
			blocker := filepath.Join(t.TempDir(), "file")
			if err := os.WriteFile(blocker, nil, 0o644); err != nil {
				t.Fatal(err)
			}
			good := h.a.opts.StateDir
			h.a.opts.StateDir = filepath.Join(blocker, "state")
			if got := h.prepare(claim("uid-1", "one", "gpu-0-mig-3g40gb-4"))["uid-1"]; got.Err == nil {
				t.Fatalf("the retry without a checkpoint: %+v, want refused", got)
			}
			h.a.opts.StateDir = good
		}},
	} {
		t.Run(tt.name, func(t *testing.T) {
			h, _ := intentLeft(t)
			tt.retry(t, h)
			h.step(Tick{})
			if g := gpuOf(t, h, 0); g.MIG.Current || len(g.Instances) != 0 {
				t.Errorf("GPU 0: MIG %v, instances %+v; want MIG off, none", g.MIG, g.Instances)
			}
		})
	}
}

// While an intent on a GPU waits for a good read (its device may exist and
// MIG may be on, whatever the last read said), the GPU is not given whole.
func TestDRAWholeGPUNotPreparedOverPendingIntent(t *testing.T) {
	h, rec := intentLeft(t)
	if whole, _ := partitionsOf(rec.last(), 0); whole {
		t.Errorf("GPU 0 offered whole through DRA while its intent waits")
	}
	if got := h.prepare(claim("uid-2", "two", "gpu-0"))["uid-2"]; got.Err == nil {
		t.Errorf("GPU 0 prepared whole (%v) while MIG is on with a device left", got.Devices[0].CDIDevices)
	}
}

// A GPU the device plugin gave a container comes back to the DRA pool once
// an answer of the kubelet's, given long enough after the allocation, no
// longer lists it: the ledger settles without a MIG layout asking.
func TestDRALedgerSettlesFromBackgroundAnswers(t *testing.T) {
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "dgx-a100"), withDRA(rec))
	h.config(wholeGPUs)
	id := findGPU(h, 0).ID
	if err := h.allocate(ResourceGPU, id); err != nil {
		t.Fatal(err)
	}
	// An answer that came too soon after the allocation settles nothing.
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU), Answered: h.clock.Now()})
	if _, ok := rec.last().Device("gpu-0"); ok {
		t.Fatalf("gpu-0 back in the DRA pool on an answer given right after its allocation")
	}
	h.clock.Advance(time.Minute)
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU, id), Answered: h.clock.Now()})
	if _, ok := rec.last().Device("gpu-0"); ok {
		t.Fatalf("gpu-0 in the DRA pool while a container holds it")
	}
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU), Answered: h.clock.Now()})
	if _, ok := rec.last().Device("gpu-0"); !ok {
		t.Errorf("gpu-0 not back in the DRA pool after its container ended (ledger %v)", h.a.ledger)
	}
}

// Claim requests are handled in the order they came: a Prepare the kubelet
// gave up on, then its Unprepare, in one batch, leave nothing prepared; a
// Prepare nobody waits for any more is not acted upon.
func TestDRAClaimRequestsInOrder(t *testing.T) {
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange()), withDRA(&draRecorder{}), withMIG())
	h.config(wholeGPUs)
	p := make(chan map[types.UID]dra.Prepared, 1)
	u := make(chan map[types.UID]error, 1)
	h.step(ClaimsPrepare{Claims: []dra.Claim{claim("uid-1", "one", "gpu-0-mig-3g40gb-4")}, Reply: p},
		ClaimsUnprepare{Claims: []dra.ClaimRef{{UID: "uid-1", Namespace: "default", Name: "one"}}, Reply: u})
	<-p
	<-u
	if st := h.a.Status().DRA; len(st.Claims) != 0 {
		t.Errorf("claims %v after Prepare then Unprepare in one batch, want none", st.Claims)
	}
	if g := gpuOf(t, h, 0); len(g.Instances) != 0 {
		t.Errorf("GPU 0 instances %+v, want none", g.Instances)
	}
	h.step(ClaimsPrepare{Claims: []dra.Claim{claim("uid-2", "two", "gpu-0-mig-3g40gb-4")}, Reply: p, GaveUp: func() bool { return true }})
	if got := <-p; got["uid-2"].Err == nil {
		t.Errorf("a Prepare the kubelet gave up on: %+v, want refused", got["uid-2"])
	}
	if g := gpuOf(t, h, 0); len(g.Instances) != 0 {
		t.Errorf("GPU 0 instances %+v after a Prepare nobody waited for, want none", g.Instances)
	}
}

// A MIG device being made for a claim (or undone after its creation failed),
// and its GPU, are the claim's until that settles: a MIG layout may neither destroy the device nor change
// the GPU's mode meanwhile (the ledger refuses the doom, and the layout's plan
// keeps the device as held).
func TestDoomRefusesDevicesOfIntents(t *testing.T) {
	h, _ := intentLeft(t)
	inv, err := h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	g := inv.GPUs[0]
	h.a.ledger.SetInventory(inv.GPUs)
	if err := h.a.ledger.Doom([]string{g.UUID}, "a layout's mode change"); err == nil || !strings.Contains(err.Error(), "ResourceClaim default/one") {
		t.Errorf("Doom of GPU 0 with an intent on it: %v, want refused naming the claim", err)
	}
	m, ok := instanceAt(g, "3g.40gb", gpu.Placement{Start: 4, Size: 4})
	if !ok {
		t.Fatalf("GPU 0 has no 3g.40gb at 4 (the intent's device was made before the read failed): %+v", g.Instances)
	}
	if err := h.a.ledger.Doom([]string{m.UUID}, "a layout's destroy"); err == nil {
		t.Errorf("Doom of the intent's device %s: nil, want refused", m.UUID)
	}
	if d := h.a.ledger.Doomed(); len(d) != 0 {
		t.Errorf("doomed %v after refusals", d)
	}
	held := Holdings{Releasing: map[string]string{m.UUID: "claim default/one"}}.heldMIG(inv)
	if !strings.Contains(held[m.UUID], "default/one") {
		t.Errorf("heldMIG %v: the intent's device is not held, so a layout would destroy it", held)
	}
}
