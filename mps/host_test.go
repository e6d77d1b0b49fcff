package mps

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/atomicfile"
	"github.com/gpu-agent/gpu-agent/internal/testwait"
)

// hostRun is a Host running in the background over a root; cleanup stops it.
type hostRun struct {
	h      *Host
	cancel context.CancelFunc
	done   chan error
}

// runHost starts a Host with fast checks over root on clk.
func runHost(t *testing.T, root string, clk *clock) *hostRun {
	t.Helper()
	h := NewHost(Options{
		Binary: fakeBinary, Args: argsOf(fakeBinary), Root: root, Interval: 20 * time.Millisecond, RestartBackoff: time.Second,
		CommandTimeout: 2 * time.Second, StopTimeout: 2 * time.Second, Now: clk.Now,
	})
	ctx, cancel := context.WithCancel(context.Background())
	hr := &hostRun{h: h, cancel: cancel, done: make(chan error, 1)}
	go func() { hr.done <- h.Run(ctx) }()
	t.Cleanup(func() { hr.stop(t) })
	return hr
}

// stop ends the Host's Run as SIGTERM would; later calls return at once.
func (hr *hostRun) stop(t *testing.T) {
	t.Helper()
	hr.cancel()
	select {
	case err := <-hr.done:
		if err != nil {
			t.Errorf("Host.Run returned %v", err)
		}
		hr.done <- nil
	case <-time.After(10 * time.Second):
		t.Fatal("Host.Run did not return after cancel")
	}
}

// remoteRun is a Remote with its Run going; cleanup ends it.
type remoteRun struct {
	*Remote
	root string
}

func runRemote(t *testing.T, root string, clk *clock) *remoteRun {
	t.Helper()
	r := NewRemote(RemoteOptions{Root: root, Poll: 10 * time.Millisecond, Now: clk.Now})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- r.Run(ctx) }()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("Remote.Run returned %v", err)
		}
	})
	return &remoteRun{Remote: r, root: root}
}

// wait waits until dev's health is want with a reason containing reason,
// woken by the Remote's change signal. The bound only catches a hang.
func (r *remoteRun) wait(t *testing.T, dev string, want bool, reason string) string {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		ok, why := r.Healthy(dev)
		if ok == want && strings.Contains(why, reason) {
			return why
		}
		select {
		case <-r.Changes():
		case <-deadline:
			t.Fatalf("%s: healthy=%v %q; waited 10s for healthy=%v with %q", dev, ok, why, want, reason)
		}
	}
}

func (r *remoteRun) set(t *testing.T, daemons ...Daemon) {
	t.Helper()
	if err := r.Set(daemons); err != nil {
		t.Fatal(err)
	}
}

func readHealth(t *testing.T, root string) *HealthFile {
	t.Helper()
	h, err := ReadHealthFile(filepath.Join(root, HealthFileName))
	if err != nil {
		t.Fatal(err)
	}
	return h
}

