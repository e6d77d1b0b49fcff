package dra

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/dra/devicemodel/devicemodeltest"
	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	clienttesting "k8s.io/client-go/testing"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"

	apiruntime "k8s.io/apimachinery/pkg/runtime"
)

// apiSlice is a slice of node-a's pool as the controller writes it.
func apiSlice(name string, gen int64, owner types.UID, devices []string, sets ...string) resourceapi.ResourceSlice {
	s := resourceapi.ResourceSlice{
		ObjectMeta: metav1.ObjectMeta{Name: name, UID: types.UID(name)},
		Spec: resourceapi.ResourceSliceSpec{Driver: devicemodel.DriverName, NodeName: ptr.To("node-a"),
			Pool: resourceapi.ResourcePool{Name: "node-a", Generation: gen}},
	}
	if owner != "" {
		s.OwnerReferences = []metav1.OwnerReference{{APIVersion: "v1", Kind: "Node", Name: "node-a", UID: owner, Controller: ptr.To(true)}}
	}
	for _, d := range devices {
		s.Spec.Devices = append(s.Spec.Devices, resourceapi.Device{Name: d})
	}
	for _, cs := range sets {
		s.Spec.SharedCounters = append(s.Spec.SharedCounters, resourceapi.CounterSet{Name: cs})
	}
	return s
}

func TestNotOurs(t *testing.T) {
	handed := resourceslice.Pool{Slices: []resourceslice.Slice{
		{SharedCounters: []resourceapi.CounterSet{{Name: "gpu-3-counters"}}},
		{Devices: []resourceapi.Device{{Name: "gpu-0"}, {Name: "gpu-1"}}},
	}}
	counters := apiSlice("0-counters", 4, "uid-1", nil, "gpu-3-counters")
	devices := apiSlice("1-devices", 4, "uid-1", []string{"gpu-0", "gpu-1"})
	tests := []struct {
		name    string
		api     []resourceapi.ResourceSlice
		nodeUID types.UID
		// want: substrings of the answer, in order ("" alone: ours).
		want    []string
		foreign int
	}{
		{name: "the same", api: []resourceapi.ResourceSlice{counters, devices}, nodeUID: "uid-1"},
		{name: "the same, the Node unknown", api: []resourceapi.ResourceSlice{counters, devices}},
		{name: "an obsolete slice beside them", nodeUID: "uid-1",
			api: []resourceapi.ResourceSlice{counters, devices, apiSlice("old", 3, "uid-1", []string{"gpu-9"})}},
		{name: "none", nodeUID: "uid-1",
			want: []string{"the API server has 0 of the 2 ResourceSlices published", "3 published not in them (counter set gpu-3-counters, gpu-0, gpu-1)"}},
		{name: "one missing", api: []resourceapi.ResourceSlice{devices}, nodeUID: "uid-1",
			want: []string{"has 1 of the 2", "1 published not in them (counter set gpu-3-counters)"}},
		{name: "a device missing, another not published", nodeUID: "uid-1",
			api:  []resourceapi.ResourceSlice{counters, apiSlice("1-devices", 4, "uid-1", []string{"gpu-0", "gpu-7"})},
			want: []string{"1 published not in them (gpu-1)", "1 in them not published (device gpu-7)"}},
		{name: "owned by a Node gone", api: []resourceapi.ResourceSlice{counters, devices}, nodeUID: "uid-2", foreign: 2,
			want: []string{`ResourceSlice 0-counters is owned by Node UID "uid-1", the Node's is uid-2`, "has 0 of the 2"}},
		{name: "owned by none", api: []resourceapi.ResourceSlice{counters, apiSlice("1-devices", 4, "", []string{"gpu-0", "gpu-1"})},
			nodeUID: "uid-1", foreign: 1, want: []string{`ResourceSlice 1-devices is owned by Node UID ""`}},
		{name: "another driver's and another node's slices do not count", nodeUID: "uid-1",
			api: []resourceapi.ResourceSlice{counters, devices, func() resourceapi.ResourceSlice {
				s := apiSlice("nic", 9, "uid-1", []string{"eth0"})
				s.Spec.Driver = "net.example.com"
				return s
			}(), func() resourceapi.ResourceSlice {
				s := apiSlice("other", 9, "uid-9", []string{"gpu-5"})
				s.Spec.NodeName = ptr.To("node-b")
				return s
			}()}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			why, foreign := notOurs("node-a", handed, tt.api, tt.nodeUID)
			if len(tt.want) == 0 && why != "" {
				t.Errorf("not ours: %q; want ours", why)
			}
			rest := why
			for _, w := range tt.want {
				i := strings.Index(rest, w)
				if i < 0 {
					t.Errorf("%q: no %q (in order)", why, w)
					break
				}
				rest = rest[i+len(w):]
			}
			if len(foreign) != tt.foreign {
				t.Errorf("%d foreign slices, want %d", len(foreign), tt.foreign)
			}
		})
	}
}

