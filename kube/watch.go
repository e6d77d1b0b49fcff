package kube

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/tools/cache"
)

// resyncPeriod re-delivers the watched object even without changes; the
// consumers ignore a repeat, so this only covers a missed event.
const resyncPeriod = 10 * time.Minute

// NodeWatcher follows the agent's own Node (and only it: a field selector on
// its name, so a big cluster costs one object) and reports what the agent
// reads of it: its labels and the cordon annotation.
type NodeWatcher struct {
	client kubernetes.Interface
	node   string
	log    *slog.Logger
	// onNode gets the node's labels and cordon annotation after every
	// change of either (a copy); it must not block.
	onNode func(NodeInfo)
	errs   *errorLog
}

// NodeInfo is what the agent reads of its Node.
type NodeInfo struct {
	Labels map[string]string
	// Cordon is the CordonAnnotation's value ("" when absent).
	Cordon string
	// UID changes when the Node is deleted and created again (a restore
	// of the API server's data, a node re-registering).
	UID types.UID
}

// NewNodeWatcher watches node; onNode gets its labels, cordon annotation
// and UID when one of them changes.
func NewNodeWatcher(client kubernetes.Interface, node string, onNode func(NodeInfo), log *slog.Logger) *NodeWatcher {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &NodeWatcher{client: client, node: node, log: log, onNode: onNode, errs: newErrorLog(log, "node "+node)}
}

// Run watches until ctx ends. API errors (down, forbidden) are logged once
// per change of error and retried with backoff by the informer; the last
// labels seen stay in force.
func (w *NodeWatcher) Run(ctx context.Context) error {
	sel := fields.OneTermEqualSelector("metadata.name", w.node).String()
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = sel
			return w.client.CoreV1().Nodes().List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = sel
			return w.client.CoreV1().Nodes().Watch(ctx, o)
		},
	}
	// The wrapper lets a client without watch-list streaming (the fake in
	// tests) say so, instead of the reflector waiting for its bookmark.
	inf := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, w.client), &corev1.Node{}, resyncPeriod, cache.Indexers{})
	var last map[string]string
	var lastCordon string
	var lastUID types.UID
	var mu sync.Mutex
	deliver := func(obj any) {
		n, ok := obj.(*corev1.Node)
		if !ok || n.Name != w.node {
			return
		}
		w.errs.ok()
		mu.Lock()
		defer mu.Unlock()
		cordon := n.Annotations[CordonAnnotation]
		if last != nil && maps.Equal(last, n.Labels) && cordon == lastCordon && n.UID == lastUID {
			return // a heartbeat or status update: nothing the agent reads
		}
		last, lastCordon, lastUID = maps.Clone(n.Labels), cordon, n.UID
		if last == nil {
			last = map[string]string{}
		}
		w.onNode(NodeInfo{Labels: maps.Clone(last), Cordon: cordon, UID: n.UID})
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    deliver,
		UpdateFunc: func(_, obj any) { deliver(obj) },
	}); err != nil {
		return fmt.Errorf("watch node %s: %w", w.node, err)
	}
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) { w.errs.failed("watch", err) })
	runInformer(ctx, inf)
	return nil
}

func (w *NodeWatcher) apiLog() *errorLog { return w.errs }

// ConfigMapWatcher follows one ConfigMap and reports its data (each key a
// file of the config, as in a mounted ConfigMap).
type ConfigMapWatcher struct {
	client          kubernetes.Interface
	namespace, name string
	log             *slog.Logger
	onData          func(data map[string]string, deleted bool)
	errs            *errorLog
}

// NewConfigMapWatcher watches namespace/name; onData gets its data after
// every change, or deleted=true when it is removed.
func NewConfigMapWatcher(client kubernetes.Interface, namespace, name string, onData func(data map[string]string, deleted bool), log *slog.Logger) *ConfigMapWatcher {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &ConfigMapWatcher{client: client, namespace: namespace, name: name, log: log, onData: onData,
		errs: newErrorLog(log, "configmap "+namespace+"/"+name)}
}

