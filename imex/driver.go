package imex

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"sync"
	"time"

	"github.com/go-logr/logr"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	"k8s.io/dynamic-resource-allocation/kubeletplugin"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/klog/v2"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/stateformat"
)

// Daemons runs the IMEX daemons of the node's domains (Supervisor).
type Daemons interface {
	Set([]DaemonSpec)
	State(domain string) DaemonState
}

// Options configure a Driver.
type Options struct {
	NodeName string
	// Client writes the driver's ResourceSlices; ClaimReader reads the
	// claims the kubelet prepares (nil: Client).
	Client, ClaimReader kubernetes.Interface
	// Domains finds ComputeDomains (Watcher).
	Domains Domains
	// Status writes the node's readiness into its domains' status.nodes
	// (Reporter); nil: nothing is reported.
	Status  StatusApplier
	Daemons Daemons
	// StateDir holds the checkpoint (StateFile).
	StateDir string
	// CDI writes each claim's spec.
	CDI *cdi.Writer
	// HostRoot is where the driver's files and channel nodes are ("/" on
	// a real node).
	HostRoot string
	// PluginDir is the kubelet plugin's directory ("":
	// /var/lib/kubelet/plugins/compute-domain.nvidia.com); RegistryDir the
	// kubelet's registration directory.
	PluginDir, RegistryDir string
	Logger                 *slog.Logger
}

// Driver is the compute-domain.nvidia.com kubelet plugin.
type Driver struct {
	opts Options
	log  *slog.Logger
	host Host
	// hostErr is why the driver's files could not be read (no channel is
	// offered then).
	hostErr error

	mu      sync.Mutex
	claims  map[types.UID]PreparedClaim
	fabric  Fabric
	pool    Pool
	gen     int64
	dropped Dropped // fields the API server drops
	// reported is, per domain, the status last applied and the
	// resourceVersion it was applied at: not applied again until the
	// watch shows a newer object.
	reported map[string]report
	// retry is signalled when a report failed, to refresh again soon.
	retry   chan struct{}
	ctrl    sliceController
	helper  *kubeletplugin.Helper
	saveErr string
	stop    context.CancelFunc
	running sync.WaitGroup
}

type sliceController interface {
	Update(*resourceslice.DriverResources)
	Stop()
}

// New reads the driver's files under HostRoot and the checkpoint. A
// checkpoint of a newer format is an error; an unreadable one is set
// aside (the kubelet prepares its claims again).
func New(opts Options) (*Driver, error) {
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.ClaimReader == nil {
		opts.ClaimReader = opts.Client
	}
	if opts.HostRoot == "" {
		opts.HostRoot = "/"
	}
	d := &Driver{opts: opts, log: opts.Logger, claims: map[types.UID]PreparedClaim{}, reported: map[string]report{}, retry: make(chan struct{}, 1)}
	d.host, d.hostErr = ReadHost(opts.HostRoot)
	if d.hostErr != nil {
		d.log.Error("IMEX: no channels offered", "err", d.hostErr)
	}
	d.pool.Channels = d.host.Channels
	restored, err := loadState(opts.StateDir)
	if newer := (*stateformat.NewerError)(nil); errors.As(err, &newer) {
		return nil, err
	}
	if err != nil {
		d.log.Error("IMEX: compute-domain checkpoint not restored", "err", err)
	}
	for _, c := range restored {
		d.claims[c.UID] = c
	}
	if opts.CDI != nil {
		removed, err := cdi.RemoveStaleIMEX(opts.CDI, func(uid string) bool { _, ok := d.claims[types.UID(uid)]; return ok })
		if err != nil || len(removed) > 0 {
			d.log.Info("IMEX: CDI specs of claims not prepared removed", "claims", removed, "err", err)
		}
	}
	d.syncDaemonsLocked()
	return d, nil
}

