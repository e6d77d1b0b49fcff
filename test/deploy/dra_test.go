package deploy

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	"strings"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"sigs.k8s.io/yaml"
)

// The DRA install: the manifests' component and the chart's dra.enabled give the same DeviceClasses (NVIDIA's
// names and selectors), the same extra rules, and the same agent flags, mounts and host paths.
func TestDRAInstall(t *testing.T) {
	comp := loadDRAComponent(t)
	for _, in := range policyInstalls(t) {
		checkPolicies(t, in.o, in.sa, in.ns)
	}
	chart, err := renderChart(t, "dra: {enabled: true}\n")
	if err != nil {
		t.Fatal(err)
	}
	mapped, err := renderChart(t, "dra: {enabled: true, extendedResourceName: nvidia.com/gpu}\n")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range append(mapped.DeviceClasses, chart.DeviceClasses...) {
		want := ""
		if c.Name == "gpu.nvidia.com" && slices.Contains(mapped.DeviceClasses, c) {
			want = "nvidia.com/gpu"
		}
		if got := c.Spec.ExtendedResourceName; (got == nil) != (want == "") || got != nil && *got != want {
			t.Errorf("DeviceClass %s: extendedResourceName %v, want %q", c.Name, got, want)
		}
	}
	off, err := renderChart(t, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(off.DeviceClasses) != 0 || flagValue(container(off).Args, "--dra") != "" || hasRule(off.ClusterRoles, "resourceslices") {
		t.Errorf("DRA is on by default in the chart")
	}

	classes := func(o *objects) map[string]string {
		out := map[string]string{}
		for _, c := range o.DeviceClasses {
			if len(c.Spec.Selectors) != 1 || c.Spec.Selectors[0].CEL == nil {
				t.Errorf("DeviceClass %s: selectors %+v", c.Name, c.Spec.Selectors)
				continue
			}
			out[c.Name] = c.Spec.Selectors[0].CEL.Expression
		}
		return out
	}
	want := map[string]string{
		"gpu.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'gpu'",
		"mig.nvidia.com": "device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == 'mig'",
	}
	for name, o := range map[string]*objects{"manifests": comp, "chart": chart} {
		got := classes(o)
		if len(got) != len(want) {
			t.Errorf("%s: DeviceClasses %v, want %v", name, got, want)
		}
		for n, e := range want {
			if got[n] != e {
				t.Errorf("%s: DeviceClass %s selects %q, want %q", name, n, got[n], e)
			}
		}
		for _, r := range []struct{ res, verbs string }{
			{"resourceslices", "create,delete,list,update,watch"}, {"resourceclaims", "get"},
			// status.devices by server-side apply: a patch, and on 1.36 the API server's per-driver
			// check, granted only for claims allocated on the agent's own node.
			{"resourceclaims/status", "patch"}, {"resourceclaims/driver", "associated-node:patch"},
		} {
			if v := ruleVerbs(o.ClusterRoles, r.res); v != r.verbs {
				t.Errorf("%s: %s verbs %q, want %q", name, r.res, v, r.verbs)
			}
		}
		for _, role := range o.ClusterRoles {
			for _, rule := range role.Rules {
				if slices.Contains(rule.Resources, "resourceclaims/driver") && !slices.Equal(rule.ResourceNames, []string{"gpu.nvidia.com"}) {
					t.Errorf("%s: resourceclaims/driver for %v, want only the driver gpu.nvidia.com", name, rule.ResourceNames)
				}
			}
		}
	}

	// The agent: flags (env in the component, args in the chart) and mounts at the host's own paths.
	mc := comp.DaemonSets[0].Spec.Template.Spec.Containers[0]
	env := map[string]string{}
	for _, e := range mc.Env {
		env[e.Name] = e.Value
	}
	hc := container(chart)
	for flag, envName := range map[string]string{"dra": "GPU_AGENT_DRA", "dra-plugin-dir": "GPU_AGENT_DRA_PLUGIN_DIR", "kubelet-registry-dir": "GPU_AGENT_KUBELET_REGISTRY_DIR"} {
		if got := flagValue(hc.Args, "--"+flag); got != env[envName] || got == "" {
			t.Errorf("--%s: chart %q, manifests %s=%q", flag, got, envName, env[envName])
		}
	}
	for name, ds := range map[string]*appsv1.DaemonSet{"manifests": comp.DaemonSets[0], "chart": agentDaemonSet(chart)} {
		c := ds.Spec.Template.Spec.Containers[0]
		for _, p := range []string{"/var/lib/kubelet/plugins", "/var/lib/kubelet/plugins_registry"} {
			i := slices.IndexFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == p })
			if i < 0 {
				t.Errorf("%s: %s not mounted", name, p)
				continue
			}
			vi := slices.IndexFunc(ds.Spec.Template.Spec.Volumes, func(v corev1.Volume) bool { return v.Name == c.VolumeMounts[i].Name })
			if vi < 0 || ds.Spec.Template.Spec.Volumes[vi].HostPath == nil || ds.Spec.Template.Spec.Volumes[vi].HostPath.Path != p {
				t.Errorf("%s: %s is not the host's own %s", name, c.VolumeMounts[i].Name, p)
			}
		}
	}
}

// loadDRAComponent decodes deploy/manifests/dra strictly: its resources and its DaemonSet patch.
func loadDRAComponent(t *testing.T) *objects {
	t.Helper()
	dir := repoPath("deploy", "manifests", "dra")
	var k struct {
		APIVersion string   `json:"apiVersion"`
		Kind       string   `json:"kind"`
		Resources  []string `json:"resources"`
		Patches    []struct {
			Path string `json:"path"`
		} `json:"patches"`
	}
	data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict(data, &k); err != nil || k.Kind != "Component" {
		t.Fatalf("dra/kustomization.yaml: kind %q, %v", k.Kind, err)
	}
	comp := &objects{}
	for _, f := range append(k.Resources, k.Patches[0].Path) {
		data, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := decodeStrict(f, data, comp); err != nil {
			t.Fatal(err)
		}
	}
	return comp
}

func hasRule(roles []*rbacv1.ClusterRole, resource string) bool {
	return ruleVerbs(roles, resource) != ""
}

// ruleVerbs returns the sorted verbs the roles grant on resource, comma-separated.
func ruleVerbs(roles []*rbacv1.ClusterRole, resource string) string {
	var verbs []string
	for _, r := range roles {
		for _, rule := range r.Rules {
			if slices.Contains(rule.Resources, resource) {
				verbs = append(verbs, rule.Verbs...)
			}
		}
	}
	slices.Sort(verbs)
	return strings.Join(slices.Compact(verbs), ",")
}
