package agent

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/mig"
)

// Violations TestSimulation found in the agent, each as a focused test.
// One not fixed yet skips, naming the issue, and the simulation lets
// violations of its kind pass (simKnown) so that seeds go on to find
// others. Whoever fixes one removes the Skip and its simKnown entry, and
// `go test -run '^TestSimulation$' ./agent -sim.known=false` shows whether
// any seed still breaks it. All of those below are fixed.

// Simulation, seed 84 (dgx-h100; 11 operations): a container holds a
// time-sliced replica of GPU 5 ("<uuid>::1"), the config goes to whole
// GPUs, and the catalog offers GPU 5 whole ("<uuid>") healthy: the
// kubelet, which counts device IDs, gives it to a second container that
// believes it has the GPU to itself. keepHeld keeps the held replica ID
// advertised (unhealthy), but nothing withholds the other IDs of the same
// silicon; the same happens to the GPU of a held MIG device when the MIG
// strategy becomes none (seed 1), and to a MIG device held under
// nvidia.com/mig-<profile> when the strategy becomes single. Where: Plan
// (desired.go) withholds the devices claims hold (withholdClaimed) but not
// those containers hold under another ID or resource.
func TestSimRegressHeldReplicaGPUOfferedWhole(t *testing.T) {
	for _, tc := range []struct {
		name   string
		node   *sim.Node
		before string // the config the container got its device under
		res    string
		id     func(h *harness) string
	}{
		{"time-sliced replica, then whole GPUs", simNode(t, "pcie-4gpu"), sliced2, ResourceGPU, func(h *harness) string {
			return deviceOn(h, ResourceGPU, 1, "::1")
		}},
		{"MIG device, then strategy none", simNode(t, "dgx-a100", sim.WithMIGEnabled()), mixedLayout(`{"1g.5gb": 7}`), "nvidia.com/mig-1g.5gb", func(h *harness) string {
			return deviceOn(h, "nvidia.com/mig-1g.5gb", 1, "")
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t, tc.node, withMIG())
			h.config(tc.before)
			id := tc.id(h)
			if id == "" {
				t.Fatalf("no %s device on GPU 1: %v", tc.res, resourceSummary(h.pub.last()))
			}
			if err := h.allocate(tc.res, id); err != nil {
				t.Fatal(err)
			}
			h.step(HoldingsChanged{Attribution: h.hold.hold(tc.res, id), Answered: h.clock.Now()})
			h.config(wholeGPUs)
			if d := findGPU(h, 1); d.ID == "" || d.Healthy {
				t.Errorf("GPU 1 offered whole and healthy (%s) while ml/trainer holds %s on it; want it unhealthy, naming the holder", d.ID, id)
			}
		})
	}
}

// Simulation, seed 129 (dgx-a100; 8 operations): on A100s in MIG mode
// with MIG devices a layout made, the config goes to whole GPUs (MIG
// strategy none offers each GPU whole) and a container gets GPU 4 whole;
// the DRA pool still offers GPU 4's MIG devices. A claim the scheduler
// gives one of them fails to prepare (the ledger sees the GPU held), and
// is retried for as long as the container runs. Where: planDRA (pool.go)
// drops a device a container holds, but not the MIG devices of a GPU a
// container holds whole.
func TestSimRegressPoolOffersMIGDevicesOfHeldGPU(t *testing.T) {
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "dgx-a100", sim.WithMIGEnabled()), withDRA(rec), withMIG())
	h.config(mixedLayout(`{"1g.5gb": 7}`))
	h.config(wholeGPUs)
	uuid := findGPU(h, 4).ID
	if err := h.allocate(ResourceGPU, uuid); err != nil {
		t.Fatal(err)
	}
	h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU, uuid), Answered: h.clock.Now()})
	var offered []string
	for _, d := range rec.last().Devices {
		if d.ParentUUID == uuid {
			offered = append(offered, d.Name)
		}
	}
	if len(offered) > 0 {
		t.Errorf("GPU 4 is held whole through the device plugin, and the DRA pool offers its MIG devices %s", strings.Join(offered, ", "))
	}
}

// deviceOn is the first device of res on GPU gpu whose ID ends in suffix
// ("" when none).
func deviceOn(h *harness, res string, gpu int, suffix string) string {
	r := h.pub.last().Resources[res]
	if r == nil {
		return ""
	}
	for _, d := range r.Devices {
		if d.GPU == gpu && strings.HasSuffix(d.ID, suffix) {
			return d.ID
		}
	}
	return ""
}