// SetInventory takes the GPUs' fabric as last read: the clique, and the
// faults the channels carry as taints.
func (d *Driver) SetInventory(inv *gpu.Inventory) {
	f := FabricOf(inv)
	d.mu.Lock()
	defer d.mu.Unlock()
	d.fabric = f
	d.republishLocked()
	d.syncDaemonsLocked()
}

// republishLocked updates the pool from the fabric and the daemons'
// failures and hands it to the controller if it changed.
func (d *Driver) republishLocked() {
	p := Pool{Channels: d.host.Channels, Faults: slices.Clone(d.fabric.Faults)}
	if f := d.imexFaultLocked(); f != nil {
		p.Faults = append(p.Faults, *f)
	}
	if p.Equal(d.pool) && d.gen > 0 {
		return
	}
	d.pool = p
	d.updateLocked()
}

func (d *Driver) updateLocked() {
	if d.ctrl == nil {
		return
	}
	d.gen++
	res := Resources(d.opts.NodeName, d.pool, d.gen, d.dropped)
	d.ctrl.Update(&res)
}

// imexFaultLocked: a daemon that failed to start or exited 3 times in a
// row means IMEX is broken on this node (a missing program, a port taken),
// whichever domain it was for: new work is kept off the channels.
func (d *Driver) imexFaultLocked() *Fault {
	if d.opts.Daemons == nil {
		return nil
	}
	for _, dom := range d.daemonDomainsLocked() {
		if st := d.opts.Daemons.State(dom); st.Failures >= 3 {
			return &Fault{Key: TaintIMEX, Why: fmt.Sprintf("IMEX daemon of domain %s failed %d times: %s", dom, st.Failures, st.Reason),
				Effect: resourceapi.DeviceTaintEffectNoSchedule}
		}
	}
	return nil
}

// Clique is the node's clique, for the node label nvidia.com/gpu.clique.
func (d *Driver) Clique() string {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.fabric.Clique
}

// Start registers with the kubelet and publishes the pool. Publishing
// waits for the API server in the background.
func (d *Driver) Start(ctx context.Context) error {
	if d.opts.NodeName == "" || d.opts.Client == nil {
		return errors.New("imex: NodeName and Client are required")
	}
	ctx = klog.NewContext(ctx, logr.FromSlogHandler(d.log.Handler()))
	kopts := []kubeletplugin.Option{
		kubeletplugin.DriverName(DriverName),
		kubeletplugin.NodeName(d.opts.NodeName),
		kubeletplugin.KubeClient(d.opts.ClaimReader),
	}
	if d.opts.PluginDir != "" {
		if err := os.MkdirAll(d.opts.PluginDir, 0o750); err != nil {
			return fmt.Errorf("imex: plugin directory: %w", err)
		}
		kopts = append(kopts, kubeletplugin.PluginDataDirectoryPath(d.opts.PluginDir))
	}
	if d.opts.RegistryDir != "" {
		kopts = append(kopts, kubeletplugin.RegistrarDirectoryPath(d.opts.RegistryDir))
	}
	h, err := kubeletplugin.Start(ctx, d, kopts...)
	if err != nil {
		return fmt.Errorf("imex: start the kubelet plugin %s: %w", DriverName, err)
	}
	ctx, cancel := context.WithCancel(ctx)
	d.mu.Lock()
	d.helper, d.stop = h, cancel
	d.gen++
	res := Resources(d.opts.NodeName, d.pool, d.gen, d.dropped)
	d.mu.Unlock()
	d.running.Add(1)
	go func() {
		defer d.running.Done()
		ctrl, err := resourceslice.StartController(ctx, resourceslice.Options{
			DriverName: DriverName, KubeClient: d.opts.Client, Resources: &res, ErrorHandler: d.HandleError,
			Owner: &resourceslice.Owner{APIVersion: "v1", Kind: "Node", Name: d.opts.NodeName},
		})
		if err != nil {
			d.log.Info("IMEX: ResourceSlices not published", "err", err)
			return
		}
		d.mu.Lock()
		d.ctrl = ctrl
		d.updateLocked() // what changed while it waited
		d.mu.Unlock()
		<-ctx.Done()
		ctrl.Stop()
	}()
	return nil
}

