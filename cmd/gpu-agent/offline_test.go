package main

import (
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/NVIDIA/go-nvml/pkg/nvml"

	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// The A100 layout of deploy/examples, as a plain config.
const a100Balanced = `version: v1
configs:
  default:
    mig:
      strategy: mixed
      devices:
      - device-filter: ["0x20B010DE"]
        devices: all
        mig-enabled: true
        mig-devices: {"1g.5gb": 2, "2g.10gb": 1, "3g.20gb": 1}
`

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// wantLines asserts that out has a line matching each pattern, spaces in a
// pattern standing for any run of them (tables are aligned).
func wantLines(t *testing.T, out string, patterns ...string) {
	t.Helper()
	for _, p := range patterns {
		re := regexp.MustCompile(`(?m)^` + strings.ReplaceAll(regexp.QuoteMeta(p), " ", `\s+`) + `(\s|$)`)
		if !re.MatchString(out) {
			t.Errorf("output has no line %q:\n%s", p, out)
		}
	}
}

// Without --backend, the three offline tools look at the same node: the
// one `make run` simulates.
func TestOfflineToolsShareDefaultBackend(t *testing.T) {
	t.Setenv("GPU_AGENT_BACKEND", "")
	cfg := writeFile(t, "a100.yaml", a100Balanced)
	for _, args := range [][]string{
		{"config", "validate", cfg},
		{"mig", "plan", "--config", cfg},
		{"inventory"},
	} {
		code, out, stderr := run(t, args...)
		if code != 0 || !strings.Contains(out, defaultOfflineBackend) || !strings.Contains(out, "A100-SXM4-40GB") {
			t.Errorf("%v: exit %d, want 0 naming %s and its A100s:\n%s%s", args, code, defaultOfflineBackend, out, stderr)
		}
	}
}

// A layout none of whose entries applies to any GPU of the node is an
// error that names the node's models, in both tools.
func TestNoLayoutEntryApplies(t *testing.T) {
	cfg := writeFile(t, "a100.yaml", a100Balanced)
	for _, args := range [][]string{
		{"config", "validate", cfg, "--backend", "sim:dgx-h100"},
		{"mig", "plan", "--config", cfg, "--backend", "sim:dgx-h100"},
	} {
		code, _, stderr := run(t, args...)
		if code != 1 || !strings.Contains(stderr, "configs.default.mig.devices: no entry applies to any GPU of this node") ||
			!strings.Contains(stderr, "NVIDIA H100 80GB HBM3, device-filter 0x233010DE") {
			t.Errorf("%v: exit %d, stderr %q; want 1 naming the H100's device-filter", args, code, stderr)
		}
	}
	// Some GPUs left alone is a layout doing what it says.
	half := strings.Replace(a100Balanced, "devices: all", "devices: [0, 1]", 1)
	code, out, stderr := run(t, "mig", "plan", "--config", writeFile(t, "half.yaml", half))
	if code != 0 || !strings.Contains(out, "GPU 7 (NVIDIA A100-SXM4-40GB): no layout entry applies; left as it is") {
		t.Errorf("layout for GPUs 0-1: exit %d\n%s%s", code, out, stderr)
	}
}

// config validate offers what the node has once the layout is applied, on
// a copy: a state file another process holds is read, never changed.
func TestValidateShowsNodeAfterLayout(t *testing.T) {
	state := filepath.Join(t.TempDir(), "sim-state.json")
	held, err := sim.New("dgx-a100", sim.WithStateFile(state))
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	held.Init()
	defer held.Shutdown()
	before, err := os.ReadFile(state)
	if err != nil {
		t.Fatal(err)
	}
	cfg := writeFile(t, "a100.yaml", a100Balanced)
	code, out, stderr := run(t, "config", "validate", cfg, "--backend", "sim:dgx-a100,state="+state)
	if code != 0 {
		t.Fatalf("exit %d: %s", code, stderr)
	}
	if !strings.Contains(out, "once the layout is applied, it would offer:") {
		t.Errorf("output does not say the resources are after the layout:\n%s", out)
	}
	wantLines(t, out, "nvidia.com/mig-1g.5gb 16", "nvidia.com/mig-2g.10gb 8", "nvidia.com/mig-3g.20gb 8")
	if strings.Contains(out, "nvidia.com/gpu ") {
		t.Errorf("whole GPUs offered after every GPU was split:\n%s", out)
	}
	if after, _ := os.ReadFile(state); string(after) != string(before) {
		t.Error("config validate changed the state file of the node it looked at")
	}
	d, r := held.DeviceGetHandleByIndex(0)
	if r != nvml.SUCCESS {
		t.Fatal(r)
	}
	if cur, pending, _ := d.GetMigMode(); cur != nvml.DEVICE_MIG_DISABLE || pending != nvml.DEVICE_MIG_DISABLE {
		t.Errorf("config validate set MIG mode %d (pending %d) on the node itself", cur, pending)
	}
}

// --addr looks at a copy of the simulated node a running agent serves,
// with its MIG instances as they are there.
func TestOfflineToolsAddr(t *testing.T) {
	node, err := sim.New("dgx-h100-mig") // 7x 1g.10gb per GPU
	if err != nil {
		t.Fatal(err)
	}
	node.Init()
	defer node.Shutdown()
	mux := http.NewServeMux()
	mux.Handle("/sim/", node.Handler())
	agent := httptest.NewServer(mux)
	defer agent.Close()
	plain := httptest.NewServer(http.NotFoundHandler()) // an agent on nvml
	defer plain.Close()

	code, out, stderr := run(t, "mig", "plan", "--config", "testdata/mig-balanced-h100.yaml", "--addr", agent.URL)
	if code != 0 || strings.Count(out, "planned, 7 steps, 5 instances destroyed") != 8 {
		t.Errorf("mig plan --addr: exit %d, want 8 GPUs losing 5 of their 7 instances:\n%s%s", code, out, stderr)
	}
	code, out, stderr = run(t, "config", "validate", "testdata/mig-balanced-h100.yaml", "--addr", strings.TrimPrefix(agent.URL, "http://"))
	if code != 0 || !strings.Contains(out, "sim:dgx-h100-mig at ") {
		t.Fatalf("config validate --addr: exit %d\n%s%s", code, out, stderr)
	}
	wantLines(t, out, "nvidia.com/mig-1g.10gb 16", "nvidia.com/mig-2g.20gb 8", "nvidia.com/mig-3g.40gb 8")
	code, out, _ = run(t, "inventory", "--addr", agent.URL)
	if code != 0 || strings.Count(out, "MIG-") != 56 {
		t.Errorf("inventory --addr: exit %d, want the node's 56 MIG devices:\n%s", code, out)
	}
	// The running node is as it was.
	if n := migDevices(t, node, 0); n != 7 {
		t.Errorf("GPU 0 of the running node has %d MIG devices after the tools, want 7", n)
	}

	for _, tc := range []struct {
		args []string
		code int
		want string
	}{
		{[]string{"mig", "plan", "--config", "testdata/mig-balanced-h100.yaml", "--addr", plain.URL}, 1, "runs no simulated node"},
		{[]string{"config", "validate", "testdata/mig-balanced-h100.yaml", "--addr", agent.URL, "--backend", "sim:dgx-a100"}, 2, "--addr and --backend"},
	} {
		code, _, stderr := run(t, tc.args...)
		if code != tc.code || !strings.Contains(stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want %d saying %q", tc.args, code, stderr, tc.code, tc.want)
		}
	}
}

func migDevices(t *testing.T, n *sim.Node, gpu int) int {
	t.Helper()
	d, r := n.DeviceGetHandleByIndex(gpu)
	if r != nvml.SUCCESS {
		t.Fatal(r)
	}
	count := 0
	max, _ := d.GetMaxMigDeviceCount()
	for i := range max {
		if _, r := d.GetMigDeviceHandleByIndex(i); r == nvml.SUCCESS {
			count++
		}
	}
	return count
}

// config validate and mig plan read a ConfigMap manifest as the agent reads
// the ConfigMap: every data key a config.
func TestConfigToolsReadManifest(t *testing.T) {
	manifest := writeFile(t, "cm.yaml", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: gpu-agent-config}\ndata:\n  a100.yaml: |\n"+
		indent(a100Balanced, "    ")+"  shared.yaml: |\n    version: v1\n    configs:\n      shared:\n        sharing:\n          timeSlicing:\n            resources:\n            - {name: nvidia.com/gpu, replicas: 2}\n")
	code, out, stderr := run(t, "config", "validate", manifest, "--labels", "gpu-agent.io/config=shared")
	if code != 0 || !strings.Contains(out, "ConfigMap manifest, keys a100.yaml, shared.yaml") || !strings.Contains(out, `uses config "shared"`) {
		t.Errorf("validate manifest: exit %d\n%s%s", code, out, stderr)
	}
	wantLines(t, out, "nvidia.com/gpu 16")
	code, out, stderr = run(t, "mig", "plan", "--config", manifest)
	if code != 0 || strings.Count(out, "planned, 5 steps") != 8 {
		t.Errorf("mig plan manifest: exit %d\n%s%s", code, out, stderr)
	}
	// A directory is a mounted ConfigMap, as --config reads it.
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "a100.yaml"), []byte(a100Balanced), 0o644)
	os.WriteFile(filepath.Join(dir, "plain.yaml"), []byte("version: v1\nconfigs:\n  plain: {}\n"), 0o644)
	code, out, stderr = run(t, "config", "validate", dir, "--labels", "gpu-agent.io/config=plain")
	if code != 0 || !strings.Contains(out, "ConfigMap directory") || !strings.Contains(out, `uses config "plain"`) {
		t.Errorf("validate directory: exit %d\n%s%s", code, out, stderr)
	}
	wantLines(t, out, "nvidia.com/gpu 8")
	bad := writeFile(t, "bad.yaml", "apiVersion: v1\nkind: ConfigMap\ndata:\n  c.yaml:\n    version: v1\n")
	code, _, stderr = run(t, "config", "validate", bad)
	if code != 1 || !strings.Contains(stderr, "data.c.yaml: expected a config as a string") {
		t.Errorf("bad manifest: exit %d, stderr %q", code, stderr)
	}
}

