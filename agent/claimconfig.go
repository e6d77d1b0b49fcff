package agent

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/mps"
)

// What a DRA claim's opaque config (NVIDIA's GpuConfig and MigDeviceConfig,
// decoded by dra.ConfigsOf) asks of its devices, and how Prepare honours it:
//   - MPS: the claim's containers are clients of the device's MPS control
//     daemon, with the config's limits in their environment (its CDI spec).
//     On a device the node's config does not share, the daemon is the
//     claim's own: started with those limits as its defaults, it runs while
//     the claim holds the device. On a device the config shares by MPS the
//     claim is a client of that daemon, its limits in its environment.
//   - TimeSlicing: the GPU's time slice is set to the config's interval.
//     Sharing is what DRA gives: every pod that references the claim gets
//     the device, and their contexts take turns. Two claims get one device
//     only where the pool lets several claims allocate it (the node's
//     config shares it: allowMultipleAllocations); they must then agree on
//     the interval.
// What cannot be honoured fails Prepare, naming the config and field.

// TimeSlicer sets the compute time slice of a whole GPU (level: Default 0
// .. Long 3, dra.Interval.Level).
type TimeSlicer interface {
	SetInterval(uuid string, level int) error
}

// claimSharing is what a claim's config asks of one of its devices.
type claimSharing struct {
	// field names the config, for errors.
	field   string
	sharing devicemodel.Sharing
	// pinned is the MPS pinned memory limit of this device (0: none).
	pinned int64
}

func (cs *claimSharing) is(s devicemodel.Strategy) bool { return cs != nil && cs.sharing.Strategy == s }

// claimSharings resolves the config of each of c's allocation results
// (index-aligned with c.Devices; nil where none asks for sharing). Admin
// access sees a device as it is: no config applies to it. An MPS config's
// per-device limits name devices by their position among the results it
// applies to, or by UUID.
func claimSharings(c dra.Claim, pool *devicemodel.Pool) ([]*claimSharing, error) {
	out := make([]*claimSharing, len(c.Devices))
	if len(c.Configs) == 0 {
		return out, nil
	}
	applies := map[*devicemodel.DeviceConfig][]int{}
	var order []*devicemodel.DeviceConfig
	for i, r := range c.Devices {
		d, ok := pool.Device(r.Device)
		if !ok || r.AdminAccess {
			continue // an unknown device fails on its own
		}
		cfg, err := devicemodel.ConfigFor(c.Configs, r.Request, d.Type)
		if err != nil {
			return nil, fmt.Errorf("request %q: %w", r.Request, err)
		}
		if cfg == nil {
			continue
		}
		if cfg.Err != nil {
			return nil, fmt.Errorf("request %q: %w", r.Request, cfg.Err)
		}
		if cfg.Sharing == nil {
			continue
		}
		if _, ok := applies[cfg]; !ok {
			order = append(order, cfg)
		}
		applies[cfg] = append(applies[cfg], i)
	}
	for _, cfg := range order {
		idx := applies[cfg]
		var uuids []string
		for _, i := range idx {
			d, _ := pool.Device(c.Devices[i].Device)
			uuids = append(uuids, d.UUID)
		}
		for pos, i := range idx {
			cs := &claimSharing{field: cfg.Field, sharing: *cfg.Sharing}
			if m := cfg.Sharing.MPS; m != nil {
				b, err := m.LimitFor(pos, uuids[pos], uuids)
				if err != nil {
					return nil, fmt.Errorf("request %q: %s: sharing.mpsConfig.%w", c.Devices[i].Request, cfg.Field, err)
				}
				cs.pinned = b
			}
			out[i] = cs
		}
	}
	return out, nil
}

// checkSharing refuses what cs asks of pool device d that the node cannot
// give, before anything is made for the claim.
func (a *Agent) checkSharing(d devicemodel.Device, cs *claimSharing, uid types.UID) error {
	if cs == nil {
		return nil
	}
	at := cs.field + ": sharing.strategy " + string(cs.sharing.Strategy)
	switch cs.sharing.Strategy {
	case devicemodel.StrategyMPS:
		switch {
		case d.Partition:
			return fmt.Errorf("%s: not on a MIG device made on demand (its daemon could only start once the device exists); use a MIG layout's device", at)
		case d.Shares > 1 && !d.MPS:
			return fmt.Errorf("%s: the node's config shares this device by time-slicing, so its other claims are not MPS clients", at)
		case a.opts.MPS == nil:
			return fmt.Errorf("%s: this agent runs no MPS control daemons", at)
		case a.opts.CDI == nil:
			return fmt.Errorf("%s: MPS sharing through DRA needs the agent's CDI specs (--cdi-spec-dir)", at)
		case mps.MaxClients(d.CC) == 0:
			return fmt.Errorf("%s: MPS needs compute capability 3.5, device has %s", at, d.CC)
		}
		if cs.pinned > 0 && uint64(cs.pinned) > d.MemoryBytes {
			return fmt.Errorf("%s: sharing.mpsConfig: pinned memory limit %dMi is above the device's %dMi", cs.field, cs.pinned>>20, d.MemoryBytes>>20)
		}
	case devicemodel.StrategyTimeSlicing:
		if d.MPS {
			return fmt.Errorf("%s: the node's config shares this device by MPS", at)
		}
		iv := cs.sharing.Interval
		if iv == devicemodel.IntervalDefault {
			return nil
		}
		if a.opts.TimeSlice == nil {
			return fmt.Errorf("%s: sharing.timeSlicingConfig.interval %s: this agent cannot set a GPU's time slice (only Default is honoured)", cs.field, iv)
		}
		for other, pc := range a.ledger.Claims() {
			for _, x := range pc.Devices {
				if other != uid && x.UUID == d.UUID && x.Interval != "" && x.Interval != iv {
					return fmt.Errorf("%s: sharing.timeSlicingConfig.interval %s: %s shares the GPU with interval %s", cs.field, iv, pc, x.Interval)
				}
			}
		}
	}
	return nil
}

