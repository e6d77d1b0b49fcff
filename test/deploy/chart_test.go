package deploy

import (
	"os/exec"
	"regexp"
	"slices"
	"sort"
	"strings"
	"testing"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// renderChart renders the chart as `helm template` would, with values given
// as YAML (merged over values.yaml), and decodes every document strictly.
func renderChart(t *testing.T, values string) (*objects, error) {
	t.Helper()
	return renderChartIn(t, values, "gpu-system")
}

// renderChartIn is renderChart into the release namespace ns (helm's -n).
func renderChartIn(t *testing.T, values, ns string) (*objects, error) {
	t.Helper()
	chrt, err := loader.Load(repoPath("deploy", "helm", "gpu-agent"))
	if err != nil {
		t.Fatalf("load chart: %v", err)
	}
	vals := map[string]any{}
	if err := yaml.Unmarshal([]byte(values), &vals); err != nil {
		t.Fatalf("values: %v", err)
	}
	// The library's default capabilities say Kubernetes 1.20 (helm stamps
	// its own build's version); render for the version the suite runs.
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = chartutil.KubeVersion{Version: "v1.36.3", Major: "1", Minor: "36"}
	rv, err := chartutil.ToRenderValues(chrt, vals, chartutil.ReleaseOptions{
		Name: "gpu-agent", Namespace: ns, IsInstall: true, Revision: 1,
	}, caps)
	if err != nil {
		t.Fatalf("render values: %v", err)
	}
	files, err := engine.Render(chrt, rv)
	if err != nil {
		return nil, err
	}
	names := make([]string, 0, len(files))
	for name := range files {
		names = append(names, name)
	}
	sort.Strings(names)
	o := &objects{}
	for _, name := range names {
		if strings.HasSuffix(name, ".tpl") || strings.HasSuffix(name, "NOTES.txt") {
			continue
		}
		if err := decodeStrict(name, []byte(files[name]), o); err != nil {
			t.Fatal(err)
		}
	}
	return o, nil
}

// container is the agent's container (`gpu-agent run`).
func container(o *objects) corev1.Container {
	return agentDaemonSet(o).Spec.Template.Spec.Containers[0]
}

func envValue(c corev1.Container, name string) (string, bool) {
	for _, e := range c.Env {
		if e.Name == name {
			return e.Value, true
		}
	}
	return "", false
}

func TestChartVariants(t *testing.T) {
	tests := []struct {
		name, values   string
		serviceMonitor bool
		namespace      bool
		mpsHost        bool
		privileged     bool
		addCaps        []corev1.Capability
		// env wants these variables set ("" value: must be absent).
		env   map[string]string
		check func(t *testing.T, o *objects)
	}{
		{
			name: "defaults", addCaps: []corev1.Capability{"SYS_ADMIN"},
			env: map[string]string{"NVIDIA_VISIBLE_DEVICES": "all", "NVIDIA_DRIVER_CAPABILITIES": "utility",
				"NVIDIA_MIG_MONITOR_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": ""},
			check: func(t *testing.T, o *objects) {
				if slices.ContainsFunc(container(o).Args, func(a string) bool { return strings.HasPrefix(a, "--nvml-lib") }) {
					t.Error("--nvml-lib set by default; the toolkit puts the library on the loader path")
				}
			},
		},
		{
			name: "service monitor and namespace", values: "metrics: {serviceMonitor: {enabled: true, labels: {release: prom}}}\ncreateNamespace: true",
			serviceMonitor: true, namespace: true, addCaps: []corev1.Capability{"SYS_ADMIN"},
			check: func(t *testing.T, o *objects) {
				if o.ServiceMonitors[0].Metadata.Labels["release"] != "prom" {
					t.Errorf("ServiceMonitor labels %v lack release=prom", o.ServiceMonitors[0].Metadata.Labels)
				}
			},
		},
		{
			name: "no MIG", values: "mig: {access: none}",
			env: map[string]string{"NVIDIA_MIG_MONITOR_DEVICES": "", "NVIDIA_MIG_CONFIG_DEVICES": ""},
		},
		{
			name: "MIG manager", values: "mig: {access: manage}", privileged: true,
			env: map[string]string{"NVIDIA_MIG_MONITOR_DEVICES": "all", "NVIDIA_MIG_CONFIG_DEVICES": "all"},
		},
		{
			name: "driver root", values: "driver: {root: /run/nvidia/driver}", privileged: true,
			env: map[string]string{"NVIDIA_VISIBLE_DEVICES": ""},
			check: func(t *testing.T, o *objects) {
				c := container(o)
				if !slices.Contains(c.Args, "--nvml-lib=/driver-root/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.1") {
					t.Errorf("args %v lack --nvml-lib under /driver-root", c.Args)
				}
				if !slices.ContainsFunc(agentDaemonSet(o).Spec.Template.Spec.Volumes, func(v corev1.Volume) bool {
					return v.HostPath != nil && v.HostPath.Path == "/run/nvidia/driver"
				}) || !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool {
					return m.MountPath == "/driver-root" && m.ReadOnly
				}) {
					t.Errorf("the driver root is not mounted read-only at /driver-root")
				}
			},
		},
		{
			name: "existing ConfigMap", values: "config: {create: false, name: site-gpu-config, key: gpu.yaml}",
			addCaps: []corev1.Capability{"SYS_ADMIN"},
			check: func(t *testing.T, o *objects) {
				if len(o.ConfigMaps) != 0 || configMapVolume(agentDaemonSet(o)) != "site-gpu-config" ||
					!slices.Contains(container(o).Args, "--config=/etc/gpu-agent/gpu.yaml") {
					t.Errorf("want the existing ConfigMap site-gpu-config mounted and its key gpu.yaml read; got %d ConfigMaps, volume %q, args %v",
						len(o.ConfigMaps), configMapVolume(agentDaemonSet(o)), container(o).Args)
				}
			},
		},
		{
			// A multi-key ConfigMap (NVIDIA's config.map style): the mounted
			// fallback reads every key, as the API path does.
			name: "existing multi-key ConfigMap", values: "config: {create: false, name: gpu-configs, key: \"\"}",
			addCaps: []corev1.Capability{"SYS_ADMIN"},
			check: func(t *testing.T, o *objects) {
				if configMapVolume(agentDaemonSet(o)) != "gpu-configs" || !slices.Contains(container(o).Args, "--config=/etc/gpu-agent") ||
					!slices.Contains(container(o).Args, "--configmap=$(POD_NAMESPACE)/gpu-configs") {
					t.Errorf("want gpu-configs mounted and read whole, as a file tree and through the API; volume %q, args %v",
						configMapVolume(agentDaemonSet(o)), container(o).Args)
				}
			},
		},
		{
			name: "MPS", values: "mps: {enabled: true}", mpsHost: true, addCaps: []corev1.Capability{"SYS_ADMIN"},
			env: map[string]string{"NVIDIA_DRIVER_CAPABILITIES": "utility"},
		},
		{
			name: "MPS with driver root", values: "mps: {enabled: true, binary: /driver-root/usr/bin/nvidia-cuda-mps-control}\ndriver: {root: /}",
			mpsHost: true, privileged: true, env: map[string]string{"NVIDIA_VISIBLE_DEVICES": ""},
			check: func(t *testing.T, o *objects) {
				m := mpsDaemonSet(o)
				c := m.Spec.Template.Spec.Containers[0]
				if sc := c.SecurityContext; sc.Privileged == nil || !*sc.Privileged {
					t.Error("mps-host is not privileged without the toolkit; it could not open /dev/nvidia*")
				}
				if _, ok := envValue(c, "NVIDIA_VISIBLE_DEVICES"); ok {
					t.Error("mps-host sets NVIDIA_VISIBLE_DEVICES with driver.root: the toolkit is not in use")
				}
				if !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == "/driver-root" && m.ReadOnly }) {
					t.Error("mps-host lacks the driver root at /driver-root")
				}
				if got := flagValue(c.Args, "--mps-binary"); got != "/driver-root/usr/bin/nvidia-cuda-mps-control" {
					t.Errorf("mps-host --mps-binary = %q", got)
				}
			},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			o, err := renderChart(t, tt.values)
			if err != nil {
				t.Fatal(err)
			}
			checkInstall(t, o, tt.serviceMonitor, tt.mpsHost)
			if got := len(o.Namespaces) == 1; got != tt.namespace {
				t.Errorf("Namespace rendered: %v, want %v", got, tt.namespace)
			}
			c := container(o)
			sc := c.SecurityContext
			if got := sc.Privileged != nil && *sc.Privileged; got != tt.privileged {
				t.Errorf("privileged = %v, want %v", got, tt.privileged)
			}
			if !tt.privileged {
				if sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
					!slices.Equal(sc.Capabilities.Add, tt.addCaps) {
					t.Errorf("capabilities = %+v, want drop ALL, add %v", sc.Capabilities, tt.addCaps)
				}
				if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
					t.Error("allowPrivilegeEscalation is not false")
				}
			}
			for name, want := range tt.env {
				got, ok := envValue(c, name)
				if want == "" && ok {
					t.Errorf("env %s=%q set, want it absent", name, got)
				} else if want != "" && got != want {
					t.Errorf("env %s = %q, want %q", name, got, want)
				}
			}
			if len(o.ConfigMaps) == 1 {
				key := strings.TrimPrefix(flagValue(c.Args, "--config"), "/etc/gpu-agent/")
				validateConfig(t, "chart ConfigMap", []byte(o.ConfigMaps[0].Data[key]), "sim:dgx-a100", "")
			}
			if tt.check != nil {
				tt.check(t, o)
			}
		})
	}
}

