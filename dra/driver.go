package dra

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/go-logr/logr"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"google.golang.org/grpc"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceclaim"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"
)

// Claim is one ResourceClaim's allocation on this node, as Prepare sees it.
type Claim struct {
	UID       types.UID
	Namespace string
	Name      string
	// Devices are the claim's allocation results for this driver and this
	// node's pool, in the claim's order.
	Devices []Allocated
	// Configs are the driver's opaque configs of the allocation, in
	// precedence order (ConfigsOf); ConfigFor picks a result's.
	Configs []devicemodel.DeviceConfig
}

// Allocated is one allocation result: which device serves which request.
type Allocated struct {
	// Request is the request's name, "<request>/<subrequest>" for a
	// subrequest.
	Request string `json:"request"`
	Device  string `json:"device"`
	// ShareID identifies this claim's share of a shared device ("" for
	// exclusive devices).
	ShareID types.UID `json:"shareID,omitempty"`
	// SharesTaken and MemoryBytes are what the claim consumes of a shared
	// device's "shares" and "memory" capacities (0: not given).
	SharesTaken int64  `json:"sharesTaken,omitempty"`
	MemoryBytes uint64 `json:"memoryBytes,omitempty"`
	// AdminAccess: allocated for administrative access (monitoring), which
	// the scheduler grants to devices in use too; it holds nothing.
	AdminAccess bool `json:"adminAccess,omitempty"`
	// ToleratesUnhealthy: the request tolerates the unhealthy taint, so
	// the scheduler may have given it an unhealthy device on purpose.
	ToleratesUnhealthy bool `json:"toleratesUnhealthy,omitempty"`
	// ToleratesCordon: the request tolerates the cordon's taint
	// (TaintCordoned, NoSchedule), so it may be given a device on a
	// cordoned GPU on purpose.
	ToleratesCordon bool `json:"toleratesCordon,omitempty"`
}

// ClaimRef names a claim to unprepare; the claim object may be gone.
type ClaimRef struct {
	UID       types.UID
	Namespace string
	Name      string
}

func (c ClaimRef) String() string { return c.Namespace + "/" + c.Name }

func (c Claim) String() string { return c.Namespace + "/" + c.Name }

// Prepared is what one claim's containers get, or why they get nothing yet.
type Prepared struct {
	Devices []PreparedDevice
	Err     error
}

// PreparedDevice is one device of a prepared claim.
type PreparedDevice struct {
	Requests   []string  `json:"requests"`
	Device     string    `json:"device"`
	CDIDevices []string  `json:"cdiDevices"`
	ShareID    types.UID `json:"shareID,omitempty"`
}

// Claims prepares and unprepares claims: the agent's loop, which owns the
// allocation ledger both the device plugin and DRA draw on. Both calls are
// idempotent, and return only once the outcome is checkpointed.
type Claims interface {
	PrepareClaims(ctx context.Context, claims []Claim) (map[types.UID]Prepared, error)
	UnprepareClaims(ctx context.Context, claims []ClaimRef) (map[types.UID]error, error)
}

// Options configure a Driver.
type Options struct {
	NodeName string
	// Client writes this node's ResourceSlices and reads its Node (the
	// slices' owner).
	Client kubernetes.Interface
	// ClaimReader reads the ResourceClaims the kubelet asks to prepare (nil:
	// Client). Prepare reads each claim, one GET apiece, while the kubelet
	// waits: on a client of its own, with its own rate limit, those reads
	// do not queue behind publishing.
	ClaimReader kubernetes.Interface
	Claims      Claims
	// SliceCheck is how often the API server's ResourceSlices of this node
	// are compared with what was published (CheckSlices; 0: 30s, negative:
	// only when called).
	SliceCheck time.Duration
	// SliceCheckGap is the least time between two checks (0: 5s), so that
	// a controller failing fast (and asking for a check each time) does
	// not make them spin; a finding is confirmed this long after it.
	SliceCheckGap time.Duration
	// HealthResend is how often the health stream repeats the devices'
	// health unchanged (0: 10s), so the kubelet never times them out.
	HealthResend time.Duration
	// Now is the clock (nil: time.Now).
	Now func() time.Time
	// PluginDir is where the DRA socket goes ("": the kubelet's default,
	// /var/lib/kubelet/plugins/gpu.nvidia.com); RegistryDir the kubelet's
	// plugin registration directory ("": /var/lib/kubelet/plugins_registry).
	PluginDir, RegistryDir string
	Logger                 *slog.Logger
}

