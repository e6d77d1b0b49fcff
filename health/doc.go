// Package health watches the node's GPUs for faults and exports their
// telemetry. A Watcher turns NVML events (XIDs, ECC errors) and a periodic
// reachability probe into a per-device health State that marks a failing GPU,
// its MIG instances and its replicas unhealthy and brings them back when the
// cause clears; a Sampler and a Collector publish dcgm-exporter-compatible
// metrics from a sampled cache, attributed to pods through the kubelet's
// pod-resources API (package podresources).
//
// The agent owns the loops: it runs Watcher.Run and Sampler.Run in
// goroutines, feeds each new gpu.Inventory to them, and
// registers one Collector on its Prometheus registry.
package health
