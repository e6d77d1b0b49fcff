package kube

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"

	"github.com/gpu-agent/gpu-agent/usage"
)

// PodWatcher follows the Pods bound to the agent's node (a spec.nodeName
// field selector, so a big cluster costs the node's pods only) for what
// per-process attribution needs: each pod's UID and its containers' IDs,
// which the cgroup of a process names and the kubelet's pod-resources API
// does not give. It keeps only those fields of each Pod.
type PodWatcher struct {
	client kubernetes.Interface
	node   string
	errs   *errorLog

	store   cache.Store // nil until Run
	changed atomic.Int64
	mu      sync.Mutex
	built   int64
	index   *usage.PodIndex
	synced  atomic.Bool
	storeMu sync.Mutex
	ended   func()
}

// NewPodWatcher watches the pods of node.
func NewPodWatcher(client kubernetes.Interface, node string, log *slog.Logger) *PodWatcher {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &PodWatcher{client: client, node: node, errs: newErrorLog(log, "pods of node "+node)}
}

// OnPodEnded sets f, called from the watch when a pod of the node is
// deleted or reaches a terminal phase: the kubelet's pod-resources answer
// changes then, and nothing else tells the agent of a device-plugin pod's
// end. f must not block. Call it before Run.
func (w *PodWatcher) OnPodEnded(f func()) { w.ended = f }

// terminal reports whether obj is a Pod that has ended (a deletion's
// tombstone is not a Pod).
func terminal(obj any) bool {
	p, ok := obj.(*corev1.Pod)
	return ok && (p.Status.Phase == corev1.PodSucceeded || p.Status.Phase == corev1.PodFailed)
}

// Run watches until ctx ends; API errors are logged once per change of
// error and retried with backoff by the informer.
func (w *PodWatcher) Run(ctx context.Context) error {
	sel := fields.OneTermEqualSelector("spec.nodeName", w.node).String()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = sel
			return w.client.CoreV1().Pods("").List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = sel
			return w.client.CoreV1().Pods("").Watch(ctx, o)
		},
	}
	inf := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, w.client), &corev1.Pod{}, resyncPeriod, cache.Indexers{})
	if err := inf.SetTransform(trimPod); err != nil {
		return fmt.Errorf("watch pods of node %s: %w", w.node, err)
	}
	bump := func(any) { w.errs.ok(); w.changed.Add(1) }
	ended := func() {
		if w.ended != nil {
			w.ended()
		}
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: bump,
		// ended before bump: whoever waits on the bump sees it told.
		UpdateFunc: func(old, obj any) {
			if !terminal(old) && terminal(obj) {
				ended()
			}
			bump(obj)
		},
		DeleteFunc: func(obj any) { ended(); bump(obj) },
	}); err != nil {
		return fmt.Errorf("watch pods of node %s: %w", w.node, err)
	}
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) { w.errs.failed("watch", err) })
	w.storeMu.Lock()
	w.store = inf.GetStore()
	w.storeMu.Unlock()
	go func() {
		if cache.WaitForCacheSync(ctx.Done(), inf.HasSynced) {
			w.synced.Store(true)
			w.changed.Add(1)
		}
	}()
	runInformer(ctx, inf)
	return nil
}

func (w *PodWatcher) apiLog() *errorLog { return w.errs }

// trimPod keeps what PodIndex, Events and OnPodEnded read of a Pod: names,
// UID, phase and the container statuses' names and IDs.
func trimPod(obj any) (any, error) {
	p, ok := obj.(*corev1.Pod)
	if !ok {
		return obj, nil // a deletion's tombstone
	}
	out := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: p.Namespace, Name: p.Name, UID: p.UID, ResourceVersion: p.ResourceVersion},
		Status: corev1.PodStatus{Phase: p.Status.Phase}}
	for _, s := range []struct {
		from []corev1.ContainerStatus
		to   *[]corev1.ContainerStatus
	}{{p.Status.InitContainerStatuses, &out.Status.InitContainerStatuses}, {p.Status.ContainerStatuses, &out.Status.ContainerStatuses},
		{p.Status.EphemeralContainerStatuses, &out.Status.EphemeralContainerStatuses}} {
		for _, c := range s.from {
			*s.to = append(*s.to, corev1.ContainerStatus{Name: c.Name, ContainerID: c.ContainerID})
		}
	}
	return out, nil
}

// PodIndex returns the index of the node's pods, rebuilt when they changed;
// nil until the watch has listed them.
func (w *PodWatcher) PodIndex() *usage.PodIndex {
	if !w.synced.Load() {
		return nil
	}
	w.mu.Lock()
	defer w.mu.Unlock()
	if gen := w.changed.Load(); w.index == nil || gen != w.built {
		w.index, w.built = usage.NewPodIndex(w.pods()), gen
	}
	return w.index
}

func (w *PodWatcher) pods() []*corev1.Pod {
	w.storeMu.Lock()
	store := w.store
	w.storeMu.Unlock()
	if store == nil {
		return nil
	}
	var out []*corev1.Pod
	for _, o := range store.List() {
		if p, ok := o.(*corev1.Pod); ok {
			out = append(out, p)
		}
	}
	return out
}

// Ref returns a reference to the pod namespace/name for an Event, and
// whether the watch knows it.
func (w *PodWatcher) Ref(namespace, name string) (corev1.ObjectReference, bool) {
	w.storeMu.Lock()
	store := w.store
	w.storeMu.Unlock()
	if store == nil {
		return corev1.ObjectReference{}, false
	}
	o, ok, err := store.GetByKey(namespace + "/" + name)
	p, isPod := o.(*corev1.Pod)
	if err != nil || !ok || !isPod {
		return corev1.ObjectReference{}, false
	}
	return corev1.ObjectReference{Kind: "Pod", APIVersion: "v1", Namespace: p.Namespace, Name: p.Name, UID: p.UID}, true
}