// Stop stops serving; slices, claims and daemons stay.
func (d *Driver) Stop() {
	d.mu.Lock()
	h, stop := d.helper, d.stop
	d.mu.Unlock()
	if h != nil {
		h.Stop()
	}
	if stop != nil {
		stop()
	}
	d.running.Wait()
}

// HandleError implements kubeletplugin.DRAPlugin and the slice
// controller's error handler. A field the API server drops (its feature
// is off there) is latched and the pool republished without it: no
// tainted channel without taints, channels without binding conditions
// (Prepare then waits for the domain's daemon, "Waiting for the domain"
// in docs/compute-domains.md), channels without allowMultipleAllocations
// (one channel claim per node). Each is said once in the log and stays on
// /status.
func (d *Driver) HandleError(_ context.Context, err error, msg string) {
	var dropped *resourceslice.DroppedFieldsError
	if !errors.As(err, &dropped) {
		d.log.Error("IMEX: "+msg, "err", err)
		return
	}
	features := dropped.DisabledFeatures()
	d.mu.Lock()
	defer d.mu.Unlock()
	changed := false
	var unknown []string
	for _, f := range features {
		flag := d.dropped.flag(f)
		switch {
		case flag == nil:
			unknown = append(unknown, f)
		case !*flag:
			*flag, changed = true, true
			d.log.Warn("IMEX: the API server drops the fields of feature "+f+" (off there); from now on "+d.dropped.effect(f),
				"feature", f, "err", err)
		}
	}
	if len(unknown) > 0 || len(features) == 0 {
		d.log.Error("IMEX: "+msg, "err", err, "features", unknown)
	}
	if changed {
		d.updateLocked()
	}
}

// Refresh is called when the domains or the daemons changed: the node
// lists are rewritten, the pool retainted, and each daemon's readiness
// written into its domain's status.nodes where the entry says otherwise.
func (d *Driver) Refresh(ctx context.Context) {
	d.mu.Lock()
	d.syncDaemonsLocked()
	d.republishLocked()
	due := d.reportsLocked()
	d.mu.Unlock()
	d.applyReports(ctx, due)
}

// Follow refreshes at each signal of changes (the domains' watch, the
// daemons' supervisor) and every interval, until ctx ends.
func (d *Driver) Follow(ctx context.Context, interval time.Duration, changes ...<-chan struct{}) error {
	t := time.NewTicker(interval)
	defer t.Stop()
	merged := make(chan struct{}, 1)
	for _, ch := range append(changes, d.retry) {
		go func() {
			for {
				select {
				case <-ctx.Done():
					return
				case <-ch:
					select {
					case merged <- struct{}{}:
					default:
					}
				}
			}
		}()
	}
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-merged:
		case <-t.C:
		}
		d.Refresh(ctx)
	}
}

// domainsLocked are the domains with claims on this node, sorted.
func (d *Driver) domainsLocked() []string {
	var out []string
	for _, c := range d.claims {
		if !slices.Contains(out, c.Domain) {
			out = append(out, c.Domain)
		}
	}
	slices.Sort(out)
	return out
}

// daemonDomainsLocked are the domains whose daemon runs here: those with
// claims on this node, and those whose status.nodes lists it (their
// workload is allocated here, its pods perhaps not bound yet), sorted.
func (d *Driver) daemonDomainsLocked() []string {
	out := d.domainsLocked()
	if d.opts.Domains != nil {
		for _, dom := range d.opts.Domains.Listing(d.opts.NodeName) {
			if !slices.Contains(out, dom) {
				out = append(out, dom)
			}
		}
	}
	slices.Sort(out)
	return out
}

