package harness

import (
	"os"
	"path/filepath"
	"slices"
	"testing"
)

func TestReadGrafanaDashboardWalksRows(t *testing.T) {
	// A panel at the top, an open row followed by its panel, a collapsed row holding one, a hidden target, a
	// text panel without targets, and a variable whose query is an object (newer Grafana).
	const doc = `{"title": "d",
	  "templating": {"list": [
	    {"name": "ds", "type": "datasource", "query": "prometheus"},
	    {"name": "node", "type": "query", "query": {"query": "label_values(up, instance)", "refId": "A"},
	     "includeAll": true, "multi": true, "allValue": ".*"},
	    {"name": "gpu", "type": "query", "query": "label_values(DCGM_FI_DEV_GPU_TEMP, gpu)", "includeAll": true, "allValue": null}]},
	  "panels": [
	    {"type": "stat", "title": "top", "targets": [{"expr": "a"}, {"expr": "hidden", "hide": true}]},
	    {"type": "row", "title": "open", "panels": []},
	    {"type": "timeseries", "title": "after open", "targets": [{"expr": "b", "legendFormat": "{{gpu}}"}]},
	    {"type": "row", "title": "collapsed", "collapsed": true, "panels": [
	      {"type": "graph", "title": "inside", "targets": [{"expr": "c"}]}]},
	    {"type": "text", "title": "notes"}]}`
	path := filepath.Join(t.TempDir(), "d.json")
	if err := os.WriteFile(path, []byte(doc), 0o644); err != nil {
		t.Fatal(err)
	}
	d, err := ReadGrafanaDashboard(path)
	if err != nil {
		t.Fatal(err)
	}
	want := []Query{
		{Panel: "top", PanelType: "stat", Expr: "a"},
		{Panel: "after open", PanelType: "timeseries", Expr: "b", Legend: "{{gpu}}"},
		{Panel: "inside", PanelType: "graph", Expr: "c"},
	}
	if !slices.Equal(d.Queries, want) {
		t.Errorf("queries %+v, want %+v", d.Queries, want)
	}
	wantVars := []Variable{
		{Name: "ds", Type: "datasource", Query: "prometheus"},
		{Name: "node", Type: "query", Query: "label_values(up, instance)", IncludeAll: true, Multi: true, AllValue: ".*"},
		{Name: "gpu", Type: "query", Query: "label_values(DCGM_FI_DEV_GPU_TEMP, gpu)", IncludeAll: true},
	}
	if !slices.Equal(d.Variables, wantVars) {
		t.Errorf("variables %+v, want %+v", d.Variables, wantVars)
	}
}

func TestInterpolate(t *testing.T) {
	vals := map[string]string{"gpu": "(0|1)", "__rate_interval": "1m", "node": ".*"}
	for _, tc := range []struct{ in, want string }{
		{`x{gpu=~"$gpu", Hostname=~"$node"}`, `x{gpu=~"(0|1)", Hostname=~".*"}`},
		{`rate(x{gpu=~"${gpu}"}[$__rate_interval])`, `rate(x{gpu=~"(0|1)"}[1m])`},
		{`x{gpu=~"[[gpu]]"}`, `x{gpu=~"(0|1)"}`},
		// Grafana leaves names it does not know, such as label_replace's $1.
		{`label_replace(x, "a", "$1", "b", "(.*)")`, `label_replace(x, "a", "$1", "b", "(.*)")`},
	} {
		got, err := Interpolate(tc.in, vals)
		if err != nil || got != tc.want {
			t.Errorf("Interpolate(%s) = %s, %v; want %s", tc.in, got, err, tc.want)
		}
	}
	if _, err := Interpolate(`x{gpu=~"${gpu:csv}"}`, vals); err == nil {
		t.Error("a ${var:format} was accepted, but formats are not implemented")
	}
}

func TestFormatAll(t *testing.T) {
	multi := Variable{Multi: true, IncludeAll: true}
	for _, tc := range []struct {
		v    Variable
		vals []string
		want string
	}{
		// One backslash per regex metacharacter, doubled inside the PromQL string.
		{multi, []string{"127.0.0.1:9400"}, `127\\.0\\.0\\.1:9400`},
		{multi, []string{"0", "1", "2"}, `(0|1|2)`},
		{multi, []string{`a\b`, "x|y"}, `(a\\\\b|x\\|y)`},
		{Variable{}, []string{"it's"}, `it\\'s`},
	} {
		if got := formatAll(tc.v, tc.vals); got != tc.want {
			t.Errorf("formatAll(%+v, %q) = %s, want %s", tc.v, tc.vals, got, tc.want)
		}
	}
}

func TestLabelValuesQuery(t *testing.T) {
	for _, tc := range []struct{ in, match, label string }{
		{"label_values(DCGM_FI_DEV_GPU_TEMP, instance)", "DCGM_FI_DEV_GPU_TEMP", "instance"},
		{`label_values(up{job="a",x="b"}, instance)`, `up{job="a",x="b"}`, "instance"},
		{"label_values(Hostname)", "", "Hostname"},
	} {
		m := labelValuesQuery.FindStringSubmatch(tc.in)
		if m == nil || m[1] != tc.match || m[2] != tc.label {
			t.Errorf("%s: parsed as %q, want match %q label %q", tc.in, m, tc.match, tc.label)
		}
	}
}

// The shipped dashboard and the fixture of NVIDIA's must both parse, with queries.
func TestDashboardsParse(t *testing.T) {
	own, err := ReadGrafanaDashboard(filepath.Join("..", "..", "..", "deploy", "grafana", "gpu-agent.json"))
	if err != nil {
		t.Fatal(err)
	}
	fixture, err := ReadDashboardFixture(filepath.Join("..", "testdata", "dcgm-dashboard-queries.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, d := range []*Dashboard{own, fixture} {
		if len(d.Queries) < 8 {
			t.Errorf("%s: %d queries", d.Title, len(d.Queries))
		}
	}
}
