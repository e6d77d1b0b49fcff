package agent

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mig"
)

// DRAPublisher publishes the node's DRA pool (dra.Driver); it must not block.
type DRAPublisher interface {
	Publish(p *dra.Pool)
}

// ClaimsPrepare asks the loop to prepare claims (the DRA driver's
// NodePrepareResources); the answer goes to Reply once it is checkpointed.
type ClaimsPrepare struct {
	Claims []dra.Claim
	Reply  chan<- map[types.UID]dra.Prepared
	// GaveUp, when set, says whether the caller stopped waiting: a request
	// it gave up on is not acted upon (its claims could stay prepared with
	// nobody to release them).
	GaveUp func() bool
}

// ClaimsUnprepare asks the loop to release claims.
type ClaimsUnprepare struct {
	Claims []dra.ClaimRef
	Reply  chan<- map[types.UID]error
}

func (ClaimsPrepare) kind() string   { return "dra-prepare" }
func (ClaimsUnprepare) kind() string { return "dra-unprepare" }

// PreparedClaim is a claim prepared on this node: the allocation ledger's
// DRA side, checkpointed.
type PreparedClaim struct {
	Namespace string                `json:"namespace"`
	Name      string                `json:"name"`
	Devices   []PreparedClaimDevice `json:"devices"`
	At        time.Time             `json:"at"`
}

// PreparedClaimDevice is one device of a prepared claim.
type PreparedClaimDevice struct {
	dra.PreparedDevice
	UUID string `json:"uuid"`
	// Created: the MIG device was created for this claim (dynamic MIG) on
	// GPU Parent, profile Profile at Placement; Unprepare destroys it.
	Created      bool          `json:"created,omitempty"`
	Parent       string        `json:"parent,omitempty"`
	Profile      string        `json:"profile,omitempty"`
	ProfileIndex int           `json:"profileIndex,omitempty"`
	Placement    gpu.Placement `json:"placement,omitzero"`
	// MPSEnv is the MPS client environment the claim's spec gives its
	// containers (a shared device under MPS).
	MPSEnv map[string]string `json:"mpsEnv,omitempty"`
	// Shares is how many shares of a shared device the claim took.
	Shares int64 `json:"shares,omitempty"`
	// AdminAccess: given for administrative access; it holds nothing.
	AdminAccess bool `json:"adminAccess,omitempty"`
}

// samePlace reports whether d and o are the MIG device of one profile at
// one placement of one GPU (an intent and the device made for it).
func (d PreparedClaimDevice) samePlace(o PreparedClaimDevice) bool {
	return d.Parent == o.Parent && d.Placement == o.Placement && d.Profile == o.Profile
}

func (c PreparedClaim) String() string { return "ResourceClaim " + c.Namespace + "/" + c.Name }

func (c PreparedClaim) prepared() dra.Prepared {
	out := dra.Prepared{Devices: make([]dra.PreparedDevice, 0, len(c.Devices))}
	for _, d := range c.Devices {
		out.Devices = append(out.Devices, d.PreparedDevice)
	}
	return out
}

// PrepareClaims implements dra.Claims: it hands the claims to the loop and
// waits for its answer.
func (a *Agent) PrepareClaims(ctx context.Context, claims []dra.Claim) (map[types.UID]dra.Prepared, error) {
	reply := make(chan map[types.UID]dra.Prepared, 1)
	a.inbox.Post(ClaimsPrepare{Claims: claims, Reply: reply, GaveUp: func() bool { return ctx.Err() != nil }})
	select {
	case r := <-reply:
		return r, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("prepare: %w", context.Cause(ctx))
	}
}

// UnprepareClaims implements dra.Claims.
func (a *Agent) UnprepareClaims(ctx context.Context, claims []dra.ClaimRef) (map[types.UID]error, error) {
	reply := make(chan map[types.UID]error, 1)
	a.inbox.Post(ClaimsUnprepare{Claims: claims, Reply: reply})
	select {
	case r := <-reply:
		return r, nil
	case <-ctx.Done():
		return nil, fmt.Errorf("unprepare: %w", context.Cause(ctx))
	}
}

// prepareClaims records the claims it can prepare in the ledger. A claim
// prepared before gets the same answer (the kubelet asks again after its
// own restart). A device that is unknown, unhealthy, held through the
// device plugin or prepared for another claim fails the claim, naming the
// device; the kubelet retries it.
func (a *Agent) prepareClaims(e ClaimsPrepare, pool *dra.Pool) (map[types.UID]dra.Prepared, []types.UID) {
	out := make(map[types.UID]dra.Prepared, len(e.Claims))
	var added []types.UID
	for _, c := range e.Claims {
		if a.file == nil {
			// No config in force yet (it is awaited from a ConfigMap): the
			// GPUs were not read, so neither a new claim nor the answer
			// given before (a reboot may have taken its devices) is sure.
			out[c.UID] = dra.Prepared{Err: fmt.Errorf("claim %s: the agent has no config in force yet, so it prepares no claim", c)}
			continue
		}
		if pc, ok := a.claims[c.UID]; ok {
			gone := a.notOnNode(c.UID, pc)
			if gone == "" {
				out[c.UID] = pc.prepared()
				continue
			}
			// The node rebooted, or its CDI specs were wiped: the answer
			// given before names what no longer exists. Prepare it afresh.
			a.log.Warn("DRA claim prepared before no longer matches the node; preparing it again", "claim", c.String(), "uid", c.UID, "reason", gone)
			delete(a.claims, c.UID)
			a.release(c.UID, pc)
			added = append(added, c.UID) // the ledger changed either way
		}
		pc, err := a.prepareClaim(c, pool)
		if err != nil {
			a.log.Warn("DRA claim not prepared", "claim", c.String(), "uid", c.UID, "error", err)
			out[c.UID] = dra.Prepared{Err: err}
			continue
		}
		a.claims[c.UID] = pc
		added = append(added, c.UID)
		out[c.UID] = pc.prepared()
		a.log.Info("DRA claim prepared", "claim", c.String(), "uid", c.UID, "devices", deviceNames(pc))
	}
	return out, added
}

