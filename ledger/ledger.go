// Package ledger is the node's one record of who has each device: what
// the device plugin handed out (kept in an allocation log), the DRA claims
// prepared, the MIG devices made or destroyed for them, and the devices a
// MIG plan is about to destroy. Every hand-out and every destroy asks it
// first, and it answers and records under one lock.
package ledger

import (
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// Ledger is the node's one record of who has each device, and the one place
// every hand-out and every destroy passes through: Allocate (the device
// plugin, from its gRPC goroutines), DRA Prepare (the loop) and the MIG
// applier (Doom, before each step that destroys a device or changes a
// GPU's MIG mode). A device is free, or in one of these states:
//
//	allocated  the device plugin handed it to a container the kubelet has
//	           not listed yet (plugin), or the kubelet lists a container
//	           holding it (holders)
//	prepared   a DRA claim holds it (claims)
//	intended   a MIG device is being made at its placement for a claim
//	           being prepared (intents)
//	releasing  made for a claim that was released, to be destroyed
//	           (releases)
//	doomed     a MIG plan is about to destroy it, or change its GPU's mode
//	           (doomed)
//
// Each check and the record it guards happen under one lock, so a device
// doomed is never handed out and one handed out is never doomed, whichever
// comes first. A MIG device and its GPU are the same silicon: holding one
// takes the other (overlaps).
//
// Allocations reach the allocation log (allocLog) before Allocate answers;
// everything else is checkpointed by the loop before it answers or acts.
// The plugin map is written from any goroutine under mu; every other field
// is written only by the loop goroutine, under mu, and the loop may read
// those without it.
type Ledger struct {
	mu  sync.Mutex
	now func() time.Time
	log *allocLog

	plugin map[string]AllocEntry // device UUID → when and how Allocate last handed it out
	ids    []string              // Admit's scratch, under mu

	places     map[string]place // MIG device UUID → where it is (from the last inventory)
	holders    *podresources.Attribution
	claims     map[types.UID]Claim
	intents    map[types.UID]Claim
	releases   map[types.UID]Claim
	dynamicMIG map[string]bool
	doomed     map[string]string // device UUID → why
	// settling: the MIG plan running is a claim's own (making or undoing
	// the devices of intents and releases), which Doom lets touch them.
	settling bool

	// logErr is why the allocation log is not open, or why the last
	// allocation could not be recorded (cleared once the log opens, or by
	// the next allocation recorded); logFailures counts the allocations
	// refused for either.
	logErr      standing
	logFailures atomic.Int64
}

// place is where a MIG device sits.
type place struct {
	parent    string
	profile   string
	placement gpu.Placement
}

// Options are what New needs beyond the state directory.
type Options struct {
	// StateDir holds the allocation log ("": none, and nothing recorded:
	// tests and offline tools).
	StateDir string
	// Now is the clock allocations are dated by (default time.Now).
	Now    func() time.Time
	Logger *slog.Logger
	// Write replaces a file atomically (default atomicfile.Write); tests
	// fail it as a full or read-only state dir would.
	Write func(path string, data []byte, opts ...atomicfile.Options) error
	// OpenLog opens the allocation log, once written, for appending
	// (default os.OpenFile); tests return a file whose writes fail as a
	// full state dir's do.
	OpenLog func(path string) (LogFile, error)
}

// New returns the node's ledger with the allocations its allocation log
// holds. The ledger is usable whatever the error. An error says that an
// unreadable log was set aside, or that the log could not be opened: then
// the ledger keeps what it read, Admit refuses every allocation
// (ErrLogUnavailable) until the log opens, and the log is tried again at
// each Admit and at each pass of the loop (RetryLog), the error standing
// on /status meanwhile (LogError).
func New(opts Options) (*Ledger, error) {
	now, log := opts.Now, opts.Logger
	if now == nil {
		now = time.Now
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	write := opts.Write
	if write == nil {
		write = atomicfile.Write
	}
	l := newLedger(now)
	if opts.StateDir == "" {
		return l, nil
	}
	l.log = newAllocLog(opts.StateDir, log, write, opts.OpenLog)
	l.mu.Lock()
	defer l.mu.Unlock()
	setAside, err := l.openLogLocked()
	if err != nil {
		l.logErr.set(err, now())
		return l, errors.Join(err, setAside)
	}
	return l, setAside
}

// openLogLocked opens the allocation log, which is not open: it reads what
// the file holds into the ledger (the first time only), then rewrites the
// file with every allocation the ledger holds and opens it for appending.
// setAside says an unreadable file was set aside; err, that the log is
// still not open. Called by New, then by reopenLocked until it
// succeeds.
func (l *Ledger) openLogLocked() (setAside, err error) {
	al := l.log
	if al.closed {
		return nil, fmt.Errorf("allocation log %s: closed", al.path)
	}
	if !al.read {
		entries, aside, err := al.readBack()
		if err != nil {
			return nil, err
		}
		al.read, setAside = true, aside
		if future := l.restoreAllocationsLocked(entries); future > 0 {
			al.log.Warn("allocations dated after now (the clock stepped back since they were made) count from now", "allocations", future)
		}
		if len(entries) > 0 {
			al.log.Info("allocations not yet accounted for by the kubelet restored", "allocations", len(entries), "log", al.path)
		}
	}
	if err := al.rewrite(l.plugin); err != nil {
		return setAside, fmt.Errorf("allocation log %s: %w", al.path, err)
	}
	return setAside, nil
}

// reopenLocked tries again to open the allocation log, which is not open:
// the error stands (logError) until it opens.
func (l *Ledger) reopenLocked(now time.Time) error {
	setAside, err := l.openLogLocked()
	if setAside != nil {
		l.log.log.Error("allocation log", "error", setAside)
	}
	if err != nil {
		if l.logErr.set(err, now) {
			l.log.log.Error("allocation log not open; Allocate is refused until it opens (tried again at every pass and every Allocate)", "error", err)
		}
		return err
	}
	if l.logErr.clear() {
		l.log.log.Info("allocation log open again", "path", l.log.path)
	}
	return nil
}

// RetryLog opens the allocation log if it could not be opened yet, and
// rewrites it if the last record could not be appended (the state dir
// full): the loop calls it at every pass, so the error leaves /status once
// the state dir can be written, without waiting for an Allocate that an
// idle node may never get. The rewrite also drops a torn record, should
// cutting it off have failed too.
func (l *Ledger) RetryLog() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.log == nil || l.log.closed {
		return
	}
	if !l.log.isOpen() {
		_ = l.reopenLocked(l.now()) // standing in logErr
		return
	}
	if l.logErr.err == nil {
		return
	}
	if err := l.log.rewrite(l.plugin); err != nil {
		l.logErr.set(fmt.Errorf("allocation log %s: %w", l.log.path, err), l.now())
		return
	}
	l.logErr.clear()
	l.log.log.Info("allocation log written again", "path", l.log.path)
}

// Close closes the allocation log.
func (l *Ledger) Close() {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.log != nil {
		l.log.close()
	}
}

func newLedger(now func() time.Time) *Ledger {
	return &Ledger{
		now: now, plugin: map[string]AllocEntry{}, places: map[string]place{},
		claims: map[types.UID]Claim{}, intents: map[types.UID]Claim{},
		releases: map[types.UID]Claim{}, dynamicMIG: map[string]bool{}, doomed: map[string]string{},
	}
}

// SetInventory learns where each MIG device sits, from the GPUs believed
// now (those that cannot be read included, with their last records).
func (l *Ledger) SetInventory(gpus []gpu.GPU) {
	places := map[string]place{}
	for _, g := range gpus {
		for _, m := range g.Instances {
			places[m.UUID] = place{parent: g.UUID, profile: m.Profile, placement: m.Placement}
		}
	}
	l.mu.Lock()
	l.places = places
	l.mu.Unlock()
}

// overlaps reports whether devices a and b share silicon: the same device,
// or a MIG device and its GPU. Callers hold mu or are the loop.
func (l *Ledger) overlaps(a, b string) bool {
	if a == "" || b == "" {
		return false
	}
	return a == b || l.places[a].parent == b || l.places[b].parent == a
}

// Admit records that the device plugin hands devices to a container
// under resource, unless one of them is taken another way: doomed by a MIG
// plan, prepared for a DRA claim, being made or destroyed for one, or
// handed out by the device plugin under another name (handedLocked). The
// record is in the allocation log before Admit returns (see allocLog for
// why a crash right after the answer cannot lose it). The error is a gRPC
// status: FailedPrecondition naming the device and why, Unavailable when
// the record could not be written, or the log is not open (it could not be
// at start, and opening it again failed). Implements plugin.Options.Admit.
func (l *Ledger) Admit(resource string, devs []Handout) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, d := range devs {
		reason, why := l.takenLocked(d.UUID)
		if why == "" {
			reason, why = ErrHeld, l.handedLocked(resource, d)
		}
		if why != "" {
			return refused(d.UUID, reason, why)
		}
	}
	now := l.now()
	if l.log != nil {
		if !l.log.isOpen() {
			if err := l.reopenLocked(now); err != nil {
				l.logFailures.Add(1)
				return logUnavailable{fmt.Errorf("the allocation could not be recorded (the allocation log in %s is not open), so a restart could destroy the device under its container: %w", filepath.Dir(l.log.path), err)}
			}
		}
		// The record's lists reuse one array: Allocate is on the
		// kubelet's container start path.
		l.ids = l.ids[:0]
		for _, d := range devs {
			l.ids = append(l.ids, d.UUID)
		}
		rec := allocRecord{At: now, IDs: l.ids, Resource: resource}
		for _, d := range devs {
			if d.Replica {
				l.ids = append(l.ids, d.UUID)
			}
		}
		rec.Replicas = l.ids[len(devs):]
		if err := l.log.append(rec); err != nil {
			l.logErr.set(err, now)
			l.logFailures.Add(1)
			return logUnavailable{fmt.Errorf("the allocation could not be recorded, so a restart could destroy the device under its container: %w", err)}
		}
		l.logErr.clear()
	}
	for _, d := range devs {
		l.plugin[d.UUID] = AllocEntry{At: now, Resource: resource, Replica: d.Replica}
	}
	if l.log != nil {
		// Devices allocated again and again while the kubelet's answer
		// settles none: the log holds one line per device after this.
		l.log.compactLocked(l.plugin)
	}
	return nil
}