func indent(s, by string) string {
	return by + strings.ReplaceAll(strings.TrimSuffix(s, "\n"), "\n", "\n"+by) + "\n"
}

// Every command refuses arguments it does not take instead of ignoring
// them, and says how it is used when asked.
func TestExtraArgumentsRefused(t *testing.T) {
	cfg := writeFile(t, "c.yaml", "version: v1\nconfigs:\n  default: {}\n")
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"status", "extra"}, "unexpected arguments: extra"},
		{[]string{"inventory", "extra"}, "unexpected arguments: extra"},
		{[]string{"run", "extra"}, "unexpected arguments: extra"},
		{[]string{"mps-host", "extra"}, "unexpected arguments: extra"},
		{[]string{"node-cleanup", "extra"}, "unexpected arguments: extra"},
		{[]string{"mig", "plan", "--config", cfg, "extra"}, "unexpected arguments: extra"},
		{[]string{"config", "validate", cfg, "extra"}, "unexpected arguments: extra"},
		{[]string{"sim", "list", "extra"}, "want: sim list"},
	} {
		code, _, stderr := run(t, tc.args...)
		if code != 2 || !strings.Contains(stderr, tc.want) {
			t.Errorf("%v: exit %d, stderr %q; want 2 saying %q", tc.args, code, stderr, tc.want)
		}
	}
	for _, args := range [][]string{{"sim", "list", "--help"}, {"help", "sim"}} {
		code, out, stderr := run(t, args...)
		if code != 0 || !strings.Contains(out, "Usage: gpu-agent sim list") || stderr != "" {
			t.Errorf("%v: exit %d, %q %q", args, code, out, stderr)
		}
	}
	code, out, stderr := run(t, "help", "mig", "plan")
	if code != 0 || !strings.Contains(out+stderr, "Usage: gpu-agent mig plan --config FILE") {
		t.Errorf("help mig plan: exit %d, %q %q", code, out, stderr)
	}
	code, _, stderr = run(t, "help", "nope")
	if code != 2 || !strings.Contains(stderr, `unknown command "nope"`) {
		t.Errorf("help nope: exit %d, %q", code, stderr)
	}
}

