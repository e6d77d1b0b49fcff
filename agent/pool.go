package agent

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// The DRA pool, planned from a Snapshot like the catalog (Plan): pure
// functions of what the loop observed and what the ledger holds.

// claimedUUIDs maps each device UUID a prepared claim holds to the claim.
func claimedUUIDs(claims map[types.UID]PreparedClaim) map[string]string {
	out := map[string]string{}
	for _, uid := range slices.Sorted(maps.Keys(claims)) {
		for _, d := range claims[uid].Devices {
			if !d.AdminAccess {
				out[d.UUID] = claims[uid].String()
			}
		}
	}
	return out
}

// releasingUUIDs maps each MIG device still to be destroyed for a released
// claim, or being made for one (for an intent, the instance no claim holds
// at its placement), and its GPU, to the claim: neither is offered
// meanwhile.
func releasingUUIDs(releases, intents map[types.UID]PreparedClaim, inv *gpu.Inventory, claimed map[string]string) map[string]string {
	out := map[string]string{}
	for _, set := range []map[types.UID]PreparedClaim{releases, intents} {
		for _, uid := range slices.Sorted(maps.Keys(set)) {
			pc := set[uid]
			for _, d := range pc.Devices {
				for _, id := range []string{d.UUID, d.Parent} {
					if _, ok := out[id]; id != "" && !ok {
						out[id] = pc.String()
					}
				}
				if d.UUID != "" || inv == nil {
					continue
				}
				if g, ok := inv.GPUByUUID(d.Parent); ok {
					if m, ok := instanceAt(g, d.Profile, d.Placement); ok && !hasKey(claimed, m.UUID) {
						out[m.UUID] = pc.String()
					}
				}
			}
		}
	}
	return out
}

// unsettled lists the MIG devices of intents and releases, in claim order.
func unsettled(sets ...map[types.UID]PreparedClaim) []PreparedClaimDevice {
	var out []PreparedClaimDevice
	for _, set := range sets {
		for _, uid := range slices.Sorted(maps.Keys(set)) {
			for _, d := range set[uid].Devices {
				if d.Created {
					out = append(out, d)
				}
			}
		}
	}
	return out
}

// planDRA is the pool the node offers through DRA: every device the
// inventory has, less those the device plugin's containers hold (a device
// goes one way at a time); devices prepared for claims stay in (the
// scheduler already counts them as allocated). MIG-capable GPUs that no
// config layout governs get their MIG devices on demand: every profile at
// every free placement, drawing on the GPU's counters (dynamicGPUs). GPUs
// are published best set first (dra.PublishOrder), so that a plain count
// claim tends to get an NVLink-connected set.
func planDRA(s Snapshot) *devicemodel.Pool {
	if !s.DRA {
		return nil
	}
	unhealthy := s.Health.UnhealthyDevices()
	dynamic := dynamicGPUs(s)
	direct := func(uuid string) bool { return pluginHolds(s.Holdings, uuid) }
	// held: a container holds the device, its GPU whole, or (for a GPU)
	// one of its MIG devices, through the device plugin.
	held := func(uuid string) bool {
		if direct(uuid) || direct(s.Inventory.ParentOf(uuid)) {
			return true
		}
		if g, ok := s.Inventory.GPUByUUID(uuid); ok {
			return slices.ContainsFunc(g.Instances, func(m gpu.MIGInstance) bool { return direct(m.UUID) })
		}
		return false
	}
	p := &devicemodel.Pool{}
	for _, d := range devicemodel.Devices(s.Inventory, s.Profiles, unhealthy) {
		if dyn, ok := dynamic[d.ParentIndexOrSelf()]; ok && !dynamicKeepsStatic(dyn, d) {
			continue // the GPU's dynamic devices stand for it
		}
		if _, claimed := s.Holdings.Claimed[d.UUID]; !claimed && held(d.UUID) {
			continue
		}
		if hasKey(s.Holdings.Releasing, d.UUID) {
			continue
		}
		p.Devices = append(p.Devices, d)
	}
	bases := map[string]devicemodel.Device{}
	for i, b := range devicemodel.GPUBases(s.Inventory) {
		bases[s.Inventory.GPUs[i].UUID] = b
	}
	for _, idx := range slices.Sorted(maps.Keys(dynamic)) {
		dyn := dynamic[idx]
		g := dyn.GPU
		if _, claimed := s.Holdings.Claimed[g.UUID]; !claimed && held(g.UUID) {
			continue // a container holds the whole GPU
		}
		base := bases[g.UUID]
		base.Unhealthy = unhealthy[g.UUID]
		devs, set := devicemodel.Partitions(dyn, base)
		p.Devices = append(p.Devices, devs...)
		if len(set.Counters) > 0 { // none when no two devices left could clash
			p.CounterSets = append(p.CounterSets, set)
		}
	}
	slices.SortFunc(p.Devices, func(a, b devicemodel.Device) int { return strings.Compare(a.Name, b.Name) })
	p.GPUOrder = devicemodel.PublishOrder(s.Inventory)
	if s.Selected.Config != nil {
		p.MIGAttributes = s.Selected.Config.DRA.MIGDeviceAttributes
	}
	return p
}

