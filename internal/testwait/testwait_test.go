package testwait

import (
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
)

// fatalRecorder is a testing.TB whose Fatalf records the message and ends
// the goroutine, as the real one does.
type fatalRecorder struct {
	testing.TB
	msg string
}

func (f *fatalRecorder) Helper() {}

func (f *fatalRecorder) Fatalf(format string, args ...any) {
	f.msg = fmt.Sprintf(format, args...)
	panic(f)
}

// run calls fn with a recorder and reports what it failed with ("" if not).
func run(fn func(tb testing.TB)) (msg string) {
	f := &fatalRecorder{}
	defer func() {
		if r := recover(); r != nil {
			if r != f {
				panic(r)
			}
			msg = f.msg
		}
	}()
	fn(f)
	return ""
}

func TestForReturnsOnceTheConditionHolds(t *testing.T) {
	var calls atomic.Int32
	if msg := run(func(tb testing.TB) { For(tb, "third call", func() bool { return calls.Add(1) == 3 }) }); msg != "" {
		t.Fatalf("For failed: %s", msg)
	}
	if got := calls.Load(); got != 3 {
		t.Errorf("cond called %d times, want 3", got)
	}
}

func TestReceiveSkipsUntilAccepted(t *testing.T) {
	ch := make(chan int, 3)
	ch <- 1
	ch <- 2
	ch <- 3
	var got int
	if msg := run(func(tb testing.TB) { got = Receive(tb, "an even number", ch, func(v int) bool { return v%2 == 0 }) }); msg != "" {
		t.Fatalf("Receive failed: %s", msg)
	}
	if got != 2 {
		t.Errorf("Receive = %d, want 2", got)
	}
}

func TestReceiveFailsOnClose(t *testing.T) {
	ch := make(chan int)
	close(ch)
	msg := run(func(tb testing.TB) { Receive(tb, "a value", ch, func(int) bool { return true }) })
	if !strings.Contains(msg, "a value") {
		t.Errorf("Receive on a closed channel failed with %q, want it to name what was awaited", msg)
	}
}
