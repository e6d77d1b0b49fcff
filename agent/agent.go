// Package agent is gpu-agent's reconcile loop: one goroutine owns the node's
// state, takes typed events from one Inbox, derives what the node should be
// with the pure Plan, and has actuators (MIG applier, MPS supervisor, health
// watcher, plugin manager) do the I/O. Everything else reads immutable
// snapshots it publishes.
package agent

import (
	"context"
	"errors"
	"log/slog"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/types"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/kube"
	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/gpu-agent/gpu-agent/mig"
	"github.com/gpu-agent/gpu-agent/mps"
	"github.com/gpu-agent/gpu-agent/plugin/topology"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// Observer reads the GPUs: the inventory and each model's MIG profiles
// (mig.Observer over NVML, real or simulated).
type Observer interface {
	Inventory() (*gpu.Inventory, error)
	MIGProfiles(g gpu.GPU) (mig.Profiles, error)
}

// Publisher serves a catalog (the plugin manager).
type Publisher interface {
	Update(c *catalog.Catalog)
}

// HealthControl is the part of health.Watcher the loop drives; the watcher
// reports back with HealthChanged events.
type HealthControl interface {
	SetInventory(inv *gpu.Inventory)
	SetPolicy(p health.Policy)
}

// HoldingsSource asks the kubelet's pod-resources API now
// (podresources.Client).
type HoldingsSource interface {
	Refresh(ctx context.Context) (*podresources.Attribution, error)
}

// MIGApplier executes MIG plans (mig.Applier), asking g (the agent's
// ledger) before each step that destroys a MIG device or changes a GPU's
// MIG mode.
type MIGApplier interface {
	Apply(ctx context.Context, p mig.Plan, g mig.Guard) (mig.State, error)
}

// MPSControl runs the MPS control daemons the loop asks for: mps.Supervisor
// in the agent's own process, or mps.Remote, which hands them to
// `gpu-agent mps-host` through the MPS root. Either reports back with
// MPSChanged events.
type MPSControl interface {
	Set(daemons []mps.Daemon) error
	Healthy(device string) (bool, string)
}

// Cluster is the Kubernetes API side (kube.Publisher): node labels and
// Events. Its calls must not block.
type Cluster interface {
	SetLabels(labels map[string]string)
	Event(warning bool, reason, message string)
	State() kube.State
}

// Options configure an Agent.
type Options struct {
	// Observer reads the GPUs (required).
	Observer Observer
	NodeName string
	// ConfigSource names where the config comes from, for /status ("" = built-in default).
	ConfigSource string
	// ConfigMap names the ConfigMap read through the API ("NAMESPACE/NAME";
	// "": none), for /status.
	ConfigMap string
	// DefaultConfig names the config (a key of a multi-key ConfigMap) used
	// when no node entry or label selects one (NVIDIA's config.default).
	DefaultConfig string
	// WaitForConfig: the config arrives as a ConfigChanged event; until it
	// does, nothing is served (a config that is rejected or selects nothing
	// on arrival, or does not fit the node, gets the built-in default
	// served instead, saying why). Otherwise the built-in default config is
	// in force from the start.
	WaitForConfig bool
	// MIGStrategy is --mig-strategy: the MIG strategy of configs that do
	// not give one (config.ParseOptions.MIGStrategy); "" for each format's
	// own default.
	MIGStrategy config.MIGStrategy
	// Inbox is where every producer posts (nil: a new one, see Inbox()).
	Inbox     *Inbox
	Publisher Publisher
	// Health marks devices unhealthy (nil: all healthy unless unreadable).
	Health HealthControl
	// Holdings asks the kubelet who holds what (nil: never known, so no
	// MIG instance is ever destroyed).
	Holdings HoldingsSource
	// MIG repartitions GPUs to the config's MIG layout (nil: layouts are
	// not applied; existing instances are served).
	MIG MIGApplier
	// ForeignPlugins lists the resources another device plugin serves on
	// this kubelet, each with its socket (nil: none is looked for); the
	// agent does not offer those (plugin.ForeignSockets).
	ForeignPlugins func() map[string]string
	// Reset resets a GPU whose MIG mode change waits for a reset, under
	// the config's mig.resetPolicy (nil: none is reset; the GPU stays
	// reset-required).
	Reset GPUResetter
	// MPS runs the MPS control daemons (nil: MPS sharing is refused).
	MPS MPSControl
	// Cluster publishes labels and Events (nil: standalone, no API).
	Cluster Cluster
	// CDI keeps the node's CDI spec, which CDI device list strategies and
	// the DRA driver name devices from (nil: no spec is written).
	CDI CDISpecs
	// DRA publishes the node's DRA pool (nil: DRA is off). The agent then
	// also answers PrepareClaims and UnprepareClaims.
	DRA DRAPublisher
	// ClaimStatus writes the prepared claims' device status to the API
	// (dra.ClaimStatusWriter; nil: none is written).
	ClaimStatus ClaimStatusPublisher
	// MPSRoot and MPSShmDir: where daemons keep their pipes, and the host
	// directory MPS clients get as /dev/shm.
	MPSRoot, MPSShmDir string
	// TimeSlice sets a GPU's time slice for DRA claims whose config asks
	// for an interval (nil: only the Default interval is honoured).
	TimeSlice TimeSlicer
	// InventoryObservers get every new inventory (the metrics sampler).
	InventoryObservers []func(*gpu.Inventory)
	// ConfigObservers get the config once it is in force, after each
	// change (the holder tracker's idle Events); they must not block.
	ConfigObservers []func(*config.Config)
	// StateDir holds the checkpoint ("": nothing is checkpointed).
	StateDir string
	// WriteState replaces a file of StateDir atomically (default
	// atomicfile.Write); tests fail it as a full or read-only state dir
	// would.
	WriteState func(path string, data []byte, opts ...atomicfile.Options) error
	// Restored is the checkpoint read at start (nil: none).
	Restored *Checkpoint
	// BootID is the node's boot id at start ("" unknown): health causes
	// the checkpoint holds from another boot are not restored (the reboot
	// reset the GPUs), as the health watcher does not restore them.
	BootID string
	// Ledger is the node's record of who has each device (nil: a new one,
	// with its allocation log in StateDir). The device plugin's Allocate
	// and the MIG applier must pass through the same ledger (see Ledger).
	Ledger *ledger.Ledger
	// ForgetGoneAfter is how long a GPU NVML no longer enumerates is still
	// offered, unhealthy, before it is forgotten (0: never). A GPU swapped
	// for another is never enumerated again; one a container or claim
	// still holds is kept until it is released.
	ForgetGoneAfter time.Duration
	// ResyncInterval re-reads the inventory even without events (default 30s).
	ResyncInterval time.Duration
	// MIGCloseGrace is how long a surplus spare GPU's partitions stay
	// published, tainted, before they go (migOnDemand.spareGPUs; default
	// a minute). A resync pass closes it once the grace is over.
	MIGCloseGrace time.Duration
	Logger        *slog.Logger
	// Registerer receives the agent's own metrics (nil: none).
	Registerer prometheus.Registerer
	// Now is the clock (nil: time.Now).
	Now func() time.Time
	// Background runs work off the loop, such as asking the kubelet, and
	// posts the event it returns to the inbox (nil: a goroutine that
	// does). Tests run it when they choose.
	Background func(work func() Event)
}

// Agent owns the node state. Create with New, then Run (or, in tests, Step).
// The loop's state is grouped by what it holds: the config in force, the
// node as observed, who holds what, and what was published.
type Agent struct {
	opts    Options
	log     *slog.Logger
	now     func() time.Time
	inbox   *Inbox
	status  atomic.Pointer[Status]
	catalog atomic.Pointer[catalog.Catalog]
	draHeld atomic.Pointer[draHeld]
	metrics *metrics
	passes  atomic.Int64

	// Everything below is owned by the loop (Run or Step), one goroutine.
	ctx    context.Context
	scorer scorerCache

	configState
	nodeState
	holdState
	publishedState
}

// configState is what the admin asks of the node: the config file and
// where it came from, the selection for this node, the last config that
// planned here, and the Node's cordon list.
type configState struct {
	// The file's content, the config selected for this node, the last one
	// that planned here, and why the latest was rejected.
	file     *config.File
	labels   map[string]string
	selected config.Selected
	lastGood config.Selected
	cfgErr   standingError
	fitErr   standingError
	// selErr: the node's entry or labels select nothing (the last
	// selection stays).
	selErr   standingError
	warnings []string
	gen      int
	// sources holds each config source's latest content; source is the
	// one in force.
	sources   map[ConfigSource]config.Update
	source    ConfigSource
	policySet *config.Config
	// cdiPlugin: the config in force gives the device plugin a CDI device
	// list strategy.
	cdiPlugin bool
	// cordoned is the Node's cordon annotation (CordonChanged).
	cordoned []string
	// observedConfig is the config ConfigObservers were last given.
	observedConfig *config.Config
}

// nodeState is what the loop believes of the node: the inventory, GPUs
// that could not be read, MIG profiles by model, and health.
type nodeState struct {
	inv    *gpu.Inventory
	failed map[string]FailedGPU
	// failedSince: when each GPU the checkpoint lists as failed first was.
	failedSince map[string]time.Time
	// misses: how many reads in a row missed each GPU.
	misses map[string]int
	// readNow: the GPUs (UUIDs) the last observe read afresh; nil when it
	// kept the last inventory (or none ran yet: inv is the checkpoint's).
	readNow map[string]bool
	// migTouched: the GPUs (UUIDs) MIG plans ran on since each was last
	// read completely; no earlier record of them is believed.
	migTouched map[string]bool
	// bareSince: when each GPU instance without a compute instance was
	// first seen (bareKey), for removeBare.
	bareSince   map[string]time.Time
	profiles    map[string]mig.Profiles
	profileErrs map[string]error
	health      *health.State
	// conflicts: NVIDIA's components seen acting on this node.
	conflicts Conflicts
}

// read reports whether GPU uuid's record comes from the last read, which
// succeeded: only such a record may say that a MIG device is gone.
func (n *nodeState) read(uuid string) bool { return n.readNow[uuid] }

// isFailed reports whether GPU uuid could not be read.
func (n *nodeState) isFailed(uuid string) bool {
	_, ok := n.failed[uuid]
	return ok
}

// holdState is who holds what: the ledger, the kubelet's last answer and
// how the loop asks for the next, and the MPS daemons claims wait on.
type holdState struct {
	// ledger is shared with the device plugin's Allocate (see Ledger).
	ledger *ledger.Ledger
	// fresh: the kubelet's last pod-resources answer was asked for in
	// this pass. holdErr: why the kubelet gave no answer; holdAsked: when
	// the last request went out (after a failure, the next waits
	// refreshRetry); asking: a request is out.
	fresh     bool
	holdErr   standingError
	holdAsked time.Time
	asking    bool
	// mpsPending: the daemons DRA claims asked for that are not up yet, by
	// device UUID (claimconfig.go).
	mpsPending map[string]pendingMPS
}

// publishedState is what the last passes decided and told: the catalog,
// the DRA pool and claim status, MIG states and Events, the MPS daemons
// handed over, the checkpoint written, and what /status shows of them.
type publishedState struct {
	cat     *catalog.Catalog
	draPool *devicemodel.Pool
	// claimStatus is what was last handed to opts.ClaimStatus.
	claimStatus map[types.UID]dra.ClaimStatus
	migStates   map[int]MIGState
	// migSaid is each GPU's MIG state as last logged and sent as an Event.
	migSaid map[int]MIGState
	migErr  standingError
	// laid: the GPUs (by index) the MIG layout in force governs, as the
	// last pass planned it (Plan serves the last config that fitted when
	// the selected one's layout does not); nil before the first pass.
	laid map[int]bool
	// planWarnings are the last plan's (Desired.Warnings), shown with the
	// file's own warnings.
	planWarnings []string
	// mpsSet are the MPS daemons last handed to Options.MPS.
	mpsSet   []mps.Daemon
	lastPass time.Time
	lastLoop time.Time
	saved    []byte
	// ckptErr: why the checkpoint is not on disk; ckptWritten: when it
	// last was.
	ckptErr     standingError
	ckptWritten time.Time
	// unhealthyGPUs: GPU UUID → reason, as last reported in Events.
	unhealthyGPUs map[string]string
	cdiStatus     CDIStatus
	// cordonStatus: what the last pass resolved the cordon list to.
	cordonStatus CordonStatus
	// controlPlane: the API server's version (ControlPlaneChanged; "" not
	// known yet, or without the API).
	controlPlane string
	// spares: the GPUs offering MIG devices on demand under spareGPUs
	// (Snapshot.MIGOpen, MIGOpening), as the last pass decided (nextOpen);
	// at start none known, or what the checkpoint has under spareLayout.
	spares spares
}

// New returns an agent; it does nothing until Run.
func New(opts Options) *Agent {
	if opts.ResyncInterval <= 0 {
		opts.ResyncInterval = 30 * time.Second
	}
	if opts.MIGCloseGrace <= 0 {
		opts.MIGCloseGrace = closeGrace
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Inbox == nil {
		opts.Inbox = NewInbox()
	}
	if opts.Background == nil {
		inbox := opts.Inbox
		opts.Background = func(work func() Event) { go func() { inbox.Post(work()) }() }
	}
	if opts.WriteState == nil {
		opts.WriteState = atomicfile.Write
	}
	a := &Agent{opts: opts, log: opts.Logger, now: opts.Now, inbox: opts.Inbox, ctx: context.Background()}
	a.metrics = newMetrics(opts.Registerer)
	a.ledger = opts.Ledger
	if a.ledger == nil {
		var err error
		// Usable whatever the error: a log it could not open refuses
		// Allocate until it opens, keeping what it read.
		if a.ledger, err = ledger.New(ledger.Options{StateDir: opts.StateDir, Now: opts.Now, Logger: opts.Logger}); err != nil {
			a.log.Error("allocation log", "error", err)
		}
	}
	if opts.Registerer != nil {
		opts.Registerer.MustRegister(newStateFailures(&a.metrics.ckptFailures, a.ledger))
	}
	a.restore(opts.Restored)
	if opts.CDI != nil {
		// A claim unprepared while no agent ran leaves its spec behind.
		removed, err := opts.CDI.RemoveStaleClaims(func(uid string) bool { return a.ledger.HasClaim(types.UID(uid)) })
		if err != nil {
			a.log.Warn("stale CDI claim specs not all removed", "error", err)
		}
		if len(removed) > 0 {
			a.log.Info("stale CDI claim specs removed", "specs", removed)
		}
	}
	// Until a config applies, the built-in default is both what is selected
	// and the last config that fitted: a config that is rejected, selects
	// nothing or does not fit on the first start then leaves the node
	// serving whole GPUs (and existing MIG devices), never nothing.
	a.selected = builtInSelection(a.parseOptions())
	a.lastGood = a.selected
	if !opts.WaitForConfig {
		a.file = config.BuiltIn(a.parseOptions())
		a.selectConfig()
	}
	a.status.Store(&Status{Node: opts.NodeName})
	return a
}

// Ledger is the agent's record of who has each device; the device
// plugin's Allocate goes through it (Ledger.Allocate).
func (a *Agent) Ledger() *ledger.Ledger { return a.ledger }

// Inbox is where producers post events for this agent.
func (a *Agent) Inbox() *Inbox { return a.inbox }

// Run loops until ctx is done: each wake-up drains the inbox and handles the
// batch (Step); a ticker posts Tick every ResyncInterval.
func (a *Agent) Run(ctx context.Context) error {
	if a.opts.Observer == nil || a.opts.Publisher == nil {
		return errors.New("agent: Observer and Publisher are required")
	}
	a.ctx = ctx
	a.inbox.Post(Tick{}) // the first pass: read the GPUs, serve the default config
	tick := time.NewTicker(a.opts.ResyncInterval)
	defer tick.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-tick.C:
			a.inbox.Post(Tick{})
		case <-a.inbox.Wake():
			a.Step(a.inbox.Drain())
		}
	}
}

