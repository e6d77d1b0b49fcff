package health

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"slices"
	"time"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// maxLogEntries bounds the event log: a GPU flooding XIDs must not grow the
// agent's memory.
const maxLogEntries = 256

// reach is what a probe learned about a GPU's reachability.
type reach int

const (
	reachOK reach = iota
	reachLost
	reachResetRequired
	// reachUnknown: the probe failed for another reason; nothing is concluded.
	reachUnknown
)

// probeResult is one probe of one GPU.
type probeResult struct {
	reach reach
	// dbeVolatile is the volatile double-bit ECC count, read while a
	// reset-class cause is active (a reset clears it).
	dbeVolatile uint64
	dbeKnown    bool
	action      int // nvml.DeviceGpuRecoveryAction
	actionKnown bool
	// Row remapping (Ampere and newer) and page retirement (older GPUs):
	// both wait for a reset to take effect.
	remapPending, remapFailure, remapKnown bool
	retiredPending, retiredKnown           bool
	detail                                 string
}

// tracker is the health state machine. It does no I/O, so every transition
// is tested without NVML; the Watcher feeds it and owns it (one goroutine).
type tracker struct {
	policy Policy
	log    *slog.Logger
	gpus   map[string]*gpuTrack
	mig    map[string]migRef
	// migOf keeps each GPU's MIG devices, so a GPU missing from a later
	// inventory (lost) keeps the ones it had.
	migOf   map[string]map[string]migRef
	entries []Entry
	changed bool
	// restored are checkpointed causes of GPUs not seen yet in this
	// process; each takes effect when its GPU appears in an inventory.
	restored map[string][]SavedCause
	// boot is the node's boot id ("" unknown); each cause is stamped with
	// the boot it was raised in, and a reboot clears those of earlier boots.
	boot string
}

type gpuTrack struct {
	uuid   string
	index  int
	causes []*cause
	stats  GPUStats
}

type cause struct {
	Cause
	// sawDown: the GPU was seen unreachable while this cause was active.
	sawDown bool
	// dbeMax is the highest volatile double-bit count seen while active.
	dbeMax   uint64
	dbeKnown bool
	// actionSeen: NVML reported a pending recovery action while active.
	actionSeen bool
	// boot is the boot it was raised in ("" unknown).
	boot string
}

func newTracker(p Policy, log *slog.Logger) *tracker {
	return &tracker{
		policy: p.withDefaults(), log: log,
		gpus: map[string]*gpuTrack{}, mig: map[string]migRef{}, migOf: map[string]map[string]migRef{},
		restored: map[string][]SavedCause{},
	}
}

// restore queues checkpointed causes; each applies when its GPU is first
// in an inventory (a GPU that is gone keeps them pending, harmlessly).
func (t *tracker) restore(saved []SavedCause) {
	for _, c := range saved {
		t.restored[c.GPU] = append(t.restored[c.GPU], c)
	}
}

// setInventory learns the GPUs and MIG devices. GPUs are never forgotten: a
// lost GPU drops out of the inventory but must stay unhealthy, and be seen
// coming back.
func (t *tracker) setInventory(inv *gpu.Inventory) {
	if inv == nil {
		return
	}
	for _, g := range inv.GPUs {
		t.ensure(g.UUID, g.Index)
		m := make(map[string]migRef, len(g.Instances))
		for _, in := range g.Instances {
			m[in.UUID] = migRef{gpu: g.UUID, gi: in.GI, ci: in.CI}
		}
		if !maps.Equal(t.migOf[g.UUID], m) {
			t.migOf[g.UUID] = m
			t.changed = true
		}
	}
	if !t.changed {
		// The same GPUs and instances as before: nothing to republish. (An
		// unconditional change here made every resync plan twice.)
		return
	}
	t.mig = map[string]migRef{}
	for _, m := range t.migOf {
		maps.Copy(t.mig, m)
	}
}

// setPolicy applies a new policy; XID causes it no longer calls fatal clear.
func (t *tracker) setPolicy(p Policy, now time.Time) {
	t.policy = p.withDefaults()
	for _, g := range t.sortedGPUs() {
		g.causes = slices.DeleteFunc(g.causes, func(c *cause) bool {
			if c.Kind == CauseXID && !t.policy.Fatal(c.XID) {
				t.record(now, g, ActionHealthy, fmt.Sprintf("cleared XID %d: the policy now ignores it", c.XID))
				return true
			}
			return false
		})
	}
	t.changed = true
}

func (t *tracker) gpu(uuid string) *gpuTrack { return t.gpus[uuid] }