// dynamicKeepsStatic reports whether d, a device of a dynamic GPU, stays in
// the pool as it is: a MIG device no claim created, which blocks its
// placement.
func dynamicKeepsStatic(dyn devicemodel.Dynamic, d devicemodel.Device) bool {
	return d.Type == devicemodel.TypeMIG && slices.Contains(dyn.Blocked, d.Placement)
}

// dynamicGPUs are the GPUs whose MIG devices are created on demand, by
// index: MIG-capable, read completely, not changing MIG mode, with known
// profiles, governed by no MIG layout of the config, and either chosen by
// the config's dra.migOnDemand (off by default: the scheduler pays for every
// partition on every node, docs/dra-devices.md "Scale") or holding a MIG
// device a claim made or is making. A GPU with MIG off qualifies only where
// turning it on needs no reset (Hopper and newer; an A100 needs one, so it
// stays a whole GPU). Placements taken by MIG devices that no claim created
// are blocked.
//
// A GPU the config no longer chooses stays dynamic while claims hold MIG
// devices made on it, offering only those (the claims' allocations name
// them, and the scheduler must keep counting them as taken), and goes back
// to a whole or static MIG GPU once they are released.
func dynamicGPUs(s Snapshot) map[int]devicemodel.Dynamic {
	if !s.DRA || !s.MIGApplies || s.Inventory == nil {
		return nil
	}
	laid := map[int]bool{}
	if layout := s.Selected.MIGLayout; layout != nil {
		wants, err := mig.Desired(layout, s.Inventory)
		if err != nil {
			return nil // a broken layout: leave every GPU as it is
		}
		for i := range wants {
			laid[i] = true
		}
	}
	var onDemand *config.MIGOnDemand
	if s.Selected.Config != nil {
		onDemand = s.Selected.Config.DRA.MIGOnDemand
	}
	created, madeFor := claimsMade(s.Holdings)
	out := map[int]devicemodel.Dynamic{}
	for _, g := range s.Inventory.GPUs {
		profiles, ok := s.Profiles[g.Name]
		if laid[g.Index] || !g.MIGCapable || g.MIGUnknown() || g.MIG.Current != g.MIG.Pending || !ok || len(profiles) == 0 {
			continue
		}
		chosen := onDemand != nil && onDemand.Enabled && migDeviceFilterMatches(onDemand.DeviceFilter, g)
		made := madeFor[g.UUID]
		var dyn devicemodel.Dynamic
		if chosen && onDemand.SpareLayout != nil && s.MIGOpen != nil {
			var ok bool
			if dyn, ok = layoutFace(s, g, profiles, made); !ok {
				continue
			}
		} else {
			closing := false
			if chosen && len(made) == 0 && s.MIGOpen != nil {
				since, open := s.MIGOpen[g.UUID]
				chosen, closing = open, open && !since.IsZero()
			}
			if !chosen && len(made) == 0 {
				continue
			}
			if !g.MIG.Current && !migModeWithoutReset(g) {
				continue
			}
			// Not whole while a release or intent on it waits: MIG may be on,
			// with a device left, whatever the last read said.
			dyn = devicemodel.Dynamic{GPU: g, Profiles: profiles, Whole: chosen && !g.MIG.Current && !hasKey(s.Holdings.Releasing, g.UUID), Closing: closing}
			if chosen {
				dyn.Offered, dyn.Made = onDemand.Profiles, made
				for _, m := range made {
					// A claim keeps the partition it holds even when its profile
					// has left the allow-list since.
					if len(dyn.Offered) > 0 && !slices.Contains(dyn.Offered, m.Profile) {
						dyn.Only = append(dyn.Only, m)
					}
				}
				if len(dyn.Only) > 0 {
					dyn.Only = append(dyn.Only, allowedPartitions(profiles, onDemand.Profiles)...)
					dyn.Offered = nil
				}
			} else {
				dyn.Only = made
			}
		}
		for _, m := range g.Instances {
			if !created[fmt.Sprintf("%s/%d+%d", g.UUID, m.Placement.Start, m.Placement.Size)] {
				dyn.Blocked = append(dyn.Blocked, m.Placement)
			}
		}
		for _, gi := range g.GIsWithoutCI {
			dyn.Blocked = append(dyn.Blocked, gi.Placement)
		}
		for _, d := range s.Holdings.Unsettled {
			// One a claim holds again stands as its partition.
			if d.Parent == g.UUID && !created[fmt.Sprintf("%s/%d+%d", g.UUID, d.Placement.Start, d.Placement.Size)] && !slices.Contains(dyn.Blocked, d.Placement) {
				dyn.Blocked = append(dyn.Blocked, d.Placement)
			}
		}
		out[g.Index] = dyn
	}
	return out
}

