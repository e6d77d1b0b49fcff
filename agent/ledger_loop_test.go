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

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/mig"
)

// The ledger as the loop, the device plugin and the MIG applier use it.

// killAfterApply is a MIG applier that, after each GPU's plan, acts as the
// kubelet would: it allocates a device the last published catalog offers
// as healthy, through the ledger as the device plugin's Allocate does.
type allocatingApplier struct {
	h        *harness
	next     *mig.Applier
	resource string
	accepted map[string]int // device UUID → the Apply call after which it was handed out
	refused  []string
	calls    int
}

func (ap *allocatingApplier) Apply(ctx context.Context, p mig.Plan, g mig.Guard) (mig.State, error) {
	st, err := ap.next.Apply(ctx, p, g)
	ap.calls++
	res := ap.h.pub.last().Resources[ap.resource]
	if res == nil {
		return st, err
	}
	for _, d := range res.Devices {
		if _, had := ap.accepted[d.Spec.VisibleID]; !d.Healthy || had {
			continue
		}
		if err := ap.h.a.Ledger().Allocate([]string{d.Spec.VisibleID}); err != nil {
			ap.refused = append(ap.refused, err.Error())
			continue
		}
		ap.accepted[d.Spec.VisibleID] = ap.calls
		break
	}
	return st, err
}

// Issue 23, defect 1: a MIG device Allocate handed out while a repartition
// ran over the GPUs was destroyed moments later (the old catalog offered
// it, healthy, for the whole apply). Now the devices a plan destroys are
// doomed and withdrawn before the first GPU is touched: the kubelet is not
// offered them, Allocate refuses them, and whatever it did hand out lives.
func TestAllocateDuringRepartition(t *testing.T) {
	node := simNode(t, "dgx-a100", sim.WithMIGEnabled())
	dir := t.TempDir()
	ap := &allocatingApplier{next: mig.NewApplier(node, dir, nil), resource: "nvidia.com/mig-1g.5gb", accepted: map[string]int{}}
	h := newHarnessIn(t, node, dir, func(h *harness) { h.opts.MIG = ap })
	ap.h = h
	h.config(mixedLayout(`{"1g.5gb": 7}`))
	if n := h.count("nvidia.com/mig-1g.5gb"); n != 56 {
		t.Fatalf("start: %d 1g.5gb devices, want 56", n)
	}
	clear(ap.accepted) // handed out before the edit: held, as the kubelet says
	h.hold.hold("nvidia.com/mig-1g.5gb")
	h.config(mixedLayout(`{"3g.20gb": 2}`))

	inv, err := h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	for uuid, after := range ap.accepted {
		if !inv.HasDevice(uuid) {
			t.Errorf("%s was handed out after Apply call %d and then destroyed", uuid, after)
		}
	}
	if len(ap.refused) != 0 {
		t.Errorf("the kubelet was offered doomed devices, and Allocate refused them: %v", ap.refused)
	}
	if got := h.count("nvidia.com/mig-3g.20gb"); got != 16 {
		t.Errorf("%d 3g.20gb devices after the edit, want 16 (nothing was handed out: every 1g.5gb was withdrawn first)", got)
	}
}

