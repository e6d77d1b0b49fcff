package kube

import (
	"context"
	"encoding/json"
	"log/slog"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/kubernetes"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"
)

// OwnedLabelsAnnotation lists, comma-separated, the Node labels gpu-agent
// set. It is how the agent (also a new one after a restart or an upgrade)
// knows which labels are its own to change or remove: it never touches a
// label not listed there, even one with the same name set by someone else
// before it (GPU feature discovery, an admin).
const OwnedLabelsAnnotation = "gpu-agent.io/owned-labels"

// Publisher writes the agent's view of the node to the API: the labels it
// owns and Events. Calls never block the caller: a goroutine applies the
// latest wanted labels, retrying with backoff while the API is down or
// denies it, and logs each failure once per change.
type Publisher struct {
	client kubernetes.Interface
	node   string
	log    *slog.Logger
	errs   *errorLog

	recorder    record.EventRecorder
	broadcaster record.EventBroadcaster
	nodeRef     *corev1.ObjectReference

	mu     sync.Mutex
	want   map[string]string // nil: nothing asked yet
	wantCh chan struct{}
	// applied is what the node carries now, as far as we know (nil: not
	// known yet); written is when it was last seen to match want.
	applied map[string]string
	written time.Time
	// tracked are the other API users whose failures /status shows.
	tracked []*errorLog
	now     func() time.Time
}

// State is how the agent's use of the Kubernetes API goes, for /status.
type State struct {
	// API is "connecting" until the API server answered a call, then
	// "reachable", or "unreachable" while a call gets no answer from it (a
	// denial is an answer: Errors says what was refused).
	API string `json:"api"`
	// Errors are the calls that fail now: "<object>: <operation>: <error>".
	Errors []string `json:"errors,omitempty"`
	// Labels are the Node labels the agent owns.
	Labels *LabelState `json:"labels,omitempty"`
}

// Kubernetes API states (State.API).
const (
	APIConnecting  = "connecting"
	APIReachable   = "reachable"
	APIUnreachable = "unreachable"
	// APIStandalone is the agent's without an API (kube never says it).
	APIStandalone = "standalone"
)

// LabelState is the Node labels the agent owns: as written, or why not.
type LabelState struct {
	// Owned is how many labels the agent owns on its Node as last written.
	Owned int `json:"owned"`
	// Written is when the Node last carried the labels the agent wants
	// (zero: not yet).
	Written time.Time `json:"written,omitzero"`
	// Pending: the labels wanted differ from those written (not yet
	// written, or Error says why they cannot be).
	Pending bool   `json:"pending,omitempty"`
	Error   string `json:"error,omitempty"`
}

// APIUser is a watcher whose API failures /status shows beside the
// publisher's (Publisher.Track).
type APIUser interface{ apiLog() *errorLog }

// NewPublisher publishes for node.
func NewPublisher(client kubernetes.Interface, node string, log *slog.Logger) *Publisher {
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	b := record.NewBroadcaster(record.WithContext(context.Background()))
	p := &Publisher{
		client: client, node: node, log: log, errs: newErrorLog(log, "node "+node),
		broadcaster: b,
		recorder:    b.NewRecorder(clientgoscheme.Scheme, corev1.EventSource{Component: "gpu-agent", Host: node}),
		// Events are about the Node; its UID is filled in once read, and
		// Events without it still show on `kubectl describe node`.
		nodeRef: &corev1.ObjectReference{Kind: "Node", Name: node, APIVersion: "v1"},
		wantCh:  make(chan struct{}, 1),
		now:     time.Now,
	}
	return p
}

// SetLabels asks for the owned labels to be exactly want: labels the agent
// set earlier and want lacks are removed, others are left alone.
func (p *Publisher) SetLabels(want map[string]string) {
	p.mu.Lock()
	same := p.want != nil && maps.Equal(p.want, want)
	p.want = maps.Clone(want)
	if p.want == nil {
		p.want = map[string]string{}
	}
	p.mu.Unlock()
	if same {
		return
	}
	select {
	case p.wantCh <- struct{}{}:
	default:
	}
}

// Event records a Node Event. The recorder aggregates repeats and rate
// limits per reason (client-go's spam filter), so a flapping condition
// cannot flood the API server.
func (p *Publisher) Event(warning bool, reason, message string) {
	typ := corev1.EventTypeNormal
	if warning {
		typ = corev1.EventTypeWarning
	}
	p.mu.Lock()
	ref := *p.nodeRef
	p.mu.Unlock()
	p.recorder.Event(&ref, typ, reason, message)
}

// ObjectEvent records an Event about another object of the node (a pod),
// through the same recorder and spam filter as the Node's.
func (p *Publisher) ObjectEvent(ref *corev1.ObjectReference, warning bool, reason, message string) {
	typ := corev1.EventTypeNormal
	if warning {
		typ = corev1.EventTypeWarning
	}
	p.recorder.Event(ref, typ, reason, message)
}

// Track adds watchers whose API failures State reports.
func (p *Publisher) Track(users ...APIUser) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, u := range users {
		p.tracked = append(p.tracked, u.apiLog())
	}
}

