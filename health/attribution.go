package health

import (
	"cmp"
	"context"
	"fmt"
	"log/slog"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"
)

// Holder is a container that holds a device (or a replica of it).
type Holder struct {
	Namespace string
	Pod       string
	Container string
}

func (h Holder) compare(o Holder) int {
	return cmp.Or(cmp.Compare(h.Namespace, o.Namespace), cmp.Compare(h.Pod, o.Pod), cmp.Compare(h.Container, o.Container))
}

// Attribution says which containers hold which devices; immutable. Device
// IDs are what the kubelet allocated: GPU or MIG UUIDs and replica IDs
// ("<uuid>::<n>"), which count for their device.
type Attribution struct {
	holders map[string][]Holder // by device UUID, sorted, distinct
	held    map[string]int      // by device UUID: distinct IDs (replicas) held
	byRes   map[string]map[Holder]int
	ids     map[string]map[string]Holder // resource → device ID as allocated → first holder
	// dra are the devices containers hold through DRA claims. They are
	// for metrics only: the ledger learns of claims from Prepare, so Same,
	// Holders and Held leave them out.
	dra []DRAHold
}

// DRAHold is one device a container holds through a DRA claim, as the
// kubelet lists it: the claim, and the driver, pool and device of one of
// its allocation results.
type DRAHold struct {
	Holder
	ClaimNamespace, ClaimName string
	Driver, Pool, Device      string
}

func (d DRAHold) compare(o DRAHold) int {
	return cmp.Or(d.Holder.compare(o.Holder), cmp.Compare(d.ClaimNamespace, o.ClaimNamespace), cmp.Compare(d.ClaimName, o.ClaimName),
		cmp.Compare(d.Driver, o.Driver), cmp.Compare(d.Pool, o.Pool), cmp.Compare(d.Device, o.Device))
}

// NewAttribution indexes a pod-resources List answer. Resources other than
// those accepted by keep (nil: all) are left out.
func NewAttribution(pods []*podresourcesv1.PodResources, keep func(resource string) bool) *Attribution {
	a := &Attribution{holders: map[string][]Holder{}, held: map[string]int{}, byRes: map[string]map[Holder]int{},
		ids: map[string]map[string]Holder{}}
	seen := map[string]bool{}
	for _, p := range pods {
		for _, c := range p.GetContainers() {
			h := Holder{Namespace: p.GetNamespace(), Pod: p.GetName(), Container: c.GetName()}
			for _, dr := range c.GetDynamicResources() {
				for _, r := range dr.GetClaimResources() {
					a.dra = append(a.dra, DRAHold{Holder: h, ClaimNamespace: dr.GetClaimNamespace(), ClaimName: dr.GetClaimName(),
						Driver: r.GetDriverName(), Pool: r.GetPoolName(), Device: r.GetDeviceName()})
				}
			}
			for _, d := range c.GetDevices() {
				res := d.GetResourceName()
				if keep != nil && !keep(res) {
					continue
				}
				for _, id := range d.GetDeviceIds() {
					if a.ids[res] == nil {
						a.ids[res] = map[string]Holder{}
					}
					if _, ok := a.ids[res][id]; !ok {
						a.ids[res][id] = h
					}
					uuid, _, _ := strings.Cut(id, "::")
					if !slices.Contains(a.holders[uuid], h) {
						a.holders[uuid] = append(a.holders[uuid], h)
					}
					if !seen[id] {
						seen[id] = true
						a.held[uuid]++
					}
					if a.byRes[res] == nil {
						a.byRes[res] = map[Holder]int{}
					}
					a.byRes[res][h]++
				}
			}
		}
	}
	for _, hs := range a.holders {
		slices.SortFunc(hs, Holder.compare)
	}
	// A device two requests of one claim share is listed twice.
	slices.SortFunc(a.dra, DRAHold.compare)
	a.dra = slices.Compact(a.dra)
	return a
}

// DRAHolds lists the devices containers hold through DRA claims, of every
// driver, sorted; the caller picks its own driver and pool.
func (a *Attribution) DRAHolds() []DRAHold {
	if a == nil {
		return nil
	}
	return a.dra
}

