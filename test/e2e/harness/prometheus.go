package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"net/http"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"time"
)

// PrometheusJob is the scrape job of the Env's gpu-agent in StartPrometheus's config.
const PrometheusJob = "gpu-agent"

// Prometheus is a real Prometheus server (Debian's package) that scrapes this Env's gpu-agent, so tests can run
// the queries users run (dashboards, alerts) against what a scrape really stores.
type Prometheus struct {
	proc *Process
	url  string
	// Target is the scraped address, the value of every series' instance label.
	Target string
}

// StartPrometheus runs bin with its TSDB in the run directory, scraping the agent's /metrics every interval as
// deploy/manifests' ServiceMonitor does (honorLabels: the agent's pod, namespace and container labels win over
// the target's), and waits until it serves its API. It is stopped before the Env's teardown.
func (e *Env) StartPrometheus(ctx context.Context, bin string, interval time.Duration) (*Prometheus, error) {
	dir := filepath.Join(e.d.run, "prometheus")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	ports, err := freePorts(1)
	if err != nil {
		return nil, err
	}
	// The scrape timeout must not exceed the interval (Prometheus refuses the config otherwise), and its default
	// is 10 s.
	cfg := fmt.Sprintf(`global:
  scrape_interval: %[1]s
  scrape_timeout: %[1]s
scrape_configs:
- job_name: %[2]s
  honor_labels: true
  metrics_path: /metrics
  static_configs:
  - targets: [%[3]q]
`, model(interval), PrometheusJob, e.agentAddr)
	cfgPath := filepath.Join(dir, "prometheus.yml")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		return nil, err
	}
	addr := fmt.Sprintf("127.0.0.1:%d", ports[0])
	p, err := startProcess("prometheus", filepath.Join(e.d.logs, "prometheus.log"), e.ledger, bin,
		"--config.file", cfgPath,
		"--storage.tsdb.path", filepath.Join(dir, "data"),
		"--web.listen-address", addr)
	if err != nil {
		return nil, err
	}
	e.t.Cleanup(func() {
		if err := p.Stop(10 * time.Second); err != nil {
			e.t.Errorf("e2e teardown: %v", err)
		}
	})
	prom := &Prometheus{proc: p, url: "http://" + addr, Target: e.agentAddr}
	err = poll(ctx, 100*time.Millisecond, func() error {
		if done, werr := p.Exited(); done {
			return stop(fmt.Errorf("prometheus exited: %v (see %s)", werr, p.LogPath))
		}
		return HTTPOK(ctx, prom.url+"/-/ready")
	})
	if err != nil {
		return nil, fmt.Errorf("prometheus: not ready: %w", err)
	}
	return prom, nil
}

// model writes d as a Prometheus duration (whole milliseconds at least).
func model(d time.Duration) string {
	if d%time.Second == 0 {
		return strconv.FormatInt(int64(d/time.Second), 10) + "s"
	}
	return strconv.FormatInt(d.Milliseconds(), 10) + "ms"
}

// Series is one series of a query's result: its labels (with __name__ where the result keeps it) and its
// values, one for an instant query, one per step for a range query.
type Series struct {
	Labels map[string]string
	Values []float64
}

// apiResponse is the envelope of every /api/v1 answer.
type apiResponse struct {
	Status    string          `json:"status"`
	Data      json.RawMessage `json:"data"`
	ErrorType string          `json:"errorType"`
	Error     string          `json:"error"`
}

func (p *Prometheus) get(ctx context.Context, path string, q url.Values, data any) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	u := p.url + path
	if len(q) > 0 {
		u += "?" + q.Encode()
	}
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, u, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return fmt.Errorf("prometheus %s: %w", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		return fmt.Errorf("prometheus %s: %w", path, err)
	}
	var r apiResponse
	if err := json.Unmarshal(b, &r); err != nil {
		return fmt.Errorf("prometheus %s: %s: %w", path, resp.Status, err)
	}
	if r.Status != "success" {
		return fmt.Errorf("prometheus %s: %s: %s", path, r.ErrorType, r.Error)
	}
	return json.Unmarshal(r.Data, data)
}

// TargetUp reports whether the agent's target is up, with the scrape error when it is not.
func (p *Prometheus) TargetUp(ctx context.Context) error {
	var data struct {
		ActiveTargets []struct {
			ScrapePool string    `json:"scrapePool"`
			Health     string    `json:"health"`
			LastError  string    `json:"lastError"`
			LastScrape time.Time `json:"lastScrape"`
		} `json:"activeTargets"`
	}
	if err := p.get(ctx, "/api/v1/targets", url.Values{"state": {"active"}}, &data); err != nil {
		return err
	}
	for _, t := range data.ActiveTargets {
		if t.ScrapePool != PrometheusJob {
			continue
		}
		if t.Health != "up" {
			return fmt.Errorf("target %s is %s (last scrape %s): %s", p.Target, t.Health, t.LastScrape.Format(time.RFC3339Nano), t.LastError)
		}
		return nil
	}
	return fmt.Errorf("no active target in job %s", PrometheusJob)
}