// A node a config selection fails for is named once.
func TestValidateNamesNodeOnce(t *testing.T) {
	cfg := writeFile(t, "c.yaml", "version: v1\nconfigs:\n  default: {}\n")
	code, _, stderr := run(t, "config", "validate", cfg, "--node-name", "vm", "--labels", "gpu-agent.io/config=nope")
	if code != 1 || strings.Count(stderr, "node vm") != 1 || !strings.Contains(stderr, "gpu-agent.io/config=nope names no config") {
		t.Errorf("exit %d, stderr %q; want 1 naming node vm once", code, stderr)
	}
}

// config validate says what the node's ResourceSlices would cost with the DRA
// driver on: whole GPUs publish no counters, MIG on demand every profile at
// every placement on counters, an allow-list only its profiles.
func TestValidateShowsDRAFootprint(t *testing.T) {
	for _, tt := range []struct {
		name, config, want string
		counters           bool
	}{
		{"whole GPUs", "version: v1\nconfigs:\n  default: {}\n", "would hold 8 devices and no counters, in 1 slices", false},
		{"on demand", "version: v1\nconfigs:\n  default:\n    dra:\n      migOnDemand: {enabled: true}\n",
			"would hold 160 devices (152 of them MIG devices made on demand) drawing 368 times on 8 counter sets of 56 counters", true},
		{"allow-list", "version: v1\nconfigs:\n  default:\n    dra:\n      migOnDemand: {enabled: true, profiles: [3g.40gb]}\n",
			"would hold 24 devices (16 of them MIG devices made on demand)", true},
	} {
		t.Run(tt.name, func(t *testing.T) {
			cfg := writeFile(t, "c.yaml", tt.config)
			code, out, stderr := run(t, "config", "validate", cfg, "--backend", "sim:dgx-h100")
			if code != 0 {
				t.Fatalf("exit %d: %s", code, stderr)
			}
			if !strings.Contains(out, tt.want) {
				t.Errorf("output does not say %q:\n%s", tt.want, out)
			}
			if got := strings.Contains(out, `docs/dra-devices.md, "Scale"`); got != tt.counters {
				t.Errorf("points to the scale docs: %v, want %v:\n%s", got, tt.counters, out)
			}
		})
	}
}

// The lean MIG example publishes the balanced layout's devices with fewer
// attributes: the same 32 devices, in fewer bytes. The agent's plan carries
// the config's dra.migDeviceAttributes to the slices.
func TestValidateLeanMIGExample(t *testing.T) {
	kib := map[string]float64{}
	for _, example := range []string{"mig-h100-balanced.yaml", "mig-h100-balanced-lean.yaml"} {
		code, out, stderr := run(t, "config", "validate", filepath.Join("..", "..", "deploy", "examples", example), "--backend", "sim:dgx-h100")
		m := regexp.MustCompile(`would hold 32 devices and no counters, in 1 slices of ([0-9.]+) KiB`).FindStringSubmatch(out)
		if code != 0 || m == nil {
			t.Fatalf("%s: exit %d, want 0 with 32 devices:\n%s%s", example, code, out, stderr)
		}
		kib[example], _ = strconv.ParseFloat(m[1], 64)
	}
	if full, lean := kib["mig-h100-balanced.yaml"], kib["mig-h100-balanced-lean.yaml"]; lean > 0.8*full {
		t.Errorf("lean example's slices %.1f KiB, the full one's %.1f: want at most 80%%", lean, full)
	}
}