// Allocate is Admit of whole devices (GPU or MIG UUIDs) under a resource
// it does not name: another allocation of the same device is then no
// conflict, one of its GPU or of a MIG device of it still is.
func (l *Ledger) Allocate(uuids []string) error {
	devs := make([]Handout, len(uuids))
	for i, u := range uuids {
		devs[i] = Handout{UUID: u}
	}
	return l.Admit("", devs)
}

// handedLocked says why the device plugin may not hand out d under
// resource ("" when it may): it handed out the same silicon another way,
// and no answer of the kubelet since has shown that container gone. The
// kubelet counts device IDs, so after a config change it would give a GPU
// whole while a container still has a replica of it, or a MIG device and
// its GPU, to two containers that each believe they have the silicon. The
// same device again under the same name is no conflict (the kubelet frees
// an ID only when its container is gone), nor are two replicas of one
// shared device; nor the same device where either name is unknown (an
// older log's, or Allocate's).
func (l *Ledger) handedLocked(resource string, d Handout) string {
	unsettled := func(e AllocEntry) string {
		return fmt.Sprintf("at %s (not yet shown gone by the kubelet)", stamp(e.At))
	}
	if e, ok := l.plugin[d.UUID]; ok && e.Resource != "" && resource != "" {
		switch {
		case e.Resource != resource:
			return fmt.Sprintf("handed out under %s %s; not again under %s", e.Resource, unsettled(e), resource)
		case e.Replica && !d.Replica:
			return fmt.Sprintf("shared: the device plugin handed out a replica of it under %s %s; not whole", e.Resource, unsettled(e))
		case !e.Replica && d.Replica:
			return fmt.Sprintf("handed out whole under %s %s; not as a replica", e.Resource, unsettled(e))
		}
	}
	if gpu := l.places[d.UUID].parent; gpu != "" {
		if e, ok := l.plugin[gpu]; ok {
			return fmt.Sprintf("a MIG device of GPU %s, which the device plugin handed out whole%s %s", gpu, under(e), unsettled(e))
		}
	}
	held := ""
	for x, p := range l.places {
		if _, ok := l.plugin[x]; ok && p.parent == d.UUID && (held == "" || x < held) {
			held = x // the first by UUID: the message is the same each time
		}
	}
	if held != "" {
		e := l.plugin[held]
		return fmt.Sprintf("the GPU of MIG device %s, which the device plugin handed out%s %s", held, under(e), unsettled(e))
	}
	return ""
}