// Driver is the kubelet plugin: registration, the DRA gRPC service, the
// device health stream, and ResourceSlice publishing.
type Driver struct {
	drahealth.UnimplementedDRAResourceHealthServer

	opts   Options
	log    *slog.Logger
	helper *kubeletplugin.Helper
	// startController starts a ResourceSlice controller (startSlices; tests
	// fake it). controller is the one running, nil until its informer has
	// synced and while publishing starts over.
	startController func(context.Context, resourceslice.DriverResources) (sliceController, error)
	controller      sliceController
	// watchers are the kubelet's health streams, signalled on each Publish.
	watchers map[chan struct{}]struct{}

	mu sync.Mutex
	// pool is the last one published, gen its generation; dropped is what
	// the API server has dropped from a slice so far (one-way: a feature
	// gate the API server starts with does not change under it).
	pool    *devicemodel.Pool
	gen     int64
	dropped devicemodel.Dropped
	// slices is where publishing stands, for /status.
	slices Slices
	// handed is the pool as last handed to the controller, what CheckSlices
	// compares the API server's copy with.
	handed resourceslice.Pool
	// stale: the controller does not have pool and dropped as they are now
	// (unchanged pools are not handed to it again).
	stale bool
	// poolSet wakes the first publish (runPublishing) once there is a pool.
	poolSet chan struct{}
	// notOurs counts the checks in a row that found the API server's copy
	// not ours; restart asks runPublishing to start over, deleting the
	// slices named (owned by a Node of the same name that is gone).
	notOurs int
	restart chan []resourceapi.ResourceSlice
	// checkNow asks the check loop for a check before its next tick.
	checkNow chan struct{}
	// running is publishing and the check loop, in the background until
	// stopPublishing ends them.
	running        sync.WaitGroup
	stopPublishing context.CancelFunc
}

// Slices says where ResourceSlice publishing stands.
type Slices struct {
	// Generation is the pool's generation last handed to the helper (0:
	// none yet), At when; the helper writes it to the API server in the
	// background.
	Generation int64     `json:"generation"`
	At         time.Time `json:"at,omitzero"`
	// WaitingForAPI: publishing has waited since then for its controller
	// to sync with the API server (at the start, and after a restart).
	WaitingForAPI time.Time `json:"waitingForAPISince,omitzero"`
	// Checked is when the API server's ResourceSlices of this node were
	// last compared with what was published (CheckSlices); CheckError why
	// the last comparison could not be made.
	Checked    time.Time `json:"checkedAt,omitzero"`
	CheckError string    `json:"checkError,omitempty"`
	// NotOurs says how the API server's copy differed from what was
	// published at the last check ("": it matched), since NotOursSince.
	NotOurs      string    `json:"notOurs,omitempty"`
	NotOursSince time.Time `json:"notOursSince,omitzero"`
	// Restarts counts the times publishing started over, with a controller
	// that reads the API server afresh, because its copy stayed not ours.
	Restarts int `json:"restarts,omitempty"`
	// LeftOut: each feature the API server drops the fields of (off
	// there, as on Kubernetes 1.34 and 1.35 by default), with the devices
	// left out of the slices for it; the warning logged once, kept here
	// so that one look at /status explains a device missing from them.
	LeftOut []devicemodel.LeftOut `json:"leftOut,omitempty"`
}