// config validate points to dra.migDeviceAttributes where a node publishes
// more MIG devices than an 8-GPU node has GPUs with NVIDIA's attributes,
// and not where it keeps fewer, nor for MIG on demand's spare layout (4).
func TestValidateSuggestsLeanMIGDevices(t *testing.T) {
	for _, tt := range []struct {
		example string
		hint    bool
	}{
		{"mig-h100-balanced.yaml", true},
		{"mig-h100-all-1g.yaml", true},
		{"mig-h100-balanced-lean.yaml", false},
		{"mig-h100-half-3g.yaml", false},
		{"dra-mig-on-demand.yaml", false},
	} {
		code, out, stderr := run(t, "config", "validate", filepath.Join("..", "..", "deploy", "examples", tt.example), "--backend", "sim:dgx-h100")
		if code != 0 {
			t.Fatalf("%s: exit %d:\n%s%s", tt.example, code, out, stderr)
		}
		if got := strings.Contains(out, "MIG devices with NVIDIA's attributes, each about 4.4 KB"); got != tt.hint {
			t.Errorf("%s: points to dra.migDeviceAttributes: %v, want %v:\n%s", tt.example, got, tt.hint, out)
		}
	}
}

// `sim list` prints sim:<profile>; pasted where README writes
// --backend sim:PROFILE it gives sim:sim:<profile>, which works too.
func TestBackendTakesSimListName(t *testing.T) {
	for _, spec := range []string{"sim:dgx-a100", "sim:sim:dgx-a100"} {
		ss, err := parseSimSpec(spec + ",mig-enabled")
		profile := ss.profile
		if err != nil || profile != "dgx-a100" {
			t.Errorf("parseSimSpec(%q) = %q, %v; want dgx-a100", spec, profile, err)
		}
	}
	code, out, stderr := run(t, "inventory", "--backend", "sim:sim:dgx-a100")
	if code != 0 || !strings.Contains(out, "A100") {
		t.Errorf("inventory --backend sim:sim:dgx-a100: exit %d\n%s%s", code, out, stderr)
	}
}

// Help writes flags as README does (--backend; a one-letter flag -o), says
// nothing of flags for a command without any, and --output is -o.
func TestHelpWritesFlagsAsREADME(t *testing.T) {
	_, _, help := run(t, "inventory", "--help")
	if !strings.Contains(help, "\n  --backend string\n") || !strings.Contains(help, "\n  -o string\n") || strings.Contains(help, "\n  -backend") {
		t.Errorf("inventory --help:\n%s", help)
	}
	if _, _, help := run(t, "version", "--help"); strings.Contains(help, "Flags:") {
		t.Errorf("version --help lists flags it does not have:\n%s", help)
	}
	code, out, stderr := run(t, "inventory", "--backend", "sim:dgx-a100", "--output", "json")
	if code != 0 || !strings.HasPrefix(strings.TrimSpace(out), "{") && !strings.HasPrefix(strings.TrimSpace(out), "[") {
		t.Errorf("inventory --output json: exit %d, %.80q %s", code, out, stderr)
	}
}

// Flags go before or after the arguments, for every subcommand.
func TestFlagsAfterArguments(t *testing.T) {
	fs := newFlagSet("cordon", "cordon", io.Discard)
	node := fs.String("node-name", "", "")
	if err := parseFlags(fs, []string{"0", "--node-name", "n1", "GPU-x", "--", "--not-a-flag"}); err != nil {
		t.Fatal(err)
	}
	if *node != "n1" || strings.Join(fs.Args(), " ") != "0 GPU-x --not-a-flag" {
		t.Errorf("node %q, args %q", *node, fs.Args())
	}
}

// A mig-parted file of layouts for several models, one of them (for the
// A100-40GB) asking for a profile the A100-40GB lacks.
const migPartedMixed = `version: v1
mig-configs:
  all-disabled:
  - devices: all
    mig-enabled: false
  five-1g-one-2g:
  - device-filter: ["0x20B010DE"]
    devices: all
    mig-enabled: true
    mig-devices:
      "1g.5gb": 5
      "4g.40gb": 1
  h100-3g:
  - device-filter: ["0x233010DE"]
    devices: all
    mig-enabled: true
    mig-devices: {"3g.40gb": 2}
`

// The planner's errors name the layout as its author wrote it, not the
// config the agent made of it (issue 32: "configs.default.mig").
func TestLayoutErrorNamesMigPartedEntry(t *testing.T) {
	cfg := writeFile(t, "mig.yaml", migPartedMixed)
	code, _, stderr := run(t, "config", "validate", cfg, "--labels", "nvidia.com/mig.config=five-1g-one-2g")
	want := "mig-configs.five-1g-one-2g[0].mig-devices: gpus 0, 1, 2, 3, 4, 5, 6, 7: MIG layout does not fit: profile 4g.40gb not offered"
	if code != 1 || !strings.Contains(stderr, want) || !strings.Contains(stderr, "(line 10)") || strings.Contains(stderr, "configs.default") {
		t.Errorf("exit %d, stderr %q; want 1 with %q at line 10", code, stderr, want)
	}
}

