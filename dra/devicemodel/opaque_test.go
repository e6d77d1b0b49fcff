package devicemodel

import (
	"reflect"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// NVIDIA's opaque config decodes to what it asks, field by field; what the
// agent cannot honour is refused naming the field.
func TestDecodeConfig(t *testing.T) {
	const head = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig",`
	const mig = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"MigDeviceConfig",`
	tests := []struct {
		name    string
		raw     string
		kind    string
		want    *Sharing
		wantErr string
	}{
		{"no sharing", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig"}`, KindGpuConfig, nil, ""},
		{"time-slicing defaults to Default", head + `"sharing":{"strategy":"TimeSlicing"}}`, KindGpuConfig,
			&Sharing{Strategy: StrategyTimeSlicing, Interval: IntervalDefault}, ""},
		{"time-slicing Long", head + `"sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Long"}}}`, KindGpuConfig,
			&Sharing{Strategy: StrategyTimeSlicing, Interval: IntervalLong}, ""},
		{"MPS without limits", head + `"sharing":{"strategy":"MPS"}}`, KindGpuConfig,
			&Sharing{Strategy: StrategyMPS, MPS: &MPSLimits{}}, ""},
		{"MPS with limits", head + `"sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50,` +
			`"defaultPinnedDeviceMemoryLimit":"10Gi","defaultPerDevicePinnedMemoryLimit":{"0":"5Gi","GPU-x":"1024Mi"},"multiUser":false}}}`, KindGpuConfig,
			&Sharing{Strategy: StrategyMPS, MPS: &MPSLimits{ActiveThreadPercentage: 50, PinnedMemoryBytes: 10 << 30,
				PerDevice: map[string]int64{"0": 5 << 30, "GPU-x": 1 << 30}}}, ""},
		{"MIG MPS", mig + `"sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":10}}}`, KindMigDeviceConfig,
			&Sharing{Strategy: StrategyMPS, MPS: &MPSLimits{ActiveThreadPercentage: 10}}, ""},
		{"MIG time-slicing", mig + `"sharing":{"strategy":"TimeSlicing"}}`, KindMigDeviceConfig,
			&Sharing{Strategy: StrategyTimeSlicing, Interval: IntervalDefault}, ""},

		{"other apiVersion", `{"apiVersion":"resource.nvidia.com/v1","kind":"GpuConfig"}`, "", nil, `apiVersion "resource.nvidia.com/v1"`},
		{"other kind", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"VfioDeviceConfig"}`, "", nil, `kind "VfioDeviceConfig"`},
		{"not JSON", `sharing: MPS`, "", nil, "not a JSON object"},
		{"unknown field", head + `"sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercent":50}}}`, "", nil, `unknown field "sharing.mpsConfig.defaultActiveThreadPercent"`},
		{"field names are case-sensitive", head + `"Sharing":{"strategy":"MPS"}}`, "", nil, `unknown field "Sharing"`},
		{"duplicate field", head + `"sharing":{"strategy":"MPS","strategy":"TimeSlicing"}}`, "", nil, `duplicate field "sharing.strategy"`},
		{"interval on a MIG device", mig + `"sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Long"}}}`, "", nil, `unknown field "sharing.timeSlicingConfig"`},
		{"unknown strategy", head + `"sharing":{"strategy":"Fabric"}}`, "", nil, `sharing.strategy "Fabric"`},
		{"no strategy", head + `"sharing":{}}`, "", nil, "sharing.strategy: missing"},
		{"unknown interval", head + `"sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Forever"}}}`, "", nil, `sharing.timeSlicingConfig.interval "Forever"`},
		{"MPS config with time-slicing", head + `"sharing":{"strategy":"TimeSlicing","mpsConfig":{}}}`, "", nil, "sharing.mpsConfig: not with strategy TimeSlicing"},
		{"time-slicing config with MPS", head + `"sharing":{"strategy":"MPS","timeSlicingConfig":{}}}`, "", nil, "sharing.timeSlicingConfig: not with strategy MPS"},
		{"thread percentage 0", head + `"sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":0}}}`, "", nil, "sharing.mpsConfig.defaultActiveThreadPercentage 0: must be 1..100"},
		{"thread percentage 101", head + `"sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":101}}}`, "", nil, "defaultActiveThreadPercentage 101"},
		{"pinned below 1Mi", head + `"sharing":{"strategy":"MPS","mpsConfig":{"defaultPinnedDeviceMemoryLimit":"512Ki"}}}`, "", nil, "sharing.mpsConfig.defaultPinnedDeviceMemoryLimit 512Ki: must be"},
		{"pinned negative", head + `"sharing":{"strategy":"MPS","mpsConfig":{"defaultPerDevicePinnedMemoryLimit":{"1":"-1Gi"}}}}`, "", nil, `defaultPerDevicePinnedMemoryLimit["1"] -1Gi`},
		{"pinned not a quantity", head + `"sharing":{"strategy":"MPS","mpsConfig":{"defaultPinnedDeviceMemoryLimit":"lots"}}}`, "", nil, "quantities must match"},
		{"multi-user", head + `"sharing":{"strategy":"MPS","mpsConfig":{"multiUser":true}}}`, "", nil, "sharing.mpsConfig.multiUser: true"},
		{"too big", head + `"x":"` + strings.Repeat("a", maxConfigBytes) + `"}`, "", nil, "above the"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			kind, got, err := DecodeConfig([]byte(tt.raw))
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if kind != tt.kind || !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got %s %+v (mps %+v), want %s %+v", kind, got, mpsOf(got), tt.kind, tt.want)
			}
		})
	}
}

func mpsOf(s *Sharing) *MPSLimits {
	if s == nil {
		return nil
	}
	return s.MPS
}

func opaque(source resourceapi.AllocationConfigSource, driver, raw string, requests ...string) resourceapi.DeviceAllocationConfiguration {
	return resourceapi.DeviceAllocationConfiguration{
		Source: source, Requests: requests,
		DeviceConfiguration: resourceapi.DeviceConfiguration{Opaque: &resourceapi.OpaqueDeviceConfiguration{
			Driver: driver, Parameters: runtime.RawExtension{Raw: []byte(raw)},
		}},
	}
}

// The config a result gets: the DeviceClass's come before the claim's
// whatever their position, the later wins, a config naming the request
// beats one naming none, a subrequest is named by its main request, a
// config of the wrong kind is skipped when it names no request and refused
// when it names this one, and other drivers' configs are not read.
func TestConfigFor(t *testing.T) {
	const (
		ts   = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing"}}`
		long = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Long"}}}`
		mps  = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS"}}`
		mig  = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"MigDeviceConfig","sharing":{"strategy":"MPS"}}`
		bad  = `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS","bogus":1}}`
	)
	class, claim := resourceapi.AllocationConfigSourceClass, resourceapi.AllocationConfigSourceClaim
	tests := []struct {
		name     string
		configs  []resourceapi.DeviceAllocationConfiguration
		request  string
		devType  string
		want     string // the chosen config's field; "" for none
		strategy Strategy
		wantErr  string
	}{
		{"none", nil, "gpu", TypeGPU, "", "", ""},
		{"class only", []resourceapi.DeviceAllocationConfiguration{opaque(class, DriverName, mps)}, "gpu", TypeGPU,
			"status.allocation.devices.config[0] (from the DeviceClass)", StrategyMPS, ""},
		{"the claim's beats the class's, listed after it", []resourceapi.DeviceAllocationConfiguration{
			opaque(claim, DriverName, ts), opaque(class, DriverName, mps)}, "gpu", TypeGPU,
			"status.allocation.devices.config[0] (from the claim)", StrategyTimeSlicing, ""},
		{"the later of the claim's wins", []resourceapi.DeviceAllocationConfiguration{
			opaque(claim, DriverName, ts), opaque(claim, DriverName, mps)}, "gpu", TypeGPU,
			"status.allocation.devices.config[1] (from the claim)", StrategyMPS, ""},
		{"another request's config is not this one's", []resourceapi.DeviceAllocationConfiguration{
			opaque(claim, DriverName, ts), opaque(claim, DriverName, mps, "other")}, "gpu", TypeGPU,
			"status.allocation.devices.config[0] (from the claim)", StrategyTimeSlicing, ""},
		{"a subrequest is named by its main request", []resourceapi.DeviceAllocationConfiguration{
			opaque(claim, DriverName, mps, "gpu")}, "gpu/big", TypeGPU,
			"status.allocation.devices.config[0] (from the claim)", StrategyMPS, ""},
		{"or by itself", []resourceapi.DeviceAllocationConfiguration{
			opaque(claim, DriverName, mps, "gpu/small"), opaque(claim, DriverName, long, "gpu/big")}, "gpu/big", TypeGPU,
			"status.allocation.devices.config[1] (from the claim)", StrategyTimeSlicing, ""},
		{"other drivers' configs are skipped", []resourceapi.DeviceAllocationConfiguration{
			opaque(claim, DriverName, ts), opaque(claim, "nic.example.com", `not even JSON`)}, "gpu", TypeGPU,
			"status.allocation.devices.config[0] (from the claim)", StrategyTimeSlicing, ""},
		{"a GpuConfig for all skips MIG devices", []resourceapi.DeviceAllocationConfiguration{
			opaque(claim, DriverName, mig), opaque(claim, DriverName, mps)}, "m", TypeMIG,
			"status.allocation.devices.config[0] (from the claim)", StrategyMPS, ""},
		{"a MigDeviceConfig for all skips GPUs", []resourceapi.DeviceAllocationConfiguration{
			opaque(claim, DriverName, mig)}, "gpu", TypeGPU, "", "", ""},
		{"a GpuConfig naming a MIG request is refused", []resourceapi.DeviceAllocationConfiguration{
			opaque(claim, DriverName, mps, "m")}, "m", TypeMIG, "", "", "kind GpuConfig cannot apply to request \"m\", a mig device (use MigDeviceConfig)"},
		{"a config that cannot be decoded fails the requests it applies to", []resourceapi.DeviceAllocationConfiguration{
			opaque(class, DriverName, bad)}, "gpu", TypeGPU,
			"status.allocation.devices.config[0] (from the DeviceClass)", "", `config[0] (from the DeviceClass): opaque.parameters: kind GpuConfig: unknown field "sharing.bogus"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ConfigFor(ConfigsOf(tt.configs), tt.request, tt.devType)
			if err == nil && got != nil {
				err = got.Err
			}
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			field, strategy := "", Strategy("")
			if got != nil {
				field = got.Field
				if got.Sharing != nil {
					strategy = got.Sharing.Strategy
				}
			}
			if field != tt.want || strategy != tt.strategy {
				t.Errorf("got %q (%s), want %q (%s)", field, strategy, tt.want, tt.strategy)
			}
		})
	}
}

// Per-device pinned limits name a device by UUID or position; one naming
// none of the config's devices is refused.
func TestMPSLimitFor(t *testing.T) {
	m := &MPSLimits{PinnedMemoryBytes: 8 << 30, PerDevice: map[string]int64{"1": 2 << 30, "GPU-c": 3 << 30}}
	uuids := []string{"GPU-a", "GPU-b", "GPU-c"}
	for i, want := range []int64{8 << 30, 2 << 30, 3 << 30} {
		got, err := m.LimitFor(i, uuids[i], uuids)
		if err != nil || got != want {
			t.Errorf("device %d: %d, %v; want %d", i, got, err, want)
		}
	}
	for _, key := range []string{"3", "-1", "01", "GPU-z"} {
		m := &MPSLimits{PerDevice: map[string]int64{key: 1 << 30}}
		if _, err := m.LimitFor(0, "GPU-a", uuids); err == nil || !strings.Contains(err.Error(), "defaultPerDevicePinnedMemoryLimit[\""+key+"\"]") {
			t.Errorf("key %q: %v, want it refused", key, err)
		}
	}
}

// FuzzDecodeConfig: a claim's opaque parameters are outside input; decoding
// never panics, and what it accepts is within the ranges it promises.
func FuzzDecodeConfig(f *testing.F) {
	for _, s := range []string{
		`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"TimeSlicing","timeSlicingConfig":{"interval":"Long"}}}`,
		`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig","sharing":{"strategy":"MPS","mpsConfig":{"defaultActiveThreadPercentage":50,"defaultPinnedDeviceMemoryLimit":"10Gi","defaultPerDevicePinnedMemoryLimit":{"0":"5Gi"}}}}`,
		`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"MigDeviceConfig","sharing":{"strategy":"MPS"}}`,
		`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig"}`,
		`{}`, `null`, `[]`, `"x"`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		kind, sh, err := DecodeConfig(raw)
		if err != nil {
			if sh != nil || kind != "" {
				t.Fatalf("error %v with a result %q %+v", err, kind, sh)
			}
			return
		}
		if kind != KindGpuConfig && kind != KindMigDeviceConfig {
			t.Fatalf("kind %q accepted", kind)
		}
		if sh == nil {
			return
		}
		switch sh.Strategy {
		case StrategyTimeSlicing:
			if sh.Interval.Level() < 0 || sh.MPS != nil {
				t.Fatalf("time-slicing %+v", sh)
			}
		case StrategyMPS:
			m := sh.MPS
			if m == nil || m.ActiveThreadPercentage < 0 || m.ActiveThreadPercentage > 100 || (m.PinnedMemoryBytes != 0 && m.PinnedMemoryBytes < 1<<20) {
				t.Fatalf("MPS %+v", m)
			}
			for k, b := range m.PerDevice {
				if k == "" || b < 1<<20 {
					t.Fatalf("per-device %q: %d", k, b)
				}
			}
		default:
			t.Fatalf("strategy %q accepted", sh.Strategy)
		}
	})
}
