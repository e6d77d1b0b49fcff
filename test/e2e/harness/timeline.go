package harness

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/fields"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/client-go/tools/cache"
)

// Milestones of an agent's start on the node, in the order they happen.
const (
	PodCreated       = "pod created"
	PodScheduled     = "pod scheduled"
	ContainerRunning = "container running"
	PodReady         = "pod ready"
	NodeAllocatable  = "node allocatable"
)

// AgentStart records, from API watches, when the agent's DaemonSet pod reached each milestone and when the
// Node's allocatable first showed the agent's devices: what a user sees after `kubectl apply`.
type AgentStart struct {
	mu      sync.Mutex
	at      map[string]time.Time
	changed chan struct{}
	pod     string
}

// WatchAgentStart starts watching pods matching selector in namespace, and the Node, until ctx ends; n of
// resource in the Node's allocatable is the last milestone. Start it before the install is applied.
func (c *Cluster) WatchAgentStart(ctx context.Context, namespace, selector, resource string, n int64) *AgentStart {
	a := &AgentStart{at: map[string]time.Time{}, changed: make(chan struct{})}
	pods := cache.NewFilteredListWatchFromClient(c.Client.CoreV1().RESTClient(), "pods", namespace,
		func(o *metav1.ListOptions) { o.LabelSelector = selector })
	nodes := cache.NewListWatchFromClient(c.Client.CoreV1().RESTClient(), "nodes", "",
		fields.OneTermEqualSelector("metadata.name", c.cfg.NodeName))
	onPod := func(obj any) {
		p, ok := obj.(*corev1.Pod)
		if !ok {
			return
		}
		a.mark(PodCreated, p.Name)
		if p.Spec.NodeName != "" {
			a.mark(PodScheduled, p.Name)
		}
		if PodRunning(p) {
			a.mark(ContainerRunning, p.Name)
		}
		for _, cond := range p.Status.Conditions {
			if cond.Type == corev1.PodReady && cond.Status == corev1.ConditionTrue {
				a.mark(PodReady, p.Name)
			}
		}
	}
	onNode := func(obj any) {
		node, ok := obj.(*corev1.Node)
		if !ok {
			return
		}
		if q, ok := node.Status.Allocatable[corev1.ResourceName(resource)]; ok && q.Value() == n {
			a.mark(NodeAllocatable, "")
		}
	}
	for _, w := range []struct {
		lw     cache.ListerWatcher
		obj    runtime.Object
		handle func(any)
	}{{pods, &corev1.Pod{}, onPod}, {nodes, &corev1.Node{}, onNode}} {
		_, ctrl := cache.NewInformerWithOptions(cache.InformerOptions{
			ListerWatcher: w.lw,
			ObjectType:    w.obj,
			Handler: cache.ResourceEventHandlerFuncs{
				AddFunc:    w.handle,
				UpdateFunc: func(_, obj any) { w.handle(obj) },
			},
		})
		go ctrl.RunWithContext(ctx)
	}
	return a
}

func (a *AgentStart) mark(name, pod string) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, ok := a.at[name]; ok {
		return
	}
	a.at[name] = time.Now()
	if name == PodCreated {
		a.pod = pod
	}
	close(a.changed)
	a.changed = make(chan struct{})
}

// Wait blocks until milestone is seen or ctx ends.
func (a *AgentStart) Wait(ctx context.Context, milestone string) error {
	for {
		a.mu.Lock()
		_, ok := a.at[milestone]
		ch := a.changed
		a.mu.Unlock()
		if ok {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("agent start: %s not seen: %w (so far: %s)", milestone, ctx.Err(), a)
		case <-ch:
		}
	}
}

// At returns when milestone was seen.
func (a *AgentStart) At(milestone string) (time.Time, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	t, ok := a.at[milestone]
	return t, ok
}

// Since returns how long after the agent's pod was created milestone was seen (false if either was not).
func (a *AgentStart) Since(milestone string) (time.Duration, bool) {
	a.mu.Lock()
	defer a.mu.Unlock()
	t0, ok0 := a.at[PodCreated]
	t, ok := a.at[milestone]
	if !ok0 || !ok {
		return 0, false
	}
	return t.Sub(t0), true
}

// String lists the milestones seen, relative to the pod's creation.
func (a *AgentStart) String() string {
	var parts []string
	for _, m := range []string{PodCreated, PodScheduled, ContainerRunning, PodReady, NodeAllocatable} {
		if d, ok := a.Since(m); ok {
			parts = append(parts, fmt.Sprintf("%s +%s", m, d.Round(10*time.Millisecond)))
		}
	}
	a.mu.Lock()
	pod := a.pod
	a.mu.Unlock()
	return fmt.Sprintf("pod %s: %s", pod, strings.Join(parts, ", "))
}
