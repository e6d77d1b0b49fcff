package main

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"

	"github.com/gpu-agent/gpu-agent/agent"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/kube"
)

func run(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = runMain(context.Background(), args, &out, &errb)
	return code, out.String(), errb.String()
}

func TestSimList(t *testing.T) {
	code, out, _ := run(t, "sim", "list")
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	for _, p := range []string{"sim:dgx-a100", "sim:dgx-h100", "sim:dgx1-v100", "sim:pcie-8gpu", "sim:pcie-4gpu", "sim:two-islands-16"} {
		if !strings.Contains(out, p+" ") {
			t.Errorf("sim list lacks %s:\n%s", p, out)
		}
	}
}

func TestUsageErrors(t *testing.T) {
	tests := []struct {
		args []string
		code int
		want string
	}{
		{nil, 2, "Usage"},
		{[]string{"frobnicate"}, 2, `unknown command "frobnicate"`},
		{[]string{"run", "--no-such-flag"}, 2, "no-such-flag"},
		{[]string{"run", "--backend", "cuda"}, 2, `--backend "cuda"`},
		{[]string{"run", "--backend", "sim:nope"}, 1, "nope"},
		{[]string{"inventory", "--backend", "sim:dgx-a100,turbo"}, 2, `unknown sim option "turbo"`},
		{[]string{"inventory", "--backend", "sim:dgx-a100", "-o", "yaml"}, 2, `-o "yaml"`},
		{[]string{"run", "--backend", "sim:dgx-h100", "--dra", "--cdi-spec-dir="}, 2, "--dra needs --cdi-spec-dir"},
		{[]string{"run", "--backend", "sim:dgx-h100", "--sample-interval", "100ms"}, 2, "--sample-interval 100ms: at least 1s"},
		{[]string{"config", "validate"}, 2, "FILE"},
		{[]string{"config", "validate", "/nonexistent.yaml"}, 1, "nonexistent"},
	}
	for _, tt := range tests {
		t.Run(strings.Join(tt.args, " "), func(t *testing.T) {
			code, _, stderr := run(t, tt.args...)
			if code != tt.code || !strings.Contains(stderr, tt.want) {
				t.Errorf("exit %d stderr %q; want exit %d mentioning %q", code, stderr, tt.code, tt.want)
			}
		})
	}
}

func TestHelpOnEveryCommand(t *testing.T) {
	for _, args := range [][]string{{"--help"}, {"run", "--help"}, {"status", "--help"}, {"inventory", "--help"},
		{"config", "--help"}, {"sim", "--help"}, {"mig", "--help"}} {
		code, out, errOut := run(t, args...)
		if code != 0 || !strings.Contains(out+errOut, "Usage") {
			t.Errorf("%v: exit %d, output %q", args, code, out+errOut)
		}
	}
}

func TestInventoryJSON(t *testing.T) {
	code, out, stderr := run(t, "inventory", "--backend", "sim:dgx1-v100", "-o", "json")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	var inv gpu.Inventory
	if err := json.Unmarshal([]byte(out), &inv); err != nil {
		t.Fatal(err)
	}
	if len(inv.GPUs) != 8 || inv.Topology == nil || inv.Topology.Lanes(0, 3) != 2 {
		t.Errorf("inventory: %d GPUs, topology %+v", len(inv.GPUs), inv.Topology)
	}
}