// Simulation, seeds 160 and 163 (with a long allocation log): once the
// allocation log was compacted (past compactAbove, as on any node after
// some hundreds of allocations) it no longer has the allocations the
// kubelet listed. A restarted agent then knows nothing of the containers
// that hold devices until pod-resources answers, and meanwhile offers
// their devices through DRA and prepares claims on them (seed 160: a
// container's MIG device in the pool), and applies a layout that turns MIG
// on under a GPU a container holds whole (seed 163, pod-resources
// unreachable: a mode change waits for no answer, only for the ledger,
// which is empty). Where: the ledger's knowledge of holders lives only in
// memory (Ledger.holders) and the uncompacted log; nothing survives a
// restart once the log is compacted (alloclog.go, compactLocked), and
// neither Prepare nor a MIG mode change waits for the first answer.
func TestSimRegressRestartForgetsListedHolders(t *testing.T) {
	for _, tc := range []struct {
		name  string
		node  func(t *testing.T) *sim.Node
		check func(t *testing.T, h *harness, rec *draRecorder, uuid string)
	}{
		{"a claim gets the GPU", func(t *testing.T) *sim.Node { return simNode(t, "pcie-4gpu") }, func(t *testing.T, h *harness, rec *draRecorder, uuid string) {
			h.config(wholeGPUs)
			if _, ok := rec.last().Device("gpu-0"); ok {
				t.Errorf("the DRA pool offers gpu-0, which a container holds")
			}
			if got := h.prepare(claim("uid-x", "x", "gpu-0"))["uid-x"]; got.Err == nil {
				t.Errorf("a claim was prepared on gpu-0, which a container holds: %+v", got)
			}
		}},
		{"a layout turns MIG on under it", func(t *testing.T) *sim.Node { return simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange()) }, func(t *testing.T, h *harness, _ *draRecorder, uuid string) {
			h.hold.fail(errUnreachable)
			h.config(mixedLayout(`{"1g.10gb": 7}`))
			if g := gpuOf(t, h, 0); g.MIG.Current {
				t.Errorf("GPU 0 (%s), which a container holds whole, was turned to MIG mode", uuid)
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node := tc.node(t)
			dir := t.TempDir()
			h := newHarnessIn(t, node, dir, withDRA(&draRecorder{}), withMIG(), withQuietLog())
			h.config(wholeGPUs)
			uuid := findGPU(h, 0).ID
			if err := h.allocate(ResourceGPU, uuid); err != nil {
				t.Fatal(err)
			}
			h.clock.Advance(time.Minute)
			h.step(HoldingsChanged{Attribution: h.hold.hold(ResourceGPU, uuid), Answered: h.clock.Now()})
			// A long-running node: the log is compacted (rewritten with
			// only what it must keep) after the kubelet listed the
			// container's allocation.
			logSize := func() int64 {
				fi, err := os.Stat(filepath.Join(dir, ledger.AllocLogFile))
				if err != nil {
					t.Fatal(err)
				}
				return fi.Size()
			}
			for compacted := false; !compacted; {
				before := logSize()
				if err := h.a.Ledger().Allocate([]string{"GPU-long-gone"}); err != nil {
					t.Fatal(err)
				}
				compacted = logSize() < before
			}

			// The agent restarts; pod-resources has not answered it yet.
			rec := &draRecorder{}
			h2 := newHarnessIn(t, node, dir, withDRA(rec), withMIG(), withCheckpoint())
			tc.check(t, h2, rec, uuid)
		})
	}
}

// releaseAllocator is a MIG applier that, before each plan that destroys
// a MIG device, does what the device plugin may do at any moment on its
// own goroutine: Allocate, here GPU gpu whole.
type releaseAllocator struct {
	next    *mig.Applier
	l       *ledger.Ledger
	gpu     string
	allowed []string // what Allocate handed out
}

func (ap *releaseAllocator) Apply(ctx context.Context, p mig.Plan, g mig.Guard) (mig.State, error) {
	if slices.ContainsFunc(p.Steps, func(s mig.Step) bool { return s.Op == mig.OpDestroy }) && ap.l.Allocate([]string{ap.gpu}) == nil {
		ap.allowed = append(ap.allowed, ap.gpu)
	}
	return ap.next.Apply(ctx, p, g)
}