func TestChartRejectsBadValues(t *testing.T) {
	for _, tt := range []struct{ values, field string }{
		{"mig: {access: all}", "mig.access"},
		// The chart's own ConfigMap needs a key to put config.data under.
		{"config: {key: \"\"}", "config.key"},
	} {
		if _, err := renderChart(t, tt.values); err == nil || !strings.Contains(err.Error(), tt.field) {
			t.Errorf("render with %s: %v, want an error naming %s", tt.values, err, tt.field)
		}
	}
}

func flagValue(args []string, flag string) string {
	for _, a := range args {
		if v, ok := strings.CutPrefix(a, flag+"="); ok {
			return v
		}
	}
	return ""
}

// commandFlags lists a gpu-agent subcommand's flags and their environment
// variables from the binary's own help, so a new flag without a chart value
// fails the tests that use it. Bool flags have no type after their name.
func commandFlags(t *testing.T, sub string, atLeast int) map[string]string {
	t.Helper()
	out, _ := exec.Command(agentBin, sub, "-h").CombinedOutput()
	flags := map[string]string{}
	re := regexp.MustCompile(`(?m)^\s+--?([a-z][a-z-]*)(?: \S+)?\n\s+.*\[([A-Z_]+)\]`)
	for _, m := range re.FindAllStringSubmatch(string(out), -1) {
		flags[m[1]] = m[2]
	}
	if len(flags) < atLeast {
		t.Fatalf("found only %d flags in `gpu-agent %s -h`:\n%s", len(flags), sub, out)
	}
	return flags
}

