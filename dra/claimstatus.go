package dra

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"maps"
	"reflect"
	"sync"
	"time"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	metaapply "k8s.io/client-go/applyconfigurations/meta/v1"
	resourceapply "k8s.io/client-go/applyconfigurations/resource/v1"
	"k8s.io/client-go/kubernetes"
)

// ConditionReady is the condition each device's status carries: true while
// the device is prepared and healthy.
const ConditionReady = "Ready"

// Reasons of the Ready condition.
const (
	ReasonPrepared  = "Prepared"
	ReasonUnhealthy = "Unhealthy"
)

// ClaimStatus is what the driver reports of one prepared claim's devices
// in ResourceClaim.status.devices (KEP-4817).
type ClaimStatus struct {
	UID             types.UID
	Namespace, Name string
	Devices         []DeviceStatus
}

// DeviceStatus is one allocated device's state.
type DeviceStatus struct {
	Device string
	// ShareID is the allocation's share of a shared device: the API server
	// accepts an entry only for a device (and share) the claim was
	// allocated.
	ShareID types.UID
	// Unhealthy is why the device is not ready ("": it is).
	Unhealthy string
	// Data is what a user may want to know of the device (its UUID; for a
	// MIG device made for the claim its parent, profile and placement),
	// written as a JSON object.
	Data map[string]any
}

// ClaimStatusOptions configure a ClaimStatusWriter.
type ClaimStatusOptions struct {
	Client   kubernetes.Interface
	NodeName string
	// Now is the clock (nil: time.Now); Retry is how long to wait before
	// writing a claim again after the n-th failure in a row (nil: 1s
	// doubling up to 1m).
	Now   func() time.Time
	Retry func(n int) time.Duration
	// Timeout bounds one write (0: 20s): a request the API server or the
	// client's rate limiter holds up is given up and retried, so one
	// claim never stalls the others.
	Timeout time.Duration
	Logger  *slog.Logger
}

// ClaimStatusWriter writes the status of the node's prepared claims to the
// API server in the background, with server-side apply: its field manager,
// one per driver and node, owns exactly the entries it writes, which the
// API server requires of a driver (only the driver may change its devices'
// entries, and only on the node the claim is allocated to:
// resourceclaims/driver with the associated-node verbs). The loop hands it
// the statuses it wants (Set); it never blocks there. A write that fails is
// retried with back-off until the claim is gone or no longer allocated.
type ClaimStatusWriter struct {
	opts ClaimStatusOptions
	log  *slog.Logger
	kick chan struct{}

	mu   sync.Mutex
	want map[types.UID]ClaimStatus
	// written is what the API server has of each claim, as last applied;
	// since is when each device's Ready condition last changed.
	written map[types.UID]ClaimStatus
	since   map[deviceKey]readySince
	// failures counts each claim's failed writes in a row; retryAt is when
	// it may be tried again.
	failures map[types.UID]int
	retryAt  map[types.UID]time.Time
	// applied counts successful writes (for tests and logs).
	applied int
}

// readySince is a device's Ready status and when it took it.
type readySince struct {
	status metav1.ConditionStatus
	at     metav1.Time
}

type deviceKey struct {
	claim   types.UID
	device  string
	shareID types.UID
}

// NewClaimStatusWriter returns a writer; it writes nothing until Run.
func NewClaimStatusWriter(opts ClaimStatusOptions) *ClaimStatusWriter {
	if opts.Now == nil {
		opts.Now = time.Now
	}
	if opts.Retry == nil {
		opts.Retry = func(n int) time.Duration { return min(time.Second<<min(n-1, 6), time.Minute) }
	}
	if opts.Timeout <= 0 {
		opts.Timeout = 20 * time.Second
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
	}
	return &ClaimStatusWriter{opts: opts, log: opts.Logger, kick: make(chan struct{}, 1),
		want: map[types.UID]ClaimStatus{}, written: map[types.UID]ClaimStatus{}, since: map[deviceKey]readySince{},
		failures: map[types.UID]int{}, retryAt: map[types.UID]time.Time{}}
}

// FieldManager is the server-side apply field manager of this node's
// writes: one per driver and node, as KEP-4817 asks, so that the entries
// of two nodes (or drivers) of one claim never fight.
func (w *ClaimStatusWriter) FieldManager() string {
	return devicemodel.DriverName + "/" + w.opts.NodeName
}

// Set replaces the statuses wanted: one per prepared claim. A claim left
// out is no longer written (Unprepare: the claim is going or deallocated,
// and the API server clears what its devices had). Never blocks.
func (w *ClaimStatusWriter) Set(claims map[types.UID]ClaimStatus) {
	w.mu.Lock()
	w.want = maps.Clone(claims)
	for uid := range w.written {
		if _, ok := claims[uid]; !ok {
			delete(w.written, uid)
			delete(w.failures, uid)
			delete(w.retryAt, uid)
		}
	}
	for k := range w.since {
		if _, ok := claims[k.claim]; !ok {
			delete(w.since, k)
		}
	}
	w.mu.Unlock()
	select {
	case w.kick <- struct{}{}:
	default:
	}
}

// Applied counts the successful writes so far.
func (w *ClaimStatusWriter) Applied() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.applied
}

