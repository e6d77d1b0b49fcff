// Package testwait lets a test wait for what another goroutine brings about
// (a state published, a socket served, a file written) instead of sleeping
// for a fixed time. A condition that already holds costs nothing; one that
// never comes fails the test after a deadline generous enough for a busy
// machine, naming what was awaited.
package testwait

import (
	"testing"
	"time"
)

// Deadline is how long For and Receive wait before failing. It is long
// because it is only reached by a test that fails anyway: CI machines with
// two cores run several test binaries at once, and a deadline near the
// normal wait makes a passing test flaky.
const Deadline = 30 * time.Second

// For polls cond until it holds, failing tb with what once Deadline passes.
// Polling starts at once and backs off to every 20 ms.
func For(tb testing.TB, what string, cond func() bool) {
	tb.Helper()
	deadline := time.Now().Add(Deadline)
	pause := time.Millisecond
	for !cond() {
		if time.Now().After(deadline) {
			tb.Fatalf("not seen within %v: %s", Deadline, what)
		}
		time.Sleep(pause)
		pause = min(2*pause, 20*time.Millisecond)
	}
}

// Receive takes values from ch until ok accepts one, and returns it. It
// fails tb with what once Deadline passes or when ch is closed first.
func Receive[T any](tb testing.TB, what string, ch <-chan T, ok func(T) bool) T {
	tb.Helper()
	deadline := time.NewTimer(Deadline)
	defer deadline.Stop()
	for {
		select {
		case v, open := <-ch:
			if !open {
				tb.Fatalf("closed before it was seen: %s", what)
			}
			if ok(v) {
				return v
			}
		case <-deadline.C:
			tb.Fatalf("not seen within %v: %s", Deadline, what)
		}
	}
}