// runFlags are `gpu-agent run`'s flags.
func runFlags(t *testing.T) map[string]string { return commandFlags(t, "run", 10) }

// TestChartValuesCoverFlags sets every value that feeds a flag to a marker and
// checks that each `gpu-agent run` flag reaches the container with it.
func TestChartValuesCoverFlags(t *testing.T) {
	values := `
backend: sim:dgx-h100
logLevel: debug
logFormat: text
resync: 45s
forgetGoneGPUsAfter: 72h
config: {key: marker.yaml, default: a100-ts4}
migStrategy: single
paths:
  devicePluginDir: /marker/device-plugins
  podResourcesDir: /marker/pod-resources
  stateDir: /marker/state
  mpsRoot: /marker/mps
  kubeletPluginsDir: /marker/plugins
  kubeletRegistryDir: /marker/plugins_registry
dra: {enabled: true, migCloseGrace: 90s}
mps: {enabled: true, binary: /marker/mps-control, shmDir: /marker/shm, host: {interval: 7s}}
driver: {nvmlLib: /marker/libnvidia-ml.so.1, nvidiaSMI: /marker/nvidia-smi}
metrics: {port: 9555, sampleInterval: 3s}
cdi: {specDir: /marker/cdi, nvidiaDevRoot: /marker/driver, migMinors: /marker/mig-minors}
`
	want := map[string]string{
		"backend":                "sim:dgx-h100",
		"log-level":              "debug",
		"log-format":             "text",
		"resync":                 "45s",
		"forget-gone-gpus-after": "72h",
		"nvidia-smi":             "/marker/nvidia-smi",
		"config":                 "/etc/gpu-agent/marker.yaml",
		"device-plugin-dir":      "/marker/device-plugins",
		"pod-resources-socket":   "/marker/pod-resources/kubelet.sock",
		"state-dir":              "/marker/state",
		"mps-root":               "/marker/mps",
		"mps-shm-dir":            "/marker/shm",
		"mps-host":               "true",
		"nvml-lib":               "/marker/libnvidia-ml.so.1",
		"listen":                 ":9555",
		"sample-interval":        "3s",
		"default-config":         "a100-ts4",
		"mig-strategy":           "single",
		"dra":                    "true",
		"dra-plugin-dir":         "/marker/plugins/gpu.nvidia.com",
		"kubelet-registry-dir":   "/marker/plugins_registry",
		"mig-close-grace":        "90s",
		"cdi-spec-dir":           "/marker/cdi",
		"nvidia-dev-root":        "/marker/driver",
		"mig-minors":             "/marker/mig-minors",
	}
	o, err := renderChart(t, values)
	if err != nil {
		t.Fatal(err)
	}
	c := container(o)
	for flag, env := range runFlags(t) {
		if flag == "kubeconfig" {
			// In a pod the agent uses its service account (in-cluster
			// config); a kubeconfig is for running it by hand.
			continue
		}
		if flag == "configmap" {
			if got := flagValue(c.Args, "--configmap"); got != "$(POD_NAMESPACE)/gpu-agent-config" {
				t.Errorf("--configmap = %q, want the chart's ConfigMap in the pod's namespace", got)
			}
			continue
		}
		if flag == "node-name" {
			// NODE_NAME comes from the downward API (checkDaemonSet).
			if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == env }) {
				t.Errorf("--node-name: %s is not set", env)
			}
			continue
		}
		if flag == "mps-binary" {
			// With mps-host the agent runs no daemon: mps.binary goes to
			// mps-host (below), and to the agent without it (further below).
			if got := flagValue(c.Args, "--mps-binary"); got != "" {
				t.Errorf("--mps-binary = %q given to an agent that runs no daemon", got)
			}
			continue
		}
		if flag == "host-proc" {
			// Not a value: the host's /proc is mounted read-only at one
			// fixed path in the container, and the flag names it.
			if got := flagValue(c.Args, "--host-proc"); got != "/host/proc" {
				t.Errorf("--host-proc = %q, want /host/proc, where the chart mounts the host's /proc", got)
			}
			if !slices.ContainsFunc(c.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == "/host/proc" && m.ReadOnly }) {
				t.Errorf("--host-proc: nothing is mounted read-only at /host/proc (%+v)", c.VolumeMounts)
			}
			continue
		}
		w, ok := want[flag]
		if !ok {
			t.Errorf("--%s [%s] has no chart value (add one to values.yaml and this test)", flag, env)
			continue
		}
		if got := flagValue(c.Args, "--"+flag); got != w {
			t.Errorf("--%s = %q, want %q from the values", flag, got, w)
		}
	}

	// Every mps-host flag has a value too.
	wantHost := map[string]string{
		"mps-root":   "/marker/mps",
		"mps-binary": "/marker/mps-control",
		"interval":   "7s",
		"log-level":  "debug",
		"log-format": "text",
	}
	hc := mpsDaemonSet(o).Spec.Template.Spec.Containers[0]
	for flag, env := range commandFlags(t, "mps-host", 5) {
		w, ok := wantHost[flag]
		if !ok {
			t.Errorf("mps-host --%s [%s] has no chart value (add one to values.yaml and this test)", flag, env)
			continue
		}
		if got := flagValue(hc.Args, "--"+flag); got != w {
			t.Errorf("mps-host --%s = %q, want %q from the values", flag, got, w)
		}
	}
	for _, m := range hc.VolumeMounts {
		if strings.HasPrefix(m.MountPath, "/run/") {
			t.Errorf("mps-host volume %s still mounted at default path %s", m.Name, m.MountPath)
		}
	}

	// Without mps.enabled the agent supervises daemons itself (as before
	// mps-host): mps.binary is its --mps-binary.
	o2, err := renderChart(t, "mps: {binary: /marker/mps-control}")
	if err != nil {
		t.Fatal(err)
	}
	if c2 := container(o2); flagValue(c2.Args, "--mps-binary") != "/marker/mps-control" || flagValue(c2.Args, "--mps-host") != "" {
		t.Errorf("agent args without mps.enabled %v: want --mps-binary from the values and no --mps-host", c2.Args)
	}
	if c.Ports[0].ContainerPort != 9555 || o.Services[0].Spec.Ports[0].Port != 9555 {
		t.Errorf("metrics.port does not reach the container port (%d) and Service (%d)", c.Ports[0].ContainerPort, o.Services[0].Spec.Ports[0].Port)
	}
	for _, m := range c.VolumeMounts {
		if strings.HasPrefix(m.MountPath, "/var/lib") || strings.HasPrefix(m.MountPath, "/run/") {
			t.Errorf("volume %s still mounted at default path %s", m.Name, m.MountPath)
		}
	}
}