// Issue 23, defect 12: one GPU given twice through DRA Prepare: a MIG
// device of GPU 6 to one claim and GPU 6 whole to another in one call, or
// both to one claim.
func TestDRAPrepareNeverGivesOneGPUTwice(t *testing.T) {
	for _, tc := range []struct {
		name   string
		claims []dra.Claim
		// ok: the claims (by UID) that may be prepared; the others fail
		// saying want.
		ok   []string
		want string
	}{
		{"a MIG device, then its GPU whole, in one call",
			[]dra.Claim{claim("tx", "tx", "gpu-6-mig-1g10gb-0"), claim("ty", "ty", "gpu-6")}, []string{"tx"}, "device \"gpu-6\" is not offered on this node"},
		{"the GPU whole, then one of its MIG devices, in one call",
			[]dra.Claim{claim("ty", "ty", "gpu-6"), claim("tx", "tx", "gpu-6-mig-1g10gb-0")}, []string{"ty"}, "in use by ResourceClaim default/ty"},
		{"one claim, the GPU and one of its MIG devices",
			[]dra.Claim{claim("tz", "tz", "gpu-7", "gpu-7-mig-1g10gb-0")}, nil, "the same GPU"},
		{"one claim, a MIG device and its GPU",
			[]dra.Claim{claim("tz", "tz", "gpu-7-mig-1g10gb-0", "gpu-7")}, nil, "the same GPU"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			rec := &draRecorder{}
			node := simNode(t, "dgx-h100", sim.WithImmediateMIGModeChange())
			h := newHarness(t, node, withDRA(rec), withMIG())
			h.config(migOnDemand)
			got := h.prepare(tc.claims...)
			for _, c := range tc.claims {
				p := got[c.UID]
				if slices.Contains(tc.ok, string(c.UID)) {
					if p.Err != nil {
						t.Errorf("claim %s: %v", c.UID, p.Err)
					}
					continue
				}
				if p.Err == nil || !strings.Contains(p.Err.Error(), tc.want) {
					t.Errorf("claim %s prepared as %+v, want refused saying %q", c.UID, p, tc.want)
				}
			}
			inv, err := h.opts.Observer.Inventory()
			if err != nil {
				t.Fatal(err)
			}
			// What a refused claim made is undone: MIG devices exist only
			// for the claims prepared.
			made := 0
			for _, g := range inv.GPUs {
				made += len(g.Instances)
				if g.Index == 7 && (g.MIG.Current || g.MIG.Pending) {
					t.Errorf("GPU 7 left in MIG mode by a refused claim: %+v", g.MIG)
				}
			}
			wantMade := 0
			if slices.Contains(tc.ok, "tx") {
				wantMade = 1
			}
			if made != wantMade {
				t.Errorf("%d MIG devices on the node, want %d", made, wantMade)
			}
		})
	}
}

// Issue 23, defect 13: on a GPU that needs a reset to enable MIG, a failed
// on-demand Prepare left the enable pending and nothing to undo it; the
// GPU dropped out of the DRA pool and the next reset would have turned MIG
// on with no claim behind it.
func TestDRAFailedPrepareCancelsPendingMIGMode(t *testing.T) {
	rec := &draRecorder{}
	node := simNode(t, "dgx-h100") // no immediate MIG mode change: a reset is needed
	h := newHarness(t, node, withDRA(rec), withMIG())
	h.config(migOnDemand)
	p := h.prepare(claim("uid-3g", "three", "gpu-0-mig-3g40gb-4"))["uid-3g"]
	if p.Err == nil || !strings.Contains(p.Err.Error(), mig.PhaseResetRequired) {
		t.Fatalf("Prepare = %+v, want refused as %s", p, mig.PhaseResetRequired)
	}
	inv, err := h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	if g := inv.GPUs[0]; g.MIG.Current || g.MIG.Pending {
		t.Fatalf("GPU 0 after the failed Prepare: MIG %+v, want off and nothing pending", g.MIG)
	}
	if l := h.a.ledger; len(l.Releases())+len(l.Intents()) != 0 || l.Dynamic(inv.GPUs[0].UUID) {
		t.Errorf("ledger keeps %v / %v / dynamic %v after everything was undone", l.Releases(), l.Intents(), l.Snapshot().DynamicMIG)
	}
	if whole, _ := partitionsOf(rec.last(), 0); !whole {
		t.Errorf("GPU 0 is not offered whole through DRA: pool %v", poolNames(rec.last()))
	}
	if p := h.prepare(claim("uid-whole", "whole", "gpu-0"))["uid-whole"]; p.Err != nil {
		t.Errorf("a claim for GPU 0 whole after the failed Prepare: %v", p.Err)
	}
}