// Every named layout is planned on the node as the agent would with the
// node labelled nvidia.com/mig.config=<entry>, model by model: one that
// does not fit the model its device-filter names is an error, one for
// other models a warning (issue 32: an A100-40GB entry asking for 4g.40gb
// was "valid").
func TestValidateChecksEveryMigConfigsEntry(t *testing.T) {
	cfg := writeFile(t, "mig.yaml", migPartedMixed)
	code, out, stderr := run(t, "config", "validate", cfg)
	if code != 1 || strings.Contains(out, "valid (") {
		t.Errorf("exit %d, want 1 and no \"valid\":\n%s%s", code, out, stderr)
	}
	wantLines(t, out,
		"Its mig-configs on sim:dgx-a100, each as the node labelled nvidia.com/mig.config=<entry> would apply it:",
		" all-disabled: fits NVIDIA A100-SXM4-40GB (GPUs 0-7)",
		" five-1g-one-2g: does not fit NVIDIA A100-SXM4-40GB: mig-configs.five-1g-one-2g[0].mig-devices: gpus 0, 1, 2, 3, 4, 5, 6, 7: MIG layout does not fit: profile 4g.40gb not offered",
		" h100-3g: applies to no GPU of this node (entry [0]: device-filter 0x233010DE names another model; this node: NVIDIA A100-SXM4-40GB, device-filter 0x20B010DE)")
	if strings.Count(out, "4g.40gb not offered") != 1 {
		t.Errorf("the reason is not said once for the model:\n%s", out)
	}
	if !strings.Contains(stderr, "mig-configs entry five-1g-one-2g does not fit the NVIDIA A100-SXM4-40GB its device-filter names: mig-configs.five-1g-one-2g[0].mig-devices:") ||
		!strings.Contains(stderr, "(line 10)") {
		t.Errorf("stderr does not name the entry, its path and line:\n%s", stderr)
	}
	if !strings.Contains(stderr, "warning: "+cfg+": on sim:dgx-a100: mig-configs entry h100-3g fits no GPU model of this node (above); fine if it is meant for other nodes") {
		t.Errorf("no warning for the H100 entry:\n%s", stderr)
	}

	// On the H100s the A100 entry is the one for other nodes.
	code, out, stderr = run(t, "config", "validate", cfg, "--backend", "sim:dgx-h100")
	if code != 0 || !strings.Contains(out, "valid (mig-parted)") {
		t.Errorf("on H100s: exit %d, want 0:\n%s%s", code, out, stderr)
	}
	wantLines(t, out, " h100-3g: fits NVIDIA H100 80GB HBM3 (GPUs 0-7)",
		" five-1g-one-2g: applies to no GPU of this node (entry [0]: device-filter 0x20B010DE names another model; this node: NVIDIA H100 80GB HBM3, device-filter 0x233010DE)")
	if !strings.Contains(stderr, "mig-configs entry five-1g-one-2g fits no GPU model of this node") {
		t.Errorf("on H100s, no warning for the A100 entry:\n%s", stderr)
	}

	// An entry without a device-filter may be meant for other nodes: a
	// warning, on its model too.
	unfiltered := strings.Replace(migPartedMixed, `  - device-filter: ["0x20B010DE"]
    devices: all`, "  - devices: all", 1)
	code, out, stderr = run(t, "config", "validate", writeFile(t, "mig.yaml", unfiltered))
	if code != 0 || !strings.Contains(stderr, "2 mig-configs entries fit no GPU model of this node (above): five-1g-one-2g, h100-3g") {
		t.Errorf("unfiltered entry: exit %d, want 0 with a warning:\n%s%s", code, out, stderr)
	}

	// The mig-configs of gpu-agent's own format are checked alike, in a
	// ConfigMap directory too.
	own := "version: v1\nconfigs:\n  default: {}\n" + strings.TrimPrefix(migPartedMixed, "version: v1\n")
	dir := t.TempDir()
	os.WriteFile(filepath.Join(dir, "config.yaml"), []byte(own), 0o644)
	code, out, stderr = run(t, "config", "validate", dir)
	if code != 1 || !strings.Contains(out, " five-1g-one-2g: does not fit NVIDIA A100-SXM4-40GB: key config.yaml: mig-configs.five-1g-one-2g[0].mig-devices:") {
		t.Errorf("own format: exit %d, want 1:\n%s%s", code, out, stderr)
	}
}

