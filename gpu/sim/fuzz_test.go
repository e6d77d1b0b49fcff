package sim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// FuzzHTTPHandler sends any method, path and body to the /sim handler of a
// node with MIG instances. It must answer 200, 400, 404 or 405 with a JSON
// body ({"ok":true} or a non-empty "error"), and a request it refuses must
// change nothing the requests can change: kept state, telemetry, injected
// failures, queued events.
func FuzzHTTPHandler(f *testing.F) {
	for _, c := range httpCases() {
		f.Add(c.method, c.path, []byte(c.body))
	}
	for _, body := range []string{
		`{"gpu":0,"call":"GetMigMode","count":-2}`,
		`{"gpu":0,"call":"GetMigMode","count":-1,"error":"ERROR_TIMEOUT"}`,
		`{"gpu":0,"call":"GpuInstanceDestroy","count":1,"error":"ERROR_IN_USE"}`,
		`{"gpu":0,"call":"GetMigMode","count":1,"error":"SUCCESS"}`,
	} {
		f.Add("POST", "/sim/fail", []byte(body))
	}
	f.Add("POST", "/sim/flaky", []byte(`{"rate":0.5,"seed":3}`))
	f.Add("POST", "/sim/flaky", []byte(`{"rate":1.5}`))
	f.Add("POST", "/sim/utilization", []byte(`{"gpu":1,"gi":1,"gpu_util":40,"mem_util":101}`))
	f.Add("POST", "/sim/utilization", []byte(`{"gpu":1,"gi":2,"gpu_util":40}`))
	f.Add("POST", "/sim/xid", []byte(`{"gpu":7,"xid":48,"gi":4294967295}`))
	f.Add("POST", "/sim/lost", []byte(`{"gpu":2,"lost":false}`))
	f.Add("PUT", "/sim/reset", []byte(`{"gpu":0}`))
	f.Add("POST", "/sim/reset", []byte(`{"gpu":0} `))
	f.Add("POST", "/sim/reset", []byte(`{"gpu":0} x`))
	f.Add("POST", "/sim/reset", []byte(`{"GPU":1}`))
	f.Add("POST", "/sim/reset", []byte(`{"gpu":1,"pad":"`+strings.Repeat("x", maxRequestBytes)+`"}`))

	// A node costs about a millisecond to build, far more than a request:
	// a worker keeps one while it takes only refused requests, which (as
	// asserted) leave it as built, and builds another after each accepted one.
	var n *Node
	var built string
	f.Fuzz(func(t *testing.T, method, path string, body []byte) {
		defer func() {
			if t.Failed() {
				n = nil // a failure may leave it changed: the next input gets a new one
			}
		}()
		if n == nil {
			n = httpFuzzNode(t)
			built = simState(n)
		}
		before := simState(n)
		if before != built {
			t.Fatalf("node reused in another state than built:\nbuilt %s\nnow   %s", built, before)
		}

		req := httptest.NewRequest(http.MethodPost, "/", bytes.NewReader(body))
		req.Method, req.URL.Path = method, path // any bytes, not only what a URL parser passes
		rec := httptest.NewRecorder()
		n.Handler().ServeHTTP(rec, req)

		var resp struct {
			OK    bool   `json:"ok"`
			Error string `json:"error"`
		}
		if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil {
			t.Fatalf("status %d with a body that is not JSON: %q", rec.Code, rec.Body)
		}
		switch rec.Code {
		case http.StatusOK:
			if !resp.OK || resp.Error != "" {
				t.Fatalf("200 with %q", rec.Body)
			}
			n.Shutdown()
			n = nil
			return
		case http.StatusBadRequest, http.StatusNotFound, http.StatusMethodNotAllowed:
			if resp.OK || resp.Error == "" {
				t.Fatalf("%d without an error: %q", rec.Code, rec.Body)
			}
		default:
			t.Fatalf("status %d for %s %q %q: %s", rec.Code, method, path, body, rec.Body)
		}
		if after := simState(n); after != before {
			t.Fatalf("refused request (%d %s) changed the node:\nbefore %s\nafter  %s", rec.Code, resp.Error, before, after)
		}
	})
}

// httpFuzzNode is a dgx-a100 with MIG on and two GPU instances on GPU 1
// (3g.20gb and 1g.5gb, each with its compute instance), and an event set
// registered for every event of every GPU.
func httpFuzzNode(t *testing.T) *Node {
	clock := time.Date(2025, 1, 1, 0, 0, 0, 0, time.UTC)
	n, err := New("dgx-a100", WithMIGEnabled(), WithClock(func() time.Time { return clock }))
	if err != nil {
		t.Fatal(err)
	}
	if r := n.Init(); r != nvml.SUCCESS {
		t.Fatal(r)
	}
	d := handle(t, n, 1)
	createFullCI(t, createGI(t, d, nvml.GPU_INSTANCE_PROFILE_3_SLICE, 4))
	createFullCI(t, createGI(t, d, nvml.GPU_INSTANCE_PROFILE_1_SLICE, 0))
	events, r := n.EventSetCreate()
	if r != nvml.SUCCESS {
		t.Fatal(r)
	}
	for i := range n.gpus {
		if r := handle(t, n, i).RegisterEvents(supportedEvents, events); r != nvml.SUCCESS {
			t.Fatalf("RegisterEvents on GPU %d: %v", i, r)
		}
	}
	return n
}

// simState renders everything a /sim request can change: the kept state as
// the state file would hold it, the telemetry the requests set, injected
// failures and the events queued on each event set.
func simState(n *Node) string {
	n.mu.Lock()
	defer n.mu.Unlock()
	kept, err := json.Marshal(n.record())
	if err != nil {
		panic(err)
	}
	var b strings.Builder
	b.Write(kept)
	for _, g := range n.gpus {
		fmt.Fprintf(&b, "\ngpu %d: util %d/%d, memory %d, codec %d/%d", g.index, g.gpuUtil, g.memUtil, g.memUsed, g.encUtil, g.decUtil)
		for _, gi := range g.gis {
			fmt.Fprintf(&b, ", gi %d %d/%d", gi.id, gi.util, gi.memUtil)
		}
	}
	keys := slices.SortedFunc(maps.Keys(n.failures), func(a, b failKey) int {
		if a.gpu != b.gpu {
			return a.gpu - b.gpu
		}
		return strings.Compare(a.call, b.call)
	})
	for _, k := range keys {
		fmt.Fprintf(&b, "\nfail gpu %d %s: %+v", k.gpu, k.call, n.failures[k])
	}
	fmt.Fprintf(&b, "\nflaky %v (%t)", n.flakyRate, n.flakyRand != nil)
	for s := range n.sets {
		fmt.Fprintf(&b, "\nevents queued: %d", len(s.queue))
	}
	return b.String()
}