func readDesired(t *testing.T, root string) *DesiredFile {
	t.Helper()
	f, err := ReadDesiredFile(filepath.Join(root, DesiredFileName))
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func pidOf(t *testing.T, root, dev string) int {
	t.Helper()
	pid, err := readPID(filepath.Join(PipeDir(root, dev), pidFileName))
	if err != nil {
		t.Fatal(err)
	}
	return pid
}

// The agent asks, mps-host runs the daemon, and the agent sees it healthy;
// then the agent restarts (a new Remote): the daemon is left as it is.
func TestRemoteAndHostRoundTrip(t *testing.T) {
	root := newRoot(t)
	clk := &clock{now: time.Unix(1000, 0)}
	runHost(t, root, clk)
	d := Daemon{Device: "GPU-rt", Index: 2, ActiveThreadPercentage: 50, PinnedMemLimitBytes: 2 << 30}
	r := runRemote(t, root, clk)
	r.set(t, d)

	r.wait(t, d.Device, true, "")
	pid := pidOf(t, root, d.Device)
	if df := readDesired(t, root); df.Generation != 1 || len(df.Daemons) != 1 || df.Daemons[0] != d {
		t.Errorf("desired.json = %+v, want generation 1 with %+v", df, d)
	}
	h := readHealth(t, root)
	if got := h.Devices[d.Device]; h.Generation != 1 || got.PID != pid || !got.Healthy {
		t.Errorf("health.json = %+v, want generation 1 and %s healthy with pid %d", h, d.Device, pid)
	}
	env, err := os.ReadFile(filepath.Join(LogDir(root, d.Device), "control.log"))
	if err != nil || !slices.Contains(strings.Fields(string(env)), "CUDA_VISIBLE_DEVICES=GPU-rt") {
		t.Errorf("daemon env %q (%v): want it pinned to GPU-rt", env, err)
	}
	hc := &harness{root: root}
	testwait.For(t, "limits applied and reported as generation 1", func() bool {
		return readHealth(t, root).Devices[d.Device].Generation == 1
	})
	if n := count(hc.commands(t, d.Device), "set_default_active_thread_percentage 50"); n != 1 {
		t.Errorf("thread percentage sent %d times, want once", n)
	}

	// The same list again changes nothing on disk.
	before, err := os.Stat(filepath.Join(root, DesiredFileName))
	if err != nil {
		t.Fatal(err)
	}
	r.set(t, d)
	if after, _ := os.Stat(filepath.Join(root, DesiredFileName)); !os.SameFile(before, after) {
		t.Error("Set with an unchanged list rewrote desired.json")
	}

	// Agent restart: the next agent's Remote knows the daemon before its
	// first Set, and that Set, unchanged, leaves it alone.
	next := runRemote(t, root, clk)
	if ok, why := next.Healthy(d.Device); !ok {
		t.Errorf("new Remote before Set: unhealthy (%s), want the running daemon healthy", why)
	}
	next.set(t, d)
	if g := readDesired(t, root).Generation; g != 1 {
		t.Errorf("unchanged Set from the next agent wrote generation %d", g)
	}
	next.wait(t, d.Device, true, "")
	if got := pidOf(t, root, d.Device); got != pid || !alive(pid) {
		t.Errorf("daemon pid %d (alive %v) after the agent restart, want %d untouched", got, alive(pid), pid)
	}
	if cmds := hc.commands(t, d.Device); count(cmds, "quit") != 0 || count(cmds, "set_default_active_thread_percentage 50") != 1 {
		t.Errorf("daemon commands %v after the agent restart: want no quit and no re-sent limits", cmds)
	}

	// A limit change is a new generation, applied live.
	d.ActiveThreadPercentage = 25
	next.set(t, d)
	testwait.For(t, "generation 2 carried", func() bool {
		return readHealth(t, root).Devices[d.Device].Generation == 2
	})
	if got := pidOf(t, root, d.Device); got != pid {
		t.Errorf("daemon restarted (pid %d → %d) for a limit change", pid, got)
	}
	if n := count(hc.commands(t, d.Device), "set_default_active_thread_percentage 25"); n != 1 {
		t.Errorf("new thread percentage sent %d times, want once", n)
	}

	// Dropping the device quits its daemon.
	next.set(t)
	testwait.For(t, "dropped daemon gone", func() bool { return !alive(pid) })
	if ok, why := next.Healthy(d.Device); ok || !strings.Contains(why, "no mps daemon") {
		t.Errorf("Healthy(dropped) = %v, %q", ok, why)
	}
}

// mps-host restarts (its upgrade, outside Kubernetes' container kill): the
// agent sees it stop, and the next mps-host adopts the running daemon.
func TestHostRestartAdoptsDaemon(t *testing.T) {
	root := newRoot(t)
	clk := &clock{now: time.Unix(1000, 0)}
	host := runHost(t, root, clk)
	d := Daemon{Device: "GPU-adopt", ActiveThreadPercentage: 40}
	r := runRemote(t, root, clk)
	r.set(t, d)
	r.wait(t, d.Device, true, "")
	pid := pidOf(t, root, d.Device)

	host.stop(t)
	why := r.wait(t, d.Device, false, "mps-host not running")
	if !strings.Contains(why, "stopped") {
		t.Errorf("reason %q, want it to say mps-host stopped", why)
	}
	if !alive(pid) {
		t.Fatalf("daemon (pid %d) gone with mps-host's Run", pid)
	}

	runHost(t, root, clk)
	r.wait(t, d.Device, true, "")
	if got := pidOf(t, root, d.Device); got != pid {
		t.Errorf("pid %d after mps-host restart, want the adopted %d", got, pid)
	}
	if cmds := (&harness{root: root}).commands(t, d.Device); count(cmds, "quit") != 0 || count(cmds, "set_default_active_thread_percentage 40") != 1 {
		t.Errorf("commands %v: want the daemon adopted with its recorded limits, not quit or re-limited", cmds)
	}
}

// An mps-host that stops writing (killed, hung) is noticed by the age of
// health.json alone, on the Remote's clock.
func TestRemoteHostGoneAfterStaleness(t *testing.T) {
	root := newRoot(t)
	hostClock := &clock{now: time.Unix(1000, 0)}
	agentClock := &clock{now: time.Unix(1000, 0)}
	runHost(t, root, hostClock)
	d := Daemon{Device: "GPU-stale"}
	r := runRemote(t, root, agentClock)
	r.set(t, d)
	r.wait(t, d.Device, true, "")

	// The host's clock stands still, so each health.json it writes looks as
	// old as the agent's clock makes it: like one written before a kill.
	agentClock.Advance(59 * time.Millisecond) // within 3 × 20ms
	if ok, why := r.Healthy(d.Device); !ok {
		t.Fatalf("unhealthy within the staleness bound: %s", why)
	}
	agentClock.Advance(2 * time.Millisecond)
	why := r.wait(t, d.Device, false, "mps-host not running")
	for _, want := range []string{HealthFileName, "61ms ago", "60ms bound"} {
		if !strings.Contains(why, want) {
			t.Errorf("reason %q lacks %q", why, want)
		}
	}
	// The host writes again with a current time: running again.
	hostClock.Advance(61 * time.Millisecond)
	r.wait(t, d.Device, true, "")
}

func TestRemoteWithoutHost(t *testing.T) {
	root := newRoot(t)
	clk := &clock{now: time.Unix(1000, 0)}
	r := runRemote(t, root, clk)
	d := Daemon{Device: "GPU-none"}
	if ok, why := r.Healthy(d.Device); ok || !strings.Contains(why, "no mps daemon") {
		t.Errorf("Healthy before Set = %v, %q", ok, why)
	}
	r.set(t, d)
	why := r.wait(t, d.Device, false, "mps-host not running")
	if !strings.Contains(why, filepath.Join(root, HealthFileName)) {
		t.Errorf("reason %q does not name the missing health.json", why)
	}
	if _, err := os.Stat(PipeDir(root, d.Device)); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("something ran a daemon without mps-host: %v", err)
	}
	if err := r.Set([]Daemon{{Device: "GPU-x"}, {Device: "GPU-x"}}); err == nil {
		t.Error("Set with a device listed twice accepted")
	}
	if g := readDesired(t, root).Generation; g != 1 {
		t.Errorf("a refused Set wrote desired.json (generation %d)", g)
	}
}