// A layout whose entries enabling MIG are all for another model does
// nothing it is for on this node, even if an entry disabling MIG applies:
// refused like a layout no entry of which applies (issue 32: the H100
// half-3g example was valid on the A100s, the other H100 examples not).
func TestLayoutForAnotherModelRefused(t *testing.T) {
	for _, example := range []string{"mig-h100-half-3g.yaml", "mig-h100-balanced.yaml", "mig-h100-all-1g.yaml"} {
		code, out, stderr := run(t, "config", "validate", filepath.Join("..", "..", "deploy", "examples", example))
		if code != 1 || !strings.Contains(stderr, "device-filter 0x233010DE names another model") && !strings.Contains(stderr, "no entry applies to any GPU of this node") {
			t.Errorf("%s on the A100s: exit %d, want 1:\n%s%s", example, code, out, stderr)
		}
	}
	half := `version: v1
configs:
  default:
    mig:
      strategy: mixed
      devices:
      - device-filter: ["0x233010DE"]
        devices: [0, 1, 2, 3]
        mig-enabled: true
        mig-devices: {"3g.40gb": 2}
      - devices: [4, 5, 6, 7]
        mig-enabled: false
`
	code, _, stderr := run(t, "mig", "plan", "--config", writeFile(t, "half.yaml", half))
	want := "configs.default.mig.devices: no entry that enables MIG applies to any GPU of this node (entry [0]: device-filter 0x233010DE names another model; " +
		"this node: NVIDIA A100-SXM4-40GB, device-filter 0x20B010DE): it would only disable MIG on GPUs 4-7; check each entry's device-filter and devices (line 6)"
	if code != 1 || !strings.Contains(stderr, want) {
		t.Errorf("mig plan: exit %d, stderr %q; want 1 with %q", code, stderr, want)
	}
	// A layout for two models: the other model's entry is listed, not refused.
	both := strings.Replace(half, "      - devices: [4, 5, 6, 7]\n        mig-enabled: false\n",
		"      - device-filter: [\"0x20B010DE\"]\n        devices: all\n        mig-enabled: true\n        mig-devices: {\"3g.20gb\": 2}\n", 1)
	code, out, stderr := run(t, "config", "validate", writeFile(t, "both.yaml", both))
	if code != 0 || !strings.Contains(out, "configs.default.mig.devices[0]: applies to no GPU of this node (device-filter 0x233010DE names another model) (line 7)") {
		t.Errorf("two-model layout: exit %d, want 0 naming the H100 entry:\n%s%s", code, out, stderr)
	}
}

// A typo in a file of NVIDIA's format is a warning, as NVIDIA's plugin
// ignores it; --strict makes every warning fail, for CI (issue 32).
func TestValidateStrict(t *testing.T) {
	nvidia := writeFile(t, "nvidia.yaml", `version: v1
sharing:
  timeSlicing:
    renameByDefualt: true
    resources:
    - name: nvidia.com/gpu
      replicas: 4
`)
	code, out, stderr := run(t, "config", "validate", nvidia)
	if code != 0 || !strings.Contains(stderr, "warning: "+nvidia+": sharing.timeSlicing.renameByDefualt: unknown field") {
		t.Errorf("without --strict: exit %d, want 0 with a warning:\n%s%s", code, out, stderr)
	}
	for _, args := range [][]string{{"config", "validate", nvidia, "--strict"}, {"config", "validate", "--strict", nvidia}} {
		code, _, stderr = run(t, args...)
		if code != 1 || !strings.Contains(stderr, nvidia+": 1 warning, and --strict makes them errors") {
			t.Errorf("%v: exit %d, want 1:\n%s", args, code, stderr)
		}
	}
	// Warnings found on the node count too.
	code, _, stderr = run(t, "config", "validate", writeFile(t, "mig.yaml", strings.Replace(migPartedMixed, `"4g.40gb": 1`, `"2g.10gb": 1`, 1)), "--strict")
	if code != 1 || !strings.Contains(stderr, ": 2 warnings, and --strict makes them errors") {
		t.Errorf("mig-configs for other nodes: exit %d, want 1 counting 2 warnings:\n%s", code, stderr)
	}
	cfg := writeFile(t, "a100.yaml", a100Balanced)
	if code, out, stderr := run(t, "config", "validate", cfg, "--strict"); code != 0 {
		t.Errorf("no warnings: exit %d\n%s%s", code, out, stderr)
	}
}

// Every example config on every simulated node publishes at most 64 KiB of
// ResourceSlices (issue 28's goal for an 8-GPU node, here for every node),
// and only MIG on demand at every placement publishes counters: every
// other config keeps the scheduler's allocator off the counters' path on
// every node model. An example whose MIG layout names another model is
// refused there; each must pass on the models it is written for.
func TestFootprintEveryProfile(t *testing.T) {
	examples, err := filepath.Glob(filepath.Join("..", "..", "deploy", "examples", "*.yaml"))
	if err != nil || len(examples) == 0 {
		t.Fatalf("no examples: %v", err)
	}
	// mustPass: examples each model must accept (the rest may name another model's layout).
	mustPass := map[string][]string{
		"whole-gpus.yaml": nil, "time-slicing-x4.yaml": nil, "dra-mig-on-demand.yaml": nil,
		"dra-mig-on-demand-every-placement.yaml": nil,
		"mig-h100-balanced.yaml":                 {"dgx-h100", "dgx-h100-mig"},
		"mig-a100-balanced.yaml":                 {"dgx-a100"},
	}
	re := regexp.MustCompile(`would hold (\d+) devices.* in (\d+) slices of ([0-9.]+) KiB`)
	passed := map[string]int{}
	for _, p := range sim.Profiles() {
		for _, ex := range examples {
			name := filepath.Base(ex)
			code, out, stderr := run(t, "config", "validate", ex, "--backend", "sim:"+p.Name)
			if code != 0 {
				if models, ok := mustPass[name]; ok && (models == nil || slices.Contains(models, p.Name)) {
					t.Errorf("%s on %s: exit %d:\n%s%s", name, p.Name, code, out, stderr)
				}
				continue
			}
			passed[name]++
			m := re.FindStringSubmatch(out)
			if m == nil {
				t.Errorf("%s on %s: no DRA footprint in:\n%s", name, p.Name, out)
				continue
			}
			if kib, _ := strconv.ParseFloat(m[3], 64); kib > 64 {
				t.Errorf("%s on %s: %s devices in %s KiB of slices, want at most 64", name, p.Name, m[1], m[3])
			}
			counters := strings.Contains(out, "counter sets of")
			if counters && name != "dra-mig-on-demand-every-placement.yaml" {
				t.Errorf("%s on %s publishes counters:\n%s", name, p.Name, out)
			}
		}
	}
	for _, ex := range examples {
		if passed[filepath.Base(ex)] == 0 && !strings.HasPrefix(filepath.Base(ex), "node-") {
			t.Errorf("%s passed on no simulated node", filepath.Base(ex))
		}
	}
}