// Slices returns where ResourceSlice publishing stands.
func (d *Driver) Slices() Slices {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := d.slices
	s.LeftOut = d.dropped.LeftOut()
	return s
}

// New returns a driver that keeps what Publish gives it until Start.
func New(opts Options) *Driver {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.HealthResend <= 0 {
		opts.HealthResend = 10 * time.Second
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.ClaimReader == nil {
		opts.ClaimReader = opts.Client
	}
	if opts.SliceCheck == 0 {
		opts.SliceCheck = 30 * time.Second
	}
	if opts.SliceCheckGap <= 0 {
		opts.SliceCheckGap = 5 * time.Second
	}
	d := &Driver{opts: opts, log: opts.Logger, watchers: map[chan struct{}]struct{}{}, poolSet: make(chan struct{}, 1),
		restart: make(chan []resourceapi.ResourceSlice, 1), checkNow: make(chan struct{}, 1)}
	d.startController = d.startSlices
	return d
}

// SetClaims sets who prepares claims (the agent, built after the driver it
// publishes through); call before Start.
func (d *Driver) SetClaims(c Claims) { d.opts.Claims = c }

// Start registers the driver with the kubelet, starts serving claims to
// opts.Claims and publishes the pool last given to Publish.
func (d *Driver) Start(ctx context.Context) error {
	opts := d.opts
	if opts.NodeName == "" || opts.Client == nil || opts.Claims == nil {
		return errors.New("dra: NodeName, Client and Claims are required")
	}
	// The helper logs through klog's contextual logger: route it to ours.
	ctx = klog.NewContext(ctx, logr.FromSlogHandler(opts.Logger.With("component", "dra").Handler()))
	kopts := []kubeletplugin.Option{
		kubeletplugin.DriverName(devicemodel.DriverName),
		kubeletplugin.NodeName(opts.NodeName),
		// The helper reads claims through its client. It writes no
		// ResourceSlices: PublishResources is never called, the driver runs
		// the controller itself, to start it over (runPublishing).
		kubeletplugin.KubeClient(opts.ClaimReader),
	}
	if opts.PluginDir != "" {
		// The kubelet creates its plugins_registry, not a driver's own directory.
		if err := os.MkdirAll(opts.PluginDir, 0o750); err != nil {
			return fmt.Errorf("dra: plugin directory: %w", err)
		}
		kopts = append(kopts, kubeletplugin.PluginDataDirectoryPath(opts.PluginDir))
	}
	if opts.RegistryDir != "" {
		kopts = append(kopts, kubeletplugin.RegistrarDirectoryPath(opts.RegistryDir))
	}
	h, err := kubeletplugin.Start(ctx, d, kopts...)
	if err != nil {
		return fmt.Errorf("dra: start the kubelet plugin %s: %w", devicemodel.DriverName, err)
	}
	d.mu.Lock()
	d.helper = h
	d.mu.Unlock()
	d.startPublishing(ctx)
	return nil
}

// Stop stops serving. ResourceSlices stay: the next agent publishes over
// them, and `gpu-agent node-cleanup` removes them on uninstall.
func (d *Driver) Stop() {
	d.mu.Lock()
	h, stopPublishing := d.helper, d.stopPublishing
	d.mu.Unlock()
	if h != nil {
		h.Stop()
	}
	if stopPublishing != nil {
		stopPublishing() // ends publishing, waiting for the API server or not
	}
	d.running.Wait()
}

// Publish sets what the node offers through DRA; the ResourceSlice controller
// writes the ResourceSlices in the background. It never blocks on the API.
// Until the first publish is through it only keeps the pool.
func (d *Driver) Publish(p *devicemodel.Pool) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.pool == nil || !d.pool.Equal(p) {
		d.stale = true
	}
	d.pool = p
	select {
	case d.poolSet <- struct{}{}:
	default:
	}
	d.publishLocked()
	for w := range d.watchers {
		select {
		case w <- struct{}{}:
		default: // a send is pending; it reads the newest pool
		}
	}
}