// ensure returns the GPU's track, creating it (with its checkpointed causes)
// on first sight. The watcher calls it for the GPUs it finds itself at start,
// so events that arrive before the first inventory are not dropped.
func (t *tracker) ensure(uuid string, index int) *gpuTrack {
	gt := t.gpus[uuid]
	if gt == nil {
		gt = &gpuTrack{uuid: uuid, index: index, stats: GPUStats{Index: index, XIDs: map[uint64]uint64{}}}
		t.gpus[uuid] = gt
		t.changed = true
		for _, sc := range t.restored[uuid] {
			if t.boot != "" && sc.Boot != "" && sc.Boot != t.boot {
				// A reboot resets every GPU: a reset-class cause is
				// cleared, and so is one that needed the reboot itself.
				// Faults that outlive it still show in NVML, read anew.
				t.changed = true
				t.record(sc.Last, gt, ActionHealthy, fmt.Sprintf("not restored from the checkpoint: %q%s: the node rebooted since (boot %s, now %s)",
					sc.Reason, scopeText(sc.GI, sc.CI), sc.Boot, t.boot))
				continue
			}
			c := &cause{Cause: sc.Cause, dbeMax: sc.DBEMax, dbeKnown: sc.DBEKnown, actionSeen: sc.ActionSeen, sawDown: sc.SawDown, boot: sc.Boot}
			if c.boot == "" {
				// Checkpointed before boots were: the next reboot clears it.
				c.boot = t.boot
			}
			c.Index = index
			gt.causes = append(gt.causes, c)
			t.record(c.Last, gt, ActionUnhealthy, "restored from the checkpoint: "+c.Reason+scopeText(c.GI, c.CI))
		}
		delete(t.restored, uuid)
	}
	if gt.index != index {
		gt.index, gt.stats.Index = index, index
		for _, c := range gt.causes {
			c.Index = index
		}
		t.changed = true
	}
	return gt
}

// xid handles an XID critical error event.
func (t *tracker) xid(uuid string, xid uint64, gi, ci int, now time.Time) {
	g := t.gpu(uuid)
	if g == nil {
		return
	}
	g.stats.LastXID = xid
	g.stats.XIDs[xid]++
	t.changed = true
	class, desc := XIDClass(xid)
	what := fmt.Sprintf("XID %d", xid)
	if desc != "" {
		what += " (" + desc + ")"
	}
	if !t.policy.Fatal(xid) {
		t.record(now, g, ActionIgnored, what+scopeText(gi, ci)+": ignored by policy")
		return
	}
	t.add(g, Cause{Kind: CauseXID, XID: xid, Class: class, GI: gi, CI: ci,
		Reason: fmt.Sprintf("%s, needs %s", what, class)}, now)
}

// ecc handles an ECC error event; only double-bit errors mark devices.
func (t *tracker) ecc(uuid string, doubleBit bool, gi, ci int, now time.Time) {
	g := t.gpu(uuid)
	if g == nil {
		return
	}
	t.changed = true
	if !doubleBit {
		g.stats.SingleBitEvents++
		return
	}
	g.stats.DoubleBitEvents++
	t.add(g, Cause{Kind: CauseDoubleBitECC, Class: ClassReset, GI: gi, CI: ci,
		Reason: "double-bit ECC error, needs " + ClassReset.String()}, now)
}

// add records a cause, merging it into an identical active one.
func (t *tracker) add(g *gpuTrack, c Cause, now time.Time) {
	for _, old := range g.causes {
		if old.Kind == c.Kind && old.XID == c.XID && old.GI == c.GI && old.CI == c.CI {
			old.Last = now
			old.Count++
			return
		}
	}
	c.GPU, c.Index, c.Since, c.Last, c.Count = g.uuid, g.index, now, now, 1
	g.causes = append(g.causes, &cause{Cause: c, boot: t.boot})
	t.changed = true
	t.record(now, g, ActionUnhealthy, c.Reason+scopeText(c.GI, c.CI))
}

// recover drops the causes keep rejects, logging why.
func (t *tracker) recover(g *gpuTrack, now time.Time, why func(c *cause) string) {
	g.causes = slices.DeleteFunc(g.causes, func(c *cause) bool {
		reason := why(c)
		if reason == "" {
			return false
		}
		t.changed = true
		t.record(now, g, ActionHealthy, fmt.Sprintf("cleared %q%s: %s", c.Reason, scopeText(c.GI, c.CI), reason))
		return true
	})
}

