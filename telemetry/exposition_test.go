package telemetry

import (
	"bytes"
	"compress/gzip"
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	podresourcesv1 "k8s.io/kubelet/pkg/apis/podresources/v1"

	"github.com/gpu-agent/gpu-agent/internal/testwait"
	"github.com/gpu-agent/gpu-agent/podresources"
)

// serve sends one /metrics request with header to h.
func serve(tb testing.TB, h http.Handler, target string, header http.Header) *httptest.ResponseRecorder {
	tb.Helper()
	req := httptest.NewRequest(http.MethodGet, target, nil)
	req.Header = header
	rec := httptest.NewRecorder()
	h.ServeHTTP(rec, req)
	return rec
}

// seriesOf decodes a /metrics answer into its series ("name{labels} value",
// labels sorted, empty ones left out as PromQL does) and checks that each
// family comes once.
func seriesOf(tb testing.TB, rec *httptest.ResponseRecorder) map[string]bool {
	tb.Helper()
	if rec.Code != http.StatusOK {
		tb.Fatalf("status %d: %s", rec.Code, rec.Body)
	}
	body := io.Reader(bytes.NewReader(rec.Body.Bytes()))
	if rec.Header().Get("Content-Encoding") == "gzip" {
		// One member, nothing after it: what every gzip reader takes.
		zr, err := gzip.NewReader(bytes.NewReader(rec.Body.Bytes()))
		if err != nil {
			tb.Fatal(err)
		}
		zr.Multistream(false)
		plain, err := io.ReadAll(zr)
		if err != nil {
			tb.Fatalf("gzip body: %v", err)
		}
		if err := zr.Close(); err != nil {
			tb.Fatalf("gzip body: %v", err)
		}
		if _, err := zr.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
			tb.Fatalf("gzip body goes on after its member: %v", err)
		}
		body = bytes.NewReader(plain)
	}
	format := expfmt.ResponseFormat(rec.Header())
	var mfs []*dto.MetricFamily
	switch format.FormatType() {
	case expfmt.TypeTextPlain:
		p := expfmt.NewTextParser(model.LegacyValidation)
		byName, err := p.TextToMetricFamilies(body)
		if err != nil {
			tb.Fatalf("text parser: %v", err)
		}
		mfs = slices.Collect(maps.Values(byName))
	case expfmt.TypeProtoDelim:
		dec := expfmt.NewDecoder(body, format)
		seen := map[string]bool{}
		for {
			mf := &dto.MetricFamily{}
			err := dec.Decode(mf)
			if errors.Is(err, io.EOF) {
				break
			}
			if err != nil {
				tb.Fatalf("protobuf: %v", err)
			}
			if seen[mf.GetName()] {
				tb.Fatalf("family %s twice", mf.GetName())
			}
			seen[mf.GetName()] = true
			mfs = append(mfs, mf)
		}
	default:
		tb.Fatalf("format %q", format)
	}
	out := map[string]bool{}
	for _, mf := range mfs {
		for _, m := range mf.Metric {
			var ls []string
			for _, l := range m.Label {
				if l.GetValue() != "" {
					ls = append(ls, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
				}
			}
			slices.Sort(ls)
			var v float64
			switch {
			case m.Gauge != nil:
				v = m.Gauge.GetValue()
			case m.Counter != nil:
				v = m.Counter.GetValue()
			default:
				v = m.Untyped.GetValue()
			}
			out[fmt.Sprintf("%s %s{%s} %g", mf.GetType(), mf.GetName(), strings.Join(ls, ","), v)] = true
		}
	}
	return out
}

