package plugin

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/ledger"
)

// resource is one served resource name: the catalog entry it currently
// answers from and its registration state. It outlives the gRPC servers that
// serve it: a kubelet restart replaces the server, not the resource.
type resource struct {
	name   string
	socket string // file name in Dir, the Endpoint sent to the kubelet
	path   string
	log    *slog.Logger
	// onAllocate and admit are Options.OnAllocate and Options.Admit (nil:
	// none).
	onAllocate func(resource string, ids []string)
	admit      func(resource string, devices []Handout) error
	now        func() time.Time
	// Refused calls, for rate-limiting their log lines.
	allocRefusals, prefRefusals refusalLog

	mu      sync.Mutex
	cur     *catalog.Resource
	changed chan struct{} // closed and replaced whenever the device list changes
	// Registration state. gen counts (re)starts so that a registration
	// attempt begun for an earlier server cannot mark a later one registered.
	gen          uint64
	registered   bool
	registeredAt time.Time
	lastErr      string

	// Owned by the manager's Run goroutine.
	srv       *grpc.Server
	done      chan struct{} // closed when srv stops; ends its ListAndWatch streams
	cancelReg context.CancelFunc
	// yielded: another plugin registered this resource after us and the
	// catalog no longer has it; the server and the kubelet's stream stay
	// open, and silent (Manager.yield).
	yielded bool
}

func newResource(name, socket, path string, res *catalog.Resource, log *slog.Logger, now func() time.Time) *resource {
	return &resource{
		name: name, socket: socket, path: path, cur: res,
		changed: make(chan struct{}),
		log:     log.With("resource", name),
		now:     now,
	}
}

// refusalLogInterval is how often a resource logs refused calls of one kind
// after the first: the kubelet retries the containers of a refused pod, and
// a client flooding the socket must not flood the node's log with it.
const refusalLogInterval = 10 * time.Second

// refusalLog rate-limits the log lines of one kind of refused call.
type refusalLog struct {
	mu         sync.Mutex
	logged     bool      // a line was ever written
	last       time.Time // when the last line was written
	suppressed int       // refusals since then without a line
}

// admit reports whether a refusal at now gets a log line and, if so, how
// many refusals went without one since the previous line.
func (l *refusalLog) admit(now time.Time) (bool, int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.logged && now.Sub(l.last) < refusalLogInterval {
		l.suppressed++
		return false, 0
	}
	n := l.suppressed
	l.logged, l.last, l.suppressed = true, now, 0
	return true, n
}

// refused logs a refused call, at most once per refusalLogInterval for
// each l. The message is the status's alone: its code is an attribute.
func (r *resource) refused(l *refusalLog, msg string, err error, attrs ...any) {
	ok, suppressed := l.admit(r.now())
	if !ok {
		return
	}
	st := status.Convert(err)
	attrs = append(attrs, "code", st.Code().String(), "err", st.Message(), "suppressed", suppressed)
	r.log.Warn(msg, attrs...)
}

// snapshot returns the catalog entry to answer from and the channel that is
// closed when it next changes. Callers use it without holding the lock.
func (r *resource) snapshot() (*catalog.Resource, <-chan struct{}) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.cur, r.changed
}

// update replaces the catalog entry in place; open ListAndWatch streams are
// woken only when the kubelet-visible device list changed.
func (r *resource) update(res *catalog.Resource) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	same := catalog.SameDevices(r.cur, res)
	r.cur = res
	if !same {
		close(r.changed)
		r.changed = make(chan struct{})
	}
	return !same
}

// restarted starts a new registration generation and returns it.
func (r *resource) restarted(why string) uint64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.gen++
	r.registered = false
	r.lastErr = why
	return r.gen
}

func (r *resource) setRegistered(gen uint64, at time.Time) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	if gen != r.gen {
		return false
	}
	r.registered, r.registeredAt, r.lastErr = true, at, ""
	return true
}

func (r *resource) setError(gen uint64, msg string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if gen == r.gen {
		r.lastErr = msg
	}
}

func (r *resource) status() ResourceStatus {
	r.mu.Lock()
	defer r.mu.Unlock()
	st := ResourceStatus{
		Name: r.name, Socket: r.path,
		Registered: r.registered, RegisteredAt: r.registeredAt, LastError: r.lastErr,
	}
	st.Devices, st.Healthy = countDevices(r.cur)
	return st
}

func (r *resource) isRegistered() bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.registered
}

func countDevices(res *catalog.Resource) (devices, healthy int) {
	if res == nil {
		return 0, 0
	}
	for _, d := range res.Devices {
		if d.Healthy {
			healthy++
		}
	}
	return len(res.Devices), healthy
}

// endpoint is the DevicePluginServer of one gRPC server instance. done is
// that instance's, so streams of a stopped server end even if the kubelet
// keeps its side open.
type endpoint struct {
	pluginapi.UnimplementedDevicePluginServer
	r    *resource
	done <-chan struct{}
}

func (e *endpoint) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return pluginOptions(), nil
}

func pluginOptions() *pluginapi.DevicePluginOptions {
	return &pluginapi.DevicePluginOptions{PreStartRequired: false, GetPreferredAllocationAvailable: true}
}

