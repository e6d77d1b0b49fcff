package imex

import (
	"context"
	"fmt"
	"log/slog"
	"time"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/tools/cache"
)

// ComputeDomains is the ComputeDomain resource.
var ComputeDomains = schema.GroupVersionResource{Group: cdv1.GroupName, Version: cdv1.Version, Resource: "computedomains"}

// Domains finds ComputeDomains by UID: what the node side reads of the
// controller's work.
type Domains interface {
	Domain(uid string) (*cdv1.ComputeDomain, bool)
	// Listing are the UIDs of the domains whose status.nodes lists node:
	// the controller placed their workload there, so their daemon runs
	// there before any claim is prepared (with binding conditions, the
	// pod is bound only once it is ready).
	Listing(node string) []string
}

// Watcher keeps the cluster's ComputeDomains in a cache (one watch per
// node, whatever the number of domains) and signals each change.
type Watcher struct {
	informer cache.SharedIndexInformer
	changes  chan struct{}
	log      *slog.Logger
}

const (
	byUID  = "uid"
	byNode = "node"
)

// NewWatcher watches ComputeDomains through client.
func NewWatcher(client dynamic.Interface, log *slog.Logger) *Watcher {
	f := dynamicinformer.NewDynamicSharedInformerFactory(client, 10*time.Minute)
	inf := f.ForResource(ComputeDomains).Informer()
	w := &Watcher{informer: inf, changes: make(chan struct{}, 1), log: log}
	_ = inf.AddIndexers(cache.Indexers{byUID: func(obj any) ([]string, error) {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			return nil, nil
		}
		return []string{string(u.GetUID())}, nil
	}, byNode: func(obj any) ([]string, error) {
		u, ok := obj.(*unstructured.Unstructured)
		if !ok {
			return nil, nil
		}
		nodes, _, _ := unstructured.NestedSlice(u.Object, "status", "nodes")
		var out []string
		for _, n := range nodes {
			if m, ok := n.(map[string]any); ok {
				if name, ok := m["name"].(string); ok {
					out = append(out, name)
				}
			}
		}
		return out, nil
	}})
	signal := func(any) {
		select {
		case w.changes <- struct{}{}:
		default:
		}
	}
	_, _ = inf.AddEventHandler(cache.ResourceEventHandlerFuncs{AddFunc: signal, UpdateFunc: func(_, n any) { signal(n) }, DeleteFunc: signal})
	return w
}

// Run runs the watch until ctx ends.
func (w *Watcher) Run(ctx context.Context) error {
	w.informer.Run(ctx.Done())
	return nil
}

// Changes signals when a ComputeDomain changed.
func (w *Watcher) Changes() <-chan struct{} { return w.changes }

// Domain is the ComputeDomain of UID uid, if the cache has it.
func (w *Watcher) Domain(uid string) (*cdv1.ComputeDomain, bool) {
	objs, err := w.informer.GetIndexer().ByIndex(byUID, uid)
	if err != nil || len(objs) == 0 {
		return nil, false
	}
	cd, err := fromUnstructured(objs[0])
	if err != nil {
		w.log.Warn("ComputeDomain unreadable", "uid", uid, "err", err)
		return nil, false
	}
	return cd, true
}

// Listing implements [Domains].
func (w *Watcher) Listing(node string) []string {
	objs, _ := w.informer.GetIndexer().ByIndex(byNode, node)
	out := make([]string, 0, len(objs))
	for _, o := range objs {
		if u, ok := o.(*unstructured.Unstructured); ok {
			out = append(out, string(u.GetUID()))
		}
	}
	return out
}

func fromUnstructured(obj any) (*cdv1.ComputeDomain, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return nil, fmt.Errorf("a %T, not a ComputeDomain", obj)
	}
	var cd cdv1.ComputeDomain
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &cd); err != nil {
		return nil, err
	}
	return &cd, nil
}
