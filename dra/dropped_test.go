package dra

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"reflect"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	drahealth "k8s.io/kubelet/pkg/apis/dra-health/v1alpha1"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel/devicemodeltest"
)

// fakeSlices records what the driver hands the ResourceSlice controller.
type fakeSlices struct {
	res []resourceslice.DriverResources
}

func (f *fakeSlices) Update(res *resourceslice.DriverResources) { f.res = append(f.res, *res) }
func (f *fakeSlices) Stop()                                     {}

// logRecords keeps the driver's log records.
type logRecords struct {
	mu      sync.Mutex
	records []slog.Record
}

func (l *logRecords) Enabled(context.Context, slog.Level) bool { return true }
func (l *logRecords) Handle(_ context.Context, r slog.Record) error {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.records = append(l.records, r)
	return nil
}
func (l *logRecords) WithAttrs([]slog.Attr) slog.Handler { return l }
func (l *logRecords) WithGroup(string) slog.Handler      { return l }

// at lists the messages logged at level.
func (l *logRecords) at(level slog.Level) []string {
	l.mu.Lock()
	defer l.mu.Unlock()
	var out []string
	for _, r := range l.records {
		if r.Level == level {
			out = append(out, r.Message)
		}
	}
	return out
}

// The API server's dropped fields reach the driver as the helper's
// controller reports them (a DroppedFieldsError of the slice it wanted and
// the one stored); the driver latches what they mean and publishes again.
func TestHandleDroppedFields(t *testing.T) {
	pool := devicemodeltest.MixedPool(t)
	// Strips of a stored slice, each as an API server without the feature.
	noTaints := func(s *resourceapi.ResourceSliceSpec) {
		for i := range s.Devices {
			s.Devices[i].Taints = nil
		}
	}
	noCounters := func(s *resourceapi.ResourceSliceSpec) { s.SharedCounters = nil }
	noConsumption := func(s *resourceapi.ResourceSliceSpec) {
		for i := range s.Devices {
			s.Devices[i].ConsumesCounters = nil
		}
	}
	noSharing := func(s *resourceapi.ResourceSliceSpec) {
		for i := range s.Devices {
			s.Devices[i].AllowMultipleAllocations = nil
		}
	}
	tests := []struct {
		name string
		// counters: the error is about the counter slice, else the device slice.
		counters bool
		strip    []func(*resourceapi.ResourceSliceSpec)
		// bindingConditions: the driver wanted binding conditions the API
		// server dropped (a feature this driver never uses).
		bindingConditions bool
		wrap              bool
		want              devicemodel.Dropped
		// warned: the features named in Warn records; failed: an Error record.
		warned []string
		failed bool
	}{
		{name: "taints", strip: []func(*resourceapi.ResourceSliceSpec){noTaints}, want: devicemodel.Dropped{Taints: true}, warned: []string{"DRADeviceTaints"}},
		{name: "shared counters", counters: true, strip: []func(*resourceapi.ResourceSliceSpec){noCounters},
			want: devicemodel.Dropped{Partitions: true}, warned: []string{"DRAPartitionableDevices"}},
		{name: "consumed counters", strip: []func(*resourceapi.ResourceSliceSpec){noConsumption},
			want: devicemodel.Dropped{Partitions: true}, warned: []string{"DRAPartitionableDevices"}},
		{name: "multiple allocations", strip: []func(*resourceapi.ResourceSliceSpec){noSharing},
			want: devicemodel.Dropped{Sharing: true}, warned: []string{"DRAConsumableCapacity"}},
		{name: "taints and sharing at once, wrapped", strip: []func(*resourceapi.ResourceSliceSpec){noTaints, noSharing}, wrap: true,
			want: devicemodel.Dropped{Taints: true, Sharing: true}, warned: []string{"DRADeviceTaints", "DRAConsumableCapacity"}},
		{name: "a feature the driver does not know", bindingConditions: true, failed: true},
		{name: "no feature found", failed: true},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			logs := &logRecords{}
			fake := &fakeSlices{}
			d := New(Options{NodeName: "node-a", Logger: slog.New(logs)})
			d.controller = fake
			d.Publish(pool)
			if len(fake.res) != 1 {
				t.Fatalf("%d publishes, want 1", len(fake.res))
			}
			i := slices.IndexFunc(fake.res[0].Pools["node-a"].Slices, func(s resourceslice.Slice) bool {
				return (len(s.SharedCounters) > 0) == tt.counters
			})
			s := fake.res[0].Pools["node-a"].Slices[i]
			desired := (&resourceapi.ResourceSlice{Spec: resourceapi.ResourceSliceSpec{Driver: devicemodel.DriverName, Devices: s.Devices, SharedCounters: s.SharedCounters}}).DeepCopy()
			actual := desired.DeepCopy()
			if tt.bindingConditions {
				desired.Spec.Devices[0].BindingConditions = []string{"example.com/ready"}
			}
			for _, strip := range tt.strip {
				strip(&actual.Spec)
			}
			var err error = &resourceslice.DroppedFieldsError{PoolName: "node-a", SliceIndex: i, DesiredSlice: desired, ActualSlice: actual}
			if tt.wrap {
				err = fmt.Errorf("update slice: %w", err)
			}

			d.HandleError(context.Background(), err, "publish ResourceSlices")
			d.mu.Lock()
			latched := d.dropped
			d.mu.Unlock()
			if latched != tt.want {
				t.Errorf("dropped %+v, want %+v", latched, tt.want)
			}
			wantPublishes := 1
			if tt.want != (devicemodel.Dropped{}) {
				wantPublishes = 2
			}
			if len(fake.res) != wantPublishes {
				t.Fatalf("%d publishes, want %d", len(fake.res), wantPublishes)
			}
			check := func(when string, pool *devicemodel.Pool, res resourceslice.DriverResources) {
				t.Helper()
				got := devicemodeltest.Summarize(res, "node-a")
				for _, dev := range pool.Devices {
					if want := !tt.want.Withholds(dev); got.Has(dev.Name) != want {
						t.Errorf("%s: %s published %v, want %v", when, dev.Name, got.Has(dev.Name), want)
					}
				}
				if tt.want.Partitions && (got.CounterSets > 0 || got.Consuming > 0) {
					t.Errorf("%s: %d counter sets and %d devices consuming counters, want none", when, got.CounterSets, got.Consuming)
				}
			}
			check("next publish", pool, fake.res[len(fake.res)-1])
			warned := logs.at(slog.LevelWarn)
			if len(warned) != len(tt.warned) {
				t.Errorf("warnings %q, want one for each of %v", warned, tt.warned)
			}
			for _, f := range tt.warned {
				if !slices.ContainsFunc(warned, func(m string) bool { return strings.Contains(m, f) && strings.Contains(m, "left out") }) {
					t.Errorf("no warning names %s and what is left out: %q", f, warned)
				}
			}
			var onStatus []string
			for _, l := range d.Slices().LeftOut {
				if l.Devices == "" {
					t.Errorf("/status names %s with nothing left out", l.Feature)
				}
				onStatus = append(onStatus, l.Feature)
			}
			if !slices.Equal(onStatus, tt.warned) {
				t.Errorf("/status left out %v, want %v", onStatus, tt.warned)
			}
			if failed := len(logs.at(slog.LevelError)) > 0; failed != tt.failed {
				t.Errorf("error logged: %v, want %v (%q)", failed, tt.failed, logs.at(slog.LevelError))
			}

			// One way: the same report again changes nothing, and a new pool
			// is published without what was dropped.
			d.HandleError(context.Background(), err, "publish ResourceSlices")
			if len(fake.res) != wantPublishes {
				t.Errorf("the same report again: %d publishes, want %d", len(fake.res), wantPublishes)
			}
			next := &devicemodel.Pool{Devices: slices.Clone(pool.Devices), CounterSets: pool.CounterSets}
			next.Devices[slices.IndexFunc(next.Devices, func(d devicemodel.Device) bool { return d.Name == "gpu-2" })].Unhealthy = "XID 48"
			d.Publish(next)
			if len(fake.res) != wantPublishes+1 {
				t.Fatalf("a later pool: %d publishes, want %d", len(fake.res), wantPublishes+1)
			}
			check("a later pool", next, fake.res[len(fake.res)-1])
		})
	}
}

