package agent

import "github.com/prometheus/client_golang/prometheus"

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
	}
	m.configValid.Set(1)
	if reg != nil {
		reg.MustRegister(m.configValid, m.configErrors, m.configReloads, m.configWarnings, m.configFallback, m.inventoryErrors, m.reconcileDuration, m.devices, m.migPhases, m.planPasses)
	}
	return m
}