// writeRaw replaces desired.json as a careless writer would (still by
// rename, so mps-host sees one change).
func writeRaw(t *testing.T, root, content string) {
	t.Helper()
	if err := atomicfile.Write(filepath.Join(root, DesiredFileName), []byte(content)); err != nil {
		t.Fatal(err)
	}
}

func TestHostKeepsLastGoodDesiredFile(t *testing.T) {
	root := newRoot(t)
	clk := &clock{now: time.Unix(1000, 0)}
	runHost(t, root, clk)
	a, b := Daemon{Device: "GPU-good"}, Daemon{Device: "GPU-next"}
	r := runRemote(t, root, clk)
	r.set(t, a)
	r.wait(t, a.Device, true, "")
	pid := pidOf(t, root, a.Device)

	for _, bad := range []struct{ name, content, want string }{
		{"not JSON", `{"version": 1, "generation": 2, "daemons": [`, "unexpected end of JSON input"},
		{"other version", `{"version": 2, "generation": 2, "daemons": [], "newLimit": 1}`, "version 2, this gpu-agent reads version 1"},
		{"unknown field", `{"version": 1, "generation": 2, "daemons": [], "spare": true}`, "spare"},
		{"invalid daemon", `{"version": 1, "generation": 2, "daemons": [{"device": "GPU-good", "activeThreadPercentage": 300}]}`, "0..100"},
		{"listed twice", `{"version": 1, "generation": 2, "daemons": [{"device": "GPU-b"}, {"device": "GPU-b"}]}`, "twice"},
	} {
		t.Run(bad.name, func(t *testing.T) {
			writeRaw(t, root, bad.content)
			testwait.For(t, "health.json reports the rejection", func() bool {
				return strings.Contains(readHealth(t, root).Rejected, bad.want)
			})
			h := readHealth(t, root)
			if h.Generation != 1 || !h.Devices[a.Device].Healthy || len(h.Devices) != 1 {
				t.Errorf("health.json %+v: want generation 1 kept with %s healthy", h, a.Device)
			}
			if !strings.Contains(h.Rejected, DesiredFileName) {
				t.Errorf("rejection %q does not name desired.json", h.Rejected)
			}
			if got := pidOf(t, root, a.Device); got != pid || !alive(pid) {
				t.Errorf("daemon pid %d (alive %v), want %d kept", got, alive(pid), pid)
			}
		})
	}
	// The agent's next change replaces the bad file with its own, valid
	// one (generation 2), and mps-host follows it again.
	writeRaw(t, root, `garbage`)
	r.set(t, b)
	r.wait(t, b.Device, true, "")
	testwait.For(t, "dropped daemon quit", func() bool { return !alive(pid) })
	if h := readHealth(t, root); h.Rejected != "" || h.Generation != 2 {
		t.Errorf("health.json %+v after a valid desired.json: want generation 2, nothing rejected", h)
	}
	if cmds := (&harness{root: root}).commands(t, a.Device); count(cmds, "quit") != 1 {
		t.Errorf("dropped daemon's commands %v: want one quit", cmds)
	}
}