// TestChartMatchesManifests: the chart with default values runs the agent as
// the plain manifests do (same args, mounts, env, probes, security).
func TestChartMatchesManifests(t *testing.T) {
	m, _ := loadManifests(t)
	h, err := renderChart(t, "logFormat: json")
	if err != nil {
		t.Fatal(err)
	}
	mc, hc := container(m), container(h)
	for _, a := range mc.Args {
		if !slices.Contains(hc.Args, a) {
			t.Errorf("manifests pass %s, the chart does not (chart args %v)", a, hc.Args)
		}
	}
	for _, e := range mc.Env {
		if v, ok := envValue(hc, e.Name); e.Name != "NODE_NAME" && e.Name != "GPU_AGENT_LOG_FORMAT" && (!ok || v != e.Value) {
			t.Errorf("manifests set %s=%s, the chart %q", e.Name, e.Value, v)
		}
	}
	if flagValue(hc.Args, "--log-format") != "json" {
		t.Errorf("chart --log-format = %q, manifests use json", flagValue(hc.Args, "--log-format"))
	}
	mountPaths := func(c corev1.Container) []string {
		var out []string
		for _, vm := range c.VolumeMounts {
			out = append(out, vm.MountPath)
		}
		sort.Strings(out)
		return out
	}
	if !slices.Equal(mountPaths(mc), mountPaths(hc)) {
		t.Errorf("mount paths differ: manifests %v, chart %v", mountPaths(mc), mountPaths(hc))
	}
	if !slices.Equal(mc.SecurityContext.Capabilities.Add, hc.SecurityContext.Capabilities.Add) {
		t.Errorf("capabilities differ: manifests %v, chart %v", mc.SecurityContext.Capabilities.Add, hc.SecurityContext.Capabilities.Add)
	}
}