// fakeAPI is a fake clientset whose ResourceSlice watches see nothing: an
// informer learns what its first list gave it and nothing after, as one
// whose API server lost its data (etcd wiped, or restored from a backup)
// learns nothing of the loss. It names created slices (the fake does not
// do generateName) and reports each create and delete.
type fakeAPI struct {
	*fake.Clientset
	created, deleted chan *resourceapi.ResourceSlice
	mu               sync.Mutex
	n                int
}

func newFakeAPI(nodeUID types.UID) *fakeAPI {
	f := &fakeAPI{Clientset: fake.NewClientset(&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", UID: nodeUID}}),
		created: make(chan *resourceapi.ResourceSlice, 256), deleted: make(chan *resourceapi.ResourceSlice, 256)}
	f.PrependWatchReactor("resourceslices", func(clienttesting.Action) (bool, watch.Interface, error) {
		return true, watch.NewFake(), nil
	})
	f.PrependReactor("create", "resourceslices", func(a clienttesting.Action) (bool, apiruntime.Object, error) {
		s := a.(clienttesting.CreateAction).GetObject().(*resourceapi.ResourceSlice)
		f.mu.Lock()
		f.n++
		s.Name = fmt.Sprintf("%s%d", s.GenerateName, f.n)
		f.mu.Unlock()
		s.UID = types.UID(s.Name)
		f.created <- s.DeepCopy()
		return false, nil, nil // the tracker stores it
	})
	f.PrependReactor("delete", "resourceslices", func(a clienttesting.Action) (bool, apiruntime.Object, error) {
		f.deleted <- &resourceapi.ResourceSlice{ObjectMeta: metav1.ObjectMeta{Name: a.(clienttesting.DeleteAction).GetName()}}
		return false, nil, nil
	})
	return f
}

// take waits for n slices on ch; the deadline only bounds a broken test.
func take(t *testing.T, what string, ch chan *resourceapi.ResourceSlice, n int) []*resourceapi.ResourceSlice {
	t.Helper()
	var out []*resourceapi.ResourceSlice
	timeout := time.After(time.Minute)
	for len(out) < n {
		select {
		case s := <-ch:
			out = append(out, s)
		case <-timeout:
			t.Fatalf("%d slices %s, want %d", len(out), what, n)
		}
	}
	return out
}

// publishing waits until a controller runs (its informer synced).
func publishing(t *testing.T, d *Driver) {
	t.Helper()
	deadline := time.Now().Add(time.Minute)
	for {
		d.mu.Lock()
		running := d.controller != nil
		d.mu.Unlock()
		if running {
			return
		}
		if time.Now().After(deadline) {
			t.Fatal("publishing did not start")
		}
		runtime.Gosched()
	}
}

// Slices the API server lost behind the controller's back (its watch saw
// nothing) are published again, owned by the Node as it is now, after two
// checks that found them not ours; /status says so meanwhile. Slices of a
// Node recreated under the same name are replaced.
func TestRepublishWhatTheAPIServerLost(t *testing.T) {
	tests := []struct {
		name string
		// lose: the slices are gone; recreate: the Node is deleted and
		// created again (another UID).
		lose, recreate bool
		want           string
	}{
		{name: "nothing lost"},
		{name: "slices lost", lose: true, want: "the API server has 0 of the"},
		{name: "slices lost and the Node recreated", lose: true, recreate: true, want: "the API server has 0 of the"},
		{name: "the Node recreated", recreate: true, want: `owned by Node UID "uid-1", the Node's is uid-2`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ctx, cancel := context.WithCancel(context.Background())
			defer cancel()
			api := newFakeAPI("uid-1")
			now := time.Date(2026, 11, 25, 12, 0, 0, 0, time.UTC)
			d := New(Options{NodeName: "node-a", Client: api, SliceCheck: -1, Now: func() time.Time { return now }})
			defer d.Stop()
			n := publishMixedPool(ctx, t, api, d)
			if err := d.CheckSlices(ctx); err != nil {
				t.Fatal(err)
			}
			if s := d.Slices(); s.Checked != now || s.NotOurs != "" || s.CheckError != "" {
				t.Fatalf("after the first publish: %+v, want checked and ours", s)
			}

			if tt.lose {
				list, err := api.ResourceV1().ResourceSlices().List(ctx, metav1.ListOptions{})
				if err != nil {
					t.Fatal(err)
				}
				for _, s := range list.Items {
					if err := api.ResourceV1().ResourceSlices().Delete(ctx, s.Name, metav1.DeleteOptions{}); err != nil {
						t.Fatal(err)
					}
				}
				take(t, "deleted by the test", api.deleted, n)
			}
			if tt.recreate {
				recreateNode(ctx, t, api, "uid-2")
			}
			for check := 1; check <= 2; check++ {
				if err := d.CheckSlices(ctx); err != nil {
					t.Fatal(err)
				}
				s := d.Slices()
				if !strings.Contains(s.NotOurs, tt.want) || (tt.want == "") != (s.NotOurs == "") {
					t.Errorf("check %d: not ours %q, want %q", check, s.NotOurs, tt.want)
				}
				if wantRestarts := 0; tt.want != "" && check == 2 {
					wantRestarts = 1
					if s.Restarts != wantRestarts || s.NotOursSince != now {
						t.Errorf("check %d: %d restarts, not ours since %v; want %d, since %v", check, s.Restarts, s.NotOursSince, wantRestarts, now)
					}
				} else if s.Restarts != wantRestarts {
					t.Errorf("check %d: %d restarts, want %d", check, s.Restarts, wantRestarts)
				}
			}
			if tt.want == "" {
				return
			}

			if tt.recreate && !tt.lose {
				// The old Node's slices go first: a new controller would
				// only update them, keeping their owner.
				take(t, "deleted as another Node's", api.deleted, n)
			}
			for _, s := range take(t, "created again", api.created, n) {
				owner := "uid-1"
				if tt.recreate {
					owner = "uid-2"
				}
				if got := nodeOwner(*s); string(got) != owner {
					t.Errorf("slice %s owned by %q, want %q", s.Name, got, owner)
				}
			}
			publishing(t, d)
			if err := d.CheckSlices(ctx); err != nil {
				t.Fatal(err)
			}
			if s := d.Slices(); s.NotOurs != "" || !s.NotOursSince.IsZero() || s.Restarts != 1 {
				t.Errorf("after publishing again: %+v, want ours, one restart", s)
			}
		})
	}
}

