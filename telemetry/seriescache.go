package telemetry

import (
	"strconv"
	"sync"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

// seriesCache builds the label pairs of the series a Collector sends from
// pairs it shares between series and scrapes: each label's name and value
// is one *dto.LabelPair however many series carry it.
//
// Building them anew for every series (prometheus.MustNewConstMetric: a
// pair allocated per label, then sorted) was a third of a scrape's time on
// a node of 100 holders (BenchmarkHolderScrape: 3,600 DCGM series of 19
// labels each). Keeping each series' own pairs from one scrape to the next
// instead cost 1.9 kB per series, 32 MB at 8 GPUs × 48 holders
// (BenchmarkHolderMemory), where a series' labels differ from the last
// series' of its family in a few values (the holder's) and the distinct
// values of a node number in the hundreds. So the cache keeps the pairs by
// name and value, and a series costs the slice of pointers to them, which
// the rendering that asked for it drops. A pair no scrape used since the
// one before is forgotten.
//
// The pairs are read-only once made, shared as client_golang shares a
// Desc's constant ones.
type seriesCache struct {
	mu     sync.Mutex
	scrape uint64 // counts rotate calls
	descs  map[*prometheus.Desc]*descLabels
	pairs  map[labelPair]*cachedPair
	// slab is where series take their slices of pairs from: an
	// allocation per few hundred series rather than one each.
	slab []*dto.LabelPair
}

type labelPair struct{ name, value string }

type cachedPair struct {
	pair *dto.LabelPair
	used uint64 // the scrape that last used it
}

// descLabels is how a Desc's series are labelled, which client_golang
// keeps to itself: the pairs sorted by name, each a label value (at[k],
// an index into the values passed) or a constant label (fixed[k]).
type descLabels struct {
	names []string
	at    []int
	fixed []*dto.LabelPair
	// values is how many label values a series takes.
	values int
	// last is the k-th pair of the series built last: the next series of
	// the family mostly has the same.
	last []*cachedPair
}

// rotate starts a scrape: pairs the previous one did not use are
// forgotten.
func (c *seriesCache) rotate() {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.scrape++
	for k, p := range c.pairs {
		if p.used+1 < c.scrape {
			delete(c.pairs, k)
		}
	}
}

// metric is prometheus.MustNewConstMetric(d, typ, v, lv...) with its label
// pairs from the cache; like it, it panics on label values d refuses (their
// number, or invalid UTF-8), which no scrape can recover from.
func (c *seriesCache) metric(d *prometheus.Desc, typ prometheus.ValueType, v float64, lv ...string) prometheus.Metric {
	c.mu.Lock()
	labels, ok := c.labels(d, lv)
	c.mu.Unlock()
	if !ok {
		return prometheus.MustNewConstMetric(d, typ, v, lv...)
	}
	return &cachedMetric{desc: d, typ: typ, v: v, labels: labels}
}

// labels returns d's pairs for the values lv, sorted by name; false when
// client_golang is to build them (and refuse them).
func (c *seriesCache) labels(d *prometheus.Desc, lv []string) ([]*dto.LabelPair, bool) {
	dl := c.descs[d]
	if dl == nil {
		// Not kept when nil: client_golang refuses d or these values.
		if dl = newDescLabels(d, len(lv)); dl == nil {
			return nil, false
		}
		if c.descs == nil {
			c.descs, c.pairs = map[*prometheus.Desc]*descLabels{}, map[labelPair]*cachedPair{}
		}
		c.descs[d] = dl
	}
	if len(lv) != dl.values {
		return nil, false
	}
	n := len(dl.names)
	if len(c.slab) < n {
		c.slab = make([]*dto.LabelPair, max(n, 4096))
	}
	out := c.slab[:n:n]
	c.slab = c.slab[n:]
	for k, i := range dl.at {
		if i < 0 {
			out[k] = dl.fixed[k]
			continue
		}
		p := dl.last[k]
		if p == nil || p.pair.GetValue() != lv[i] {
			key := labelPair{dl.names[k], lv[i]}
			if p = c.pairs[key]; p == nil {
				if !utf8.ValidString(lv[i]) {
					return nil, false
				}
				p = &cachedPair{pair: &dto.LabelPair{Name: &dl.names[k], Value: &key.value}}
				c.pairs[key] = p
			}
			dl.last[k] = p
		}
		p.used = c.scrape
		out[k] = p.pair
	}
	return out, true
}

// newDescLabels learns d's labels from client_golang: the pairs of two
// series whose n values all differ, sorted as it sorts them; a pair whose
// value is the same in both is a constant label. nil when d takes no n
// values.
func newDescLabels(d *prometheus.Desc, n int) *descLabels {
	write := func(suffix string) []*dto.LabelPair {
		lv := make([]string, n)
		for i := range lv {
			lv[i] = strconv.Itoa(i) + suffix
		}
		m, err := prometheus.NewConstMetric(d, prometheus.UntypedValue, 0, lv...)
		if err != nil {
			return nil
		}
		var out dto.Metric
		if m.Write(&out) != nil {
			return nil
		}
		return out.Label
	}
	a, b := write(""), write("'")
	if a == nil || len(a) != len(b) {
		return nil
	}
	dl := &descLabels{names: make([]string, len(a)), at: make([]int, len(a)), fixed: make([]*dto.LabelPair, len(a)),
		values: n, last: make([]*cachedPair, len(a))}
	for k := range a {
		dl.names[k] = a[k].GetName()
		if a[k].GetValue() == b[k].GetValue() {
			dl.at[k], dl.fixed[k] = -1, a[k]
			continue
		}
		i, err := strconv.Atoi(a[k].GetValue())
		if err != nil || i < 0 || i >= n {
			return nil
		}
		dl.at[k] = i
	}
	return dl
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