// exposedRig is a node with holders of every kind: four pods time-sliced on
// GPU 0 (one of them idle), two MPS clients on GPU 1, and a Hostname whose
// characters the text format must escape.
func exposedRig(t *testing.T) (*holderRig, *Collector) {
	r := newHolderRig(t, "dgx-h100", HolderOptions{})
	g0, g1 := r.inv.GPUs[0].UUID, r.inv.GPUs[1].UUID
	var pods []*podresourcesv1.PodResources
	for i, name := range []string{"busy", "light", "idle", "none"} {
		w := newWorkload(i+1, "ml", name)
		r.pods = append(r.pods, w.pod())
		pods = append(pods, pod(w.ns, w.name, w.container, "nvidia.com/gpu.shared", fmt.Sprintf("%s::%d", g0, i)))
		if name != "none" {
			r.start(0, uint32(1000+i), w, uint32(40/(i+1)), 1<<30)
		}
	}
	for i, name := range []string{"mps-a", "mps-b"} {
		w := newWorkload(10+i, "infer", name)
		r.pods = append(r.pods, w.pod())
		pods = append(pods, pod(w.ns, w.name, w.container, "nvidia.com/gpu.shared", fmt.Sprintf("%s::%d", g1, i)))
		p := simProcess(uint32(2000+i), uint32(30-20*i), w)
		p.MPS = true
		must(t, r.n.StartProcess(1, p))
	}
	r.attr.a = podresources.NewAttribution(pods, nil)
	r.passes(3, 10*time.Second)
	r.s.Sample()
	col := NewCollector(CollectorOptions{Samples: r.s, Attribution: r.attr, Holders: r.tr, Hostname: "node \"1\"\\\nb"})
	return r, col
}

// TestExpositionServesCollectorSeries: whatever a scraper asks for (text or
// protobuf, plain or gzip, all families or some), the Exposition's answer
// decodes to the series the Collector gathered through a registry at the
// scrape gives, plus the registry's own; on its own, its text is byte for
// byte promhttp's.
func TestExpositionServesCollectorSeries(t *testing.T) {
	golden, _ := goldenCollector(t)
	_, holders := exposedRig(t)
	for _, col := range []struct {
		name string
		c    *Collector
	}{{"golden", golden}, {"holders", holders}} {
		t.Run(col.name, func(t *testing.T) {
			old := scrape(t, col.c, nil)
			want := seriesOf(t, &httptest.ResponseRecorder{Code: http.StatusOK, Body: bytes.NewBufferString(old),
				HeaderMap: http.Header{"Content-Type": {string(expfmt.NewFormat(expfmt.TypeTextPlain))}}})
			if len(want) < 50 {
				t.Fatalf("only %d series through the registry", len(want))
			}
			e := NewExposition(col.c)
			// The Collector's families first, byte for byte, then the
			// registry's: promhttp's error counter.
			got := serve(t, MetricsHandler(prometheus.NewRegistry(), e), "/metrics", nil).Body.String()
			rest, ok := strings.CutPrefix(got, old)
			if !ok {
				t.Errorf("text differs from promhttp's:\n%s", diffLines(old, got))
			}
			for l := range strings.Lines(rest) {
				if !strings.Contains(l, "promhttp_metric_handler_errors_total") {
					t.Errorf("after the Collector's families: %q", l)
				}
			}

			reg := prometheus.NewRegistry()
			other := prometheus.NewCounter(prometheus.CounterOpts{Name: "other_total", Help: "Not the GPUs'."})
			other.Add(3)
			reg.MustRegister(other)
			h := MetricsHandler(reg, e)
			withOther := maps.Clone(want)
			withOther[`COUNTER other_total{} 3`] = true
			// What promhttp registers on the registry it is given.
			withOther[`COUNTER promhttp_metric_handler_errors_total{cause="encoding"} 0`] = true
			withOther[`COUNTER promhttp_metric_handler_errors_total{cause="gathering"} 0`] = true
			for _, tc := range []struct {
				name, accept, encoding string
			}{
				{"text", "", ""},
				{"text gzip", "", "gzip"},
				{"text 1.0.0", "text/plain;version=1.0.0;escaping=allow-utf-8", "deflate, gzip;q=0.5"},
				{"protobuf", protobufAccept, ""},
				{"protobuf gzip", protobufAccept, "gzip"},
				{"protobuf text (promhttp)", "application/vnd.google.protobuf;proto=io.prometheus.client.MetricFamily;encoding=text", ""},
			} {
				t.Run(tc.name, func(t *testing.T) {
					hdr := http.Header{}
					if tc.accept != "" {
						hdr.Set("Accept", tc.accept)
					}
					if tc.encoding != "" {
						hdr.Set("Accept-Encoding", tc.encoding)
					}
					rec := serve(t, h, "/metrics", hdr)
					if tc.encoding != "" && rec.Header().Get("Content-Encoding") != "gzip" {
						t.Errorf("Content-Encoding %q, want gzip", rec.Header().Get("Content-Encoding"))
					}
					if strings.Contains(tc.name, "promhttp") {
						if !strings.Contains(rec.Body.String(), `"DCGM_FI_DEV_GPU_TEMP"`) {
							t.Errorf("protobuf text without the DCGM families:\n%.500s", rec.Body)
						}
						return
					}
					got := seriesOf(t, rec)
					if !maps.Equal(got, withOther) {
						t.Errorf("series differ from the registry's:\n%s", diffSets(withOther, got))
					}
				})
			}
			t.Run("name filter", func(t *testing.T) {
				rec := serve(t, h, "/metrics?name[]=gpu_agent_device_healthy&name[]=other_total", nil)
				got := seriesOf(t, rec)
				for s := range got {
					if !strings.Contains(s, " gpu_agent_device_healthy{") && !strings.Contains(s, " other_total{") {
						t.Errorf("filtered out series %s served", s)
					}
				}
				if !got[`COUNTER other_total{} 3`] || len(got) < 2 {
					t.Errorf("filtered: %v", got)
				}
			})
		})
	}
}