// Simulation, seed 166 (dgx-h100): a claim whose first device, a MIG
// device made on demand on idle GPU 3, is made and whose second fails is
// undone at once (release): the intent is taken out of the ledger, then
// the device destroyed. Between the two the ledger holds nothing for the
// GPU, so an Allocate of GPU 3 whole (the catalog, published before the
// claim, offers it healthy) is accepted; the destroy then waits for that
// container, which got a GPU in MIG mode with the claim's MIG device on
// it, and the release is left undone until it exits. Where: release
// (dynamicmig.go) takes the intents (takeIntents), and Unprepare the claim
// (unclaim), before destroyPartition runs, and records what is left
// (setRelease) only after.
func TestSimRegressAllocateDuringRelease(t *testing.T) {
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	dir := t.TempDir()
	ap := &releaseAllocator{next: mig.NewApplier(node, dir, nil)}
	h := newHarnessIn(t, node, dir, withDRA(&draRecorder{}), func(h *harness) { h.opts.MIG = ap })
	ap.l = h.a.Ledger()
	h.config(wholeGPUs)
	ap.gpu = findGPU(h, 0).ID
	c := claim("uid-1", "two", "gpu-0-mig-3g40gb-4", "gpu-42")
	c.Devices[1].Request = "second"
	if got := h.prepare(c)["uid-1"]; got.Err == nil {
		t.Fatalf("Prepare: %+v, want refused (gpu-42 is not offered)", got)
	}
	if len(ap.allowed) > 0 {
		t.Errorf("GPU 0 (%s) was handed out whole while the MIG device made on it for the failed claim was being destroyed", ap.gpu)
	}
	if g := gpuOf(t, h, 0); g.MIG.Current || len(g.Instances) != 0 {
		t.Errorf("GPU 0 after the failed claim: MIG %v, instances %+v; want MIG off, none", g.MIG, g.Instances)
	}
}

// Simulation, seed 90 with -sim.steps=20 (dgx-a100): the agent is killed
// while a layout is applied, after NVML made a GPU instance and before its
// compute instance; the agent that follows is given a config with no
// layout (whole GPUs: MIG left as it is). The GPU instance without a
// compute instance stays for good: no MIG device stands for it, its
// slices are taken, and DRA blocks them. Where: only a layout's plan
// (mig.MakePlan, resumed from the journal) or a claim's release removes a
// bare GPU instance; a GPU no layout governs keeps it (dynamicGPUs counts
// it as blocked).
func TestSimRegressBareGPUInstanceAfterCrashWithoutLayout(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "gpus.json")
	node, err := sim.New("dgx-a100", sim.WithMIGEnabled(), sim.WithStateFile(state), sim.WithLogger(quietLogger()), sim.WithCrashAfter(1, func() { panic(crash{}) }))
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	h := newHarnessIn(t, node, dir, withMIG())
	func() {
		defer func() {
			if r := recover(); r != (crash{}) {
				t.Fatalf("recovered %v, want the simulated crash", r)
			}
		}()
		h.config(mixedLayout(`{"1g.5gb": 7}`))
	}()
	h.a.Ledger().Close()
	node.Close()

	node2, err := sim.New("dgx-a100", sim.WithStateFile(state))
	if err != nil {
		t.Fatal(err)
	}
	node2.Init()
	t.Cleanup(func() { node2.Close() })
	h2 := newHarnessIn(t, node2, dir, withMIG(), withCheckpoint())
	if g := gpuOf(t, h2, 0); len(g.GIsWithoutCI) != 1 {
		t.Fatalf("after the crash GPU 0 has bare GPU instances %+v, want the one made before it", g.GIsWithoutCI)
	}
	h2.config(wholeGPUs)
	for range 3 {
		h2.clock.Advance(time.Minute)
		h2.step(Tick{})
	}
	if g := gpuOf(t, h2, 0); len(g.GIsWithoutCI) != 0 {
		t.Errorf("GPU 0 keeps a GPU instance without a compute instance: %+v", g.GIsWithoutCI)
	}
}

// Simulation, seed 148 with -sim.steps=20 (dgx-h100): a claim's MIG device
// was made but its GPU could not be read right after (the intent stands,
// as it should); the DRA pool still offers partitions over the intent's
// placement, where the device may well exist: a claim the scheduler gives
// one fails to prepare, or waits for the intent to be undone. The whole
// GPU is withheld meanwhile (TestDRAWholeGPUNotPreparedOverPendingIntent),
// its partitions are not. Where: dynamicGPUs (pool.go) blocks the
// placements of the instances the inventory shows and of bare GPU
// instances, not those of intents and releases whose device a stale
// inventory does not show. Since a GPU a MIG plan ran on is offered not
// at all until it is read completely (withdrawTouched), this sequence no
// longer reaches the pool planner with a stale record;
// TestPoolBlocksUnsettledPlacements checks the planner's part.
func TestSimRegressPoolOffersPartitionsOverIntent(t *testing.T) {
	_, rec := intentLeft(t)
	_, parts := partitionsOf(rec.last(), 0)
	var over []string
	for _, name := range parts {
		d, _ := rec.last().Device(name)
		if d.Placement.Start < 8 && d.Placement.Start+d.Placement.Size > 4 {
			over = append(over, name)
		}
	}
	if len(over) > 0 {
		t.Errorf("while the intent for 3g.40gb at 4 on GPU 0 waits (its device may exist), the pool offers %s", strings.Join(over, ", "))
	}
}

