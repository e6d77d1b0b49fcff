//go:build e2e

package e2e

import (
	"errors"
	"fmt"
	"math"
	"os"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/gpu-agent/gpu-agent/test/e2e/harness"
)

const (
	// ownDashboard is the dashboard gpu-agent ships.
	ownDashboard = "../../deploy/grafana/gpu-agent.json"
	// dcgmFixture lists the queries of NVIDIA's dashboard for dcgm-exporter.
	dcgmFixture = "testdata/dcgm-dashboard-queries.yaml"
	// dcgmPublishedDefault is where this project keeps NVIDIA's published dashboard file (not in the repository);
	// E2E_DCGM_DASHBOARD names another copy.
	dcgmPublishedDefault = "/work/shared/compat-artefacts/dcgm-exporter/dcgm-exporter-dashboard.json"
	// scrapeInterval is short so that the two samples rate() needs come within seconds.
	scrapeInterval = time.Second
)

// grafanaBuiltins are the global variables Grafana sets for a panel: $__rate_interval is
// max($__interval + scrape interval, 4 × scrape interval) with the data source's default scrape interval of
// 15 s, the step Grafana picks for a 15-minute range on a panel of ordinary width.
var grafanaBuiltins = map[string]string{
	"__interval": "15s", "__interval_ms": "15000", "__rate_interval": "1m", "__range": "15m", "__range_s": "900",
}

// statPanels are the panel types that show one number: they must show one on any node, before anything has
// happened on it.
var statPanels = []string{"stat", "gauge", "singlestat", "bargauge"}

// utilOnMIG is why the utilization-rate panels are empty on a node whose GPUs are all in MIG mode, with
// dcgm-exporter as with gpu-agent.
// noMPS: the MPS panel's series are there only for MPS clients; TestHolderMPS checks them.
const noMPS = "no MPS client on this node (gpu_agent_holder_mps_* are checked by TestHolderMPS)"

const utilOnMIG = "DCGM_FI_DEV_GPU_UTIL and DCGM_FI_DEV_MEM_COPY_UTIL do not exist for MIG-enabled GPUs: NVML " +
	"refuses GetUtilizationRates with MIG on, and DCGM does not support them either (NVIDIA/dcgm-exporter#216, #430: " +
	"use DCGM_FI_PROF_GR_ENGINE_ACTIVE)"

// dashboardNode is a simulated node in use: a config with a time-sliced resource, a pod holding a device, and
// (after the quiet check) an application XID, so that every panel has something to chart.
type dashboardNode struct {
	backend, config string
	// resource is what the pod asks for; offered, how many of it the kubelet lists.
	resource string
	offered  int
	// noData: dashboard and panel → why it charts nothing on this node for a reason outside gpu-agent. The test
	// checks that it indeed does not, so a stale entry is noticed.
	noData map[string]string
}

var dashboardNodes = []dashboardNode{
	{
		backend: "sim:dgx-h100",
		config: `version: v1
configs:
  default:
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/gpu
          rename: nvidia.com/gpu.shared
          devices: [4, 5, 6, 7]
          replicas: 4
`,
		resource: gpuResource, offered: 4,
		noData: map[string]string{
			"gpu-agent.json/MPS clients: SM use against their thread limit": noMPS,
		},
	},
	{
		backend: "sim:dgx-h100-mig",
		config: `version: v1
configs:
  default:
    mig:
      strategy: mixed
    sharing:
      timeSlicing:
        resources:
        - name: nvidia.com/mig-1g.10gb
          replicas: 2
`,
		resource: "nvidia.com/mig-1g.10gb", offered: 7 * 8 * 2,
		noData: map[string]string{
			"gpu-agent.json/GPU utilization":                                utilOnMIG,
			"gpu-agent.json/Memory copy utilization":                        utilOnMIG,
			"gpu-agent.json/GPU utilization by pod":                         utilOnMIG,
			"dcgm-exporter fixture/GPU Utilization":                         utilOnMIG,
			"dcgm-exporter published/GPU Utilization":                       utilOnMIG,
			"gpu-agent.json/MPS clients: SM use against their thread limit": noMPS,
		},
	},
}

// namedDashboard is a dashboard under test; skip says why it is not there.
type namedDashboard struct {
	name string
	d    *harness.Dashboard
	skip string
}

