package telemetry

import (
	"reflect"
	"sync"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
)

func writeMetric(t *testing.T, m prometheus.Metric) *dto.Metric {
	t.Helper()
	var out dto.Metric
	if err := m.Write(&out); err != nil {
		t.Fatal(err)
	}
	return &out
}

// The cache's samples are client_golang's own, label for label and value
// for value, whatever the type; a pair (a label's name and value) is one
// object in every series that has it, from one scrape to the next; one no
// scrape used for a whole scrape is built anew after.
func TestSeriesCache(t *testing.T) {
	d := prometheus.NewDesc("x", "help", []string{"b", "a"}, prometheus.Labels{"c": "const"})
	other := prometheus.NewDesc("y", "help", []string{"a"}, nil)
	var c seriesCache
	for _, typ := range []prometheus.ValueType{prometheus.GaugeValue, prometheus.CounterValue, prometheus.UntypedValue} {
		for _, lv := range [][]string{{"1", "2"}, {"1", "3"}, {"", ""}, {"0", "1"}, {"1", "0"}} {
			got := writeMetric(t, c.metric(d, typ, 42.5, lv...))
			want := writeMetric(t, prometheus.MustNewConstMetric(d, typ, 42.5, lv...))
			if !reflect.DeepEqual(got.String(), want.String()) {
				t.Errorf("%v %v: cache writes %v, client_golang %v", typ, lv, got, want)
			}
		}
	}
	c.rotate()
	first := writeMetric(t, c.metric(d, prometheus.GaugeValue, 1, "1", "2"))
	between := writeMetric(t, c.metric(d, prometheus.GaugeValue, 1, "3", "1"))
	again := writeMetric(t, c.metric(d, prometheus.GaugeValue, 2, "1", "2"))
	elsewhere := writeMetric(t, c.metric(other, prometheus.GaugeValue, 2, "2"))
	// Pairs are sorted by name: a, b, c.
	if first.Label[0] != again.Label[0] || first.Label[1] != again.Label[1] || first.Label[2] != again.Label[2] {
		t.Errorf("a series built twice got pairs %p and %p", first.Label, again.Label)
	}
	if between.Label[2] != first.Label[2] {
		t.Errorf("the constant label is two pairs: %p, %p", between.Label[2], first.Label[2])
	}
	if elsewhere.Label[0] != first.Label[0] {
		t.Errorf("a=2 is two pairs in two families: %p, %p", elsewhere.Label[0], first.Label[0])
	}
	if first.GetGauge().GetValue() != 1 || again.GetGauge().GetValue() != 2 {
		t.Errorf("values %v, %v; want 1, 2", first.GetGauge().GetValue(), again.GetGauge().GetValue())
	}
	c.rotate() // kept: used in the last scrape
	if kept := writeMetric(t, c.metric(d, prometheus.GaugeValue, 3, "1", "2")); kept.Label[0] != first.Label[0] {
		t.Error("a pair of the last scrape was built again")
	}
	c.rotate()
	c.rotate() // a="2" unused for a whole scrape
	if _, ok := c.pairs[labelPair{"a", "2"}]; ok {
		t.Error("a pair no scrape used is still cached")
	}
	if _, ok := c.pairs[labelPair{"a", "1"}]; ok {
		t.Error("a pair no scrape used is still cached")
	}
	for _, lv := range [][]string{{"only one"}, {"1", "2", "3"}, {"\xff", "1"}} {
		func() {
			defer func() {
				if recover() == nil {
					t.Errorf("label values %q did not panic", lv)
				}
			}()
			c.metric(d, prometheus.GaugeValue, 1, lv...)
		}()
	}
}

// Scrapes at once each get every series whole.
func TestSeriesCacheConcurrent(t *testing.T) {
	d := prometheus.NewDesc("x", "help", []string{"i"}, nil)
	var c seriesCache
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			for range 50 {
				c.rotate()
				for i := range 20 {
					v := string(rune('a' + i))
					if got := writeMetric(t, c.metric(d, prometheus.GaugeValue, float64(i), v)); got.Label[0].GetValue() != v || got.GetGauge().GetValue() != float64(i) {
						t.Errorf("series %s: %v", v, got)
					}
				}
			}
		})
	}
	wg.Wait()
}