func diffSets(want, got map[string]bool) string {
	var b strings.Builder
	for _, s := range slices.Sorted(maps.Keys(want)) {
		if !got[s] {
			fmt.Fprintf(&b, "- %s\n", s)
		}
	}
	for _, s := range slices.Sorted(maps.Keys(got)) {
		if !want[s] {
			fmt.Fprintf(&b, "+ %s\n", s)
		}
	}
	return b.String()
}

// TestExpositionFollowsPasses: a rendering is served while its inputs
// stand, and never after: a holder that ends loses its series at the next
// scrape after the tracker's pass, rendered or not; Run renders after a
// Kick, so that scrape finds the rendering made.
func TestExpositionFollowsPasses(t *testing.T) {
	r, col := exposedRig(t)
	e := NewExposition(col)
	h := MetricsHandler(prometheus.NewRegistry(), e)
	busy := `pod="busy"`
	if got := seriesOf(t, serve(t, h, "/metrics", nil)); !hasSeries(got, "gpu_agent_holder_sm_util_percent", busy) {
		t.Fatalf("no SM series of busy: %v", got)
	}
	first := e.cur.Load()
	serve(t, h, "/metrics", http.Header{"Accept-Encoding": {"gzip"}})
	if e.cur.Load() != first {
		t.Errorf("rendered again though nothing changed")
	}

	// busy ends: gone from pod-resources, then a pass; nobody renders.
	var pods []*podresourcesv1.PodResources
	for i, name := range []string{"light", "idle", "none"} {
		pods = append(pods, pod("ml", name, "main", "nvidia.com/gpu.shared", fmt.Sprintf("%s::%d", r.inv.GPUs[0].UUID, i+1)))
	}
	r.attr.a = podresources.NewAttribution(pods, nil)
	r.passes(1, 10*time.Second)
	for _, hdr := range []http.Header{nil, {"Accept": {protobufAccept}, "Accept-Encoding": {"gzip"}}} {
		got := seriesOf(t, serve(t, h, "/metrics", hdr))
		for s := range got {
			if strings.Contains(s, busy) {
				t.Errorf("ended holder's series served: %s", s)
			}
		}
		if !hasSeries(got, "gpu_agent_holder_sm_util_percent", `pod="light"`) {
			t.Errorf("light's series gone too")
		}
	}

	// A new sample: Run renders it after the Kick, and the scrape serves
	// that rendering.
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- e.Run(ctx) }()
	defer func() { cancel(); <-done }()
	r.clk.Add(10 * time.Second)
	r.s.Sample()
	e.Kick()
	testwait.For(t, "a rendering of the new sample", func() bool { return e.cur.Load().in.snap == r.s.Snapshot() })
	rendered := e.cur.Load()
	serve(t, h, "/metrics", nil)
	if e.cur.Load() != rendered {
		t.Errorf("the scrape rendered again after Run had")
	}
}