// notOnNode says what of prepared claim pc is no longer on the node: a
// device NVML no longer lists on a GPU it reads (MIG devices do not
// outlive a reboot), or the claim's CDI spec (kept on a tmpfs). "" when
// all is there, or when it cannot be told (its GPU cannot be read now).
func (a *Agent) notOnNode(uid types.UID, pc PreparedClaim) string {
	if a.inv == nil {
		return ""
	}
	for _, d := range pc.Devices {
		if !a.inv.HasDevice(d.UUID) && a.readNow != nil && !a.failedHas(d.UUID) && !a.isFailed(d.Parent) {
			return "device " + d.Device + " (" + d.UUID + ") is gone"
		}
	}
	if a.opts.CDI == nil {
		return ""
	}
	for _, d := range pc.Devices {
		if d.MPSEnv == nil {
			continue
		}
		path := a.opts.CDI.ClaimPath(string(uid))
		if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
			return "its CDI spec " + path + " is gone"
		}
	}
	return ""
}

// failedHas reports whether uuid is a GPU that cannot be read now, or one
// of the MIG devices it had.
func (a *Agent) failedHas(uuid string) bool {
	for _, f := range a.failed {
		if f.GPU.HasDevice(uuid) {
			return true
		}
	}
	return false
}

func (a *Agent) prepareClaim(c dra.Claim, pool *dra.Pool) (PreparedClaim, error) {
	if len(c.Devices) == 0 {
		return PreparedClaim{}, fmt.Errorf("claim %s: no device of driver %s on this node is allocated to it", c, dra.DriverName)
	}
	pc := PreparedClaim{Namespace: c.Namespace, Name: c.Name, At: a.now()}
	byDevice := map[string]int{}
	var claimDevs []cdi.ClaimDevice
	for _, r := range c.Devices {
		key := fmt.Sprintf("%s/%s/%v", r.Device, r.ShareID, r.AdminAccess)
		if i, ok := byDevice[key]; ok {
			// Two requests served by one device: one entry, both requests.
			pc.Devices[i].Requests = append(pc.Devices[i].Requests, r.Request)
			continue
		}
		d, ok := pool.Device(r.Device)
		if !ok {
			a.release(c.UID, pc)
			return PreparedClaim{}, fmt.Errorf("claim %s: request %q: device %q is not offered on this node (any more)", c, r.Request, r.Device)
		}
		if d.Unhealthy != "" && !r.ToleratesUnhealthy && !r.AdminAccess {
			a.release(c.UID, pc)
			return PreparedClaim{}, fmt.Errorf("claim %s: request %q: device %s (%s) is unhealthy: %s", c, r.Request, r.Device, d.UUID, d.Unhealthy)
		}
		if r.AdminAccess {
			// Monitoring: the device as it is, shared with whoever holds it;
			// admin access neither holds nor creates anything.
			pd, err := a.adminDevice(d)
			if err != nil {
				a.release(c.UID, pc)
				return PreparedClaim{}, fmt.Errorf("claim %s: request %q (admin access): %w", c, r.Request, err)
			}
			pd.Requests = []string{r.Request}
			byDevice[key] = len(pc.Devices)
			pc.Devices = append(pc.Devices, pd)
			continue
		}
		if d.Partition {
			pd, err := a.createPartition(c, d)
			if err != nil {
				a.release(c.UID, pc)
				return PreparedClaim{}, fmt.Errorf("claim %s: request %q: device %s: %w", c, r.Request, r.Device, err)
			}
			pd.Requests = []string{r.Request}
			byDevice[key] = len(pc.Devices)
			pc.Devices = append(pc.Devices, pd)
			continue
		}
		if by := a.usedElsewhere(d, c.UID, max(r.SharesTaken, 1)); by != "" {
			a.release(c.UID, pc)
			return PreparedClaim{}, fmt.Errorf("claim %s: request %q: device %s (%s) is in use by %s", c, r.Request, r.Device, d.UUID, by)
		}
		pd := PreparedClaimDevice{
			PreparedDevice: dra.PreparedDevice{Requests: []string{r.Request}, Device: r.Device, CDIDevices: []string{d.CDIDevice()}, ShareID: r.ShareID},
			UUID:           d.UUID,
		}
		if d.Shares > 1 {
			pd.Shares = max(r.SharesTaken, 1)
		}
		if d.MPS {
			env, mounts, err := a.mpsClient(d, r)
			if err != nil {
				a.release(c.UID, pc)
				return PreparedClaim{}, fmt.Errorf("claim %s: request %q: device %s (%s): %w", c, r.Request, r.Device, d.UUID, err)
			}
			name := cdi.ClaimDeviceName(string(c.UID), len(claimDevs))
			claimDevs = append(claimDevs, cdi.ClaimDevice{Name: name, Env: env, Mounts: mounts})
			pd.CDIDevices = append(pd.CDIDevices, cdi.QualifiedName(name))
			pd.MPSEnv = env
		}
		byDevice[key] = len(pc.Devices)
		pc.Devices = append(pc.Devices, pd)
	}
	if len(claimDevs) > 0 {
		// The claim's MPS environment and pipe directory reach its containers
		// through a CDI spec of its own: DRA has no other way to give a
		// container environment or mounts.
		err := errors.New("MPS sharing through DRA needs the agent's CDI specs (--cdi-spec-dir)")
		if a.opts.CDI != nil {
			err = a.opts.CDI.WriteClaim(string(c.UID), claimDevs)
		}
		if err != nil {
			a.release(c.UID, pc)
			return PreparedClaim{}, fmt.Errorf("claim %s: %w", c, err)
		}
	}
	return pc, nil
}