// layoutFace is what g, a GPU chosen for MIG on demand under
// migOnDemand.spareLayout, offers as nextOpen left it (Snapshot.MIGOpen,
// MIGOpening), beside the partitions claims made there (made); false when
// it is a plain whole GPU. The GPU whole and its layout are never offered
// untainted together, and neither is offered while the other is tainted:
//   - open: the layout, less what clashes with made (tainted while closing);
//   - opening: whole, tainted (on a GPU in use: made only);
//   - both (open and opening, a GPU whose past is not known): whole and
//     every partition, tainted, on counters;
//   - neither: whole.
//
// A GPU held whole offers its whole device (claimed) and no partition.
// A model that cannot hold the layout offers made only, or is whole.
func layoutFace(s Snapshot, g gpu.GPU, profiles mig.Profiles, made []devicemodel.ProfileAt) (devicemodel.Dynamic, bool) {
	od := s.Selected.Config.DRA.MIGOnDemand
	since, isOpen := s.MIGOpen[g.UUID]
	_, isOpening := s.MIGOpening[g.UUID]
	layout, err := spareLayout(od, profiles)
	inUse := migInUse(g, made)
	dyn := devicemodel.Dynamic{GPU: g, Profiles: profiles, Only: slices.Clone(made)}
	if dyn.Only == nil {
		dyn.Only = []devicemodel.ProfileAt{}
	}
	switch {
	case err != nil || (!isOpen && !isOpening):
		return dyn, len(made) > 0
	case inUse:
		if !g.MIG.Current && !migModeWithoutReset(g) {
			return dyn, false
		}
	case hasKey(s.Holdings.Claimed, g.UUID) || pluginHolds(s.Holdings, g.UUID) || hasKey(s.Holdings.Releasing, g.UUID):
		return dyn, false // whole: it stays offered while held
	case isOpen && isOpening:
		dyn.Whole, dyn.WholeClosing, dyn.Closing = true, true, true
		dyn.Only, dyn.Offered = nil, od.Profiles
		return dyn, true
	case isOpening:
		dyn.Whole, dyn.WholeClosing = true, true
		return dyn, true
	}
	if isOpening {
		return dyn, true // in use: the layout waits out the grace
	}
	dyn.Closing = !since.IsZero()
	for _, l := range layout {
		if !slices.ContainsFunc(made, func(m devicemodel.ProfileAt) bool { return m.Placement.Overlaps(l.Placement) }) {
			dyn.Only = append(dyn.Only, l)
		}
	}
	return dyn, true
}

