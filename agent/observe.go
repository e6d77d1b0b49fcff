package agent

import (
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// maxMisses is how many inventories in a row may fail to read a GPU (for a
// reason other than NVML saying it is lost) before it is offered as
// unhealthy: one failed call is not a failed GPU, and withdrawing or
// flapping devices on every NVML hiccup would fail pods for nothing.
const maxMisses = 3

// FailedGPU is a GPU known earlier that the inventory could not read.
type FailedGPU struct {
	GPU    gpu.GPU
	Reason string
	// Since is when it was first not read (kept across restarts); Gone
	// says NVML no longer enumerates it at all, as after the GPU was
	// swapped for another (an RMA).
	Since time.Time
	Gone  bool
}

// observe reads the GPUs and settles what the loop believes about them; on
// failure the last inventory stays.
func (a *Agent) observe(why string) {
	a.readNow = nil // until a read settles
	for attempt := 1; ; attempt++ {
		next, err := a.opts.Observer.Inventory()
		if err != nil {
			// Keep serving the last inventory: a transient NVML failure must
			// not withdraw every device from the kubelet.
			a.log.Error("inventory failed; keeping the last one", "reason", why, "error", err)
			a.metrics.inventoryErrors.Inc()
			if !a.withdrawTouched() {
				return
			}
			break
		}
		for _, e := range next.Errors {
			a.log.Debug("inventory incomplete", "error", e.Error())
		}
		inv, transient := a.settle(next)
		if transient && a.inv == nil && attempt < maxMisses {
			// Nothing believed yet to fall back on: read again at once
			// rather than serve a half-read node until the next resync.
			continue
		}
		if inv == a.inv && !a.withdrawTouched() {
			return
		}
		a.inv = inv
		a.withdrawTouched()
		break
	}
	gpus := slices.Clone(a.inv.GPUs)
	for _, uuid := range slices.Sorted(maps.Keys(a.failed)) {
		gpus = append(gpus, a.failed[uuid].GPU)
	}
	a.ledger.SetInventory(gpus)
	a.readProfiles()
	if a.opts.Health != nil {
		a.opts.Health.SetInventory(a.inv)
	}
	for _, o := range a.opts.InventoryObservers {
		o(a.inv)
	}
	a.syncCDI(why)
}

// touchMIG records that a MIG plan is about to run on GPU uuid: until the
// GPU is read completely again, its record from before is not believed.
// The set is checkpointed before the plan runs, so that an agent killed
// in the middle of it does not, once restarted, believe the checkpoint's
// record from before the plan either. A checkpoint that cannot be written
// does not stop the plan: it is retried at every pass and shown on
// /status, as for anything else the checkpoint holds.
func (a *Agent) touchMIG(uuid string) {
	if a.migTouched[uuid] {
		return
	}
	if a.migTouched == nil {
		a.migTouched = map[string]bool{}
	}
	a.migTouched[uuid] = true
	a.checkpoint()
}

// withoutMIG is what is known of GPU g after a MIG plan ran on it and no
// read since was complete: not its MIG devices (the plan destroyed some,
// made others), so none is offered.
func withoutMIG(g gpu.GPU) gpu.GPU {
	g.Instances, g.GIsWithoutCI = nil, nil
	return g
}

// withdrawTouched moves out of the inventory, into the failed GPUs, every
// GPU a MIG plan ran on that the last observe did not read completely (it
// failed, or kept the last inventory for a GPU missing for a moment): its
// record from before the plan would offer the MIG devices the plan
// destroyed. It reports whether it moved any.
func (a *Agent) withdrawTouched() bool {
	if a.inv == nil {
		return false
	}
	var drop []string
	for _, g := range a.inv.GPUs {
		if !a.migTouched[g.UUID] || a.read(g.UUID) {
			continue
		}
		if a.failed == nil {
			a.failed = map[string]FailedGPU{}
		}
		a.failed[g.UUID] = a.failedGPU(withoutMIG(g), "not read since its MIG devices changed: none is offered until it is read completely", false)
		drop = append(drop, g.UUID)
	}
	if len(drop) == 0 {
		return false
	}
	a.log.Warn("GPUs not read since their MIG devices changed; offering them as unhealthy, with no MIG device, until read", "gpus", drop)
	a.inv = a.inv.Without(drop)
	return true
}

// settle decides what to believe after a read. A GPU NVML could only partly
// read keeps its last known record (MIG mode, instances): one failed
// GetMigMode must not turn a MIG GPU into a whole one. A GPU missing for a
// transient reason keeps the whole last inventory (the topology is indexed
// by the inventory's GPU order), up to maxMisses reads in a row. A GPU NVML
// calls lost, that is no longer enumerated, or that stayed unreadable is
// offered as unhealthy (a.failed) until it is read again. transient says the
// last inventory was kept (or, with none, that reading again may help).
func (a *Agent) settle(next *gpu.Inventory) (inv *gpu.Inventory, transient bool) {
	prev := a.inv
	if a.misses == nil {
		a.misses = map[string]int{}
	}
	failed := map[string]FailedGPU{}
	kept := map[string]bool{} // partly read: the last record stands
	var partial []string
	for i, g := range next.GPUs {
		if !unsure(g) {
			continue
		}
		if a.migTouched[g.UUID] {
			// A MIG plan ran on it since its last complete read: the last
			// record has the devices it destroyed.
			last := g
			if f, ok := a.failed[g.UUID]; ok {
				last = f.GPU
			} else if prev != nil {
				if old, ok := prev.GPUByUUID(g.UUID); ok {
					last = old
				}
			}
			partial = append(partial, g.UUID)
			failed[g.UUID] = a.failedGPU(withoutMIG(last), fmt.Sprintf("partly read (%v) since its MIG devices changed: none is offered until it is read completely", g.Unread), false)
			continue
		}
		if prev != nil {
			if old, ok := prev.GPUByUUID(g.UUID); ok {
				a.log.Debug("GPU partly read; keeping its last record", "gpu", g.Index, "uuid", g.UUID, "unread", g.Unread)
				next.GPUs[i] = old
				kept[g.UUID] = true
				continue
			}
		}
		if !g.Unknown(gpu.FactMIGMode, gpu.FactInstances) {
			continue // what it is offered as is known; the rest can wait
		}
		if f, was := a.failed[g.UUID]; was {
			// Failed before and only partly read now: it stays failed with
			// its last complete record, not with this read's missing MIG
			// devices.
			partial = append(partial, g.UUID)
			failed[g.UUID] = a.failedGPU(f.GPU, f.Reason, f.Gone)
			continue
		}
		// Nothing to fall back on: what it would be offered as is unknown.
		if a.misses[g.UUID]+1 < maxMisses {
			a.misses[g.UUID]++
			transient = true
			continue
		}
		partial = append(partial, g.UUID)
		failed[g.UUID] = a.failedGPU(g, fmt.Sprintf("partly read %d times in a row (%v)", maxMisses, g.Unread), false)
	}
	known := map[string]gpu.GPU{}
	for uuid, f := range a.failed {
		known[uuid] = f.GPU
	}
	if prev != nil {
		for _, g := range prev.GPUs {
			known[g.UUID] = g
		}
	}
	for _, uuid := range slices.Sorted(maps.Keys(known)) {
		g := known[uuid]
		if ng, ok := next.GPUByUUID(uuid); ok && !slices.Contains(partial, ng.UUID) {
			if _, was := a.failed[uuid]; was {
				a.log.Info("GPU readable again", "gpu", g.Index, "uuid", uuid)
			}
			delete(a.misses, uuid)
			continue
		} else if ok {
			continue // partly read, failed above
		}
		e, found := errorFor(next, g)
		switch {
		case !found:
			failed[uuid] = a.failedGPU(g, "no longer enumerated by NVML", true)
		case e.Lost:
			failed[uuid] = a.failedGPU(g, e.Call+": "+e.Err, false)
		case a.misses[uuid]+1 < maxMisses && prev != nil && !a.isFailed(uuid):
			a.misses[uuid]++
			transient = true
			a.log.Warn("GPU could not be read; keeping its last state", "gpu", g.Index, "uuid", uuid,
				"misses", a.misses[uuid], "of", maxMisses, "error", e.Error())
		default:
			a.misses[uuid] = maxMisses
			failed[uuid] = a.failedGPU(g, fmt.Sprintf("%s: %s (%d reads in a row)", e.Call, e.Err, maxMisses), false)
		}
	}
	if transient {
		return prev, true
	}
	a.readNow = map[string]bool{}
	for _, g := range next.GPUs {
		if !kept[g.UUID] && !slices.Contains(partial, g.UUID) {
			a.readNow[g.UUID] = true
			delete(a.migTouched, g.UUID)
		}
	}
	for uuid, f := range failed {
		if _, was := a.failed[uuid]; !was {
			a.log.Warn("GPU could not be read; offering it as unhealthy", "gpu", f.GPU.Index, "uuid", uuid, "reason", f.Reason,
				"since", f.Since, "forget-at", a.forgetAt(f))
		}
	}
	a.forgetGone(failed)
	a.failed = failed
	return next.Without(partial), false
}

// failedGPU records g as failed for reason, since when it first failed
// (this run, or the checkpoint's).
func (a *Agent) failedGPU(g gpu.GPU, reason string, gone bool) FailedGPU {
	since, ok := a.failed[g.UUID].Since, hasKey(a.failed, g.UUID)
	if !ok {
		since, ok = a.failedSince[g.UUID]
	}
	if !ok {
		since = a.now()
	}
	return FailedGPU{GPU: g, Reason: reason, Since: since, Gone: gone}
}

// forgetAt is when failed GPU f is forgotten (zero: never): a GPU NVML no
// longer enumerates, after Options.ForgetGoneAfter.
func (a *Agent) forgetAt(f FailedGPU) time.Time {
	if !f.Gone || a.opts.ForgetGoneAfter <= 0 {
		return time.Time{}
	}
	return f.Since.Add(a.opts.ForgetGoneAfter)
}

// forgetGone drops from failed the GPUs gone for ForgetGoneAfter that no
// container or claim holds: a GPU swapped for another (an RMA) is never
// enumerated again, and would otherwise be offered unhealthy forever. One
// still held stays until it is released.
func (a *Agent) forgetGone(failed map[string]FailedGPU) {
	now := a.now()
	for _, uuid := range slices.Sorted(maps.Keys(failed)) {
		f := failed[uuid]
		at := a.forgetAt(f)
		if at.IsZero() || now.Before(at) {
			continue
		}
		if by := a.ledger.Holder(uuid, ""); by != "" {
			continue // forgotten once released
		}
		delete(failed, uuid)
		delete(a.misses, uuid)
		delete(a.migTouched, uuid)
		a.log.Info("GPU forgotten: not enumerated by NVML for longer than --forget-gone-gpus-after; no longer offered",
			"gpu", f.GPU.Index, "uuid", uuid, "since", f.Since, "after", a.opts.ForgetGoneAfter)
		a.event(false, ReasonGPUForgotten, "GPU %d (%s) forgotten: not enumerated by NVML since %s, more than %s; no longer offered",
			f.GPU.Index, uuid, stamp(f.Since), a.opts.ForgetGoneAfter)
	}
}

// unsure reports whether a GPU's read left facts unknown that decide what it
// is offered as (MIG mode and instances) or how it may be shared.
func unsure(g gpu.GPU) bool {
	return g.Unknown(gpu.FactMIGMode, gpu.FactInstances, gpu.FactGIsWithoutCI, gpu.FactComputeCapability, gpu.FactBrand)
}

// errorFor finds the inventory error that names g, by UUID or else index.
func errorFor(inv *gpu.Inventory, g gpu.GPU) (gpu.DeviceError, bool) {
	for _, e := range inv.Errors {
		if e.UUID == g.UUID {
			return e, true
		}
	}
	for _, e := range inv.Errors {
		if e.UUID == "" && e.Index == g.Index {
			return e, true
		}
	}
	return gpu.DeviceError{}, false
}

// readProfiles reads the MIG profiles of each MIG-capable model not read
// yet; a failure is retried at the next observe.
func (a *Agent) readProfiles() {
	if a.opts.MIG == nil {
		return
	}
	if a.profiles == nil {
		a.profiles, a.profileErrs = map[string]mig.Profiles{}, map[string]error{}
	}
	for _, g := range a.inv.GPUs {
		if !g.MIGCapable {
			continue
		}
		if _, ok := a.profiles[g.Name]; ok {
			continue
		}
		p, err := a.opts.Observer.MIGProfiles(g)
		if err != nil {
			a.profileErrs[g.Name] = err
			continue
		}
		delete(a.profileErrs, g.Name)
		a.profiles[g.Name] = p
	}
}