func (e *endpoint) ListAndWatch(_ *pluginapi.Empty, s grpc.ServerStreamingServer[pluginapi.ListAndWatchResponse]) error {
	for {
		res, changed := e.r.snapshot()
		if err := s.Send(listResponse(res)); err != nil {
			e.r.log.Warn("ListAndWatch send failed", "err", err)
			return fmt.Errorf("resource %s: ListAndWatch send: %w", e.r.name, err)
		}
		select {
		case <-changed:
		case <-e.done:
			return nil
		case <-s.Context().Done():
			return nil
		}
	}
}

func listResponse(res *catalog.Resource) *pluginapi.ListAndWatchResponse {
	resp := &pluginapi.ListAndWatchResponse{Devices: make([]*pluginapi.Device, 0, len(res.Devices))}
	for _, d := range res.Devices {
		pd := &pluginapi.Device{ID: d.ID, Health: pluginapi.Healthy}
		if !d.Healthy {
			pd.Health = pluginapi.Unhealthy
		}
		// The kubelet's topology manager reads an absent Topology as "no
		// NUMA affinity"; a node ID of -1 would be taken literally.
		if d.NUMANode >= 0 {
			pd.Topology = &pluginapi.TopologyInfo{Nodes: []*pluginapi.NUMANode{{ID: int64(d.NUMANode)}}}
		}
		resp.Devices = append(resp.Devices, pd)
	}
	return resp
}

func (e *endpoint) GetPreferredAllocation(_ context.Context, req *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	res, _ := e.r.snapshot()
	resp := &pluginapi.PreferredAllocationResponse{}
	for i, creq := range req.GetContainerRequests() {
		ids, err := preferred(res, creq)
		if err != nil {
			err = inContainer(i, err)
			e.r.refused(&e.r.prefRefusals, "GetPreferredAllocation failed", err)
			return nil, err
		}
		resp.ContainerResponses = append(resp.ContainerResponses, &pluginapi.ContainerPreferredAllocationResponse{DeviceIDs: ids})
	}
	return resp, nil
}

func (e *endpoint) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	res, _ := e.r.snapshot()
	resp, err := allocate(res, req)
	if err == nil && e.r.admit != nil {
		err = admitted(e.r.admit(e.r.name, handouts(res, req)))
	}
	if err != nil {
		var ids []string
		total := 0
		for _, c := range req.GetContainerRequests() {
			total += len(c.GetDevicesIds())
			if len(ids) < maxListedIDs {
				ids = append(ids, c.GetDevicesIds()[:min(len(c.GetDevicesIds()), maxListedIDs-len(ids))]...)
			}
		}
		e.r.refused(&e.r.allocRefusals, "allocation refused", err,
			"containers", len(req.GetContainerRequests()), "requested", total, "devices", summarizeIDs(ids))
		return nil, err
	}
	// Debug: every allocation is already on record where it matters (the
	// agent's allocation log, the kubelet's checkpoint), and a log line
	// is a tenth of an Allocate's cost. Its arguments are built only when
	// it is written: Allocate is on the container start path.
	if e.r.log.Enabled(context.Background(), slog.LevelDebug) {
		ids := make([][]string, len(req.GetContainerRequests()))
		for i, c := range req.GetContainerRequests() {
			ids[i] = c.GetDevicesIds()
		}
		e.r.log.Debug("allocated", "devices", ids)
	}
	if e.r.onAllocate != nil {
		e.r.onAllocate(e.r.name, requestedIDs(req))
	}
	return resp, nil
}

// requestedIDs lists the device IDs of every container of req; the one
// container's list itself when there is one, as the kubelet asks.
func requestedIDs(req *pluginapi.AllocateRequest) []string {
	creqs := req.GetContainerRequests()
	if len(creqs) == 1 {
		return creqs[0].GetDevicesIds()
	}
	var all []string
	for _, c := range creqs {
		all = append(all, c.GetDevicesIds()...)
	}
	return all
}

// Handout is a device an Allocate hands out: a GPU or MIG UUID, whole or
// as a replica of a shared device (time-slicing, MPS). The kubelet counts
// device IDs, so one silicon offered under two names (a replica and the
// whole GPU, a MIG device and its GPU) could go to two containers that
// each believe they have it; Admit tells the two apart by this.
type Handout struct {
	UUID    string
	Replica bool
}

// handouts lists the distinct devices behind a request's IDs, which
// allocate found in res; replicas of one device name it once.
func handouts(res *catalog.Resource, req *pluginapi.AllocateRequest) []Handout {
	var out []Handout
	for _, c := range req.GetContainerRequests() {
		for _, id := range c.GetDevicesIds() {
			d, ok := res.Device(id)
			h := Handout{UUID: d.Spec.VisibleID, Replica: d.Replica}
			if ok && !slices.Contains(out, h) {
				out = append(out, h)
			}
		}
	}
	return out
}

// admitted turns Admit's error into the status Allocate answers: an
// allocation the ledger could not record may succeed when the kubelet tries
// again (Unavailable); any other refusal holds until the catalog changes
// (FailedPrecondition). The message, naming the device and why, is kept.
func admitted(err error) error {
	switch {
	case err == nil:
		return nil
	case errors.Is(err, ledger.ErrLogUnavailable):
		return status.Error(codes.Unavailable, err.Error())
	default:
		return status.Error(codes.FailedPrecondition, err.Error())
	}
}

func (e *endpoint) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}
