package gpu

import (
	"encoding/json"
	"fmt"
	"strconv"
	"strings"
)

// PCIID is a PCI device id as people read it: JSON "0x20B010DE", the form
// configs write in a MIG layout's device-filter and lspci prints. It is for
// what the agent shows (/status); GPU.PCIDeviceID stays a number, since the
// checkpoint stores GPU and its format does not change with the display.
type PCIID uint32

// String is the id as configs write it: 0x, then eight upper-case hex digits.
func (id PCIID) String() string { return fmt.Sprintf("0x%08X", uint32(id)) }

// MarshalJSON writes the id as a string in String's form.
func (id PCIID) MarshalJSON() ([]byte, error) { return json.Marshal(id.String()) }

// UnmarshalJSON reads a hex string ("0x20B010DE", either case, with or
// without 0x) or a JSON number: agents before this type wrote the id as a
// decimal, and `gpu-agent status --addr` reads those too.
func (id *PCIID) UnmarshalJSON(b []byte) error {
	if string(b) == "null" {
		return nil // as for any JSON value: null leaves it as it is
	}
	var s string
	if err := json.Unmarshal(b, &s); err != nil {
		var n uint32
		if nerr := json.Unmarshal(b, &n); nerr != nil {
			return fmt.Errorf("pciDeviceID %s: want a hex string like \"0x20B010DE\" or a number", b)
		}
		*id = PCIID(n)
		return nil
	}
	hex := strings.TrimPrefix(strings.TrimPrefix(s, "0x"), "0X")
	n, err := strconv.ParseUint(hex, 16, 32)
	if err != nil {
		return fmt.Errorf("pciDeviceID %q: want a hex string like \"0x20B010DE\"", s)
	}
	*id = PCIID(n)
	return nil
}

// Shown is a GPU as the agent shows it (/status): GPU, but the PCI device id
// in hex. Its PCIDeviceID hides GPU's in Go and in JSON.
type Shown struct {
	GPU
	PCIDeviceID PCIID `json:"pciDeviceID,omitempty"`
}

// Show is gs as the agent shows them.
func Show(gs []GPU) []Shown {
	if gs == nil {
		return nil
	}
	out := make([]Shown, len(gs))
	for i, g := range gs {
		out[i] = Shown{GPU: g, PCIDeviceID: PCIID(g.PCIDeviceID)}
	}
	return out
}