// probe applies what a probe learned.
func (t *tracker) probe(uuid string, r probeResult, now time.Time) {
	g := t.gpu(uuid)
	if g == nil {
		return
	}
	switch r.reach {
	case reachLost, reachResetRequired:
		kind, class, reason := CauseLost, ClassReboot, "GPU is lost (NVML: GPU is lost)"
		if r.reach == reachResetRequired {
			kind, class, reason = CauseResetRequired, ClassReset, "GPU requires a reset (NVML: reset required)"
		}
		if r.detail != "" {
			reason += ": " + r.detail
		}
		t.add(g, Cause{Kind: kind, Class: class, GI: AllInstances, CI: AllInstances, Reason: reason}, now)
		for _, c := range g.causes {
			c.sawDown = true
		}
		return
	case reachUnknown:
		return
	}
	t.recover(g, now, func(c *cause) string {
		switch {
		case c.Kind == CauseLost || c.Kind == CauseResetRequired:
			return "GPU answers NVML again"
		case c.Kind == CauseRemapPending && r.remapKnown && !r.remapPending:
			return "row remapping is no longer pending: the GPU was reset"
		case c.Kind == CauseRemapFailure && r.remapKnown && !r.remapFailure:
			return "NVML no longer reports a row remapping failure"
		case c.Kind == CauseRetiredPending && r.retiredKnown && !r.retiredPending:
			return "page retirement is no longer pending: the GPU was reset"
		case c.Kind == CauseRecoveryAction && r.actionKnown && r.action == 0:
			return "NVML reports no recovery action pending any more"
		case c.Kind == CauseRemapPending || c.Kind == CauseRemapFailure || c.Kind == CauseRetiredPending || c.Kind == CauseRecoveryAction:
			return "" // only their own evidence clears them
		case c.Class >= ClassReset && c.sawDown:
			return "GPU answers NVML again after being unreachable (reset or re-attached)"
		case c.Class == ClassReset && r.dbeKnown && c.dbeKnown && r.dbeVolatile < c.dbeMax:
			return fmt.Sprintf("volatile double-bit ECC count dropped from %d to %d: the GPU was reset", c.dbeMax, r.dbeVolatile)
		case c.Class >= ClassReset && r.actionKnown && r.action == 0 && c.actionSeen:
			return "NVML reports no recovery action pending any more"
		}
		return ""
	})
	for _, c := range g.causes {
		if r.dbeKnown && (!c.dbeKnown || r.dbeVolatile > c.dbeMax) {
			c.dbeMax, c.dbeKnown = r.dbeVolatile, true
		}
		if r.actionKnown && r.action != 0 {
			c.actionSeen = true
		}
	}
}

// initial applies what NVML still shows when a GPU is first seen. Faults
// from before this agent started (or before its events were registered)
// leave these traces, so they are not lost with their events: a volatile
// double-bit ECC count, a pending recovery action, pending or failed row
// remapping, pending page retirement.
func (t *tracker) initial(uuid string, r probeResult, now time.Time) {
	g := t.gpu(uuid)
	if g == nil || r.reach != reachOK {
		t.probe(uuid, r, now)
		return
	}
	tracked := false // a restored cause already judges the ECC count
	for _, c := range g.causes {
		tracked = tracked || c.dbeKnown
	}
	all := func(kind CauseKind, class Class, reason string) Cause {
		return Cause{Kind: kind, Class: class, GI: AllInstances, CI: AllInstances, Reason: reason}
	}
	if r.dbeKnown && r.dbeVolatile > 0 && !tracked {
		t.add(g, all(CauseDoubleBitECC, ClassReset, fmt.Sprintf(
			"%d double-bit ECC errors since the last GPU reset (volatile count), needs %s", r.dbeVolatile, ClassReset)), now)
	}
	if r.actionKnown && r.action != 0 {
		class, name := recoveryClass(r.action)
		t.add(g, all(CauseRecoveryAction, class, "NVML recovery action pending: "+name+", needs "+class.String()), now)
	}
	switch {
	case r.remapKnown && r.remapFailure:
		t.add(g, all(CauseRemapFailure, ClassReset, "row remapping failed, needs "+ClassReset.String()), now)
	case r.remapKnown && r.remapPending:
		t.add(g, all(CauseRemapPending, ClassReset, "row remapping pending, needs "+ClassReset.String()), now)
	}
	if r.retiredKnown && r.retiredPending {
		t.add(g, all(CauseRetiredPending, ClassReset, "page retirement pending, needs "+ClassReset.String()), now)
	}
	t.probe(uuid, r, now)
}

// recoveryClass maps NVML's recovery action to what clears it.
func recoveryClass(action int) (Class, string) {
	switch action {
	case 1:
		return ClassReset, "GPU reset"
	case 2:
		return ClassReboot, "node reboot"
	case 3:
		return ClassReset, "drain peer-to-peer traffic"
	case 4:
		return ClassReset, "drain and reset"
	}
	return ClassReset, fmt.Sprintf("action %d", action)
}