// claimsForCheck: a whole GPU, a MIG device by profile (NVIDIA's documented
// claim) as a template and as a pod's claim made from it, a MIG device by
// driverVersion (an attribute the lean example leaves out), more GPUs than a
// node has, a class nobody gave, and a request the API server would refuse.
const claimsForCheck = `apiVersion: v1
kind: List
items:
- apiVersion: resource.k8s.io/v1
  kind: ResourceClaim
  metadata: {name: one-gpu, namespace: default}
  spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]}}
- apiVersion: resource.k8s.io/v1
  kind: ResourceClaimTemplate
  metadata: {name: mig-small, namespace: ml}
  spec:
    spec:
      devices:
        requests:
        - name: mig
          exactly:
            deviceClassName: mig.nvidia.com
            selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}]
- apiVersion: resource.k8s.io/v1
  kind: ResourceClaim
  metadata: {name: pod-0-mig-x7k2p, namespace: ml, annotations: {resource.kubernetes.io/pod-claim-name: mig}}
  spec:
    devices:
      requests:
      - name: mig
        exactly:
          deviceClassName: mig.nvidia.com
          selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}]
- apiVersion: resource.k8s.io/v1
  kind: ResourceClaim
  metadata: {name: mig-by-driver, namespace: ml}
  spec:
    devices:
      requests:
      - name: mig
        exactly:
          deviceClassName: mig.nvidia.com
          selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].driverVersion.isGreaterThan(semver('500.0.0'))"}}]
- apiVersion: resource.k8s.io/v1
  kind: ResourceClaim
  metadata: {name: nine, namespace: default}
  spec: {devices: {requests: [{name: gpus, exactly: {deviceClassName: gpu.nvidia.com, count: 9}}]}}
- apiVersion: resource.k8s.io/v1
  kind: ResourceClaim
  metadata: {name: nic, namespace: default}
  spec: {devices: {requests: [{name: nic, exactly: {deviceClassName: nic.example.com}}]}}
- apiVersion: resource.k8s.io/v1
  kind: ResourceClaim
  metadata: {name: bare, namespace: default}
  spec: {devices: {requests: [{name: gpu}]}}
`

// config validate --claims allocates each claim on the node as the config
// would have it, with the scheduler's allocator and gpu-agent's classes: a
// claim that reads an attribute the lean MIG example leaves out is a
// warning there (and an error with --strict), and allocates with NVIDIA's
// attributes; a claim that does not fit a node is said so, not warned of; a
// class not given, or a claim the API server would refuse, is a warning on
// every node; a claim of a spec already checked is named beside it.
func TestValidateClaims(t *testing.T) {
	claims := writeFile(t, "claims.yaml", claimsForCheck)
	classes := filepath.Join("..", "..", "deploy", "manifests", "dra", "deviceclasses.yaml")
	example := func(name string) string { return filepath.Join("..", "..", "deploy", "examples", name) }
	const (
		nic  = `^  ResourceClaim default/nic: NOT CHECKED: DeviceClass nic.example.com not given`
		bare = `^  ResourceClaim default/bare: CANNOT BE EVALUATED here: the API server would refuse it: request gpu: want exactly one of exactly and firstAvailable$`
		same = ` \(and 1 with the same spec: ResourceClaim ml/pod-0-mig-x7k2p\)$`
	)
	for _, tt := range []struct {
		example  string
		lines    []string
		warnings []string
	}{
		{
			example: "whole-gpus.yaml",
			lines: []string{
				`^  ResourceClaim default/one-gpu: allocates gpu: gpu-0$`,
				`^  ResourceClaimTemplate ml/mig-small: does not fit this node` + same,
				`^  ResourceClaim ml/mig-by-driver: does not fit this node$`,
				`^  ResourceClaim default/nine: does not fit this node$`,
				nic, bare,
				`^  1 allocates, 4 do not fit this node, 1 cannot be evaluated, 1 not checked$`,
			},
			warnings: []string{"default/nic", "default/bare"},
		},
		{
			example: "mig-h100-balanced.yaml",
			lines: []string{
				`^  ResourceClaim default/one-gpu: does not fit this node$`,
				`^  ResourceClaimTemplate ml/mig-small: allocates mig: gpu-\d+-mig-\S+` + same,
				`^  ResourceClaim ml/mig-by-driver: allocates mig: gpu-\d+-mig-`,
				nic, bare,
				`^  3 allocate, 2 do not fit this node, 1 cannot be evaluated, 1 not checked$`,
			},
			warnings: []string{"default/nic", "default/bare"},
		},
		{
			example: "mig-h100-balanced-lean.yaml",
			lines: []string{
				`^  ResourceClaimTemplate ml/mig-small: allocates mig: gpu-\d+-mig-\S+` + same,
				`^  ResourceClaim ml/mig-by-driver: CANNOT BE EVALUATED here: .*no such key: driverVersion$`,
				nic, bare,
				`^  2 allocate, 2 do not fit this node, 2 cannot be evaluated, 1 not checked$`,
			},
			warnings: []string{"ml/mig-by-driver", "default/nic", "default/bare"},
		},
	} {
		t.Run(tt.example, func(t *testing.T) {
			code, out, stderr := run(t, "config", "validate", example(tt.example), "--backend", "sim:dgx-h100", "--claims", claims, "--claims", classes)
			if code != 0 {
				t.Fatalf("exit %d, want 0 (warnings only):\n%s%s", code, out, stderr)
			}
			head := `^Claims \(--claims: 7 claims, 2 DeviceClasses\), each allocated alone, by the kube-scheduler's allocator, on the node as the config would publish it:$`
			for _, l := range append([]string{head}, tt.lines...) {
				if !regexp.MustCompile(`(?m)` + l).MatchString(out) {
					t.Errorf("output has no line matching %s:\n%s", l, out)
				}
			}
			var warned []string
			for _, l := range strings.Split(strings.TrimSpace(stderr), "\n") {
				if m := regexp.MustCompile(`^warning: .*: on sim:dgx-h100: Resource\w+ (\S+) (cannot be evaluated|not checked)`).FindStringSubmatch(l); m != nil {
					warned = append(warned, m[1])
				}
			}
			if strings.Join(warned, ",") != strings.Join(tt.warnings, ",") {
				t.Errorf("warnings for %q, want %q:\n%s", warned, tt.warnings, stderr)
			}
			code, _, stderr = run(t, "config", "validate", example(tt.example), "--backend", "sim:dgx-h100", "--claims", claims, "--claims", classes, "--strict")
			if want := fmt.Sprintf(": %d warnings, and --strict makes them errors", len(tt.warnings)); code != 1 || !strings.Contains(stderr, want) {
				t.Errorf("--strict: exit %d, want 1 and %q:\n%s", code, want, stderr)
			}
		})
	}
}

