package sim

import (
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// httpCase is one request to the /sim handler and its answer, on one
// dgx-a100 that took the cases before it.
type httpCase struct {
	name    string
	method  string
	path    string
	body    string
	status  int
	errPart string // in the error message
}

func httpCases() []httpCase {
	return []httpCase{
		{"xid", "POST", "/sim/xid", `{"gpu":1,"xid":48}`, 200, ""},
		{"xid with instance, prefix stripped", "POST", "/xid", `{"gpu":1,"xid":94,"gi":2,"ci":0}`, 200, ""},
		{"xid missing gpu", "POST", "/sim/xid", `{"xid":48}`, 400, `missing "gpu"`},
		{"xid missing xid", "POST", "/sim/xid", `{"gpu":1}`, 400, `missing "xid"`},
		{"xid gpu out of range", "POST", "/sim/xid", `{"gpu":8,"xid":48}`, 400, "out of range"},
		{"unknown field", "POST", "/sim/xid", `{"gpu":1,"xid":48,"extra":1}`, 400, "extra"},
		{"negative gpu index", "POST", "/sim/xid", `{"gpu":-1,"xid":48}`, 400, "out of range"},
		{"wrong type", "POST", "/sim/xid", `{"gpu":"one","xid":48}`, 400, `bad JSON: "gpu" is a JSON string, want an integer`},
		{"array, not object", "POST", "/sim/xid", `[{"gpu":1,"xid":48}]`, 400,
			`bad JSON: the body is a JSON array, want one JSON object with fields "gpu", "xid", "gi" or "ci"`},
		{"number, not object", "POST", "/sim/reset", `3`, 400, `the body is a JSON number, want one JSON object with field "gpu"`},
		{"two objects", "POST", "/sim/reset", `{"gpu":1}{"gpu":2}`, 400, "more than one"},
		{"empty body", "POST", "/sim/lost", ``, 400, `empty body, want a JSON object with fields "gpu" or "lost"`},
		{"utilization", "POST", "/sim/utilization", `{"gpu":3,"gpu_util":80,"mem_used_bytes":1073741824,"mem_util":20}`, 200, ""},
		{"utilization over 100", "POST", "/sim/utilization", `{"gpu":3,"gpu_util":180}`, 400, "above 100"},
		{"utilization nothing to set", "POST", "/sim/utilization", `{"gpu":3}`, 400, "nothing to set"},
		{"codec utilization", "POST", "/sim/utilization", `{"gpu":2,"enc_util":30,"dec_util":40}`, 200, ""},
		{"codec utilization over 100", "POST", "/sim/utilization", `{"gpu":2,"dec_util":101}`, 400, "above 100"},
		{"GPU instance utilization without MIG", "POST", "/sim/utilization", `{"gpu":2,"gi":1,"gpu_util":10}`, 400, "no GPU instance 1"},
		{"GPU instance takes no memory bytes", "POST", "/sim/utilization", `{"gpu":2,"gi":1,"mem_used_bytes":1}`, 400, "takes only"},
		{"memory above what is not reserved", "POST", "/sim/utilization", `{"gpu":2,"mem_used_bytes":42949672960}`, 400, "not reserved"},
		{"process", "POST", "/sim/process", `{"gpu":4,"pid":4242,"sm_util":60,"mem_used_bytes":1073741824}`, 200, ""},
		{"process over 100", "POST", "/sim/process", `{"gpu":4,"pid":4242,"mem_util":101}`, 400, "above 100"},
		{"process on a MIG device of a whole GPU", "POST", "/sim/process", `{"gpu":4,"gi":1,"ci":0,"pid":4243}`, 400, "MIG is off"},
		{"process stop", "POST", "/sim/process/stop", `{"gpu":4,"pid":4242}`, 200, ""},
		{"process stop again", "POST", "/sim/process/stop", `{"pid":4242}`, 400, "no process 4242"},
		{"lost", "POST", "/sim/lost", `{"gpu":5}`, 200, ""},
		{"reset", "POST", "/sim/reset", `{"gpu":6}`, 200, ""},
		{"GET not allowed", "GET", "/sim/xid", ``, 405, "use POST"},
		{"unknown path", "POST", "/sim/melt", `{}`, 404, "no such endpoint"},
	}
}

func TestHTTPHandler(t *testing.T) {
	tests := httpCases()
	n := newNode(t, "dgx-a100")
	s := registered(t, n, nvml.EventTypeXidCriticalError, 1)
	h := n.Handler()
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			h.ServeHTTP(rec, httptest.NewRequest(tt.method, tt.path, strings.NewReader(tt.body)))
			if rec.Code != tt.status {
				t.Fatalf("status %d, want %d; body %s", rec.Code, tt.status, rec.Body)
			}
			if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
				t.Errorf("Content-Type %q", ct)
			}
			var resp struct {
				OK    bool   `json:"ok"`
				Error string `json:"error"`
			}
			if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil {
				t.Fatalf("response %q: %v", rec.Body, err)
			}
			if tt.status == 200 && !resp.OK || tt.status != 200 && !strings.Contains(resp.Error, tt.errPart) {
				t.Errorf("response %+v, want error containing %q", resp, tt.errPart)
			}
			if tt.status == http.StatusMethodNotAllowed && rec.Header().Get("Allow") != "POST" {
				t.Errorf("Allow header %q", rec.Header().Get("Allow"))
			}
		})
	}

	// The effects are visible through NVML.
	for _, want := range []nvml.EventData{
		{EventData: 48, GpuInstanceId: NoInstance, ComputeInstanceId: NoInstance},
		{EventData: 94, GpuInstanceId: 2, ComputeInstanceId: 0},
	} {
		e, r := s.Wait(100)
		if r != nvml.SUCCESS || e.EventData != want.EventData || e.GpuInstanceId != want.GpuInstanceId || e.ComputeInstanceId != want.ComputeInstanceId {
			t.Errorf("event %+v, %v; want %+v", e, r, want)
		}
	}
	if u, _ := handle(t, n, 3).GetUtilizationRates(); u != (nvml.Utilization{Gpu: 80, Memory: 20}) {
		t.Errorf("utilization %+v", u)
	}
	if m, _ := handle(t, n, 3).GetMemoryInfo_v2(); m.Used != 1<<30 {
		t.Errorf("memory used %d", m.Used)
	}
	if u, _, r := handle(t, n, 2).GetDecoderUtilization(); r != nvml.SUCCESS || u != 40 {
		t.Errorf("decoder utilization %d, %v", u, r)
	}
	if _, r := n.DeviceGetHandleByIndex(5); r != nvml.ERROR_GPU_IS_LOST {
		t.Errorf("GPU 5 after /sim/lost: %v", r)
	}
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest("POST", "/sim/lost", strings.NewReader(`{"gpu":5,"lost":false}`)))
	if _, r := n.DeviceGetHandleByIndex(5); rec.Code != 200 || r != nvml.SUCCESS {
		t.Errorf("GPU 5 after lost=false: %d %v", rec.Code, r)
	}
}