// adminDevice is what a claim with admin access to d gets: d itself, or
// for an on-demand MIG device the instance a claim made at its placement
// (admin access makes none).
func (a *Agent) adminDevice(d dra.Device) (PreparedClaimDevice, error) {
	if !d.Partition {
		return PreparedClaimDevice{PreparedDevice: dra.PreparedDevice{Device: d.Name, CDIDevices: []string{d.CDIDevice()}}, UUID: d.UUID, AdminAccess: true}, nil
	}
	if g, ok := a.inv.GPUByUUID(d.ParentUUID); ok {
		if m, ok := instanceAt(g, d.Profile, d.Placement); ok {
			return PreparedClaimDevice{PreparedDevice: dra.PreparedDevice{Device: d.Name, CDIDevices: []string{dra.CDIKind + "=" + m.UUID}}, UUID: m.UUID, AdminAccess: true}, nil
		}
	}
	return PreparedClaimDevice{}, fmt.Errorf("device %s: no %s exists at placement %d of GPU %s, and admin access creates none", d.Name, d.Profile, d.Placement.Start, d.ParentUUID)
}

// mpsClient is what a claim's container needs to be a client of the MPS
// daemon of shared device d: the daemon's pipe directory and shm, as the
// device plugin's MPS replicas get, with limits from the claim's share of
// the device's capacity: CUDA_MPS_ACTIVE_THREAD_PERCENTAGE is its shares'
// part of the threads, CUDA_MPS_PINNED_DEVICE_MEM_LIMIT the memory it
// consumes (by default an equal part).
func (a *Agent) mpsClient(d dra.Device, r dra.Allocated) (map[string]string, []catalog.Mount, error) {
	var spec *catalog.AllocateSpec
	if a.cat != nil {
	find:
		for _, res := range a.cat.Resources {
			for i := range res.Devices {
				dev := &res.Devices[i]
				if dev.Replica && dev.Spec.VisibleID == d.UUID && dev.Spec.Env[mpsPipeEnv] != "" {
					if !dev.Healthy && strings.HasPrefix(dev.Reason, "MPS daemon") {
						return nil, nil, fmt.Errorf("its %s", dev.Reason)
					}
					spec = &dev.Spec
					break find
				}
			}
		}
	}
	if spec == nil {
		return nil, nil, errors.New("no MPS daemon serves it")
	}
	shares := max(r.SharesTaken, 1)
	mem := r.MemoryBytes
	if mem == 0 {
		mem = d.MemoryBytes / uint64(d.Shares)
	}
	env := maps.Clone(spec.Env)
	env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = strconv.FormatInt(max(1, shares*100/int64(d.Shares)), 10)
	// The container sees only this device, so it is ordinal 0 there.
	env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = "0=" + strconv.FormatUint(mem>>20, 10) + "M"
	return env, slices.Clone(spec.Mounts), nil
}

// mpsPipeEnv marks an MPS client's spec (mps.ContainerSpec).
const mpsPipeEnv = "CUDA_MPS_PIPE_DIRECTORY"

