package agent

import (
	"encoding/json"
	"testing"
	"time"
)

// The checkpoint is read back from disk at every start: whatever its bytes,
// DecodeCheckpoint refuses them or gives a checkpoint that encodes and
// decodes to itself, and that an agent restores without panicking.
func FuzzDecodeCheckpoint(f *testing.F) {
	for _, s := range []string{
		`{"version":1,"node":"n","written":"2026-11-23T00:00:00Z","allocated":{"MIG-a":"2026-11-23T00:00:00Z"}}`,
		`{"version":2,"node":"n","written":"2026-11-23T00:00:00Z","claims":{"uid-a":{"namespace":"default","name":"a","devices":[{"requests":["gpu"],"device":"gpu-0","cdiDevices":["nvidia.com/gpu=GPU-0"],"uuid":"GPU-0"}],"at":"2026-11-23T00:00:00Z"}}}`,
		`{"version":3,"node":"n","written":"2026-11-23T00:00:00Z","gpus":[{"index":0,"uuid":"GPU-0","name":"NVIDIA A100-SXM4-40GB"}],"intents":{"u":{"namespace":"a","name":"b","devices":[{"device":"gpu-0-mig-1g5gb-0","created":true,"parent":"GPU-0","profile":"1g.5gb","placement":{"start":0,"size":1}}],"at":"2026-11-23T00:00:00Z"}},"releasing":{"v":{"namespace":"a","name":"c","devices":[],"at":"2026-11-23T00:00:00Z"}},"dynamicMIG":["GPU-0"]}`,
		`{"version":3,"written":"2026-11-23T00:00:00Z","health":[{"cause":{"gpu":"GPU-0","kind":"xid","xid":79}}]}`,
		`{"version":4,"node":"n","written":"2026-11-23T00:00:00Z","cordon":["1","GPU-0",""]}`,
		`{"version":4,"node":"n","written":"2026-11-23T00:00:00Z","gpus":[{"index":0,"uuid":"GPU-0","migCapable":true}],"migTouched":["GPU-0","GPU-gone"]}`,
		`{"version":3}{}`,
		`{"version":4,"minor":1,"node":"n","written":"2026-11-23T00:00:00Z","future":{"a":[1]}}`,
		`{"version":5,"written":"2026-11-23T00:00:00Z"}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		cp, err := DecodeCheckpoint(b)
		if err != nil {
			if err.Error() == "" {
				t.Fatal("an error without a message")
			}
			return
		}
		again, err := json.Marshal(cp)
		if err != nil {
			t.Fatalf("a decoded checkpoint does not encode: %v", err)
		}
		cp2, err := DecodeCheckpoint(again)
		if err != nil {
			t.Fatalf("a decoded checkpoint does not decode again: %v\n%s", err, again)
		}
		if third, _ := json.Marshal(cp2); string(third) != string(again) {
			t.Fatalf("not stable:\n%s\n%s", again, third)
		}
		a := New(Options{Restored: cp, NodeName: "n", Now: func() time.Time { return time.Date(2026, 11, 23, 12, 0, 0, 0, time.UTC) }})
		if err := a.ledger.AddClaim("fuzz", PreparedClaim{}); err != nil {
			t.Fatalf("an empty claim refused after restoring: %v", err)
		}
	})
}
