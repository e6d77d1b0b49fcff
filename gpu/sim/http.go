package sim

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// maxRequestBytes bounds a fault-injection request body.
const maxRequestBytes = 64 << 10

// Handler serves fault injection over HTTP (see the package documentation
// for the endpoints). It answers both with and without the "/sim" prefix,
// so it can be mounted at "/sim/" with or without http.StripPrefix.
func (n *Node) Handler() http.Handler {
	return http.HandlerFunc(n.serveHTTP)
}

func (n *Node) serveHTTP(w http.ResponseWriter, r *http.Request) {
	path := strings.TrimPrefix(r.URL.Path, "/sim")
	if path == "/state" {
		n.serveState(w, r)
		return
	}
	var route func(*Node, *json.Decoder) error
	switch path {
	case "/xid":
		route = serveXID
	case "/lost":
		route = serveLost
	case "/reset":
		route = serveReset
	case "/reboot":
		route = serveReboot
	case "/utilization":
		route = serveUtilization
	case "/fail":
		route = serveFail
	case "/flaky":
		route = serveFlaky
	case "/process":
		route = serveProcess
	case "/process/stop":
		route = serveProcessStop
	case "/fabric":
		route = serveFabric
	default:
		writeJSON(w, http.StatusNotFound, map[string]string{"error": fmt.Sprintf("no such endpoint %q", r.URL.Path)})
		return
	}
	if r.Method != http.MethodPost {
		w.Header().Set("Allow", http.MethodPost)
		writeJSON(w, http.StatusMethodNotAllowed, map[string]string{"error": r.Method + " not allowed, use POST"})
		return
	}
	dec := json.NewDecoder(http.MaxBytesReader(w, r.Body, maxRequestBytes))
	dec.DisallowUnknownFields()
	if err := route(n, dec); err != nil {
		writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
		return
	}
	writeJSON(w, http.StatusOK, map[string]bool{"ok": true})
}

// serveState answers GET /sim/state with the node's kept state (State), so
// the offline tools (gpu-agent config validate --addr) can plan on a copy
// of a node a running agent holds the state file of.
func (n *Node) serveState(w http.ResponseWriter, r *http.Request) {
	if r.Method != http.MethodGet {
		w.Header().Set("Allow", http.MethodGet)
		writeJSON(w, http.StatusMethodNotAllowed, map[string]string{"error": r.Method + " not allowed, use GET"})
		return
	}
	data, err := n.State()
	if err != nil {
		writeJSON(w, http.StatusInternalServerError, map[string]string{"error": err.Error()})
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_, _ = w.Write(data) // the client went away; nothing to do
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_ = json.NewEncoder(w).Encode(v) // the client went away; nothing to do
}

// decode reads exactly one JSON object into v, a pointer to a struct whose
// json tags are the endpoint's fields.
func decode(dec *json.Decoder, v any) error {
	if err := dec.Decode(v); err != nil {
		if errors.Is(err, io.EOF) {
			return fmt.Errorf("empty body, want a JSON object with %s", fieldList(v))
		}
		// encoding/json names Go types ("cannot unmarshal array into Go
		// value of type struct { GPU *int ...}"); the caller wrote JSON.
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			if te.Field == "" {
				return fmt.Errorf("bad JSON: the body is a JSON %s, want one JSON object with %s", te.Value, fieldList(v))
			}
			return fmt.Errorf("bad JSON: %q is a JSON %s, want %s", te.Field, te.Value, jsonKind(te.Type))
		}
		return fmt.Errorf("bad JSON: %w", err)
	}
	if err := dec.Decode(&struct{}{}); !errors.Is(err, io.EOF) {
		return errors.New("bad JSON: more than one value in body")
	}
	return nil
}

// fieldList names the JSON fields of the struct v points to, for errors:
// `"gpu", "xid", "gi" or "ci"`.
func fieldList(v any) string {
	t := reflect.TypeOf(v)
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	if t.Kind() != reflect.Struct {
		return "its fields"
	}
	var names []string
	for f := range t.Fields() {
		if name, _, _ := strings.Cut(f.Tag.Get("json"), ","); name != "" && name != "-" {
			names = append(names, strconv.Quote(name))
		}
	}
	switch len(names) {
	case 0:
		return "no fields"
	case 1:
		return "field " + names[0]
	}
	return "fields " + strings.Join(names[:len(names)-1], ", ") + " or " + names[len(names)-1]
}

