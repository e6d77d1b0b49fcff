package controller

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	resourcev1 "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/util/sets"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/informers"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/util/workqueue"
)

// Resource is the ComputeDomain resource the controller watches.
var Resource = schema.GroupVersionResource{Group: cdv1.GroupName, Version: cdv1.Version, Resource: "computedomains"}

// Options configure a Controller.
type Options struct {
	// Dynamic reads and writes ComputeDomains; Kube everything else.
	Dynamic dynamic.Interface
	Kube    kubernetes.Interface
	// Namespace holds the daemons' templates (the controller's own).
	Namespace string
	// Reports reads what the node sides report (nil: StatusReports).
	Reports NodeReports
	// Resync is the informers' resync period: every domain is reconciled
	// this often even without events (0: never).
	Resync time.Duration
	// Workers reconcile domains in parallel (0: 2). One domain is never
	// reconciled by two at once.
	Workers int
	Log     *slog.Logger
}

// Controller reconciles ComputeDomains. Its cost in watches is fixed: one
// each on ComputeDomains, on the ResourceClaimTemplates and
// ResourceClaims that carry LabelDomain (a label selector, so the API
// server sends only the domains' own), and on Nodes; how many domains
// and nodes there are changes what they carry, not their number.
type Controller struct {
	opts    Options
	domains dynamic.NamespaceableResourceInterface

	cdInformer    cache.SharedIndexInformer
	rctInformer   cache.SharedIndexInformer
	claimInformer cache.SharedIndexInformer
	nodeInformer  cache.SharedIndexInformer
	start         func(stop <-chan struct{})

	queue workqueue.TypedRateLimitingInterface[string]

	mu     sync.Mutex
	synced bool
	// finalized are the domains whose finalizer this controller removed;
	// forgotten once the informer no longer has them.
	finalized sets.Set[types.UID]
	// conditioned is, per claim, the resourceVersion its binding
	// conditions were last written at: while the informer still shows
	// that version, the write has not reached it, and writing again would
	// only conflict. Forgotten once the informer shows a newer one.
	conditioned map[types.UID]string
}

// Index names.
const (
	byUID    = "uid"    // domains by UID
	byNode   = "node"   // domains by the names of their status.nodes; claims by their allocation's node
	byDomain = "domain" // templates and claims by LabelDomain
)

// sweepKey is the queue's key for the sweep of objects whose domain is gone.
const sweepKey = ""

// New builds a controller; Run starts it.
func New(opts Options) (*Controller, error) {
	if opts.Dynamic == nil || opts.Kube == nil {
		return nil, errors.New("controller: Dynamic and Kube clients are required")
	}
	if opts.Namespace == "" {
		return nil, errors.New("controller: namespace of the daemon templates is required")
	}
	if opts.Reports == nil {
		opts.Reports = StatusReports{}
	}
	if opts.Workers <= 0 {
		opts.Workers = 2
	}
	if opts.Log == nil {
		opts.Log = slog.Default()
	}
	c := &Controller{
		opts:        opts,
		domains:     opts.Dynamic.Resource(Resource),
		finalized:   sets.New[types.UID](),
		conditioned: map[types.UID]string{},
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(
			workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "computedomains"}),
	}

	dyn := dynamicinformer.NewDynamicSharedInformerFactory(opts.Dynamic, opts.Resync)
	c.cdInformer = dyn.ForResource(Resource).Informer()
	labelled := informers.NewSharedInformerFactoryWithOptions(opts.Kube, opts.Resync,
		informers.WithTweakListOptions(func(o *metav1.ListOptions) { o.LabelSelector = LabelDomain }))
	c.rctInformer = labelled.Resource().V1().ResourceClaimTemplates().Informer()
	c.claimInformer = labelled.Resource().V1().ResourceClaims().Informer()
	nodes := informers.NewSharedInformerFactory(opts.Kube, opts.Resync)
	c.nodeInformer = nodes.Core().V1().Nodes().Informer()
	c.start = func(stop <-chan struct{}) {
		dyn.Start(stop)
		labelled.Start(stop)
		nodes.Start(stop)
	}

	if err := c.cdInformer.AddIndexers(cache.Indexers{byUID: domainUIDIndex, byNode: domainNodesIndex}); err != nil {
		return nil, err
	}
	if err := c.rctInformer.AddIndexers(cache.Indexers{byDomain: labelIndex}); err != nil {
		return nil, err
	}
	if err := c.claimInformer.AddIndexers(cache.Indexers{byDomain: labelIndex, byNode: claimNodeIndex}); err != nil {
		return nil, err
	}
	if err := c.addHandlers(); err != nil {
		return nil, err
	}
	return c, nil
}