// With mps.enabled the daemons run in the mps-host DaemonSet, which has what
// they need (host IPC, the host shm directory as /dev/shm, compute tools);
// the agent needs none of it any more: it asks mps-host through the MPS root
// and hands clients the pipe and shm directories by host path.
func TestChartMPSEnabled(t *testing.T) {
	o, err := renderChart(t, "mps: {enabled: true, shmDir: /run/gpu-agent/shm}\n")
	if err != nil {
		t.Fatal(err)
	}
	checkInstall(t, o, false, true)
	ds, m := agentDaemonSet(o), mpsDaemonSet(o)
	if m.Name != "gpu-agent-mps" {
		t.Errorf("mps-host DaemonSet %q, want gpu-agent-mps", m.Name)
	}

	// The agent: no host IPC, no shared /dev/shm, no compute tools.
	if ds.Spec.Template.Spec.HostIPC {
		t.Error("the agent still has hostIPC; the daemons no longer run in it")
	}
	c := container(o)
	if got := flagValue(c.Args, "--mps-shm-dir"); got != "/run/gpu-agent/shm" {
		t.Errorf("agent --mps-shm-dir = %q, want the host directory clients get", got)
	}
	if slices.ContainsFunc(c.VolumeMounts, func(vm corev1.VolumeMount) bool { return vm.MountPath == "/dev/shm" }) {
		t.Error("the agent still mounts the shared /dev/shm")
	}
	if caps, _ := envValue(c, "NVIDIA_DRIVER_CAPABILITIES"); caps != "utility" {
		t.Errorf("agent NVIDIA_DRIVER_CAPABILITIES = %q, want utility only", caps)
	}

	// mps-host: the daemons' needs.
	mc := m.Spec.Template.Spec.Containers[0]
	if caps, _ := envValue(mc, "NVIDIA_DRIVER_CAPABILITIES"); caps != "compute,utility" {
		t.Errorf("mps-host NVIDIA_DRIVER_CAPABILITIES = %q, want compute,utility (nvidia-cuda-mps-control)", caps)
	}
	if v, _ := envValue(mc, "NVIDIA_VISIBLE_DEVICES"); v != "all" {
		t.Errorf("mps-host NVIDIA_VISIBLE_DEVICES = %q, want all", v)
	}
	if got := flagValue(mc.Args, "--interval"); got != "5s" {
		t.Errorf("mps-host --interval = %q, want the default 5s", got)
	}
	sc := mc.SecurityContext
	if sc.Privileged != nil && *sc.Privileged || sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
		len(sc.Capabilities.Add) != 0 || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation {
		t.Errorf("mps-host securityContext %+v: want unprivileged, all capabilities dropped", sc)
	}
}