// Simulation, seed 72 with -sim.steps=30 (dgx-h100): GPU 2's MIG devices
// cannot be listed (GetMigDeviceHandleByIndex fails), so each read keeps
// its last record, as it should for a GPU the agent did not touch. A
// layout then repartitions GPU 2 (planned from that record, which still
// held); the read after the apply is partial again and keeps the record
// from before the apply, so the catalog offers, healthy, the MIG devices
// the apply destroyed, and the kubelet is handed one NVML no longer has.
// Where: settle (observe.go) keeps the last record of a partly read GPU
// even when the agent changed that GPU since; applyMIG (step.go) runs
// plans on GPUs whose record was not read afresh.
func TestSimRegressPartlyReadAfterApplyKeepsDestroyedDevices(t *testing.T) {
	node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
	h := newHarness(t, node, withMIG())
	layout := func(counts string) string {
		return "version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n      devices:\n      - devices: [0]\n        mig-enabled: true\n        mig-devices: " + counts + "\n"
	}
	h.config(layout(`{"1g.10gb": 7}`))
	if n := h.count("nvidia.com/mig-1g.10gb"); n != 7 {
		t.Fatalf("%d 1g.10gb devices, want 7 on GPU 0", n)
	}
	if err := node.FailCalls(0, "GetMigDeviceHandleByIndex", nvml.ERROR_UNKNOWN, -1); err != nil {
		t.Fatal(err)
	}
	h.config(layout(`{"3g.40gb": 2}`))
	if g := gpuOf(t, h, 0); len(g.Instances) == 7 {
		t.Fatalf("GPU 0 was not repartitioned: %+v", g.Instances)
	}
	var gone []string
	if r := h.pub.last().Resources["nvidia.com/mig-1g.10gb"]; r != nil {
		for _, d := range r.Devices {
			if d.Healthy {
				gone = append(gone, d.ID)
			}
		}
	}
	if len(gone) > 0 {
		t.Errorf("after GPU 0 was repartitioned to 2x 3g.40gb, the catalog offers healthy %d 1g.10gb devices from before: %s", len(gone), strings.Join(gone, ", "))
	}
}

// Simulation, seed 1962 (dgx-h100; 109 operations): the agent is killed
// while it unprepares a claim whose MIG device it made, after NVML
// destroyed the device and before MIG went back off and the checkpoint
// forgot the claim. The next agent restores the claim; its device is
// gone, so nothing connects the claim to its GPU any more: the catalog
// offers the GPU whole (in MIG mode, with nothing on it) and the ledger
// hands it to a container. When the kubelet asks again to unprepare, the
// release cannot turn MIG off under that container, and waits until it
// exits. Where: the ledger finds a claim's GPU through the inventory
// (overlaps, places; withholdClaimed likewise), not through the claim's
// own record of it (PreparedClaimDevice.Parent). Since the agent
// checkpoints the GPUs MIG plans touch before the plan runs (issue 29,
// defect 6), the release is on disk before NVML destroys anything, unless
// that write failed: the checkpoint from before the Unprepare, put back
// after the crash, stands for that.
func TestSimRegressCrashMidUnprepareLeavesGPUUnguarded(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "gpus.json")
	// NVML changes: MIG on, GPU instance, compute instance (Prepare); then
	// compute instance, GPU instance destroyed (Unprepare): killed there.
	node, err := sim.New("dgx-h100", sim.WithImmediateMIGModeChange(), sim.WithStateFile(state), sim.WithLogger(quietLogger()),
		sim.WithCrashAfter(5, func() { panic(crash{}) }))
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	h := newHarnessIn(t, node, dir, withDRA(&draRecorder{}), withMIG())
	h.config(migOnDemand)
	if got := h.prepare(claim("uid-1", "one", "gpu-0-mig-3g40gb-4"))["uid-1"]; got.Err != nil {
		t.Fatal(got.Err)
	}
	ckpt := filepath.Join(dir, CheckpointFile)
	prepared, err := os.ReadFile(ckpt)
	if err != nil {
		t.Fatal(err)
	}
	func() {
		defer func() {
			if r := recover(); r != (crash{}) {
				t.Fatalf("recovered %v, want the simulated crash", r)
			}
		}()
		h.unprepare(dra.ClaimRef{UID: "uid-1", Namespace: "default", Name: "one"})
	}()
	h.a.Ledger().Close()
	node.Close()
	if err := os.WriteFile(ckpt, prepared, 0o600); err != nil {
		t.Fatal(err)
	}

	node2, err := sim.New("dgx-h100", sim.WithImmediateMIGModeChange(), sim.WithStateFile(state))
	if err != nil {
		t.Fatal(err)
	}
	node2.Init()
	t.Cleanup(func() { node2.Close() })
	h2 := newHarnessIn(t, node2, dir, withDRA(&draRecorder{}), withMIG(), withCheckpoint())
	h2.config(migOnDemand)
	if g := gpuOf(t, h2, 0); !g.MIG.Current || len(g.Instances) != 0 {
		t.Fatalf("after the crash GPU 0 is MIG %v with instances %+v; want MIG on, the claim's device gone", g.MIG, g.Instances)
	}
	uuid := gpuOf(t, h2, 0).UUID
	if d := findGPU(h2, 0); d.Healthy {
		t.Errorf("the catalog offers GPU 0 whole and healthy while claim default/one, restored, still holds a MIG device on it")
	}
	if err := h2.a.Ledger().Allocate([]string{uuid}); err == nil {
		t.Errorf("the ledger hands out GPU 0 whole while claim default/one, restored, still holds a MIG device on it")
	}
}

