package deploy

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// fakeKubelet accepts device plugin registrations, so the agent's /readyz can
// turn ready the way it does on a node.
type fakeKubelet struct {
	pluginapi.UnimplementedRegistrationServer
	registered chan string
}

func (k *fakeKubelet) Register(_ context.Context, r *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	k.registered <- r.ResourceName
	return &pluginapi.Empty{}, nil
}

// TestDaemonSetRunsAgent starts the real agent with the base DaemonSet's args
// and env, each hostPath mount rebased under a temp dir and the ConfigMap
// written where it is mounted, on a simulated DGX A100; then probes it like
// the kubelet and scrapes it like Prometheus. Short sockets matter: unix socket
// paths are limited to 108 bytes, so the temp root is kept short.
func TestDaemonSetRunsAgent(t *testing.T) {
	o, _ := loadManifests(t)
	ds := o.DaemonSets[0]
	c := ds.Spec.Template.Spec.Containers[0]

	root, err := os.MkdirTemp("", "gad")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(root) })
	// rebase maps a container path to where this test puts it.
	mounts := map[string]string{}
	for _, m := range c.VolumeMounts {
		mounts[m.MountPath] = filepath.Join(root, m.Name)
		if err := os.MkdirAll(mounts[m.MountPath], 0o755); err != nil {
			t.Fatal(err)
		}
	}
	rebase := func(p string) string {
		for mp, dir := range mounts {
			if p == mp || strings.HasPrefix(p, mp+"/") {
				return dir + strings.TrimPrefix(p, mp)
			}
		}
		t.Fatalf("path %s is outside every volume mount: it would not exist in the container", p)
		return ""
	}
	cfgDir := rebase("/etc/gpu-agent")
	if err := os.WriteFile(filepath.Join(cfgDir, "config.yaml"), []byte(o.ConfigMaps[0].Data["config.yaml"]), 0o644); err != nil {
		t.Fatal(err)
	}

	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	var args []string
	for _, a := range c.Args {
		name, val, ok := strings.Cut(a, "=")
		switch {
		case !ok:
			args = append(args, a)
		case name == "--listen":
			// The pod has its own network namespace; here port 9400 may be taken.
			args = append(args, name+"="+addr)
		case name == "--configmap":
			// A ConfigMap's name, not a path; without an API server here
			// the agent serves the mounted file (and says so).
			args = append(args, a)
		case name == "--mps-binary" && !strings.HasPrefix(val, "/"):
			args = append(args, a) // a program name, looked up on PATH
		case name == "--mps-shm-dir" && val == "/dev/shm":
			// The container's own /dev/shm; here a directory of the test.
			args = append(args, name+"="+filepath.Join(root, "shm"))
		default:
			args = append(args, name+"="+rebase(val))
		}
	}
	env := []string{"GPU_AGENT_BACKEND=sim:dgx-a100"}
	for _, e := range c.Env {
		switch {
		case e.Name == "NODE_NAME" && e.ValueFrom != nil:
			env = append(env, "NODE_NAME=gpu-node-1")
		case e.Name == "POD_NAMESPACE" && e.ValueFrom != nil:
			env = append(env, "POD_NAMESPACE=gpu-agent")
		case e.ValueFrom == nil:
			env = append(env, e.Name+"="+e.Value)
		default:
			t.Fatalf("env %s: unsupported source %+v", e.Name, e.ValueFrom)
		}
	}

	sock := filepath.Join(flagDir(t, args, "--device-plugin-dir"), "kubelet.sock")
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	kubelet := &fakeKubelet{registered: make(chan string, 64)}
	srv := grpc.NewServer()
	pluginapi.RegisterRegistrationServer(srv, kubelet)
	go srv.Serve(ln)
	t.Cleanup(srv.Stop)

	ctx, cancel := context.WithCancel(context.Background())
	cmd := exec.CommandContext(ctx, agentBin, args...)
	cmd.Env = env
	logs := &strings.Builder{}
	cmd.Stdout, cmd.Stderr = logs, logs
	cmd.Cancel = func() error { return cmd.Process.Signal(os.Interrupt) }
	cmd.WaitDelay = 10 * time.Second
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cancel()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("agent log:\n%s", logs.String())
		}
	})

	base := "http://" + addr
	waitStatus(t, base+"/healthz", 200)
	waitStatus(t, base+"/readyz", 200)
	select {
	case r := <-kubelet.registered:
		if r != "nvidia.com/gpu" {
			t.Errorf("registered %q, want nvidia.com/gpu", r)
		}
	default:
		t.Error("ready without registering with the kubelet")
	}
	var st struct {
		Backend string `json:"backend"`
	}
	getJSON(t, base+"/status", &st)
	if st.Backend != "sim:dgx-a100" {
		t.Errorf("/status backend %q, want sim:dgx-a100", st.Backend)
	}
	// A fatal XID makes the XID counter appear, so the dashboard check sees it
	// in the scrape. The health watcher subscribes to NVML events on its own
	// schedule after start and an event before that is lost, as on hardware;
	// so inject until it is counted.
	deadline := time.Now().Add(20 * time.Second)
	var metrics string
	for {
		resp, err := http.Post(base+"/sim/xid", "application/json", strings.NewReader(`{"gpu":0,"xid":79}`))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("POST /sim/xid: %s", resp.Status)
		}
		time.Sleep(500 * time.Millisecond)
		metrics = get(t, base+"/metrics")
		if strings.Contains(metrics, "gpu_agent_xid_events_total{") || time.Now().After(deadline) {
			break
		}
	}
	if !strings.Contains(metrics, `gpu_agent_xid_events_total{UUID=`) {
		t.Error("no gpu_agent_xid_events_total after an injected XID")
	}
	checkDashboard(t, metrics)
}