// under names an allocation's resource, for messages.
func under(e AllocEntry) string {
	if e.Resource == "" {
		return ""
	}
	return " under " + e.Resource
}

// takenLocked says why device u may not go to the device plugin ("" when
// it may), and the reason it wraps.
func (l *Ledger) takenLocked(u string) (reason error, why string) {
	// Sorted for a message that is the same each time; only when there is
	// something to sort, as sorting the keys of no map still allocates,
	// and Admit is on the container start path.
	if len(l.doomed) > 0 {
		for _, x := range slices.Sorted(maps.Keys(l.doomed)) {
			if l.overlaps(u, x) {
				return ErrDoomed, "being repartitioned: " + l.doomed[x]
			}
		}
	}
	if by := l.claimHolder(u, ""); by != "" {
		return ErrPrepared, "prepared for " + by + " through DRA"
	}
	for _, set := range []struct {
		reason error
		m      map[types.UID]Claim
	}{{ErrIntended, l.intents}, {ErrReleasing, l.releases}} {
		for _, pc := range set.m {
			for _, d := range pc.Devices {
				if !d.Created {
					continue
				}
				if u == d.Parent || (d.UUID != "" && l.overlaps(u, d.UUID)) || (d.UUID == "" && l.at(u, d)) {
					return set.reason, "a MIG device made for " + pc.String() + " through DRA, or its GPU, while it is made or destroyed"
				}
			}
		}
	}
	return nil, ""
}

