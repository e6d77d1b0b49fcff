// Package imex is the node side of compute domains: the DRA driver
// compute-domain.nvidia.com, served by the agent beside gpu.nvidia.com on
// nodes whose GPUs are attached to a multi-node NVLink fabric (GB200 and
// GB300 NVL72 racks).
//
// It publishes the node's IMEX channels (counted from the driver's
// parameters) and its daemon device under the attributes NVIDIA's
// DeviceClasses select, prepares channel claims by injecting the domain's
// own channel through CDI, checkpoints what it prepared, and keeps one
// IMEX daemon per domain with claims on the node running as a supervised
// process, with the domain's own config, node list and ports. Fabric faults
// and IMEX failures become device taints on the channels.
//
// The node list comes from the ComputeDomain's status.nodes, which the
// controller writes (docs/compute-domains.md, "Node side ↔ controller
// contract").
package imex