// channelOfLocked is a domain's channel on this node (its first); for a
// domain with no claim here yet, the one its first claim will get, so
// that the daemon's ports do not change when it comes.
func (d *Driver) channelOfLocked(domain string) int {
	held := map[int]string{}
	for _, c := range d.claims {
		if c.Domain == domain && len(c.Channels) > 0 {
			if c.Mode == cdv1.AllocationModeAll {
				return preferredChannel(domain, d.host.Channels)
			}
			return c.Channels[0]
		}
		for _, ch := range c.Channels {
			held[ch] = c.Domain
		}
	}
	if ch, err := assignChannel(domain, d.host.Channels, held); err == nil {
		return ch
	}
	return preferredChannel(domain, d.host.Channels)
}

// daemonSpecLocked is the daemon domain needs here, or why there is none
// yet: the controller has not listed this node in the domain's
// status.nodes.
func (d *Driver) daemonSpecLocked(domain string) (DaemonSpec, error) {
	cd, ok := d.opts.Domains.Domain(domain)
	if !ok {
		return DaemonSpec{}, fmt.Errorf("ComputeDomain %s not found", domain)
	}
	name := cd.Namespace + "/" + cd.Name
	var self *cdv1.ComputeDomainNode
	for i, n := range cd.Status.Nodes {
		if n.Name == d.opts.NodeName {
			self = &cd.Status.Nodes[i]
		}
	}
	if self == nil || self.IPAddress == "" {
		return DaemonSpec{}, fmt.Errorf("ComputeDomain %s: the controller has not listed node %s in status.nodes yet", name, d.opts.NodeName)
	}
	clique := self.CliqueID
	if clique == "" {
		clique = d.fabric.Clique
	}
	peers := slices.Clone(cd.Status.Nodes)
	peers = slices.DeleteFunc(peers, func(n cdv1.ComputeDomainNode) bool { return n.CliqueID != clique || n.IPAddress == "" })
	sort.SliceStable(peers, func(i, j int) bool { return peers[i].Index < peers[j].Index })
	spec := DaemonSpec{Domain: domain, Name: name, BindIP: self.IPAddress}
	for _, p := range peers {
		if !slices.Contains(spec.Nodes, p.IPAddress) {
			spec.Nodes = append(spec.Nodes, p.IPAddress)
		}
	}
	spec.ServerPort, spec.CmdPort = serverPorts(d.channelOfLocked(domain))
	return spec, nil
}

// syncDaemonsLocked hands the daemons wanted to the supervisor: one per
// domain with claims here whose node list is known.
func (d *Driver) syncDaemonsLocked() {
	if d.opts.Daemons == nil || d.opts.Domains == nil {
		return
	}
	var specs []DaemonSpec
	for _, dom := range d.daemonDomainsLocked() {
		if spec, err := d.daemonSpecLocked(dom); err == nil {
			specs = append(specs, spec)
		}
	}
	d.opts.Daemons.Set(specs)
}

// PrepareResourceClaims implements kubeletplugin.DRAPlugin.
func (d *Driver) PrepareResourceClaims(_ context.Context, claims []*resourceapi.ResourceClaim) (map[types.UID]kubeletplugin.PrepareResult, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[types.UID]kubeletplugin.PrepareResult, len(claims))
	for _, c := range claims {
		devs, err := d.prepareLocked(c)
		if err != nil {
			err = fmt.Errorf("claim %s/%s: %w", c.Namespace, c.Name, err)
		}
		out[c.UID] = kubeletplugin.PrepareResult{Devices: devs, Err: err}
	}
	d.syncDaemonsLocked()
	d.republishLocked()
	return out, nil
}

