package imex

import (
	"context"
	"encoding/json"
	"log/slog"
	"reflect"
	"slices"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	"github.com/gpu-agent/gpu-agent/computedomain/controller"
)

// The names the node side writes are the controller's (contract.go).
func TestContractNames(t *testing.T) {
	for got, want := range map[string]string{
		DriverName:             controller.DriverName,
		NodeFieldManagerPrefix: controller.NodeFieldManagerPrefix,
		ConditionDaemonReady:   controller.ConditionDaemonReady,
		ConditionDaemonFailed:  controller.ConditionDaemonFailed,
	} {
		if got != want {
			t.Errorf("node side %q, controller %q", got, want)
		}
	}
}

// applies records the status applies a fake dynamic client received;
// answer, if set, answers them.
type applies struct {
	client *dynamicfake.FakeDynamicClient
	got    []k8stesting.PatchActionImpl
	answer error
}

func newApplies() *applies {
	a := &applies{client: dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{ComputeDomains: cdv1.KindComputeDomainList})}
	a.client.PrependReactor("patch", "computedomains", func(action k8stesting.Action) (bool, runtime.Object, error) {
		a.got = append(a.got, action.(k8stesting.PatchActionImpl))
		if a.answer != nil {
			return true, nil, a.answer
		}
		return true, nil, nil
	})
	return a
}

// The node side reports its daemon's readiness in its own status.nodes
// entry, by server-side apply of the status subresource: only the entry's
// key and status, at the resourceVersion read, under its own field
// manager, forced. It writes when the daemon's answer and the entry
// differ, once per resourceVersion; NotReady again when the daemon stops
// answering READY; nothing for a domain that does not list the node.
func TestReportReadiness(t *testing.T) {
	ctx := context.Background()
	n, root := simTray(t, 16)
	domains := &fakeDomains{}
	listed := func(rv string, self cdv1.Status) *cdv1.ComputeDomain {
		cd := domain("cd-1", "team", "job",
			cdv1.ComputeDomainNode{Name: "node-a", IPAddress: "10.0.0.1", CliqueID: clique7, Index: 0, Status: self},
			cdv1.ComputeDomainNode{Name: "node-b", IPAddress: "10.0.0.2", CliqueID: clique7, Index: 1, Status: cdv1.StatusNotReady})
		cd.ResourceVersion = rv
		return cd
	}
	domains.put(listed("5", cdv1.StatusNotReady))
	other := domain("cd-2", "team", "elsewhere", cdv1.ComputeDomainNode{Name: "node-b", IPAddress: "10.0.0.2", CliqueID: clique7})
	other.ResourceVersion = "3"
	domains.put(other)
	a := newApplies()
	td := newTestDriver(t, root, t.TempDir(), t.TempDir(), inventoryOf(t, n), fake.NewClientset(), domains)
	td.opts.Status = Reporter{Client: a.client}

	td.Refresh(ctx)
	if w := td.daemons.wanted(); len(w) != 1 || w[0].Domain != "cd-1" {
		t.Fatalf("daemons wanted %+v: want cd-1's, the domain listing the node, before any claim", w)
	}
	if len(a.got) != 0 {
		t.Fatalf("applied %d times while the daemon is not ready and the entry says NotReady", len(a.got))
	}

	td.daemons.setReady("cd-1")
	td.Refresh(ctx)
	td.Refresh(ctx) // the watch has not shown the write yet: not written again
	if len(a.got) != 1 {
		t.Fatalf("%d applies once ready, want 1", len(a.got))
	}
	checkApply(t, a.got[0], "5", cdv1.StatusReady)

	domains.put(listed("6", cdv1.StatusReady))
	td.Refresh(ctx)
	if len(a.got) != 1 {
		t.Fatalf("applied again though the entry says Ready: %d applies", len(a.got))
	}

	// The daemon fails (or loses its quorum): NotReady.
	td.daemons.mu.Lock()
	td.daemons.ready = nil
	td.daemons.mu.Unlock()
	td.Refresh(ctx)
	if len(a.got) != 2 {
		t.Fatalf("%d applies after the daemon stopped being ready, want 2", len(a.got))
	}
	checkApply(t, a.got[1], "6", cdv1.StatusNotReady)

	// A conflict (the controller wrote the domain meanwhile) is not
	// retried at the old resourceVersion... but is at the next one.
	a.answer = apierrors.NewConflict(schema.GroupResource{Group: cdv1.GroupName, Resource: "computedomains"}, "job", nil)
	td.daemons.setReady("cd-1")
	domains.put(listed("7", cdv1.StatusNotReady))
	td.Refresh(ctx)
	a.answer = nil
	domains.put(listed("8", cdv1.StatusNotReady))
	td.Refresh(ctx)
	if len(a.got) != 4 {
		t.Fatalf("%d applies, want 4 (a conflict, then the next resourceVersion)", len(a.got))
	}
	checkApply(t, a.got[3], "8", cdv1.StatusReady)

	// The controller removed the entry: no daemon, no write.
	cd := listed("9", "")
	cd.Status.Nodes = cd.Status.Nodes[1:]
	domains.put(cd)
	td.Refresh(ctx)
	if len(a.got) != 4 || len(td.daemons.wanted()) != 0 {
		t.Errorf("after the entry went: %d applies, daemons %+v", len(a.got), td.daemons.wanted())
	}
}