// PrepareResourceClaims implements kubeletplugin.DRAPlugin: the loop
// decides, this only translates.
func (d *Driver) PrepareResourceClaims(ctx context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	in := make([]Claim, 0, len(claims))
	for _, c := range claims {
		in = append(in, ClaimOf(c, d.opts.NodeName))
	}
	got, err := d.opts.Claims.PrepareClaims(ctx, in)
	if err != nil {
		return nil, err
	}
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(in))
	for _, c := range in {
		p, ok := got[c.UID]
		if !ok {
			out[c.UID] = kubeletplugin.PrepareResult{Err: fmt.Errorf("claim %s: no answer", c)}
			continue
		}
		if p.Err != nil {
			out[c.UID] = kubeletplugin.PrepareResult{Err: p.Err}
			continue
		}
		r := kubeletplugin.PrepareResult{Devices: make([]kubeletplugin.Device, 0, len(p.Devices))}
		for _, pd := range p.Devices {
			kd := kubeletplugin.Device{Requests: pd.Requests, PoolName: d.opts.NodeName, DeviceName: pd.Device, CDIDeviceIDs: pd.CDIDevices}
			if pd.ShareID != "" {
				kd.ShareID = &pd.ShareID
			}
			r.Devices = append(r.Devices, kd)
		}
		out[c.UID] = r
	}
	return out, nil
}

// ClaimOf extracts what Prepare needs from an allocated claim: the results
// of this driver in this node's pool.
func ClaimOf(c *resourceapi.ResourceClaim, pool string) Claim {
	out := Claim{UID: c.UID, Namespace: c.Namespace, Name: c.Name}
	if c.Status.Allocation == nil {
		return out
	}
	out.Configs = devicemodel.ConfigsOf(c.Status.Allocation.Devices.Config)
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver == devicemodel.DriverName && r.Pool == pool {
			a := Allocated{Request: r.Request, Device: r.Device}
			if r.ShareID != nil {
				a.ShareID = *r.ShareID
			}
			if q, ok := r.ConsumedCapacity[devicemodel.CapacityShares]; ok {
				a.SharesTaken = q.Value()
			}
			if q, ok := r.ConsumedCapacity["memory"]; ok && q.Sign() > 0 {
				a.MemoryBytes = uint64(q.Value())
			}
			a.AdminAccess = r.AdminAccess != nil && *r.AdminAccess
			for _, t := range r.Tolerations {
				for _, effect := range []resourceapi.DeviceTaintEffect{resourceapi.DeviceTaintEffectNoSchedule, resourceapi.DeviceTaintEffectNoExecute} {
					if resourceclaim.ToleratesTaint(t, resourceapi.DeviceTaint{Key: devicemodel.TaintUnhealthy, Effect: effect}) {
						a.ToleratesUnhealthy = true
					}
				}
				// The cordon's taint is only ever NoSchedule: a toleration of
				// NoExecute alone does not match it, for the scheduler either.
				if resourceclaim.ToleratesTaint(t, resourceapi.DeviceTaint{Key: devicemodel.TaintCordoned, Effect: resourceapi.DeviceTaintEffectNoSchedule}) {
					a.ToleratesCordon = true
				}
			}
			out.Devices = append(out.Devices, a)
		}
	}
	return out
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin.
func (d *Driver) UnprepareResourceClaims(ctx context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	in := make([]ClaimRef, 0, len(claims))
	for _, c := range claims {
		in = append(in, ClaimRef{UID: c.UID, Namespace: c.Namespace, Name: c.Name})
	}
	return d.opts.Claims.UnprepareClaims(ctx, in)
}