// jsonKind says which JSON value a Go type decodes from.
func jsonKind(t reflect.Type) string {
	for t.Kind() == reflect.Pointer {
		t = t.Elem()
	}
	switch t.Kind() {
	case reflect.Bool:
		return "true or false"
	case reflect.String:
		return "a string"
	case reflect.Int, reflect.Int8, reflect.Int16, reflect.Int32, reflect.Int64:
		return "an integer"
	case reflect.Uint, reflect.Uint8, reflect.Uint16, reflect.Uint32, reflect.Uint64:
		return "an integer of 0 or more"
	case reflect.Float32, reflect.Float64:
		return "a number"
	case reflect.Slice, reflect.Array:
		return "an array"
	}
	return "an object"
}

func needGPU(gpu *int) (int, error) {
	if gpu == nil {
		return 0, errors.New(`missing "gpu"`)
	}
	return *gpu, nil
}

func serveXID(n *Node, dec *json.Decoder) error {
	var req struct {
		GPU *int    `json:"gpu"`
		XID *uint64 `json:"xid"`
		GI  *uint32 `json:"gi"`
		CI  *uint32 `json:"ci"`
	}
	if err := decode(dec, &req); err != nil {
		return err
	}
	gpu, err := needGPU(req.GPU)
	if err != nil {
		return err
	}
	if req.XID == nil {
		return errors.New(`missing "xid"`)
	}
	e := Event{GPU: gpu, Type: nvml.EventTypeXidCriticalError, Data: *req.XID, GI: NoInstance, CI: NoInstance}
	if req.GI != nil {
		e.GI = *req.GI
	}
	if req.CI != nil {
		e.CI = *req.CI
	}
	return n.InjectEvent(e)
}

func serveLost(n *Node, dec *json.Decoder) error {
	var req struct {
		GPU  *int  `json:"gpu"`
		Lost *bool `json:"lost"`
	}
	if err := decode(dec, &req); err != nil {
		return err
	}
	gpu, err := needGPU(req.GPU)
	if err != nil {
		return err
	}
	lost := req.Lost == nil || *req.Lost
	return n.SetLost(gpu, lost)
}

func serveReset(n *Node, dec *json.Decoder) error {
	var req struct {
		GPU *int `json:"gpu"`
	}
	if err := decode(dec, &req); err != nil {
		return err
	}
	gpu, err := needGPU(req.GPU)
	if err != nil {
		return err
	}
	return n.Reset(gpu)
}

// serveReboot takes an empty body or {}: a reboot is of the whole node.
func serveReboot(n *Node, dec *json.Decoder) error {
	var req struct{}
	if err := dec.Decode(&req); err != nil && !errors.Is(err, io.EOF) {
		var te *json.UnmarshalTypeError
		if errors.As(err, &te) {
			return fmt.Errorf("bad JSON: the body is a JSON %s, want none or {} (a reboot is of the whole node)", te.Value)
		}
		if strings.Contains(err.Error(), "unknown field") {
			return fmt.Errorf("bad JSON: %w: a reboot is of the whole node and takes no fields", err)
		}
		return fmt.Errorf("bad JSON: %w", err)
	}
	if err := dec.Decode(&struct{}{}); !errors.Is(err, io.EOF) {
		return errors.New("bad JSON: more than one value in body")
	}
	return n.Reboot()
}

func serveUtilization(n *Node, dec *json.Decoder) error {
	var req struct {
		GPU     *int    `json:"gpu"`
		GI      *int    `json:"gi"`
		GPUUtil *uint32 `json:"gpu_util"`
		MemUtil *uint32 `json:"mem_util"`
		MemUsed *uint64 `json:"mem_used_bytes"`
		EncUtil *uint32 `json:"enc_util"`
		DecUtil *uint32 `json:"dec_util"`
	}
	if err := decode(dec, &req); err != nil {
		return err
	}
	gpu, err := needGPU(req.GPU)
	if err != nil {
		return err
	}
	if req.GI != nil {
		if req.MemUsed != nil || req.EncUtil != nil || req.DecUtil != nil {
			return errors.New(`a GPU instance ("gi") takes only "gpu_util" and "mem_util"`)
		}
	} else if req.GPUUtil == nil && req.MemUtil == nil && req.MemUsed == nil && req.EncUtil == nil && req.DecUtil == nil {
		return errors.New(`nothing to set: give "gpu_util", "mem_util", "mem_used_bytes", "enc_util" or "dec_util"`)
	}
	// Apply under one lock so a bad field leaves the GPU unchanged.
	return n.update(gpu, func(g *gpuState) error {
		pick := func(p *uint32, old uint32) uint32 {
			if p != nil {
				return *p
			}
			return old
		}
		if req.GI != nil {
			for _, gi := range g.gis {
				if gi.id == *req.GI {
					gu, mu := pick(req.GPUUtil, gi.util), pick(req.MemUtil, gi.memUtil)
					if gu > 100 || mu > 100 {
						return fmt.Errorf("utilization %d%%/%d%% above 100%%", gu, mu)
					}
					gi.util, gi.memUtil = gu, mu
					return nil
				}
			}
			return fmt.Errorf("no GPU instance %d", *req.GI)
		}
		gu, mu := pick(req.GPUUtil, g.gpuUtil), pick(req.MemUtil, g.memUtil)
		eu, du := pick(req.EncUtil, g.encUtil), pick(req.DecUtil, g.decUtil)
		if gu > 100 || mu > 100 || eu > 100 || du > 100 {
			return fmt.Errorf("utilization %d%%/%d%% (encoder %d%%, decoder %d%%) above 100%%", gu, mu, eu, du)
		}
		used := g.memUsed
		if req.MemUsed != nil {
			used = *req.MemUsed
		}
		if usable := n.spec.model.usable(); used > usable {
			return fmt.Errorf("memory used %d bytes exceeds the %d not reserved", used, usable)
		}
		g.gpuUtil, g.memUtil, g.memUsed, g.encUtil, g.decUtil = gu, mu, used, eu, du
		return nil
	})
}

