package dra

import (
	"context"
	"encoding/json"
	"errors"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	resourceapi "k8s.io/api/resource/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
)

func statusClaim(uid types.UID, name string) *resourceapi.ResourceClaim {
	return &resourceapi.ResourceClaim{ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "ml", UID: uid}}
}

// statusWriter is a writer on a fake API with claims a and b, a clock the
// test moves, and no back-off.
func statusWriter(t *testing.T) (*ClaimStatusWriter, *fake.Clientset, *time.Time) {
	t.Helper()
	client := fake.NewClientset(statusClaim("uid-a", "a"), statusClaim("uid-b", "b"))
	now := time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC)
	w := NewClaimStatusWriter(ClaimStatusOptions{Client: client, NodeName: "node-1", Now: func() time.Time { return now },
		Retry: func(int) time.Duration { return time.Minute }})
	return w, client, &now
}

func claimDevices(t *testing.T, client *fake.Clientset, name string) []resourceapi.AllocatedDeviceStatus {
	t.Helper()
	c, err := client.ResourceV1().ResourceClaims("ml").Get(context.Background(), name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return c.Status.Devices
}

func patches(client *fake.Clientset) int {
	n := 0
	for _, a := range client.Actions() {
		if a.GetVerb() == "patch" && a.GetSubresource() == "status" {
			n++
		}
	}
	return n
}

func TestClaimStatusWriter(t *testing.T) {
	w, client, now := statusWriter(t)
	ctx := context.Background()
	whole := ClaimStatus{UID: "uid-a", Namespace: "ml", Name: "a", Devices: []DeviceStatus{{Device: "gpu-0", Data: map[string]any{"uuid": "GPU-0"}}}}
	made := ClaimStatus{UID: "uid-b", Namespace: "ml", Name: "b", Devices: []DeviceStatus{{Device: "gpu-1-mig-3g20gb-4", ShareID: "share-1",
		Data: map[string]any{"uuid": "MIG-1", "profile": "3g.20gb", "placement": map[string]any{"start": 4, "size": 4}}}}}
	w.Set(map[types.UID]ClaimStatus{"uid-a": whole, "uid-b": made})
	w.writeDue(ctx)

	type want struct {
		claim, device, shareID, status, reason, data string
		since                                        time.Time
	}
	check := func(step string, wants ...want) {
		t.Helper()
		for _, wt := range wants {
			ds := claimDevices(t, client, wt.claim)
			if len(ds) != 1 {
				t.Errorf("%s: claim %s has %d device entries, want 1: %+v", step, wt.claim, len(ds), ds)
				continue
			}
			d := ds[0]
			if d.Driver != devicemodel.DriverName || d.Pool != "node-1" || d.Device != wt.device || string(ptrOr(d.ShareID)) != wt.shareID {
				t.Errorf("%s: claim %s entry %s/%s/%s share %v", step, wt.claim, d.Driver, d.Pool, d.Device, d.ShareID)
			}
			if len(d.Conditions) != 1 || d.Conditions[0].Type != ConditionReady || string(d.Conditions[0].Status) != wt.status ||
				d.Conditions[0].Reason != wt.reason || !d.Conditions[0].LastTransitionTime.Time.Equal(wt.since) {
				t.Errorf("%s: claim %s conditions %+v, want Ready=%s (%s) since %s", step, wt.claim, d.Conditions, wt.status, wt.reason, wt.since)
			}
			var got, exp any
			if d.Data == nil || json.Unmarshal(d.Data.Raw, &got) != nil || json.Unmarshal([]byte(wt.data), &exp) != nil || !jsonEqual(got, exp) {
				t.Errorf("%s: claim %s data %v, want %s", step, wt.claim, d.Data, wt.data)
			}
		}
	}
	t0 := *now
	check("prepared",
		want{"a", "gpu-0", "", "True", ReasonPrepared, `{"uuid":"GPU-0"}`, t0},
		want{"b", "gpu-1-mig-3g20gb-4", "share-1", "True", ReasonPrepared, `{"uuid":"MIG-1","profile":"3g.20gb","placement":{"start":4,"size":4}}`, t0})
	c, _ := client.ResourceV1().ResourceClaims("ml").Get(ctx, "a", metav1.GetOptions{})
	if len(c.ManagedFields) == 0 || c.ManagedFields[0].Manager != "gpu.nvidia.com/node-1" {
		t.Errorf("managed fields %+v, want the manager gpu.nvidia.com/node-1", c.ManagedFields)
	}

	// The same statuses again: nothing written.
	before := patches(client)
	w.Set(map[types.UID]ClaimStatus{"uid-a": whole, "uid-b": made})
	w.writeDue(ctx)
	if n := patches(client) - before; n != 0 {
		t.Errorf("%d writes of unchanged statuses, want 0", n)
	}

	// a's GPU turns unhealthy: Ready false with the cause, since now; b keeps its time.
	*now = now.Add(time.Minute)
	bad := whole
	bad.Devices = []DeviceStatus{whole.Devices[0]}
	bad.Devices[0].Unhealthy = "XID 48 (double-bit ECC error)"
	w.Set(map[types.UID]ClaimStatus{"uid-a": bad, "uid-b": made})
	w.writeDue(ctx)
	check("unhealthy",
		want{"a", "gpu-0", "", "False", ReasonUnhealthy, `{"uuid":"GPU-0"}`, *now},
		want{"b", "gpu-1-mig-3g20gb-4", "share-1", "True", ReasonPrepared, `{"uuid":"MIG-1","profile":"3g.20gb","placement":{"start":4,"size":4}}`, t0})
	if d := claimDevices(t, client, "a"); d[0].Conditions[0].Message != "XID 48 (double-bit ECC error)" {
		t.Errorf("message %q, want the health cause", d[0].Conditions[0].Message)
	}
	if n := patches(client) - before; n != 1 {
		t.Errorf("%d writes for one changed claim, want 1", n)
	}
}

func ptrOr(s *string) string {
	if s == nil {
		return ""
	}
	return *s
}

func jsonEqual(a, b any) bool {
	x, _ := json.Marshal(a)
	y, _ := json.Marshal(b)
	return string(x) == string(y)
}

func TestClaimStatusWriterFailures(t *testing.T) {
	gr := schema.GroupResource{Group: "resource.k8s.io", Resource: "resourceclaims"}
	tests := []struct {
		name  string
		err   error
		retry bool // written again once the back-off is over
	}{
		{"the API server fails: retried after the back-off", apierrors.NewInternalError(errors.New("etcd")), true},
		{"forbidden (RBAC being fixed): retried", apierrors.NewForbidden(gr, "a", errors.New("no")), true},
		{"the claim is gone: not retried", apierrors.NewNotFound(gr, "a"), false},
		{"no longer allocated these devices: not retried", apierrors.NewInvalid(schema.GroupKind{Group: "resource.k8s.io", Kind: "ResourceClaim"}, "a", nil), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			w, client, now := statusWriter(t)
			fail := true
			client.PrependReactor("patch", "resourceclaims", func(k8stesting.Action) (bool, runtime.Object, error) {
				if fail {
					return true, nil, tt.err
				}
				return false, nil, nil
			})
			st := ClaimStatus{UID: "uid-a", Namespace: "ml", Name: "a", Devices: []DeviceStatus{{Device: "gpu-0"}}}
			w.Set(map[types.UID]ClaimStatus{"uid-a": st})
			next := w.writeDue(context.Background())
			if got := !next.IsZero(); got != tt.retry {
				t.Fatalf("a retry due at %v; want one: %v", next, tt.retry)
			}
			fail = false
			w.writeDue(context.Background()) // before the back-off is over: nothing
			if n := patches(client); n != 1 {
				t.Fatalf("%d writes before the back-off is over, want 1", n)
			}
			*now = now.Add(time.Minute)
			w.writeDue(context.Background())
			written := len(claimDevices(t, client, "a")) == 1
			if written != tt.retry {
				t.Errorf("written after the back-off: %v, want %v", written, tt.retry)
			}
		})
	}
}

// TestClaimStatusWriterRun: Set never waits on the API, and Run writes in
// the background.
func TestClaimStatusWriterRun(t *testing.T) {
	client := fake.NewClientset(statusClaim("uid-a", "a"))
	release, written := make(chan struct{}), make(chan struct{}, 1)
	client.PrependReactor("patch", "resourceclaims", func(k8stesting.Action) (bool, runtime.Object, error) {
		<-release // a slow API server
		select {
		case written <- struct{}{}:
		default:
		}
		return false, nil, nil
	})
	w := NewClaimStatusWriter(ClaimStatusOptions{Client: client, NodeName: "node-1"})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- w.Run(ctx) }()
	st := ClaimStatus{UID: "uid-a", Namespace: "ml", Name: "a", Devices: []DeviceStatus{{Device: "gpu-0"}}}
	w.Set(map[types.UID]ClaimStatus{"uid-a": st})
	w.Set(map[types.UID]ClaimStatus{"uid-a": st}) // while the first write hangs
	close(release)
	<-written
	cancel()
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if len(claimDevices(t, client, "a")) != 1 {
		t.Error("the claim's status was not written")
	}
}