func domainUIDIndex(obj any) ([]string, error) {
	m, err := meta(obj)
	if err != nil {
		return nil, err
	}
	return []string{string(m.GetUID())}, nil
}

func domainNodesIndex(obj any) ([]string, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return nil, nil
	}
	nodes, _, _ := unstructured.NestedSlice(u.Object, "status", "nodes")
	var names []string
	for _, n := range nodes {
		if m, ok := n.(map[string]any); ok {
			if name, ok := m["name"].(string); ok {
				names = append(names, name)
			}
		}
	}
	return names, nil
}

func claimNodeIndex(obj any) ([]string, error) {
	if claim, ok := obj.(*resourcev1.ResourceClaim); ok {
		if node := allocatedNode(claim); node != "" {
			return []string{node}, nil
		}
	}
	return nil, nil
}

func labelIndex(obj any) ([]string, error) {
	m, err := meta(obj)
	if err != nil {
		return nil, err
	}
	if uid, ok := m.GetLabels()[LabelDomain]; ok {
		return []string{uid}, nil
	}
	return nil, nil
}

func meta(obj any) (metav1.Object, error) {
	if d, ok := obj.(cache.DeletedFinalStateUnknown); ok {
		obj = d.Obj
	}
	m, ok := obj.(metav1.Object)
	if !ok {
		return nil, fmt.Errorf("%T is not an object", obj)
	}
	return m, nil
}

func (c *Controller) addHandlers() error {
	onDomain := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { c.enqueueObject(obj) },
		UpdateFunc: func(_, obj any) { c.enqueueObject(obj) },
		DeleteFunc: func(obj any) {
			if m, err := meta(obj); err == nil {
				c.mu.Lock()
				c.finalized.Delete(m.GetUID())
				c.mu.Unlock()
			}
			c.queue.Add(sweepKey)
		},
	}
	if _, err := c.cdInformer.AddEventHandler(onDomain); err != nil {
		return err
	}
	// A template or claim names its domain by UID.
	byLabel := func(objs ...any) {
		for _, obj := range objs {
			if m, err := meta(obj); err == nil {
				if uid, ok := m.GetLabels()[LabelDomain]; ok {
					c.enqueueUID(uid)
				}
			}
		}
	}
	labelled := cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { byLabel(obj) },
		UpdateFunc: func(old, obj any) { byLabel(old, obj) },
		DeleteFunc: func(obj any) {
			if m, err := meta(obj); err == nil {
				c.mu.Lock()
				delete(c.conditioned, m.GetUID()) // a claim's; a template has none
				c.mu.Unlock()
			}
			byLabel(obj)
		},
	}
	for _, inf := range []cache.SharedIndexInformer{c.rctInformer, c.claimInformer} {
		if _, err := inf.AddEventHandler(labelled); err != nil {
			return err
		}
	}
	// A Node matters to the domains that list it in status.nodes and to
	// those whose claims are allocated on it (its readiness, address or
	// clique changed, it came or went). Kubelet heartbeats renew a Lease,
	// not the Node, so this handler runs on real changes.
	onNode := func(objs ...any) {
		for _, obj := range objs {
			m, err := meta(obj)
			if err != nil {
				continue
			}
			keys, _ := c.cdInformer.GetIndexer().IndexKeys(byNode, m.GetName())
			for _, k := range keys {
				c.queue.Add(k)
			}
			claims, _ := c.claimInformer.GetIndexer().ByIndex(byNode, m.GetName())
			byLabel(claims...)
		}
	}
	_, err := c.nodeInformer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    func(obj any) { onNode(obj) },
		UpdateFunc: func(old, obj any) { onNode(old, obj) },
		DeleteFunc: func(obj any) { onNode(obj) },
	})
	return err
}