func hasSeries(series map[string]bool, name, label string) bool {
	for s := range series {
		if strings.Contains(s, " "+name+"{") && strings.Contains(s, label) {
			return true
		}
	}
	return false
}

// TestExpositionDuplicateFamily: a registry family of the Collector's name
// is refused as one registry would refuse it, in every path.
func TestExpositionDuplicateFamily(t *testing.T) {
	col, _ := goldenCollector(t)
	reg := prometheus.NewRegistry()
	g := prometheus.NewGauge(prometheus.GaugeOpts{Name: "gpu_agent_device_healthy", Help: "A second one."})
	reg.MustRegister(g)
	h := MetricsHandler(reg, NewExposition(col))
	for _, tc := range []struct {
		target string
		header http.Header
	}{
		{"/metrics", nil},
		{"/metrics", http.Header{"Accept-Encoding": {"gzip"}}},
		{"/metrics", http.Header{"Accept": {protobufAccept}}},
		{"/metrics?name[]=gpu_agent_device_healthy", nil},
	} {
		if rec := serve(t, h, tc.target, tc.header); rec.Code != http.StatusInternalServerError || !strings.Contains(rec.Body.String(), "gpu_agent_device_healthy") {
			t.Errorf("%s %v: %d %.200s, want 500 naming the family", tc.target, tc.header, rec.Code, rec.Body)
		}
	}
}

// TestExpositionNamesLegacy: the rendering's bytes serve every escaping
// scheme only because no name needs escaping.
func TestExpositionNamesLegacy(t *testing.T) {
	ch := make(chan *prometheus.Desc, 100)
	NewCollector(CollectorOptions{}).Describe(ch)
	close(ch)
	n := 0
	for d := range ch {
		n++
		s := d.String()
		name := s[strings.Index(s, `fqName: "`)+len(`fqName: "`):]
		name = name[:strings.IndexByte(name, '"')]
		if !model.LegacyValidation.IsValidMetricName(name) {
			t.Errorf("%s is not a legacy metric name", name)
		}
		_, labels, _ := strings.Cut(s, "variableLabels: {")
		labels, _, _ = strings.Cut(labels, "}")
		for l := range strings.SplitSeq(labels, ",") {
			if l != "" && !model.LegacyValidation.IsValidLabelName(l) {
				t.Errorf("%s: label %q is not a legacy name", name, l)
			}
		}
	}
	if n < 20 {
		t.Errorf("%d descriptions", n)
	}
}

func TestAcceptsGzip(t *testing.T) {
	for _, tc := range []struct {
		header string
		want   bool
	}{
		{"", false},
		{"gzip", true},
		{"GZIP", true},
		{"deflate, gzip", true},
		{"gzip;q=0", false},
		{"gzip; q=0.0", false},
		{"gzip;q=0.5", true},
		{"*", true},
		{"*;q=0", false},
		{"*, gzip;q=0", false},
		{"gzip;q=0, *", false},
		{"identity", false},
		{"zstd, br", false},
		{"gzip;q=bad", false},
	} {
		if got := acceptsGzip(tc.header); got != tc.want {
			t.Errorf("acceptsGzip(%q) = %v, want %v", tc.header, got, tc.want)
		}
	}
}

// FuzzAcceptsGzip: any Accept-Encoding header gets an answer, the same with
// spaces around its parts.
func FuzzAcceptsGzip(f *testing.F) {
	for _, s := range []string{"", "gzip", "gzip;q=0", "*;q=0.1, identity", "br;q=1.0, gzip;q=0.8, *;q=0.1", ";;,=,", "gzip;q"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, h string) {
		got := acceptsGzip(h)
		if spaced := strings.ReplaceAll(h, ",", " , "); acceptsGzip(spaced) != got {
			t.Errorf("acceptsGzip(%q) = %v, but %v with spaces around the commas", h, got, !got)
		}
	})
}
