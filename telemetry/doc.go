// Package telemetry exports the GPUs' DCGM-style metrics. A Sampler reads
// NVML (fields, memory, GPM) into a cache on its own schedule, and a
// Collector turns that cache, the health watcher's state and the kubelet's
// pod-resources answer into dcgm-exporter-compatible series, attributed to
// the pods that hold each device; a scrape never calls NVML or the kubelet.
//
// The agent owns the loop: it runs Sampler.Run in a goroutine, feeds each
// new gpu.Inventory to it, and registers one Collector on its Prometheus
// registry.
package telemetry