// Catalog returns the catalog last published (nil before the first); safe
// from any goroutine.
func (a *Agent) Catalog() *catalog.Catalog { return a.catalog.Load() }

// Status returns the latest published status; safe from any goroutine.
func (a *Agent) Status() *Status { return a.status.Load() }

// PlanPasses counts Plan calls since start; safe from any goroutine.
func (a *Agent) PlanPasses() int64 { return a.passes.Load() }

// Alive reports whether the loop turned recently (liveness): a loop stuck
// in NVML for several resync periods is dead to the kubelet too.
func (a *Agent) Alive() bool {
	s := a.status.Load()
	if s.LastLoop.IsZero() {
		return true // still starting; readiness covers that
	}
	return a.now().Sub(s.LastLoop) < 4*a.opts.ResyncInterval
}

// scorerCache ranks GPU sets for GetPreferredAllocation: built once per
// inventory and policy, never per request.
type scorerCache struct {
	inv   *gpu.Inventory
	byPol map[topology.Policy]*topology.Scorer
}

func (c *scorerCache) get(inv *gpu.Inventory) func(topology.Policy) *topology.Scorer {
	if inv == nil {
		return nil
	}
	if c.inv != inv {
		c.inv, c.byPol = inv, map[topology.Policy]*topology.Scorer{}
	}
	return func(p topology.Policy) *topology.Scorer {
		if s, ok := c.byPol[p]; ok {
			return s
		}
		s := topology.FromInventory(inv, p)
		c.byPol[p] = s
		return s
	}
}