// at reports whether MIG device u sits where intent d will make one.
func (l *Ledger) at(u string, d ClaimDevice) bool {
	p, ok := l.places[u]
	return ok && p.parent == d.Parent && p.profile == d.Profile && p.placement == d.Placement
}

// claimHolder names the claim other than except that holds a device
// overlapping u ("" when none); admin access holds nothing.
func (l *Ledger) claimHolder(u string, except types.UID) string {
	if len(l.claims) == 0 {
		return "" // and no keys to sort (see takenLocked)
	}
	for _, uid := range slices.Sorted(maps.Keys(l.claims)) {
		if uid == except {
			continue
		}
		for _, d := range l.claims[uid].Devices {
			if l.holds(d, u) {
				return l.claims[uid].String()
			}
		}
	}
	return ""
}

// holds reports whether claim device d holds silicon device u shares: u
// itself, u's GPU or a MIG device of u's; and for a MIG device made for the
// AddClaim, its GPU and its placement as the claim recorded them. The claim's
// record stands even where the inventory no longer shows the device: an
// agent killed mid-Unprepare, after NVML destroyed the device and before
// the claim was forgotten, restores a claim whose device is gone, and its
// GPU is still the claim's until the release is done (MIG back off).
// Admin access holds nothing.
func (l *Ledger) holds(d ClaimDevice, u string) bool {
	if d.AdminAccess || u == "" {
		return false
	}
	if l.overlaps(u, d.UUID) {
		return true
	}
	if !d.Created || d.Parent == "" {
		return false
	}
	if u == d.Parent {
		return true
	}
	p, ok := l.places[u]
	return ok && p.parent == d.Parent && p.placement.Overlaps(d.Placement)
}