// Simulation, seed 84 (dgx-h100; 8 operations): a container is handed a
// time-sliced replica of GPU 5 ("<uuid>::1"), the config goes to whole
// GPUs before the kubelet lists that container, and Allocate of GPU 5
// whole ("<uuid>") is accepted: two containers, one believing it has the
// GPU to itself. The catalog withholds what the kubelet lists
// (withholdHeldSilicon), not what it has not listed yet; the ledger knew
// only UUIDs, and the same UUID again is the kubelet's to give. The ledger
// now keeps each allocation's resource and whether it is a replica
// (persisted in the allocation log), and refuses the same silicon under
// another name until the kubelet shows the first container gone.
func TestSimRegressUnlistedHandoutUnderTwoNames(t *testing.T) {
	const renamed = "version: v1\nconfigs:\n  default:\n    sharing:\n      timeSlicing:\n        renameByDefault: true\n        resources:\n        - name: nvidia.com/gpu\n          replicas: 2\n"
	type handout struct{ res, id string }
	for _, tc := range []struct {
		name          string
		node          func(t *testing.T) *sim.Node
		before, after string
		first, second func(h *harness) handout
		restart       bool   // the agent restarts between the two
		refused       string // in the refusal ("": accepted)
	}{
		{"time-sliced replica, then whole GPUs", pcie4, sliced2, wholeGPUs,
			func(h *harness) handout { return handout{ResourceGPU, deviceOn(h, ResourceGPU, 1, "::1")} },
			func(h *harness) handout { return handout{ResourceGPU, findGPU(h, 1).ID} }, false, "replica"},
		{"time-sliced replica, restart, then whole GPUs", pcie4, sliced2, wholeGPUs,
			func(h *harness) handout { return handout{ResourceGPU, deviceOn(h, ResourceGPU, 1, "::1")} },
			func(h *harness) handout { return handout{ResourceGPU, findGPU(h, 1).ID} }, true, "replica"},
		{"whole GPU, then a renamed shared resource", pcie4, wholeGPUs, renamed,
			func(h *harness) handout { return handout{ResourceGPU, findGPU(h, 1).ID} },
			func(h *harness) handout {
				return handout{"nvidia.com/gpu.shared", deviceOn(h, "nvidia.com/gpu.shared", 1, "::0")}
			}, false, "under nvidia.com/gpu"},
		{"MIG device, then strategy none", a100MIG, mixedLayout(`{"1g.5gb": 7}`), wholeGPUs,
			func(h *harness) handout {
				return handout{"nvidia.com/mig-1g.5gb", deviceOn(h, "nvidia.com/mig-1g.5gb", 1, "")}
			},
			func(h *harness) handout { return handout{ResourceGPU, findGPU(h, 1).ID} }, false, "MIG device"},
		// What the kubelet may do: another replica of a shared GPU, and the
		// same device again once its container is gone.
		{"two replicas of one GPU", pcie4, sliced2, sliced2,
			func(h *harness) handout { return handout{ResourceGPU, deviceOn(h, ResourceGPU, 1, "::1")} },
			func(h *harness) handout { return handout{ResourceGPU, deviceOn(h, ResourceGPU, 1, "::0")} }, false, ""},
		{"the same whole GPU again", pcie4, wholeGPUs, wholeGPUs,
			func(h *harness) handout { return handout{ResourceGPU, findGPU(h, 1).ID} },
			func(h *harness) handout { return handout{ResourceGPU, findGPU(h, 1).ID} }, true, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			node, dir := tc.node(t), t.TempDir()
			h := newHarnessIn(t, node, dir, withMIG(), withQuietLog())
			h.config(tc.before)
			first := tc.first(h)
			if first.id == "" {
				t.Fatalf("no %s device on GPU 1: %v", first.res, resourceSummary(h.pub.last()))
			}
			if err := h.allocate(first.res, first.id); err != nil {
				t.Fatal(err)
			}
			if tc.restart {
				h.a.Ledger().Close()
				h = newHarnessIn(t, node, dir, withMIG(), withQuietLog(), withCheckpoint())
			}
			h.config(tc.after)
			second := tc.second(h)
			if second.id == "" {
				t.Fatalf("no %s device on GPU 1: %v", second.res, resourceSummary(h.pub.last()))
			}
			err := h.allocate(second.res, second.id)
			switch {
			case tc.refused == "" && err != nil:
				t.Errorf("Allocate of %s %s after %s %s: %v, want it accepted", second.res, second.id, first.res, first.id, err)
			case tc.refused != "" && (!errors.Is(err, ledger.ErrHeld) || !strings.Contains(err.Error(), tc.refused)):
				t.Errorf("Allocate of %s %s while %s %s is not yet listed: %v, want ErrHeld saying %q",
					second.res, second.id, first.res, first.id, err, tc.refused)
			}
		})
	}
}

