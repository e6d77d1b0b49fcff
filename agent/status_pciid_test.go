package agent

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// /status writes a GPU's PCI device id as configs write it (a MIG layout's
// device-filter: 0x20B010DE); the checkpoint keeps the number its format has.
func TestStatusPCIDeviceIDInHex(t *testing.T) {
	h := newHarness(t, simNode(t, "dgx-a100"))
	h.config(wholeGPUs)
	b, err := json.Marshal(h.a.Status())
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(string(b), `"pciDeviceID":"0x20B010DE"`); n != 8 {
		t.Errorf("/status has the A100's id in hex %d times, want 8: %s", n, b)
	}
	cp, err := os.ReadFile(filepath.Join(h.dir, "checkpoint.json"))
	if err != nil {
		t.Fatal(err)
	}
	if n := strings.Count(strings.ReplaceAll(string(cp), " ", ""), `"pciDeviceID":548409566`); n != 8 {
		t.Errorf("the checkpoint has the id as a number %d times, want 8: %s", n, cp)
	}
}