// Issue 29, defect 1: an allocation log that could not be rewritten at
// start (the state dir full or read-only) left the ledger without the
// allocations it had just read and without a log, and Allocate answered
// OK from memory only: a restart then knew neither allocation, and a MIG
// plan could destroy their devices under their containers. The ledger
// keeps what it read, refuses Allocate (Unavailable) while the log is not
// open, shows why on /status, and opens the log again, rewritten with what
// it holds, at the loop's next pass or the next Admit once it can.
func TestAllocationLogUnwritableAtStart(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "state")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	node := simNode(t, "pcie-4gpu")
	// The agent before the restart: GPU 0 allocated, and logged.
	h := newHarnessIn(t, node, dir)
	h.config(wholeGPUs)
	first, second := h.a.inv.GPUs[0].UUID, h.a.inv.GPUs[1].UUID
	if err := h.allocate(ResourceGPU, first); err != nil {
		t.Fatal(err)
	}
	h.a.Ledger().Close()

	// Restarted on a full state dir: the log reads, its rewrite fails.
	var full error = syscall.ENOSPC
	write := func(path string, data []byte, opts ...atomicfile.Options) error {
		if full != nil {
			return fmt.Errorf("write %s: %w", path, full)
		}
		return atomicfile.Write(path, data, opts...)
	}
	reg := prometheus.NewRegistry()
	var openErr error
	h2 := newHarnessIn(t, node, dir, withCheckpoint(), func(h *harness) {
		h.opts.Registerer = reg
		h.opts.Ledger, openErr = ledger.New(ledger.Options{StateDir: dir, Now: h.clock.Now, Logger: h.opts.Logger, Write: write})
	})
	defer h2.a.Ledger().Close()
	start := h2.clock.Now()
	logPath := filepath.Join(dir, ledger.AllocLogFile)
	if openErr == nil || !strings.Contains(openErr.Error(), logPath) || !strings.Contains(openErr.Error(), "no space left on device") {
		t.Errorf("ledger.New: %v, want an error naming %s and why", openErr, logPath)
	}
	h2.config(wholeGPUs)
	l := h2.a.Ledger()

	// (a) What the log held is still held: no plan may destroy it.
	if _, ok := l.Allocations()[first]; !ok {
		t.Errorf("allocations %v: %s, read from the log at start, is gone", l.Allocations(), first)
	}
	if err := l.Doom([]string{first}, "test"); err == nil || !strings.Contains(err.Error(), "held by a container the device plugin gave it") {
		t.Errorf("Doom %s = %v, want it refused as held", first, err)
	}

	// The kubelet lists the container from now on: the allocation stays
	// when the loop's passes below ask it.
	h2.hold.hold(ResourceGPU, first)

	// (b) Allocate is refused while the log is not open, saying why.
	h2.clock.Advance(time.Minute)
	err := h2.allocate(ResourceGPU, second)
	if !errors.Is(err, ledger.ErrLogUnavailable) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "no space left on device") {
		t.Errorf("Allocate while the log is not open = %v, want ErrLogUnavailable naming %s and why", err, dir)
	}
	if _, ok := l.Allocations()[second]; ok {
		t.Errorf("a refused allocation is in the ledger: %v", l.Allocations())
	}
	if got := l.LogFailures(); got != 1 {
		t.Errorf("LogFailures = %d, want 1 (the refused Allocate)", got)
	}

	// (d) /status, /readyz and gpu_agent_state_saved say so, since start.
	h2.step(Tick{})
	st := h2.a.Status().State
	if st == nil || !strings.Contains(st.Error, "allocation log: ") || !strings.Contains(st.Error, "no space left on device") || !st.ErrorSince.Equal(start) {
		t.Errorf("state %+v, want the allocation log's error since %v", st, start)
	}
	if got := testutil.ToFloat64(h2.a.metrics.stateSaved); got != 0 {
		t.Errorf("gpu_agent_state_saved = %v, want 0", got)
	}

	// (c) Space is freed: the loop's next pass opens the log, rewritten
	// with what the ledger holds; the status clears; Allocate is logged.
	full = nil
	h2.clock.Advance(time.Minute)
	h2.step(Tick{})
	if st := h2.a.Status().State; st == nil || st.Error != "" || testutil.ToFloat64(h2.a.metrics.stateSaved) != 1 {
		t.Errorf("after the space came back: state %+v", st)
	}
	if b, err := os.ReadFile(logPath); err != nil || !strings.Contains(string(b), first) {
		t.Errorf("log after the loop's pass (%v):\n%s", err, b)
	}
	if err := h2.allocate(ResourceGPU, second); err != nil {
		t.Fatalf("Allocate once the log is open: %v", err)
	}
	again, err := ledger.New(ledger.Options{StateDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	for _, u := range []string{first, second} {
		if _, ok := again.Allocations()[u]; !ok {
			t.Errorf("a restart reads %v from the log, without %s", again.Allocations(), u)
		}
	}
}