// An mps-host that cannot take in the agent's desired.json (one too old for
// it) keeps its daemons, and the agent offers their replicas unhealthy,
// saying why, rather than with limits that may not be the ones asked for.
func TestRemoteReportsRejectedDesiredFile(t *testing.T) {
	root := newRoot(t)
	clk := &clock{now: time.Unix(1000, 0)}
	r := runRemote(t, root, clk)
	d := Daemon{Device: "GPU-rej", ActiveThreadPercentage: 10}
	r.set(t, d)
	// What such an mps-host writes: its earlier generation's daemon healthy.
	hf := HealthFile{Version: FileVersion, Written: clk.Now(), Interval: Duration(time.Second), PID: 1, Generation: 0,
		Rejected: root + `/desired.json: json: unknown field "newLimit"`,
		Devices:  map[string]DeviceHealth{d.Device: {Healthy: true, PID: 42}}}
	if err := writeJSONAtomic(filepath.Join(root, HealthFileName), hf); err != nil {
		t.Fatal(err)
	}
	why := r.wait(t, d.Device, false, "did not take in generation 1")
	if !strings.Contains(why, `unknown field "newLimit"`) {
		t.Errorf("reason %q lacks mps-host's rejection", why)
	}
	// Once it has taken in the agent's generation, its word holds again.
	hf.Generation, hf.Rejected = 1, ""
	if err := writeJSONAtomic(filepath.Join(root, HealthFileName), hf); err != nil {
		t.Fatal(err)
	}
	r.wait(t, d.Device, true, "")
}

