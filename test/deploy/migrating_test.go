package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// Opt-in checks of docs/migrating.md against NVIDIA's charts, read from
// checkouts the user names (NVIDIA's files are never committed here):
//
//	GPU_OPERATOR_REPO=/path/to/gpu-operator NVIDIA_DEVICE_PLUGIN_REPO=/path/to/k8s-device-plugin \
//	  go test -run TestMigratingDoc -v ./test/deploy
const (
	gpuOperatorRepoEnv  = "GPU_OPERATOR_REPO"
	devicePluginRepoEnv = "NVIDIA_DEVICE_PLUGIN_REPO"
)

// docCommand is one shell command of the doc, its continuation lines
// joined.
func docCommands(t *testing.T) []string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(repoRoot, "docs", "migrating.md"))
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	cur := ""
	for _, line := range strings.Split(string(b), "\n") {
		line = strings.TrimSpace(line)
		if s, ok := strings.CutSuffix(line, "\\"); ok {
			cur += s + " "
			continue
		}
		out = append(out, cur+line)
		cur = ""
	}
	return out
}

var reSet = regexp.MustCompile(`--set ([A-Za-z0-9_.]+)=`)

// setKeys are the --set keys of the doc's helm commands for chart.
func setKeys(t *testing.T, chart string) []string {
	var keys []string
	for _, c := range docCommands(t) {
		if !strings.HasPrefix(c, "helm ") || !strings.Contains(c, chart) {
			continue
		}
		for _, m := range reSet.FindAllStringSubmatch(c, -1) {
			keys = append(keys, m[1])
		}
	}
	return keys
}

// hasValue reports whether the dotted path names a value of values.yaml.
func hasValue(values map[string]any, path string) bool {
	var cur any = values
	for _, k := range strings.Split(path, ".") {
		m, ok := cur.(map[string]any)
		if !ok {
			return false
		}
		if cur, ok = m[k]; !ok {
			return false
		}
	}
	return true
}

func readValues(t *testing.T, path string) map[string]any {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var v map[string]any
	if err := yaml.Unmarshal(b, &v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	return v
}

// grepRepo reports whether s occurs in the files of repo under dir.
func grepRepo(t *testing.T, repo, s string, dirs ...string) bool {
	t.Helper()
	cmd := exec.Command("grep", append([]string{"-rqF", "--", s}, dirs...)...)
	cmd.Dir = repo
	return cmd.Run() == nil
}

// TestMigratingDoc checks that every GPU Operator value the migration guide
// sets exists in the chart's values.yaml and is used by its templates, that
// every per-node deploy label it names selects one of the operator's
// DaemonSets, and (with a device plugin checkout) that the standalone
// chart's values exist.
func TestMigratingDoc(t *testing.T) {
	op := os.Getenv(gpuOperatorRepoEnv)
	if op == "" {
		t.Skip(gpuOperatorRepoEnv + " names no checkout of NVIDIA's gpu-operator")
	}
	keys := setKeys(t, "nvidia/gpu-operator")
	if len(keys) < 4 {
		t.Fatalf("the doc's GPU Operator command sets %v, want the four components", keys)
	}
	values := readValues(t, filepath.Join(op, "deployments", "gpu-operator", "values.yaml"))
	for _, k := range keys {
		if !hasValue(values, k) {
			t.Errorf("--set %s: no such value in the GPU Operator chart", k)
		}
		if !grepRepo(t, op, ".Values."+k, "deployments/gpu-operator/templates") {
			t.Errorf("--set %s: no template of the GPU Operator chart reads it", k)
		}
	}
	b, err := os.ReadFile(filepath.Join(repoRoot, "docs", "migrating.md"))
	if err != nil {
		t.Fatal(err)
	}
	doc := string(b)
	for _, k := range []string{"driver.enabled", "toolkit.enabled", "devicePlugin.config.name", "migManager.config.name", "mig.strategy"} {
		if strings.Contains(doc, "`"+k+"`") && !hasValue(values, k) {
			t.Errorf("the doc names %s: no such value in the GPU Operator chart", k)
		}
	}
	labels := regexp.MustCompile(`nvidia\.com/gpu\.deploy\.[a-z-]+`).FindAllString(doc, -1)
	if len(labels) == 0 {
		t.Fatal("the doc names no nvidia.com/gpu.deploy.* label")
	}
	for _, l := range labels {
		if l == "nvidia.com/gpu.deploy.operands" {
			if !grepRepo(t, op, `"`+l+`"`, "controllers") {
				t.Errorf("%s: not in the operator's controllers", l)
			}
			continue
		}
		if !grepRepo(t, op, l+`: "true"`, "assets") {
			t.Errorf("%s: no DaemonSet of the operator selects nodes by it", l)
		}
	}

	dp := os.Getenv(devicePluginRepoEnv)
	if dp == "" {
		t.Log(devicePluginRepoEnv + " not set: the standalone device plugin chart's values are not checked")
		return
	}
	dpValues := readValues(t, filepath.Join(dp, "deployments", "helm", "nvidia-device-plugin", "values.yaml"))
	dpKeys := setKeys(t, "nvdp/nvidia-device-plugin")
	if len(dpKeys) == 0 {
		t.Fatal("the doc sets no value of the device plugin chart")
	}
	for _, k := range append(dpKeys, "affinity") {
		if !hasValue(dpValues, k) {
			t.Errorf("%s: no such value in the nvidia-device-plugin chart", k)
		}
	}
}
