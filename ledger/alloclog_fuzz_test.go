package ledger

import (
	"encoding/json"
	"maps"
	"os"
	"strings"
	"testing"
	"time"
)

// The allocation log is read back at every start: any bytes give the
// records that are whole, each a device ID within bounds and a time, and
// what the log keeps of them (rewrite) reads back the same.
func FuzzDecodeAllocLog(f *testing.F) {
	for _, s := range []string{
		"{\"at\":\"2026-11-23T12:00:00Z\",\"ids\":[\"MIG-a\",\"MIG-b\"]}\n{\"at\":\"2026-11-23T12:00:01Z\",\"ids\":[\"GPU-c\"]}\n",
		"{\"at\":\"2026-11-23T12:00:00Z\",\"ids\":[\"MIG-a\"]}\n{\"at\":\"2026-11-23T12:00:09Z\",\"ids\":[\"GPU-",
		"{\"at\":\"0001-01-01T00:00:00Z\",\"ids\":[\"a\"]}\n",
		"{\"at\":\"2026-11-23T12:00:00Z\",\"ids\":[]}\n\n\n",
		"{\"at\":\"2026-11-23T12:00:00Z\",\"ids\":[\"x\"],\"extra\":1}\n",
		"{\"at\":\"2026-11-23T12:00:00Z\",\"ids\":[\"GPU-a\",\"GPU-b\"],\"resource\":\"nvidia.com/gpu\",\"replicas\":[\"GPU-b\"]}\n",
		"{\"at\":\"2026-11-23T12:00:00Z\",\"ids\":[\"GPU-a\"],\"replicas\":[\"GPU-z\"]}\n",
		"{\"at\":\"2026-11-23T12:00:00Z\",\"ids\":[\"GPU-a\"],\"version\":1,\"minor\":2,\"new\":[1]}\n",
		"{\"at\":\"2026-11-23T12:00:00Z\",\"ids\":[\"GPU-a\"]}\n{\"version\":2,\"devices\":[]}\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		got, bad, newer := DecodeAllocLog(b)
		if newer != nil {
			return
		}
		if len(bad) > 10 {
			t.Fatalf("%d errors reported, want at most 10", len(bad))
		}
		for id, e := range got {
			if id == "" || len(id) > maxIDBytes || e.At.IsZero() || len(e.Resource) > maxIDBytes {
				t.Fatalf("entry %q %+v out of bounds", id, e)
			}
		}
		dir := t.TempDir()
		l := &allocLog{path: dir + "/" + AllocLogFile}
		if err := l.rewrite(got); err != nil {
			t.Fatal(err)
		}
		defer l.close()
		again, bad, err := DecodeAllocLog(readFile(t, l.path))
		if err != nil {
			t.Fatal(err)
		}
		if len(bad) != 0 || !maps.EqualFunc(got, again, func(x, y AllocEntry) bool {
			return x.At.Equal(y.At) && x.Resource == y.Resource && x.Replica == y.Replica
		}) {
			t.Fatalf("rewritten log reads back %v (%v), want %v", again, bad, got)
		}
		if strings.Count(string(readFile(t, l.path)), "\n") != len(got) {
			t.Fatalf("rewrite is not one line per device")
		}
	})
}

// The hand-written record is what encoding/json writes, for any IDs.
func FuzzAppendRecord(f *testing.F) {
	f.Add("MIG-3dee2220-2f67-5d76-a37a-43529f763691", "GPU-0", "", false, int64(1764072000123456789))
	f.Add("GPU-a", "GPU-b", "nvidia.com/gpu", true, int64(1764072000123456789))
	f.Add("a\"b<c>&\x00é", "", "<r>", true, int64(0))
	f.Fuzz(func(t *testing.T, a, b, resource string, replica bool, nanos int64) {
		rec := allocRecord{At: time.Unix(0, nanos).UTC(), IDs: []string{a, b}, Resource: resource}
		if replica {
			rec.Replicas = []string{b}
		}
		got, err := appendRecord(nil, rec)
		if err != nil {
			t.Fatal(err)
		}
		want, err := json.Marshal(rec)
		if err != nil {
			return // a time encoding/json refuses (year outside 0-9999)
		}
		if string(got) != string(want)+"\n" {
			t.Fatalf("appendRecord\n%s\nencoding/json\n%s", got, want)
		}
	})
}

func readFile(t *testing.T, path string) []byte {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return b
}