func TestConfigValidate(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.yaml")
	os.WriteFile(good, []byte("version: v1\nnodes:\n  n1: special\nconfigs:\n  default: {}\n  special:\n    devicePlugin:\n      passDeviceSpecs: true\n"), 0o644)
	bad := filepath.Join(dir, "bad.yaml")
	os.WriteFile(bad, []byte("version: v1\nconfigs:\n  default:\n    allocation:\n      policy: random\n"), 0o644)

	code, out, stderr := run(t, "config", "validate", good, "--backend", "sim:pcie-4gpu", "--node-name", "n1")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	for _, want := range []string{`config "special"`, "nvidia.com/gpu", "4"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	code, _, stderr = run(t, "config", "validate", bad)
	if code != 1 || !strings.Contains(stderr, "allocation.policy") {
		t.Errorf("bad file: exit %d, stderr %q; want 1 naming allocation.policy", code, stderr)
	}
}

func TestWriteStatus(t *testing.T) {
	st := &agent.Status{
		Node: "n1", Backend: "sim:x",
		Config: agent.ConfigStatus{Source: "c.yaml", Name: "default", SelectedBy: "default", Error: "configs.default.x: unknown field (line 3)"},
		GPUs:   gpu.Show([]gpu.GPU{{Index: 0, UUID: "GPU-1", Name: "A100", MemoryBytes: 40 << 30, NUMANode: 3, MIGCapable: true}}),
		Resource: []agent.ResourceState{{Name: "nvidia.com/gpu", Devices: []agent.DeviceState{
			{ID: "GPU-1", Healthy: false, Reason: "XID 79", NUMANode: 3, HeldBy: "ml/trainer (main)"}}}},
		Registrations: []agent.Registration{{Resource: "nvidia.com/gpu", LastError: "kubelet.sock absent"}},
		MIG:           []agent.MIGState{{GPU: 0, Want: "3g.40gb x2", Phase: "pending", Reason: "held by ml/trainer"}},
		Sharing: []agent.SharingState{{Device: "GPU-2", GPU: 1, Resource: "nvidia.com/gpu.mps", Mode: "mps", Replicas: 4,
			ActiveThreadPercentage: "25", PinnedMemoryLimit: "0=10240M", Holders: []string{"GPU-2::0 by ml/a (main)"}}},
		Cordon: &agent.CordonStatus{GPUs: []agent.CordonedGPU{{Index: 0, UUID: "GPU-1", As: "0"}}, Unknown: []string{"GPU-typo"}},
	}
	var b bytes.Buffer
	if err := writeStatus(&b, st); err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"threads 25%, memory 0=10240M", "GPU-2::0 by ml/a (main)", "pending", "held by ml/trainer", "ml/trainer (main)", "unknown field (line 3)", "config default stays in force", "40 GiB", "unhealthy: XID 79", "not registered: kubelet.sock absent",
		"CORDONED (gpu-agent.io/cordon lists 0)", "names no GPU of this node, ignored: GPU-typo"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("status lacks %q:\n%s", want, b.String())
		}
	}
}

// fakeKubelet is the kubelet's registration service on kubelet.sock.
type fakeKubelet struct {
	pluginapi.UnimplementedRegistrationServer
	mu   sync.Mutex
	reqs []*pluginapi.RegisterRequest
	srv  *grpc.Server
}

func (k *fakeKubelet) Register(_ context.Context, r *pluginapi.RegisterRequest) (*pluginapi.Empty, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.reqs = append(k.reqs, r)
	return &pluginapi.Empty{}, nil
}

func (k *fakeKubelet) registered() []string {
	k.mu.Lock()
	defer k.mu.Unlock()
	var out []string
	for _, r := range k.reqs {
		out = append(out, r.ResourceName)
	}
	return out
}

func startFakeKubelet(t *testing.T, dir string) *fakeKubelet {
	t.Helper()
	ln, err := net.Listen("unix", filepath.Join(dir, "kubelet.sock"))
	if err != nil {
		t.Fatal(err)
	}
	k := &fakeKubelet{srv: grpc.NewServer()}
	pluginapi.RegisterRegistrationServer(k.srv, k)
	go k.srv.Serve(ln)
	t.Cleanup(k.srv.Stop)
	return k
}

// TestRunBinarySIGTERM runs the real binary on a simulated node against a
// kubelet double: it registers nvidia.com/gpu, serves /status, /readyz and
// /metrics, and on SIGTERM removes its sockets and exits 0.
// unreachableKubeconfig writes a kubeconfig whose API server refuses
// every connection.
func unreachableKubeconfig(t *testing.T, dir string) string {
	t.Helper()
	path := filepath.Join(dir, "kubeconfig")
	err := os.WriteFile(path, []byte(`apiVersion: v1
kind: Config
clusters: [{name: down, cluster: {server: "https://127.0.0.1:1", insecure-skip-tls-verify: true}}]
users: [{name: agent, user: {token: t}}]
contexts: [{name: down, context: {cluster: down, user: agent}}]
current-context: down
`), 0o600)
	if err != nil {
		t.Fatal(err)
	}
	return path
}