func serveFail(n *Node, dec *json.Decoder) error {
	var req struct {
		GPU   *int    `json:"gpu"`
		Call  *string `json:"call"`
		Error *string `json:"error"`
		Count *int    `json:"count"`
	}
	if err := decode(dec, &req); err != nil {
		return err
	}
	gpu, err := needGPU(req.GPU)
	if err != nil {
		return err
	}
	if req.Call == nil {
		return errors.New(`missing "call" (an NVML method such as "GetMigMode")`)
	}
	// No default count: 0 clears, and a forgotten count that failed calls
	// forever would look like a hung agent.
	if req.Count == nil {
		return errors.New(`missing "count" (calls to fail; -1 until cleared, 0 clears)`)
	}
	if *req.Count < -1 {
		return fmt.Errorf(`"count" %d: want the number of calls to fail, -1 (until cleared) or 0 (clears)`, *req.Count)
	}
	ret := nvml.ERROR_UNKNOWN
	if req.Error != nil {
		if ret, err = parseReturn(*req.Error); err != nil {
			return fmt.Errorf(`"error": %w`, err)
		}
	}
	return n.FailCalls(gpu, *req.Call, ret, *req.Count)
}

func serveFlaky(n *Node, dec *json.Decoder) error {
	var req struct {
		Rate *float64 `json:"rate"`
		Seed int64    `json:"seed"`
	}
	if err := decode(dec, &req); err != nil {
		return err
	}
	if req.Rate == nil {
		return errors.New(`missing "rate" (0 to 1; 0 turns it off)`)
	}
	return n.SetFlaky(*req.Rate, req.Seed)
}

// serveProcess starts a process or changes a running one: fields left out
// keep their value (on a new process, 0). The device is "gpu" (with "gi"
// and "ci" for a MIG device) or its "uuid", which a workload finds in its
// environment. One PID may run on several GPUs, as a process using two
// GPUs does; each is set on its own.
func serveProcess(n *Node, dec *json.Decoder) error {
	var req struct {
		GPU     *int    `json:"gpu"`
		UUID    *string `json:"uuid"`
		GI      *uint32 `json:"gi"`
		CI      *uint32 `json:"ci"`
		PID     *uint32 `json:"pid"`
		MPS     *bool   `json:"mps"`
		MemUsed *uint64 `json:"mem_used_bytes"`
		SM      *uint32 `json:"sm_util"`
		Mem     *uint32 `json:"mem_util"`
		Enc     *uint32 `json:"enc_util"`
		Dec     *uint32 `json:"dec_util"`
		Cgroup  *string `json:"cgroup"`
	}
	if err := decode(dec, &req); err != nil {
		return err
	}
	if req.PID == nil {
		return errors.New(`missing "pid"`)
	}
	gpu, gi, ci, err := n.processDevice(req.GPU, req.UUID, req.GI, req.CI)
	if err != nil {
		return err
	}
	return n.update(gpu, func(g *gpuState) error {
		p := Process{PID: *req.PID, GI: gi, CI: ci}
		if i := slices.IndexFunc(g.procs, func(q process) bool { return q.Pid == *req.PID }); i >= 0 {
			p = g.procs[i].export()
			if req.GPU != nil || req.UUID != nil {
				p.GI, p.CI = gi, ci
			}
		}
		for _, f := range []struct {
			from *uint32
			to   *uint32
		}{{req.SM, &p.SM}, {req.Mem, &p.Mem}, {req.Enc, &p.Enc}, {req.Dec, &p.Dec}} {
			if f.from != nil {
				*f.to = *f.from
			}
		}
		if req.MPS != nil {
			p.MPS = *req.MPS
		}
		if req.MemUsed != nil {
			p.MemoryBytes = *req.MemUsed
		}
		if req.Cgroup != nil {
			p.Cgroup = *req.Cgroup
		}
		return n.startProcess(g, p)
	})
}