// State says how the API calls go and where the owned labels stand.
func (p *Publisher) State() State {
	p.mu.Lock()
	logs := append([]*errorLog{p.errs}, p.tracked...)
	labels := &LabelState{Owned: len(p.applied), Written: p.written,
		Pending: p.want != nil && (p.applied == nil || !maps.Equal(p.want, p.applied))}
	p.mu.Unlock()
	st := State{API: APIConnecting, Labels: labels}
	answered, unreachable := false, false
	for _, l := range logs {
		a, u, failure := l.snapshot()
		answered, unreachable = answered || a, unreachable || u
		if failure != "" {
			st.Errors = append(st.Errors, failure)
		}
	}
	labels.Error = p.errs.current()
	switch {
	case unreachable:
		st.API = APIUnreachable
	case answered:
		st.API = APIReachable
	}
	return st
}

// Run applies wanted labels until ctx ends.
func (p *Publisher) Run(ctx context.Context) error {
	stop := p.broadcaster.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: p.client.CoreV1().Events("")})
	defer stop.Stop()
	defer p.broadcaster.Shutdown()
	backoff := time.Second
	retry := time.NewTimer(time.Hour)
	retry.Stop()
	defer retry.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-p.wantCh:
		case <-retry.C:
		}
		if err := p.apply(ctx); err != nil {
			if ctx.Err() != nil {
				return nil
			}
			p.errs.failed("label node", err)
			retry.Reset(backoff)
			backoff = min(2*backoff, 2*time.Minute)
			continue
		}
		p.errs.ok()
		backoff = time.Second
	}
}

// apply makes the node's owned labels match the wanted ones with one merge
// patch (labels and the ownership annotation together, so they never
// disagree), guarded by the node's resourceVersion.
func (p *Publisher) apply(ctx context.Context) error {
	p.mu.Lock()
	want := maps.Clone(p.want)
	p.mu.Unlock()
	if want == nil {
		return nil
	}
	node, err := p.client.CoreV1().Nodes().Get(ctx, p.node, metav1.GetOptions{})
	if err != nil {
		return err
	}
	p.mu.Lock()
	p.nodeRef = &corev1.ObjectReference{Kind: "Node", Name: node.Name, UID: node.UID, APIVersion: "v1"}
	p.mu.Unlock()
	owned := ownedLabels(node)
	patch, changed := labelPatch(node.Labels, owned, want)
	if !changed {
		p.setState(want)
		return nil
	}
	patch["metadata"].(map[string]any)["resourceVersion"] = node.ResourceVersion
	body, err := json.Marshal(patch)
	if err != nil {
		return err
	}
	_, err = p.client.CoreV1().Nodes().Patch(ctx, p.node, types.MergePatchType, body, metav1.PatchOptions{FieldManager: "gpu-agent"})
	if apierrors.IsConflict(err) {
		// The node changed under us: read it again at once.
		select {
		case p.wantCh <- struct{}{}:
		default:
		}
		return nil
	}
	if err != nil {
		return err
	}
	p.setState(want)
	p.log.Info("node labels updated", "node", p.node, "labels", len(want))
	return nil
}

func (p *Publisher) setState(applied map[string]string) {
	p.mu.Lock()
	p.applied = applied
	p.written = p.now()
	p.mu.Unlock()
}

// ownedLabels reads the ownership annotation.
func ownedLabels(n *corev1.Node) []string {
	v := n.Annotations[OwnedLabelsAnnotation]
	if v == "" {
		return nil
	}
	return strings.Split(v, ",")
}

// labelPatch is the merge patch that sets want and removes owned labels want
// lacks; changed is false when the node already matches. Labels neither
// owned nor wanted are never in it.
func labelPatch(current map[string]string, owned []string, want map[string]string) (map[string]any, bool) {
	labels := map[string]any{}
	for k, v := range want {
		if cur, ok := current[k]; !ok || cur != v {
			labels[k] = v
		}
	}
	for _, k := range owned {
		if _, still := want[k]; !still {
			if _, present := current[k]; present {
				labels[k] = nil // merge patch: remove
			}
		}
	}
	newOwned := strings.Join(slices.Sorted(maps.Keys(want)), ",")
	oldOwned := strings.Join(slices.Sorted(slices.Values(owned)), ",")
	meta := map[string]any{}
	if len(labels) > 0 {
		meta["labels"] = labels
	}
	if newOwned != oldOwned {
		if newOwned == "" {
			meta["annotations"] = map[string]any{OwnedLabelsAnnotation: nil}
		} else {
			meta["annotations"] = map[string]any{OwnedLabelsAnnotation: newOwned}
		}
	}
	if len(meta) == 0 {
		return nil, false
	}
	return map[string]any{"metadata": meta}, true
}

// RemoveOwned removes every label gpu-agent owns from node, and the
// ownership annotation (uninstall: `gpu-agent node-cleanup`).
func RemoveOwned(ctx context.Context, client kubernetes.Interface, node string) (int, error) {
	n, err := client.CoreV1().Nodes().Get(ctx, node, metav1.GetOptions{})
	if err != nil {
		return 0, err
	}
	owned := ownedLabels(n)
	patch, changed := labelPatch(n.Labels, owned, nil)
	if !changed {
		return 0, nil
	}
	patch["metadata"].(map[string]any)["resourceVersion"] = n.ResourceVersion
	body, err := json.Marshal(patch)
	if err != nil {
		return 0, err
	}
	if _, err := client.CoreV1().Nodes().Patch(ctx, node, types.MergePatchType, body, metav1.PatchOptions{FieldManager: "gpu-agent"}); err != nil {
		return 0, err
	}
	return len(owned), nil
}
