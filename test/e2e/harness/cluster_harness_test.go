package harness

import (
	"os"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
)

func repoFile(parts ...string) string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(append([]string{filepath.Dir(file), "..", "..", ".."}, parts...)...)
}

// The repository's Dockerfile, read as the e2e image reads it.
func TestAgentImageFromDockerfile(t *testing.T) {
	bin := "/bin/true" // any dynamically linked host binary stands in for gpu-agent
	spec, err := AgentImage(repoFile("Dockerfile"), bin)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(spec.Entrypoint, []string{"/usr/bin/gpu-agent"}) || !slices.Equal(spec.Cmd, []string{"run"}) {
		t.Errorf("entrypoint %v cmd %v, want [/usr/bin/gpu-agent] [run]", spec.Entrypoint, spec.Cmd)
	}
	if spec.User != "0:0" || !slices.Equal(spec.ExposedPorts, []string{"9400/tcp"}) {
		t.Errorf("user %q ports %v", spec.User, spec.ExposedPorts)
	}
	for _, kv := range []string{"NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=utility"} {
		if !slices.Contains(spec.Env, kv) {
			t.Errorf("env %v lacks %s", spec.Env, kv)
		}
	}
	if spec.Labels["org.opencontainers.image.version"] != "dev" || spec.Labels["org.opencontainers.image.title"] != "gpu-agent" {
		t.Errorf("labels %v", spec.Labels)
	}
	paths := map[string]bool{}
	for _, f := range spec.Files {
		paths[f.Path] = true
	}
	if !paths["/usr/bin/gpu-agent"] || !paths["/etc/passwd"] {
		t.Errorf("files %v lack the binary or /etc/passwd", paths)
	}
	var libc bool
	for p := range paths {
		libc = libc || strings.HasSuffix(p, "/libc.so.6")
	}
	if !libc {
		t.Errorf("files %v: no libc.so.6 for a dynamic binary", paths)
	}
}