// serveProcessStop ends a process: on the GPU "gpu" or "uuid" names, or
// without either on every GPU it runs on.
func serveProcessStop(n *Node, dec *json.Decoder) error {
	var req struct {
		GPU  *int    `json:"gpu"`
		UUID *string `json:"uuid"`
		PID  *uint32 `json:"pid"`
	}
	if err := decode(dec, &req); err != nil {
		return err
	}
	if req.PID == nil {
		return errors.New(`missing "pid"`)
	}
	if req.GPU == nil && req.UUID == nil {
		gpus := n.processGPUs(*req.PID)
		if len(gpus) == 0 {
			return fmt.Errorf("no process %d on any GPU", *req.PID)
		}
		for _, gpu := range gpus {
			if err := n.StopProcess(gpu, *req.PID); err != nil {
				return err
			}
		}
		return nil
	}
	gpu, _, _, err := n.processDevice(req.GPU, req.UUID, nil, nil)
	if err != nil {
		return err
	}
	return n.StopProcess(gpu, *req.PID)
}

// processDevice resolves where a /sim/process request puts its process:
// a GPU index, and the MIG device's GI and CI or NoInstance.
func (n *Node) processDevice(gpu *int, uuid *string, gi, ci *uint32) (int, uint32, uint32, error) {
	switch {
	case gpu != nil && uuid != nil:
		return 0, 0, 0, errors.New(`give "gpu" or "uuid", not both`)
	case uuid != nil && (gi != nil || ci != nil):
		return 0, 0, 0, errors.New(`"gi" and "ci" come with "gpu"; a MIG device's "uuid" names them`)
	case (gi == nil) != (ci == nil):
		return 0, 0, 0, errors.New(`a MIG device needs both "gi" and "ci"`)
	case uuid != nil:
		return n.deviceOf(*uuid)
	case gpu != nil:
		if gi == nil {
			return *gpu, NoInstance, NoInstance, nil
		}
		return *gpu, *gi, *ci, nil
	}
	return 0, 0, 0, errors.New(`missing "gpu" or "uuid"`)
}

// deviceOf finds the GPU and MIG device of a GPU or MIG device UUID.
func (n *Node) deviceOf(uuid string) (int, uint32, uint32, error) {
	n.mu.Lock()
	defer n.mu.Unlock()
	for _, g := range n.gpus {
		if g.uuid == uuid {
			return g.index, NoInstance, NoInstance, nil
		}
		for _, gi := range g.gis {
			for _, ci := range gi.cis {
				if ci.dev.uuid == uuid {
					return g.index, uint32(gi.id), uint32(ci.id), nil
				}
			}
		}
	}
	return 0, 0, 0, fmt.Errorf("no GPU or MIG device %q", uuid)
}

// processGPUs lists the GPUs pid runs on.
func (n *Node) processGPUs(pid uint32) []int {
	n.mu.Lock()
	defer n.mu.Unlock()
	var out []int
	for _, g := range n.gpus {
		if slices.ContainsFunc(g.procs, func(p process) bool { return p.Pid == pid }) {
			out = append(out, g.index)
		}
	}
	return out
}

// serveFabric sets one GPU's whole FabricFault: fields left out are no
// fault, so {"gpu":0} clears it.
func serveFabric(n *Node, dec *json.Decoder) error {
	var req struct {
		GPU            *int    `json:"gpu"`
		State          *string `json:"state"`
		Status         *string `json:"status"`
		DegradedBW     bool    `json:"degraded_bw"`
		RouteRecovery  bool    `json:"route_recovery"`
		RouteUnhealthy bool    `json:"route_unhealthy"`
	}
	if err := decode(dec, &req); err != nil {
		return err
	}
	gpu, err := needGPU(req.GPU)
	if err != nil {
		return err
	}
	f := FabricFault{DegradedBandwidth: req.DegradedBW, RouteRecovery: req.RouteRecovery, RouteUnhealthy: req.RouteUnhealthy}
	if req.State != nil {
		if f.State, err = ParseFabricState(*req.State); err != nil {
			return fmt.Errorf(`"state": %w`, err)
		}
	}
	if req.Status != nil && *req.Status != "SUCCESS" {
		if f.Status, err = parseReturn(*req.Status); err != nil {
			return fmt.Errorf(`"status": %w`, err)
		}
	}
	return n.SetFabricFault(gpu, f)
}
