// Package devicemodel is what the node offers through DRA, as pure data and
// functions: devices built from the GPU inventory, MIG partitions on shared
// counters, the Pool the agent's loop plans, the ResourceSlices a pool is
// published as, and NVIDIA's opaque device config as claims carry it. It
// does no I/O; package dra (the kubelet plugin) and the agent build on it.
//
// Devices and attributes follow NVIDIA's DRA driver (driver name
// gpu.nvidia.com, devices "gpu-N" and MIG devices, attributes uuid,
// productName, architecture, cudaComputeCapability, ...), so DeviceClasses
// and claims written for it select the same devices here. Its opaque device
// config (resource.nvidia.com/v1beta1 GpuConfig and MigDeviceConfig) is
// decoded here, strictly (opaque.go); the loop honours it at Prepare.
package devicemodel
