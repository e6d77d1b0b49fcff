package telemetry

import (
	"strings"
	"sync"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// seriesCache keeps the label pairs of the series a Collector sends from
// one scrape to the next, in which they rarely change. Building them anew
// for every series (prometheus.MustNewConstMetric: a pair allocated per
// label, then sorted) was a third of a scrape's time on a node of 100
// holders (BenchmarkHolderScrape: 3,600 DCGM series of 15 labels each).
// Pairs not used in a scrape are dropped at the next one. The pairs are
// shared by every scrape that sends the series, read-only, as client_golang
// shares a const metric's.
type seriesCache struct {
	mu sync.Mutex
	// cur holds the pairs used since the last rotate, prev those of the
	// scrape before; a pair is moved from prev to cur when used again.
	cur, prev map[seriesKey][]*dto.LabelPair
}

type seriesKey struct {
	desc   *prometheus.Desc
	values string
}

// rotate starts a scrape: what the previous one did not use is forgotten.
func (c *seriesCache) rotate() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.prev, c.cur = c.cur, make(map[seriesKey][]*dto.LabelPair, len(c.cur))
}

// metric is prometheus.MustNewConstMetric(d, typ, v, lv...) with its label
// pairs from the cache; like it, it panics on label values d refuses (their
// number, or invalid UTF-8), which no scrape can recover from.
func (c *seriesCache) metric(d *prometheus.Desc, typ prometheus.ValueType, v float64, lv ...string) prometheus.Metric {
	key := seriesKey{d, strings.Join(lv, "\xff")}
	c.mu.Lock()
	pairs, ok := c.cur[key]
	if !ok {
		if pairs, ok = c.prev[key]; ok {
			c.cur[key] = pairs
		}
	}
	c.mu.Unlock()
	if !ok {
		m := prometheus.MustNewConstMetric(d, typ, v, lv...)
		var out dto.Metric
		if err := m.Write(&out); err != nil {
			panic(err)
		}
		pairs = out.Label
		c.mu.Lock()
		if c.cur == nil {
			c.cur = map[seriesKey][]*dto.LabelPair{}
		}
		c.cur[key] = pairs
		c.mu.Unlock()
	}
	return &cachedMetric{desc: d, typ: typ, v: v, labels: pairs}
}

// cachedMetric is one sample of a series whose label pairs are cached.
type cachedMetric struct {
	desc   *prometheus.Desc
	typ    prometheus.ValueType
	v      float64
	labels []*dto.LabelPair
}

func (m *cachedMetric) Desc() *prometheus.Desc { return m.desc }

func (m *cachedMetric) Write(out *dto.Metric) error {
	out.Label = m.labels
	switch m.typ {
	case prometheus.CounterValue:
		out.Counter = &dto.Counter{Value: &m.v}
	case prometheus.GaugeValue:
		out.Gauge = &dto.Gauge{Value: &m.v}
	default:
		out.Untyped = &dto.Untyped{Value: &m.v}
	}
	return nil
}
