// Package dra is gpu-agent's Dynamic Resource Allocation (resource.k8s.io/v1)
// kubelet plugin. It has no state of its own: the agent's loop decides which
// devices the node offers through DRA (a Pool, planned from the same
// inventory, health and allocation ledger as the device plugin's catalog)
// and answers Prepare and Unprepare; this package turns the Pool into
// ResourceSlices and the kubelet's gRPC calls into requests to the loop.
//
// Devices and attributes follow NVIDIA's DRA driver (driver name
// gpu.nvidia.com, devices "gpu-N" and MIG devices, attributes uuid,
// productName, architecture, cudaComputeCapability, ...), so DeviceClasses
// and claims written for it select the same devices here. Its opaque device
// config (resource.nvidia.com/v1beta1 GpuConfig and MigDeviceConfig) is
// decoded here, strictly (opaque.go); the loop honours it at Prepare.
package dra