// wantsResetEvidence reports whether probes of the GPU should read the
// counters that show a reset happened.
func (t *tracker) wantsResetEvidence(uuid string) bool {
	g := t.gpu(uuid)
	if g == nil {
		return false
	}
	for _, c := range g.causes {
		if c.Class >= ClassReset {
			return true
		}
	}
	return false
}

// noteReset is told that the agent itself reset the GPU.
func (t *tracker) noteReset(uuid string, now time.Time) {
	g := t.gpu(uuid)
	if g == nil {
		return
	}
	t.recover(g, now, func(c *cause) string {
		if c.Class <= ClassReset && c.Kind != CauseResetRequired {
			return "the agent reset the GPU"
		}
		return ""
	})
}

// setBoot learns the node's boot id. A new one, after another was known,
// is a reboot: every cause raised before it is cleared, as the reboot reset
// every GPU; it reports whether that happened.
func (t *tracker) setBoot(boot string, now time.Time) (rebooted bool) {
	if boot == "" || boot == t.boot {
		return false
	}
	old := t.boot
	t.boot = boot
	if old == "" {
		for _, g := range t.gpus {
			for _, c := range g.causes {
				if c.boot == "" {
					c.boot = boot
				}
			}
		}
		return false
	}
	for _, g := range t.sortedGPUs() {
		t.recover(g, now, func(c *cause) string {
			if c.boot != boot {
				return fmt.Sprintf("the node rebooted (boot %s, now %s)", old, boot)
			}
			return ""
		})
	}
	t.changed = true
	return true
}

// tick clears application-class causes whose quiet period has passed.
func (t *tracker) tick(now time.Time) {
	for _, g := range t.gpus {
		t.recover(g, now, func(c *cause) string {
			if c.Class == ClassApp && now.Sub(c.Last) >= t.policy.QuietPeriod {
				return fmt.Sprintf("no recurrence for %s", t.policy.QuietPeriod)
			}
			return ""
		})
	}
}

func (t *tracker) record(now time.Time, g *gpuTrack, action, msg string) {
	level := slog.LevelWarn
	switch action {
	case ActionHealthy:
		level = slog.LevelInfo
	case ActionIgnored:
		level = slog.LevelDebug
	}
	t.log.Log(context.Background(), level, "gpu health: "+action, "gpu", g.index, "uuid", g.uuid, "why", msg)
	if len(t.entries) >= maxLogEntries {
		t.entries = slices.Delete(t.entries, 0, len(t.entries)-maxLogEntries+1)
	}
	t.entries = append(t.entries, Entry{Time: now, GPU: g.uuid, Index: g.index, Action: action, Message: msg})
}

func (t *tracker) sortedGPUs() []*gpuTrack {
	out := slices.Collect(maps.Values(t.gpus))
	slices.SortFunc(out, func(a, b *gpuTrack) int { return cmp.Compare(a.index, b.index) })
	return out
}

// state snapshots the tracker.
func (t *tracker) state() *State {
	s := &State{
		Log:   slices.Clone(t.entries),
		byGPU: map[string][]Cause{},
		mig:   maps.Clone(t.mig),
		stats: make(map[string]GPUStats, len(t.gpus)),
	}
	for _, g := range t.sortedGPUs() {
		st := g.stats
		st.XIDs = maps.Clone(g.stats.XIDs)
		s.stats[g.uuid] = st
		if len(g.causes) == 0 {
			continue
		}
		cs := make([]Cause, 0, len(g.causes))
		for _, c := range g.causes {
			cs = append(cs, c.Cause)
			s.saved = append(s.saved, SavedCause{Cause: c.Cause, DBEMax: c.dbeMax, DBEKnown: c.dbeKnown,
				ActionSeen: c.actionSeen, SawDown: c.sawDown, Boot: c.boot})
		}
		// Most severe first, so Unhealthy names the cause that takes longest to clear.
		slices.SortStableFunc(cs, func(a, b Cause) int {
			return cmp.Or(cmp.Compare(b.Class, a.Class), a.Since.Compare(b.Since))
		})
		s.byGPU[g.uuid] = cs
		s.Causes = append(s.Causes, cs...)
	}
	return s
}

func scopeText(gi, ci int) string {
	switch {
	case gi == AllInstances:
		return ""
	case ci == AllInstances:
		return fmt.Sprintf(" on GPU instance %d", gi)
	}
	return fmt.Sprintf(" on GPU instance %d compute instance %d", gi, ci)
}
