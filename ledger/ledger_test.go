package ledger

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/gpu"
)

// The ledger's rule, state by state: what Allocate refuses and why, and
// what Doom refuses. A MIG device and its GPU are one device to it.
func TestLedgerStates(t *testing.T) {
	const gpu0, mig0, mig1, gpu1 = "GPU-0", "MIG-0a", "MIG-0b", "GPU-1"
	inventory := []gpu.GPU{
		{UUID: gpu0, Instances: []gpu.MIGInstance{
			{UUID: mig0, Profile: "1g.10gb", Placement: gpu.Placement{Start: 0, Size: 1}},
			{UUID: mig1, Profile: "1g.10gb", Placement: gpu.Placement{Start: 1, Size: 1}},
		}},
		{UUID: gpu1},
	}
	clock := newClock()
	claimOf := func(devs ...ClaimDevice) Claim {
		return Claim{Namespace: "ml", Name: "c", Devices: devs}
	}
	for _, tc := range []struct {
		name  string
		setup func(l *Ledger) error
		// allocate: device → "" (accepted) or the refusal's words.
		allocate map[string]string
		// doom: device → "" (doomed) or the refusal's words.
		doom map[string]string
		// reason is what every refusal of the case wraps.
		reason error
	}{
		{name: "free", allocate: map[string]string{gpu0: "", mig0: "", gpu1: ""}, doom: map[string]string{mig0: "", gpu1: ""}},
		{name: "a MIG device doomed", setup: func(l *Ledger) error { return l.Doom([]string{mig0}, "layout X") },
			allocate: map[string]string{mig0: "being repartitioned: layout X", gpu0: "being repartitioned", mig1: "", gpu1: ""}, reason: ErrDoomed},
		{name: "a GPU doomed (mode change)", setup: func(l *Ledger) error { return l.Doom([]string{gpu0}, "MIG on") },
			allocate: map[string]string{mig0: "being repartitioned: MIG on", mig1: "being repartitioned", gpu1: ""}, reason: ErrDoomed},
		{name: "allocated through the device plugin", setup: func(l *Ledger) error { return l.Allocate([]string{mig0}) },
			allocate: map[string]string{mig0: "", mig1: ""}, // the kubelet may allocate one again (a restarted container)
			doom:     map[string]string{mig0: "held by a container the device plugin gave it at 2026-11-23T12:00:00Z", gpu0: "held by a container the device plugin gave its MIG device MIG-0a", mig1: ""}, reason: ErrHeld},
		{name: "a MIG device prepared for a claim", setup: func(l *Ledger) error {
			return l.AddClaim("uid", claimOf(ClaimDevice{PreparedDevice: dra.PreparedDevice{Device: "gpu-0-mig"}, UUID: mig0}))
		}, allocate: map[string]string{mig0: "prepared for ResourceClaim ml/c through DRA", gpu0: "prepared for ResourceClaim ml/c", mig1: ""},
			doom: map[string]string{mig0: "prepared for ResourceClaim ml/c", gpu0: "prepared for ResourceClaim ml/c", mig1: ""}, reason: ErrPrepared},
		{name: "admin access holds nothing", setup: func(l *Ledger) error {
			return l.AddClaim("uid", claimOf(ClaimDevice{PreparedDevice: dra.PreparedDevice{Device: "gpu-0"}, UUID: gpu0, AdminAccess: true}))
		}, allocate: map[string]string{gpu0: "", mig0: ""}},
		{name: "a MIG device being made for a claim", setup: func(l *Ledger) error {
			return l.Intend("uid", claimOf(), ClaimDevice{Created: true, Parent: gpu1, Profile: "1g.10gb", Placement: gpu.Placement{Start: 0, Size: 1}})
		}, allocate: map[string]string{gpu1: "a MIG device made for ResourceClaim ml/c", gpu0: ""},
			doom: map[string]string{gpu1: "being made for ResourceClaim ml/c", gpu0: ""}, reason: ErrIntended},
		{name: "left by a released claim", setup: func(l *Ledger) error {
			l.SetRelease("uid", claimOf(ClaimDevice{Created: true, UUID: mig1, Parent: gpu0}))
			return nil
		}, allocate: map[string]string{mig1: "a MIG device made for ResourceClaim ml/c", gpu0: "made for ResourceClaim ml/c", mig0: "", gpu1: ""},
			doom: map[string]string{mig1: "being released by ResourceClaim ml/c", gpu0: "being released by ResourceClaim ml/c", mig0: ""}, reason: ErrReleasing},
	} {
		t.Run(tc.name, func(t *testing.T) {
			// Each question on a ledger of its own: an answer changes it.
			fresh := func() *Ledger {
				l := newLedger(clock.Now)
				l.SetInventory(inventory)
				if tc.setup != nil {
					if err := tc.setup(l); err != nil {
						t.Fatal(err)
					}
				}
				return l
			}
			for dev, want := range tc.allocate {
				err := fresh().Allocate([]string{dev})
				checkRefusal(t, "Allocate "+dev, err, want)
				checkReason(t, "Allocate "+dev, err, dev, tc.reason)
			}
			for dev, want := range tc.doom {
				err := fresh().Doom([]string{dev}, "test")
				checkRefusal(t, "Doom "+dev, err, want)
				checkReason(t, "Doom "+dev, err, dev, tc.reason)
			}
		})
	}
}