func pcie4(t *testing.T) *sim.Node   { return simNode(t, "pcie-4gpu") }
func a100MIG(t *testing.T) *sim.Node { return simNode(t, "dgx-a100", sim.WithMIGEnabled()) }

// The pool planner itself: a placement an intent or a release stands on
// is offered as no partition, whatever the GPU's record shows (after a
// failed read the record may be one from before the device was made).
func TestPoolBlocksUnsettledPlacements(t *testing.T) {
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange()), withDRA(&draRecorder{}), withMIG(), withQuietLog())
	h.config(migOnDemand)
	uuid := findGPU(h, 0).ID
	at := gpu.Placement{Start: 4, Size: 4}
	for _, tc := range []struct {
		name      string
		unsettled []PreparedClaimDevice
		wantOver  bool // partitions over 4-7 offered
	}{
		{"nothing unsettled", nil, true},
		{"an intent at 4", []PreparedClaimDevice{{Created: true, Parent: uuid, Profile: "3g.40gb", Placement: at}}, false},
		{"a release at 4, its device named", []PreparedClaimDevice{{UUID: "MIG-gone", Created: true, Parent: uuid, Profile: "3g.40gb", Placement: at}}, false},
		{"an intent on another GPU", []PreparedClaimDevice{{Created: true, Parent: "GPU-other", Profile: "3g.40gb", Placement: at}}, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s := h.a.snapshot()
			s.Holdings.Unsettled = tc.unsettled
			var over []string
			for _, d := range planDRA(s).Devices {
				if d.Partition && d.ParentUUID == uuid && d.Placement.Overlaps(at) {
					over = append(over, d.Name)
				}
			}
			if got := len(over) > 0; got != tc.wantOver {
				t.Errorf("partitions of GPU 0 over memory slices 4-7: %v; want offered: %v", over, tc.wantOver)
			}
		})
	}
}

// crashIn runs f, which the simulated node crashes (sim.WithCrashAfter),
// and fails the test if it does not.
func crashIn(t *testing.T, f func()) {
	t.Helper()
	defer func() {
		if r := recover(); r != (crash{}) {
			t.Fatalf("recovered %v, want the simulated crash", r)
		}
	}()
	f()
}

// restartOn starts the node again from its state file (no faults, no
// crash armed) and an agent on it from what the last one checkpointed.
func restartOn(t *testing.T, h *harness, profile, state string, opts ...sim.Option) *harness {
	t.Helper()
	h.a.Ledger().Close()
	h.node.Close()
	node, err := sim.New(profile, append(opts, sim.WithStateFile(state), sim.WithLogger(quietLogger()))...)
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	t.Cleanup(func() { node.Close() })
	return newHarnessIn(t, node, h.dir, withDRA(&draRecorder{}), withMIG(), withCheckpoint())
}

