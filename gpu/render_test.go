package gpu_test

import (
	"bytes"
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu"
)

var update = flag.Bool("update", false, "rewrite testdata/*.golden")

// goldenNode is a hand-made DGX-A100-like node with a bit of everything: an
// NVSwitch fabric, two NUMA nodes, one GPU with MIG on (including a GPU
// instance split into two compute instances), one with MIG pending, one GPU
// that fails to enumerate and, after it, one without NVLink (so positions and
// NVML indexes differ).
func goldenNode() *fakeNode {
	node := plainNode(6)
	const swA, swB = "00000000:C1:00.0", "00000000:C2:00.0"
	numa := func(i int) int { return min(i/2, 1) }
	for i := range node.gpus {
		node.gpus[i].numa = numa(i)
	}
	for i := range 4 {
		g := &node.gpus[i]
		for l := range 12 {
			sw := swA
			if l%2 == 1 {
				sw = swB
			}
			g.links = append(g.links, fakeLink{typ: nvml.NVLINK_DEVICE_TYPE_SWITCH, remote: sw})
		}
	}
	node.level = func(i, j int) nvml.GpuTopologyLevel {
		switch {
		case i/2 == j/2:
			return nvml.TOPOLOGY_MULTIPLE
		case numa(i) == numa(j):
			return nvml.TOPOLOGY_NODE
		default:
			return nvml.TOPOLOGY_SYSTEM
		}
	}
	m := migNode()
	node.gpus[3].mig = on(true, true)
	node.gpus[3].migs = m.gpus[0].migs
	node.gpus[2].mig = on(false, true)
	node.gpus[1].links[5].down = true
	node.gpus[4].fail = map[string]nvml.Return{"GetUUID": nvml.ERROR_UNKNOWN}
	// GPU 5 has MIG on and a GPU instance without a compute instance; GPU
	// 0 could not tell its MIG mode.
	node.gpus[5].mig = on(true, true)
	node.gpus[5].bareGIs = []fakeGI{{gi: 1, giProfile: nvml.GPU_INSTANCE_PROFILE_7_SLICE, start: 0, len: 8}}
	node.gpus[0].fail = map[string]nvml.Return{"GetMigMode": nvml.ERROR_UNKNOWN}
	return node
}

func golden(t *testing.T, name string, got []byte) {
	t.Helper()
	path := filepath.Join("testdata", name)
	if *update {
		if err := os.MkdirAll("testdata", 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run with -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs from the golden file (run with -update if intended):\n--- got\n%s\n--- want\n%s", name, got, want)
	}
}

func TestWriteTableGolden(t *testing.T) {
	inv := newInventory(t, goldenNode(), gpu.Options{})
	var buf bytes.Buffer
	if err := gpu.WriteTable(&buf, inv); err != nil {
		t.Fatal(err)
	}
	golden(t, "node.table.golden", buf.Bytes())

	// Spot checks, so that a bad -update is caught too.
	out := buf.String()
	for _, want := range []string{
		"GPU0  X     NV11  NV12  NV12  SYS   0", // GPU1 has one link down
		"GPU2  NV12  NV11  X     NV12  NODE  1",
		"GPU5  SYS   SYS   NODE  NODE  X     1",
		"3    1c.2g.10gb",
		"gpu 4: GetUUID: ERROR_UNKNOWN",
		"off/on",
		"5    7g.40gb     1   -   0:8        -          (no compute instance)",
		"gpu 0 (GPU-0000): migMode, instances, gisWithoutCI",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q", want)
		}
	}
	if strings.Contains(out, " \n") {
		t.Error("table has trailing spaces")
	}
}

func TestWriteTablePCIeOnly(t *testing.T) {
	node := plainNode(2)
	node.level = func(i, j int) nvml.GpuTopologyLevel { return nvml.TOPOLOGY_HOSTBRIDGE }
	node.gpus[1].mig = nil
	node.gpus[1].fail = map[string]nvml.Return{"GetNumaNodeId": nvml.ERROR_NOT_SUPPORTED}
	inv := newInventory(t, node, gpu.Options{})
	var buf bytes.Buffer
	if err := gpu.WriteTable(&buf, inv); err != nil {
		t.Fatal(err)
	}
	out := buf.String()
	for _, want := range []string{"GPU0  X     PHB   0", "GPU1  PHB   X     N/A", "MIG instances\nGPU  PROFILE  GI  CI  PLACEMENT  MEMORY  UUID\n(none)"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "Errors") {
		t.Errorf("error section without errors:\n%s", out)
	}
}