func checkApply(t *testing.T, got k8stesting.PatchActionImpl, rv string, status cdv1.Status) {
	t.Helper()
	if got.PatchType != types.ApplyPatchType || got.Subresource != "status" || got.Namespace != "team" || got.Name != "job" {
		t.Errorf("apply %s of %s/%s/%s, want an apply of team/job/status", got.PatchType, got.Namespace, got.Name, got.Subresource)
	}
	if got.PatchOptions.FieldManager != "compute-domain.nvidia.com/node-a" || got.PatchOptions.Force == nil || !*got.PatchOptions.Force {
		t.Errorf("patch options %+v, want field manager compute-domain.nvidia.com/node-a, forced", got.PatchOptions)
	}
	var patch map[string]any
	if err := json.Unmarshal(got.Patch, &patch); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{
		"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
		"metadata": map[string]any{"name": "job", "namespace": "team", "resourceVersion": rv},
		"status":   map[string]any{"nodes": []any{map[string]any{"name": "node-a", "status": string(status)}}},
	}
	if !reflect.DeepEqual(want, patch) {
		t.Errorf("apply patch\n got %s\nwant %v", got.Patch, want)
	}
}

// Channels carry the contract's binding conditions unless the API server
// drops them; the daemon device never does.
func TestBindingConditionsPublished(t *testing.T) {
	for _, drop := range []Dropped{{}, {BindingConditions: true}} {
		devs := Resources("node-a", Pool{Channels: 2}, 1, drop).Pools["node-a"].Slices[0].Devices
		if len(devs[0].BindingConditions)+len(devs[0].BindingFailureConditions) != 0 {
			t.Errorf("%+v: the daemon device has binding conditions %v %v", drop, devs[0].BindingConditions, devs[0].BindingFailureConditions)
		}
		for _, d := range devs[1:] {
			want := []string{ConditionDaemonReady}
			wantFail := []string{ConditionDaemonFailed}
			if drop.BindingConditions {
				want, wantFail = nil, nil
			}
			if !slices.Equal(d.BindingConditions, want) || !slices.Equal(d.BindingFailureConditions, wantFail) {
				t.Errorf("%+v: %s binding conditions %v / %v, want %v / %v", drop, d.Name, d.BindingConditions, d.BindingFailureConditions, want, wantFail)
			}
		}
	}
}

// The watcher finds the domains whose status.nodes lists a node.
func TestWatcherListing(t *testing.T) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	obj := func(uid, name string, nodes ...string) *unstructured.Unstructured {
		var entries []any
		for _, n := range nodes {
			entries = append(entries, map[string]any{"name": n, "ipAddress": "10.0.0.1"})
		}
		u := &unstructured.Unstructured{Object: map[string]any{"apiVersion": cdv1.APIVersion, "kind": cdv1.KindComputeDomain,
			"metadata": map[string]any{"name": name, "namespace": "team", "uid": uid},
			"spec":     map[string]any{"channel": map[string]any{"resourceClaimTemplate": map[string]any{"name": name}}},
			"status":   map[string]any{"nodes": entries}}}
		return u
	}
	client := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(),
		map[schema.GroupVersionResource]string{ComputeDomains: cdv1.KindComputeDomainList},
		obj("cd-1", "one", "node-a", "node-b"), obj("cd-2", "two", "node-b"), obj("cd-3", "three"))
	w := NewWatcher(client, slog.New(slog.DiscardHandler))
	go func() { _ = w.Run(ctx) }()
	if !cache.WaitForCacheSync(ctx.Done(), w.informer.HasSynced) {
		t.Fatal("no sync")
	}
	for node, want := range map[string][]string{"node-a": {"cd-1"}, "node-b": {"cd-1", "cd-2"}, "node-c": {}} {
		got := w.Listing(node)
		slices.Sort(got)
		if !slices.Equal(got, want) {
			t.Errorf("Listing(%s) = %v, want %v", node, got, want)
		}
	}
	if cd, ok := w.Domain("cd-2"); !ok || cd.Name != "two" {
		t.Errorf("Domain(cd-2) = %+v, %v", cd, ok)
	}
}
