package telemetry

import (
	"strconv"

	"github.com/prometheus/client_golang/prometheus"
)

// holderSplit finds a holder's own figures in a HolderSnapshot.
type holderSplit map[holderKey]*HolderUse

func newHolderSplit(s *HolderSnapshot) holderSplit {
	if s == nil || len(s.Holders) == 0 {
		return nil
	}
	out := make(holderSplit, len(s.Holders))
	for i := range s.Holders {
		u := &s.Holders[i]
		out[holderKey{u.Device, u.series}] = u
	}
	return out
}

// of returns, for a device several holders share, each holder's own value
// of the field where dcgm-exporter splits it per process
// (DCGM_FI_DEV_GPU_UTIL from per-process SM utilization, DCGM_FI_DEV_FB_USED
// from per-process memory), so that dashboards built on its per-pod series
// read the same here; nil otherwise, and a holder without its own figure
// keeps the device's. uuids are the devices the series stands for (a GPU,
// or the MIG devices of one GPU instance).
func (s holderSplit) of(f Field, hs []seriesHolder, uuids ...string) func(seriesHolder) (float64, bool) {
	if s == nil || len(hs) < 2 || (f != FieldGPUUtil && f != FieldFBUsed) {
		return nil
	}
	return func(h seriesHolder) (float64, bool) {
		var v float64
		found := false
		for _, uuid := range uuids {
			u := s[holderKey{uuid, h}]
			if u == nil || !u.Attributed {
				continue
			}
			switch {
			case f == FieldFBUsed:
				v += float64(u.FBBytes >> 20)
			case u.PerProcess:
				v += u.SM
			default:
				continue
			}
			found = true
		}
		if f == FieldGPUUtil {
			v = min(v, 100)
		}
		return v, found
	}
}

// holderUse sends each holder's own series.
func (c *Collector) holderUse(ch chan<- prometheus.Metric, s *HolderSnapshot) {
	if s == nil || s.Time.IsZero() {
		return
	}
	ch <- c.cache.metric(c.holderTime, prometheus.GaugeValue, float64(s.Time.UnixNano())/1e9)
	lv := make([]string, 4+len(holderLabelNames)+1)
	for i := range s.Holders {
		u := &s.Holders[i]
		lv[0], lv[1], lv[2], lv[3] = strconv.Itoa(u.GPU), u.GPUUUID, u.MIGProfile, ""
		if u.GI >= 0 {
			lv[3] = strconv.Itoa(u.GI)
		}
		u.series.values(lv[4:])
		l := lv[:len(lv)-1]
		if u.Attributed {
			ch <- c.cache.metric(c.holderFB, prometheus.GaugeValue, float64(u.FBBytes), l...)
			ch <- c.cache.metric(c.holderProcs, prometheus.GaugeValue, float64(u.Processes), l...)
		}
		if u.UtilKnown {
			ch <- c.cache.metric(c.holderSM, prometheus.GaugeValue, u.SM, l...)
			ch <- c.cache.metric(c.holderIdle, prometheus.GaugeValue, u.IdleSeconds, l...)
		}
		if u.PerProcess {
			ch <- c.cache.metric(c.holderMem, prometheus.GaugeValue, u.Mem, l...)
			ch <- c.cache.metric(c.holderEnc, prometheus.GaugeValue, u.Enc, l...)
			ch <- c.cache.metric(c.holderDec, prometheus.GaugeValue, u.Dec, l...)
		}
		if u.MPSThreadLimit > 0 {
			ch <- c.cache.metric(c.holderMPSLimit, prometheus.GaugeValue, float64(u.MPSThreadLimit), l...)
			if u.UtilKnown {
				ch <- c.cache.metric(c.holderMPSUsed, prometheus.GaugeValue, u.MPSLimitUsed, l...)
			}
		}
		for _, w := range holderWindows {
			if v, ok := u.SMAvg[w.name]; ok {
				lv[len(lv)-1] = w.name
				ch <- c.cache.metric(c.holderAvg, prometheus.GaugeValue, v, lv...)
			}
		}
	}
}