// migInUse reports whether g, a GPU chosen for MIG on demand, is in MIG
// use: claims made (or are making) partitions there, MIG mode is or is
// going on, or it holds instances. It then offers partitions, never itself
// whole.
func migInUse(g gpu.GPU, made []devicemodel.ProfileAt) bool {
	return len(made) > 0 || g.MIG.Current || g.MIG.Pending || len(g.Instances) > 0 || len(g.GIsWithoutCI) > 0
}

// closeGrace is how long a surplus spare's partitions stay published,
// tainted, before they go: far longer than the scheduler takes to see the
// taint and bind a pod it gave one of them just before, whose claim is then
// prepared (a Prepare takes any free placement of a chosen GPU).
const closeGrace = time.Minute

// spares is which chosen GPUs offer MIG devices on demand under
// migOnDemand.spareGPUs, as one pass decided (Snapshot.MIGOpen and
// MIGOpening).
type spares struct {
	// open are the GPUs offering them, each with when it was found a
	// surplus spare (zero: it is not closing). Nil: not known (after a
	// start), or no spare limit applies.
	open map[string]time.Time
	// opening, under spareLayout only, are GPUs offered whole but tainted
	// since the time given, before their layout replaces it.
	opening map[string]time.Time
	// layout: decided under migOnDemand.spareLayout.
	layout bool
	// off: decided under a config that offers no MIG on demand, so every
	// GPU free of claims' MIG devices was offered whole only.
	off bool
}

