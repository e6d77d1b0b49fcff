package kube

import (
	"context"
	"encoding/json"
	"errors"
	"maps"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/internal/testwait"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/version"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/kubernetes/fake"
	k8stesting "k8s.io/client-go/testing"
	"k8s.io/client-go/tools/cache"
)

func TestLabelPatch(t *testing.T) {
	tests := []struct {
		name    string
		current map[string]string
		owned   []string
		want    map[string]string
		patch   string // labels part, "" = no change
	}{
		{name: "first labels", current: map[string]string{"kubernetes.io/hostname": "n"},
			want: map[string]string{"nvidia.com/gpu.count": "8"}, patch: `{"metadata":{"annotations":{"gpu-agent.io/owned-labels":"nvidia.com/gpu.count"},"labels":{"nvidia.com/gpu.count":"8"}}}`},
		{name: "nothing changed", current: map[string]string{"nvidia.com/gpu.count": "8"}, owned: []string{"nvidia.com/gpu.count"},
			want: map[string]string{"nvidia.com/gpu.count": "8"}},
		{name: "a label no longer applies", current: map[string]string{"nvidia.com/gpu.count": "8", "nvidia.com/mig-1g.5gb.count": "7"},
			owned: []string{"nvidia.com/gpu.count", "nvidia.com/mig-1g.5gb.count"}, want: map[string]string{"nvidia.com/gpu.count": "8"},
			patch: `{"metadata":{"annotations":{"gpu-agent.io/owned-labels":"nvidia.com/gpu.count"},"labels":{"nvidia.com/mig-1g.5gb.count":null}}}`},
		{name: "labels not owned are never touched", current: map[string]string{"nvidia.com/gpu.machine": "DGX", "team": "ml"},
			want: nil},
		{name: "uninstall removes owned ones and the annotation", current: map[string]string{"nvidia.com/gpu.count": "8", "team": "ml"},
			owned: []string{"nvidia.com/gpu.count"}, want: nil,
			patch: `{"metadata":{"annotations":{"gpu-agent.io/owned-labels":null},"labels":{"nvidia.com/gpu.count":null}}}`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, changed := labelPatch(tt.current, tt.owned, tt.want)
			if tt.patch == "" {
				if changed {
					t.Fatalf("patch %v, want none", p)
				}
				return
			}
			if got := mustJSON(t, p); got != tt.patch {
				t.Errorf("patch\n%s\nwant\n%s", got, tt.patch)
			}
		})
	}
}

func newNode(labels map[string]string) *corev1.Node {
	return &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "gpu-1", Labels: labels, UID: "uid-1"}}
}

// watching returns a channel closed once the client has a watch open: the
// fake clientset does not replay changes made before a watch starts.
func watching(client *fake.Clientset, resource string) <-chan struct{} {
	ch := make(chan struct{})
	var once sync.Once
	client.PrependWatchReactor(resource, func(k8stesting.Action) (bool, watch.Interface, error) {
		once.Do(func() { close(ch) })
		return false, nil, nil
	})
	return ch
}

// next takes the next value from ch, failing after a bound.
func next[T any](t *testing.T, ch <-chan T) T {
	t.Helper()
	select {
	case v := <-ch:
		return v
	case <-time.After(10 * time.Second):
		t.Fatal("nothing delivered in 10s")
	}
	var zero T
	return zero
}

func runPublisher(t *testing.T, client *fake.Clientset) *Publisher {
	t.Helper()
	p := NewPublisher(client, "gpu-1", nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = p.Run(ctx) }()
	t.Cleanup(func() { cancel(); <-done })
	return p
}

