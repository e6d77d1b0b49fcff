package mps

import (
	"encoding/json"
	"path/filepath"
	"reflect"
	"strconv"
	"testing"
	"time"
)

// desiredSeeds are desired.json contents: what Remote.Set writes, and the
// files TestHostKeepsLastGoodDesiredFile refuses.
func desiredSeeds(tb testing.TB) [][]byte {
	written := DesiredFile{Version: FileVersion, Generation: 3, Daemons: []Daemon{
		{Device: "GPU-a", ActiveThreadPercentage: 50},
		{Device: "GPU-b", Index: 1, PinnedMemLimitBytes: 1 << 30},
		{Device: "MIG-GPU-x/1/0", Index: 2, ActiveThreadPercentage: 14, PinnedMemLimitBytes: 5 << 30},
	}}
	out := [][]byte{mustIndent(tb, written), mustIndent(tb, DesiredFile{Version: FileVersion, Generation: 1, Daemons: []Daemon{}})}
	for _, s := range []string{
		`{"version": 1, "generation": 2, "daemons": [`,
		`{"version": 2, "generation": 2, "daemons": [], "newLimit": 1}`,
		`{"version": 1, "generation": 2, "daemons": [], "spare": true}`,
		`{"version": 1, "generation": 2, "daemons": [{"device": "GPU-good", "activeThreadPercentage": 300}]}`,
		`{"version": 1, "generation": 2, "daemons": [{"device": "GPU-b"}, {"device": "GPU-b"}]}`,
		`{"version": 1, "generation": 0, "daemons": []}`,
		`{"version": 1, "generation": 2, "daemons": null} {}`,
	} {
		out = append(out, []byte(s))
	}
	return out
}

// FuzzParseDesiredFile decodes any bytes as desired.json. A file it accepts
// has a generation of at least 1 and valid daemons, each with a folder of its
// own directly under the MPS root, and reads back the same once written as
// Remote writes it.
func FuzzParseDesiredFile(f *testing.F) {
	for _, b := range desiredSeeds(f) {
		f.Add(b)
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := parseDesiredFile(b)
		if err != nil {
			if got != nil || err.Error() == "" {
				t.Fatalf("parseDesiredFile = %+v, %q", got, err)
			}
			return
		}
		if got.Version != FileVersion || got.Generation < 1 {
			t.Fatalf("accepted version %d, generation %d", got.Version, got.Generation)
		}
		if _, err := validateDaemons(got.Daemons); err != nil {
			t.Fatalf("accepted invalid daemons: %v", err)
		}
		const root = "/run/mps"
		folders := map[string]string{}
		for _, d := range got.Daemons {
			folder := filepath.Dir(PipeDir(root, d.Device))
			if filepath.Dir(folder) != root || folder == root || LogDir(root, d.Device) != filepath.Join(folder, "log") {
				t.Fatalf("daemon %q: pipe %s and log %s are not in a folder of its own under %s",
					d.Device, PipeDir(root, d.Device), LogDir(root, d.Device), root)
			}
			if other, ok := folders[folder]; ok {
				t.Fatalf("daemons %q and %q share the folder %s", other, d.Device, folder)
			}
			folders[folder] = d.Device
		}
		again, err := parseDesiredFile(mustIndent(t, got))
		if err != nil {
			t.Fatalf("written back, it is refused: %v\n%s", err, mustIndent(t, got))
		}
		if !reflect.DeepEqual(again, got) {
			t.Fatalf("written back, it reads as %+v, not %+v", again, got)
		}
	})
}

