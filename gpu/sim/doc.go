// Package sim builds simulated GPU nodes that implement nvml.Interface, so
// every part of gpu-agent runs and is tested without a GPU. A node follows
// real NVML's rules and error codes (MIG placements, pending mode changes,
// lost GPUs, events) and takes faults and telemetry injected from Go or
// over HTTP.
//
// # Profiles
//
// New takes one of the names Profiles lists: dgx-a100, dgx-h100 (NVSwitch
// systems, MIG capable), dgx1-v100 (NVLink hybrid cube-mesh), pcie-8gpu,
// pcie-4gpu (L40S without NVLink) and two-islands-16 (two cube-mesh
// islands). UUIDs are name-based: the same profile, GPU index and MIG
// GI/CI ids give the same UUIDs in every process.
//
// # NVML semantics worth knowing
//
//   - Init must be called first (and counts references, like nvmlInit);
//     before it and after the last Shutdown every call returns
//     ERROR_UNINITIALIZED.
//   - Calls the sim does not model return ERROR_NOT_SUPPORTED (see
//     FillNotSupported), or ERROR_GPU_IS_LOST on a lost GPU. The versioned
//     helpers (GetGpuInstanceProfileInfoV and friends) return handler structs
//     that call the real library and must not be used with the sim.
//   - GPU instance ids are the lowest free id from 1; compute instance ids
//     the lowest free id from 0 within their GPU instance. Real drivers
//     derive GI ids from the placement; callers must read ids from NVML,
//     never predict them.
//   - Profile ids in GpuInstanceProfileInfo and GpuInstanceInfo are the ids
//     real drivers report (19 for A100 1g.5gb, ...), not the
//     GPU_INSTANCE_PROFILE_* index passed to GetGpuInstanceProfileInfo.
//   - SetMigMode returns (activationStatus, ret). Without
//     WithImmediateMIGModeChange a change stays pending until Reset and
//     activationStatus is ERROR_RESET_REQUIRED.
//   - A lost GPU has no handle: DeviceGetHandleByIndex returns
//     ERROR_GPU_IS_LOST, and handles taken before return it from every call.
//     Losing a GPU also raises XID 79 on registered event sets.
//   - Reset destroys the GPU's MIG instances, as a real reset does.
//   - Handles are the sim's own types; do not type-assert them to go-nvml's
//     mock types.
//
// # HTTP fault injection
//
// Node.Handler serves these endpoints, mounted by the agent under /sim/
// (with or without the prefix stripped). Each takes a POST with a JSON
// object and answers {"ok":true}; bad input gets 400 and {"error":"..."},
// unknown paths 404, other methods 405. "gpu" is the NVML index.
//
//	POST /sim/xid          {"gpu":0,"xid":48}            optional "gi","ci" (default 4294967295: whole GPU)
//	POST /sim/lost         {"gpu":0}                     optional "lost":false to bring it back
//	POST /sim/reset        {"gpu":0}
//	POST /sim/utilization  {"gpu":0,"gpu_util":80,"mem_used_bytes":1073741824}  optional "mem_util";
//	                       fields left out keep their value, at least one is needed
//
// Example:
//
//	curl -X POST localhost:9400/sim/xid -d '{"gpu":3,"xid":79}'
package sim