// Same reports whether a and b attribute the same device IDs to the same
// containers.
func (a *Attribution) Same(b *Attribution) bool {
	if a == nil || b == nil {
		return a == b
	}
	return maps.EqualFunc(a.ids, b.ids, func(x, y map[string]Holder) bool { return maps.Equal(x, y) })
}

// HeldIDs returns the device IDs of resource that containers hold, exactly
// as the kubelet allocated them (replica IDs included), each with a holder.
func (a *Attribution) HeldIDs(resource string) map[string]Holder {
	if a == nil {
		return nil
	}
	return a.ids[resource]
}

// Resources lists the resources a container holds devices of, in order.
func (a *Attribution) Resources() []string {
	if a == nil {
		return nil
	}
	return slices.Sorted(maps.Keys(a.ids))
}

// String names the holder as "namespace/pod (container)".
func (h Holder) String() string { return h.Namespace + "/" + h.Pod + " (" + h.Container + ")" }

// Holders returns the containers holding the device or any of its replicas,
// sorted; nil when none (or a is nil).
func (a *Attribution) Holders(uuid string) []Holder {
	if a == nil {
		return nil
	}
	return a.holders[uuid]
}

// Held returns how many distinct IDs of the device (replicas, or 1 for the
// device itself) are allocated.
func (a *Attribution) Held(uuid string) int {
	if a == nil {
		return 0
	}
	return a.held[uuid]
}

// Allocation is how many device IDs of one resource a container holds.
type Allocation struct {
	Resource string
	Holder   Holder
	Devices  int
}

// Allocations lists every container's holdings, by resource then holder.
func (a *Attribution) Allocations() []Allocation {
	if a == nil {
		return nil
	}
	var out []Allocation
	for res, hs := range a.byRes {
		for h, n := range hs {
			out = append(out, Allocation{Resource: res, Holder: h, Devices: n})
		}
	}
	slices.SortFunc(out, func(x, y Allocation) int {
		return cmp.Or(cmp.Compare(x.Resource, y.Resource), x.Holder.compare(y.Holder))
	})
	return out
}

// IsGPUResource accepts NVIDIA's resource names and renamed shared ones
// ("nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/gpu.shared").
func IsGPUResource(name string) bool { return strings.HasPrefix(name, "nvidia.com/") }

// PodResourcesOptions tune a PodResources.
type PodResourcesOptions struct {
	// Socket is the kubelet's pod-resources socket path (a relative one is
	// taken from the working directory).
	Socket string
	// MinInterval is the least time between two background List calls,
	// however often Invalidate is called (default 2s).
	MinInterval time.Duration
	// MaxAge refreshes the cache even without Invalidate, to see pods that
	// ended (default 30s).
	MaxAge time.Duration
	// Timeout bounds one List call (default 5s).
	Timeout time.Duration
	// Keep selects the resources attributed (nil: IsGPUResource).
	Keep func(resource string) bool
	// OnChange gets each background answer that differs from the last one
	// (not Refresh's: its caller has the answer). It must not block.
	OnChange func(*Attribution)
	Logger   *slog.Logger
}

// PodResources keeps an Attribution from the kubelet's pod-resources API
// fresh: one connection, a List after each Invalidate (rate limited) and
// every MaxAge. Scrapes read the cache; they never dial the kubelet. Run's
// goroutine is the only one that talks to the kubelet and writes the cache:
// Refresh hands it a request and waits for the answer.
type PodResources struct {
	opts     PodResourcesOptions
	log      *slog.Logger
	cur      atomic.Pointer[Attribution]
	kick     chan struct{}
	requests chan chan refreshResult
	lists    atomic.Int64
}

type refreshResult struct {
	att *Attribution
	err error
}

