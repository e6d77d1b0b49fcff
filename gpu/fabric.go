package gpu

import (
	"fmt"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
	"github.com/google/uuid"
)

// Fabric is a GPU's attachment to a multi-node NVLink fabric (GB200 and
// GB300 NVL72 racks), as NVML's fabric info reports it. A GPU without one
// (no NVLink fabric, or one within a single node) has none: GPU.Fabric is
// nil.
type Fabric struct {
	// State is the GPU's registration with the fabric: FabricNotStarted,
	// FabricInProgress or FabricCompleted.
	State FabricState `json:"state"`
	// Error is why a completed registration failed (NVML's status, as
	// its error string); "" when it succeeded or is not complete.
	Error string `json:"error,omitempty"`
	// ClusterUUID identifies the NVLink domain (the rack), lower-case
	// UUID form; "" when the registration is not complete, or when the
	// fabric is one node's own (an all-zero UUID: NVSwitch systems without
	// multi-node NVLink).
	ClusterUUID string `json:"clusterUUID,omitempty"`
	// CliqueID is the GPU's clique within the domain: GPUs of one cluster
	// UUID and clique can reach each other over NVLink.
	CliqueID uint32 `json:"cliqueID"`
	// Health is NVML's health summary; FabricHealthUnknown where the
	// driver reports none (NVML before version 3 of the struct).
	Health FabricHealth `json:"health,omitempty"`
	// Conditions are the health mask's fields NVML reports true (degraded
	// bandwidth, route recovery, ...), in mask order; an incorrect
	// configuration names what is wrong.
	Conditions []string `json:"conditions,omitempty"`
}

// FabricState is a GPU's fabric registration state.
type FabricState string

// The fabric registration states NVML reports for a fabric-attached GPU.
const (
	FabricNotStarted FabricState = "not-started"
	FabricInProgress FabricState = "in-progress"
	FabricCompleted  FabricState = "completed"
)

// FabricHealth is NVML's fabric health summary.
type FabricHealth string

// The fabric health summaries.
const (
	FabricHealthUnknown   FabricHealth = ""
	FabricHealthy         FabricHealth = "healthy"
	FabricUnhealthy       FabricHealth = "unhealthy"
	FabricLimitedCapacity FabricHealth = "limited-capacity"
)

// Clique is the clique's name as NVIDIA's DRA driver writes it (label
// nvidia.com/gpu.clique, and its compute domain daemons' CLIQUE_ID):
// "<cluster UUID>.<clique id>"; "" when the GPU is in no multi-node
// domain: registration incomplete or failed, or no cluster UUID.
func (f *Fabric) Clique() string {
	if !f.Ready() || f.ClusterUUID == "" {
		return ""
	}
	return fmt.Sprintf("%s.%d", f.ClusterUUID, f.CliqueID)
}

// Ready reports whether the GPU's registration completed successfully, so
// that its cluster UUID and clique are what the fabric assigned.
func (f *Fabric) Ready() bool {
	return f != nil && f.State == FabricCompleted && f.Error == ""
}

// healthFields are the health mask's fields (NVML_GPU_FABRIC_HEALTH_GET)
// that hold TRUE (1), FALSE (2) or NOT_SUPPORTED (0), by name.
var healthFields = []struct {
	name         string
	shift, width uint32
}{
	{"degraded-bandwidth", nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_DEGRADED_BW, nvml.GPU_FABRIC_HEALTH_MASK_WIDTH_DEGRADED_BW},
	{"route-recovery", nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_RECOVERY, nvml.GPU_FABRIC_HEALTH_MASK_WIDTH_ROUTE_RECOVERY},
	{"route-unhealthy", nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ROUTE_UNHEALTHY, nvml.GPU_FABRIC_HEALTH_MASK_WIDTH_ROUTE_UNHEALTHY},
	{"access-timeout-recovery", nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_ACCESS_TIMEOUT_RECOVERY, nvml.GPU_FABRIC_HEALTH_MASK_WIDTH_ACCESS_TIMEOUT_RECOVERY},
}

// incorrectConfigurations names the INCORRECT_CONFIGURATION field's values
// (0 not supported, 1 none).
var incorrectConfigurations = map[uint32]string{
	nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_INCORRECT_SYSGUID:    "incorrect-sysguid",
	nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_INCORRECT_CHASSIS_SN: "incorrect-chassis-serial",
	nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_NO_PARTITION:         "no-partition",
	nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_INSUFFICIENT_NVLINKS: "insufficient-nvlinks",
	nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_INCOMPATIBLE_GPU_FW:  "incompatible-gpu-firmware",
	nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_INVALID_LOCATION:     "invalid-location",
	nvml.GPU_FABRIC_HEALTH_MASK_INCORRECT_CONFIGURATION_GPU_STATE_INVALID:    "gpu-state-invalid",
}