func TestJSONRoundTrip(t *testing.T) {
	inv := newInventory(t, goldenNode(), gpu.Options{})
	var buf bytes.Buffer
	if err := gpu.WriteJSON(&buf, inv); err != nil {
		t.Fatal(err)
	}
	golden(t, "node.json.golden", buf.Bytes())

	// The fixture reads back to the same inventory and renders the same table.
	f, err := os.Open(filepath.Join("testdata", "node.json.golden"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	back, err := gpu.ReadJSON(f)
	if err != nil {
		t.Fatalf("ReadJSON: %v", err)
	}
	if !reflect.DeepEqual(back, inv) {
		t.Errorf("round trip differs:\n got %+v\nwant %+v", back, inv)
	}
	var a, b bytes.Buffer
	if err := gpu.WriteTable(&a, inv); err != nil {
		t.Fatal(err)
	}
	if err := gpu.WriteTable(&b, back); err != nil {
		t.Fatal(err)
	}
	if a.String() != b.String() {
		t.Error("table of the read-back inventory differs")
	}
}

func TestReadJSONRejects(t *testing.T) {
	tests := map[string]string{
		"not json":           `{"gpus": [`,
		"short level":        `{"gpus":[{"index":0},{"index":1}],"topology":{"level":[[0,50]],"directLanes":[[0,0],[0,0]],"switchLanes":[0,0],"fabric":[-1,-1]}}`,
		"ragged lanes":       `{"gpus":[{"index":0},{"index":1}],"topology":{"level":[[0,50],[50,0]],"directLanes":[[0,0],[0]],"switchLanes":[0,0],"fabric":[-1,-1]}}`,
		"fabric missing":     `{"gpus":[{"index":0}],"topology":{"level":[[0]],"directLanes":[[0]],"switchLanes":[0]}}`,
		"switch lanes short": `{"gpus":[{"index":0}],"topology":{"level":[[0]],"directLanes":[[0]],"switchLanes":[],"fabric":[-1]}}`,
	}
	for name, in := range tests {
		t.Run(name, func(t *testing.T) {
			if inv, err := gpu.ReadJSON(strings.NewReader(in)); err == nil {
				t.Errorf("ReadJSON accepted %s: %+v", in, inv)
			}
		})
	}
	// Unknown fields (a newer writer) are fine.
	inv, err := gpu.ReadJSON(strings.NewReader(`{"gpus":[{"index":3,"uuid":"GPU-x","future":1}],"later":true}`))
	if err != nil || len(inv.GPUs) != 1 || inv.GPUs[0].UUID != "GPU-x" {
		t.Errorf("ReadJSON with unknown fields = %+v, %v", inv, err)
	}
}

type failingWriter struct{}

var errWrite = errors.New("disk full")

func (failingWriter) Write([]byte) (int, error) { return 0, errWrite }

func TestWritersReportErrors(t *testing.T) {
	inv := newInventory(t, plainNode(1), gpu.Options{})
	if err := gpu.WriteTable(failingWriter{}, inv); !errors.Is(err, errWrite) {
		t.Errorf("WriteTable error = %v, want %v", err, errWrite)
	}
	if err := gpu.WriteJSON(failingWriter{}, inv); !errors.Is(err, errWrite) {
		t.Errorf("WriteJSON error = %v, want %v", err, errWrite)
	}
	bad := &gpu.Inventory{GPUs: []gpu.GPU{{}, {}}, Topology: &gpu.Topology{Level: [][]gpu.LinkLevel{{0}}}}
	if err := gpu.WriteTable(&bytes.Buffer{}, bad); err == nil {
		t.Error("WriteTable accepted a topology that does not match the GPUs")
	}
}
