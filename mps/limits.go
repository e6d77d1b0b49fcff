// Package mps runs one CUDA MPS control daemon per shared GPU or MIG device,
// keeps its limits applied and reports its health, so that MPS replicas are
// only offered while their daemon answers. It also says what a container that
// gets an MPS replica receives (environment and mounts).
//
// The daemons outlive the agent, so that an agent restart or upgrade does not
// kill their MPS clients: ending Supervisor.Run leaves them running, and the
// next agent adopts them. Only Set dropping a device (after the first Set,
// also a leftover daemon for a device it does not list) or
// Supervisor.StopAll quits one.
//
// In Kubernetes that is not enough: a daemon still ends with the container
// that started it. There the daemons run in `gpu-agent mps-host` (Host, a
// Supervisor in a DaemonSet of its own), and the agent drives them through
// Remote, which has the Supervisor's Set, Healthy and Changes; the two talk
// through desired.json and health.json in the MPS root (hostfiles.go).
package mps

import (
	"fmt"
	"path/filepath"
	"strconv"
	"strings"

	"github.com/gpu-agent/gpu-agent/catalog"
	"github.com/gpu-agent/gpu-agent/gpu"
)

// Daemon is the desired MPS control daemon for one device.
type Daemon struct {
	// Device is the GPU or MIG UUID the daemon is pinned to (CUDA_VISIBLE_DEVICES).
	Device string `json:"device"`
	// Index is the NVML index of the physical GPU; used in logs and errors only.
	Index int `json:"gpu"`
	// ActiveThreadPercentage limits each client's share of the SMs (1..100);
	// 0 leaves MPS's default (100).
	ActiveThreadPercentage int `json:"activeThreadPercentage,omitempty"`
	// PinnedMemLimitBytes limits each client's device memory; 0 means no limit.
	// MPS takes the limit in MiB, so it is rounded down to a whole MiB.
	PinnedMemLimitBytes uint64 `json:"pinnedMemLimitBytes,omitempty"`
}

// Validate checks the fields the daemon and the clients would reject.
func (d Daemon) Validate() error {
	if d.Device == "" {
		return fmt.Errorf("gpu %d: mps daemon: empty device UUID", d.Index)
	}
	if dirName(d.Device) == "." {
		// Its pipe and log directories would be the MPS root's own.
		return fmt.Errorf("gpu %d: mps daemon: device %q names no folder of its own", d.Index, d.Device)
	}
	if d.ActiveThreadPercentage < 0 || d.ActiveThreadPercentage > 100 {
		return fmt.Errorf("gpu %d (%s): activeThreadPercentage %d: must be 0..100", d.Index, d.Device, d.ActiveThreadPercentage)
	}
	if d.PinnedMemLimitBytes != 0 && d.PinnedMemLimitBytes < 1<<20 {
		return fmt.Errorf("gpu %d (%s): pinnedMemLimit %d bytes: below 1 MiB, the unit MPS takes", d.Index, d.Device, d.PinnedMemLimitBytes)
	}
	return nil
}

// DefaultDaemon is the daemon for a device shared by replicas clients: each
// client gets 100/replicas percent of the threads and memory/replicas bytes,
// so that replicas really are fractions of the device. Overrides from the
// config replace these fields afterwards.
func DefaultDaemon(device string, index int, memoryBytes uint64, replicas int) Daemon {
	d := Daemon{Device: device, Index: index}
	if replicas > 0 {
		d.ActiveThreadPercentage = max(1, 100/replicas)
		d.PinnedMemLimitBytes = memoryBytes / uint64(replicas)
	}
	return d
}

// MaxClients is the number of client CUDA contexts one MPS server accepts on
// a device of compute capability cc: 48 from Volta (7.0) on, 16 before, as
// NVIDIA's MPS documentation states. MPS needs compute capability 3.5; below
// that it returns 0.
func MaxClients(cc gpu.ComputeCapability) int {
	switch {
	case cc.AtLeast(7, 0):
		return 48
	case cc.AtLeast(3, 5):
		return 16
	}
	return 0
}

