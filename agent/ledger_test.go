package agent

import (
	"context"
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
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

// The ledger's rule, state by state: what Allocate refuses and why, and
// what Doom refuses. A MIG device and its GPU are one device to it.
func TestLedgerStates(t *testing.T) {
	const gpu0, mig0, mig1, gpu1 = "GPU-0", "MIG-0a", "MIG-0b", "GPU-1"
	inventory := []gpu.GPU{
		{UUID: gpu0, Instances: []gpu.MIGInstance{
			{UUID: mig0, Profile: "1g.10gb", Placement: gpu.Placement{Start: 0, Size: 1}},
			{UUID: mig1, Profile: "1g.10gb", Placement: gpu.Placement{Start: 1, Size: 1}},
		}},
		{UUID: gpu1},
	}
	clock := newClock()
	claimOf := func(devs ...PreparedClaimDevice) PreparedClaim {
		return PreparedClaim{Namespace: "ml", Name: "c", Devices: devs}
	}
	for _, tc := range []struct {
		name  string
		setup func(l *Ledger) error
		// allocate: device → "" (accepted) or the refusal's words.
		allocate map[string]string
		// doom: device → "" (doomed) or the refusal's words.
		doom map[string]string
	}{
		{name: "free", allocate: map[string]string{gpu0: "", mig0: "", gpu1: ""}, doom: map[string]string{mig0: "", gpu1: ""}},
		{name: "a MIG device doomed", setup: func(l *Ledger) error { return l.Doom([]string{mig0}, "layout X") },
			allocate: map[string]string{mig0: "being repartitioned: layout X", gpu0: "being repartitioned", mig1: "", gpu1: ""}},
		{name: "a GPU doomed (mode change)", setup: func(l *Ledger) error { return l.Doom([]string{gpu0}, "MIG on") },
			allocate: map[string]string{mig0: "being repartitioned: MIG on", mig1: "being repartitioned", gpu1: ""}},
		{name: "allocated through the device plugin", setup: func(l *Ledger) error { return l.Allocate([]string{mig0}) },
			allocate: map[string]string{mig0: "", mig1: ""}, // the kubelet may allocate one again (a restarted container)
			doom:     map[string]string{mig0: "held by a container the device plugin gave it at 2026-11-23T12:00:00Z", gpu0: "held by a container the device plugin gave its MIG device MIG-0a", mig1: ""}},
		{name: "a MIG device prepared for a claim", setup: func(l *Ledger) error {
			return l.claim("uid", claimOf(PreparedClaimDevice{PreparedDevice: dra.PreparedDevice{Device: "gpu-0-mig"}, UUID: mig0}))
		}, allocate: map[string]string{mig0: "prepared for ResourceClaim ml/c through DRA", gpu0: "prepared for ResourceClaim ml/c", mig1: ""},
			doom: map[string]string{mig0: "prepared for ResourceClaim ml/c", gpu0: "prepared for ResourceClaim ml/c", mig1: ""}},
		{name: "admin access holds nothing", setup: func(l *Ledger) error {
			return l.claim("uid", claimOf(PreparedClaimDevice{PreparedDevice: dra.PreparedDevice{Device: "gpu-0"}, UUID: gpu0, AdminAccess: true}))
		}, allocate: map[string]string{gpu0: "", mig0: ""}},
		{name: "a MIG device being made for a claim", setup: func(l *Ledger) error {
			return l.intend("uid", claimOf(), PreparedClaimDevice{Created: true, Parent: gpu1, Profile: "1g.10gb", Placement: gpu.Placement{Start: 0, Size: 1}})
		}, allocate: map[string]string{gpu1: "a MIG device made for ResourceClaim ml/c", gpu0: ""}},
		{name: "left by a released claim", setup: func(l *Ledger) error {
			l.setRelease("uid", claimOf(PreparedClaimDevice{Created: true, UUID: mig1, Parent: gpu0}))
			return nil
		}, allocate: map[string]string{mig1: "a MIG device made for ResourceClaim ml/c", gpu0: "made for ResourceClaim ml/c", mig0: "", gpu1: ""}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Each question on a ledger of its own: an answer changes it.
			fresh := func() *Ledger {
				l := newLedger(clock.Now)
				l.setInventory(inventory)
				if tc.setup != nil {
					if err := tc.setup(l); err != nil {
						t.Fatal(err)
					}
				}
				return l
			}
			for dev, want := range tc.allocate {
				err := fresh().Allocate([]string{dev})
				checkRefusal(t, "Allocate "+dev, err, want)
				if err != nil && status.Code(err) != codes.FailedPrecondition {
					t.Errorf("Allocate %s: code %v, want FailedPrecondition", dev, status.Code(err))
				}
			}
			for dev, want := range tc.doom {
				checkRefusal(t, "Doom "+dev, fresh().Doom([]string{dev}, "test"), want)
			}
		})
	}
}

