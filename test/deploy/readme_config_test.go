package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"
)

// exampleProfiles is the simulated node each example is for: README's
// PROFILE, picked as a user picks it from `gpu-agent sim list`.
var exampleProfiles = map[string]string{
	"cdi.yaml":                               "dgx-a100",
	"dra-mig-on-demand.yaml":                 "dgx-h100",
	"dra-mig-on-demand-every-placement.yaml": "dgx-h100",
	"mig-a100-all-1g.yaml":                   "dgx-a100",
	"mig-a100-balanced.yaml":                 "dgx-a100",
	"mig-a100-half-3g.yaml":                  "dgx-a100",
	"mig-h100-all-1g.yaml":                   "dgx-h100",
	"mig-h100-balanced.yaml":                 "dgx-h100",
	"mig-h100-balanced-lean.yaml":            "dgx-h100",
	"mig-h100-half-3g.yaml":                  "dgx-h100",
	"mps-x2.yaml":                            "dgx-a100",
	"node-override.yaml":                     "dgx-a100",
	"time-slicing-x4.yaml":                   "dgx-a100",
	"whole-gpus.yaml":                        "dgx-a100",
}

// readmeInstallCommands are the command lines of the ```sh blocks in
// README's Install section, comments dropped.
func readmeInstallCommands(t *testing.T) []string {
	t.Helper()
	cmds := readmeCommands(t, "## Install\n")
	if len(cmds) < 4 {
		t.Fatalf("README's Install section has %d commands in sh blocks, want the config workflow's", len(cmds))
	}
	return cmds
}

// readmeCommands are the command lines of the ```sh blocks in the README
// section whose heading starts with heading, in order, comments dropped (a
// line that is only a comment, continuing the one above, drops out).
func readmeCommands(t *testing.T, heading string) []string {
	t.Helper()
	var cmds []string
	for _, line := range readmeShLines(t, heading) {
		if line, _, _ = strings.Cut(line, "#"); strings.TrimSpace(line) != "" {
			cmds = append(cmds, strings.TrimSpace(line))
		}
	}
	return cmds
}

// readmeShLines are the lines of the ```sh blocks in the README section
// whose heading starts with heading, in order, trimmed, comments kept.
func readmeShLines(t *testing.T, heading string) []string {
	t.Helper()
	readme, err := os.ReadFile(repoPath("README.md"))
	if err != nil {
		t.Fatal(err)
	}
	_, section, ok := strings.Cut(string(readme), "\n"+heading)
	if !ok {
		t.Fatalf("README has no section %q", strings.TrimSpace(heading))
	}
	section, _, _ = strings.Cut(section, "\n## ")
	var lines []string
	for block := range strings.SplitSeq(section, "```sh\n") {
		if !strings.Contains(block, "```") {
			continue // the text before the first block
		}
		body, _, _ := strings.Cut(block, "```")
		for line := range strings.SplitSeq(body, "\n") {
			if line = strings.TrimSpace(line); line != "" {
				lines = append(lines, line)
			}
		}
	}
	return lines
}