func TestParseDockerfileRejectsUnknownLastStage(t *testing.T) {
	df := filepath.Join(t.TempDir(), "Dockerfile")
	content := "FROM golang AS build\nRUN go build -o /out/gpu-agent ./cmd/gpu-agent\n" +
		"FROM gcr.io/distroless/static\nCOPY --from=build /out/gpu-agent /gpu-agent\nRUN echo hi\n"
	if err := os.WriteFile(df, []byte(content), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := AgentImage(df, "/bin/true"); err == nil || !strings.Contains(err.Error(), "RUN is not supported") {
		t.Fatalf("got %v, want RUN refused", err)
	}
}

func TestWords(t *testing.T) {
	got, err := words(`a="b c" d=e  "f"`)
	if err != nil {
		t.Fatal(err)
	}
	if want := []string{"a=b c", "d=e", "f"}; !slices.Equal(got, want) {
		t.Fatalf("got %q, want %q", got, want)
	}
}

// The sim overlay of deploy/manifests with a node layer: every host path remapped, the host network, the
// metrics port moved, the backend selected.
func TestBuildManifestsNodeLayer(t *testing.T) {
	run := t.TempDir()
	c := &Cluster{Env: &Env{d: newDirs(run)}, APIPort: 6443}
	layer := NodeLayer{
		MetricsPort: 19400,
		HostDirs: map[string]string{
			DevicePluginDir:                  DevicePluginDir,
			"/var/lib/kubelet/pod-resources": run + "/kubelet/pod-resources",
			"/var/lib/gpu-agent":             run + "/agent/state",
			"/run/gpu-agent/mps":             run + "/agent/mps",
			"/var/run/cdi":                   run + "/cdi",
			"/proc":                          "/proc",
		},
		APIHost: "127.0.0.1", APIPort: 6443,
	}
	objs, err := c.BuildManifests(repoFile("test", "e2e", "testdata", "sim-overlay"), layer)
	if err != nil {
		t.Fatal(err)
	}
	ds, err := AgentDaemonSet(objs)
	if err != nil {
		t.Fatal(err)
	}
	spec := ds.Spec.Template.Spec
	if !spec.HostNetwork {
		t.Error("not on the host network")
	}
	c0 := spec.Containers[0]
	if c0.Image != "ghcr.io/gpu-agent/gpu-agent:v0.1.0" {
		t.Errorf("image %s", c0.Image)
	}
	if !slices.Contains(c0.Args, "--listen=:19400") || c0.Ports[0].ContainerPort != 19400 {
		t.Errorf("args %v ports %v", c0.Args, c0.Ports)
	}
	// The MPS root at the same path inside and out (clients bind the pipe directories the agent names).
	mps := run + "/agent/mps"
	if last := c0.Args[len(c0.Args)-1]; last != "--mps-root="+mps ||
		!slices.ContainsFunc(c0.VolumeMounts, func(m corev1.VolumeMount) bool { return m.MountPath == mps }) {
		t.Errorf("args %v mounts %v: want the MPS root at %s", c0.Args, c0.VolumeMounts, mps)
	}
	env := map[string]string{}
	for _, e := range c0.Env {
		env[e.Name] = e.Value
	}
	if env["GPU_AGENT_BACKEND"] != "sim:dgx-a100" || env["KUBERNETES_SERVICE_HOST"] != "127.0.0.1" || env["KUBERNETES_SERVICE_PORT"] != "6443" {
		t.Errorf("env %v", env)
	}
	for _, v := range spec.Volumes {
		if v.HostPath != nil && v.HostPath.Path != DevicePluginDir && v.HostPath.Path != "/proc" && !strings.HasPrefix(v.HostPath.Path, run+"/") {
			t.Errorf("volume %s: host path %s", v.Name, v.HostPath.Path)
		}
	}
	kinds := map[string]int{}
	for _, o := range objs {
		kinds[o.GetKind()]++
		if o.GetKind() != "Namespace" && o.GetKind() != "ClusterRole" && o.GetKind() != "ClusterRoleBinding" && o.GetNamespace() != "gpu-agent" {
			t.Errorf("%s %s in namespace %q", o.GetKind(), o.GetName(), o.GetNamespace())
		}
	}
	for _, k := range []string{"Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "ConfigMap", "DaemonSet", "Service", "ServiceMonitor"} {
		if kinds[k] != 1 {
			t.Errorf("%d %s objects, want 1 (all: %v)", kinds[k], k, kinds)
		}
	}
}

// The chart with MPS on renders a second DaemonSet (mps-host): the node layer puts both on the host network,
// patches only the agent's, and every host path comes from the values.
func TestRenderChartNodeLayer(t *testing.T) {
	run := t.TempDir()
	c := &Cluster{Env: &Env{d: newDirs(run)}, APIPort: 6443}
	layer := NodeLayer{
		MetricsPort: 19400,
		HostDirs: map[string]string{
			DevicePluginDir:                  DevicePluginDir,
			"/var/lib/kubelet/pod-resources": run + "/kubelet/pod-resources",
			"/var/lib/gpu-agent":             run + "/agent/state",
			"/run/gpu-agent/mps":             run + "/agent/mps",
			"/var/run/cdi":                   run + "/cdi",
			"/proc":                          "/proc",
		},
		APIHost: "127.0.0.1", APIPort: 6443,
	}
	values := filepath.Join(t.TempDir(), "values.yaml")
	if err := os.WriteFile(values, []byte("mps:\n  enabled: true\n  shmDir: "+run+"/shm\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	objs, err := c.renderChart(repoFile("deploy", "helm", "gpu-agent"), "gpu-agent", "gpu-agent", "v1.36.3", layer,
		repoFile("test", "e2e", "testdata", "helm-values-sim.yaml"), values)
	if err != nil {
		t.Fatal(err)
	}
	ds, err := AgentDaemonSet(objs)
	if err != nil {
		t.Fatal(err)
	}
	c0 := ds.Spec.Template.Spec.Containers[0]
	if !slices.Contains(c0.Args, "--backend=sim:dgx-a100") || !slices.Contains(c0.Args, "--listen=:19400") {
		t.Errorf("args %v", c0.Args)
	}
	dss, err := daemonSets(objs)
	if err != nil {
		t.Fatal(err)
	}
	if len(dss) != 2 {
		t.Fatalf("%d DaemonSets, want the agent's and mps-host's", len(dss))
	}
	for _, d := range dss {
		env := map[string]bool{}
		for _, e := range d.Spec.Template.Spec.Containers[0].Env {
			env[e.Name] = true
		}
		if env["KUBERNETES_SERVICE_HOST"] != (d.Name == ds.Name) {
			t.Errorf("DaemonSet %s: KUBERNETES_SERVICE_HOST set: %v", d.Name, env["KUBERNETES_SERVICE_HOST"])
		}
	}
	if _, err := c.renderChart(repoFile("deploy", "helm", "gpu-agent"), "gpu-agent", "gpu-agent", "v1.20.0", layer); err == nil ||
		!strings.Contains(err.Error(), "kubeVersion") {
		t.Errorf("an API server older than the chart's kubeVersion: got %v", err)
	}
}