// prepareLocked prepares one claim: records it (checkpointed) with its
// domain's channel, writes its CDI spec, and answers once the domain's
// IMEX daemon on this node is ready. Until then the answer is an error
// the kubelet retries, and the record stays, so that the daemon runs.
func (d *Driver) prepareLocked(c *resourceapi.ResourceClaim) ([]kubeletplugin.Device, error) {
	rec, ok := d.claims[c.UID]
	if !ok {
		var err error
		rec, err = d.newClaimLocked(c)
		if err != nil {
			return nil, err
		}
		if len(rec.Devices) == 0 {
			return nil, nil
		}
		d.claims[c.UID] = rec
		if err := saveState(d.opts.StateDir, d.sortedClaimsLocked()); err != nil {
			delete(d.claims, c.UID)
			d.saveErr = err.Error()
			return nil, err
		}
		d.saveErr = ""
		if err := d.writeSpecLocked(rec); err != nil {
			return nil, err
		}
	}
	if rec.Kind == KindChannel && d.opts.Daemons != nil {
		d.syncDaemonsLocked()
		spec, err := d.daemonSpecLocked(rec.Domain)
		if err != nil {
			return nil, fmt.Errorf("waiting for the IMEX daemon of domain %s: %w", rec.Domain, err)
		}
		if st := d.opts.Daemons.State(rec.Domain); !st.Ready {
			return nil, fmt.Errorf("waiting for the IMEX daemon of ComputeDomain %s on this node: %s", spec.Name, orElse(st.Reason, "starting"))
		}
	}
	out := make([]kubeletplugin.Device, 0, len(rec.Devices))
	for _, dv := range rec.Devices {
		out = append(out, kubeletplugin.Device{Requests: dv.Requests, PoolName: d.opts.NodeName, DeviceName: dv.Device,
			ShareID: dv.ShareID, CDIDeviceIDs: []string{cdi.IMEXDeviceName(string(rec.UID))}})
	}
	return out, nil
}

func orElse(s, def string) string {
	if s == "" {
		return def
	}
	return s
}

// newClaimLocked works out what claim c is: its devices of this driver in
// this node's pool, its opaque config, and the channels it gets. A channel
// device is the name the scheduler allocated (channel-0 for NVIDIA's
// default class, a share of it where the API server serves
// allowMultipleAllocations, with a shareID per claim); the host channel
// comes from the claim's domain alone.
func (d *Driver) newClaimLocked(c *resourceapi.ResourceClaim) (PreparedClaim, error) {
	rec := PreparedClaim{UID: c.UID, Namespace: c.Namespace, Name: c.Name}
	if c.Status.Allocation == nil {
		return rec, errors.New("not allocated")
	}
	type share struct {
		device string
		id     types.UID
	}
	byShare := map[share]int{}
	var channelDevs, daemonDevs []string
	for _, r := range c.Status.Allocation.Devices.Results {
		if r.Driver != DriverName || r.Pool != d.opts.NodeName {
			continue
		}
		key := share{device: r.Device}
		if r.ShareID != nil {
			key.id = *r.ShareID
		}
		if i, ok := byShare[key]; ok {
			rec.Devices[i].Requests = append(rec.Devices[i].Requests, r.Request)
			continue
		}
		switch _, isChannel := channelID(r.Device); {
		case isChannel:
			channelDevs = append(channelDevs, r.Request)
		case r.Device == DaemonDevice:
			daemonDevs = append(daemonDevs, r.Request)
		default:
			return rec, fmt.Errorf("device %s: not one this driver publishes", r.Device)
		}
		byShare[key] = len(rec.Devices)
		rec.Devices = append(rec.Devices, ClaimDevice{Requests: []string{r.Request}, Device: r.Device, ShareID: r.ShareID})
	}
	if len(rec.Devices) == 0 {
		return rec, nil
	}
	if len(channelDevs) > 0 && len(daemonDevs) > 0 {
		return rec, errors.New("a channel and the daemon device in one claim")
	}
	cfg, err := configOf(c.Status.Allocation.Devices.Config, append(channelDevs, daemonDevs...))
	if err != nil {
		return rec, err
	}
	if d.fabric.Clique == "" {
		return rec, errors.New("the node's GPUs are in no complete NVLink clique: " + d.faultText())
	}
	switch cfg := cfg.(type) {
	case *cdv1.ComputeDomainChannelConfig:
		if len(channelDevs) == 0 {
			return rec, errors.New("a ComputeDomainChannelConfig for the daemon device")
		}
		for _, f := range d.fabric.Faults {
			if f.Effect == resourceapi.DeviceTaintEffectNoExecute {
				return rec, errors.New("the NVLink fabric is faulty: " + f.Why)
			}
		}
		rec.Kind, rec.Domain, rec.Mode = KindChannel, cfg.DomainID, cfg.AllocationMode
		if cd, ok := d.opts.Domains.Domain(cfg.DomainID); ok && cd.Namespace != c.Namespace {
			// As NVIDIA's driver: a claim joins only a domain of its own
			// namespace.
			return rec, fmt.Errorf("ComputeDomain %s is in namespace %s, the claim in %s", cfg.DomainID, cd.Namespace, c.Namespace)
		}
		held := map[int]string{}
		for _, o := range d.claims {
			for _, ch := range o.Channels {
				held[ch] = o.Domain
			}
		}
		if cfg.AllocationMode == cdv1.AllocationModeAll {
			for ch, dom := range held {
				if dom != cfg.DomainID {
					return rec, fmt.Errorf("allocation mode All: channel %d is held by domain %s", ch, dom)
				}
			}
			for ch := range d.host.Channels {
				rec.Channels = append(rec.Channels, ch)
			}
			return rec, nil
		}
		ch, err := assignChannel(cfg.DomainID, d.host.Channels, held)
		if err != nil {
			return rec, err
		}
		rec.Channels = []int{ch}
	case *cdv1.ComputeDomainDaemonConfig:
		if len(daemonDevs) == 0 {
			return rec, errors.New("a ComputeDomainDaemonConfig for a channel device")
		}
		rec.Kind, rec.Domain = KindDaemon, cfg.DomainID
	}
	return rec, nil
}