// Simulation, seed 1047 (dgx-h100; 49 operations; seed 7165 leaves the
// device made orphaned instead): the agent is killed while it makes a claim's MIG device on a GPU already in MIG mode,
// after NVML refused the compute instance and the applier removed the GPU
// instance again, before the plan's journal was dropped. The next agent
// undoes the claim's intent (nothing is left at its placement) and the
// journal stays. The next claim on that GPU wants a device of the same
// profile elsewhere: its plan asks for the same counts as the journal's, so
// the applier resumes the journal and makes the first claim's device; the
// second claim fails ("created but NVML does not list it"), and the device
// made, which no claim holds, is offered through the device plugin and
// handed to a container while the simulation still counts it DRA's. Where:
// mig.Applier resumes a journal whose Want (counts per profile) equals the
// new plan's; a claim's plan is one device at one placement, which counts
// do not say.
func TestSimRegressCrashMidPrepareJournalResumedForAnotherClaim(t *testing.T) {
	dir := t.TempDir()
	state := filepath.Join(dir, "gpus.json")
	// NVML changes: the GPU instance made, then destroyed when its
	// compute instance fails: killed there.
	node, err := sim.New("dgx-a100", sim.WithMIGEnabled(), sim.WithStateFile(state), sim.WithLogger(quietLogger()),
		sim.WithCrashAfter(2, func() { panic(crash{}) }))
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	h := newHarnessIn(t, node, dir, withDRA(&draRecorder{}), withMIG())
	h.config(migOnDemand)
	if err := node.FailCalls(0, "GpuInstanceCreateComputeInstance", nvml.ERROR_UNKNOWN, 1); err != nil {
		t.Fatal(err)
	}
	crashIn(t, func() { h.prepare(claim("uid-1", "one", "gpu-0-mig-3g20gb-0")) })

	h2 := restartOn(t, h, "dgx-a100", state)
	h2.config(migOnDemand)
	got := h2.prepare(claim("uid-2", "two", "gpu-0-mig-3g20gb-4"))["uid-2"]
	if got.Err != nil {
		t.Errorf("Prepare of 3g.20gb at 4 on GPU 0 after the crash: %v", got.Err)
	}
	if l := layout(gpuOf(t, h2, 0)); !slices.Equal(l, []string{"3g.20gb@4"}) {
		t.Errorf("GPU 0 has MIG devices %v; want only claim two's, 3g.20gb@4", l)
	}
}

// layout is g's MIG devices as profile@start, in order.
func layout(g gpu.GPU) []string {
	var out []string
	for _, m := range g.Instances {
		out = append(out, fmt.Sprintf("%s@%d", m.Profile, m.Placement.Start))
	}
	slices.Sort(out)
	return out
}

// Simulation, seed 3715 (dgx-h100; 26 operations), and 6095, 6885, 7306:
// the agent is killed while a layout is applied, after NVML made a GPU
// instance and before its compute instance; the config has meanwhile become
// one whose layout does not fit the GPUs, so the restarted agent, which has
// no last good config of its own, serves the built-in default: no layout is
// in force. The GPU instance without a compute instance stays for good.
// Where: removeBare (bare.go) leaves alone every GPU the selected config's
// layout names (governed), a layout that does not fit included, although
// Plan then serves the last config that fitted, whose layout (here none) is
// the one in force.
func TestSimRegressBareGPUInstanceUnderUnfitLayout(t *testing.T) {
	on0 := func(counts string) string {
		return "version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n      devices:\n      - devices: [0]\n        mig-enabled: true\n        mig-devices: " + counts + "\n"
	}
	dir := t.TempDir()
	state := filepath.Join(dir, "gpus.json")
	// NVML changes: MIG on, the first GPU instance: killed there.
	node, err := sim.New("dgx-h100", sim.WithImmediateMIGModeChange(), sim.WithStateFile(state), sim.WithLogger(quietLogger()),
		sim.WithCrashAfter(2, func() { panic(crash{}) }))
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	h := newHarnessIn(t, node, dir, withMIG())
	crashIn(t, func() { h.config(on0(`{"1g.10gb": 7}`)) })

	h2 := restartOn(t, h, "dgx-h100", state, sim.WithImmediateMIGModeChange())
	if g := gpuOf(t, h2, 0); len(g.GIsWithoutCI) != 1 {
		t.Fatalf("after the crash GPU 0 has bare GPU instances %+v, want the one made before it", g.GIsWithoutCI)
	}
	h2.config(on0(`{"7g.80gb": 2}`))
	if h2.a.Status().Config.Error == "" {
		t.Fatalf("2× 7g.80gb on GPU 0 was accepted; want it refused (it does not fit)")
	}
	for range 3 {
		h2.clock.Advance(time.Minute)
		h2.step(Tick{})
	}
	if g := gpuOf(t, h2, 0); len(g.GIsWithoutCI) != 0 {
		t.Errorf("GPU 0 keeps a GPU instance without a compute instance under a layout not in force: %+v", g.GIsWithoutCI)
	}
}

