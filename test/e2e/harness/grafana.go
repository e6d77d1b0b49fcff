package harness

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"regexp"
	"strings"

	"sigs.k8s.io/yaml"
)

// Dashboard is what evaluating a Grafana dashboard's queries needs of it: its template variables and each
// panel's queries. ReadGrafanaDashboard reads one from Grafana's JSON; a test fixture can list the same in YAML
// (ReadDashboardFixture).
type Dashboard struct {
	Title     string     `json:"title"`
	Variables []Variable `json:"variables"`
	Queries   []Query    `json:"queries"`
}

// Variable is a template variable. Query is label_values(...) for a query variable, the comma-separated
// options of a custom one, the value of a constant or textbox.
type Variable struct {
	Name       string `json:"name"`
	Type       string `json:"type"`
	Query      string `json:"query"`
	IncludeAll bool   `json:"includeAll,omitempty"`
	Multi      bool   `json:"multi,omitempty"`
	// AllValue replaces the list of every value when "All" is selected (e.g. ".*"); empty: the list.
	AllValue string `json:"allValue,omitempty"`
}

// Query is one target of a panel.
type Query struct {
	Panel     string `json:"panel"`
	PanelType string `json:"panelType"`
	Expr      string `json:"expr"`
	Legend    string `json:"legend,omitempty"`
}

// grafanaPanel is the part of a panel (or row) Grafana's JSON model gives that a query needs.
type grafanaPanel struct {
	Title   string         `json:"title"`
	Type    string         `json:"type"`
	Panels  []grafanaPanel `json:"panels"` // a collapsed row's panels
	Targets []struct {
		Expr         string `json:"expr"`
		LegendFormat string `json:"legendFormat"`
		Hide         bool   `json:"hide"`
	} `json:"targets"`
}

// ReadGrafanaDashboard reads a dashboard as Grafana exports it: panels nested in rows (both the current model,
// where a collapsed row holds its panels, and the old one's top-level rows), and its templating list.
func ReadGrafanaDashboard(path string) (*Dashboard, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var doc struct {
		Title  string         `json:"title"`
		Panels []grafanaPanel `json:"panels"`
		Rows   []grafanaPanel `json:"rows"`
		// Templating holds the variables; each entry's query is a string, or an object with a query string
		// in newer Grafana, and allValue may be null.
		Templating struct {
			List []struct {
				Name       string          `json:"name"`
				Type       string          `json:"type"`
				Query      json.RawMessage `json:"query"`
				IncludeAll bool            `json:"includeAll"`
				Multi      bool            `json:"multi"`
				AllValue   *string         `json:"allValue"`
			} `json:"list"`
		} `json:"templating"`
	}
	if err := json.Unmarshal(data, &doc); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	d := &Dashboard{Title: doc.Title}
	for _, v := range doc.Templating.List {
		q, err := variableQuery(v.Query)
		if err != nil {
			return nil, fmt.Errorf("%s: variable %s: %w", path, v.Name, err)
		}
		nv := Variable{Name: v.Name, Type: v.Type, Query: q, IncludeAll: v.IncludeAll, Multi: v.Multi}
		if v.AllValue != nil {
			nv.AllValue = *v.AllValue
		}
		d.Variables = append(d.Variables, nv)
	}
	var walk func([]grafanaPanel)
	walk = func(ps []grafanaPanel) {
		for _, p := range ps {
			walk(p.Panels)
			for _, t := range p.Targets {
				if t.Hide || t.Expr == "" {
					continue // Grafana does not run hidden targets; a target without expr is another data source's
				}
				d.Queries = append(d.Queries, Query{Panel: p.Title, PanelType: p.Type, Expr: t.Expr, Legend: t.LegendFormat})
			}
		}
	}
	walk(doc.Panels)
	walk(doc.Rows)
	return d, nil
}

func variableQuery(raw json.RawMessage) (string, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return "", nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, nil
	}
	var o struct {
		Query string `json:"query"`
	}
	if err := json.Unmarshal(raw, &o); err != nil {
		return "", fmt.Errorf("query is neither a string nor an object with one: %s", raw)
	}
	return o.Query, nil
}

// ReadDashboardFixture reads a Dashboard written out in YAML (the fields of Dashboard).
func ReadDashboardFixture(path string) (*Dashboard, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	var d Dashboard
	if err := yaml.UnmarshalStrict(data, &d); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &d, nil
}