// createPartition creates the MIG device d stands for (dynamic MIG): MIG
// mode on first if it is off (only on GPUs that need no reset for it, and
// only while no container holds the GPU), then the GPU instance at d's
// placement with one compute instance spanning it, journaled by the MIG
// applier like any layout change.
func (a *Agent) createPartition(c dra.Claim, d dra.Device) (PreparedClaimDevice, error) {
	if a.opts.MIG == nil {
		return PreparedClaimDevice{}, errors.New("this agent does not manage MIG")
	}
	g, ok := a.inv.GPUByUUID(d.ParentUUID)
	if !ok {
		return PreparedClaimDevice{}, fmt.Errorf("GPU %s is gone", d.ParentUUID)
	}
	if by := a.heldElsewhere(g.UUID, c.UID); by != "" {
		return PreparedClaimDevice{}, fmt.Errorf("GPU %d (%s) is in use by %s", g.Index, g.UUID, by)
	}
	for _, m := range g.Instances {
		if m.Placement.Start < d.Placement.Start+d.Placement.Size && d.Placement.Start < m.Placement.Start+m.Placement.Size {
			return PreparedClaimDevice{}, fmt.Errorf("GPU %d: MIG device %s (%s at %d) already occupies memory slices %d-%d",
				g.Index, m.UUID, m.Profile, m.Placement.Start, d.Placement.Start, d.Placement.Start+d.Placement.Size-1)
		}
	}
	counts := map[string]int{d.Profile: 1}
	for _, m := range g.Instances {
		counts[m.Profile]++
	}
	plan := mig.Plan{GPU: g.Index, UUID: g.UUID, Want: mig.Want{MIGEnabled: true, Counts: counts}}
	why := "DRA claim " + c.String()
	if !g.MIG.Current {
		plan.Steps = append(plan.Steps, mig.Step{Op: mig.OpSetMode, Enable: true, Reason: why + ": the first MIG device on an idle GPU"})
	}
	plan.Steps = append(plan.Steps, mig.Step{Op: mig.OpCreate, Profile: d.Profile, ProfileIndex: d.ProfileIndex, Placement: d.Placement, Reason: why})
	intent := PreparedClaimDevice{PreparedDevice: dra.PreparedDevice{Device: d.Name}, Created: true, Parent: g.UUID,
		Profile: d.Profile, ProfileIndex: d.ProfileIndex, Placement: d.Placement}
	wasDynamic := a.dynamicMIG[g.UUID]
	if !g.MIG.Current {
		// Turned on for claims: this GPU changes MIG mode without a reset,
		// so it goes back to MIG off when its last on-demand device goes.
		// Recorded with the intent, before the mode changes.
		a.dynamicMIG[g.UUID] = true
	}
	if err := a.intend(c, intent); err != nil {
		a.intendDone(c.UID, intent)
		if !g.MIG.Current && !wasDynamic {
			delete(a.dynamicMIG, g.UUID)
		}
		return PreparedClaimDevice{}, fmt.Errorf("GPU %d: %s at %d not created: it could not be checkpointed first, so a crash could orphan it: %w",
			g.Index, d.Profile, d.Placement.Start, err)
	}
	st, err := a.opts.MIG.Apply(a.ctx, plan)
	if err == nil && st.Phase != mig.PhaseApplied {
		err = fmt.Errorf("GPU %d: %s: %s", g.Index, st.Phase, st.Reason)
	}
	a.observe("dynamic MIG: " + why)
	if !a.read(g.UUID) {
		// What NVML made cannot be told now. The intent stays in the
		// ledger: the claim's release (the caller's) undoes it once the
		// GPU reads again.
		if err == nil {
			err = fmt.Errorf("GPU %d could not be read after %s at %d was created", g.Index, d.Profile, d.Placement.Start)
		}
		return PreparedClaimDevice{}, err
	}
	now, ok := a.inv.GPUByUUID(g.UUID)
	if ok && !now.MIG.Current {
		delete(a.dynamicMIG, g.UUID) // the mode did not change
	}
	if m, made := instanceAt(now, d.Profile, d.Placement); ok && made && err == nil {
		// The intent stays until the claim is checkpointed with the
		// device (claimsStep).
		a.log.Info("DRA: MIG device created", "claim", c.String(), "gpu", g.Index, "profile", d.Profile, "placement", d.Placement.Start, "uuid", m.UUID)
		dev := intent
		dev.UUID, dev.CDIDevices = m.UUID, []string{dra.CDIKind + "=" + m.UUID}
		return dev, nil
	}
	if err == nil {
		err = fmt.Errorf("GPU %d: %s at %d was created but NVML does not list it", plan.GPU, d.Profile, d.Placement.Start)
	}
	// Whatever the failed creation left (a device NVML lists late, MIG mode
	// turned on) is undone with the claim's release (the caller's), from
	// the intent, now or on a later resync.
	return PreparedClaimDevice{}, err
}

// release undoes what preparing claim uid left on the node: its CDI spec
// and the MIG devices created for it (pc's devices marked Created), for a
// claim the kubelet released or one that failed to prepare. What cannot be
// undone now stays in a.releasing, checkpointed, and is tried again on
// every resync (retryReleases): nothing a claim made is forgotten.
func (a *Agent) release(uid types.UID, pc PreparedClaim) {
	rest := pc
	rest.Devices = nil
	devs := pc.Devices
	if earlier, ok := a.releasing[uid]; ok {
		devs = append(slices.Clone(earlier.Devices), devs...)
	}
	var failed []string
	if a.opts.CDI != nil && !hasKey(a.claims, uid) { // a claim prepared again keeps its spec
		if err := a.opts.CDI.RemoveClaim(string(uid)); err != nil {
			failed = append(failed, "CDI spec: "+err.Error())
		}
	}
	seen := map[string]bool{}
	for _, d := range devs {
		if !d.Created {
			continue
		}
		key := fmt.Sprintf("%s/%s/%s@%d+%d", d.UUID, d.Parent, d.Profile, d.Placement.Start, d.Placement.Size)
		if seen[key] {
			continue
		}
		seen[key] = true
		if err := a.destroyPartition(pc, d); err != nil {
			rest.Devices = append(rest.Devices, d)
			failed = append(failed, err.Error())
		}
	}
	if len(failed) == 0 {
		delete(a.releasing, uid)
		return
	}
	if _, again := a.releasing[uid]; !again {
		a.log.Error("DRA: what a claim left on the node is not undone yet; trying again on every resync",
			"claim", pc.String(), "uid", uid, "left", strings.Join(failed, "; "))
	}
	a.releasing[uid] = rest
}

// retryReleases tries again to undo what released claims left.
func (a *Agent) retryReleases() {
	for _, uid := range slices.Sorted(maps.Keys(a.releasing)) {
		pc := a.releasing[uid]
		a.release(uid, pc)
		if _, left := a.releasing[uid]; !left {
			a.log.Info("DRA: what a released claim left on the node is undone", "claim", pc.String(), "uid", uid)
		}
	}
}

// intend records, checkpointed, that a MIG device is about to be created
// for claim c; done drops the record once the device is in the claim (or
// known not to exist). A record found after a crash is undone like a
// released claim's device: the kubelet never heard of it and asks again.
func (a *Agent) intend(c dra.Claim, d PreparedClaimDevice) error {
	pc := a.releasing[c.UID]
	pc.Namespace, pc.Name, pc.At = c.Namespace, c.Name, a.now()
	pc.Devices = append(pc.Devices, d)
	a.releasing[c.UID] = pc
	return a.checkpoint()
}