// /sim/fail takes a count of -1 (until cleared), 0 (clear) or a number of
// calls; anything below -1 is refused, naming the field, and fails no call.
func TestHTTPFailCount(t *testing.T) {
	tests := []struct {
		name   string
		count  string
		status int
		want   string // in the error, or the GetMigMode results after the request
	}{
		{"until cleared", "-1", 200, "UUU"},
		{"clears", "0", 200, "..."},
		{"twice", "2", 200, "UU."},
		{"minus two", "-2", 400, `"count" -2`},
		{"most negative", "-9223372036854775808", 400, `"count" -9223372036854775808`},
		{"not an integer", "1.5", 400, "bad JSON"},
		{"missing", "", 400, `missing "count"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			n := newNode(t, "dgx-h100")
			body := `{"gpu":0,"call":"GetMigMode","error":"ERROR_UNKNOWN"`
			if tt.count != "" {
				body += `,"count":` + tt.count
			}
			body += "}"
			rec := httptest.NewRecorder()
			n.Handler().ServeHTTP(rec, httptest.NewRequest("POST", "/sim/fail", strings.NewReader(body)))
			if rec.Code != tt.status {
				t.Fatalf("status %d, want %d; body %s", rec.Code, tt.status, rec.Body)
			}
			var calls strings.Builder
			for range 3 {
				switch _, _, r := handle(t, n, 0).GetMigMode(); r {
				case nvml.SUCCESS:
					calls.WriteByte('.')
				case nvml.ERROR_UNKNOWN:
					calls.WriteByte('U')
				default:
					t.Fatalf("GetMigMode: %v", r)
				}
			}
			if tt.status != 200 {
				var resp struct{ Error string }
				if err := json.Unmarshal(rec.Body.Bytes(), &resp); err != nil || !strings.Contains(resp.Error, tt.want) {
					t.Errorf("error %q (%v), want it to contain %q", resp.Error, err, tt.want)
				}
				if calls.String() != "..." {
					t.Errorf("refused request changed the node: GetMigMode gave %s", calls.String())
				}
				return
			}
			if calls.String() != tt.want {
				t.Errorf("GetMigMode gave %s, want %s", calls.String(), tt.want)
			}
		})
	}
}

// GET /sim/state answers the node's State, from which a copy builds.
func TestHTTPState(t *testing.T) {
	n := newNode(t, "dgx-h100-mig")
	rec := httptest.NewRecorder()
	n.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/sim/state", nil))
	want, err := n.State()
	if err != nil {
		t.Fatal(err)
	}
	if rec.Code != http.StatusOK || rec.Body.String() != string(want) {
		t.Fatalf("GET /sim/state: %d %q, want 200 and the node's State", rec.Code, rec.Body.String())
	}
	if _, err := New("dgx-h100-mig", WithState(rec.Body.Bytes())); err != nil {
		t.Errorf("copy from /sim/state: %v", err)
	}
	rec = httptest.NewRecorder()
	n.Handler().ServeHTTP(rec, httptest.NewRequest("POST", "/sim/state", strings.NewReader(`{}`)))
	if rec.Code != http.StatusMethodNotAllowed || rec.Header().Get("Allow") != "GET" {
		t.Errorf("POST /sim/state: %d, Allow %q; want 405, GET", rec.Code, rec.Header().Get("Allow"))
	}
}

// /sim/reboot takes no body or {}, and reboots the node: a lost GPU is back
// and the boot id is new. Anything else is refused, saying what it takes.
func TestHTTPReboot(t *testing.T) {
	n := newNode(t, "dgx-a100")
	h := n.Handler()
	for _, tt := range []struct {
		name, body string
		status     int
		errPart    string
	}{
		{"no body", ``, 200, ""},
		{"empty object", `{}`, 200, ""},
		{"one GPU", `{"gpu":1}`, 400, "a reboot is of the whole node and takes no fields"},
		{"array", `[]`, 400, "the body is a JSON array, want none or {}"},
		{"two objects", `{}{}`, 400, "more than one value"},
	} {
		must(t, n.SetLost(5, true))
		boot := n.BootID()
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest("POST", "/sim/reboot", strings.NewReader(tt.body)))
		if rec.Code != tt.status || !strings.Contains(rec.Body.String(), tt.errPart) {
			t.Errorf("%s: %d %s, want %d and %q", tt.name, rec.Code, rec.Body, tt.status, tt.errPart)
		}
		_, r := n.DeviceGetHandleByIndex(5)
		if rebooted := n.BootID() != boot; rebooted != (tt.status == 200) || (r == nvml.SUCCESS) != rebooted {
			t.Errorf("%s: new boot %v, GPU 5 %v; want a reboot only when accepted", tt.name, rebooted, r)
		}
		must(t, n.SetLost(5, false))
	}
}
