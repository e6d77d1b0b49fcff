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
//   - Reset destroys the GPU's MIG instances, as a real reset does; Reboot
//     resets every GPU and starts a new boot (BootID), which the agent
//     reads as the node's /proc/sys/kernel/random/boot_id.
//   - Handles are the sim's own types; do not type-assert them to go-nvml's
//     mock types.
//
// # Telemetry and the load model
//
// Setters (SetUtilization, SetInstanceUtilization for a MIG GPU instance,
// SetMemoryUsed, SetTemperature, SetPower, SetClocks, SetCodecUtilization,
// SetPCIeReplays) set what NVML reports. What moves with load follows from
// the utilization through a fixed workload mix (telemetry.go): GPM's
// engine, SM, tensor, FP and DRAM activity and PCIe and NVLink traffic,
// integrated over the WithClock clock like the energy counter, so GPM's
// averages between two samples and the NVLink throughput counters agree
// with the utilization in force between them. Per model, as on hardware:
// GPM (GpmQueryDeviceSupport, GpmSampleGet, GpmMigSampleGet,
// GpmMetricsGet) from Hopper on; FI_DEV_MEMORY_TEMP on HBM models only;
// NVLink throughput fields where the GPU has NVLink; encoder utilization
// where the model has NVENC (not A100 or H100), and neither encoder nor
// decoder utilization with MIG on. GetMemoryInfo_v2 reports the memory the
// driver reserves, which GetMemoryInfo counts as used. GPMSamplesAllocated
// lets tests check that GPM sample buffers are freed.
//
// # Processes
//
// StartProcess runs a simulated compute process on a GPU or, with its GI
// and CI, on a MIG device: its framebuffer bytes and its load (SM, memory,
// encoder, decoder utilization); StopProcess ends it, and so does a reset.
// GetComputeRunningProcesses lists them, MPS clients (Process.MPS) apart in
// GetMPSComputeRunningProcesses; a MIG device handle lists its own.
// GetProcessUtilization returns one sample per busy process and second of
// the WithClock clock, newer than the timestamp it is given, from a
// buffer of the last minute (NVML documents neither period nor buffer),
// ERROR_NOT_FOUND when there is none, and ERROR_NOT_SUPPORTED with MIG on,
// as NVML does. A process at 0% on every engine has no samples. The load
// of the GPU (SetUtilization) is set apart and does not follow from it.
//
// # State that outlives the process
//
// Real GPUs keep their MIG mode, instances, ECC counters, recovery action,
// remapped rows and lost state when the agent restarts, and processes keep
// running. WithStateFile gives
// a node the same: it loads the file if it exists (instead of the profile's
// initial layout) and writes it, atomically, before every call that changes
// that state returns, so even a process killed with SIGKILL right after a
// call leaves its effect for the next one. GI and CI ids and hence MIG
// device UUIDs come back the same. A file the node cannot read (corrupt,
// another profile, another version) makes New fail; it is never replaced.
// If writing fails, the call changes nothing and returns ERROR_UNKNOWN (the
// Go setters: an error). One process at a time holds a state file (a flock
// on <path>.lock); Close releases it. The format, version 1:
//
//	{"version": 1, "profile": "dgx-a100", "gpus": [{
//	  "index": 0, "uuid": "GPU-...", "lost": false,
//	  "mig_current": true, "mig_pending": true,
//	  "gpu_instances": [{"id": 1, "profile_id": 9, "profile": "3g.20gb",
//	    "placement": {"start": 4, "size": 4},
//	    "compute_instances": [{"id": 0, "profile_id": 2,
//	      "placement": {"start": 0, "size": 3}, "uuid": "MIG-..."}]}],
//	  "ecc": {"corrected_volatile": 0, "corrected_aggregate": 0,
//	    "uncorrected_volatile": 0, "uncorrected_aggregate": 0},
//	  "recovery_action": 0,
//	  "remapped_rows": {"corrected": 0, "uncorrected": 0, "pending": false, "failure": false},
//	  "processes": [{"pid": 4242, "gi": 1, "ci": 0, "mps": true, "memory_bytes": 1073741824,
//	    "sm_util": 40, "mem_util": 10, "enc_util": 0, "dec_util": 0}]}]}
//
// "processes" is left out when there are none; on a whole GPU "gi" and
// "ci" are 4294967295; "mps" and the utilizations are left out when false
// or 0.
//
// # Failing calls
//
// FailCalls makes the next N calls of one method on one GPU (its handle,
// MIG devices and instances) return a chosen error without running;
// SetFlaky fails every handle call with ERROR_UNKNOWN at a rate, from a
// seeded source. Neither is kept in the state file.
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
//	POST /sim/reboot       no body, or {}                every GPU reset, a new boot id (Reboot)
//	POST /sim/utilization  {"gpu":0,"gpu_util":80,"mem_used_bytes":1073741824}  optional "mem_util",
//	                       "enc_util", "dec_util"; fields left out keep their value, at least one
//	                       is needed; with "gi" (a GPU instance id) only "gpu_util" and "mem_util"
//	POST /sim/fail         {"gpu":0,"call":"GetMigMode","count":1}  optional "error" (default
//	                       "ERROR_UNKNOWN"; any ERROR_* name); "count" -1 fails until cleared, 0 clears,
//	                       below -1 is refused; "call" as FailCalls names it
//	POST /sim/flaky        {"rate":0.02,"seed":1}       "rate" 0 turns it off; "seed" defaults to 0
//	POST /sim/process      {"gpu":0,"pid":4242,"sm_util":40}  starts or changes a process; the device is
//	                       "gpu" (with "gi" and "ci" for a MIG device) or "uuid" (GPU or MIG); optional
//	                       "mps", "mem_used_bytes", "sm_util", "mem_util", "enc_util", "dec_util"; fields
//	                       left out keep their value (a new process: 0, not MPS)
//	POST /sim/process/stop {"pid":4242}                 optional "gpu" or "uuid"; without, on every GPU
//
// GET /sim/state, read-only, answers the node's State: what its state file
// holds, from which WithState builds a copy.
//
// Example:
//
//	curl -X POST localhost:9400/sim/xid -d '{"gpu":3,"xid":79}'
package sim