func (c *Controller) enqueueObject(obj any) {
	key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj)
	if err == nil {
		c.queue.Add(key)
	}
}

// enqueueUID queues the domain of a UID, or the sweep when no domain has
// it: what it labels is left over.
func (c *Controller) enqueueUID(uid string) {
	objs, _ := c.cdInformer.GetIndexer().ByIndex(byUID, uid)
	if len(objs) == 0 {
		c.queue.Add(sweepKey)
		return
	}
	for _, obj := range objs {
		c.enqueueObject(obj)
	}
}

// Run reconciles until ctx ends: informers first, then the sweep of what
// domains deleted while no controller ran left behind, then the workers.
func (c *Controller) Run(ctx context.Context) error {
	defer c.queue.ShutDown()
	c.start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), c.cdInformer.HasSynced, c.rctInformer.HasSynced,
		c.claimInformer.HasSynced, c.nodeInformer.HasSynced) {
		return ctx.Err()
	}
	c.mu.Lock()
	c.synced = true
	c.mu.Unlock()
	c.opts.Log.Info("compute domain controller synced", "domains", len(c.cdInformer.GetStore().ListKeys()))
	c.queue.Add(sweepKey)
	var wg sync.WaitGroup
	for range c.opts.Workers {
		wg.Go(func() {
			for c.processNext(ctx) {
			}
		})
	}
	<-ctx.Done()
	c.queue.ShutDown()
	wg.Wait()
	return nil
}

// Synced says whether the informers have synced (readiness).
func (c *Controller) Synced() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.synced
}

func (c *Controller) processNext(ctx context.Context) bool {
	key, quit := c.queue.Get()
	if quit {
		return false
	}
	defer c.queue.Done(key)
	if err := c.sync(ctx, key); err != nil {
		// Conflicts (a node side's status write between our read and
		// write, a Node changed under a label patch) and API errors are
		// retried with the queue's per-key back-off, 5 ms doubling to
		// 1000 s, under its overall 10 per second.
		c.opts.Log.Warn("compute domain: will retry", "domain", key, "err", err)
		c.queue.AddRateLimited(key)
		return true
	}
	c.queue.Forget(key)
	return true
}

// domain returns the typed domain of a cache object.
func toDomain(obj any) (*cdv1.ComputeDomain, error) {
	u, ok := obj.(*unstructured.Unstructured)
	if !ok {
		return nil, fmt.Errorf("%T is not an unstructured ComputeDomain", obj)
	}
	var cd cdv1.ComputeDomain
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &cd); err != nil {
		return nil, fmt.Errorf("ComputeDomain %s/%s: %w", u.GetNamespace(), u.GetName(), err)
	}
	return &cd, nil
}

func fromDomain(cd *cdv1.ComputeDomain) (*unstructured.Unstructured, error) {
	obj, err := runtime.DefaultUnstructuredConverter.ToUnstructured(cd)
	if err != nil {
		return nil, fmt.Errorf("ComputeDomain %s/%s: %w", cd.Namespace, cd.Name, err)
	}
	u := &unstructured.Unstructured{Object: obj}
	u.SetAPIVersion(cdv1.APIVersion)
	u.SetKind(cdv1.KindComputeDomain)
	return u, nil
}

// listByDomain returns an informer's objects labelled with uid.
func listByDomain[T any](inf cache.SharedIndexInformer, uid string) []T {
	objs, _ := inf.GetIndexer().ByIndex(byDomain, uid)
	out := make([]T, 0, len(objs))
	for _, o := range objs {
		if t, ok := o.(T); ok {
			out = append(out, t)
		}
	}
	return out
}