func checkRefusal(t *testing.T, what string, err error, want string) {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Errorf("%s refused: %v", what, err)
	case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
		t.Errorf("%s = %v, want a refusal saying %q", what, err, want)
	}
}

// An allocation is in the log when Allocate returns: a ledger opened on the
// same directory without the first being closed (the process was killed)
// has it, and a torn last line (killed mid-write) costs only that line.
func TestAllocationLogSurvivesKill(t *testing.T) {
	dir := t.TempDir()
	clock := newClock()
	l, err := NewLedger(dir, clock.Now, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Allocate([]string{"MIG-a", "MIG-b"}); err != nil {
		t.Fatal(err)
	}
	clock.Advance(time.Second)
	if err := l.Allocate([]string{"GPU-c"}); err != nil {
		t.Fatal(err)
	}
	// Killed mid-write of a third record.
	f, err := os.OpenFile(filepath.Join(dir, AllocLogFile), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"at":"2026-11-23T12:00:09Z","ids":["GPU-`)
	f.Close()

	again, err := NewLedger(dir, clock.Now, nil)
	if err != nil {
		t.Fatal(err)
	}
	got := again.allocations()
	start := newClock().Now()
	want := map[string]time.Time{"MIG-a": start, "MIG-b": start, "GPU-c": start.Add(time.Second)}
	if len(got) != len(want) {
		t.Fatalf("restored %v, want %v", got, want)
	}
	for id, at := range want {
		if !got[id].Equal(at) {
			t.Errorf("%s restored at %v, want %v", id, got[id], at)
		}
	}
	// The log was compacted on open: the torn line is gone, the rest kept.
	b, _ := os.ReadFile(filepath.Join(dir, AllocLogFile))
	if strings.Contains(string(b), `"GPU-"`) || strings.Count(string(b), "\n") != 3 {
		t.Errorf("log after reopening:\n%s", b)
	}
}

// The log holds one line per device once it is compacted: when it grows
// past compactAbove (the same devices allocated again and again), and when
// allocations settle.
func TestAllocationLogCompacts(t *testing.T) {
	dir := t.TempDir()
	clock := newClock()
	l, err := NewLedger(dir, clock.Now, nil)
	if err != nil {
		t.Fatal(err)
	}
	logSize := func() int64 {
		fi, err := os.Stat(filepath.Join(dir, AllocLogFile))
		if err != nil {
			t.Fatal(err)
		}
		return fi.Size()
	}
	for i := range 5000 { // about 460 KB of records
		if err := l.Allocate([]string{fmt.Sprintf("GPU-%d", i%16)}); err != nil {
			t.Fatal(err)
		}
	}
	if size := logSize(); size >= compactAbove {
		t.Fatalf("log of %d bytes after 5000 allocations of 16 devices, want it compacted below %d", size, compactAbove)
	}
	if got := len(l.allocations()); got != 16 {
		t.Fatalf("%d allocations in the ledger, want 16", got)
	}
	again, _ := NewLedger(dir, clock.Now, nil)
	if got := len(again.allocations()); got != 16 {
		t.Fatalf("the compacted log reads back %d allocations, want 16", got)
	}
	clock.Advance(time.Minute)
	l.Allocate([]string{"GPU-late"})
	for l.log.size < compactAbove { // enough lines for the next compaction
		l.log.append(allocRecord{At: clock.Now(), IDs: []string{"GPU-late"}})
	}
	if n := l.settle(nil, clock.Now()); n != 16 {
		t.Fatalf("settled %d, want the 16 allocated a minute before the answer", n)
	}
	b, _ := os.ReadFile(filepath.Join(dir, AllocLogFile))
	if got := strings.Count(string(b), "\n"); got != 1 || !strings.Contains(string(b), "GPU-late") {
		t.Errorf("log after settling (%d lines):\n%.300s", got, b)
	}
}

// An allocation whose record cannot be written is refused: a restart would
// not know it.
func TestAllocateRefusedWhenNotRecorded(t *testing.T) {
	dir := t.TempDir()
	l, err := NewLedger(dir, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	l.log.f.Close() // a write now fails as a full or vanished disk would
	err = l.Allocate([]string{"GPU-a"})
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "could not be recorded") {
		t.Fatalf("Allocate = %v, want Unavailable saying it could not be recorded", err)
	}
	if len(l.allocations()) != 0 {
		t.Errorf("a refused allocation is in the ledger: %v", l.allocations())
	}
}

// Issue 23, defect 7: an allocation dated after now (the clock stepped back
// across a restart) blocked its GPU for good; it counts from now instead,
// and an answer asked long enough after settles it.
func TestFutureAllocationSettles(t *testing.T) {
	dir := t.TempDir()
	clock := newClock()
	future := clock.Now().Add(48 * time.Hour)
	line := fmt.Sprintf(`{"at":%q,"ids":["MIG-a"]}`+"\n", future.Format(time.RFC3339Nano))
	if err := os.WriteFile(filepath.Join(dir, AllocLogFile), []byte(line), 0o600); err != nil {
		t.Fatal(err)
	}
	l, _ := NewLedger(dir, clock.Now, nil)
	if at := l.allocations()["MIG-a"]; !at.Equal(clock.Now()) {
		t.Fatalf("restored at %v, want now (%v)", at, clock.Now())
	}
	clock.Advance(recentSettle)
	if n := l.settle(nil, clock.Now()); n != 1 {
		t.Errorf("settled %d, want the allocation %v after it", n, recentSettle)
	}
	// Checkpoints of version 2 held allocations too.
	l2 := newLedger(clock.Now)
	if n := l2.restoreAllocations(map[string]AllocEntry{"MIG-b": {At: clock.Now().Add(time.Hour)}}); n != 1 {
		t.Errorf("restoreAllocations counted %d from the future, want 1", n)
	}
}

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

func (ap *allocatingApplier) Apply(ctx context.Context, p mig.Plan) (mig.State, error) {
	st, err := ap.next.Apply(ctx, p)
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

func (ap *allocatingApplier) SetGuard(g mig.Guard) { ap.next.SetGuard(g) }

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
	if len(h.a.ledger.releases)+len(h.a.ledger.intents) != 0 || h.a.ledger.dynamicMIG[inv.GPUs[0].UUID] {
		t.Errorf("ledger keeps %v / %v / dynamic %v after everything was undone", h.a.ledger.releases, h.a.ledger.intents, h.a.ledger.dynamicMIG)
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
		h.opts.Ledger, openErr = newLedgerAt(dir, h.clock.Now, h.opts.Logger, write)
	})
	defer h2.a.Ledger().Close()
	start := h2.clock.Now()
	logPath := filepath.Join(dir, AllocLogFile)
	if openErr == nil || !strings.Contains(openErr.Error(), logPath) || !strings.Contains(openErr.Error(), "no space left on device") {
		t.Errorf("NewLedger: %v, want an error naming %s and why", openErr, logPath)
	}
	h2.config(wholeGPUs)
	l := h2.a.Ledger()

	// (a) What the log held is still held: no plan may destroy it.
	if _, ok := l.allocations()[first]; !ok {
		t.Errorf("allocations %v: %s, read from the log at start, is gone", l.allocations(), first)
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
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "no space left on device") {
		t.Errorf("Allocate while the log is not open = %v, want Unavailable naming %s and why", err, dir)
	}
	if _, ok := l.allocations()[second]; ok {
		t.Errorf("a refused allocation is in the ledger: %v", l.allocations())
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
	again, err := NewLedger(dir, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer again.Close()
	for _, u := range []string{first, second} {
		if _, ok := again.allocations()[u]; !ok {
			t.Errorf("a restart reads %v from the log, without %s", again.allocations(), u)
		}
	}
}

// The same at Admit, without the loop (the device plugin's Allocate may
// come first): the next Admit after the fault clears opens the log.
func TestAllocationLogOpenedAtAdmit(t *testing.T) {
	dir := t.TempDir()
	clock := newClock()
	l, err := NewLedger(dir, clock.Now, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Allocate([]string{"GPU-a"}); err != nil {
		t.Fatal(err)
	}
	var full error = syscall.EROFS
	write := func(path string, data []byte, opts ...atomicfile.Options) error {
		if full != nil {
			return fmt.Errorf("write %s: %w", path, full)
		}
		return atomicfile.Write(path, data, opts...)
	}
	l2, _ := newLedgerAt(dir, clock.Now, nil, write)
	defer l2.Close()
	if err := l2.Allocate([]string{"GPU-b"}); status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "read-only file system") {
		t.Errorf("Allocate while the log is not open = %v, want Unavailable saying why", err)
	}
	if err, since := l2.logError(); err == nil || !since.Equal(clock.Now()) {
		t.Errorf("logError = %v since %v, want the open's error since start", err, since)
	}
	full = nil
	if err := l2.Allocate([]string{"GPU-b"}); err != nil {
		t.Fatalf("Allocate once the fault cleared: %v", err)
	}
	if err, _ := l2.logError(); err != nil {
		t.Errorf("logError = %v after the log opened", err)
	}
	again, _ := NewLedger(dir, clock.Now, nil)
	defer again.Close()
	if got := again.allocations(); len(got) != 2 {
		t.Errorf("a restart reads %v from the log, want GPU-a and GPU-b", got)
	}
}