// FuzzParseHealthFile decodes any bytes as health.json. A file it accepts
// has a positive interval, and written as Host writes it reads back to the
// same bytes.
func FuzzParseHealthFile(f *testing.F) {
	written := HealthFile{
		Version: FileVersion, Written: time.Date(2025, 3, 1, 12, 0, 0, 123456789, time.FixedZone("", 3600)),
		Interval: Duration(5 * time.Second), PID: 4242, Generation: 7, Rejected: "desired.json: version 2",
		Devices: map[string]DeviceHealth{
			"GPU-a":         {Healthy: true, PID: 99, Generation: 7},
			"MIG-GPU-x/1/0": {Reason: "mps daemon (pid 98) not answering: timeout", PID: 98, Generation: 6},
		},
	}
	f.Add(mustIndent(f, written))
	written.Stopped, written.Devices, written.Rejected = true, map[string]DeviceHealth{}, ""
	f.Add(mustIndent(f, written))
	f.Add([]byte(`{"version": 1, "written": "2025-03-01T12:00:00Z", "interval": "0s", "pid": 1, "generation": 0, "devices": {}}`))
	f.Add([]byte(`{"version": 1, "written": "2025-03-01T12:00:00Z", "interval": 5, "pid": 1, "generation": 0, "devices": {}}`))
	f.Add([]byte(`{"version": 1, "interval": "-1h", "devices": null}`))
	f.Fuzz(func(t *testing.T, b []byte) {
		got, err := parseHealthFile(b)
		if err != nil {
			if got != nil || err.Error() == "" {
				t.Fatalf("parseHealthFile = %+v, %q", got, err)
			}
			return
		}
		if got.Version != FileVersion || got.Interval <= 0 {
			t.Fatalf("accepted version %d, interval %v", got.Version, time.Duration(got.Interval))
		}
		out := mustIndent(t, got)
		again, err := parseHealthFile(out)
		if err != nil {
			t.Fatalf("written back, it is refused: %v\n%s", err, out)
		}
		if out2 := mustIndent(t, again); string(out2) != string(out) {
			t.Fatalf("written back, it reads differently:\n%s\n%s", out, out2)
		}
	})
}

// FuzzCarriesLimits decodes any bytes as a daemon's limits record. What the
// supervisor writes for a daemon and pid reads back as carried, and a record
// speaks for one pid and one set of limits only.
func FuzzCarriesLimits(f *testing.F) {
	f.Add([]byte(`{"pid":4242,"activeThreadPercentage":50,"pinnedMemLimitBytes":1073741824}`), 50, uint64(1<<30), 4242)
	f.Add([]byte(`{"pid":7}`), 0, uint64(0), 7)
	f.Add([]byte(`{"pid":7,"PID":8}`), 0, uint64(0), 8)
	f.Add([]byte(`null`), 0, uint64(0), 1)
	f.Add([]byte(`{"pid":7,"activeThreadPercentage":50,"pinnedMemLimitBytes":1e3}`), 50, uint64(1000), 7)
	f.Fuzz(func(t *testing.T, b []byte, threads int, mem uint64, pid int) {
		if pid <= 0 {
			pid = 1 // the supervisor asks only of live processes
		}
		d := Daemon{Device: "GPU-a", ActiveThreadPercentage: threads, PinnedMemLimitBytes: mem}
		written, err := json.Marshal(newRecord(d, pid))
		if err != nil {
			t.Fatal(err)
		}
		if !carriesLimits(written, d, pid) {
			t.Fatalf("the record written for pid %d, %+v does not read back: %s", pid, d, written)
		}
		if !carriesLimits(b, d, pid) {
			return
		}
		other := d
		other.ActiveThreadPercentage++
		if carriesLimits(b, other, pid) {
			t.Fatalf("%s carries both %+v and %+v", b, d, other)
		}
		if pid < int(^uint(0)>>1) && carriesLimits(b, d, pid+1) {
			t.Fatalf("%s carries limits for pid %d and %d", b, pid, pid+1)
		}
	})
}

// FuzzParsePID reads any bytes as the pid file of an MPS control daemon: it
// gives a positive pid or an error, and reads the pid files daemons write.
func FuzzParsePID(f *testing.F) {
	for _, s := range []string{"4242\n", " 7 ", "0", "-1", "+12", "0x10", "9223372036854775808", "12\n13\n", ""} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		pid, err := parsePID(b)
		if err != nil {
			if pid != 0 || err.Error() == "" {
				t.Fatalf("parsePID(%q) = %d, %q", b, pid, err)
			}
			return
		}
		if pid <= 0 {
			t.Fatalf("parsePID(%q) = %d", b, pid)
		}
		if again, err := parsePID([]byte(strconv.Itoa(pid) + "\n")); err != nil || again != pid {
			t.Fatalf("pid file of %d reads as %d, %v", pid, again, err)
		}
	})
}

// mustIndent is v as writeJSONAtomic writes it.
func mustIndent(tb testing.TB, v any) []byte {
	tb.Helper()
	b, err := json.MarshalIndent(v, "", "  ")
	if err != nil {
		tb.Fatal(err)
	}
	return append(b, '\n')
}