// pluginHolderLocked names the container the device plugin gave a device
// overlapping u: the kubelet's answer, or an allocation it has not listed
// yet ("" when none).
func (l *Ledger) pluginHolderLocked(u string) string {
	for _, x := range []string{u, l.places[u].parent} {
		if x == "" {
			continue
		}
		if hs := l.holders.Holders(x); len(hs) > 0 {
			return hs[0].String() + " (device plugin)"
		}
		if e, ok := l.plugin[x]; ok {
			return "a container the device plugin gave it at " + stamp(e.At) + " (not yet listed by the kubelet)"
		}
	}
	for x, p := range l.places {
		if p.parent != u {
			continue
		}
		if hs := l.holders.Holders(x); len(hs) > 0 {
			return hs[0].String() + " (device plugin, MIG device " + x + ")"
		}
		if e, ok := l.plugin[x]; ok {
			return "a container the device plugin gave its MIG device " + x + " at " + stamp(e.At) + " (not yet listed by the kubelet)"
		}
	}
	return ""
}

// PluginHolder is pluginHolderLocked for the loop.
func (l *Ledger) PluginHolder(u string) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.pluginHolderLocked(u)
}

// stamp is a time for messages, with its date: a checkpoint may be days old.
func stamp(t time.Time) string { return t.UTC().Format(time.RFC3339) }

// Holder names whoever other than claim except holds a device overlapping
// u: a container of the device plugin or another claim ("" when none).
func (l *Ledger) Holder(u string, except types.UID) string {
	l.mu.Lock()
	defer l.mu.Unlock()
	if by := l.pluginHolderLocked(u); by != "" {
		return by
	}
	return l.claimHolder(u, except)
}

// LogError is why the allocation log is not open, or why the last
// allocation could not be recorded, and since when (nil when neither).
func (l *Ledger) LogError() (error, time.Time) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.logErr.err, l.logErr.since
}

// LogFailures counts allocations refused because they could not be
// recorded.
func (l *Ledger) LogFailures() int64 { return l.logFailures.Load() }

// Allocations copies the device plugin's allocations not yet accounted for.
func (l *Ledger) Allocations() map[string]time.Time {
	l.mu.Lock()
	defer l.mu.Unlock()
	out := make(map[string]time.Time, len(l.plugin))
	for u, e := range l.plugin {
		out[u] = e.At
	}
	return out
}

// Settleable reports whether an allocation the last answer did not list is
// old enough for a kubelet answer asked now to account for it.
func (l *Ledger) Settleable(now time.Time) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	for u, e := range l.plugin {
		if now.Sub(e.At) >= SettleAfter && len(l.holders.Holders(u)) == 0 {
			return true
		}
	}
	return false
}

// restoreAllocationsLocked takes allocations an earlier agent recorded.
// One dated after now (the clock stepped back across the restart) counts
// from now: otherwise no answer could ever be late enough to settle it,
// and its GPU would stay blocked for good.
func (l *Ledger) restoreAllocationsLocked(allocs map[string]AllocEntry) (future int) {
	now := l.now()
	for u, e := range allocs {
		if e.At.After(now) {
			e.At, future = now, future+1
		}
		if old, ok := l.plugin[u]; !ok || e.At.After(old.At) {
			l.plugin[u] = e
		}
	}
	return future
}

