package agent

import (
	"sync"
	"time"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/health"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// Event is one input of the loop. Every producer (config watcher, node
// labels, health watcher, MPS supervisor, plugin, pod-resources, ticker)
// posts to one Inbox; the loop is the only reader.
type Event interface {
	// kind names the event in logs, metrics and tests; events of a
	// coalescing kind replace an unread one of the same kind.
	kind() string
}

// ConfigChanged carries new config content from one source.
type ConfigChanged struct {
	Update config.Update
	Source ConfigSource
}

// ConfigSource says where config content came from. With both, the API wins
// and the mounted file is the fallback: the API sees an edit at once, a
// mounted volume only when the kubelet syncs it (a minute or more).
type ConfigSource string

// Config sources.
const (
	SourceFile ConfigSource = "" // --config (the default)
	SourceAPI  ConfigSource = "api"
)

// LabelsChanged carries the node's labels (from the Kubernetes API).
type LabelsChanged struct{ Labels map[string]string }

// HealthChanged carries the health watcher's new state.
type HealthChanged struct{ State *health.State }

// MPSChanged says some MPS daemon's health changed.
type MPSChanged struct{}

// Allocated says the plugin handed these device IDs to a container.
type Allocated struct {
	Resource string
	IDs      []string
}

// HoldingsChanged carries an unsolicited pod-resources answer (the
// background refresh): who holds what, for status, metrics and withdrawing
// released devices, and to settle the allocation ledger (Answered). It
// never authorises destroying anything: only an answer the loop asked for
// itself does.
type HoldingsChanged struct {
	Attribution *podresources.Attribution
	// Answered is when the kubelet's answer came back (zero: unknown). An
	// allocation made recentSettle before it is accounted for by it.
	Answered time.Time
}

// HoldingsAnswer is the kubelet's answer to the loop's own pod-resources
// request (askHoldings), made off the loop. A successful one asked at Asked
// settles the allocations made recentSettle before, and lets the pass of
// its batch destroy MIG devices it does not list.
type HoldingsAnswer struct {
	Attribution *podresources.Attribution
	Err         error
	Asked       time.Time
}

// Tick is the periodic resync: read the GPUs again even without events.
type Tick struct{}

func (e ConfigChanged) kind() string { return "config/" + string(e.Source) }
func (LabelsChanged) kind() string   { return "labels" }
func (HealthChanged) kind() string   { return "health" }
func (MPSChanged) kind() string      { return "mps" }
func (Allocated) kind() string       { return "allocated" }
func (HoldingsChanged) kind() string { return "holdings" }
func (HoldingsAnswer) kind() string  { return "holdings-answer" }
func (Tick) kind() string            { return "tick" }

// Inbox is the loop's one queue. Post never blocks and the queue is bounded:
// state events (config, labels, health, MPS, holdings, tick) replace an
// unread one of their kind, because only the latest matters, allocations
// merge into one event whose IDs are de-duplicated (they are devices the
// catalog offered, so their number is bounded by the catalog), and DRA
// requests queue as they come.
type Inbox struct {
	mu      sync.Mutex
	pending []Event
	wake    chan struct{}
}

// NewInbox returns an empty inbox.
func NewInbox() *Inbox {
	return &Inbox{wake: make(chan struct{}, 1)}
}

// Post queues e for the loop; safe from any goroutine.
func (b *Inbox) Post(e Event) {
	b.mu.Lock()
	b.pending = coalesce(b.pending, e)
	b.mu.Unlock()
	select {
	case b.wake <- struct{}{}:
	default: // a wake-up is pending; Drain takes everything queued
	}
}

func coalesce(q []Event, e Event) []Event {
	switch e.(type) {
	case ClaimsPrepare, ClaimsUnprepare:
		// Requests, each with a caller waiting for its answer: never
		// merged. The kubelet plugin helper serializes them, so at most a
		// few wait.
		return append(q, e)
	}
	for i, old := range q {
		if old.kind() != e.kind() {
			continue
		}
		if a, ok := e.(Allocated); ok {
			q[i] = mergeAllocated(old.(Allocated), a)
			return q
		}
		// Keep the queue's order of first arrival: the loop handles kinds
		// in a fixed order anyway (see step).
		q[i] = e
		return q
	}
	return append(q, e)
}

func mergeAllocated(a, b Allocated) Allocated {
	seen := make(map[string]bool, len(a.IDs)+len(b.IDs))
	ids := make([]string, 0, len(a.IDs)+len(b.IDs))
	for _, id := range append(append([]string(nil), a.IDs...), b.IDs...) {
		if !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	res := a.Resource
	if res != b.Resource {
		res = "" // several resources: the IDs say enough
	}
	return Allocated{Resource: res, IDs: ids}
}

// Wake is signalled when events are waiting.
func (b *Inbox) Wake() <-chan struct{} { return b.wake }

// Drain takes every queued event.
func (b *Inbox) Drain() []Event {
	b.mu.Lock()
	defer b.mu.Unlock()
	q := b.pending
	b.pending = nil
	return q
}

// Len is how many events wait (for tests).
func (b *Inbox) Len() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.pending)
}