// nextOpen works out which chosen GPUs offer MIG devices on demand under
// migOnDemand.spareGPUs, from the last pass's answer prev (open nil: none
// yet, as after a start, when every chosen GPU may have offered them) at
// now. Nil maps when no spare limit applies.
//
// On counters (no spareLayout) a GPU opens at once: publishing more devices
// never takes one from a claim. It closes only through the grace: a free GPU
// beyond the spares (the ones last in the publish order, those open before
// first, so that whole GPUs go to the best sets) is marked closing, its
// partitions tainted, and leaves the map grace later if still surplus. GPUs
// with MIG devices (or MIG mode on) stay open. A GPU held whole leaves at
// once: its partitions are blocked by the counters the holding claim takes,
// so no claim can have been given one.
//
// Under spareLayout the GPU whole and its layout never stand side by side
// (no counters tell the scheduler they clash), so each change of face goes
// through the grace: a spare-to-be is first opening (whole, tainted, no
// partition), then open; a surplus spare closing (its layout tainted, not
// whole), then whole. A GPU whose past is not known (after a start with no
// record, or one that offered both on counters) offers both, tainted, on
// counters, for the grace before it settles.
func nextOpen(s Snapshot, prev spares, now time.Time, grace time.Duration) spares {
	if !s.DRA || s.Selected.Config == nil || s.Inventory == nil {
		return spares{}
	}
	od := s.Selected.Config.DRA.MIGOnDemand
	if od == nil || !od.Enabled {
		return spares{off: true}
	}
	if od.SpareGPUs <= 0 {
		return spares{}
	}
	all := s
	all.MIGOpen, all.MIGOpening = nil, nil
	dynamic := dynamicGPUs(all)
	_, madeFor := claimsMade(s.Holdings)
	order := devicemodel.PublishOrder(s.Inventory)
	slices.Reverse(order)
	out := spares{open: map[string]time.Time{}, layout: od.SpareLayout != nil}
	if out.layout {
		out.opening = map[string]time.Time{}
	}
	// What each GPU offered after the last pass.
	type face int
	const (
		whole   face = iota
		opening      // whole, tainted
		open         // partitions (closing: tainted)
		both         // both, tainted, on counters
	)
	was := func(uuid string) face {
		_, isOpen := prev.open[uuid]
		_, isOpening := prev.opening[uuid]
		switch {
		case prev.off:
			return whole
		case !out.layout && (prev.open == nil || isOpen):
			// On counters both may stand: what was open still is.
			return open
		case !out.layout:
			return whole
		case prev.open == nil, !prev.layout && isOpen, isOpen && isOpening:
			return both
		case isOpen:
			return open
		case isOpening:
			return opening
		}
		return whole
	}
	// settle moves g toward offering partitions (spare) or whole.
	settle := func(g gpu.GPU, spare bool) {
		switch was(g.UUID) {
		case open:
			if spare {
				out.open[g.UUID] = time.Time{}
				return
			}
			since := prev.open[g.UUID]
			if since.IsZero() {
				since = now
			}
			if now.Sub(since) < grace {
				out.open[g.UUID] = since
			}
		case opening:
			if since := prev.opening[g.UUID]; now.Sub(since) < grace {
				out.opening[g.UUID] = since
			} else if spare {
				out.open[g.UUID] = time.Time{}
			}
		case both:
			since := prev.opening[g.UUID]
			if prev.open == nil || since.IsZero() {
				since = now
			}
			if now.Sub(since) < grace {
				out.open[g.UUID], out.opening[g.UUID] = since, since
			} else if spare {
				out.open[g.UUID] = time.Time{}
			}
		case whole:
			if spare && out.layout {
				out.opening[g.UUID] = now
			} else if spare {
				out.open[g.UUID] = time.Time{}
			}
		}
	}
	var free []gpu.GPU
	for _, idx := range order {
		dyn, ok := dynamic[idx]
		if !ok || !migDeviceFilterMatches(od.DeviceFilter, dyn.GPU) {
			continue
		}
		g := dyn.GPU
		inUse := migInUse(g, madeFor[g.UUID])
		heldWhole := hasKey(s.Holdings.Claimed, g.UUID) || pluginHolds(s.Holdings, g.UUID)
		switch {
		case inUse && !out.layout:
			out.open[g.UUID] = time.Time{}
		case heldWhole && !out.layout:
			// Held whole: closed at once (see above).
		case inUse:
			// Under spareLayout a change of face waits out the grace,
			// whatever holds the GPU: the scheduler may have given out
			// the face it leaves.
			settle(g, true)
		case heldWhole:
			settle(g, false)
		default:
			if _, err := spareLayout(od, dyn.Profiles); err == nil {
				free = append(free, g)
			}
		}
	}
	// A cordoned or unhealthy GPU's partitions carry a taint no plain
	// claim tolerates: it makes a poor spare.
	unusable := map[string]bool{}
	for _, c := range s.Cordon().GPUs {
		unusable[c.UUID] = true
	}
	for uuid := range s.Health.UnhealthyDevices() {
		unusable[uuid] = true
	}
	// The spares: usable ones first; then open ones, so that a freed GPU
	// does not close one that claims may be taking now (those not closing
	// first), then those on their way; then by the publish order, from its
	// end.
	rank := func(g gpu.GPU) int {
		r := map[face]int{open: 0, both: 2, opening: 2, whole: 3}[was(g.UUID)]
		if since, ok := prev.open[g.UUID]; ok && r == 0 && !since.IsZero() {
			r = 1
		}
		if unusable[g.UUID] {
			r += 4
		}
		return r
	}
	slices.SortStableFunc(free, func(a, b gpu.GPU) int { return rank(a) - rank(b) })
	for i, g := range free {
		settle(g, i < od.SpareGPUs)
	}
	return out
}