// dropIntents forgets the intents of claim uid once the claim, with the
// devices they stand for, is checkpointed.
func (a *Agent) dropIntents(uid types.UID) {
	pc, ok := a.releasing[uid]
	if !ok {
		return
	}
	claim := a.claims[uid]
	pc.Devices = slices.DeleteFunc(pc.Devices, func(x PreparedClaimDevice) bool {
		return x.UUID == "" && slices.ContainsFunc(claim.Devices, func(d PreparedClaimDevice) bool {
			return d.Created && d.samePlace(x)
		})
	})
	if len(pc.Devices) == 0 {
		delete(a.releasing, uid)
		return
	}
	a.releasing[uid] = pc
}

func (a *Agent) intendDone(uid types.UID, d PreparedClaimDevice) {
	pc, ok := a.releasing[uid]
	if !ok {
		return
	}
	// Only the intent just appended: an identical earlier one (a failed
	// attempt whose device may exist) still stands.
	if i := len(pc.Devices) - 1; i >= 0 {
		if x := pc.Devices[i]; x.UUID == "" && x.samePlace(d) {
			pc.Devices = pc.Devices[:i]
		}
	}
	if len(pc.Devices) == 0 {
		delete(a.releasing, uid)
		return
	}
	a.releasing[uid] = pc
}

// destroyPartition destroys a MIG device created for a claim once the claim
// no longer holds it, unless a container got it through the device plugin
// meanwhile; a GPU left without MIG devices goes back to MIG off where a
// claim turned it on, so it is offered whole again. A device recorded only
// as an intent (no UUID yet) is the one at its placement that no claim
// holds. The error says why it is still there.
func (a *Agent) destroyPartition(pc PreparedClaim, d PreparedClaimDevice) error {
	if a.opts.MIG == nil || a.inv == nil {
		return fmt.Errorf("%s at %d on GPU %s: this agent cannot change MIG devices now", d.Profile, d.Placement.Start, d.Parent)
	}
	g, ok := a.inv.GPUByUUID(d.Parent)
	switch {
	case a.readNow == nil || ok && !a.read(d.Parent) || a.isFailed(d.Parent):
		// What the loop believes of the GPU is older than the last read
		// (or the checkpoint's): it cannot tell the device is gone.
		return fmt.Errorf("%s at %d on GPU %s: the GPU was not read just now; trying again", d.Profile, d.Placement.Start, d.Parent)
	case !ok:
		return nil // the GPU is gone, and its MIG devices with it
	}
	claimed := claimedUUIDs(a.claims)
	var m gpu.MIGInstance
	found := false
	if d.UUID != "" {
		i := slices.IndexFunc(g.Instances, func(in gpu.MIGInstance) bool { return in.UUID == d.UUID })
		if found = i >= 0; found {
			m = g.Instances[i]
		}
	} else if in, ok := instanceAt(g, d.Profile, d.Placement); ok && !hasKey(claimed, in.UUID) {
		m, found = in, true
	}
	// A destroy or create cut short leaves the GPU instance without its
	// compute instance: no MIG device, but its slices are still taken.
	bare := slices.IndexFunc(g.GIsWithoutCI, func(b gpu.GPUInstance) bool { return b.Placement == d.Placement && b.Profile == d.Profile })
	switch {
	case found:
		if by, ok := claimed[m.UUID]; ok {
			// Made again, with the same UUID, for another claim: ours is gone.
			a.log.Warn("DRA: MIG device of a released claim is prepared for another claim; left as it is", "claim", pc.String(), "uuid", m.UUID, "holder", by)
			return nil
		}
		if by := a.pluginHolder(m.UUID); by != "" {
			return fmt.Errorf("MIG device %s is held by %s; destroyed once released", m.UUID, by)
		}
	case bare >= 0:
		b := g.GIsWithoutCI[bare]
		m = gpu.MIGInstance{GI: b.GI, Profile: b.Profile, GIProfileID: b.GIProfileID, Placement: b.Placement}
	default:
		return a.migBackOff(g, pc.String()+" released") // the device is gone
	}
	var uuids []string
	if m.UUID != "" {
		uuids = []string{m.UUID}
	}
	counts := map[string]int{}
	for _, o := range g.Instances {
		if o.UUID != m.UUID {
			counts[o.Profile]++
		}
	}
	bares := len(g.GIsWithoutCI)
	if !found {
		bares-- // the one destroyed
	}
	// MIG goes back off only where a claim turned it on (and so it switched
	// without a reset): one an admin turned on stays on.
	last := len(counts) == 0 && bares == 0
	plan := mig.Plan{GPU: g.Index, UUID: g.UUID, Want: mig.Want{MIGEnabled: !(last && a.dynamicMIG[g.UUID]), Counts: counts}}
	why := pc.String() + " released"
	plan.Steps = append(plan.Steps, mig.Step{Op: mig.OpDestroy, Profile: m.Profile, ProfileIndex: m.GIProfileID, Placement: m.Placement,
		GI: m.GI, UUIDs: uuids, Reason: why})
	if !plan.Want.MIGEnabled {
		plan.Steps = append(plan.Steps, mig.Step{Op: mig.OpSetMode, Enable: false, Reason: why + ": no MIG device left, the GPU is offered whole again"})
	}
	st, err := a.opts.MIG.Apply(a.ctx, plan)
	if err == nil && st.Phase == mig.PhaseApplied && !plan.Want.MIGEnabled {
		delete(a.dynamicMIG, g.UUID)
	}
	if err == nil && st.Phase != mig.PhaseApplied {
		err = fmt.Errorf("%s: %s", st.Phase, st.Reason)
	}
	a.observe("dynamic MIG: " + why)
	if err != nil {
		return fmt.Errorf("GPU %d: MIG device %s (%s at %d) not destroyed: %w", g.Index, d.UUID, m.Profile, m.Placement.Start, err)
	}
	a.log.Info("DRA: MIG device destroyed", "claim", pc.String(), "gpu", g.Index, "uuid", d.UUID, "gi", m.GI, "mig-off", !plan.Want.MIGEnabled)
	return nil
}

