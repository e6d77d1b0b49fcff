// Package dra is gpu-agent's Dynamic Resource Allocation (resource.k8s.io/v1)
// kubelet plugin: the adapter between the kubelet and the API server on one
// side and the agent's loop on the other. It has no state of its own: the
// loop decides which devices the node offers (a devicemodel.Pool) and
// answers Prepare and Unprepare; this package registers the driver with the
// kubelet, publishes the pool as ResourceSlices and checks them, turns the
// kubelet's gRPC calls into requests to the loop, streams device health,
// and writes the claims' device status.
//
// What the devices are, their attributes, partitions and slices, and the
// opaque config claims may carry, is package devicemodel's.
package dra
