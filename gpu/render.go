package gpu

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"strconv"
	"strings"
	"text/tabwriter"
)

// WriteTable writes inv for people: the GPUs, the MIG instances (GPU
// instances without a compute instance among them), a topology matrix in
// the style of `nvidia-smi topo -m`, then what could not be read and any
// errors. The output
// depends only on inv, so it can be compared with a golden file.
func WriteTable(w io.Writer, inv *Inventory) error {
	var buf bytes.Buffer
	tw := tabwriter.NewWriter(&buf, 0, 0, 2, ' ', 0)

	if inv.DriverVersion != "" {
		fmt.Fprintf(tw, "Driver %s\n\n", inv.DriverVersion)
	}
	fmt.Fprintln(tw, "GPUs")
	fmt.Fprintln(tw, "IDX\tNAME\tUUID\tMEMORY\tBUS ID\tNUMA\tCC\tMIG (CUR/PEND)")
	for _, g := range inv.GPUs {
		fmt.Fprintf(tw, "%d\t%s\t%s\t%.1f GiB\t%s\t%s\t%s\t%s\n", g.Index, g.Name, g.UUID,
			float64(g.MemoryBytes)/(1<<30), orNA(g.PCIBusID), numaString(g.NUMANode), g.ComputeCapability, migString(g))
	}
	if len(inv.GPUs) == 0 {
		fmt.Fprintln(tw, "(none)")
	}

	fmt.Fprintln(tw, "\nMIG instances")
	fmt.Fprintln(tw, "GPU\tPROFILE\tGI\tCI\tPLACEMENT\tMEMORY\tUUID")
	listed := false
	for _, g := range inv.GPUs {
		for _, m := range g.Instances {
			listed = true
			fmt.Fprintf(tw, "%d\t%s\t%d\t%d\t%d:%d\t%d MiB\t%s\n", g.Index, m.Profile, m.GI, m.CI,
				m.Placement.Start, m.Placement.Size, m.MemoryBytes>>20, m.UUID)
		}
		for _, b := range g.GIsWithoutCI {
			listed = true
			fmt.Fprintf(tw, "%d\t%s\t%d\t-\t%d:%d\t-\t(no compute instance)\n", g.Index, b.Profile, b.GI,
				b.Placement.Start, b.Placement.Size)
		}
	}
	if !listed {
		fmt.Fprintln(tw, "(none)")
	}
	// The matrix has its own columns: flush so they do not widen the tables above.
	if err := tw.Flush(); err != nil {
		return err
	}

	buf.WriteString("\nTopology\n")
	if err := writeMatrix(&buf, inv); err != nil {
		return err
	}

	var unread []string
	for _, g := range inv.GPUs {
		if len(g.Unread) > 0 {
			facts := make([]string, len(g.Unread))
			for i, f := range g.Unread {
				facts[i] = string(f)
			}
			unread = append(unread, fmt.Sprintf("gpu %d (%s): %s\n", g.Index, g.UUID, strings.Join(facts, ", ")))
		}
	}
	if len(unread) > 0 {
		buf.WriteString("\nNot read this time\n")
		for _, u := range unread {
			buf.WriteString(u)
		}
	}

	if len(inv.Errors) > 0 {
		buf.WriteString("\nErrors\n")
		for _, e := range inv.Errors {
			fmt.Fprintf(&buf, "%s\n", e.Error())
		}
	}
	_, err := w.Write(buf.Bytes())
	return err
}

func writeMatrix(buf *bytes.Buffer, inv *Inventory) error {
	t := inv.Topology
	if t == nil || t.Len() == 0 {
		buf.WriteString("(none)\n")
		return nil
	}
	if err := t.check(len(inv.GPUs)); err != nil {
		return err
	}
	tw := tabwriter.NewWriter(buf, 0, 0, 2, ' ', 0)
	for _, g := range inv.GPUs {
		fmt.Fprintf(tw, "\tGPU%d", g.Index)
	}
	fmt.Fprintln(tw, "\tNUMA")
	for i, g := range inv.GPUs {
		fmt.Fprintf(tw, "GPU%d", g.Index)
		for j := range inv.GPUs {
			fmt.Fprintf(tw, "\t%s", cell(t, i, j))
		}
		fmt.Fprintf(tw, "\t%s\n", numaString(g.NUMANode))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	buf.WriteString(`
Legend:
  X     = the GPU itself
  NV#   = # NVLink lanes: direct lanes, plus NVSwitch lanes when both GPUs share a switch fabric
  SYS   = path crosses the link between NUMA nodes (e.g. UPI, Infinity Fabric)
  NODE  = path crosses PCIe host bridges inside one NUMA node
  PHB   = path goes through one PCIe host bridge (the CPU)
  PXB   = path crosses several PCIe switches, no host bridge
  PIX   = path crosses at most one PCIe switch
  BOARD = both GPUs are on one board
`)
	return nil
}

func cell(t *Topology, i, j int) string {
	if i == j {
		return "X"
	}
	if n := t.Lanes(i, j); n > 0 {
		return "NV" + strconv.Itoa(n)
	}
	return t.Level[i][j].String()
}

func orNA(s string) string {
	if s == "" {
		return "N/A"
	}
	return s
}

func numaString(n int) string {
	if n < 0 {
		return "N/A"
	}
	return strconv.Itoa(n)
}

func migString(g GPU) string {
	if g.Unknown(FactMIGMode) {
		return "?"
	}
	if !g.MIGCapable {
		return "N/A"
	}
	onOff := func(b bool) string {
		if b {
			return "on"
		}
		return "off"
	}
	return onOff(g.MIG.Current) + "/" + onOff(g.MIG.Pending)
}

// WriteJSON writes inv as indented JSON; ReadJSON reads it back.
func WriteJSON(w io.Writer, inv *Inventory) error {
	b, err := json.MarshalIndent(inv, "", "  ")
	if err != nil {
		return fmt.Errorf("encode inventory: %w", err)
	}
	_, err = w.Write(append(b, '\n'))
	return err
}

// ReadJSON reads an inventory written by WriteJSON (a fixture, or another
// agent's /status). Unknown fields are ignored so that an older reader accepts
// a newer writer; a topology whose shape does not match the GPUs is rejected,
// because Topology's accessors index it without checks.
func ReadJSON(r io.Reader) (*Inventory, error) {
	var inv Inventory
	if err := json.NewDecoder(r).Decode(&inv); err != nil {
		return nil, fmt.Errorf("decode inventory: %w", err)
	}
	if inv.Topology != nil {
		if err := inv.Topology.check(len(inv.GPUs)); err != nil {
			return nil, fmt.Errorf("decode inventory: %w", err)
		}
	}
	return &inv, nil
}

// check reports whether t describes exactly n GPUs in every field.
func (t *Topology) check(n int) error {
	if len(t.Level) != n || len(t.DirectLanes) != n || len(t.SwitchLanes) != n || len(t.Fabric) != n {
		return fmt.Errorf("topology: sizes level=%d directLanes=%d switchLanes=%d fabric=%d, want %d GPUs",
			len(t.Level), len(t.DirectLanes), len(t.SwitchLanes), len(t.Fabric), n)
	}
	for i := range n {
		if len(t.Level[i]) != n || len(t.DirectLanes[i]) != n {
			return fmt.Errorf("topology: row %d has %d levels and %d lane counts, want %d", i, len(t.Level[i]), len(t.DirectLanes[i]), n)
		}
	}
	return nil
}