// TestReadmeConfigWorkflow runs README's config commands on every example,
// as a user does: FILE is the example, PROFILE the node it is for, and
// my-config.yaml a plain config (the example's config.yaml key). gpu-agent
// commands run; `kubectl apply -f` decodes the manifest and checks that the
// installs mount what it creates; `helm upgrade` renders the chart with the
// command's values. A command the test does not know fails it, so a README
// edit cannot leave a command untested.
func TestReadmeConfigWorkflow(t *testing.T) {
	cmds := readmeInstallCommands(t)
	files, err := filepath.Glob(repoPath("deploy", "examples", "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, example := range files {
		name := filepath.Base(example)
		t.Run(name, func(t *testing.T) {
			profile, ok := exampleProfiles[name]
			if !ok {
				t.Fatalf("no PROFILE for %s in exampleProfiles", name)
			}
			plain := filepath.Join(t.TempDir(), "my-config.yaml")
			if err := os.WriteFile(plain, loadExample(t, example), 0o644); err != nil {
				t.Fatal(err)
			}
			for _, cmd := range cmds {
				line := strings.NewReplacer("FILE", example, "PROFILE", profile, "my-config.yaml", plain).Replace(cmd)
				runReadmeCommand(t, strings.Fields(line))
			}
		})
	}
}

func runReadmeCommand(t *testing.T, args []string) {
	t.Helper()
	switch {
	case len(args) >= 3 && args[0] == "gpu-agent":
		out, err := exec.Command(agentBin, args[1:]...).CombinedOutput()
		if err != nil {
			t.Errorf("%s: %v\n%s", strings.Join(args, " "), err, out)
		} else if strings.Contains(string(out), "warning:") {
			t.Errorf("%s warns:\n%s", strings.Join(args, " "), out)
		}
	case len(args) == 4 && args[0] == "kubectl" && args[1] == "apply" && args[2] == "-f":
		checkAppliedExample(t, args[3])
	case len(args) > 2 && args[0] == "helm" && args[1] == "upgrade":
		checkHelmCommand(t, args)
	default:
		t.Errorf("README command %q: the test does not know how to run it", strings.Join(args, " "))
	}
}

// checkAppliedExample: the manifest is one ConfigMap (loadExample checks
// its name, namespace and key), and both installs mount that ConfigMap and
// read its key: the plain manifests, and the chart with config.create=false
// as README says.
func checkAppliedExample(t *testing.T, path string) {
	t.Helper()
	loadExample(t, path)
	manifests, _ := loadManifests(t)
	chart, err := renderChartIn(t, "config: {create: false}", "gpu-agent")
	if err != nil {
		t.Fatal(err)
	}
	for install, o := range map[string]*objects{"manifests": manifests, "chart with config.create=false": chart} {
		ds := agentDaemonSet(o)
		if got := configMapVolume(ds); got != "gpu-agent-config" {
			t.Errorf("%s: mounts ConfigMap %q, not the example's gpu-agent-config", install, got)
		}
		if got := flagValue(ds.Spec.Template.Spec.Containers[0].Args, "--config"); !strings.HasSuffix(got, "/config.yaml") {
			t.Errorf("%s: --config=%s, not the example's key config.yaml", install, got)
		}
		if install != "manifests" && len(o.ConfigMaps) != 0 {
			t.Errorf("%s: the chart still makes a ConfigMap, which would overwrite the applied one", install)
		}
	}
}

// checkHelmCommand renders the chart with the command's -n, --set and
// --set-file, and checks that the ConfigMap holds the file as given.
func checkHelmCommand(t *testing.T, args []string) {
	t.Helper()
	values := map[string]any{}
	ns := "default"
	var files, positional []string
	for i := 2; i < len(args); i++ {
		switch a := args[i]; {
		case a == "--install" || a == "--reuse-values":
		case (a == "-n" || a == "--set" || a == "--set-file") && i+1 < len(args):
			i++
			k, v, _ := strings.Cut(args[i], "=")
			switch a {
			case "-n":
				ns = args[i]
			case "--set":
				setValue(values, k, v)
			case "--set-file":
				data, err := os.ReadFile(v)
				if err != nil {
					t.Fatal(err)
				}
				setValue(values, k, string(data))
				files = append(files, string(data))
			}
		case !strings.HasPrefix(a, "-"):
			positional = append(positional, a)
		default:
			t.Errorf("README helm command: argument %q not understood", a)
		}
	}
	if len(positional) != 2 || positional[0] != "gpu-agent" || positional[1] != "deploy/helm/gpu-agent" {
		t.Errorf("README helm command: release and chart %q, want gpu-agent deploy/helm/gpu-agent", positional)
	}
	vals, err := yaml.Marshal(values)
	if err != nil {
		t.Fatal(err)
	}
	o, err := renderChartIn(t, string(vals), ns)
	if err != nil {
		t.Fatalf("%s: %v", strings.Join(args, " "), err)
	}
	if len(o.ConfigMaps) != 1 || len(files) != 1 || o.ConfigMaps[0].Data["config.yaml"] != files[0] {
		t.Errorf("%s: the chart's ConfigMap does not hold the file as its config.yaml", strings.Join(args, " "))
	}
}

// setValue sets a dotted key as helm's --set does (strings only).
func setValue(values map[string]any, key, v string) {
	parts := strings.Split(key, ".")
	m := values
	for _, p := range parts[:len(parts)-1] {
		next, ok := m[p].(map[string]any)
		if !ok {
			next = map[string]any{}
			m[p] = next
		}
		m = next
	}
	m[parts[len(parts)-1]] = v
}