// grafanaVar matches Grafana's variable syntaxes: $name, ${name}, ${name:format}, [[name]], [[name:format]].
var grafanaVar = regexp.MustCompile(`\$(\w+)|\$\{(\w+)(?::([^}]+))?\}|\[\[(\w+)(?::([^\]]+))?\]\]`)

// Interpolate replaces the variables in expr with their text in vals, as Grafana does before it sends a query.
// A name vals lacks is left as written, as Grafana leaves it (so "$1" in label_replace survives); a format
// other than the default is an error, as this does not implement them.
func Interpolate(expr string, vals map[string]string) (string, error) {
	var err error
	out := grafanaVar.ReplaceAllStringFunc(expr, func(m string) string {
		sub := grafanaVar.FindStringSubmatch(m)
		name, format := sub[1]+sub[2]+sub[4], sub[3]+sub[5]
		v, ok := vals[name]
		if !ok {
			return m
		}
		if format != "" && err == nil {
			err = fmt.Errorf("variable %s: format %q not supported", name, format)
		}
		return v
	})
	return out, err
}

// regexEscape escapes a value for a Prometheus regex matcher inside a double-quoted PromQL string, as
// Grafana's Prometheus data source does for multi-value variables: a backslash in the string, so that the
// regex sees one before the character.
func regexEscape(v string) string {
	var b strings.Builder
	for _, r := range v {
		switch r {
		case '\\':
			b.WriteString(`\\\\`)
		case '$', '^', '*', '{', '}', '[', ']', '\'', '+', '?', '.', '(', ')', '|':
			b.WriteString(`\\`)
			b.WriteRune(r)
		default:
			b.WriteRune(r)
		}
	}
	return b.String()
}

// formatAll is the text Grafana substitutes for a variable whose selection is vals: a single-value variable's
// value, or the regex of a multi-value or include-all one.
func formatAll(v Variable, vals []string) string {
	if !v.Multi && !v.IncludeAll {
		if len(vals) == 0 {
			return ""
		}
		return strings.NewReplacer(`\`, `\\`, `'`, `\\'`).Replace(vals[0])
	}
	esc := make([]string, len(vals))
	for i, s := range vals {
		esc[i] = regexEscape(s)
	}
	if len(esc) == 1 {
		return esc[0]
	}
	return "(" + strings.Join(esc, "|") + ")"
}

// labelValuesQuery matches label_values(label) and label_values(selector, label).
var labelValuesQuery = regexp.MustCompile(`^\s*label_values\(\s*(?:(.+?)\s*,\s*)?(\w+)\s*\)\s*$`)

// SelectAll resolves the dashboard's variables with "All" selected (the first value where a variable offers
// no "All" and takes one value), in order, each query variable's query interpolated with those before it and
// asked of p as Grafana's label_values() asks it. builtins (e.g. __rate_interval) are added as given. The
// result is what Interpolate needs.
func (p *Prometheus) SelectAll(ctx context.Context, d *Dashboard, builtins map[string]string) (map[string]string, error) {
	vals := map[string]string{}
	for k, v := range builtins {
		vals[k] = v
	}
	for _, v := range d.Variables {
		var opts []string
		switch v.Type {
		case "datasource":
			continue // names the data source, never part of a query
		case "query":
			q, err := Interpolate(v.Query, vals)
			if err != nil {
				return nil, err
			}
			m := labelValuesQuery.FindStringSubmatch(q)
			if m == nil {
				return nil, fmt.Errorf("variable %s: query %q: only label_values() is implemented", v.Name, q)
			}
			if opts, err = p.LabelValues(ctx, m[2], m[1]); err != nil {
				return nil, fmt.Errorf("variable %s: %s: %w", v.Name, q, err)
			}
			if len(opts) == 0 {
				return nil, fmt.Errorf("variable %s: %s has no values", v.Name, q)
			}
		case "custom", "interval":
			for _, o := range strings.Split(v.Query, ",") {
				opts = append(opts, strings.TrimSpace(o))
			}
		case "constant", "textbox":
			opts = []string{v.Query}
		default:
			return nil, fmt.Errorf("variable %s: type %q not implemented", v.Name, v.Type)
		}
		switch {
		case v.IncludeAll && v.AllValue != "":
			vals[v.Name] = v.AllValue // Grafana substitutes a custom all value as written
		case v.IncludeAll || v.Multi:
			vals[v.Name] = formatAll(v, opts)
		default:
			vals[v.Name] = formatAll(v, opts[:1])
		}
	}
	return vals, nil
}