// A controller that updates a slice the API server does not have asks for
// a check at once; other errors do not.
func TestNotFoundAsksForCheck(t *testing.T) {
	d := New(Options{NodeName: "node-a"})
	d.HandleError(context.Background(), errors.New("conflict"), "update ResourceSlice")
	if len(d.checkNow) != 0 {
		t.Fatal("a conflict asked for a check")
	}
	gone := apierrors.NewNotFound(schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceslices"}, "0-gpu.nvidia.com-node-a-x")
	d.HandleError(context.Background(), fmt.Errorf("update resource slice: %w", gone), "processing ResourceSlice objects")
	if len(d.checkNow) != 1 {
		t.Error("a slice the API server does not have asked for no check")
	}
}

// A Node created again is told to the driver (CheckSoon), and the check
// that confirms the slices are not ours follows the first by SliceCheckGap,
// not by SliceCheck: the slices come back owned by the new Node without
// waiting for the periodic checks.
func TestRecreatedNodeRepublishedSoon(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	api := newFakeAPI("uid-1")
	d := New(Options{NodeName: "node-a", Client: api, SliceCheck: time.Hour, SliceCheckGap: time.Millisecond})
	defer d.Stop()
	n := publishMixedPool(ctx, t, api, d)
	recreateNode(ctx, t, api, "uid-2")
	d.CheckSoon()
	take(t, "deleted as another Node's", api.deleted, n)
	for _, s := range take(t, "created again", api.created, n) {
		if got := nodeOwner(*s); got != "uid-2" {
			t.Errorf("slice %s owned by %q, want uid-2", s.Name, got)
		}
	}
	if s := d.Slices(); s.Restarts != 1 {
		t.Errorf("%d restarts, want 1", s.Restarts)
	}
}

// publishMixedPool publishes devicemodeltest's mixed pool through d and
// waits until its slices are created on api and d's controller runs; it
// returns how many slices that is.
func publishMixedPool(ctx context.Context, t *testing.T, api *fakeAPI, d *Driver) int {
	t.Helper()
	pool := devicemodeltest.MixedPool(t)
	n := len(devicemodel.Resources("node-a", pool, 1, devicemodel.Dropped{}).Pools["node-a"].Slices)
	d.Publish(pool)
	d.startPublishing(ctx)
	take(t, "created", api.created, n)
	publishing(t, d)
	return n
}

// recreateNode deletes node-a and creates it again under uid, as a restore
// of the API server's data or a node registering anew does.
func recreateNode(ctx context.Context, t *testing.T, api *fakeAPI, uid string) {
	t.Helper()
	if err := api.CoreV1().Nodes().Delete(ctx, "node-a", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := api.CoreV1().Nodes().Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "node-a", UID: types.UID(uid)}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
}