// instanceAt is g's MIG device of profile at placement pl, if any (a
// placement holds one GPU instance; ours have one compute instance).
func instanceAt(g gpu.GPU, profile string, pl gpu.Placement) (gpu.MIGInstance, bool) {
	i := slices.IndexFunc(g.Instances, func(m gpu.MIGInstance) bool { return m.Placement == pl && m.Profile == profile })
	if i < 0 {
		return gpu.MIGInstance{}, false
	}
	return g.Instances[i], true
}

// migBackOff turns MIG off on a GPU a claim turned it on for that has no
// MIG device left (a creation that failed after the mode changed leaves
// it so), so the GPU is offered whole again.
func (a *Agent) migBackOff(g gpu.GPU, why string) error {
	if !g.MIG.Current && a.read(g.UUID) {
		delete(a.dynamicMIG, g.UUID) // off already (it never went on)
	}
	if !a.dynamicMIG[g.UUID] || !g.MIG.Current || len(g.Instances) > 0 || len(g.GIsWithoutCI) > 0 {
		return nil
	}
	plan := mig.Plan{GPU: g.Index, UUID: g.UUID, Want: mig.Want{MIGEnabled: false},
		Steps: []mig.Step{{Op: mig.OpSetMode, Enable: false, Reason: why + ": no MIG device left, the GPU is offered whole again"}}}
	st, err := a.opts.MIG.Apply(a.ctx, plan)
	if err == nil && st.Phase != mig.PhaseApplied {
		err = fmt.Errorf("%s: %s", st.Phase, st.Reason)
	}
	a.observe("dynamic MIG: " + why)
	if err != nil {
		return fmt.Errorf("GPU %d: MIG mode not turned back off: %w", g.Index, err)
	}
	delete(a.dynamicMIG, g.UUID)
	return nil
}

// usedElsewhere is heldElsewhere for a device of the pool: a shared device
// (Shares above 1) may be held by other claims as long as the shares they
// took and the want this claim takes fit; containers of the device plugin
// still exclude it.
func (a *Agent) usedElsewhere(d dra.Device, uid types.UID, want int64) string {
	if d.Shares <= 1 {
		return a.heldElsewhere(d.UUID, uid)
	}
	if by := a.pluginHolder(d.UUID); by != "" {
		return by
	}
	var sharing []string
	taken := int64(0)
	for other, pc := range a.claims {
		if other == uid {
			continue
		}
		for _, x := range pc.Devices {
			if x.UUID == d.UUID && !x.AdminAccess {
				sharing = append(sharing, pc.String())
				taken += max(x.Shares, 1)
			}
		}
	}
	if taken+want > int64(d.Shares) {
		slices.Sort(sharing)
		return fmt.Sprintf("%d claims holding %d of its %d shares, %d wanted (%s)", len(sharing), taken, d.Shares, want, strings.Join(sharing, ", "))
	}
	return ""
}

// pluginHolder names the container that holds the device through the
// device plugin: the kubelet's answer, or an allocation it has not listed
// yet; "" if none.
func (a *Agent) pluginHolder(uuid string) string {
	if hs := a.att.Holders(uuid); len(hs) > 0 {
		return hs[0].String() + " (device plugin)"
	}
	if at, ok := a.ledger[uuid]; ok {
		return "a container the device plugin gave it at " + at.UTC().Format(time.TimeOnly) + " UTC"
	}
	return ""
}

// heldElsewhere names who, other than claim uid, holds the device: a
// container through the device plugin (the kubelet's answer or an
// allocation it has not listed yet), or another claim.
func (a *Agent) heldElsewhere(uuid string, uid types.UID) string {
	if by := a.pluginHolder(uuid); by != "" {
		return by
	}
	for other, pc := range a.claims {
		if other == uid {
			continue
		}
		for _, d := range pc.Devices {
			if d.UUID == uuid && !d.AdminAccess {
				return pc.String()
			}
		}
	}
	return ""
}

// unprepareClaims drops the claims from the ledger and undoes what they
// made on the node (release). An unknown claim is already released, but
// its CDI spec may outlive a crash between writing it and checkpointing.
func (a *Agent) unprepareClaims(e ClaimsUnprepare) (map[types.UID]error, []PreparedClaim) {
	out := make(map[types.UID]error, len(e.Claims))
	var removed []PreparedClaim
	for _, c := range e.Claims {
		out[c.UID] = nil
		pc, ok := a.claims[c.UID]
		if !ok {
			if a.opts.CDI != nil && !hasKey(a.releasing, c.UID) {
				if err := a.opts.CDI.RemoveClaim(string(c.UID)); err != nil {
					a.log.Warn("DRA: CDI spec of an unknown claim not removed", "claim", c.String(), "error", err)
				}
			}
			continue
		}
		delete(a.claims, c.UID)
		removed = append(removed, pc)
		a.release(c.UID, pc)
		a.log.Info("DRA claim unprepared", "claim", c.String(), "uid", c.UID, "devices", deviceNames(pc))
	}
	return out, removed
}