// The chart installs on Kubernetes 1.26 and newer, but its default admission
// policies need 1.30: on an older cluster it says so and how to install
// without them, instead of failing on an unknown API.
func TestChartAdmissionPolicyNeedsKubernetes130(t *testing.T) {
	chrt, err := loader.Load(repoPath("deploy", "helm", "gpu-agent"))
	if err != nil {
		t.Fatal(err)
	}
	render := func(version, values string) error {
		vals := map[string]any{}
		if err := yaml.Unmarshal([]byte(values), &vals); err != nil {
			t.Fatal(err)
		}
		caps := chartutil.DefaultCapabilities.Copy()
		caps.KubeVersion = chartutil.KubeVersion{Version: version, Major: "1", Minor: strings.Split(version, ".")[1]}
		rv, err := chartutil.ToRenderValues(chrt, vals, chartutil.ReleaseOptions{Name: "gpu-agent", Namespace: "gpu-system", IsInstall: true}, caps)
		if err != nil {
			return err
		}
		_, err = engine.Render(chrt, rv)
		return err
	}
	if err := render("v1.29.4", ""); err == nil || !strings.Contains(err.Error(), "admissionPolicy.enabled=false") || !strings.Contains(err.Error(), "v1.29.4") {
		t.Errorf("1.29 with the default policies: %v, want an error naming the version and the value to set", err)
	}
	if err := render("v1.29.4", "admissionPolicy: {enabled: false}"); err != nil {
		t.Errorf("1.29 without the policies: %v", err)
	}
	if err := render("v1.30.0", ""); err != nil {
		t.Errorf("1.30: %v", err)
	}
}