// The binary serves, gets ready and ends cleanly on SIGTERM, standalone and
// as a DRA driver whose API server cannot be reached (the driver's first
// ResourceSlice publish then waits for it, and nothing else may).
func TestRunBinarySIGTERM(t *testing.T) {
	bin := agentBinary(t)
	for _, tt := range []struct {
		name string
		args func(t *testing.T, dir string) []string
		// status checks /status once the agent is ready.
		status func(t *testing.T, st *agent.Status)
	}{
		{name: "standalone", args: func(*testing.T, string) []string { return nil }, status: func(t *testing.T, st *agent.Status) {
			if st.Cluster.API != kube.APIStandalone || st.DRA != nil {
				t.Errorf("status: cluster %+v, DRA %+v; want standalone, no DRA", st.Cluster, st.DRA)
			}
			if st.Build == nil || st.Build.Version != testVersion {
				t.Errorf("status: build %+v, want version %s as linked", st.Build, testVersion)
			}
		}},
		{name: "DRA, API server down", args: func(t *testing.T, dir string) []string {
			registry := filepath.Join(dir, "plugins_registry")
			if err := os.Mkdir(registry, 0o755); err != nil {
				t.Fatal(err)
			}
			return []string{"--kubeconfig", unreachableKubeconfig(t, dir), "--dra", "--cdi-spec-dir", filepath.Join(dir, "cdi"),
				"--dra-plugin-dir", filepath.Join(dir, "dra"), "--kubelet-registry-dir", registry}
		}, status: func(t *testing.T, st *agent.Status) {
			// The pool is planned; the slices wait for the API server, and
			// /status says so.
			if st.DRA == nil || len(st.DRA.Devices) != 4 || st.DRA.Slices == nil || st.DRA.Slices.Generation != 0 ||
				st.DRA.Slices.WaitingForAPI.IsZero() {
				t.Errorf("status DRA %+v; want 4 devices, slices waiting for the API server", st.DRA)
			}
		}},
	} {
		t.Run(tt.name, func(t *testing.T) { runBinaryUntilSIGTERM(t, bin, tt.args, tt.status) })
	}
}

func runBinaryUntilSIGTERM(t *testing.T, bin string, extra func(t *testing.T, dir string) []string, status func(*testing.T, *agent.Status)) {
	dir, err := os.MkdirTemp("", "ga")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	pluginDir := filepath.Join(dir, "dp")
	os.Mkdir(pluginDir, 0o755)
	kubelet := startFakeKubelet(t, pluginDir)

	ln, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := ln.Addr().String()
	ln.Close()
	args := append([]string{"run", "--backend", "sim:pcie-4gpu", "--device-plugin-dir", pluginDir,
		"--listen", addr, "--state-dir", filepath.Join(dir, "state"), "--node-name", "n1"}, extra(t, dir)...)
	cmd := exec.Command(bin, args...)
	var logs bytes.Buffer
	cmd.Stderr = &logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		if t.Failed() {
			t.Logf("agent log:\n%s", logs.String())
		}
	})

	deadline := time.Now().Add(10 * time.Second)
	// A listener nobody serves accepts and then says nothing.
	probe := &http.Client{Timeout: 2 * time.Second}
	for {
		resp, err := probe.Get("http://" + addr + "/readyz")
		if err == nil {
			resp.Body.Close()
			if resp.StatusCode == http.StatusOK {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz never became ready (registered: %v)", kubelet.registered())
		}
		time.Sleep(50 * time.Millisecond)
	}
	if got := kubelet.registered(); len(got) != 1 || got[0] != "nvidia.com/gpu" {
		t.Fatalf("registered %v, want [nvidia.com/gpu]", got)
	}
	status(t, waitStatus(t, addr, "served", func(*agent.Status) bool { return true }))
	code, out, stderr := run(t, "status", "--addr", addr)
	if code != 0 || !regexp.MustCompile(`nvidia.com/gpu +4 +4 +registered 20`).MatchString(out) {
		t.Errorf("status: exit %d\n%s%s", code, out, stderr)
	}
	// The holders section, from the binary's own /holders: no pod holds a GPU here.
	if !regexp.MustCompile(`(?m)^Holders: (none \(sampled 20|not sampled yet)`).MatchString(out) {
		t.Errorf("status: no holders section:\n%s", out)
	}
	resp, err := http.Get("http://" + addr + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	var mb bytes.Buffer
	mb.ReadFrom(resp.Body)
	resp.Body.Close()
	if !regexp.MustCompile(`(?m)^gpu_agent_build_info\{commit="` + builtCommit + `",goversion="go1\.[^"]+",version="` + testVersion + `"\} 1$`).MatchString(mb.String()) {
		t.Errorf("metrics lack the build info:\n%s", grepLines(mb.String(), "gpu_agent_build_info"))
	}
	if !strings.Contains(mb.String(), `gpu_agent_devices{health="healthy",resource="nvidia.com/gpu"} 4`) {
		t.Errorf("metrics lack the device gauge:\n%s", grepLines(mb.String(), "gpu_agent_"))
	}
	// Ready means scrapeable: the first scrape has every GPU's DCGM series.
	if n := strings.Count(mb.String(), "\nDCGM_FI_DEV_GPU_TEMP{"); n != 4 {
		t.Errorf("first scrape after /readyz: %d DCGM_FI_DEV_GPU_TEMP series, want 4:\n%s", n, grepLines(mb.String(), "DCGM_FI_DEV_GPU_TEMP"))
	}
	socks, _ := filepath.Glob(filepath.Join(pluginDir, "gpu-agent-*.sock"))
	if len(socks) != 1 {
		t.Fatalf("plugin sockets %v, want one", socks)
	}

	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("agent did not exit within 10s of SIGTERM")
	}
	socks, _ = filepath.Glob(filepath.Join(pluginDir, "gpu-agent-*.sock"))
	if len(socks) != 0 {
		t.Errorf("sockets left after SIGTERM: %v", socks)
	}
	if _, err := os.Stat(filepath.Join(pluginDir, "kubelet.sock")); err != nil {
		t.Errorf("the kubelet's socket must be left alone: %v", err)
	}
}

