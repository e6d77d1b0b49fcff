package gpu_test

import (
	"bytes"
	"os"
	"path/filepath"
	"testing"

	"github.com/gpu-agent/gpu-agent/gpu"
)

// FuzzReadJSON reads any bytes as an inventory. One it accepts renders as
// a table, has a topology that fits its GPUs also after one is left out, and
// written with WriteJSON reads back to what writes the same bytes again.
func FuzzReadJSON(f *testing.F) {
	golden, err := os.ReadFile(filepath.Join("testdata", "node.json.golden"))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(golden)
	for _, s := range []string{
		`{"gpus":[{"index":3,"uuid":"GPU-x","future":1}],"later":true}`,
		`{"gpus":[{"index":0},{"index":1}],"topology":{"level":[[0,50]],"directLanes":[[0,0],[0,0]],"switchLanes":[0,0],"fabric":[-1,-1]}}`,
		`{"gpus":[{"index":0,"uuid":"GPU-a"},{"index":1,"uuid":"GPU-b"}],"topology":{"level":[[0,77],[10,0]],"directLanes":[[0,4],[4,0]],"switchLanes":[12,-3],"fabric":[0,0]}}`,
		`{"gpus":[],"topology":{"level":[],"directLanes":[],"switchLanes":[],"fabric":[]},"errors":[{"index":2,"call":"GetUUID","error":"lost","lost":true}]}`,
		`{"gpus":null,"topology":null}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		inv, err := gpu.ReadJSON(bytes.NewReader(data))
		if err != nil {
			if inv != nil || err.Error() == "" {
				t.Fatalf("ReadJSON = %+v, %q", inv, err)
			}
			return
		}
		if err := gpu.WriteTable(new(bytes.Buffer), inv); err != nil {
			t.Fatalf("accepted inventory does not render: %v", err)
		}
		if len(inv.GPUs) > 0 {
			less := inv.Without([]string{inv.GPUs[0].UUID})
			if err := gpu.WriteTable(new(bytes.Buffer), less); err != nil {
				t.Fatalf("without GPU %q it does not render: %v", inv.GPUs[0].UUID, err)
			}
		}
		var first, second bytes.Buffer
		if err := gpu.WriteJSON(&first, inv); err != nil {
			t.Fatal(err)
		}
		back, err := gpu.ReadJSON(bytes.NewReader(first.Bytes()))
		if err != nil {
			t.Fatalf("written back, it is refused: %v\n%s", err, first.Bytes())
		}
		if err := gpu.WriteJSON(&second, back); err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(first.Bytes(), second.Bytes()) {
			t.Fatalf("written back, it reads differently:\n%s\n%s", first.Bytes(), second.Bytes())
		}
	})
}