// Run watches until ctx ends; see NodeWatcher.Run for errors.
func (w *ConfigMapWatcher) Run(ctx context.Context) error {
	sel := fields.OneTermEqualSelector("metadata.name", w.name).String()
	cms := w.client.CoreV1().ConfigMaps(w.namespace)
	lw := &cache.ListWatch{
		ListWithContextFunc: func(ctx context.Context, o metav1.ListOptions) (runtime.Object, error) {
			o.FieldSelector = sel
			return cms.List(ctx, o)
		},
		WatchFuncWithContext: func(ctx context.Context, o metav1.ListOptions) (watch.Interface, error) {
			o.FieldSelector = sel
			return cms.Watch(ctx, o)
		},
	}
	inf := cache.NewSharedIndexInformer(cache.ToListWatcherWithWatchListSemantics(lw, w.client), &corev1.ConfigMap{}, resyncPeriod, cache.Indexers{})
	var last map[string]string
	delivered := false
	var mu sync.Mutex
	deliver := func(obj any) {
		cm, ok := obj.(*corev1.ConfigMap)
		if !ok || cm.Name != w.name {
			return
		}
		w.errs.ok()
		mu.Lock()
		defer mu.Unlock()
		data := maps.Clone(cm.Data)
		if data == nil {
			data = map[string]string{}
		}
		for k, v := range cm.BinaryData {
			data[k] = string(v)
		}
		if delivered && maps.Equal(data, last) {
			return // a resync or a change elsewhere in the object
		}
		last, delivered = data, true
		w.onData(maps.Clone(data), false)
	}
	if _, err := inf.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc:    deliver,
		UpdateFunc: func(_, obj any) { deliver(obj) },
		DeleteFunc: func(any) {
			mu.Lock()
			last, delivered = nil, false
			mu.Unlock()
			w.log.Warn("configmap deleted; falling back to the mounted config, if any", "configmap", w.namespace+"/"+w.name)
			w.onData(nil, true)
		},
	}); err != nil {
		return fmt.Errorf("watch configmap %s/%s: %w", w.namespace, w.name, err)
	}
	_ = inf.SetWatchErrorHandlerWithContext(func(_ context.Context, _ *cache.Reflector, err error) { w.errs.failed("watch", err) })
	runInformer(ctx, inf)
	return nil
}

func (w *ConfigMapWatcher) apiLog() *errorLog { return w.errs }

// errorLog logs an API failure once per change of error, and the recovery
// once: a down API server must not flood the log, nor go unmentioned. It
// also keeps what /status says of the calls it covers (snapshot).
type errorLog struct {
	log  *slog.Logger
	what string
	mu   sync.Mutex
	last string
	// op is the failing operation; answered: the API server answered some
	// call (a denial is an answer); unreachable: the failing call got none.
	op          string
	answered    bool
	unreachable bool
}

func newErrorLog(log *slog.Logger, what string) *errorLog { return &errorLog{log: log, what: what} }

func (e *errorLog) failed(op string, err error) {
	msg := err.Error()
	var status apierrors.APIStatus
	answered := errors.As(err, &status)
	e.mu.Lock()
	defer e.mu.Unlock()
	e.answered = e.answered || answered
	e.unreachable = !answered
	e.op = op
	if msg == e.last {
		return
	}
	e.last = msg
	e.log.Warn("kubernetes API: "+op+" failed; keeping the last state and retrying", "object", e.what, "error", msg)
}

func (e *errorLog) ok() {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.answered, e.unreachable = true, false
	if e.last != "" {
		e.log.Info("kubernetes API: works again", "object", e.what)
		e.last = ""
	}
}

// current is the last error ("" when working).
func (e *errorLog) current() string {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.last
}

// snapshot says whether the API server answered these calls, whether it
// cannot be reached now, and the failure as /status shows it ("" when none).
func (e *errorLog) snapshot() (answered, unreachable bool, failure string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.last == "" {
		return e.answered, false, ""
	}
	return e.answered, e.unreachable, e.what + ": " + e.op + ": " + e.last
}

// runInformer runs inf until ctx ends, and returns then without waiting for
// it: client-go's watch-list retry sleeps its backoff (up to 30 s while the
// API server cannot be reached) without watching ctx, and an agent told to
// stop must not wait that out. What it is left doing ends with the process.
func runInformer(ctx context.Context, inf cache.SharedIndexInformer) {
	go inf.RunWithContext(ctx)
	<-ctx.Done()
}