// Settle takes a successful pod-resources answer the kubelet gave to a
// request made at asked: who holds what, and the allocations made
// SettleAfter before asked are accounted for by it: those it does not
// list are forgotten (their containers are gone), those it lists stay (the
// allocation log keeps them for a restart). It reports how many went.
func (l *Ledger) Settle(att *podresources.Attribution, asked time.Time) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.holders = att
	n := 0
	for u, e := range l.plugin {
		// One the answer lists stays: the log then tells a restarted
		// agent who holds what before the kubelet first answers it.
		if asked.Sub(e.At) >= SettleAfter && len(att.Holders(u)) == 0 {
			delete(l.plugin, u)
			n++
		}
	}
	if n > 0 && l.log != nil {
		l.log.compactLocked(l.plugin)
	}
	return n
}

// SetHolders takes who holds what from an answer whose time is unknown: it
// settles nothing.
func (l *Ledger) SetHolders(att *podresources.Attribution) {
	l.mu.Lock()
	l.holders = att
	l.mu.Unlock()
}

// AddClaim records prepared claim pc as uid's, unless one of its devices is
// taken: by a container of the device plugin, by a MIG plan, by another
// claim (a shared device excepted: its shares are counted by the caller),
// or twice within pc (a GPU and one of its MIG devices). Checked and
// recorded under one lock, so Allocate cannot slip in between.
func (l *Ledger) AddClaim(uid types.UID, pc Claim) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for i, d := range pc.Devices {
		if d.AdminAccess {
			continue
		}
		if by := l.pluginHolderLocked(d.UUID); by != "" {
			return refused(d.Device+" ("+d.UUID+")", ErrHeld, "in use by "+by)
		}
		for _, x := range slices.Sorted(maps.Keys(l.doomed)) {
			if l.overlaps(d.UUID, x) {
				return refused(d.Device+" ("+d.UUID+")", ErrDoomed, "being repartitioned: "+l.doomed[x])
			}
		}
		for _, o := range pc.Devices[:i] {
			if !o.AdminAccess && o.UUID != d.UUID && (l.holds(o, d.UUID) || l.holds(d, o.UUID)) {
				return fmt.Errorf("devices %s and %s of one claim are the same GPU", o.Device, d.Device)
			}
		}
		for _, other := range slices.Sorted(maps.Keys(l.claims)) {
			if other == uid {
				continue
			}
			for _, o := range l.claims[other].Devices {
				if o.AdminAccess || (o.UUID == d.UUID && d.Shares > 0 && o.Shares > 0) {
					continue
				}
				if l.holds(o, d.UUID) || l.holds(d, o.UUID) {
					return refused(d.Device+" ("+d.UUID+")", ErrPrepared, "in use by "+l.claims[other].String())
				}
			}
		}
	}
	l.claims[uid] = pc
	return nil
}

// Intend records that MIG device d is about to be made for claim c, unless
// its GPU is taken by someone else (a container of the device plugin, a
// MIG plan, another claim holding the GPU whole or, by its record, a MIG
// device over d's placement).
func (l *Ledger) Intend(uid types.UID, c Claim, d ClaimDevice) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if by := l.pluginHolderLocked(d.Parent); by != "" {
		return refused("", ErrHeld, "in use by "+by)
	}
	if why, ok := l.doomed[d.Parent]; ok {
		return refused("", ErrDoomed, "being repartitioned: "+why)
	}
	for _, other := range slices.Sorted(maps.Keys(l.claims)) {
		for _, o := range l.claims[other].Devices {
			if !o.AdminAccess && (o.UUID == d.Parent || (o.Created && o.Parent == d.Parent && o.Placement.Overlaps(d.Placement))) {
				return refused("", ErrPrepared, "in use by "+l.claims[other].String())
			}
		}
	}
	pc := l.intents[uid]
	pc.Namespace, pc.Name, pc.At = c.Namespace, c.Name, c.At
	pc.Devices = append(pc.Devices, d)
	l.intents[uid] = pc
	return nil
}

