package devicemodel

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/api/resource"
	kjson "sigs.k8s.io/json"
)

// The opaque device config of NVIDIA's DRA driver (resource.nvidia.com/v1beta1,
// kinds GpuConfig and MigDeviceConfig), as claims and DeviceClasses written
// for that driver carry it. Its field names, defaults and checks follow
// NVIDIA's published API so that such claims mean here what they mean there;
// what the agent cannot honour is refused, naming the field, never ignored.

// ConfigAPIVersion is the apiVersion of NVIDIA's opaque device config.
const ConfigAPIVersion = "resource.nvidia.com/v1beta1"

// The config kinds: GpuConfig applies to whole GPUs, MigDeviceConfig to MIG
// devices.
const (
	KindGpuConfig       = "GpuConfig"
	KindMigDeviceConfig = "MigDeviceConfig"
)

// Strategy is how the devices a config applies to are shared among the
// containers of the claim's pods.
type Strategy string

// The strategies NVIDIA's API defines (its "Fabric" is refused).
const (
	StrategyTimeSlicing Strategy = "TimeSlicing"
	StrategyMPS         Strategy = "MPS"
)

// Interval is the time slice a GPU gives each context in turn; NVIDIA's
// names, in the order of nvidia-smi's compute-policy --set-timeslice values
// (0..3).
type Interval string

// The intervals; "" decodes as Default.
const (
	IntervalDefault Interval = "Default"
	IntervalShort   Interval = "Short"
	IntervalMedium  Interval = "Medium"
	IntervalLong    Interval = "Long"
)

// Level is the interval's compute-policy value (Default 0 .. Long 3).
func (i Interval) Level() int {
	return slices.Index([]Interval{IntervalDefault, IntervalShort, IntervalMedium, IntervalLong}, i)
}

// Sharing is one decoded config: what the devices it applies to get.
type Sharing struct {
	Strategy Strategy `json:"strategy"`
	// Interval is set for TimeSlicing (Default when the config names none).
	Interval Interval `json:"interval,omitempty"`
	// MPS is set for the MPS strategy (zero: no limits given).
	MPS *MPSLimits `json:"mps,omitempty"`
}

// MPSLimits are the limits of an MPS config. Zero means not given.
type MPSLimits struct {
	// ActiveThreadPercentage is 1..100.
	ActiveThreadPercentage int `json:"activeThreadPercentage,omitempty"`
	// PinnedMemoryBytes is the limit of every device the config applies to,
	// unless PerDevice names it: by its position among those devices ("0",
	// "1", ...) or its UUID. Each is at least 1 MiB, the unit MPS takes.
	PinnedMemoryBytes int64            `json:"pinnedMemoryBytes,omitempty"`
	PerDevice         map[string]int64 `json:"perDevice,omitempty"`
}

// DeviceConfig is one opaque config of this driver in a claim's allocation.
type DeviceConfig struct {
	// Field locates it in the claim, for errors:
	// "status.allocation.devices.config[2] (from the DeviceClass)".
	Field string `json:"field"`
	Kind  string `json:"kind"`
	// Requests it applies to (empty: every request of its kind's devices).
	Requests []string `json:"requests,omitempty"`
	// Sharing is nil when the config asks for none.
	Sharing *Sharing `json:"sharing,omitempty"`
	// Err is why it cannot be honoured (undecodable, unknown field, value
	// out of range); it fails every device it applies to.
	Err error `json:"-"`
}

// ConfigsOf returns this driver's opaque configs of an allocation in
// precedence order, lowest first: the DeviceClass's, then the claim's, each
// in its own order (the later wins), as the resource API defines it.
// Configs of other drivers are skipped; one that cannot be decoded is kept
// with its Err, so that only the devices it applies to fail.
func ConfigsOf(configs []resourceapi.DeviceAllocationConfiguration) []DeviceConfig {
	var class, claim []DeviceConfig
	for i, c := range configs {
		if c.Opaque == nil || c.Opaque.Driver != DriverName {
			continue
		}
		dc := DeviceConfig{Field: fmt.Sprintf("status.allocation.devices.config[%d]", i), Requests: c.Requests}
		var from *[]DeviceConfig
		switch c.Source {
		case resourceapi.AllocationConfigSourceClass:
			dc.Field, from = dc.Field+" (from the DeviceClass)", &class
		case resourceapi.AllocationConfigSourceClaim:
			dc.Field, from = dc.Field+" (from the claim)", &claim
		default:
			dc.Err, from = fmt.Errorf("source %q: neither FromClass nor FromClaim", c.Source), &claim
		}
		if dc.Err == nil {
			dc.Kind, dc.Sharing, dc.Err = DecodeConfig(c.Opaque.Parameters.Raw)
		}
		if dc.Err != nil {
			dc.Err = fmt.Errorf("%s: opaque.parameters: %w", dc.Field, dc.Err)
		}
		*from = append(*from, dc)
	}
	return append(class, claim...)
}

