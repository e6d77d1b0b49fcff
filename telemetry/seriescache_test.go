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
// for value, whatever the type; a series used again shares its pairs; one
// a scrape leaves out is built anew after.
func TestSeriesCache(t *testing.T) {
	d := prometheus.NewDesc("x", "help", []string{"b", "a"}, prometheus.Labels{"c": "const"})
	var c seriesCache
	for _, typ := range []prometheus.ValueType{prometheus.GaugeValue, prometheus.CounterValue, prometheus.UntypedValue} {
		for _, lv := range [][]string{{"1", "2"}, {"1", "3"}, {"", ""}} {
			got := writeMetric(t, c.metric(d, typ, 42.5, lv...))
			want := writeMetric(t, prometheus.MustNewConstMetric(d, typ, 42.5, lv...))
			if !reflect.DeepEqual(got.String(), want.String()) {
				t.Errorf("%v %v: cache writes %v, client_golang %v", typ, lv, got, want)
			}
		}
	}
	c.rotate()
	first := writeMetric(t, c.metric(d, prometheus.GaugeValue, 1, "1", "2"))
	again := writeMetric(t, c.metric(d, prometheus.GaugeValue, 2, "1", "2"))
	if &first.Label[0] != &again.Label[0] {
		t.Errorf("a series used twice got pairs %p and %p", first.Label, again.Label)
	}
	if first.GetGauge().GetValue() != 1 || again.GetGauge().GetValue() != 2 {
		t.Errorf("values %v, %v; want 1, 2", first.GetGauge().GetValue(), again.GetGauge().GetValue())
	}
	other := writeMetric(t, c.metric(d, prometheus.GaugeValue, 1, "12", ""))
	// Pairs are sorted by name: a, b, c.
	if other.Label[0].GetValue() != "" || other.Label[1].GetValue() != "12" || &other.Label[0] == &first.Label[0] {
		t.Errorf("values joined ambiguously: %v", other.Label)
	}
	c.rotate() // kept: used in the last scrape
	if kept := writeMetric(t, c.metric(d, prometheus.GaugeValue, 3, "1", "2")); &kept.Label[0] != &first.Label[0] {
		t.Error("a series of the last scrape was built again")
	}
	c.rotate()
	c.rotate() // "1","2" unused for a whole scrape
	if _, ok := c.prev[seriesKey{d, "1\xff2"}]; ok {
		t.Error("a series no scrape used is still cached")
	}
	defer func() {
		if recover() == nil {
			t.Error("a wrong number of label values did not panic")
		}
	}()
	c.metric(d, prometheus.GaugeValue, 1, "only one")
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