// DropIntent forgets the last intent of claim uid if it is d (the device
// is made and in the claim, or known not to exist). An identical earlier
// intent (a failed attempt whose device may exist) still stands.
func (l *Ledger) DropIntent(uid types.UID, d ClaimDevice) {
	l.mu.Lock()
	defer l.mu.Unlock()
	pc, ok := l.intents[uid]
	if !ok {
		return
	}
	if i := len(pc.Devices) - 1; i >= 0 && pc.Devices[i].samePlace(d) {
		pc.Devices = pc.Devices[:i]
	}
	l.setLocked(l.intents, uid, pc)
}

// DropIntents forgets the intents of claim uid that its checkpointed
// devices stand for.
func (l *Ledger) DropIntents(uid types.UID) {
	l.mu.Lock()
	defer l.mu.Unlock()
	pc, ok := l.intents[uid]
	if !ok {
		return
	}
	claim := l.claims[uid]
	pc.Devices = slices.DeleteFunc(pc.Devices, func(x ClaimDevice) bool {
		return slices.ContainsFunc(claim.Devices, func(d ClaimDevice) bool { return d.Created && d.samePlace(x) })
	})
	l.setLocked(l.intents, uid, pc)
}

// BeginRelease records, in one step, that everything claim uid made is to
// be undone: pc's devices, its intents and what an earlier release left
// (the MIG devices created, and its CDI spec: a record with no device),
// unclaiming uid first when asked. It returns the devices to undo. Done
// under one lock, no Allocate finds the claim's devices or their GPUs free
// between the claim (or intent) going and the release being recorded.
func (l *Ledger) BeginRelease(uid types.UID, pc Claim, unclaim bool) []ClaimDevice {
	l.mu.Lock()
	defer l.mu.Unlock()
	if unclaim {
		delete(l.claims, uid)
	}
	rel := l.releases[uid]
	devs := append(slices.Clone(rel.Devices), pc.Devices...)
	devs = append(devs, l.intents[uid].Devices...)
	delete(l.intents, uid)
	rel.Namespace, rel.Name, rel.At = pc.Namespace, pc.Name, pc.At
	rel.Devices = nil
	for _, d := range devs {
		if d.Created && !slices.ContainsFunc(rel.Devices, func(x ClaimDevice) bool { return x.UUID == d.UUID && x.samePlace(d) }) {
			rel.Devices = append(rel.Devices, d)
		}
	}
	l.releases[uid] = rel
	return devs
}

// SetRelease records what claim uid left to undo: MIG devices, or only
// its CDI spec (a record without devices).
func (l *Ledger) SetRelease(uid types.UID, pc Claim) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.releases[uid] = pc
}

// DropRelease forgets claim uid's release: all it left is undone.
func (l *Ledger) DropRelease(uid types.UID) {
	l.mu.Lock()
	defer l.mu.Unlock()
	delete(l.releases, uid)
}

// setLocked stores pc under uid in m, or deletes it when it has no device.
func (l *Ledger) setLocked(m map[types.UID]Claim, uid types.UID, pc Claim) {
	if len(pc.Devices) == 0 {
		delete(m, uid)
		return
	}
	m[uid] = pc
}

// SetDynamic records whether a claim turned GPU uuid's MIG mode on.
func (l *Ledger) SetDynamic(uuid string, on bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if on {
		l.dynamicMIG[uuid] = true
	} else {
		delete(l.dynamicMIG, uuid)
	}
}

// Doom marks devices that a MIG plan is about to destroy (MIG devices) or
// whose MIG mode it changes (GPUs): Allocate and Prepare refuse them from
// now on. It refuses, marking nothing, when one of them is held by a
// container of the device plugin (listed by the kubelet or not yet) or
// prepared for a claim. Dooming a device again is no error (the applier
// checks before each step what the loop doomed before the first).
// Implements mig.Guard.
func (l *Ledger) Doom(uuids []string, why string) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	for _, u := range uuids {
		if by := l.pluginHolderLocked(u); by != "" {
			return refused(u, ErrHeld, "held by "+by)
		}
		if by := l.claimHolder(u, ""); by != "" {
			return refused(u, ErrPrepared, "prepared for "+by+" through DRA")
		}
		if reason, by := l.unsettledHolderLocked(u); by != "" && !l.settling {
			return refused(u, reason, by)
		}
	}
	for _, u := range uuids {
		if _, ok := l.doomed[u]; !ok {
			l.doomed[u] = why
		}
	}
	return nil
}