// Query evaluates expr at now.
func (p *Prometheus) Query(ctx context.Context, expr string) ([]Series, error) {
	var data struct {
		ResultType string `json:"resultType"`
		Result     []struct {
			Metric map[string]string `json:"metric"`
			Value  [2]any            `json:"value"`
		} `json:"result"`
	}
	if err := p.get(ctx, "/api/v1/query", url.Values{"query": {expr}}, &data); err != nil {
		return nil, err
	}
	if data.ResultType != "vector" {
		return nil, fmt.Errorf("query %s: result type %s, want vector", expr, data.ResultType)
	}
	out := make([]Series, 0, len(data.Result))
	for _, r := range data.Result {
		v, err := sampleValue(r.Value)
		if err != nil {
			return nil, fmt.Errorf("query %s: %w", expr, err)
		}
		out = append(out, Series{Labels: r.Metric, Values: []float64{v}})
	}
	return out, nil
}

// QueryRange evaluates expr over [start, end] every step, as a Grafana graph, time series or stat panel does.
func (p *Prometheus) QueryRange(ctx context.Context, expr string, start, end time.Time, step time.Duration) ([]Series, error) {
	var data struct {
		ResultType string `json:"resultType"`
		Result     []struct {
			Metric map[string]string `json:"metric"`
			Values [][2]any          `json:"values"`
		} `json:"result"`
	}
	q := url.Values{
		"query": {expr},
		"start": {strconv.FormatFloat(float64(start.UnixMilli())/1e3, 'f', 3, 64)},
		"end":   {strconv.FormatFloat(float64(end.UnixMilli())/1e3, 'f', 3, 64)},
		"step":  {strconv.FormatFloat(step.Seconds(), 'f', -1, 64)},
	}
	if err := p.get(ctx, "/api/v1/query_range", q, &data); err != nil {
		return nil, err
	}
	if data.ResultType != "matrix" {
		return nil, fmt.Errorf("query_range %s: result type %s, want matrix", expr, data.ResultType)
	}
	out := make([]Series, 0, len(data.Result))
	for _, r := range data.Result {
		s := Series{Labels: r.Metric}
		for _, pt := range r.Values {
			v, err := sampleValue(pt)
			if err != nil {
				return nil, fmt.Errorf("query_range %s: %w", expr, err)
			}
			s.Values = append(s.Values, v)
		}
		out = append(out, s)
	}
	return out, nil
}

// sampleValue reads the value of a [timestamp, "value"] pair.
func sampleValue(pt [2]any) (float64, error) {
	s, ok := pt[1].(string)
	if !ok {
		return 0, fmt.Errorf("sample value %v is not a string", pt[1])
	}
	switch s {
	case "NaN":
		return math.NaN(), nil
	case "+Inf":
		return math.Inf(1), nil
	case "-Inf":
		return math.Inf(-1), nil
	}
	return strconv.ParseFloat(s, 64)
}

// LabelValues returns the values of label on the series match selects ("" for any series), as Grafana's
// label_values() asks for them.
func (p *Prometheus) LabelValues(ctx context.Context, label, match string) ([]string, error) {
	q := url.Values{}
	if match != "" {
		q.Set("match[]", match)
	}
	var vals []string
	if err := p.get(ctx, "/api/v1/label/"+url.PathEscape(label)+"/values", q, &vals); err != nil {
		return nil, err
	}
	return vals, nil
}

// WaitSamples waits until the agent's target is up and every series of selector (a series selector, e.g. a
// metric name) has at least n samples in the last minute: rate() and increase() need two. The error says what
// was last seen.
func (p *Prometheus) WaitSamples(ctx context.Context, selector string, n int) error {
	expr := fmt.Sprintf("count_over_time(%s[1m])", selector)
	err := poll(ctx, 200*time.Millisecond, func() error {
		if done, werr := p.proc.Exited(); done {
			return stop(fmt.Errorf("prometheus exited: %v (see %s)", werr, p.proc.LogPath))
		}
		if err := p.TargetUp(ctx); err != nil {
			return err
		}
		res, err := p.Query(ctx, expr)
		if err != nil {
			return stop(err)
		}
		if len(res) == 0 {
			return fmt.Errorf("no series of %s yet", selector)
		}
		for _, s := range res {
			if s.Values[0] < float64(n) {
				return fmt.Errorf("%s: a series has %v samples, want %d: %v", selector, s.Values[0], n, s.Labels)
			}
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("prometheus: waiting for %d samples of %s: %w", n, selector, err)
	}
	return nil
}

// PrometheusBinary finds Debian's prometheus (run.sh installs the package) on PATH.
func PrometheusBinary() (string, error) {
	bin, err := exec.LookPath("prometheus")
	if err != nil {
		return "", fmt.Errorf("prometheus not installed (apt-get install prometheus; run.sh does): %w", err)
	}
	return bin, nil
}