// Simulation, seed 20 of -sim.steps=60 (dgx-h100; 41 operations, the
// state dir filling and emptying): a checkpoint that could not be written kept its error for good when what
// it was to hold changed back to what the file on disk already had (a GPU
// cordoned and uncordoned while the state dir was full): the write was
// skipped as needless, and the error it would have cleared stayed on
// /status with gpu_agent_state_saved 0 although everything was saved.
func TestSimRegressCheckpointErrorClearsWhenDiskHasIt(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	full := false
	h := newHarnessIn(t, simNode(t, "pcie-4gpu"), dir, func(h *harness) { h.opts.WriteState = fillable(&full) })
	h.config(wholeGPUs)
	if st := h.a.Status().State; st == nil || st.Error != "" {
		t.Fatalf("state %+v, want the checkpoint written", st)
	}
	full = true
	h.step(CordonChanged{GPUs: []string{"1"}})
	if st := h.a.Status().State; st == nil || !strings.Contains(st.Error, "no space left on device") {
		t.Fatalf("state %+v, want the checkpoint's error while the state dir is full", st)
	}
	h.step(CordonChanged{})
	full = false
	h.step(Tick{})
	if st := h.a.Status().State; st == nil || st.Error != "" {
		t.Errorf("state %+v: the checkpoint on disk holds what the agent holds, yet an error stands", st)
	}
	cp, err := LoadCheckpoint(dir)
	if err != nil || cp == nil || len(cp.Cordon) != 0 {
		t.Errorf("checkpoint %+v (%v), want it without a cordon", cp, err)
	}
}

// fillable is atomicfile.Write on a state dir that is full while *full.
func fillable(full *bool) func(path string, data []byte, opts ...atomicfile.Options) error {
	return func(path string, data []byte, opts ...atomicfile.Options) error {
		if *full {
			return fmt.Errorf("write %s: %w", path, syscall.ENOSPC)
		}
		return atomicfile.Write(path, data, opts...)
	}
}

// fillableLog is the allocation log opened for appending on a state dir
// that is full while *full: a write then stores half the record and fails.
func fillableLog(full *bool) func(path string) (ledger.LogFile, error) {
	return func(path string) (ledger.LogFile, error) {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
		if err != nil {
			return nil, err
		}
		return fullLogFile{f, full}, nil
	}
}

type fullLogFile struct {
	*os.File
	full *bool
}

func (f fullLogFile) Write(b []byte) (int, error) {
	if !*f.full {
		return f.File.Write(b)
	}
	n, _ := f.File.Write(b[:len(b)/2])
	return n, &os.PathError{Op: "write", Path: f.Name(), Err: syscall.ENOSPC}
}

// Simulation, seed 27 of -sim.steps=60 (dgx-a100; 29 operations, the
// state dir filling and emptying): an Allocate refused because its record
// could not be appended left the allocation log's error standing until
// the next Allocate that succeeded. On a node nothing allocates on, the
// state dir's room came back and /status said for good that the state was
// not saved (gpu_agent_state_saved 0). The loop's pass tries the log
// again (ledger.RetryLog): rewritten whole, it clears the error.
func TestSimRegressAllocationLogErrorClearsWhenDiskHasRoom(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	full := false
	h := newHarnessIn(t, simNode(t, "pcie-4gpu"), dir, func(h *harness) {
		l, err := ledger.New(ledger.Options{StateDir: dir, Now: h.clock.Now, Write: fillable(&full), OpenLog: fillableLog(&full)})
		if err != nil {
			t.Fatal(err)
		}
		h.opts.Ledger = l
	})
	defer h.a.Ledger().Close()
	h.config(wholeGPUs)
	full = true
	if err := h.allocate(ResourceGPU, h.a.inv.GPUs[0].UUID); !errors.Is(err, ledger.ErrLogUnavailable) {
		t.Fatalf("Allocate on a full state dir = %v, want ErrLogUnavailable", err)
	}
	h.step(Tick{})
	if st := h.a.Status().State; st == nil || !strings.Contains(st.Error, "allocation log: ") {
		t.Fatalf("state %+v, want the allocation log's error while the state dir is full", st)
	}
	full = false
	h.clock.Advance(time.Minute)
	h.step(Tick{})
	if st := h.a.Status().State; st == nil || st.Error != "" {
		t.Errorf("state %+v: nothing is unsaved and the state dir has room, yet an error stands", st)
	}
	if err := h.allocate(ResourceGPU, h.a.inv.GPUs[0].UUID); err != nil {
		t.Errorf("Allocate once the state dir has room: %v", err)
	}
}
