// Package usage finds who uses each GPU and MIG device and how much: the
// processes NVML reports on them, with their per-process utilization and
// framebuffer memory (Sampler), and the pod and container each process runs
// in, read from the host's /proc (Resolver).
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
// the caller's choosing: the host's /proc mounted read-only into the
// agent's container (the chart mounts it at /host/proc), so the agent needs
// neither hostPID nor any other view of the host's processes. The cgroup
// path names the pod's UID and the container's ID (cgroup v1 and v2, the
// systemd and cgroupfs drivers, containerd and CRI-O); PodIndex turns them
// into namespace, pod and container names from the API server's Pods of the
// node.
package usage