// HandleError implements kubeletplugin.DRAPlugin, and is the ResourceSlice
// controller's error handler: none is fatal. Fields the API server dropped
// mean a feature is off there: the devices that need them are left out
// from then on (Dropped), and the slices are published again without them.
// A slice the API server does not know (the controller updating one its
// cache still holds) asks for a check of the API server's copy at once.
func (d *Driver) HandleError(_ context.Context, err error, msg string) {
	var dropped *resourceslice.DroppedFieldsError
	if !errors.As(err, &dropped) {
		d.log.Error("DRA: "+msg, "err", err)
		if apierrors.IsNotFound(err) {
			d.CheckSoon()
		}
		return
	}
	features := dropped.DisabledFeatures()
	d.mu.Lock()
	defer d.mu.Unlock()
	changed := false
	var unknown []string
	for _, f := range features {
		flag, leftOut := d.dropped.Flag(f)
		switch {
		case flag == nil:
			unknown = append(unknown, f)
		case !*flag:
			*flag, changed = true, true
			d.log.Warn("DRA: the API server drops the fields of feature "+f+" (off there); left out of the ResourceSlices from now on: "+leftOut,
				"feature", f, "err", err)
		default:
			// A slice written before the last republish.
			d.log.Debug("DRA: the API server dropped fields of a feature already allowed for", "feature", f, "err", err)
		}
	}
	if len(unknown) > 0 || len(features) == 0 {
		// Nothing the driver knows to leave out: the slice stays as the API
		// server stored it.
		d.log.Error("DRA: "+msg, "err", err, "features", unknown)
	}
	if changed {
		d.stale = true
		d.publishLocked()
	}
}

// NodeWatchResources implements the kubelet's DRA health service: the
// complete list of the pool's devices with their health, at once, on every
// change, and again every HealthResend.
func (d *Driver) NodeWatchResources(_ *drahealth.NodeWatchResourcesRequest, stream grpc.ServerStreamingServer[drahealth.NodeWatchResourcesResponse]) error {
	changed := make(chan struct{}, 1)
	d.mu.Lock()
	d.watchers[changed] = struct{}{}
	d.mu.Unlock()
	defer func() {
		d.mu.Lock()
		delete(d.watchers, changed)
		d.mu.Unlock()
	}()
	resend := time.NewTicker(d.opts.HealthResend)
	defer resend.Stop()
	for {
		if err := stream.Send(d.healthResponse()); err != nil {
			return err
		}
		select {
		case <-stream.Context().Done():
			return nil
		case <-changed:
		case <-resend.C:
		}
	}
}

func (d *Driver) healthResponse() *drahealth.NodeWatchResourcesResponse {
	d.mu.Lock()
	pool := d.pool
	d.mu.Unlock()
	now := d.opts.Now().Unix()
	out := &drahealth.NodeWatchResourcesResponse{}
	if pool == nil {
		return out
	}
	for _, dev := range pool.Devices {
		h := &drahealth.DeviceHealth{
			Device:          &drahealth.DeviceIdentifier{PoolName: d.opts.NodeName, DeviceName: dev.Name},
			Health:          drahealth.HealthStatus_HEALTHY,
			LastUpdatedTime: now,
			// Three resends missed: the agent is gone, the kubelet says Unknown.
			HealthCheckTimeoutSeconds: max(1, int64(3*d.opts.HealthResend/time.Second)), // a resend under 1/3 s must not round it to 0
		}
		// A cordoned device reads as the device plugin reports it to the
		// kubelet: not to be used, saying why. The stream only informs
		// (the pod's allocatedResourcesStatus); it evicts nothing.
		if why := joinWhy(dev.Unhealthy, dev.Cordoned); why != "" {
			h.Health, h.Message = drahealth.HealthStatus_UNHEALTHY, truncate(why, 1024)
		}
		out.Devices = append(out.Devices, h)
	}
	return out
}

// joinWhy joins the reasons given, leaving out empty ones.
func joinWhy(why ...string) string {
	var out []string
	for _, w := range why {
		if w != "" {
			out = append(out, w)
		}
	}
	return strings.Join(out, "; ")
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n-3] + "..."
}