func loadDashboards(t *testing.T) []namedDashboard {
	t.Helper()
	own, err := harness.ReadGrafanaDashboard(ownDashboard)
	if err != nil {
		t.Fatal(err)
	}
	fixture, err := harness.ReadDashboardFixture(dcgmFixture)
	if err != nil {
		t.Fatal(err)
	}
	out := []namedDashboard{{name: "gpu-agent.json", d: own}, {name: "dcgm-exporter fixture", d: fixture}}
	// The published file is optional where this project's copy is absent, never where E2E_DCGM_DASHBOARD names it.
	path, named := os.LookupEnv("E2E_DCGM_DASHBOARD")
	if !named {
		path = dcgmPublishedDefault
	}
	published, err := harness.ReadGrafanaDashboard(path)
	switch {
	case !named && errors.Is(err, os.ErrNotExist):
		out = append(out, namedDashboard{name: "dcgm-exporter published", skip: err.Error()})
	case err != nil:
		t.Fatal(err)
	default:
		out = append(out, namedDashboard{name: "dcgm-exporter published", d: published})
	}
	for _, nd := range out {
		if nd.d != nil && len(nd.d.Queries) == 0 {
			t.Fatalf("%s: no panel queries", nd.name)
		}
	}
	return out
}

// TestGrafanaDashboards renders gpu-agent's own Grafana dashboard and NVIDIA's dashboard for dcgm-exporter from a
// real Prometheus scraping the agent, as Grafana would with "All" selected: every panel query must return
// series (not only NaN) that carry the labels its legend names. Stat and gauge panels are checked first on the
// quiet node, then every panel once an application XID has happened and its counter has two samples.
func TestGrafanaDashboards(t *testing.T) {
	promBin, err := harness.PrometheusBinary()
	if err != nil {
		t.Fatal(err)
	}
	dashboards := loadDashboards(t)
	t.Run("fixture matches the published dashboard", func(t *testing.T) {
		published := dashboards[2]
		if published.d == nil {
			t.Skip(published.skip)
		}
		fixture := dashboards[1].d
		if published.d.Title != fixture.Title || !reflect.DeepEqual(published.d.Variables, fixture.Variables) {
			t.Errorf("%s: title %q, variables %+v; the fixture has %q, %+v", published.name, published.d.Title,
				published.d.Variables, fixture.Title, fixture.Variables)
		}
		if !slices.Equal(published.d.Queries, fixture.Queries) {
			t.Errorf("%s has the queries\n%+v\nthe fixture %s lists\n%+v", published.name, published.d.Queries,
				dcgmFixture, fixture.Queries)
		}
	})
	for _, node := range dashboardNodes {
		t.Run(strings.TrimPrefix(node.backend, "sim:"), func(t *testing.T) {
			began := time.Now()
			prom := startDashboardNode(t, node, promBin)
			for _, nd := range dashboards {
				t.Run("quiet/"+nd.name, func(t *testing.T) {
					if nd.d == nil {
						t.Skip(nd.skip)
					}
					checkPanels(t, prom, nd, node, func(q harness.Query) bool { return slices.Contains(statPanels, q.PanelType) })
				})
			}

			e := prom.env
			simPost(t, e, "/sim/xid", `{"gpu":0,"xid":13}`) // in NVIDIA's default application-error list: GPU 0 stays healthy
			ctx := stepCtx(t)
			// The holder series come from the holder tracker's pass, every 10 s: the first after the pod held its
			// device.
			for _, sel := range []string{"gpu_agent_gpu_xid_events_total", "gpu_agent_allocated_devices", "gpu_agent_holder_idle_seconds"} {
				if err := prom.WaitSamples(ctx, sel, 2); err != nil {
					t.Fatal(err)
				}
			}
			// The XID panels count the first event of a GPU: the per-GPU counter is there at 0 before it (a
			// per-XID series born at 1 would give increase() nothing).
			xids, err := prom.Query(ctx, "sum(increase(gpu_agent_gpu_xid_events_total[1h]))")
			if err != nil || len(xids) != 1 || len(xids[0].Values) == 0 || xids[0].Values[len(xids[0].Values)-1] <= 0 {
				t.Errorf("XID errors (1h) after one XID: %+v (%v), want more than 0", xids, err)
			}
			for _, nd := range dashboards {
				t.Run(nd.name, func(t *testing.T) {
					if nd.d == nil {
						t.Skip(nd.skip)
					}
					checkPanels(t, prom, nd, node, func(harness.Query) bool { return true })
				})
			}
			t.Logf("MEASURED: %s: node, Prometheus and every dashboard checked in %v", node.backend, time.Since(began).Round(time.Millisecond))
		})
	}
}

// dashboardProm is the Prometheus of a dashboard node, with its Env.
type dashboardProm struct {
	*harness.Prometheus
	env *harness.Env
}