func (d *Driver) faultText() string {
	if len(d.fabric.Faults) == 0 {
		return "no fabric info"
	}
	return d.fabric.Faults[0].Why
}

// configOf is the driver's opaque config for requests: the claim's over
// the class's, a config naming the request over one naming none.
func configOf(configs []resourceapi.DeviceAllocationConfiguration, requests []string) (any, error) {
	var found any
	rank := -1
	for i, c := range configs {
		if c.Opaque == nil || c.Opaque.Driver != DriverName {
			continue
		}
		applies := len(c.Requests) == 0 || slices.ContainsFunc(c.Requests, func(r string) bool { return slices.Contains(requests, r) })
		if !applies {
			continue
		}
		r := 0
		if c.Source == resourceapi.AllocationConfigSourceClaim {
			r += 2
		}
		if len(c.Requests) > 0 {
			r++
		}
		if r < rank {
			continue
		}
		v, err := cdv1.DecodeConfig(c.Opaque.Parameters.Raw)
		if err != nil {
			return nil, fmt.Errorf("status.allocation.devices.config[%d].opaque.parameters: %w", i, err)
		}
		found, rank = v, r
	}
	if found == nil {
		return nil, errors.New("no ComputeDomainChannelConfig or ComputeDomainDaemonConfig (the claim must come from a ComputeDomain's template)")
	}
	return found, nil
}

// writeSpecLocked writes claim rec's CDI spec: its channels' device nodes;
// for a daemon claim, the domain's identity in the environment, as
// NVIDIA's driver gives its daemon pods.
func (d *Driver) writeSpecLocked(rec PreparedClaim) error {
	if d.opts.CDI == nil {
		return nil
	}
	var nodes []cdi.CharDevice
	for _, ch := range rec.Channels {
		p := filepath.Join(ChannelDir, "channel"+strconv.Itoa(ch))
		nodes = append(nodes, cdi.CharDevice{Path: p, HostPath: filepath.Join(d.opts.HostRoot, p), Major: int64(d.host.Major), Minor: int64(ch)})
	}
	var env map[string]string
	if rec.Kind == KindDaemon {
		env = map[string]string{"COMPUTE_DOMAIN_UUID": rec.Domain, "CLIQUE_ID": d.fabric.Clique}
		if cd, ok := d.opts.Domains.Domain(rec.Domain); ok {
			env["COMPUTE_DOMAIN_NAME"], env["COMPUTE_DOMAIN_NAMESPACE"] = cd.Name, cd.Namespace
		}
	}
	s, err := cdi.IMEXClaimSpec(string(rec.UID), nodes, env)
	if err != nil {
		return err
	}
	_, err = d.opts.CDI.Write(cdi.IMEXSpecName(string(rec.UID)), s)
	return err
}

