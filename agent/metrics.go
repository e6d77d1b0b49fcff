package agent

import (
	"sync/atomic"

	"github.com/gpu-agent/gpu-agent/ledger"
	"github.com/prometheus/client_golang/prometheus"
)

type metrics struct {
	configValid       prometheus.Gauge
	configErrors      prometheus.Counter
	configReloads     prometheus.Counter
	configWarnings    prometheus.Gauge
	configFallback    prometheus.Gauge
	inventoryErrors   prometheus.Counter
	reconcileDuration prometheus.Histogram
	devices           *prometheus.GaugeVec
	migPhases         *prometheus.GaugeVec
	planPasses        prometheus.Counter
	// ckptFailures counts failed checkpoint writes, for stateFailures;
	// stateSaved is 1 while the checkpoint and the allocation log are on
	// disk.
	ckptFailures atomic.Int64
	stateSaved   prometheus.Gauge
}

// stateFailures is gpu_agent_state_write_failures_total: the checkpoint's
// failed writes (the loop's) and the allocation log's (the ledger's, from
// the device plugin's goroutines), by file.
type stateFailures struct {
	desc   *prometheus.Desc
	ckpt   *atomic.Int64
	ledger *ledger.Ledger
}

func newStateFailures(ckpt *atomic.Int64, l *ledger.Ledger) *stateFailures {
	return &stateFailures{ckpt: ckpt, ledger: l, desc: prometheus.NewDesc("gpu_agent_state_write_failures_total",
		"Writes of what must survive a restart that failed, by file in --state-dir: the checkpoint (retried at every pass; a DRA Prepare it cannot record is refused) and the allocation log (an Allocate it cannot record is refused).",
		[]string{"file"}, nil)}
}

func (c *stateFailures) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c *stateFailures) Collect(ch chan<- prometheus.Metric) {
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(c.ckpt.Load()), CheckpointFile)
	ch <- prometheus.MustNewConstMetric(c.desc, prometheus.CounterValue, float64(c.ledger.LogFailures()), ledger.AllocLogFile)
}

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		configValid: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpu_agent_config_valid",
			Help: "1 when the config file's latest content was accepted, 0 when it was rejected (the last good config is kept).",
		}),
		configErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gpu_agent_config_errors_total",
			Help: "Config contents rejected since start.",
		}),
		configReloads: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gpu_agent_config_reloads_total",
			Help: "Config contents accepted since start.",
		}),
		configWarnings: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpu_agent_config_warnings",
			Help: "Warnings about the config in force (shown on /status): fields accepted but ignored, and entries this node cannot honour while the rest applies.",
		}),
		configFallback: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpu_agent_config_fallback",
			Help: "1 while the built-in default (whole GPUs, existing MIG devices, no sharing) is served because no config has applied since start; /status says why.",
		}),
		inventoryErrors: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gpu_agent_inventory_errors_total",
			Help: "Inventory passes that failed entirely (the last inventory was kept).",
		}),
		reconcileDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name:    "gpu_agent_reconcile_duration_seconds",
			Help:    "Time of one observe-plan-publish pass.",
			Buckets: prometheus.ExponentialBuckets(0.0005, 4, 8),
		}),
		devices: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gpu_agent_devices",
			Help: "Devices offered to the kubelet, by resource and health.",
		}, []string{"resource", "health"}),
		migPhases: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "gpu_agent_mig_state",
			Help: "1 for each GPU's MIG repartitioning phase (applied, planned, pending, reset-required, failed).",
		}, []string{"gpu", "UUID", "phase"}),
		planPasses: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "gpu_agent_plan_passes_total",
			Help: "Plans computed since start (steady state: one per resync or event batch).",
		}),
		stateSaved: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "gpu_agent_state_saved",
			Help: "1 while the checkpoint and the allocation log are on disk as the agent last meant them, 0 while a write fails (/status and /readyz say why).",
		}),
	}
	m.stateSaved.Set(1)
	m.configValid.Set(1)
	if reg != nil {
		reg.MustRegister(m.configValid, m.configErrors, m.configReloads, m.configWarnings, m.configFallback, m.inventoryErrors, m.reconcileDuration, m.devices, m.migPhases, m.planPasses,
			m.stateSaved)
	}
	return m
}