// ValidateReplicas reports an error when replicas MPS clients cannot share a
// device of compute capability cc. Each replica is at least one client
// context, so more replicas than MaxClients would fail at run time.
func ValidateReplicas(replicas int, cc gpu.ComputeCapability) error {
	limit := MaxClients(cc)
	switch {
	case replicas < 1:
		return fmt.Errorf("mps replicas %d: must be at least 1", replicas)
	case limit == 0:
		return fmt.Errorf("mps: not supported on compute capability %s (needs 3.5)", cc)
	case replicas > limit:
		return fmt.Errorf("mps replicas %d: above the %d clients MPS allows per device on compute capability %s", replicas, limit, cc)
	}
	return nil
}

// dirName is the device's folder under the MPS root. Pre-R470 MIG UUIDs
// ("MIG-GPU-<uuid>/<gi>/<ci>") contain slashes; they must not nest folders.
func dirName(device string) string {
	return strings.NewReplacer("/", "_", "..", "_").Replace(device)
}

// PipeDir is the daemon's CUDA_MPS_PIPE_DIRECTORY for device under root.
func PipeDir(root, device string) string {
	return filepath.Join(root, dirName(device), "pipe")
}

// LogDir is the daemon's CUDA_MPS_LOG_DIRECTORY for device under root.
func LogDir(root, device string) string {
	return filepath.Join(root, dirName(device), "log")
}

// ContainerSpec is what Allocate adds for a replica of d: the pipe directory
// (mounted at the same path, since clients find the daemon through it), the
// per-client limits, and shmDir as /dev/shm, because MPS clients and server
// exchange state in POSIX shared memory and must see the same /dev/shm as the
// daemon (shmDir is the host folder mounted as the agent's /dev/shm; "" adds
// no shm mount). The limits are also set as client environment because the
// daemon's defaults only reach servers started after they were set, while the
// environment is read by every client (and can only lower the daemon's).
func ContainerSpec(root, shmDir string, d Daemon) (map[string]string, []catalog.Mount) {
	pipe := PipeDir(root, d.Device)
	env := map[string]string{"CUDA_MPS_PIPE_DIRECTORY": pipe}
	if d.ActiveThreadPercentage > 0 {
		env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = strconv.Itoa(d.ActiveThreadPercentage)
	}
	if d.PinnedMemLimitBytes > 0 {
		// The container sees only this device, so it is ordinal 0 there.
		env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] = "0=" + memLimit(d.PinnedMemLimitBytes)
	}
	mounts := []catalog.Mount{{HostPath: pipe, ContainerPath: pipe}}
	if shmDir != "" {
		mounts = append(mounts, catalog.Mount{HostPath: shmDir, ContainerPath: "/dev/shm"})
	}
	return env, mounts
}

// memLimit formats bytes the way MPS takes memory limits: whole MiB with an
// "M" suffix.
func memLimit(bytes uint64) string {
	return strconv.FormatUint(bytes>>20, 10) + "M"
}

// limitCommands are the control commands that make d's limits the defaults
// of its daemon. The daemon sees only d.Device (CUDA_VISIBLE_DEVICES), so the
// device ordinal is 0.
func limitCommands(d Daemon) []string {
	var cmds []string
	if d.ActiveThreadPercentage > 0 {
		cmds = append(cmds, fmt.Sprintf("set_default_active_thread_percentage %d", d.ActiveThreadPercentage))
	}
	if d.PinnedMemLimitBytes > 0 {
		cmds = append(cmds, "set_default_device_pinned_mem_limit 0 "+memLimit(d.PinnedMemLimitBytes))
	}
	return cmds
}

// serverCommands apply d's limits to an already running MPS server: the
// set_default_* commands only reach servers spawned afterwards.
func serverCommands(d Daemon, serverPID int) []string {
	var cmds []string
	if d.ActiveThreadPercentage > 0 {
		cmds = append(cmds, fmt.Sprintf("set_active_thread_percentage %d %d", serverPID, d.ActiveThreadPercentage))
	}
	if d.PinnedMemLimitBytes > 0 {
		cmds = append(cmds, fmt.Sprintf("set_device_pinned_mem_limit %d 0 %s", serverPID, memLimit(d.PinnedMemLimitBytes)))
	}
	return cmds
}