// UnprepareResourceClaims implements kubeletplugin.DRAPlugin: the claim's
// spec is removed and its record dropped; a domain left without claims
// here has its daemon stopped.
func (d *Driver) UnprepareResourceClaims(_ context.Context, claims []kubeletplugin.NamespacedObject) (map[types.UID]error, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	out := make(map[types.UID]error, len(claims))
	for _, c := range claims {
		rec, ok := d.claims[c.UID]
		if !ok {
			out[c.UID] = nil
			continue
		}
		if d.opts.CDI != nil {
			if _, err := d.opts.CDI.Write(cdi.IMEXSpecName(string(c.UID)), nil); err != nil {
				out[c.UID] = err
				continue
			}
		}
		delete(d.claims, c.UID)
		if err := saveState(d.opts.StateDir, d.sortedClaimsLocked()); err != nil {
			d.claims[c.UID] = rec
			d.saveErr = err.Error()
			out[c.UID] = err
			continue
		}
		d.saveErr = ""
		out[c.UID] = nil
	}
	d.syncDaemonsLocked()
	d.republishLocked()
	return out, nil
}

func (d *Driver) sortedClaimsLocked() []PreparedClaim {
	out := make([]PreparedClaim, 0, len(d.claims))
	for _, c := range d.claims {
		out = append(out, c)
	}
	slices.SortFunc(out, func(a, b PreparedClaim) int {
		if a.UID < b.UID {
			return -1
		}
		if a.UID > b.UID {
			return 1
		}
		return 0
	})
	return out
}

// Status is the driver's part of /status.
type Status struct {
	Driver   string                 `json:"driver"`
	Clique   string                 `json:"clique,omitempty"`
	Channels int                    `json:"channels"`
	HostErr  string                 `json:"hostError,omitempty"`
	Faults   []Fault                `json:"faults,omitempty"`
	Claims   []PreparedClaim        `json:"claims,omitempty"`
	Daemons  map[string]DaemonState `json:"daemons,omitempty"`
	// Waiting says, per domain, why its daemon does not run yet.
	Waiting    map[string]string `json:"waiting,omitempty"`
	Generation int64             `json:"generation"`
	SaveError  string            `json:"saveError,omitempty"`
	// FeaturesOff are the DRA features the API server drops the fields
	// of, and what the node loses while each is off.
	FeaturesOff []FeatureOff `json:"featuresOff,omitempty"`
}

// Status reports the clique, the pool's faults, the claims and each
// domain's daemon.
func (d *Driver) Status() Status {
	d.mu.Lock()
	defer d.mu.Unlock()
	s := Status{Driver: DriverName, Clique: d.fabric.Clique, Channels: d.pool.Channels, Faults: d.pool.Faults,
		Claims: d.sortedClaimsLocked(), Generation: d.gen, SaveError: d.saveErr, FeaturesOff: d.dropped.Off()}
	if d.hostErr != nil {
		s.HostErr = d.hostErr.Error()
	}
	for _, dom := range d.daemonDomainsLocked() {
		if d.opts.Domains != nil {
			if _, err := d.daemonSpecLocked(dom); err != nil {
				if s.Waiting == nil {
					s.Waiting = map[string]string{}
				}
				s.Waiting[dom] = err.Error()
				continue
			}
		}
		if d.opts.Daemons != nil {
			if s.Daemons == nil {
				s.Daemons = map[string]DaemonState{}
			}
			s.Daemons[dom] = d.opts.Daemons.State(dom)
		}
	}
	return s
}
