package sim

import (
	"fmt"
	"reflect"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

var returnType = reflect.TypeFor[nvml.Return]()

// FillNotSupported sets every nil XxxFunc field of a go-nvml mock struct
// (mock.Interface, mock.Device, mock.GpuInstance, ...) to a function that
// returns zero values with every nvml.Return result set to
// ERROR_NOT_SUPPORTED, so an unmodelled call answers like an old GPU would
// instead of panicking. Fields already set are kept. It panics when
// mockStruct is not a non-nil pointer to a struct: that is a programming error.
func FillNotSupported(mockStruct any) {
	fillFuncs(mockStruct, func(string) nvml.Return { return nvml.ERROR_NOT_SUPPORTED })
}

// fillFuncs is FillNotSupported with the Return computed per call, so the
// sim can answer GPU_IS_LOST or UNINITIALIZED from calls it does not model.
// status gets the method's name (the field's, less "Func"), so injected
// failures (FailCalls) reach unmodelled calls too.
func fillFuncs(mockStruct any, status func(call string) nvml.Return) {
	v := reflect.ValueOf(mockStruct)
	if v.Kind() != reflect.Pointer || v.IsNil() || v.Elem().Kind() != reflect.Struct {
		panic(fmt.Sprintf("sim: FillNotSupported needs a non-nil pointer to a mock struct, got %T", mockStruct))
	}
	s := v.Elem()
	t := s.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		fv := s.Field(i)
		if !f.IsExported() || f.Type.Kind() != reflect.Func || !strings.HasSuffix(f.Name, "Func") || !fv.IsNil() {
			continue
		}
		call := strings.TrimSuffix(f.Name, "Func")
		fv.Set(reflect.MakeFunc(f.Type, notModelled(f.Type, func() nvml.Return { return status(call) })))
	}
}

func notModelled(ft reflect.Type, status func() nvml.Return) func([]reflect.Value) []reflect.Value {
	hasReturn := false
	for i := range ft.NumOut() {
		hasReturn = hasReturn || ft.Out(i) == returnType
	}
	return func([]reflect.Value) []reflect.Value {
		out := make([]reflect.Value, ft.NumOut())
		var r nvml.Return
		if hasReturn {
			r = status()
		}
		for i := range out {
			if ft.Out(i) == returnType {
				out[i] = reflect.ValueOf(r)
			} else {
				out[i] = reflect.Zero(ft.Out(i))
			}
		}
		return out
	}
}

// handleTypes are the handle interfaces whose methods nvml.Interface repeats
// as functions taking the handle first (DeviceGetName(Device) and so on).
var handleTypes = []reflect.Type{
	reflect.TypeFor[nvml.Device](),
	reflect.TypeFor[nvml.GpuInstance](),
	reflect.TypeFor[nvml.ComputeInstance](),
	reflect.TypeFor[nvml.EventSet](),
}

// forwardHandleFuncs sets each XxxYyyFunc field of an Interface mock whose
// first parameter is handle type Xxx to call method Yyy on that handle, as
// the real library does, so lib.DeviceGetName(d) and d.GetName() agree.
func forwardHandleFuncs(iface any) {
	s := reflect.ValueOf(iface).Elem()
	t := s.Type()
	for i := range t.NumField() {
		f := t.Field(i)
		ft := f.Type
		if ft.Kind() != reflect.Func || ft.NumIn() == 0 || ft.IsVariadic() || !strings.HasSuffix(f.Name, "Func") {
			continue
		}
		recv := ft.In(0)
		if !isHandleType(recv) {
			continue
		}
		name, ok := strings.CutPrefix(strings.TrimSuffix(f.Name, "Func"), recv.Name())
		if !ok {
			continue
		}
		m, ok := recv.MethodByName(name)
		if !ok || !sameSignatureMinusFirst(ft, m.Type) {
			continue
		}
		s.Field(i).Set(reflect.MakeFunc(ft, forwarder(ft, m.Index)))
	}
}

func isHandleType(t reflect.Type) bool {
	for _, h := range handleTypes {
		if t == h {
			return true
		}
	}
	return false
}

func sameSignatureMinusFirst(fn, method reflect.Type) bool {
	if fn.NumIn()-1 != method.NumIn() || fn.NumOut() != method.NumOut() {
		return false
	}
	for i := range method.NumIn() {
		if fn.In(i+1) != method.In(i) {
			return false
		}
	}
	for i := range method.NumOut() {
		if fn.Out(i) != method.Out(i) {
			return false
		}
	}
	return true
}

func forwarder(ft reflect.Type, method int) func([]reflect.Value) []reflect.Value {
	invalid := notModelled(ft, func() nvml.Return { return nvml.ERROR_INVALID_ARGUMENT })
	return func(args []reflect.Value) []reflect.Value {
		if args[0].IsNil() {
			// A nil handle is what NVML calls an invalid handle.
			return invalid(args)
		}
		return args[0].Method(method).Call(args[1:])
	}
}