// startDashboardNode starts the node with its config, Prometheus scraping the agent, and a pod holding one of
// node.resource; it returns once Prometheus has a sample of the target.
func startDashboardNode(t *testing.T, node dashboardNode, promBin string) dashboardProm {
	t.Helper()
	e := harness.Start(t, harness.Config{
		Kubelet: inputs.kubelet, Agent: inputs.agent, Images: inputs.images, LedgerPath: inputs.ledger,
		Backend: node.backend, NodeName: nodeName, AgentConfig: node.config,
	})
	t.Logf("e2e env in %s", e.RunDir())
	ctx := stepCtx(t)
	// Prometheus first: its discovery hands the scrape loop its targets only after a few seconds, which the
	// node's setup then overlaps.
	promStarted := time.Now()
	p, err := e.StartPrometheus(ctx, promBin, scrapeInterval)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitAllocatable(ctx, node.resource, node.offered); err != nil {
		t.Fatal(err)
	}
	const pod = "dashboard-user"
	if err := e.AddPod(harness.PodSpec{Name: pod, Limits: map[string]int64{node.resource: 1}}); err != nil {
		t.Fatal(err)
	}
	if _, err := e.WaitRunning(ctx, pod); err != nil {
		t.Fatal(err)
	}
	// An XID sent before the agent registered for events is lost, as with real NVML.
	if _, err := e.WaitAgentStatus(ctx, "health events registered on every GPU", func(st *harness.AgentStatus) bool {
		return len(st.HealthEvents) == nodeGPUs
	}); err != nil {
		t.Fatal(err)
	}
	if err := p.WaitSamples(ctx, fmt.Sprintf(`up{job=%q}`, harness.PrometheusJob), 1); err != nil {
		t.Fatal(err)
	}
	t.Logf("MEASURED: Prometheus had its first sample of the agent %v after its start", time.Since(promStarted).Round(time.Millisecond))
	return dashboardProm{Prometheus: p, env: e}
}

var legendLabel = regexp.MustCompile(`\{\{\s*(\w+)\s*\}\}`)

// checkPanels evaluates the dashboard's queries that want selects, as Grafana would over the last 15 minutes,
// and fails for each that errs or returns no data (nothing, or only NaN), or whose legend names a label a series
// lacks. Each panel's result is logged, so the run lists what was evaluated.
func checkPanels(t *testing.T, prom dashboardProm, nd namedDashboard, node dashboardNode, want func(harness.Query) bool) {
	t.Helper()
	ctx := stepCtx(t)
	vals, err := prom.SelectAll(ctx, nd.d, grafanaBuiltins)
	if err != nil {
		t.Fatalf("%s: template variables: %v", nd.name, err)
	}
	end := time.Now()
	start := end.Add(-15 * time.Minute)
	for _, q := range nd.d.Queries {
		if !want(q) {
			continue
		}
		expr, err := harness.Interpolate(q.Expr, vals)
		if err != nil {
			t.Errorf("panel %q: %s: %v", q.Panel, q.Expr, err)
			continue
		}
		series, err := prom.QueryRange(ctx, expr, start, end, 15*time.Second)
		if err != nil {
			t.Errorf("panel %q: %s: %v", q.Panel, expr, err)
			continue
		}
		n := numberSeries(series)
		why, expectEmpty := node.noData[nd.name+"/"+q.Panel]
		switch {
		case expectEmpty && n > 0:
			t.Errorf("panel %q: %s: %d series, but the test expects none on %s (%s): drop that entry", q.Panel, expr, n, node.backend, why)
		case expectEmpty:
			t.Logf("panel %q (%s): no data, as with dcgm-exporter: %s", q.Panel, q.PanelType, why)
		case n == 0:
			t.Errorf("panel %q: %s: no data (%d series, none with a number)", q.Panel, expr, len(series))
		default:
			t.Logf("panel %q (%s): %d series", q.Panel, q.PanelType, n)
		}
		for _, m := range legendLabel.FindAllStringSubmatch(q.Legend, -1) {
			for _, s := range series {
				if s.Labels[m[1]] == "" {
					t.Errorf("panel %q: %s: legend %q names %s, which the series %v lacks", q.Panel, expr, q.Legend, m[1], s.Labels)
					break
				}
			}
		}
	}
}

// numberSeries counts the series with at least one value that is a number.
func numberSeries(series []harness.Series) int {
	n := 0
	for _, s := range series {
		if slices.ContainsFunc(s.Values, func(v float64) bool { return !math.IsNaN(v) }) {
			n++
		}
	}
	return n
}