// NewPodResources returns an attribution source; it lists nothing until Run.
func NewPodResources(opts PodResourcesOptions) *PodResources {
	if opts.MinInterval <= 0 {
		opts.MinInterval = 2 * time.Second
	}
	if opts.MaxAge <= 0 {
		opts.MaxAge = 30 * time.Second
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 5 * time.Second
	}
	if opts.Keep == nil {
		opts.Keep = IsGPUResource
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	if abs, err := filepath.Abs(opts.Socket); err == nil {
		// gRPC reads "unix://relative/path" as an authority and refuses it.
		opts.Socket = abs
	}
	p := &PodResources{opts: opts, log: opts.Logger, kick: make(chan struct{}, 1), requests: make(chan chan refreshResult)}
	p.cur.Store(NewAttribution(nil, nil))
	return p
}

// Refresh asks the kubelet now, bypassing the cache's rate limit, and
// returns the answer (also cached). It is for decisions that destroy what a
// pod may hold (MIG repartitioning), not for scrapes. It fails when Run is
// not running or the kubelet does not answer within Timeout.
func (p *PodResources) Refresh(ctx context.Context) (*Attribution, error) {
	ctx, cancel := context.WithTimeout(ctx, p.opts.Timeout+time.Second)
	defer cancel()
	reply := make(chan refreshResult, 1)
	select {
	case p.requests <- reply:
	case <-ctx.Done():
		return nil, fmt.Errorf("pod-resources %s: no answer: %w", p.opts.Socket, ctx.Err())
	}
	select {
	case r := <-reply:
		return r.att, r.err
	case <-ctx.Done():
		return nil, fmt.Errorf("pod-resources %s: no answer: %w", p.opts.Socket, ctx.Err())
	}
}

// Attribution returns the cached attribution; safe from any goroutine.
func (p *PodResources) Attribution() *Attribution { return p.cur.Load() }

// Invalidate asks for a refresh: call it after an Allocate, when the
// kubelet's answer is about to change.
func (p *PodResources) Invalidate() {
	select {
	case p.kick <- struct{}{}:
	default:
	}
}

// Lists returns how many List calls were made (for tests and /status).
func (p *PodResources) Lists() int64 { return p.lists.Load() }

// Run refreshes the cache and answers Refresh until ctx is done.
func (p *PodResources) Run(ctx context.Context) error {
	conn, err := grpc.NewClient("unix://"+p.opts.Socket,
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(16<<20)))
	if err != nil {
		return fmt.Errorf("pod-resources %s: %w", p.opts.Socket, err)
	}
	defer conn.Close()
	client := podresourcesv1.NewPodResourcesListerClient(conn)
	var lastErr string
	list := func() (*Attribution, error) {
		lctx, cancel := context.WithTimeout(ctx, p.opts.Timeout)
		defer cancel()
		resp, err := client.List(lctx, &podresourcesv1.ListPodResourcesRequest{})
		p.lists.Add(1)
		if err != nil {
			if msg := err.Error(); msg != lastErr && ctx.Err() == nil {
				// Keep the last answer: pods rarely all vanish, and metrics
				// without their pods are worse than slightly stale ones.
				p.log.Warn("pod-resources List failed; keeping the last attribution", "socket", p.opts.Socket, "error", err)
				lastErr = msg
			}
			return nil, fmt.Errorf("pod-resources %s: List: %w", p.opts.Socket, err)
		}
		if lastErr != "" {
			p.log.Info("pod-resources List works again", "socket", p.opts.Socket)
			lastErr = ""
		}
		a := NewAttribution(resp.GetPodResources(), p.opts.Keep)
		p.cur.Store(a)
		return a, nil
	}
	age := time.NewTimer(0)
	defer age.Stop()
	limit := time.NewTimer(0)
	defer limit.Stop()
	limited := false // an Invalidate waits in kick until limit fires
	for {
		kick := p.kick
		if limited {
			kick = nil
		}
		select {
		case <-ctx.Done():
			return nil
		case reply := <-p.requests:
			a, err := list()
			reply <- refreshResult{att: a, err: err}
			continue
		case <-limit.C:
			limited = false
			continue
		case <-kick:
		case <-age.C:
		}
		before := p.cur.Load()
		if a, err := list(); err == nil && p.opts.OnChange != nil && !a.Same(before) {
			p.opts.OnChange(a)
		}
		limited = true
		limit.Reset(p.opts.MinInterval)
		age.Reset(p.opts.MaxAge)
	}
}
