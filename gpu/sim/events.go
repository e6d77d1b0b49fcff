package sim

import (
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/NVIDIA/go-nvml/pkg/nvml/mock"
)

// maxQueuedEvents bounds each event set's queue, as the driver's buffer is
// bounded: when nobody waits, the oldest events are dropped.
const maxQueuedEvents = 1024

// eventSet is an nvml.EventSet. Its queue and registrations are guarded by
// Node.mu; notify wakes a waiter without holding the lock.
type eventSet struct {
	mockEventSet
	n     *Node
	reg   map[int]uint64 // GPU index → registered event types
	queue []nvml.EventData
	freed bool
	// blocked counts the Waits asleep on notify, so that a test can wake
	// one it knows is blocked rather than sleep and hope.
	blocked int
	notify  chan struct{} // capacity 1
	done    chan struct{} // closed by Free
}

type mockEventSet struct{ *mock.EventSet }

var _ nvml.EventSet = (*eventSet)(nil)

func newEventSet(n *Node) *eventSet {
	s := &eventSet{
		mockEventSet: mockEventSet{&mock.EventSet{}},
		n:            n, reg: map[int]uint64{},
		notify: make(chan struct{}, 1), done: make(chan struct{}),
	}
	FillNotSupported(s.EventSet)
	return s
}

// Wait returns the oldest queued event, or waits up to timeoutMs for one
// and returns ERROR_TIMEOUT. The timeout runs on the wall clock, not the
// node's injected clock. After Free it returns ERROR_INVALID_ARGUMENT,
// which also wakes a Wait in progress.
func (s *eventSet) Wait(timeoutMs uint32) (nvml.EventData, nvml.Return) {
	var timer *time.Timer
	for {
		s.n.mu.Lock()
		r := s.n.ready()
		if r == nvml.SUCCESS && s.freed {
			r = nvml.ERROR_INVALID_ARGUMENT
		}
		if r == nvml.SUCCESS && len(s.queue) > 0 {
			e := s.queue[0]
			s.queue[0] = nvml.EventData{}
			s.queue = s.queue[1:]
			s.n.mu.Unlock()
			return e, nvml.SUCCESS
		}
		if r != nvml.SUCCESS {
			s.n.mu.Unlock()
			return nvml.EventData{}, r
		}
		s.blocked++
		s.n.mu.Unlock()
		if timer == nil {
			timer = time.NewTimer(time.Duration(timeoutMs) * time.Millisecond)
			defer timer.Stop()
		}
		timedOut := false
		select {
		case <-s.notify:
		case <-s.done:
		case <-timer.C:
			timedOut = true
		}
		s.n.mu.Lock()
		s.blocked--
		s.n.mu.Unlock()
		if timedOut {
			return nvml.EventData{}, nvml.ERROR_TIMEOUT
		}
	}
}

// blockedWaits is how many Waits are asleep until an event, Free or their
// timeout wakes them.
func (s *eventSet) blockedWaits() int {
	s.n.mu.Lock()
	defer s.n.mu.Unlock()
	return s.blocked
}

// Free releases the set; further calls on it are invalid.
func (s *eventSet) Free() nvml.Return {
	s.n.mu.Lock()
	defer s.n.mu.Unlock()
	if r := s.n.ready(); r != nvml.SUCCESS {
		return r
	}
	if s.freed {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	s.freed = true
	s.queue = nil
	close(s.done)
	delete(s.n.sets, s)
	return nvml.SUCCESS
}

// deliver queues e on every set that registered its GPU for its type;
// callers hold n.mu.
func (n *Node) deliver(gpu int, e nvml.EventData) {
	for s := range n.sets {
		if s.reg[gpu]&e.EventType == 0 {
			continue
		}
		if len(s.queue) >= maxQueuedEvents {
			s.queue = s.queue[1:]
		}
		s.queue = append(s.queue, e)
		select {
		case s.notify <- struct{}{}:
		default:
		}
	}
}