// spareLayout is the config's spareLayout placed on an empty GPU whose
// profiles are profiles (nil when the config has none), or why no GPU of
// the model can hold it.
func spareLayout(od *config.MIGOnDemand, profiles mig.Profiles) ([]devicemodel.ProfileAt, error) {
	if od == nil || od.SpareLayout == nil {
		return nil, nil
	}
	counts, err := spareCounts(od, profiles)
	if err != nil {
		return nil, err
	}
	return mig.PlaceLayout(profiles, counts)
}

// spareCounts is the config's spareLayout in the profiles of a model
// (ps). A key "<n>g" names the model's plain profile of n compute slices
// with the least memory, among migOnDemand.profiles where those are given
// (1g.10gb on an H100, 1g.5gb on an A100 40GB, 1g.23gb on a B200), so that
// one layout serves every MIG model of a fleet; a full name stands for
// itself.
func spareCounts(od *config.MIGOnDemand, ps mig.Profiles) (map[string]int, error) {
	out := make(map[string]int, len(od.SpareLayout))
	for key, n := range od.SpareLayout {
		name := key
		if compute, ok := config.SpareLayoutSlices(key); ok {
			name = ""
			for _, p := range ps {
				plain := !strings.Contains(p.Name, "+") && !strings.HasSuffix(p.Name, "-me")
				if !plain || int(p.Info.SliceCount) != compute || (len(od.Profiles) > 0 && !od.Offers(p.Name)) {
					continue
				}
				if best, ok := ps[name]; !ok || p.Info.MemorySizeMB < best.Info.MemorySizeMB || (p.Info.MemorySizeMB == best.Info.MemorySizeMB && p.Name < name) {
					name = p.Name
				}
			}
			if name == "" {
				return nil, fmt.Errorf("spareLayout %q: no MIG profile of %d compute slices offered", key, compute)
			}
		}
		out[name] += n
	}
	return out, nil
}

// spareLayoutWarnings name the GPUs chosen for MIG on demand that cannot
// hold sel's spareLayout: they are offered whole only.
func spareLayoutWarnings(inv *gpu.Inventory, profiles map[string]mig.Profiles, sel config.Selected) []string {
	if inv == nil || sel.Config == nil {
		return nil
	}
	od := sel.Config.DRA.MIGOnDemand
	if od == nil || !od.Enabled || od.SpareLayout == nil {
		return nil
	}
	// One warning per model: the layout fits all its GPUs or none.
	var models []string
	gpus := map[string][]string{}
	why := map[string]error{}
	for _, g := range inv.GPUs {
		ps, ok := profiles[g.Name]
		if !g.MIGCapable || !ok || len(ps) == 0 || !migDeviceFilterMatches(od.DeviceFilter, g) {
			continue
		}
		if _, err := spareLayout(od, ps); err != nil {
			if _, seen := why[g.Name]; !seen {
				models = append(models, g.Name)
			}
			why[g.Name] = err
			gpus[g.Name] = append(gpus[g.Name], strconv.Itoa(g.Index))
		}
	}
	var out []string
	for _, m := range models {
		out = append(out, fmt.Sprintf("configs.%s.dra.migOnDemand.spareLayout: GPUs %s (%s): %v; offered whole only",
			sel.Name, strings.Join(gpus[m], ", "), m, why[m]))
	}
	return out
}