// Before the first desired.json mps-host touches no daemon, even one it
// does not know; once asked for, that daemon is adopted.
func TestHostWithoutDesiredFileTouchesNothing(t *testing.T) {
	root := newRoot(t)
	d := Daemon{Device: "GPU-left"}
	prev := NewSupervisor(Options{Binary: fakeBinary, Args: argsOf(fakeBinary), Root: root})
	pid, err := prev.start(context.Background(), d)
	if err != nil {
		t.Fatal(err)
	}

	clk := &clock{now: time.Unix(1000, 0)}
	runHost(t, root, clk)
	testwait.For(t, "a first heartbeat", func() bool {
		_, err := ReadHealthFile(filepath.Join(root, HealthFileName))
		return err == nil
	})
	h0 := readHealth(t, root)
	if h0.Generation != 0 || len(h0.Devices) != 0 {
		t.Errorf("health.json %+v before any desired.json: want generation 0, no devices", h0)
	}
	// Let more intervals pass: the rule is "never", not "not yet".
	clk.Advance(time.Second)
	testwait.For(t, "a later heartbeat", func() bool { return readHealth(t, root).Written.After(h0.Written) })
	if !alive(pid) || count((&harness{root: root}).commands(t, d.Device), "quit") != 0 {
		t.Fatalf("daemon (pid %d) stopped by an mps-host that was never asked for daemons", pid)
	}

	r := runRemote(t, root, clk)
	r.set(t, d)
	r.wait(t, d.Device, true, "")
	if got := pidOf(t, root, d.Device); got != pid {
		t.Errorf("pid %d, want the running %d adopted", got, pid)
	}
}

func TestHostFilesFormat(t *testing.T) {
	root := newRoot(t)
	clk := &clock{now: time.Unix(1000, 0).UTC()}
	r := runRemote(t, root, clk)
	r.set(t, Daemon{Device: "GPU-b", Index: 1, PinnedMemLimitBytes: 1 << 30}, Daemon{Device: "GPU-a", ActiveThreadPercentage: 50})
	b, err := os.ReadFile(filepath.Join(root, DesiredFileName))
	if err != nil {
		t.Fatal(err)
	}
	var got any
	if err := json.Unmarshal(b, &got); err != nil {
		t.Fatal(err)
	}
	want := map[string]any{"version": 1.0, "generation": 1.0, "daemons": []any{
		map[string]any{"device": "GPU-a", "gpu": 0.0, "activeThreadPercentage": 50.0},
		map[string]any{"device": "GPU-b", "gpu": 1.0, "pinnedMemLimitBytes": float64(1 << 30)},
	}}
	if gb, wb := mustJSON(t, got), mustJSON(t, want); gb != wb {
		t.Errorf("desired.json = %s\nwant %s", gb, wb)
	}
	if entries, _ := os.ReadDir(root); len(entries) != 1 {
		t.Errorf("root holds %d entries after one atomic write, want desired.json only (no temp file left)", len(entries))
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

// A host file of the largest size read, but all list or map items, is
// refused before it is decoded: encoding/json makes an item of each (even
// after a type error), which cost over 500 MB for 4 MiB of "{},", in an
// agent limited to 128 MiB.
func TestHostFilesBoundMemory(t *testing.T) {
	var devices strings.Builder
	devices.WriteString(`{"version":1,"interval":"1s","devices":{"0":{}`)
	for i := 1; devices.Len() < maxHostFileBytes-32; i++ {
		fmt.Fprintf(&devices, `,"%x":{}`, i)
	}
	devices.WriteString("}}")
	for _, tt := range []struct {
		name  string
		parse func([]byte) error
		data  []byte
	}{
		{"desired daemons", func(b []byte) error { _, err := parseDesiredFile(b); return err }, filled(`{"version":1,"generation":1,"daemons":[{}`, ",{}", "]}")},
		{"desired daemons as numbers", func(b []byte) error { _, err := parseDesiredFile(b); return err }, filled(`{"version":1,"generation":1,"daemons":[1`, ",1", "]}")},
		{"health devices", func(b []byte) error { _, err := parseHealthFile(b); return err }, []byte(devices.String())},
	} {
		var before, after runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&before)
		err := tt.parse(tt.data)
		runtime.ReadMemStats(&after)
		if err == nil || !strings.Contains(err.Error(), "refused undecoded") {
			t.Errorf("%s: %v, want it refused undecoded", tt.name, err)
		}
		if alloc := after.TotalAlloc - before.TotalAlloc; alloc > 8<<20 {
			t.Errorf("%s: decoding %d bytes allocated %d MB", tt.name, len(tt.data), alloc>>20)
		}
	}
}

// filled is head, then item as often as fits in maxHostFileBytes, then tail.
func filled(head, item, tail string) []byte {
	var b strings.Builder
	b.WriteString(head)
	for b.Len()+len(item)+len(tail) <= maxHostFileBytes {
		b.WriteString(item)
	}
	b.WriteString(tail)
	return []byte(b.String())
}
