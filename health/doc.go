// Package health watches the node's GPUs for faults. A Watcher turns NVML
// events (XIDs, ECC errors) and a periodic reachability probe into a
// per-device health State that marks a failing GPU, its MIG instances and its
// replicas unhealthy and brings them back when the cause clears.
//
// The agent owns the loop: it runs Watcher.Run in a goroutine and feeds each
// new gpu.Inventory and XID policy to it. Package telemetry reads the State
// for its metrics.
package health