// A DeviceClass given twice, differently, is said: the last one is used.
// A field of a later Kubernetes is not dropped silently: its claim is not
// checked, and the others are.
func TestValidateClaimsSaysWhatItDidNotCheck(t *testing.T) {
	in := writeFile(t, "claims.yaml", `apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.nvidia.com}
spec: {selectors: [{cel: {expression: "false"}}]}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: later, namespace: default}
spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com, derivedAttributes: [x]}}]}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: one-gpu, namespace: default}
spec: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]}}
`)
	classes := filepath.Join("..", "..", "deploy", "manifests", "dra", "deviceclasses.yaml")
	code, out, stderr := run(t, "config", "validate", filepath.Join("..", "..", "deploy", "examples", "whole-gpus.yaml"), "--backend", "sim:dgx-h100", "--claims", in, "--claims", classes)
	if code != 0 {
		t.Fatalf("exit %d:\n%s%s", code, out, stderr)
	}
	for _, l := range []string{
		`^  DeviceClass gpu.nvidia.com is given more than once with different specs: the last one given is used$`,
		`^  ResourceClaim default/later: NOT CHECKED: not read whole \(a field misspelt, of a later Kubernetes than this build's 1.36, or given twice\): spec: unknown field "devices.requests\[0\].exactly.derivedAttributes"$`,
		`^  ResourceClaim default/one-gpu: allocates gpu: gpu-0$`,
	} {
		if !regexp.MustCompile(`(?m)` + l).MatchString(out) {
			t.Errorf("output has no line matching %s:\n%s", l, out)
		}
	}
}

// A --claims file that cannot be read stops config validate before it looks
// at the node, naming the file's document and object.
func TestValidateClaimsRefusesBadFile(t *testing.T) {
	bad := writeFile(t, "bad.yaml", strings.Replace(claimsForCheck, "requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]", "requests: 3", 1))
	code, out, stderr := run(t, "config", "validate", filepath.Join("..", "..", "deploy", "examples", "whole-gpus.yaml"), "--backend", "sim:dgx-h100", "--claims", bad)
	if code != 1 || !strings.Contains(stderr, `--claims: `+bad+`: document 1: List item 0: ResourceClaim default/one-gpu: spec: `) || out != "" {
		t.Errorf("exit %d, want 1 naming the object:\n%s%s", code, out, stderr)
	}
}

// --claims - reads standard input, which can be read once.
func TestReadClaimFilesStdin(t *testing.T) {
	objs, err := readClaimFiles([]string{"-"}, strings.NewReader(claimsForCheck))
	if err != nil || len(objs.Claims) != 7 {
		t.Fatalf("read %d claims, error %v; want 7", len(objs.Claims), err)
	}
	if _, err := readClaimFiles([]string{"-", "-"}, strings.NewReader(claimsForCheck)); err == nil || !strings.Contains(err.Error(), "standard input given twice") {
		t.Errorf("error %v, want standard input given twice", err)
	}
}