func deviceNames(pc PreparedClaim) []string {
	out := make([]string, 0, len(pc.Devices))
	for _, d := range pc.Devices {
		out = append(out, d.Device)
	}
	return out
}

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
// claim (for an intent, the instance no claim holds at its placement), and
// its GPU, to the claim: neither is offered meanwhile.
func releasingUUIDs(releasing map[types.UID]PreparedClaim, inv *gpu.Inventory, claimed map[string]string) map[string]string {
	out := map[string]string{}
	for _, uid := range slices.Sorted(maps.Keys(releasing)) {
		pc := releasing[uid]
		for _, d := range pc.Devices {
			for _, id := range []string{d.UUID, d.Parent} {
				if id != "" {
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
	return out
}

// planDRA is the pool the node offers through DRA: every device the
// inventory has, less those the device plugin's containers hold (a device
// goes one way at a time); devices prepared for claims stay in (the
// scheduler already counts them as allocated). MIG-capable GPUs that no
// config layout governs get their MIG devices on demand: every profile at
// every free placement, drawing on the GPU's counters (dynamicGPUs).
func planDRA(s Snapshot) *dra.Pool {
	if !s.DRA {
		return nil
	}
	unhealthy := s.Health.UnhealthyDevices()
	dynamic := dynamicGPUs(s)
	held := func(uuid string) bool {
		return len(s.Holdings.Attribution.Holders(uuid)) > 0 || hasKey(s.Holdings.Allocated, uuid)
	}
	p := &dra.Pool{}
	for _, d := range dra.Devices(s.Inventory, unhealthy) {
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
	for _, idx := range slices.Sorted(maps.Keys(dynamic)) {
		dyn := dynamic[idx]
		g := dyn.GPU
		if _, claimed := s.Holdings.Claimed[g.UUID]; !claimed && held(g.UUID) {
			continue // a container holds the whole GPU
		}
		base := dra.Device{
			ProductName: g.Name, Architecture: g.ComputeCapability.Family(), CC: g.ComputeCapability,
			DriverVersion: s.Inventory.DriverVersion, PCIBusID: g.PCIBusID, Minor: g.Minor, Unhealthy: unhealthy[g.UUID],
		}
		devs, set := dra.Partitions(dyn, base)
		p.Devices = append(p.Devices, devs...)
		p.CounterSets = append(p.CounterSets, set)
	}
	slices.SortFunc(p.Devices, func(a, b dra.Device) int { return strings.Compare(a.Name, b.Name) })
	return p
}

// dynamicKeepsStatic reports whether d, a device of a dynamic GPU, stays in
// the pool as it is: a MIG device no claim created, which blocks its
// placement.
func dynamicKeepsStatic(dyn dra.Dynamic, d dra.Device) bool {
	return d.Type == dra.TypeMIG && slices.Contains(dyn.Blocked, d.Placement)
}

// dynamicGPUs are the GPUs whose MIG devices are created on demand, by
// index: MIG-capable, read completely, not changing MIG mode, with known
// profiles, and governed by no MIG layout of the config. A GPU with MIG off
// qualifies only where turning it on needs no reset (Hopper and newer; an
// A100 needs one, so it stays a whole GPU). Placements taken by MIG devices
// that no claim created are blocked.
func dynamicGPUs(s Snapshot) map[int]dra.Dynamic {
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
	created := map[string]bool{} // parent UUID + placement of claim-created devices
	for _, pc := range s.Holdings.Claims {
		for _, d := range pc.Devices {
			if d.Created {
				created[fmt.Sprintf("%s/%d+%d", d.Parent, d.Placement.Start, d.Placement.Size)] = true
			}
		}
	}
	out := map[int]dra.Dynamic{}
	for _, g := range s.Inventory.GPUs {
		profiles, ok := s.Profiles[g.Name]
		if laid[g.Index] || !g.MIGCapable || g.MIGUnknown() || g.MIG.Current != g.MIG.Pending || !ok || len(profiles) == 0 {
			continue
		}
		if !g.MIG.Current && !migModeWithoutReset(g) {
			continue
		}
		// Not whole while a release or intent on it waits: MIG may be on,
		// with a device left, whatever the last read said.
		dyn := dra.Dynamic{GPU: g, Profiles: profiles, Whole: !g.MIG.Current && !hasKey(s.Holdings.Releasing, g.UUID)}
		for _, m := range g.Instances {
			if !created[fmt.Sprintf("%s/%d+%d", g.UUID, m.Placement.Start, m.Placement.Size)] {
				dyn.Blocked = append(dyn.Blocked, m.Placement)
			}
		}
		for _, gi := range g.GIsWithoutCI {
			dyn.Blocked = append(dyn.Blocked, gi.Placement)
		}
		out[g.Index] = dyn
	}
	return out
}

// migModeWithoutReset: from Hopper on, an idle GPU changes MIG mode at once;
// Ampere needs a GPU reset, which the agent never does.
func migModeWithoutReset(g gpu.GPU) bool { return g.ComputeCapability.AtLeast(9, 0) }

// shareDevices marks the pool's devices that the config shares, by
// time-slicing or MPS: each may be shared by as many claims as the catalog
// has replicas of it.
func shareDevices(p *dra.Pool, cat *catalog.Catalog, sel config.Selected) {
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
func evictOnUnhealthy(p *dra.Pool, sel config.Selected) {
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

// withholdClaimed marks every catalog device that stands for a device a
// claim holds (the device itself, its replicas, or the whole GPU one of its
// MIG devices is on) unavailable to the kubelet's
// device manager: a device goes one way at a time.
func withholdClaimed(cat *catalog.Catalog, claimed map[string]string, inv *gpu.Inventory, why func(by string) string) {
	if cat == nil || len(claimed) == 0 {
		return
	}
	// A GPU offered whole while one of its MIG devices is claimed (MIG
	// strategy none) is not free either.
	if inv != nil {
		parents := map[string]string{}
		for _, g := range inv.GPUs {
			for _, m := range g.Instances {
				if by, ok := claimed[m.UUID]; ok {
					parents[g.UUID] = by
				}
			}
		}
		if len(parents) > 0 {
			claimed = maps.Clone(claimed)
			for uuid, by := range parents {
				if _, ok := claimed[uuid]; !ok {
					claimed[uuid] = by
				}
			}
		}
	}
	for _, r := range cat.Resources {
		for i := range r.Devices {
			d := &r.Devices[i]
			by, ok := claimed[d.Spec.VisibleID]
			if !ok {
				continue
			}
			d.Healthy = false
			d.Reason = why(by)
		}
	}
}

// claimReplies are the answers of one Step, sent once the ledger they
// describe is checkpointed.
type claimReplies struct {
	changed bool
	send    []func()
}

func (r claimReplies) sendAll() {
	for _, f := range r.send {
		f() // buffered channels: the caller may have given up
	}
}

// claimsStep prepares and releases the claims of one batch, in the order
// the kubelet asked (a Prepare it gave up on, then its Unprepare, leaves
// nothing prepared), and checkpoints the ledger before any answer leaves:
// a claim the kubelet was told is prepared is never forgotten by a
// restart, and one that could not be written is refused (the kubelet asks
// again).
func (a *Agent) claimsStep(events []Event) claimReplies {
	var r claimReplies
	if len(events) == 0 {
		return r
	}
	invBefore, relBefore := a.inv, releasingUUIDs(a.releasing, a.inv, claimedUUIDs(a.claims))
	var removed []PreparedClaim
	var added []types.UID
	var prepared []map[types.UID]dra.Prepared
	for _, ev := range events {
		switch e := ev.(type) {
		case ClaimsUnprepare:
			out, rm := a.unprepareClaims(e)
			removed = append(removed, rm...)
			r.send = append(r.send, func() { e.Reply <- out })
		case ClaimsPrepare:
			var out map[types.UID]dra.Prepared
			if e.GaveUp != nil && e.GaveUp() {
				out = map[types.UID]dra.Prepared{}
				for _, c := range e.Claims {
					out[c.UID] = dra.Prepared{Err: fmt.Errorf("claim %s: the kubelet stopped waiting before the agent got to it", c)}
				}
			} else {
				pool := planDRA(a.snapshot())
				shareDevices(pool, a.cat, a.lastGood) // the config the catalog was planned with
				var add []types.UID
				out, add = a.prepareClaims(e, pool)
				added = append(added, add...)
			}
			prepared = append(prepared, out)
			r.send = append(r.send, func() { e.Reply <- out })
		}
	}
	if len(added)+len(removed) == 0 {
		// A claim that failed may still have changed the node (MIG mode,
		// a device left to destroy): plan for what is there now.
		r.changed = a.inv != invBefore || !maps.Equal(relBefore, releasingUUIDs(a.releasing, a.inv, claimedUUIDs(a.claims)))
		return r
	}
	r.changed = true
	if err := a.checkpoint(); err == nil {
		for _, uid := range added {
			if hasKey(a.claims, uid) {
				a.dropIntents(uid)
			}
		}
	} else {
		for _, uid := range added {
			pc, ok := a.claims[uid]
			if !ok {
				continue
			}
			delete(a.claims, uid)
			a.release(uid, pc)
			for _, out := range prepared {
				if _, ok := out[uid]; ok {
					out[uid] = dra.Prepared{Err: fmt.Errorf("%w: %w", errCheckpoint, err)}
				}
			}
		}
		// Released claims stay released: their containers are gone, and
		// the next checkpoint that succeeds forgets them.
	}
	return r
}

// errCheckpoint is why a prepared claim was rolled back.
var errCheckpoint = errors.New("the claim could not be checkpointed, so a restart would forget it")

func (a *Agent) draStatus() *DRAStatus {
	st := &DRAStatus{Devices: []string{}}
	if a.draPool != nil {
		for _, d := range a.draPool.Devices {
			st.Devices = append(st.Devices, d.Name)
			if d.Unhealthy != "" {
				st.Unhealthy = append(st.Unhealthy, d.Name)
			}
		}
	}
	for _, uid := range slices.Sorted(maps.Keys(a.claims)) {
		pc := a.claims[uid]
		st.Claims = append(st.Claims, pc.Namespace+"/"+pc.Name+": "+strings.Join(deviceNames(pc), ", "))
	}
	for _, uid := range slices.Sorted(maps.Keys(a.releasing)) {
		pc := a.releasing[uid]
		left := []string{}
		for _, d := range pc.Devices {
			switch {
			case d.UUID != "":
				left = append(left, d.UUID)
			default:
				left = append(left, fmt.Sprintf("%s at %d on %s (to be made)", d.Profile, d.Placement.Start, d.Parent))
			}
		}
		if len(left) == 0 {
			left = append(left, "CDI spec")
		}
		st.Releasing = append(st.Releasing, pc.Namespace+"/"+pc.Name+": "+strings.Join(left, ", "))
	}
	return st
}