// noteOpen takes next as the GPUs offering MIG devices on demand, logging
// each GPU that opens, starts closing or closes.
func (a *Agent) noteOpen(next spares) {
	prev := a.spares
	a.spares = next
	if prev.open == nil || next.open == nil || a.inv == nil {
		return
	}
	for _, g := range a.inv.GPUs {
		was, wasOpen := prev.open[g.UUID]
		now, isOpen := next.open[g.UUID]
		_, wasOpening := prev.opening[g.UUID]
		_, isOpening := next.opening[g.UUID]
		switch {
		case isOpening && !wasOpening:
			a.log.Info("GPU chosen as a spare: offered whole, tainted, until its spare layout replaces it",
				"gpu", g.Index, "uuid", g.UUID, "taint", devicemodel.TaintClosing, "grace", a.opts.MIGCloseGrace)
		case wasOpening && !isOpening && !isOpen:
			a.log.Info("GPU no longer chosen as a spare: offered whole", "gpu", g.Index, "uuid", g.UUID)
		case isOpen && !wasOpen:
			a.log.Info("GPU opened as a spare: it offers MIG devices on demand", "gpu", g.Index, "uuid", g.UUID)
		case isOpen && !now.IsZero() && was.IsZero():
			a.log.Info("GPU is a surplus spare: its MIG devices on demand are tainted, and go unless it is needed again",
				"gpu", g.Index, "uuid", g.UUID, "taint", devicemodel.TaintClosing, "grace", a.opts.MIGCloseGrace)
		case isOpen && now.IsZero() && !was.IsZero():
			a.log.Info("GPU is a spare again: its MIG devices on demand stay", "gpu", g.Index, "uuid", g.UUID)
		case wasOpen && !isOpen:
			a.log.Info("GPU no longer offers MIG devices on demand: offered whole only", "gpu", g.Index, "uuid", g.UUID)
		}
	}
}

// SettledMIGOpen is Snapshot.MIGOpen on an idle node once surplus spares
// have closed, for what `config validate` shows.
func SettledMIGOpen(s Snapshot) (open, opening map[string]time.Time) {
	sp := nextOpen(s, spares{}, time.Time{}, 0)
	return sp.open, sp.opening
}

// claimsMade is what claims made on the GPUs: created, the parent UUID and
// placement ("uuid/start+size") of each MIG device a prepared claim made,
// and madeFor, per GPU UUID, the partitions claims made or are making
// there (intents and releases included).
func claimsMade(h Holdings) (created map[string]bool, madeFor map[string][]devicemodel.ProfileAt) {
	created, madeFor = map[string]bool{}, map[string][]devicemodel.ProfileAt{}
	for _, pc := range h.Claims {
		for _, d := range pc.Devices {
			if d.Created {
				created[fmt.Sprintf("%s/%d+%d", d.Parent, d.Placement.Start, d.Placement.Size)] = true
				madeFor[d.Parent] = append(madeFor[d.Parent], devicemodel.ProfileAt{Profile: d.Profile, Placement: d.Placement})
			}
		}
	}
	for _, d := range h.Unsettled {
		madeFor[d.Parent] = append(madeFor[d.Parent], devicemodel.ProfileAt{Profile: d.Profile, Placement: d.Placement})
	}
	return created, madeFor
}

// pluginHolds reports whether a container holds device uuid through the
// device plugin: the kubelet lists it, or an allocation it has not listed
// yet is in the ledger.
func pluginHolds(h Holdings, uuid string) bool {
	return uuid != "" && (len(h.Attribution.Holders(uuid)) > 0 || hasKey(h.Allocated, uuid))
}

// allowedPartitions lists every placement of the allowed profiles.
func allowedPartitions(ps mig.Profiles, allowed []string) []devicemodel.ProfileAt {
	var out []devicemodel.ProfileAt
	for _, p := range ps {
		if !slices.Contains(allowed, p.Name) {
			continue
		}
		for _, pl := range p.Placements {
			out = append(out, devicemodel.ProfileAt{Profile: p.Name, Placement: pl})
		}
	}
	return out
}

// migDeviceFilterMatches reports whether g is one of the PCI device IDs of
// filter (mig-parted's device-filter; empty matches every GPU). A GPU whose
// ID is unknown matches no filter.
func migDeviceFilterMatches(filter []string, g gpu.GPU) bool {
	if len(filter) == 0 {
		return true
	}
	for _, f := range filter {
		v, err := strconv.ParseUint(strings.TrimPrefix(strings.ToLower(f), "0x"), 16, 32)
		if err == nil && g.PCIDeviceID != 0 && uint32(v) == g.PCIDeviceID {
			return true
		}
	}
	return false
}