// DecodeFabric turns NVML's version 3 fabric info into a Fabric. It
// returns nil, nil for a GPU that is not fabric-attached (state
// NOT_SUPPORTED) and an error for what NVML does not define (an unknown
// state or health summary), naming the field: the driver is newer than
// this build, and guessing what it means could put a GPU in the wrong
// domain. Health fields with values NVML does not define are left out of
// Conditions (a newer driver's finer reading of a condition).
func DecodeFabric(info nvml.GpuFabricInfo_v3) (*Fabric, error) {
	f := &Fabric{CliqueID: info.CliqueId}
	switch info.State {
	case nvml.GPU_FABRIC_STATE_NOT_SUPPORTED:
		return nil, nil
	case nvml.GPU_FABRIC_STATE_NOT_STARTED:
		f.State = FabricNotStarted
	case nvml.GPU_FABRIC_STATE_IN_PROGRESS:
		f.State = FabricInProgress
	case nvml.GPU_FABRIC_STATE_COMPLETED:
		f.State = FabricCompleted
	default:
		return nil, fmt.Errorf("fabric info: state %d is not one NVML defines", info.State)
	}
	switch info.HealthSummary {
	case nvml.GPU_FABRIC_HEALTH_SUMMARY_NOT_SUPPORTED:
	case nvml.GPU_FABRIC_HEALTH_SUMMARY_HEALTHY:
		f.Health = FabricHealthy
	case nvml.GPU_FABRIC_HEALTH_SUMMARY_UNHEALTHY:
		f.Health = FabricUnhealthy
	case nvml.GPU_FABRIC_HEALTH_SUMMARY_LIMITED_CAPACITY:
		f.Health = FabricLimitedCapacity
	default:
		return nil, fmt.Errorf("fabric info: health summary %d is not one NVML defines", info.HealthSummary)
	}
	if f.State != FabricCompleted {
		// Status, cluster UUID and clique mean nothing until the
		// registration completes.
		f.CliqueID = 0
	} else {
		if st := nvml.Return(info.Status); st != nvml.SUCCESS {
			f.Error = st.Error()
		}
		if info.ClusterUuid != ([16]uint8{}) {
			f.ClusterUUID = uuid.UUID(info.ClusterUuid).String()
		}
	}
	for _, h := range healthFields {
		if info.HealthMask>>h.shift&h.width == nvml.GPU_FABRIC_HEALTH_MASK_DEGRADED_BW_TRUE { // TRUE is 1 in every field
			f.Conditions = append(f.Conditions, h.name)
		}
	}
	cfg := info.HealthMask >> nvml.GPU_FABRIC_HEALTH_MASK_SHIFT_INCORRECT_CONFIGURATION & nvml.GPU_FABRIC_HEALTH_MASK_WIDTH_INCORRECT_CONFIGURATION
	if name, ok := incorrectConfigurations[cfg]; ok {
		f.Conditions = append(f.Conditions, name)
	}
	return f, nil
}

// FabricReader reads a GPU's fabric info at version 3 (with health).
type FabricReader func(nvml.Device) (nvml.GpuFabricInfo_v3, nvml.Return)

// fabricV3Device is a device that answers version 3 itself: the simulated
// node's, which go-nvml's handler cannot reach (see NVMLFabricInfo).
type fabricV3Device interface {
	GetGpuFabricInfoV3() (nvml.GpuFabricInfo_v3, nvml.Return)
}

// NVMLFabricInfo reads the fabric info of a device of the real library:
// nvmlDeviceGetGpuFabricInfoV at version 3, and version 1 (no health) from
// drivers that do not know it. go-nvml's versioned handler calls the
// library itself, whatever the Device it was handed, so this must only be
// given the real library's devices (Options.FabricInfo of the nvml
// backend); anything else goes through defaultFabricInfo.
func NVMLFabricInfo(d nvml.Device) (nvml.GpuFabricInfo_v3, nvml.Return) {
	h := d.GetGpuFabricInfoV()
	return fabricV3OrV1(h.V3, d.GetGpuFabricInfo)
}

// fabricV3OrV1 asks v3 and, where the driver does not know the versioned
// call or version 3 of its struct, v1.
func fabricV3OrV1(v3 func() (nvml.GpuFabricInfo_v3, nvml.Return), v1 func() (nvml.GpuFabricInfo, nvml.Return)) (nvml.GpuFabricInfo_v3, nvml.Return) {
	info, ret := v3()
	if ret != nvml.ERROR_FUNCTION_NOT_FOUND && ret != nvml.ERROR_ARGUMENT_VERSION_MISMATCH {
		return info, ret
	}
	old, ret := v1()
	return nvml.GpuFabricInfo_v3{ClusterUuid: old.ClusterUuid, Status: old.Status, CliqueId: old.CliqueId, State: old.State}, ret
}

// defaultFabricInfo reads fabric info without the versioned call: a
// device's own GetGpuFabricInfoV3 where it has one, else version 1.
func defaultFabricInfo(d nvml.Device) (nvml.GpuFabricInfo_v3, nvml.Return) {
	if v3, ok := d.(fabricV3Device); ok {
		return v3.GetGpuFabricInfoV3()
	}
	old, ret := d.GetGpuFabricInfo()
	return nvml.GpuFabricInfo_v3{ClusterUuid: old.ClusterUuid, Status: old.Status, CliqueId: old.CliqueId, State: old.State}, ret
}