// Run writes what Set asks until ctx is done.
func (w *ClaimStatusWriter) Run(ctx context.Context) error {
	timer := time.NewTimer(time.Hour)
	defer timer.Stop()
	for {
		next := w.writeDue(ctx)
		if !timer.Stop() {
			select {
			case <-timer.C:
			default:
			}
		}
		if !next.IsZero() {
			timer.Reset(max(next.Sub(w.opts.Now()), 0))
		}
		select {
		case <-ctx.Done():
			return nil
		case <-w.kick:
		case <-timer.C:
		}
	}
}

// writeDue applies every claim whose wanted status differs from what was
// written and whose back-off is over; it returns when the next retry is
// due (zero: none waits).
func (w *ClaimStatusWriter) writeDue(ctx context.Context) time.Time {
	w.mu.Lock()
	var due []ClaimStatus
	now := w.opts.Now()
	for uid, c := range w.want {
		if last, ok := w.written[uid]; ok && reflect.DeepEqual(last, c) {
			continue
		}
		if at, ok := w.retryAt[uid]; ok && now.Before(at) {
			continue
		}
		due = append(due, c)
	}
	w.mu.Unlock()
	for _, c := range due {
		if ctx.Err() != nil {
			break
		}
		w.log.Debug("DRA: writing claim status", "claim", c.Namespace+"/"+c.Name, "uid", c.UID)
		err := w.apply(ctx, c)
		w.mu.Lock()
		if cur, ok := w.want[c.UID]; !ok || !reflect.DeepEqual(cur, c) {
			// Set changed it meanwhile: the next pass writes the new one.
			w.mu.Unlock()
			continue
		}
		switch {
		case err == nil:
			w.written[c.UID] = c
			w.applied++
			w.log.Info("DRA: claim status written", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "devices", len(c.Devices))
			delete(w.failures, c.UID)
			delete(w.retryAt, c.UID)
		case apierrors.IsNotFound(err) || apierrors.IsInvalid(err) || apierrors.IsConflict(err):
			// The claim is gone, was recreated, or its allocation no
			// longer names these devices: nothing to retry. Written
			// as it is, so that only a change of the status tries again.
			w.log.Info("DRA: claim status not written; the claim changed under it", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "err", err)
			w.written[c.UID] = c
		default:
			w.failures[c.UID]++
			n := w.failures[c.UID]
			w.retryAt[c.UID] = w.opts.Now().Add(w.opts.Retry(n))
			if n == 1 {
				w.log.Warn("DRA: claim status not written; retrying", "claim", c.Namespace+"/"+c.Name, "uid", c.UID, "err", err)
			}
		}
		w.mu.Unlock()
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	var next time.Time
	for uid, at := range w.retryAt {
		if _, ok := w.want[uid]; ok && (next.IsZero() || at.Before(next)) {
			next = at
		}
	}
	return next
}

// apply writes c's device entries, and only those, as this node's field
// manager.
func (w *ClaimStatusWriter) apply(ctx context.Context, c ClaimStatus) error {
	cfg, err := w.applyConfig(c)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(ctx, w.opts.Timeout)
	defer cancel()
	_, err = w.opts.Client.ResourceV1().ResourceClaims(c.Namespace).ApplyStatus(ctx, cfg,
		metav1.ApplyOptions{FieldManager: w.FieldManager(), Force: true})
	if err != nil {
		return fmt.Errorf("claim %s/%s: apply status.devices: %w", c.Namespace, c.Name, err)
	}
	return nil
}

// applyConfig is c as a server-side apply request. The UID makes the API
// server refuse a write to a claim of the same name made since.
func (w *ClaimStatusWriter) applyConfig(c ClaimStatus) (*resourceapply.ResourceClaimApplyConfiguration, error) {
	st := resourceapply.ResourceClaimStatus()
	for _, d := range c.Devices {
		ready, reason, msg := metav1.ConditionTrue, ReasonPrepared, "prepared on node "+w.opts.NodeName
		if d.Unhealthy != "" {
			ready, reason, msg = metav1.ConditionFalse, ReasonUnhealthy, d.Unhealthy
		}
		key := deviceKey{c.UID, d.Device, d.ShareID}
		w.mu.Lock()
		since, ok := w.since[key]
		if !ok || since.status != ready {
			// The condition's lastTransitionTime: kept while the status
			// stays, whatever else is written again.
			since = readySince{ready, metav1.NewTime(w.opts.Now().UTC().Truncate(time.Second))}
			w.since[key] = since
		}
		w.mu.Unlock()
		ds := resourceapply.AllocatedDeviceStatus().WithDriver(devicemodel.DriverName).WithPool(w.opts.NodeName).WithDevice(d.Device).
			WithConditions(metaapply.Condition().WithType(ConditionReady).WithStatus(ready).WithReason(reason).
				WithMessage(msg).WithLastTransitionTime(since.at))
		if d.ShareID != "" {
			ds = ds.WithShareID(string(d.ShareID))
		}
		if len(d.Data) > 0 {
			raw, err := json.Marshal(d.Data)
			if err != nil {
				return nil, fmt.Errorf("claim %s/%s: device %s: data: %w", c.Namespace, c.Name, d.Device, err)
			}
			ds = ds.WithData(runtime.RawExtension{Raw: raw})
		}
		st = st.WithDevices(ds)
	}
	return resourceapply.ResourceClaim(c.Name, c.Namespace).WithUID(c.UID).WithStatus(st), nil
}
