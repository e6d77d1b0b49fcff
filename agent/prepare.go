package agent

import (
	"errors"
	"fmt"
	"maps"
	"os"
	"slices"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/mps"
)

// DRA Prepare and Unprepare: what a claim gets, decided against the ledger.

// prepareClaims records the claims it can prepare in the ledger. A claim
// prepared before gets the same answer (the kubelet asks again after its
// own restart). A device that is unknown, unhealthy, held through the
// device plugin or prepared for another claim fails the claim, naming the
// device; the kubelet retries it. The pool is planned again whenever a
// claim changed the node (a MIG device made), so a later claim of the same
// call is decided against what is there now.
func (a *Agent) prepareClaims(e ClaimsPrepare) (map[types.UID]dra.Prepared, []types.UID) {
	out := make(map[types.UID]dra.Prepared, len(e.Claims))
	var added []types.UID
	var pool *devicemodel.Pool
	var planned *gpu.Inventory
	for _, c := range e.Claims {
		if a.file == nil {
			// No config in force yet (it is awaited from a ConfigMap): the
			// GPUs were not read, so neither a new claim nor the answer
			// given before (a reboot may have taken its devices) is sure.
			out[c.UID] = dra.Prepared{Err: fmt.Errorf("claim %s: the agent has no config in force yet, so it prepares no claim", c)}
			continue
		}
		if pc, ok := a.ledger.Claim(c.UID); ok {
			gone := a.notOnNode(c.UID, pc)
			if gone == "" {
				out[c.UID] = pc.Prepared()
				continue
			}
			// The node rebooted, or its CDI specs were wiped: the answer
			// given before names what no longer exists. Prepare it afresh.
			a.log.Warn("DRA claim prepared before no longer matches the node; preparing it again", "claim", c.String(), "uid", c.UID, "reason", gone)
			a.release(c.UID, pc, true)
			added = append(added, c.UID) // the ledger changed either way
		}
		if pool == nil || planned != a.inv {
			snap := a.snapshot()
			// A claim given a partition of a GPU that has closed since (a
			// surplus spare, spareGPUs) is prepared where its placement is
			// free: the scheduler gave it out while it was published.
			snap.MIGOpen, snap.MIGOpening = nil, nil
			pool, planned = planDRA(snap), a.inv
			shareDevices(pool, a.cat, a.lastGood) // the config the catalog was planned with
			withdrawCordoned(nil, pool, snap.Cordon())
		}
		pc, err := a.prepareClaim(c, pool)
		if err != nil {
			a.log.Warn("DRA claim not prepared", "claim", c.String(), "uid", c.UID, "error", err)
			out[c.UID] = dra.Prepared{Err: err}
			continue
		}
		added = append(added, c.UID)
		out[c.UID] = pc.Prepared()
		a.log.Info("DRA claim prepared", "claim", c.String(), "uid", c.UID, "devices", pc.DeviceNames())
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
func (n *nodeState) failedHas(uuid string) bool {
	for _, f := range n.failed {
		if f.GPU.HasDevice(uuid) {
			return true
		}
	}
	return false
}

// prepareClaim works out and makes what claim c gets, device by device,
// then records it in the ledger, which refuses it if a device is taken
// meanwhile or twice within the claim. On any error what was made so far
// (MIG devices, the claim's CDI spec) is undone (release).
func (a *Agent) prepareClaim(c dra.Claim, pool *devicemodel.Pool) (pc PreparedClaim, err error) {
	if len(c.Devices) == 0 {
		return PreparedClaim{}, fmt.Errorf("claim %s: no device of driver %s on this node is allocated to it", c, devicemodel.DriverName)
	}
	pc = PreparedClaim{Namespace: c.Namespace, Name: c.Name, At: a.now()}
	defer func() {
		if err != nil {
			a.release(c.UID, pc, false)
			pc = PreparedClaim{}
		}
	}()
	sharings, err := claimSharings(c, pool)
	if err != nil {
		return pc, fmt.Errorf("claim %s: %w", c, err)
	}
	byDevice := map[string]int{}
	var claimDevs []cdi.ClaimDevice
	for ri, r := range c.Devices {
		key := fmt.Sprintf("%s/%s/%v", r.Device, r.ShareID, r.AdminAccess)
		if i, ok := byDevice[key]; ok {
			// Two requests served by one device: one entry, both requests.
			pc.Devices[i].Requests = append(pc.Devices[i].Requests, r.Request)
			continue
		}
		pd, cd, err := a.prepareDevice(c, r, sharings[ri], pool, pc, len(claimDevs))
		if err != nil {
			return pc, fmt.Errorf("claim %s: request %q: %w", c, r.Request, err)
		}
		if cd != nil {
			claimDevs = append(claimDevs, *cd)
		}
		pd.Requests = []string{r.Request}
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
			return pc, fmt.Errorf("claim %s: %w", c, err)
		}
	}
	if err := a.ledger.AddClaim(c.UID, pc); err != nil {
		return pc, fmt.Errorf("claim %s: %w", c, err)
	}
	return pc, nil
}

// prepareDevice is what request r of claim c gets from pool device r.Device
// (decideDevice), made and set on the node (makeDevice); for an MPS client
// also the CDI device of the claim's own spec, numbered after the n it has.
// Each device is decided against the node as the devices before it in the
// claim left it: a second MIG device made on the same GPU counts the first.
func (a *Agent) prepareDevice(c dra.Claim, r dra.Allocated, cs *claimSharing, pool *devicemodel.Pool, pc PreparedClaim, n int) (PreparedClaimDevice, *cdi.ClaimDevice, error) {
	p, err := a.decideDevice(c, r, cs, pool, pc, n)
	if err != nil {
		return PreparedClaimDevice{}, nil, err
	}
	pd, err := a.makeDevice(c, r, p)
	if err != nil {
		return PreparedClaimDevice{}, nil, err
	}
	return pd, p.CDI, nil
}

// devicePlan is what one request of a claim gets, decided before anything
// is made or set for it (decideDevice); makeDevice then does it, in the
// order of the fields.
type devicePlan struct {
	// Device is what the claim records in the ledger for the request. For
	// a MIG device made on demand it is the intent: its UUID and CDI name
	// are known once NVML lists it.
	Device PreparedClaimDevice
	// Partition, when set, is the MIG device to make on demand; nothing
	// else is done for it.
	Partition *partitionPlan
	// Interval is the time slice to set on the device before the claim is
	// answered ("": none); intervalField names the config asking, for
	// errors.
	Interval      devicemodel.Interval
	intervalField string
	// Daemon is the claim's own MPS control daemon, which must answer
	// before the claim is answered (nil: none).
	Daemon *mps.Daemon
	// CDI is the device of the claim's own CDI spec, with the MPS
	// environment and mounts its containers get (nil: none); the claim's
	// spec is written once every device is made, before the ledger records
	// the claim.
	CDI *cdi.ClaimDevice
}

// decideDevice works out what request r of claim c gets from pool device
// r.Device: the device as it is for admin access, a MIG device to make on
// demand, or a whole, MIG or shared device, with the time slice, MPS daemon
// and CDI device its sharing asks for. pc is what the claim got so far: one
// claim cannot hold a GPU and one of its MIG devices. cs is the sharing the
// claim's config asks of the device (nil: none). It reads the loop's state
// and the ledger, and changes neither: a refusal leaves nothing to undo.
func (a *Agent) decideDevice(c dra.Claim, r dra.Allocated, cs *claimSharing, pool *devicemodel.Pool, pc PreparedClaim, n int) (devicePlan, error) {
	d, ok := pool.Device(r.Device)
	if !ok {
		return devicePlan{}, fmt.Errorf("device %q is not offered on this node (any more)", r.Device)
	}
	if d.Unhealthy != "" && !r.ToleratesUnhealthy && !r.AdminAccess {
		return devicePlan{}, fmt.Errorf("device %s (%s) is unhealthy: %s", r.Device, d.UUID, d.Unhealthy)
	}
	if d.Cordoned != "" && !r.ToleratesCordon && !r.AdminAccess {
		// The scheduler honours the taint; this catches a claim allocated
		// before the cordon, or by one that ignores taints.
		name, idx, uuid := r.Device, d.Index, d.UUID
		if d.Type == devicemodel.TypeMIG {
			idx, uuid = d.ParentIndex, d.ParentUUID
			if d.UUID != "" { // "": a MIG device not made yet
				name += " (" + d.UUID + ")"
			}
		}
		return devicePlan{}, fmt.Errorf("device %s is on GPU %d (%s), cordoned by the Node's %s annotation: only a request that tolerates the %s taint gets it",
			name, idx, uuid, cordonAnnotation, devicemodel.TaintCordoned)
	}
	if r.AdminAccess {
		// Monitoring: the device as it is, shared with whoever holds it;
		// admin access neither holds nor creates anything.
		pd, err := a.adminDevice(d)
		if err != nil {
			return devicePlan{}, fmt.Errorf("(admin access): %w", err)
		}
		return devicePlan{Device: pd}, nil
	}
	for _, o := range pc.Devices {
		if !o.AdminAccess && (o.UUID == d.ParentUUID || (o.Parent != "" && o.Parent == d.UUID) || (o.UUID != d.UUID && a.ledger.Overlaps(o.UUID, d.UUID))) {
			return devicePlan{}, fmt.Errorf("device %s and device %s of the same claim are the same GPU", o.Device, r.Device)
		}
	}
	if err := a.checkSharing(d, cs, c.UID); err != nil {
		return devicePlan{}, fmt.Errorf("device %s: %w", r.Device, err)
	}
	if d.Partition {
		pp, err := a.planPartition(c, d)
		if err != nil {
			return devicePlan{}, fmt.Errorf("device %s: %w", r.Device, err)
		}
		return devicePlan{Device: pp.Intent, Partition: &pp}, nil
	}
	if by := a.whyTaken(d, c.UID, max(r.SharesTaken, 1)); by != "" {
		return devicePlan{}, fmt.Errorf("device %s (%s) is in use by %s", r.Device, d.UUID, by)
	}
	p := devicePlan{Device: PreparedClaimDevice{
		PreparedDevice: dra.PreparedDevice{Device: r.Device, CDIDevices: []string{d.CDIDevice()}, ShareID: r.ShareID},
		UUID:           d.UUID,
	}}
	if d.Shares > 1 {
		p.Device.Shares = max(r.SharesTaken, 1)
	}
	if !d.MPS && cs == nil {
		return p, nil
	}
	env, mounts, err := a.decideSharing(d, r, cs, &p)
	if err != nil {
		return devicePlan{}, fmt.Errorf("device %s (%s): %w", r.Device, d.UUID, err)
	}
	if env == nil {
		return p, nil
	}
	name := cdi.ClaimDeviceName(string(c.UID), n)
	p.Device.CDIDevices = append(p.Device.CDIDevices, cdi.QualifiedName(name))
	p.Device.MPSEnv = env
	p.CDI = &cdi.ClaimDevice{Name: name, Env: env, Mounts: mounts}
	return p, nil
}

// makeDevice does what p decided for request r of claim c: makes the MIG
// device, sets the time slice, or sees the claim's MPS daemon answer. It
// returns the device as the claim records it. What it made stays on a
// failure: the claim's release (prepareClaim's) undoes it.
func (a *Agent) makeDevice(c dra.Claim, r dra.Allocated, p devicePlan) (PreparedClaimDevice, error) {
	if p.Partition != nil {
		pd, err := a.createPartition(c, *p.Partition)
		if err != nil {
			return PreparedClaimDevice{}, fmt.Errorf("device %s: %w", r.Device, err)
		}
		return pd, nil
	}
	pd := p.Device
	if p.Interval != "" {
		if err := a.opts.TimeSlice.SetInterval(pd.UUID, p.Interval.Level()); err != nil {
			return PreparedClaimDevice{}, fmt.Errorf("device %s (%s): %s: setting time slice %s: %w", r.Device, pd.UUID, p.intervalField, p.Interval, err)
		}
	}
	if p.Daemon != nil {
		if err := a.mpsUp(c.UID, *p.Daemon); err != nil {
			return PreparedClaimDevice{}, fmt.Errorf("device %s (%s): %w", r.Device, pd.UUID, err)
		}
	}
	return pd, nil
}

// adminDevice is what a claim with admin access to d gets: d itself, or
// for an on-demand MIG device the instance a claim made at its placement
// (admin access makes none).
func (n *nodeState) adminDevice(d devicemodel.Device) (PreparedClaimDevice, error) {
	if !d.Partition {
		return PreparedClaimDevice{PreparedDevice: dra.PreparedDevice{Device: d.Name, CDIDevices: []string{d.CDIDevice()}}, UUID: d.UUID, AdminAccess: true}, nil
	}
	if g, ok := n.inv.GPUByUUID(d.ParentUUID); ok {
		if m, ok := instanceAt(g, d.Profile, d.Placement); ok {
			return PreparedClaimDevice{PreparedDevice: dra.PreparedDevice{Device: d.Name, CDIDevices: []string{devicemodel.CDIKind + "=" + m.UUID}}, UUID: m.UUID, AdminAccess: true}, nil
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
func (p *publishedState) mpsClient(d devicemodel.Device, r dra.Allocated) (map[string]string, []catalog.Mount, error) {
	var spec *catalog.AllocateSpec
	if p.cat != nil {
	find:
		for _, res := range p.cat.Resources {
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

// whyTaken says who other than claim uid holds pool device d ("" when
// nobody does): anyone at all for a device that is not shared; for a
// shared one (Shares above 1), a container of the device plugin, or other
// claims whose shares and the want this claim takes exceed its shares.
func (a *Agent) whyTaken(d devicemodel.Device, uid types.UID, want int64) string {
	if d.Shares <= 1 {
		return a.ledger.Holder(d.UUID, uid)
	}
	if by := a.ledger.PluginHolder(d.UUID); by != "" {
		return by
	}
	var sharing []string
	taken := int64(0)
	for other, pc := range a.ledger.Claims() {
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

// unprepareClaims drops the claims from the ledger and undoes what they
// made on the node (release). An unknown claim is already released, but
// its CDI spec may outlive a crash between writing it and checkpointing.
func (a *Agent) unprepareClaims(e ClaimsUnprepare) (map[types.UID]error, []PreparedClaim) {
	out := make(map[types.UID]error, len(e.Claims))
	var removed []PreparedClaim
	for _, c := range e.Claims {
		out[c.UID] = nil
		pc, ok := a.ledger.Claim(c.UID)
		if !ok {
			if a.opts.CDI != nil && !a.ledger.HasRelease(c.UID) {
				if err := a.opts.CDI.RemoveClaim(string(c.UID)); err != nil {
					a.log.Warn("DRA: CDI spec of an unknown claim not removed", "claim", c.String(), "error", err)
				}
			}
			continue
		}
		removed = append(removed, pc)
		a.release(c.UID, pc, true)
		a.log.Info("DRA claim unprepared", "claim", c.String(), "uid", c.UID, "devices", pc.DeviceNames())
	}
	return out, removed
}