// migModeWithoutReset: from Hopper on, an idle GPU changes MIG mode at once;
// Ampere needs a GPU reset, which the agent never does.
func migModeWithoutReset(g gpu.GPU) bool { return g.ComputeCapability.AtLeast(9, 0) }

// shareDevices marks the pool's devices that the config shares, by
// time-slicing or MPS: each may be shared by as many claims as the catalog
// has replicas of it.
func shareDevices(p *devicemodel.Pool, cat *catalog.Catalog, sel config.Selected) {
	if p == nil || cat == nil || sel.Config == nil {
		return
	}
	replicas := map[string]int{}
	mps := map[string]bool{}
	count := func(e config.ReplicatedResource, renameByDefault, isMPS bool) {
		name := e.Rename
		if name == "" {
			name = e.Name
			if renameByDefault {
				name += ".shared"
			}
		}
		res := cat.Resources[name]
		if res == nil {
			return
		}
		for _, dev := range res.Devices {
			if dev.Replica {
				replicas[dev.Spec.VisibleID]++
				mps[dev.Spec.VisibleID] = mps[dev.Spec.VisibleID] || isMPS
			}
		}
	}
	if ts := sel.Config.Sharing.TimeSlicing; ts != nil {
		for _, r := range ts.Resources {
			count(r, ts.RenameByDefault, false)
		}
	}
	if m := sel.Config.Sharing.MPS; m != nil {
		for _, r := range m.Resources {
			count(r.ReplicatedResource, m.RenameByDefault, true)
		}
	}
	for i := range p.Devices {
		if n := replicas[p.Devices[i].UUID]; n > 1 && !p.Devices[i].Partition {
			p.Devices[i].Shares = n
			p.Devices[i].MPS = mps[p.Devices[i].UUID]
		}
	}
}

// evictOnUnhealthy gives unhealthy devices the NoExecute taint when the
// config asks for it (health.draTaintEffect).
func evictOnUnhealthy(p *devicemodel.Pool, sel config.Selected) {
	if p == nil || sel.Config == nil || sel.Config.Health.DRATaintEffect != config.DRATaintNoExecute {
		return
	}
	for i := range p.Devices {
		p.Devices[i].Evict = p.Devices[i].Unhealthy != ""
	}
}

func hasKey[K comparable, V any](m map[K]V, k K) bool {
	_, ok := m[k]
	return ok
}

// withholdClaimed marks every catalog device that stands for a device in
// claimed or in gpus (the device itself, its replicas) unavailable to the
// kubelet's device manager: a device goes one way at a time.
func withholdClaimed(cat *catalog.Catalog, claimed, gpus map[string]string, why func(by string) string) {
	if cat == nil || len(claimed)+len(gpus) == 0 {
		return
	}
	for _, r := range cat.Resources {
		for i := range r.Devices {
			d := &r.Devices[i]
			by, ok := claimed[d.Spec.VisibleID]
			if !ok {
				by, ok = gpus[d.Spec.VisibleID]
			}
			if !ok {
				continue
			}
			d.Healthy = false
			d.Reason = why(by)
		}
	}
}

// claimedGPUs maps each GPU one of whose MIG devices a claim holds to the
// claim: a GPU offered whole (MIG strategy none) is not free then. A MIG
// device made for the claim names its GPU itself (Parent), so its GPU stays
// the claim's when the device is gone before the claim (an agent killed
// mid-Unprepare); others are found in the inventory.
func claimedGPUs(claims map[types.UID]PreparedClaim, inv *gpu.Inventory) map[string]string {
	out := map[string]string{}
	for _, uid := range slices.Sorted(maps.Keys(claims)) {
		for _, d := range claims[uid].Devices {
			parent := d.Parent
			if !d.Created && inv != nil {
				parent = inv.ParentOf(d.UUID)
			}
			if _, ok := out[parent]; !d.AdminAccess && parent != "" && !ok {
				out[parent] = claims[uid].String()
			}
		}
	}
	return out
}