// Any other error of the helper is only logged.
func TestHandleOtherError(t *testing.T) {
	logs := &logRecords{}
	fake := &fakeSlices{}
	d := New(Options{NodeName: "node-a", Logger: slog.New(logs)})
	d.controller = fake
	d.Publish(&devicemodel.Pool{Devices: []devicemodel.Device{{Name: "gpu-0", Type: devicemodel.TypeGPU, UUID: "GPU-0", Unhealthy: "XID 79"}}})
	d.HandleError(context.Background(), errors.New("conflict"), "update ResourceSlice")
	if len(fake.res) != 1 || devicemodeltest.Summarize(fake.res[0], "node-a").Tainted != 1 {
		t.Errorf("publishes %d, want the first only, with its taint", len(fake.res))
	}
	if e := logs.at(slog.LevelError); len(e) != 1 || !strings.Contains(e[0], "update ResourceSlice") {
		t.Errorf("errors logged %q", e)
	}
}

// waitingSlices is a ResourceSlice controller whose start waits for
// release, as the real one waits for its informer to sync with the API
// server (forever while that cannot be reached).
type waitingSlices struct {
	calls   chan resourceslice.DriverResources // each start and update, as it begins
	release chan struct{}
}

func (w *waitingSlices) start(ctx context.Context, res resourceslice.DriverResources) (sliceController, error) {
	w.calls <- res
	select {
	case <-w.release:
		return w, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

func (w *waitingSlices) Update(res *resourceslice.DriverResources) { w.calls <- *res }
func (w *waitingSlices) Stop()                                     {}

// returns fails the test if fn has not returned within a minute: a call
// that waits on the API server would never return here.
func returns(t *testing.T, what string, fn func()) {
	t.Helper()
	done := make(chan struct{})
	go func() { defer close(done); fn() }()
	select {
	case <-done:
	case <-time.After(time.Minute):
		t.Fatalf("%s is still waiting for the first publish to reach the API server", what)
	}
}

// The first publish waits for the API server in the background: the
// agent's loop (Publish), the dropped-fields handler and the health stream
// go on meanwhile, and what changed is published once it is through.
func TestFirstPublishWaitsAlone(t *testing.T) {
	pool := devicemodeltest.MixedPool(t)
	w := &waitingSlices{calls: make(chan resourceslice.DriverResources, 8), release: make(chan struct{})}
	now := time.Date(2026, 11, 24, 12, 0, 0, 0, time.UTC)
	d := New(Options{NodeName: "node-a", Now: func() time.Time { return now }, SliceCheck: time.Hour})
	d.startController = w.start
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	d.startPublishing(ctx)
	// Nothing before the loop's first pool: an empty one would withdraw
	// the previous agent's slices until then.
	returns(t, "Publish", func() { d.Publish(pool) })
	if first := devicemodeltest.Summarize(<-w.calls, "node-a"); len(first.Devices) != len(pool.Devices) {
		t.Fatalf("first publish has %d devices, want the pool's %d", len(first.Devices), len(pool.Devices))
	}

	next := &devicemodel.Pool{Devices: slices.Clone(pool.Devices), CounterSets: pool.CounterSets}
	next.Devices[slices.IndexFunc(next.Devices, func(d devicemodel.Device) bool { return d.Name == "gpu-2" })].Unhealthy = "XID 48"
	returns(t, "Publish", func() { d.Publish(next) })
	returns(t, "HandleError", func() { d.HandleError(ctx, errors.New("conflict"), "update ResourceSlice") })
	var health *drahealth.NodeWatchResourcesResponse
	returns(t, "the health stream", func() { health = d.healthResponse() })
	if i := slices.IndexFunc(health.Devices, func(h *drahealth.DeviceHealth) bool { return h.Device.DeviceName == "gpu-2" }); i < 0 ||
		health.Devices[i].Health != drahealth.HealthStatus_UNHEALTHY {
		t.Errorf("health stream while the first publish waits: gpu-2 not unhealthy (%v)", health.Devices)
	}
	if got := d.Slices(); !reflect.DeepEqual(got, Slices{WaitingForAPI: now}) {
		t.Errorf("state while the first publish waits: %+v, want waiting since %v and nothing published", got, now)
	}

	close(w.release)
	if got, want := devicemodeltest.Summarize(<-w.calls, "node-a").Tainted, devicemodeltest.Summarize(devicemodel.Resources("node-a", next, 0, devicemodel.Dropped{}), "node-a").Tainted; got != want {
		t.Errorf("after the first publish: %d devices tainted, want the newer pool's %d", got, want)
	}
	if got := d.Slices(); !reflect.DeepEqual(got, Slices{Generation: 2, At: now}) {
		t.Errorf("state after the first publish and the one it owed: %+v, want generation 2, not waiting", got)
	}
	// From then on a publish is handed over at once, and an unchanged pool
	// is not handed over again.
	d.Publish(pool)
	d.Publish(pool)
	if n := len(w.calls); n != 1 {
		t.Errorf("%d publishes of a changed then an unchanged pool, want 1", n)
	}
}

// A first publish still waiting when the driver stops ends with it.
func TestStopEndsWaitingPublish(t *testing.T) {
	w := &waitingSlices{calls: make(chan resourceslice.DriverResources, 8), release: make(chan struct{})}
	logs := &logRecords{}
	d := New(Options{NodeName: "node-a", Logger: slog.New(logs), SliceCheck: time.Hour})
	d.startController = w.start
	ctx, cancel := context.WithCancel(context.Background())
	d.startPublishing(ctx)
	d.Publish(devicemodeltest.MixedPool(t))
	<-w.calls
	cancel() // what the agent's end does
	returns(t, "Stop", d.Stop)
	if e := logs.at(slog.LevelError); len(e) > 0 {
		t.Errorf("stopping logged errors: %q", e)
	}
}

// A driver stopped before the loop gave it a pool does not wait for one.
func TestStopBeforeAnyPool(t *testing.T) {
	w := &waitingSlices{calls: make(chan resourceslice.DriverResources, 8), release: make(chan struct{})}
	d := New(Options{NodeName: "node-a", SliceCheck: time.Hour})
	d.startController = w.start
	d.startPublishing(context.Background())
	returns(t, "Stop", d.Stop)
	if len(w.calls) != 0 {
		t.Errorf("%d publishes without a pool", len(w.calls))
	}
}
