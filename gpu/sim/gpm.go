package sim

import (
	"time"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

// gpmSample is an nvmlGpmSample_t: a buffer GpmSampleGet fills with the
// counters of a GPU, a MIG device or a GPU instance, which GpmMetricsGet
// turns into averages between two samples.
type gpmSample struct {
	n     *Node
	freed bool
	taken bool
	g     *gpuState
	gi    *gpuInstance // nil: the whole GPU
	at    time.Time
	act   activity
}

var _ nvml.GpmSample = (*gpmSample)(nil)

// GpmSampleAlloc returns an empty sample buffer; see GPMSamplesAllocated.
func (n *Node) GpmSampleAlloc() (nvml.GpmSample, nvml.Return) {
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := n.ready(); r != nvml.SUCCESS {
		return nil, r
	}
	n.gpmLive++
	return &gpmSample{n: n}, nvml.SUCCESS
}

// GPMSamplesAllocated counts GPM sample buffers allocated and not yet freed,
// so tests can check that a caller frees what it allocates.
func (n *Node) GPMSamplesAllocated() int {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.gpmLive
}

// GpmSampleFree is s.Free.
func (n *Node) GpmSampleFree(s nvml.GpmSample) nvml.Return {
	if s == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return s.Free()
}

// GpmSampleGet is s.Get(dev), as in NVML.
func (n *Node) GpmSampleGet(dev nvml.Device, s nvml.GpmSample) nvml.Return {
	if s == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return s.Get(dev)
}

// GpmMigSampleGet is s.MigGet(dev, gi), as in NVML.
func (n *Node) GpmMigSampleGet(dev nvml.Device, gi int, s nvml.GpmSample) nvml.Return {
	if s == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return s.MigGet(dev, gi)
}

// GpmQueryDeviceSupport is dev.GpmQueryDeviceSupport.
func (n *Node) GpmQueryDeviceSupport(dev nvml.Device) (nvml.GpmSupport, nvml.Return) {
	if dev == nil {
		return nvml.GpmSupport{}, nvml.ERROR_INVALID_ARGUMENT
	}
	return dev.GpmQueryDeviceSupport()
}

// Free releases the buffer; a freed buffer is an invalid argument.
func (s *gpmSample) Free() nvml.Return {
	s.n.mu.Lock()
	defer s.n.mu.Unlock()
	if s.freed {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	s.freed = true
	s.n.gpmLive--
	return nvml.SUCCESS
}

// Get samples a GPU or MIG device handle (a MIG device samples its GPU
// instance).
func (s *gpmSample) Get(dev nvml.Device) nvml.Return {
	d, ok := dev.(*device)
	if !ok || d == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return d.gpmSample("GpmSampleGet", s, -1)
}

// MigGet samples GPU instance gi of the GPU handle dev.
func (s *gpmSample) MigGet(dev nvml.Device, gi int) nvml.Return {
	d, ok := dev.(*device)
	if !ok || d == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	return d.GpmMigSampleGet(gi, s)
}

// GpmSampleGet is s.Get(d).
func (d *device) GpmSampleGet(s nvml.GpmSample) nvml.Return {
	sample, _ := s.(*gpmSample)
	return d.gpmSample("GpmSampleGet", sample, -1)
}

// GpmMigSampleGet is s.MigGet(d, gi).
func (d *device) GpmMigSampleGet(gi int, s nvml.GpmSample) nvml.Return {
	sample, _ := s.(*gpmSample)
	if gi < 0 {
		gi = -2 // an invalid id, not the whole GPU
	}
	return d.gpmSample("GpmMigSampleGet", sample, gi)
}

// GpmQueryDeviceSupport answers for GPU and MIG device handles alike: a
// model older than Hopper is not a supported device (a success that says
// no, as NVML answers).
func (d *device) GpmQueryDeviceSupport() (nvml.GpmSupport, nvml.Return) {
	r := d.lock("GpmQueryDeviceSupport", true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return nvml.GpmSupport{}, r
	}
	s := nvml.GpmSupport{Version: nvml.GPM_SUPPORT_VERSION}
	if d.model().gpmSupported() {
		s.IsSupportedDevice = 1
	}
	return s, nvml.SUCCESS
}

// gpmSample fills s with the counters of d (gi -1) or of d's GPU instance
// gi (GpmMigSampleGet), after the checks every call makes.
func (d *device) gpmSample(call string, s *gpmSample, gi int) nvml.Return {
	r := d.lock(call, true)
	defer d.n.mu.Unlock()
	if r != nvml.SUCCESS {
		return r
	}
	if s == nil || s.n != d.n || s.freed || (gi != -1 && d.ci != nil) {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	if !d.model().gpmSupported() {
		return nvml.ERROR_NOT_SUPPORTED
	}
	g := d.g
	var inst *gpuInstance
	switch {
	case d.ci != nil:
		inst = d.ci.gi
	case gi != -1:
		if !g.migCurrent {
			return nvml.ERROR_NOT_SUPPORTED
		}
		for _, x := range g.gis {
			if x.id == gi {
				inst = x
			}
		}
		if inst == nil {
			return nvml.ERROR_INVALID_ARGUMENT
		}
	}
	g.advance(d.n)
	s.taken, s.g, s.gi, s.at = true, g, inst, d.n.opts.now()
	if inst != nil {
		s.act = inst.act
	} else {
		s.act = g.act
	}
	return nvml.SUCCESS
}

// GpmMetricsGet computes the metrics asked for in mg from its two samples,
// which must be of the same GPU or GPU instance, the second taken later.
// Metrics the sim does not model, NVLink metrics of a GPU without NVLink,
// and a GPU instance's PCIe and NVLink metrics (the links belong to the
// whole GPU; MIG has no NVLink) are NOT_SUPPORTED in their own NvmlReturn.
func (n *Node) GpmMetricsGet(mg *nvml.GpmMetricsGetType) nvml.Return {
	n.mu.Lock()
	defer n.mu.Unlock()
	if r := n.ready(); r != nvml.SUCCESS {
		return r
	}
	if mg == nil {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	mg.Version = nvml.GPM_METRICS_GET_VERSION // as go-nvml's GpmMetricsGet sets it
	s1, ok1 := mg.Sample1.(*gpmSample)
	s2, ok2 := mg.Sample2.(*gpmSample)
	if !ok1 || !ok2 || s1 == nil || s2 == nil || s1.n != n || s2.n != n || s1.freed || s2.freed ||
		!s1.taken || !s2.taken || s1.g != s2.g || s1.gi != s2.gi || int(mg.NumMetrics) > len(mg.Metrics) {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	dt := s2.at.Sub(s1.at).Seconds()
	if dt <= 0 {
		return nvml.ERROR_INVALID_ARGUMENT
	}
	a, b := &s1.act, &s2.act
	pct := func(x, y float64) float64 { return 100 * (y - x) / dt }
	mibps := func(x, y float64) float64 { return (y - x) / dt / mib }
	nvlink := s1.gi == nil && len(s1.g.links) > 0
	for i := range mg.Metrics[:mg.NumMetrics] {
		m := &mg.Metrics[i]
		m.NvmlReturn, m.Value = uint32(nvml.SUCCESS), 0
		switch nvml.GpmMetricId(m.MetricId) {
		case nvml.GPM_METRIC_GRAPHICS_UTIL:
			m.Value = pct(a.gr, b.gr)
		case nvml.GPM_METRIC_SM_UTIL:
			m.Value = pct(a.sm, b.sm)
		case nvml.GPM_METRIC_SM_OCCUPANCY:
			m.Value = pct(a.occ, b.occ)
		case nvml.GPM_METRIC_INTEGER_UTIL:
			m.Value = pct(a.integer, b.integer)
		case nvml.GPM_METRIC_ANY_TENSOR_UTIL, nvml.GPM_METRIC_HMMA_TENSOR_UTIL:
			m.Value = pct(a.tensor, b.tensor) // all of it half precision
		case nvml.GPM_METRIC_DFMA_TENSOR_UTIL, nvml.GPM_METRIC_IMMA_TENSOR_UTIL, nvml.GPM_METRIC_DMMA_TENSOR_UTIL:
			m.Value = 0
		case nvml.GPM_METRIC_DRAM_BW_UTIL:
			m.Value = pct(a.dram, b.dram)
		case nvml.GPM_METRIC_FP64_UTIL:
			m.Value = pct(a.fp64, b.fp64)
		case nvml.GPM_METRIC_FP32_UTIL:
			m.Value = pct(a.fp32, b.fp32)
		case nvml.GPM_METRIC_FP16_UTIL:
			m.Value = pct(a.fp16, b.fp16)
		case nvml.GPM_METRIC_PCIE_TX_PER_SEC:
			if s1.gi != nil {
				m.NvmlReturn = uint32(nvml.ERROR_NOT_SUPPORTED)
				continue
			}
			m.Value = mibps(a.pcieTx, b.pcieTx)
		case nvml.GPM_METRIC_PCIE_RX_PER_SEC:
			if s1.gi != nil {
				m.NvmlReturn = uint32(nvml.ERROR_NOT_SUPPORTED)
				continue
			}
			m.Value = mibps(a.pcieRx, b.pcieRx)
		case nvml.GPM_METRIC_NVLINK_TOTAL_TX_PER_SEC:
			if !nvlink {
				m.NvmlReturn = uint32(nvml.ERROR_NOT_SUPPORTED)
				continue
			}
			m.Value = mibps(a.nvlTx, b.nvlTx)
		case nvml.GPM_METRIC_NVLINK_TOTAL_RX_PER_SEC:
			if !nvlink {
				m.NvmlReturn = uint32(nvml.ERROR_NOT_SUPPORTED)
				continue
			}
			m.Value = mibps(a.nvlRx, b.nvlRx)
		default:
			m.NvmlReturn = uint32(nvml.ERROR_NOT_SUPPORTED)
		}
	}
	return nvml.SUCCESS
}