// ConfigFor is the config that applies to the allocation result of request
// on a device of type devType (TypeGPU or TypeMIG): the last in precedence
// order that names the request, or failing that the last that names no
// request and is of the device's kind (GpuConfig for a GPU,
// MigDeviceConfig for a MIG device). nil when none applies. A config that
// names the request but is of the other kind cannot be honoured: that is
// the error. A request "main/sub" (a subrequest) is named by "main/sub" or
// by "main".
func ConfigFor(configs []DeviceConfig, request, devType string) (*DeviceConfig, error) {
	want := KindGpuConfig
	if devType == TypeMIG {
		want = KindMigDeviceConfig
	}
	main, _, _ := strings.Cut(request, "/")
	for i := len(configs) - 1; i >= 0; i-- {
		c := &configs[i]
		if slices.Contains(c.Requests, request) || slices.Contains(c.Requests, main) {
			if c.Err == nil && c.Kind != want {
				return nil, fmt.Errorf("%s: kind %s cannot apply to request %q, a %s device (use %s)", c.Field, c.Kind, request, devType, want)
			}
			return c, nil
		}
		if len(c.Requests) == 0 && (c.Kind == want || c.Err != nil) {
			return c, nil
		}
	}
	return nil, nil
}

// maxConfigBytes bounds one config's parameters: they are a few hundred
// bytes; the API server allows 10 KiB.
const maxConfigBytes = 10 << 10

// typeMeta is what selects the schema.
type typeMeta struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
}

// gpuConfig and migDeviceConfig are the wire forms, decoded strictly: a
// field they do not have is refused, so a misspelt limit is never ignored.
type gpuConfig struct {
	typeMeta `json:",inline"`
	Sharing  *struct {
		Strategy          Strategy       `json:"strategy"`
		TimeSlicingConfig *tsConfig      `json:"timeSlicingConfig"`
		MPSConfig         *mpsConfigWire `json:"mpsConfig"`
	} `json:"sharing"`
}

type migDeviceConfig struct {
	typeMeta `json:",inline"`
	Sharing  *struct {
		Strategy  Strategy       `json:"strategy"`
		MPSConfig *mpsConfigWire `json:"mpsConfig"`
	} `json:"sharing"`
}

type tsConfig struct {
	Interval *Interval `json:"interval"`
}

type mpsConfigWire struct {
	DefaultActiveThreadPercentage     *int                         `json:"defaultActiveThreadPercentage"`
	DefaultPinnedDeviceMemoryLimit    *resource.Quantity           `json:"defaultPinnedDeviceMemoryLimit"`
	DefaultPerDevicePinnedMemoryLimit map[string]resource.Quantity `json:"defaultPerDevicePinnedMemoryLimit"`
	MultiUser                         *bool                        `json:"multiUser"`
}

// DecodeConfig decodes and checks one opaque config's parameters (JSON, as
// the API server stores them): its kind, and its sharing (nil when it asks
// for none). Errors name the field.
func DecodeConfig(raw []byte) (string, *Sharing, error) {
	if len(raw) > maxConfigBytes {
		return "", nil, fmt.Errorf("%d bytes: above the %d a config may have", len(raw), maxConfigBytes)
	}
	var tm typeMeta
	if err := kjson.UnmarshalCaseSensitivePreserveInts(raw, &tm); err != nil {
		return "", nil, fmt.Errorf("not a JSON object: %w", err)
	}
	if tm.APIVersion != ConfigAPIVersion {
		return "", nil, fmt.Errorf("apiVersion %q: gpu-agent reads %s only", tm.APIVersion, ConfigAPIVersion)
	}
	var sh *Sharing
	var err error
	switch tm.Kind {
	case KindGpuConfig:
		var c gpuConfig
		if err := strict(raw, &c); err != nil {
			return "", nil, fmt.Errorf("kind %s: %w", tm.Kind, err)
		}
		if c.Sharing != nil {
			sh, err = sharingOf(c.Sharing.Strategy, c.Sharing.TimeSlicingConfig, c.Sharing.MPSConfig)
		}
	case KindMigDeviceConfig:
		var c migDeviceConfig
		if err := strict(raw, &c); err != nil {
			return "", nil, fmt.Errorf("kind %s: %w", tm.Kind, err)
		}
		if c.Sharing != nil {
			sh, err = sharingOf(c.Sharing.Strategy, nil, c.Sharing.MPSConfig)
		}
	default:
		return "", nil, fmt.Errorf("kind %q: gpu-agent honours %s and %s", tm.Kind, KindGpuConfig, KindMigDeviceConfig)
	}
	if err != nil {
		return "", nil, fmt.Errorf("kind %s: sharing.%w", tm.Kind, err)
	}
	return tm.Kind, sh, nil
}

