package deploy

import (
	"os"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// TestDCGMDashboardMetricsDeclared checks, without root or Prometheus, that every metric NVIDIA's dcgm-exporter
// dashboard queries (as listed in the e2e suite's fixture) is one the agent declares, so a rename in the agent
// fails here before the e2e suite's TestGrafanaDashboards renders the dashboard. checkDashboard does the same
// for gpu-agent's own dashboard against a scrape.
func TestDCGMDashboardMetricsDeclared(t *testing.T) {
	path := repoPath("test", "e2e", "testdata", "dcgm-dashboard-queries.yaml")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var fixture struct {
		Queries []struct {
			Panel string `json:"panel"`
			Expr  string `json:"expr"`
		} `json:"queries"`
	}
	if err := yaml.Unmarshal(data, &fixture); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	if len(fixture.Queries) == 0 {
		t.Fatalf("%s lists no queries", path)
	}
	source := agentSource(t)
	for _, q := range fixture.Queries {
		names := reMetricName.FindAllString(q.Expr, -1)
		if len(names) == 0 {
			t.Errorf("panel %q: query %q names no gpu-agent metric", q.Panel, q.Expr)
		}
		for _, n := range names {
			if !strings.Contains(source, `"`+n+`"`) {
				t.Errorf("panel %q of NVIDIA's dashboard queries %s, which the agent does not declare", q.Panel, n)
			}
		}
	}
}
