// Package usage finds who uses each GPU and MIG device and how much: the
// processes NVML reports on them, with their per-process utilization and
// framebuffer memory (Sampler), and the pod and container each process runs
// in, read from the host's /proc (Resolver) and named by the API server's
// Pods of the node (PodIndex).
//
// # What NVML gives
//
// GetProcessUtilization returns samples (SM, memory, encoder, decoder %) of
// the processes busy in each of the driver's sample periods, newer than a
// timestamp the caller carries between reads; an idle process has none,
// and with nothing new the call answers NOT_FOUND. It does not exist for
// MIG: there a process's framebuffer memory, from GetComputeRunningProcesses
// and GetMPSComputeRunningProcesses on the MIG device's handle, is all there
// is. go-nvml's GetProcessesUtilizationInfo cannot return samples (it never
// passes an array), so it is not used.
//
// # PIDs and pods
//
// NVML names processes by their PID in the host's PID namespace. The
// Resolver reads /proc/<pid>/cgroup and /proc/<pid>/stat under a root of
// the caller's choosing. In a cluster that root is the host's /proc,
// mounted read-only into the agent's container (hostPath /proc at
// /host/proc, as node exporters do), not hostPID: the agent holds
// CAP_SYS_ADMIN for MIG, and in the host's PID namespace it could signal
// every process of the node, where the mount only lets it read the files
// Linux lets any user read. A process's cgroup file read from the agent's
// own cgroup namespace shows paths relative to the agent's cgroup
// ("/../../kubepods-…"), which the parser takes as they come.
//
// The cgroup path names the pod's UID and the container's ID (cgroup v1 and
// v2, the systemd and cgroupfs drivers, containerd, CRI-O and Docker
// scopes). The start time in /proc/<pid>/stat tells a reused PID from the
// process cached under it.
//
// UID and ID still need names. The kubelet's pod-resources API lists
// devices by namespace, pod and container name, with neither UID nor
// container ID; the CRI has both, but its socket gives whoever holds it the
// node. So PodIndex takes the Pods of the node from the API server
// (a watch on spec.nodeName, list and watch of pods in the agent's RBAC):
// each has its UID and, in its container statuses, every container's ID.
// A DRA claim's status.reservedFor names its pods by name and UID; its
// containers' names still come from the Pods.
package usage