func grepLines(s, substr string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, substr) {
			out = append(out, l)
		}
	}
	return fmt.Sprint(strings.Join(out, "\n"))
}

// TestConfigDocExample keeps the config example of docs/config.md valid
// and doing what the page says it does.
func TestConfigDocExample(t *testing.T) {
	doc, err := os.ReadFile("../../docs/config.md")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(doc), "```yaml\n")
	example, _, ok2 := strings.Cut(rest, "```")
	if !ok || !ok2 {
		t.Fatal("docs/config.md has no yaml example")
	}
	file := filepath.Join(t.TempDir(), "example.yaml")
	os.WriteFile(file, []byte(example), 0o644)
	code, out, stderr := run(t, "config", "validate", file, "--backend", "sim:dgx-a100")
	if code != 0 {
		t.Fatalf("docs/config.md example: exit %d: %s", code, stderr)
	}
	for _, want := range []string{"nvidia.com/gpu         4", "nvidia.com/gpu.shared  16"} {
		if !strings.Contains(out, want) {
			t.Errorf("docs/config.md example output lacks %q:\n%s", want, out)
		}
	}
}

func TestConfigValidateMIGMixedTimeSliced(t *testing.T) {
	code, out, stderr := run(t, "config", "validate", "testdata/mig-mixed-timesliced.yaml", "--backend", "sim:dgx-h100-mig")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	// 8 GPUs x 7 1g.10gb instances x 4 replicas; the GPUs themselves are not offered whole.
	if !strings.Contains(out, "nvidia.com/mig-1g.10gb  224") || strings.Contains(out, "nvidia.com/gpu ") {
		t.Errorf("output:\n%s", out)
	}
}

func TestMIGPlan(t *testing.T) {
	code, out, stderr := run(t, "mig", "plan", "--config", "testdata/mig-balanced-h100.yaml", "--backend", "sim:dgx-h100-mig")
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	// From 7x 1g.10gb: the two 1g instances the layout can keep stay, five go.
	if n := strings.Count(out, "planned, 7 steps, 5 instances destroyed"); n != 8 {
		t.Errorf("want 8 GPUs planned with 5 destroys each:\n%s", out)
	}
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	os.WriteFile(bad, []byte("version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n      devices:\n      - devices: all\n        mig-enabled: true\n        mig-devices: {\"3g.40gb\": 3}\n"), 0o644)
	code, _, stderr = run(t, "mig", "plan", "--config", bad, "--backend", "sim:dgx-h100")
	if code != 1 || !strings.Contains(stderr, "gpus 0, 1, 2, 3, 4, 5, 6, 7: MIG layout does not fit") || strings.Count(stderr, "does not fit") != 1 {
		t.Errorf("impossible layout: exit %d, stderr %q; want 1 naming the GPUs once", code, stderr)
	}
}