// checkReason checks that a refusal names dev and wraps reason (and no
// other reason), which the device plugin maps to its gRPC code.
func checkReason(t *testing.T, what string, err error, dev string, reason error) {
	t.Helper()
	if err == nil {
		return
	}
	var r *RefusedError
	if !errors.As(err, &r) || r.Device != dev || !errors.Is(err, reason) {
		t.Errorf("%s = %#v, want a RefusedError of %s wrapping %v", what, err, dev, reason)
	}
	for _, other := range []error{ErrHeld, ErrDoomed, ErrPrepared, ErrIntended, ErrReleasing, ErrLogUnavailable} {
		if other != reason && errors.Is(err, other) {
			t.Errorf("%s = %v, which is %v too", what, err, other)
		}
	}
}

func checkRefusal(t *testing.T, what string, err error, want string) {
	t.Helper()
	switch {
	case want == "" && err != nil:
		t.Errorf("%s refused: %v", what, err)
	case want != "" && (err == nil || !strings.Contains(err.Error(), want)):
		t.Errorf("%s = %v, want a refusal saying %q", what, err, want)
	}
}

// An allocation is in the log when Allocate returns: a ledger opened on the
// same directory without the first being closed (the process was killed)
// has it, and a torn last line (killed mid-write) costs only that line.
func TestAllocationLogSurvivesKill(t *testing.T) {
	dir := t.TempDir()
	clock := newClock()
	l, err := New(Options{StateDir: dir, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Allocate([]string{"MIG-a", "MIG-b"}); err != nil {
		t.Fatal(err)
	}
	clock.Advance(time.Second)
	if err := l.Allocate([]string{"GPU-c"}); err != nil {
		t.Fatal(err)
	}
	// Killed mid-write of a third record.
	f, err := os.OpenFile(filepath.Join(dir, AllocLogFile), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	f.WriteString(`{"at":"2026-11-23T12:00:09Z","ids":["GPU-`)
	f.Close()

	again, err := New(Options{StateDir: dir, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	got := again.Allocations()
	start := newClock().Now()
	want := map[string]time.Time{"MIG-a": start, "MIG-b": start, "GPU-c": start.Add(time.Second)}
	if len(got) != len(want) {
		t.Fatalf("restored %v, want %v", got, want)
	}
	for id, at := range want {
		if !got[id].Equal(at) {
			t.Errorf("%s restored at %v, want %v", id, got[id], at)
		}
	}
	// The log was compacted on open: the torn line is gone, the rest kept.
	b, _ := os.ReadFile(filepath.Join(dir, AllocLogFile))
	if strings.Contains(string(b), `"GPU-"`) || strings.Count(string(b), "\n") != 3 {
		t.Errorf("log after reopening:\n%s", b)
	}
}

// The log holds one line per device once it is compacted: when it grows
// past compactAbove (the same devices allocated again and again), and when
// allocations settle.
func TestAllocationLogCompacts(t *testing.T) {
	dir := t.TempDir()
	clock := newClock()
	l, err := New(Options{StateDir: dir, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	logSize := func() int64 {
		fi, err := os.Stat(filepath.Join(dir, AllocLogFile))
		if err != nil {
			t.Fatal(err)
		}
		return fi.Size()
	}
	for i := range 5000 { // about 460 KB of records
		if err := l.Allocate([]string{fmt.Sprintf("GPU-%d", i%16)}); err != nil {
			t.Fatal(err)
		}
	}
	if size := logSize(); size >= compactAbove {
		t.Fatalf("log of %d bytes after 5000 allocations of 16 devices, want it compacted below %d", size, compactAbove)
	}
	if got := len(l.Allocations()); got != 16 {
		t.Fatalf("%d allocations in the ledger, want 16", got)
	}
	again, _ := New(Options{StateDir: dir, Now: clock.Now})
	if got := len(again.Allocations()); got != 16 {
		t.Fatalf("the compacted log reads back %d allocations, want 16", got)
	}
	clock.Advance(time.Minute)
	l.Allocate([]string{"GPU-late"})
	for l.log.size < compactAbove { // enough lines for the next compaction
		l.log.append(allocRecord{At: clock.Now(), IDs: []string{"GPU-late"}})
	}
	if n := l.Settle(nil, clock.Now()); n != 16 {
		t.Fatalf("settled %d, want the 16 allocated a minute before the answer", n)
	}
	b, _ := os.ReadFile(filepath.Join(dir, AllocLogFile))
	if got := strings.Count(string(b), "\n"); got != 1 || !strings.Contains(string(b), "GPU-late") {
		t.Errorf("log after settling (%d lines):\n%.300s", got, b)
	}
}

// An allocation whose record cannot be written is refused: a restart would
// not know it.
func TestAllocateRefusedWhenNotRecorded(t *testing.T) {
	dir := t.TempDir()
	l, err := New(Options{StateDir: dir})
	if err != nil {
		t.Fatal(err)
	}
	l.log.f.Close() // a write now fails as a full or vanished disk would
	err = l.Allocate([]string{"GPU-a"})
	if !errors.Is(err, ErrLogUnavailable) || !strings.Contains(err.Error(), "could not be recorded") {
		t.Fatalf("Allocate = %v, want ErrLogUnavailable saying it could not be recorded", err)
	}
	if len(l.Allocations()) != 0 {
		t.Errorf("a refused allocation is in the ledger: %v", l.Allocations())
	}
}

// Issue 23, defect 7: an allocation dated after now (the clock stepped back
// across a restart) blocked its GPU for good; it counts from now instead,
// and an answer asked long enough after settles it.
func TestFutureAllocationSettles(t *testing.T) {
	dir := t.TempDir()
	clock := newClock()
	future := clock.Now().Add(48 * time.Hour)
	line := fmt.Sprintf(`{"at":%q,"ids":["MIG-a"]}`+"\n", future.Format(time.RFC3339Nano))
	if err := os.WriteFile(filepath.Join(dir, AllocLogFile), []byte(line), 0o600); err != nil {
		t.Fatal(err)
	}
	l, _ := New(Options{StateDir: dir, Now: clock.Now})
	if at := l.Allocations()["MIG-a"]; !at.Equal(clock.Now()) {
		t.Fatalf("restored at %v, want now (%v)", at, clock.Now())
	}
	clock.Advance(SettleAfter)
	if n := l.Settle(nil, clock.Now()); n != 1 {
		t.Errorf("settled %d, want the allocation %v after it", n, SettleAfter)
	}
	// Checkpoints of version 2 held allocations too.
	l2 := newLedger(clock.Now)
	if n := l2.Restore(Snapshot{Allocated: map[string]time.Time{"MIG-b": clock.Now().Add(time.Hour)}}); n != 1 {
		t.Errorf("Restore counted %d from the future, want 1", n)
	}
}

// The same at Admit, without the loop (the device plugin's Allocate may
// come first): the next Admit after the fault clears opens the log.
func TestAllocationLogOpenedAtAdmit(t *testing.T) {
	dir := t.TempDir()
	clock := newClock()
	l, err := New(Options{StateDir: dir, Now: clock.Now})
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Allocate([]string{"GPU-a"}); err != nil {
		t.Fatal(err)
	}
	var full error = syscall.EROFS
	write := func(path string, data []byte, opts ...atomicfile.Options) error {
		if full != nil {
			return fmt.Errorf("write %s: %w", path, full)
		}
		return atomicfile.Write(path, data, opts...)
	}
	l2, _ := New(Options{StateDir: dir, Now: clock.Now, Write: write})
	defer l2.Close()
	if err := l2.Allocate([]string{"GPU-b"}); !errors.Is(err, ErrLogUnavailable) || !strings.Contains(err.Error(), "read-only file system") {
		t.Errorf("Allocate while the log is not open = %v, want ErrLogUnavailable saying why", err)
	}
	if err, since := l2.LogError(); err == nil || !since.Equal(clock.Now()) {
		t.Errorf("logError = %v since %v, want the open's error since start", err, since)
	}
	full = nil
	if err := l2.Allocate([]string{"GPU-b"}); err != nil {
		t.Fatalf("Allocate once the fault cleared: %v", err)
	}
	if err, _ := l2.LogError(); err != nil {
		t.Errorf("logError = %v after the log opened", err)
	}
	again, _ := New(Options{StateDir: dir, Now: clock.Now})
	defer again.Close()
	if got := again.Allocations(); len(got) != 2 {
		t.Errorf("a restart reads %v from the log, want GPU-a and GPU-b", got)
	}
}

// clock is a test's clock, moved by hand.
type clock struct {
	mu  sync.Mutex
	now time.Time
}

func newClock() *clock { return &clock{now: time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC)} }

func (c *clock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.now
}

func (c *clock) Advance(d time.Duration) {
	c.mu.Lock()
	c.now = c.now.Add(d)
	c.mu.Unlock()
}

// fullFile is the allocation log on a state dir that may fill: while full
// is set, a write stores half the record (the disk filled mid-record) and
// fails.
type fullFile struct {
	*os.File
	full *bool
}

func (f fullFile) Write(b []byte) (int, error) {
	if !*f.full {
		return f.File.Write(b)
	}
	n, _ := f.File.Write(b[:len(b)/2])
	return n, &os.PathError{Op: "write", Path: f.Name(), Err: syscall.ENOSPC}
}

// Found by TestSimulation (a state dir that fills and empties): a record
// that could not be appended left its error on /status until the next
// Allocate succeeded, so an idle node whose state dir had room again said
// for good that its state was not saved. The loop's pass (RetryLog) tries
// the log again: rewritten whole, which also cuts off any torn record, the
// error clears once the state dir takes writes.
func TestAllocationLogAppendErrorClearsWhenWritable(t *testing.T) {
	dir := t.TempDir()
	clock := newClock()
	full := false
	write := func(path string, data []byte, opts ...atomicfile.Options) error {
		if full {
			return fmt.Errorf("write %s: %w", path, syscall.ENOSPC)
		}
		return atomicfile.Write(path, data, opts...)
	}
	l, err := New(Options{StateDir: dir, Now: clock.Now, Write: write, OpenLog: func(path string) (LogFile, error) {
		f, err := os.OpenFile(path, os.O_WRONLY|os.O_APPEND, 0)
		return fullFile{f, &full}, err
	}})
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	if err := l.Allocate([]string{"GPU-a"}); err != nil {
		t.Fatal(err)
	}
	full = true
	if err := l.Allocate([]string{"GPU-b"}); !errors.Is(err, ErrLogUnavailable) || !strings.Contains(err.Error(), "no space left on device") {
		t.Fatalf("Allocate on a full state dir = %v, want ErrLogUnavailable saying why", err)
	}
	l.RetryLog()
	if err, _ := l.LogError(); err == nil {
		t.Errorf("logError cleared while the state dir is still full")
	}
	full = false
	l.RetryLog()
	if err, _ := l.LogError(); err != nil {
		t.Errorf("logError = %v after the state dir had room again and the loop passed", err)
	}
	b, err := os.ReadFile(filepath.Join(dir, AllocLogFile))
	if err != nil {
		t.Fatal(err)
	}
	entries, bad, err := DecodeAllocLog(b)
	if err != nil || len(bad) > 0 || len(entries) != 1 || !strings.Contains(string(b), "GPU-a") {
		t.Errorf("log after the retry (bad %v, %v):\n%s", bad, err, b)
	}
	if err := l.Allocate([]string{"GPU-b"}); err != nil {
		t.Fatalf("Allocate once the state dir has room: %v", err)
	}
}