// decideSharing works out what cs asks of d for the claim's device p: the
// time slice to set, or what makes it an MPS client (its environment and
// mounts, and the claim's own daemon where the config runs none); it
// returns the environment and mounts for the claim's CDI spec (nil: the
// device needs none). A device shared by the config's MPS gives the claim
// client limits from its share (mpsClient). It changes nothing.
func (a *Agent) decideSharing(d devicemodel.Device, r dra.Allocated, cs *claimSharing, p *devicePlan) (map[string]string, []catalog.Mount, error) {
	if cs.is(devicemodel.StrategyTimeSlicing) && cs.sharing.Interval != devicemodel.IntervalDefault {
		p.Interval, p.intervalField = cs.sharing.Interval, cs.field
		p.Device.Interval = cs.sharing.Interval
	}
	switch {
	case d.MPS:
		env, mounts, err := a.mpsClient(d, r)
		if err != nil || !cs.is(devicemodel.StrategyMPS) {
			return env, mounts, err
		}
		// The claim's own limits, within the daemon's: the environment
		// can only lower what the daemon gives.
		if pct := cs.sharing.MPS.ActiveThreadPercentage; pct > 0 {
			env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = strconv.Itoa(pct)
		}
		if cs.pinned > 0 {
			env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = "0=" + strconv.FormatInt(cs.pinned>>20, 10) + "M"
		}
		return env, mounts, nil
	case cs.is(devicemodel.StrategyMPS):
		dm := mps.Daemon{Device: d.UUID, Index: d.ParentIndexOrSelf(), ActiveThreadPercentage: cs.sharing.MPS.ActiveThreadPercentage, PinnedMemLimitBytes: uint64(cs.pinned)}
		if err := dm.Validate(); err != nil {
			return nil, nil, fmt.Errorf("%s: %w", cs.field, err)
		}
		env, mounts := mps.ContainerSpec(a.opts.MPSRoot, a.opts.MPSShmDir, dm)
		p.Daemon, p.Device.MPSDaemon = &dm, &dm
		return env, mounts, nil
	}
	return nil, nil, nil
}

// mpsPendingFor is how long a daemon started for a claim that is not
// prepared yet keeps running: the kubelet retries a failed Prepare within
// its pod backoff, which is at most a few minutes.
const mpsPendingFor = 5 * time.Minute

// pendingMPS is a daemon a claim asked for, started before its Prepare can
// succeed.
type pendingMPS struct {
	daemon mps.Daemon
	claim  types.UID
	since  time.Time
}

// mpsUp says whether claim uid's daemon dm answers; if not, it is asked for
// (the pass after this Prepare starts it) and Prepare fails: a container
// given the pipe directory before its daemon answers could not use it. The
// kubelet asks again.
func (a *Agent) mpsUp(uid types.UID, dm mps.Daemon) error {
	why := ""
	if slices.Contains(a.mpsSet, dm) {
		var ok bool
		if ok, why = a.opts.MPS.Healthy(dm.Device); ok {
			// Still pending until the claim is in the ledger: a claim that
			// fails on another device keeps this one's daemon for its retry.
			return nil
		}
	}
	if p, ok := a.mpsPending[dm.Device]; !ok || p.daemon != dm || p.claim != uid {
		if a.mpsPending == nil {
			a.mpsPending = map[string]pendingMPS{}
		}
		a.mpsPending[dm.Device] = pendingMPS{daemon: dm, claim: uid, since: a.now()}
	}
	if why != "" {
		return fmt.Errorf("the MPS control daemon started for it does not answer yet (%s); the kubelet retries", why)
	}
	return errors.New("its MPS control daemon is being started for this claim; the kubelet retries")
}

// claimDaemons are the MPS daemons DRA claims ask for: those of prepared
// claims, and those started for claims whose Prepare waits on them.
func (a *Agent) claimDaemons() []mps.Daemon {
	var out []mps.Daemon
	claims := a.ledger.Claims()
	for _, uid := range slices.Sorted(maps.Keys(claims)) {
		for _, d := range claims[uid].Devices {
			if d.MPSDaemon != nil {
				out = append(out, *d.MPSDaemon)
			}
		}
	}
	now := a.now()
	for _, dev := range slices.Sorted(maps.Keys(a.mpsPending)) {
		p := a.mpsPending[dev]
		if now.Sub(p.since) > mpsPendingFor || a.ledger.HasClaim(p.claim) {
			delete(a.mpsPending, dev)
			continue
		}
		out = append(out, p.daemon)
	}
	return out
}

// withClaimDaemons adds the claims' daemons to the config's, on devices the
// config runs none for.
func withClaimDaemons(daemons, claims []mps.Daemon) []mps.Daemon {
	for _, c := range claims {
		if !slices.ContainsFunc(daemons, func(d mps.Daemon) bool { return d.Device == c.Device }) {
			daemons = append(daemons, c)
		}
	}
	return daemons
}