func TestConfigValidateRejectsImpossibleMIGLayout(t *testing.T) {
	bad := filepath.Join(t.TempDir(), "bad.yaml")
	// A100-40GB has no 3g.40gb profile.
	os.WriteFile(bad, []byte("version: v1\nconfigs:\n  default:\n    mig:\n      strategy: mixed\n      devices:\n      - devices: all\n        mig-enabled: true\n        mig-devices: {\"3g.40gb\": 1}\n"), 0o644)
	code, _, stderr := run(t, "config", "validate", bad, "--backend", "sim:dgx-a100")
	if code != 1 || !strings.Contains(stderr, "MIG layout does not fit") || !strings.Contains(stderr, "3g.40gb") {
		t.Errorf("exit %d, stderr %q; want 1 naming the layout problem", code, stderr)
	}
	code, out, stderr := run(t, "config", "validate", "testdata/mig-balanced-h100.yaml", "--backend", "sim:dgx-h100")
	if code != 0 || !strings.Contains(out, "planned, 5 steps, 0 instances destroyed") {
		t.Errorf("good layout: exit %d\n%s%s", code, out, stderr)
	}
}

// The status table says what is served while a config error stands, as
// /status does (issue 23, defect 11: it said "serving the last good config"
// while the JSON said the built-in default, and "since 0001-01-01").
func TestWriteStatusConfigError(t *testing.T) {
	since := time.Date(2026, 11, 25, 10, 0, 0, 0, time.UTC)
	served := []agent.ResourceState{{Name: "nvidia.com/gpu"}}
	for _, tc := range []struct {
		cfg      agent.ConfigStatus
		resource []agent.ResourceState
		want     string
	}{
		{agent.ConfigStatus{Name: agent.BuiltInConfigName, Error: "bad", ErrorSince: since, Serving: agent.BuiltInConfigName}, served,
			"bad (since 2026-11-25T10:00:00Z; serving the built-in default)"},
		{agent.ConfigStatus{Name: "new", Error: "layout", ErrorSince: since, Serving: "old"}, served,
			"layout (since 2026-11-25T10:00:00Z; serving old, the last config that fitted)"},
		{agent.ConfigStatus{Name: "cur", Error: "MIG apply failed"}, served, "MIG apply failed (config cur stays in force)"},
		{agent.ConfigStatus{Error: "bad", ErrorSince: since}, nil, "bad (since 2026-11-25T10:00:00Z; nothing served until a config applies)"},
	} {
		var b bytes.Buffer
		if err := writeStatus(&b, &agent.Status{Config: tc.cfg, Resource: tc.resource}); err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(b.String(), "Config error:  "+tc.want+"\n") {
			t.Errorf("status lacks %q:\n%s", tc.want, b.String())
		}
	}
}

// TestMetricsDocNamesOwnMetrics keeps docs/metrics.md naming every
// gpu_agent_* series the agent's packages declare.
func TestMetricsDocNamesOwnMetrics(t *testing.T) {
	doc, err := os.ReadFile("../../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	section := string(doc)
	name := regexp.MustCompile(`"(gpu_agent_[a-z_]+)"`)
	seen := 0
	for _, dir := range []string{"../../agent", "../../health", "../../telemetry", "../../podresources", "../../plugin", "../../dra", "../../kube", "../../mps", "."} {
		files, err := filepath.Glob(filepath.Join(dir, "*.go"))
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range files {
			if strings.HasSuffix(f, "_test.go") {
				continue
			}
			src, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range name.FindAllStringSubmatch(string(src), -1) {
				seen++
				if !strings.Contains(section, "`"+m[1]) {
					t.Errorf("%s (declared in %s) is not in docs/metrics.md", m[1], f)
				}
			}
		}
	}
	if seen < 20 {
		t.Errorf("found %d gpu_agent_* names in the source; the search is broken", seen)
	}
}
