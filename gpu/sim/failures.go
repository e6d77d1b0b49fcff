package sim

import (
	"fmt"
	"math"
	"math/rand"
	"reflect"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// failKey names the calls one FailCalls covers.
type failKey struct {
	gpu  int
	call string
}

type failure struct {
	ret  nvml.Return
	left int // calls still to fail; < 0 until cleared
}

// FailCalls makes the next count calls of one NVML method on GPU gpu (its
// handle, MIG device handles, GPU and compute instances) return ret instead
// of running, so nothing changes. count -1 fails every call until
// FailCalls is called again with count 0, which clears it; a count below -1
// is an error (it would read as a number of calls). Failures stand
// for the driver, not the GPU: they are not kept in the state file.
//
// call is the method's name on its handle: "GetMigMode" or
// "GetMigDeviceHandleByIndex" for nvml.Device (the nvml.Interface name,
// "DeviceGetMigMode", is accepted too); GPU and compute instance methods go
// by their nvml.Interface names, "GpuInstanceCreateComputeInstance",
// "ComputeInstanceDestroy", as their bare names clash. Methods the sim does
// not model fail the same way. Before Init, calls still return
// ERROR_UNINITIALIZED and count nothing.
func (n *Node) FailCalls(gpu int, call string, ret nvml.Return, count int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	g, err := n.gpu(gpu)
	if err != nil {
		return err
	}
	name, ok := canonicalCall(call)
	if !ok {
		return fmt.Errorf("sim gpu %d (%s): fail calls: %q is not a method of an NVML device, GPU instance or compute instance", g.index, g.uuid, call)
	}
	if ret == nvml.SUCCESS {
		return fmt.Errorf("sim gpu %d (%s): fail calls to %s: the return code must be an error, not SUCCESS", g.index, g.uuid, name)
	}
	if count < -1 {
		return fmt.Errorf("sim gpu %d (%s): fail calls to %s: count %d, want the number of calls, -1 (until cleared) or 0 (clears)", g.index, g.uuid, name, count)
	}
	k := failKey{g.index, name}
	if count == 0 {
		delete(n.failures, k)
		return nil
	}
	n.failures[k] = failure{ret: ret, left: count}
	return nil
}

// SetFlaky makes every call on a device, GPU or compute instance handle
// fail with ERROR_UNKNOWN with probability rate (0 turns it off), drawn
// from a source seeded with seed: the same calls in the same order fail
// the same way in every run. FailCalls takes precedence.
func (n *Node) SetFlaky(rate float64, seed int64) error {
	if math.IsNaN(rate) || rate < 0 || rate > 1 {
		return fmt.Errorf("sim %s: flaky rate %v outside [0, 1]", n.spec.name, rate)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	n.flakyRate = rate
	n.flakyRand = nil
	if rate > 0 {
		n.flakyRand = rand.New(rand.NewSource(seed))
	}
	return nil
}

// injected is the injected failure, if any, of call on GPU g; callers hold
// n.mu and have checked the node is initialised.
func (n *Node) injected(g *gpuState, call string) nvml.Return {
	if r := n.injectedCall(g, call); r != nvml.SUCCESS {
		return r
	}
	if n.flakyRand != nil && n.flakyRand.Float64() < n.flakyRate {
		return nvml.ERROR_UNKNOWN
	}
	return nvml.SUCCESS
}

// injectedCall is injected without SetFlaky's draw: FailCalls alone.
func (n *Node) injectedCall(g *gpuState, call string) nvml.Return {
	k := failKey{g.index, call}
	if f, ok := n.failures[k]; ok {
		switch {
		case f.left == 1:
			delete(n.failures, k)
		case f.left > 1:
			f.left--
			n.failures[k] = f
		}
		return f.ret
	}
	return nvml.SUCCESS
}

// canonicalCall resolves a FailCalls name to the one the handles check.
func canonicalCall(call string) (string, bool) {
	if has(reflect.TypeFor[nvml.Device](), call) {
		return call, true
	}
	if m, ok := strings.CutPrefix(call, "Device"); ok && has(reflect.TypeFor[nvml.Device](), m) {
		return m, true
	}
	for _, h := range []reflect.Type{reflect.TypeFor[nvml.GpuInstance](), reflect.TypeFor[nvml.ComputeInstance]()} {
		if m, ok := strings.CutPrefix(call, h.Name()); ok && has(h, m) {
			return call, true
		}
	}
	return "", false
}

// has reports whether interface t has method name returning an nvml.Return
// (the others cannot report a failure).
func has(t reflect.Type, name string) bool {
	m, ok := t.MethodByName(name)
	if !ok {
		return false
	}
	for i := range m.Type.NumOut() {
		if m.Type.Out(i) == returnType {
			return true
		}
	}
	return false
}

// returnCodes are the codes /sim/fail accepts, by the names NVML's headers
// give them. Spelled out rather than read from Return.Error, which gives
// the real library's messages once that is loaded.
func returnCodes() []namedReturn {
	return []namedReturn{
		{"ERROR_UNINITIALIZED", nvml.ERROR_UNINITIALIZED},
		{"ERROR_INVALID_ARGUMENT", nvml.ERROR_INVALID_ARGUMENT},
		{"ERROR_NOT_SUPPORTED", nvml.ERROR_NOT_SUPPORTED},
		{"ERROR_NO_PERMISSION", nvml.ERROR_NO_PERMISSION},
		{"ERROR_NOT_FOUND", nvml.ERROR_NOT_FOUND},
		{"ERROR_INSUFFICIENT_SIZE", nvml.ERROR_INSUFFICIENT_SIZE},
		{"ERROR_INSUFFICIENT_POWER", nvml.ERROR_INSUFFICIENT_POWER},
		{"ERROR_DRIVER_NOT_LOADED", nvml.ERROR_DRIVER_NOT_LOADED},
		{"ERROR_TIMEOUT", nvml.ERROR_TIMEOUT},
		{"ERROR_IRQ_ISSUE", nvml.ERROR_IRQ_ISSUE},
		{"ERROR_CORRUPTED_INFOROM", nvml.ERROR_CORRUPTED_INFOROM},
		{"ERROR_GPU_IS_LOST", nvml.ERROR_GPU_IS_LOST},
		{"ERROR_RESET_REQUIRED", nvml.ERROR_RESET_REQUIRED},
		{"ERROR_OPERATING_SYSTEM", nvml.ERROR_OPERATING_SYSTEM},
		{"ERROR_LIB_RM_VERSION_MISMATCH", nvml.ERROR_LIB_RM_VERSION_MISMATCH},
		{"ERROR_IN_USE", nvml.ERROR_IN_USE},
		{"ERROR_MEMORY", nvml.ERROR_MEMORY},
		{"ERROR_NO_DATA", nvml.ERROR_NO_DATA},
		{"ERROR_INSUFFICIENT_RESOURCES", nvml.ERROR_INSUFFICIENT_RESOURCES},
		{"ERROR_ARGUMENT_VERSION_MISMATCH", nvml.ERROR_ARGUMENT_VERSION_MISMATCH},
		{"ERROR_NOT_READY", nvml.ERROR_NOT_READY},
		{"ERROR_UNKNOWN", nvml.ERROR_UNKNOWN},
	}
}

type namedReturn struct {
	name string
	ret  nvml.Return
}

// parseReturn reads an NVML return code's name, such as "ERROR_TIMEOUT".
func parseReturn(name string) (nvml.Return, error) {
	var names []string
	for _, c := range returnCodes() {
		if c.name == name {
			return c.ret, nil
		}
		names = append(names, c.name)
	}
	return 0, fmt.Errorf("unknown NVML error %q (known: %s)", name, strings.Join(names, ", "))
}

// returnName is parseReturn's inverse: "" for a code it does not know.
func returnName(r nvml.Return) string {
	for _, c := range returnCodes() {
		if c.ret == r {
			return c.name
		}
	}
	return ""
}