// SettlingClaims marks the MIG plans applied from now on (until called
// with false) as a claim's own: they make and undo the devices of intents
// and releases, which layouts' plans must leave alone.
func (l *Ledger) SettlingClaims(on bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.settling = on
}

// unsettledHolderLocked says which claim's intent or release u belongs to
// ("" if none), and the reason it wraps: a MIG device being made or
// destroyed for a claim (by its UUID, or by its placement for one whose
// UUID is not known yet), or the GPU such a device is on, whose mode must
// not change under it.
func (l *Ledger) unsettledHolderLocked(u string) (reason error, why string) {
	at, known := l.places[u]
	for _, set := range []struct {
		reason error
		what   string
		m      map[types.UID]Claim
	}{{ErrIntended, "being made for", l.intents}, {ErrReleasing, "being released by", l.releases}} {
		for _, uid := range slices.Sorted(maps.Keys(set.m)) {
			for _, d := range set.m[uid].Devices {
				switch {
				case d.UUID != "" && d.UUID == u, d.Parent != "" && d.Parent == u,
					known && d.Created && d.Parent == at.parent && d.Placement.Overlaps(at.placement):
					return set.reason, set.what + " " + set.m[uid].String()
				}
			}
		}
	}
	return nil, ""
}

// UndoomAll clears every doom: the plans ran, and what they destroyed is
// gone from the catalog published since.
func (l *Ledger) UndoomAll() {
	l.mu.Lock()
	defer l.mu.Unlock()
	clear(l.doomed)
}

// Doomed copies the doomed devices with why.
func (l *Ledger) Doomed() map[string]string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return maps.Clone(l.doomed)
}

// SettleAfter is how long after an Allocate the kubelet's pod-resources
// answer is trusted to list it. The kubelet records a container's devices
// as it admits the pod, right after Allocate returns; the margin covers a
// slow admission.
const SettleAfter = 5 * time.Second

// CompactAbove is the allocation log's size from which settling
// allocations rewrites it with only those still unsettled.
const CompactAbove = compactAbove

// Handout is a device the device plugin hands out: a GPU or MIG UUID,
// whole or as a replica of a shared device (time-slicing, MPS). The
// kubelet counts device IDs, so one silicon offered under two names could
// go to two containers; Admit tells them apart by this.
type Handout struct {
	UUID    string
	Replica bool
}

// Place is where a MIG device sits.
type Place struct {
	GPU       string
	Profile   string
	Placement gpu.Placement
}

// Where is where MIG device u sat at the last inventory (false for a GPU,
// or a device no inventory showed).
func (l *Ledger) Where(u string) (Place, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	p, ok := l.places[u]
	return Place{GPU: p.parent, Profile: p.profile, Placement: p.placement}, ok
}

// Overlaps reports whether devices a and b share silicon: the same device,
// or a MIG device and its GPU (by the last inventory).
func (l *Ledger) Overlaps(a, b string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.overlaps(a, b)
}

// Holders is the kubelet's last answer on who holds what (nil before the
// first).
func (l *Ledger) Holders() *podresources.Attribution {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.holders
}

// standing is an error and since when it stands. Set again with the same
// message it keeps its first time, so the log says it once, however often
// the cause repeats.
type standing struct {
	err   error
	since time.Time
}

// set records err as of now and reports whether it is news.
func (s *standing) set(err error, now time.Time) bool {
	news := s.err == nil || s.err.Error() != err.Error()
	if news {
		s.since = now
	}
	s.err = err
	return news
}

// clear forgets the error and reports whether there was one.
func (s *standing) clear() bool {
	was := s.err != nil
	s.err, s.since = nil, time.Time{}
	return was
}