func nodeLabels(t *testing.T, client *fake.Clientset) map[string]string {
	t.Helper()
	n, err := client.CoreV1().Nodes().Get(context.Background(), "gpu-1", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	return n.Labels
}

// The agent owns its labels: it sets them, removes them when they no longer
// apply, and never touches labels it did not set.
func TestPublisherOwnsItsLabels(t *testing.T) {
	client := fake.NewClientset(newNode(map[string]string{"team": "ml", "nvidia.com/gpu.machine": "DGX-A100"}))
	p := runPublisher(t, client)
	p.SetLabels(map[string]string{"nvidia.com/gpu.count": "8", "nvidia.com/mig-1g.5gb.count": "56"})
	testwait.For(t, "labels set", func() bool { return nodeLabels(t, client)["nvidia.com/mig-1g.5gb.count"] == "56" })
	p.SetLabels(map[string]string{"nvidia.com/gpu.count": "8"})
	testwait.For(t, "stale label removed", func() bool { _, ok := nodeLabels(t, client)["nvidia.com/mig-1g.5gb.count"]; return !ok })
	want := map[string]string{"team": "ml", "nvidia.com/gpu.machine": "DGX-A100", "nvidia.com/gpu.count": "8"}
	if got := nodeLabels(t, client); !maps.Equal(got, want) {
		t.Errorf("labels %v, want %v", got, want)
	}
	// A new agent (after a restart) finds what the last one owned.
	removed, err := RemoveOwned(context.Background(), client, "gpu-1")
	if err != nil || removed != 1 {
		t.Fatalf("RemoveOwned: %d, %v", removed, err)
	}
	if got := nodeLabels(t, client); !maps.Equal(got, map[string]string{"team": "ml", "nvidia.com/gpu.machine": "DGX-A100"}) {
		t.Errorf("after uninstall: %v", got)
	}
}

// Patching denied (RBAC revoked): the publisher says so, keeps trying, and
// applies once allowed; the caller is never blocked.
func TestPublisherDeniedThenAllowed(t *testing.T) {
	client := fake.NewClientset(newNode(nil))
	var mu sync.Mutex
	deny := true
	client.PrependReactor("patch", "nodes", func(k8stesting.Action) (bool, runtime.Object, error) {
		mu.Lock()
		defer mu.Unlock()
		if deny {
			return true, nil, apierrors.NewForbidden(schema.GroupResource{Resource: "nodes"}, "gpu-1", errors.New("RBAC: patch nodes not allowed"))
		}
		return false, nil, nil
	})
	p := runPublisher(t, client)
	p.SetLabels(map[string]string{"nvidia.com/gpu.present": "true"})
	testwait.For(t, "denial reported", func() bool { return strings.Contains(p.State().Labels.Error, "forbidden") })
	// A denial is an answer: the API is reachable, the labels are not written.
	if st := p.State(); st.API != APIReachable || len(st.Errors) != 1 || !strings.HasPrefix(st.Errors[0], "node gpu-1: label node: ") || !st.Labels.Pending {
		t.Errorf("denied: state %+v, labels %+v; want reachable, the denial listed, labels pending", st, st.Labels)
	}
	mu.Lock()
	deny = false
	mu.Unlock()
	testwait.For(t, "applied after the denial ends", func() bool { return nodeLabels(t, client)["nvidia.com/gpu.present"] == "true" })
	testwait.For(t, "state recovers", func() bool {
		l := p.State().Labels
		return l.Owned == 1 && !l.Pending && l.Error == "" && !l.Written.IsZero()
	})
	if st := p.State(); st.API != APIReachable || len(st.Errors) != 0 {
		t.Errorf("recovered: state %+v", st)
	}
}

// State says whether the API answers, every call failing now (the
// watchers' too) and where the owned labels stand.
func TestPublisherState(t *testing.T) {
	written := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	denied := apierrors.NewForbidden(schema.GroupResource{Resource: "nodes"}, "gpu-1", errors.New("no"))
	refused := errors.New("dial tcp 10.0.0.1:443: connect: connection refused")
	type step func(p *Publisher, nodes, cms *errorLog)
	tests := []struct {
		name   string
		steps  []step
		api    string
		errors []string // each error contains one of these, in order
		labels LabelState
	}{
		{name: "nothing asked or answered yet", api: APIConnecting},
		{name: "labels wanted, none written yet", api: APIConnecting, labels: LabelState{Pending: true},
			steps: []step{func(p *Publisher, _, _ *errorLog) { p.SetLabels(map[string]string{"a": "1"}) }}},
		{name: "labels written", api: APIReachable, labels: LabelState{Owned: 1, Written: written},
			steps: []step{func(p *Publisher, _, _ *errorLog) {
				p.SetLabels(map[string]string{"a": "1"})
				p.setState(map[string]string{"a": "1"})
				p.errs.ok()
			}}},
		{name: "label write denied: reachable, not written", api: APIReachable,
			errors: []string{"node gpu-1: label node: nodes \"gpu-1\" is forbidden"},
			labels: LabelState{Pending: true, Error: `nodes "gpu-1" is forbidden: no`},
			steps: []step{func(p *Publisher, _, _ *errorLog) {
				p.SetLabels(map[string]string{"a": "1"})
				p.errs.failed("label node", denied)
			}}},
		{name: "the API server cannot be reached", api: APIUnreachable,
			errors: []string{"node gpu-1: label node: dial tcp", "configmap gpu-agent/cfg: watch: dial tcp"},
			labels: LabelState{Owned: 1, Written: written, Pending: true, Error: refused.Error()},
			steps: []step{func(p *Publisher, nodes, cms *errorLog) {
				p.setState(map[string]string{"a": "1"})
				p.SetLabels(map[string]string{"a": "2"})
				p.errs.failed("label node", refused)
				cms.failed("watch", refused)
				nodes.ok()
			}}},
		{name: "a watcher fails, the labels are written", api: APIReachable,
			errors: []string{"node gpu-1: watch: nodes \"gpu-1\" is forbidden"}, labels: LabelState{Owned: 1, Written: written},
			steps: []step{func(p *Publisher, nodes, _ *errorLog) {
				p.SetLabels(map[string]string{"a": "1"})
				p.setState(map[string]string{"a": "1"})
				p.errs.ok()
				nodes.failed("watch", denied)
			}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			client := fake.NewClientset()
			p := NewPublisher(client, "gpu-1", nil)
			p.now = func() time.Time { return written }
			nodes := NewNodeWatcher(client, "gpu-1", func(NodeInfo) {}, nil)
			cms := NewConfigMapWatcher(client, "gpu-agent", "cfg", func(map[string]string, bool) {}, nil)
			p.Track(nodes, cms)
			for _, s := range tt.steps {
				s(p, nodes.errs, cms.errs)
			}
			st := p.State()
			if st.API != tt.api {
				t.Errorf("api %q, want %q", st.API, tt.api)
			}
			if len(st.Errors) != len(tt.errors) {
				t.Errorf("errors %q, want %d", st.Errors, len(tt.errors))
			}
			for i := range min(len(st.Errors), len(tt.errors)) {
				if !strings.Contains(st.Errors[i], tt.errors[i]) {
					t.Errorf("error %d = %q, want it to contain %q", i, st.Errors[i], tt.errors[i])
				}
			}
			if *st.Labels != tt.labels {
				t.Errorf("labels %+v, want %+v", *st.Labels, tt.labels)
			}
		})
	}
}

// The node watcher reports the labels and the cordon annotation of its own
// node only, once per change of either.
func TestNodeWatcherReportsLabels(t *testing.T) {
	client := fake.NewClientset(newNode(map[string]string{"a": "1"}),
		&corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: "other", Labels: map[string]string{"b": "2"}}})
	got := make(chan NodeInfo, 10)
	open := watching(client, "nodes")
	w := NewNodeWatcher(client, "gpu-1", func(n NodeInfo) { got <- n }, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	defer func() { cancel(); <-done }()
	if n := next(t, got); !maps.Equal(n.Labels, map[string]string{"a": "1"}) || n.Cordon != "" {
		t.Fatalf("first node info %+v", n)
	}
	next(t, open)
	n := newNode(map[string]string{"a": "1", "nvidia.com/mig.config": "all-1g.10gb"})
	if _, err := client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if n := next(t, got); n.Labels["nvidia.com/mig.config"] != "all-1g.10gb" {
		t.Fatalf("after the label change %+v", n)
	}
	n.Annotations = map[string]string{CordonAnnotation: "1"}
	if _, err := client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if n := next(t, got); n.Cordon != "1" || n.Labels["nvidia.com/mig.config"] != "all-1g.10gb" {
		t.Fatalf("after the annotation %+v", n)
	}
	// Another annotation alone is no news.
	n.Annotations["x"] = "y"
	if _, err := client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	delete(n.Annotations, CordonAnnotation)
	if _, err := client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if n := next(t, got); n.Cordon != "" {
		t.Fatalf("after the annotation's removal %+v (an unrelated annotation was delivered?)", n)
	}
	// The same node under another UID (deleted and created again) is news
	// even with the same labels: the agent's ResourceSlices were owned by
	// the old one.
	n.UID = "uid-again"
	if _, err := client.CoreV1().Nodes().Update(ctx, n, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if n := next(t, got); n.UID != "uid-again" || n.Labels["nvidia.com/mig.config"] != "all-1g.10gb" {
		t.Fatalf("after the Node came back under another UID %+v", n)
	}
}

func TestSplitCordon(t *testing.T) {
	for _, tt := range []struct {
		in   string
		want []string
	}{
		{"", nil},
		{" , ,", nil},
		{"0", []string{"0"}},
		{"GPU-a, 1,GPU-a ,,2", []string{"GPU-a", "1", "2"}},
	} {
		if got := SplitCordon(tt.in); !slices.Equal(got, tt.want) {
			t.Errorf("SplitCordon(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

// EditCordon writes the edited list, removes an emptied annotation, and
// leaves the node's other annotations alone.
func TestEditCordon(t *testing.T) {
	node := newNode(nil)
	node.Annotations = map[string]string{"keep": "me"}
	client := fake.NewClientset(node)
	ctx := context.Background()
	annotations := func() map[string]string {
		n, err := client.CoreV1().Nodes().Get(ctx, "gpu-1", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		return n.Annotations
	}
	add := func(gpus ...string) func([]string) []string {
		return func(l []string) []string { return SplitCordon(strings.Join(append(l, gpus...), ",")) }
	}
	for _, tt := range []struct {
		edit func([]string) []string
		want string // "" : no annotation
	}{
		{add("1"), "1"},
		{add("GPU-x", "1"), "1,GPU-x"},
		{func(l []string) []string { return slices.DeleteFunc(l, func(s string) bool { return s == "1" }) }, "GPU-x"},
		{func([]string) []string { return nil }, ""},
	} {
		got, err := EditCordon(ctx, client, "gpu-1", tt.edit)
		if err != nil {
			t.Fatal(err)
		}
		a := annotations()
		v, ok := a[CordonAnnotation]
		if v != tt.want || ok != (tt.want != "") || strings.Join(got, ",") != tt.want {
			t.Fatalf("annotation %q (present %v), returned %q, want %q", v, ok, got, tt.want)
		}
		if a["keep"] != "me" {
			t.Fatalf("other annotations changed: %v", a)
		}
	}
	if _, err := EditCordon(ctx, client, "nope", add("1")); err == nil || !strings.Contains(err.Error(), "node nope") {
		t.Fatalf("unknown node: %v", err)
	}
}

// The ConfigMap watcher delivers the data, and says when it is deleted.
func TestConfigMapWatcher(t *testing.T) {
	cm := &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Namespace: "gpu-agent", Name: "cfg"}, Data: map[string]string{"config.yaml": "version: v1\n"}}
	client := fake.NewClientset(cm)
	type update struct {
		data    map[string]string
		deleted bool
	}
	got := make(chan update, 10)
	open := watching(client, "configmaps")
	w := NewConfigMapWatcher(client, "gpu-agent", "cfg", func(d map[string]string, del bool) { got <- update{d, del} }, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); _ = w.Run(ctx) }()
	defer func() { cancel(); <-done }()
	if u := next(t, got); u.deleted || u.data["config.yaml"] != "version: v1\n" {
		t.Fatalf("first %+v", u)
	}
	next(t, open)
	cm = cm.DeepCopy()
	cm.Data["a100"] = "x"
	cm.ResourceVersion = "2"
	if _, err := client.CoreV1().ConfigMaps("gpu-agent").Update(ctx, cm, metav1.UpdateOptions{}); err != nil {
		t.Fatal(err)
	}
	if u := next(t, got); u.data["a100"] != "x" {
		t.Fatalf("after the edit %+v", u)
	}
	if err := client.CoreV1().ConfigMaps("gpu-agent").Delete(ctx, "cfg", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
	if u := next(t, got); !u.deleted {
		t.Fatalf("after the delete %+v", u)
	}
}

func TestParseConfigMapRef(t *testing.T) {
	for _, bad := range []string{"", "cfg", "/cfg", "ns/", "a/b/c"} {
		if _, _, err := ParseConfigMapRef(bad); err == nil {
			t.Errorf("%q accepted", bad)
		}
	}
	if ns, n, err := ParseConfigMapRef("gpu-agent/config"); err != nil || ns != "gpu-agent" || n != "config" {
		t.Errorf("gpu-agent/config: %s %s %v", ns, n, err)
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

// stuckInformer does not watch its context, as client-go's watch-list
// retry does while it sleeps its backoff.
type stuckInformer struct {
	cache.SharedIndexInformer
	running chan struct{}
}

func (s *stuckInformer) RunWithContext(context.Context) {
	close(s.running)
	select {}
}

// A watcher told to stop returns at once, whatever its informer is doing:
// an agent stopping while the API server is down must not wait out a 30 s
// backoff.
func TestRunInformerReturnsAtStop(t *testing.T) {
	inf := &stuckInformer{running: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); runInformer(ctx, inf) }()
	<-inf.running
	select {
	case <-done:
		t.Fatal("returned before its context ended")
	default:
	}
	cancel()
	next(t, done)
}

// The version watcher hands on the API server's version at start and again
// only when it changes; a failed read is retried after Retry, not Every.
func TestVersionWatcher(t *testing.T) {
	disc := &fakeVersions{answers: []any{"v1.36.3", errors.New("connection refused"), "v1.36.3", "v1.37.2"}}
	var got []string
	var waits []time.Duration
	ctx, cancel := context.WithCancel(context.Background())
	w := NewVersionWatcher(disc, func(v string) { got = append(got, v) }, nil)
	w.After = func(d time.Duration) <-chan time.Time {
		waits = append(waits, d)
		if len(waits) == len(disc.answers) {
			cancel()
			return nil // never: the watcher ends on ctx
		}
		c := make(chan time.Time, 1)
		c <- time.Time{}
		return c
	}
	if err := w.Run(ctx); err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, []string{"v1.36.3", "v1.37.2"}) {
		t.Errorf("versions handed on: %v, want v1.36.3 then v1.37.2", got)
	}
	if want := []time.Duration{10 * time.Minute, 10 * time.Second, 10 * time.Minute, 10 * time.Minute}; !slices.Equal(waits, want) {
		t.Errorf("waits %v, want %v", waits, want)
	}
}

// fakeVersions answers ServerVersion from answers in turn: a version
// string, or an error.
type fakeVersions struct {
	answers []any
	n       int
}

func (f *fakeVersions) ServerVersion() (*version.Info, error) {
	a := f.answers[min(f.n, len(f.answers)-1)]
	f.n++
	if err, ok := a.(error); ok {
		return nil, err
	}
	return &version.Info{GitVersion: a.(string)}, nil
}