// flagDir is the value of a path flag in args, or its directory for a socket.
func flagDir(t *testing.T, args []string, flag string) string {
	t.Helper()
	v := flagValue(args, flag)
	if v == "" {
		t.Fatalf("no %s in %v", flag, args)
	}
	return v
}

func get(t *testing.T, url string) string {
	t.Helper()
	resp, err := http.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func getJSON(t *testing.T, url string, v any) {
	t.Helper()
	if err := json.Unmarshal([]byte(get(t, url)), v); err != nil {
		t.Fatalf("%s: %v", url, err)
	}
}

// waitStatus polls url until it answers code, as a kubelet probe would.
func waitStatus(t *testing.T, url string, code int) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	last := ""
	for time.Now().Before(deadline) {
		resp, err := http.Get(url)
		if err == nil {
			b, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if resp.StatusCode == code {
				return
			}
			last = fmt.Sprintf("%d %s", resp.StatusCode, b)
		} else {
			last = err.Error()
		}
		time.Sleep(100 * time.Millisecond)
	}
	t.Fatalf("%s did not answer %d within 30s (last: %s)", url, code, last)
}

var reMetricName = regexp.MustCompile(`\b(DCGM_FI_[A-Z_]+|gpu_agent_[a-z_]+)\b`)

// checkDashboard asserts that every metric the Grafana dashboard queries is one
// the agent exports: present in this scrape, or (for series that only appear
// with allocations or config errors) declared by name in the agent's source.
func checkDashboard(t *testing.T, metrics string) {
	t.Helper()
	data, err := os.ReadFile(repoPath("deploy", "grafana", "gpu-agent.json"))
	if err != nil {
		t.Fatal(err)
	}
	var dash struct {
		Panels []struct {
			Title   string `json:"title"`
			Targets []struct {
				Expr string `json:"expr"`
			} `json:"targets"`
		} `json:"panels"`
	}
	if err := json.Unmarshal(data, &dash); err != nil {
		t.Fatalf("dashboard: %v", err)
	}
	if len(dash.Panels) < 10 {
		t.Fatalf("dashboard has %d panels", len(dash.Panels))
	}
	source := agentSource(t)
	exported := func(name string) bool {
		if regexp.MustCompile(`(?m)^` + name + `[{ ]`).MatchString(metrics) {
			return true
		}
		family := strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(name, "_bucket"), "_sum"), "_count")
		return strings.Contains(source, `"`+family+`"`)
	}
	dcgm, agentOwn := 0, 0
	for _, p := range dash.Panels {
		for _, tg := range p.Targets {
			names := reMetricName.FindAllString(tg.Expr, -1)
			if len(names) == 0 {
				t.Errorf("panel %q: query %q names no gpu-agent metric", p.Title, tg.Expr)
			}
			for _, n := range names {
				if !exported(n) {
					t.Errorf("panel %q: %s is not exported by gpu-agent", p.Title, n)
				}
				if strings.HasPrefix(n, "DCGM_") {
					dcgm++
					// This node is an A100: the profiling fields (GPM, Hopper and newer) are absent
					// here, as they must be; TestGrafanaDashboards checks them on H100 nodes.
					absent := strings.HasPrefix(n, "DCGM_FI_PROF_") && !regexp.MustCompile(`(?m)^`+n+`[{ ]`).MatchString(metrics)
					if !absent && !regexp.MustCompile(`(?m)^`+n+`\{[^}]*Hostname="`).MatchString(metrics) {
						t.Errorf("panel %q filters %s by Hostname, which the scrape does not carry", p.Title, n)
					}
				} else {
					agentOwn++
				}
			}
		}
	}
	if dcgm == 0 || agentOwn == 0 {
		t.Errorf("dashboard uses %d DCGM and %d gpu_agent queries; want both", dcgm, agentOwn)
	}
}

// agentSource is the agent's non-test Go source, where metric names are declared.
func agentSource(t *testing.T) string {
	t.Helper()
	var b strings.Builder
	for _, dir := range []string{"agent", "health", "telemetry", "podresources", "plugin", "cmd/gpu-agent"} {
		files, _ := filepath.Glob(repoPath(dir, "*.go"))
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			data, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			b.Write(data)
		}
	}
	return b.String()
}
