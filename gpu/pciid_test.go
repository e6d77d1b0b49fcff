package gpu_test

import (
	"encoding/json"
	"strings"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu"
)

func TestPCIIDJSON(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want gpu.PCIID
		err  bool
	}{
		{in: `"0x20B010DE"`, want: 0x20B010DE},
		{in: `"0x233010de"`, want: 0x233010DE},
		{in: `"0X26B910DE"`, want: 0x26B910DE},
		{in: `"20B010DE"`, want: 0x20B010DE},
		{in: `548409566`, want: 0x20B010DE}, // an agent before the hex display
		{in: `"0x"`, err: true},
		{in: `""`, err: true},
		{in: `"0x1_0"`, err: true},
		{in: `"-0x1"`, err: true},
		{in: `"0x120B010DE"`, err: true}, // over 32 bits
		{in: `4294967296`, err: true},
		{in: `-1`, err: true},
		{in: `1.5`, err: true},
		{in: `true`, err: true},
	} {
		var id gpu.PCIID
		err := json.Unmarshal([]byte(tc.in), &id)
		if (err != nil) != tc.err || (!tc.err && id != tc.want) {
			t.Errorf("%s: %v, %v; want %v, error %v", tc.in, id, err, tc.want, tc.err)
		}
	}
}

// /status shows the id as configs write it; the GPU record the checkpoint
// stores keeps the number.
func TestShowWritesPCIIDInHex(t *testing.T) {
	gs := []gpu.GPU{{Index: 0, UUID: "GPU-a", PCIDeviceID: 0x20B010DE}}
	shown, err := json.Marshal(gpu.Show(gs))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(shown), `"pciDeviceID":"0x20B010DE"`) || strings.Count(string(shown), "pciDeviceID") != 1 {
		t.Errorf("shown: %s", shown)
	}
	stored, err := json.Marshal(gs)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(stored), `"pciDeviceID":548409566`) {
		t.Errorf("stored: %s", stored)
	}
	var back []gpu.Shown
	if err := json.Unmarshal(shown, &back); err != nil {
		t.Fatal(err)
	}
	if len(back) != 1 || back[0].PCIDeviceID != 0x20B010DE || back[0].UUID != "GPU-a" {
		t.Errorf("read back %+v", back)
	}
	if gpu.Show(nil) != nil {
		t.Error("Show(nil) is not nil")
	}
	// Unknown (0) is left out, as GPU leaves it out.
	if b, _ := json.Marshal(gpu.Show([]gpu.GPU{{UUID: "GPU-b"}})); strings.Contains(string(b), "pciDeviceID") {
		t.Errorf("unknown id shown: %s", b)
	}
}

func FuzzPCIIDJSON(f *testing.F) {
	for _, s := range []string{`"0x20B010DE"`, `548409566`, `"zz"`, `"0x"`, `null`, `"0xFFFFFFFF"`} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, in string) {
		var id gpu.PCIID
		if err := json.Unmarshal([]byte(in), &id); err != nil {
			return
		}
		b, err := json.Marshal(id)
		if err != nil {
			t.Fatal(err)
		}
		var back gpu.PCIID
		if err := json.Unmarshal(b, &back); err != nil || back != id {
			t.Fatalf("%s → %v → %s → %v, %v", in, id, b, back, err)
		}
	})
}