// strict decodes raw into v, refusing unknown and duplicate fields (field
// names match case-sensitively, as the API server's decoder does).
func strict(raw []byte, v any) error {
	strictErrs, err := kjson.UnmarshalStrict(bytes.TrimSpace(raw), v)
	if err != nil {
		return err
	}
	return errors.Join(strictErrs...)
}

// sharingOf checks one config's sharing; errors start with the field
// under "sharing.".
func sharingOf(strategy Strategy, ts *tsConfig, m *mpsConfigWire) (*Sharing, error) {
	switch strategy {
	case StrategyTimeSlicing:
		if m != nil {
			return nil, fmt.Errorf("mpsConfig: not with strategy %s", strategy)
		}
		sh := &Sharing{Strategy: strategy, Interval: IntervalDefault}
		if ts != nil && ts.Interval != nil {
			if ts.Interval.Level() < 0 {
				return nil, fmt.Errorf("timeSlicingConfig.interval %q: one of Default, Short, Medium, Long", *ts.Interval)
			}
			sh.Interval = *ts.Interval
		}
		return sh, nil
	case StrategyMPS:
		if ts != nil {
			return nil, fmt.Errorf("timeSlicingConfig: not with strategy %s", strategy)
		}
		limits, err := mpsLimitsOf(m)
		if err != nil {
			return nil, fmt.Errorf("mpsConfig.%w", err)
		}
		return &Sharing{Strategy: strategy, MPS: limits}, nil
	case "":
		return nil, errors.New("strategy: missing (TimeSlicing or MPS)")
	}
	return nil, fmt.Errorf("strategy %q: gpu-agent honours TimeSlicing and MPS", strategy)
}

func mpsLimitsOf(m *mpsConfigWire) (*MPSLimits, error) {
	out := &MPSLimits{}
	if m == nil {
		return out, nil
	}
	if m.MultiUser != nil && *m.MultiUser {
		return nil, errors.New("multiUser: true: the agent's MPS daemons serve one user")
	}
	if p := m.DefaultActiveThreadPercentage; p != nil {
		if *p < 1 || *p > 100 {
			// NVIDIA's API lets 0 through, which MPS itself refuses.
			return nil, fmt.Errorf("defaultActiveThreadPercentage %d: must be 1..100", *p)
		}
		out.ActiveThreadPercentage = *p
	}
	if q := m.DefaultPinnedDeviceMemoryLimit; q != nil {
		b, err := pinned(*q)
		if err != nil {
			return nil, fmt.Errorf("defaultPinnedDeviceMemoryLimit %s: %w", q, err)
		}
		out.PinnedMemoryBytes = b
	}
	for _, k := range slices.Sorted(maps.Keys(m.DefaultPerDevicePinnedMemoryLimit)) {
		q := m.DefaultPerDevicePinnedMemoryLimit[k]
		if k == "" {
			return nil, errors.New(`defaultPerDevicePinnedMemoryLimit[""]: names no device (an index or a UUID)`)
		}
		b, err := pinned(q)
		if err != nil {
			return nil, fmt.Errorf("defaultPerDevicePinnedMemoryLimit[%q] %s: %w", k, q.String(), err)
		}
		if out.PerDevice == nil {
			out.PerDevice = map[string]int64{}
		}
		out.PerDevice[k] = b
	}
	return out, nil
}

// pinned is a pinned memory limit in bytes: at least 1 MiB, the unit MPS
// takes it in (NVIDIA's driver refuses less too).
func pinned(q resource.Quantity) (int64, error) {
	b, ok := q.AsInt64()
	if !ok || b < 1<<20 {
		return 0, errors.New("must be a whole number of bytes, at least 1Mi")
	}
	return b, nil
}

// LimitFor is the pinned memory limit of the device at position i (of n)
// among those the config applies to, with UUID uuid: its PerDevice entry by
// UUID or position, else PinnedMemoryBytes (0: none). A PerDevice key that
// names none of the devices is an error, as a misspelt UUID would
// otherwise leave a device without its limit.
func (m *MPSLimits) LimitFor(i int, uuid string, uuids []string) (int64, error) {
	for _, k := range slices.Sorted(maps.Keys(m.PerDevice)) {
		if slices.Contains(uuids, k) {
			continue
		}
		if n, err := strconv.Atoi(k); err != nil || n < 0 || n >= len(uuids) || strconv.Itoa(n) != k {
			return 0, fmt.Errorf("defaultPerDevicePinnedMemoryLimit[%q]: neither the UUID nor the index (0..%d) of a device this config applies to", k, len(uuids)-1)
		}
	}
	if b, ok := m.PerDevice[uuid]; ok {
		return b, nil
	}
	if b, ok := m.PerDevice[strconv.Itoa(i)]; ok {
		return b, nil
	}
	return m.PinnedMemoryBytes, nil
}
