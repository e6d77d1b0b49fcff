package deploy

import (
	"os"
	"path/filepath"
	"slices"
	"testing"

	corev1 "k8s.io/api/core/v1"
	"sigs.k8s.io/yaml"
)

// kustomization is the part of a kustomization.yaml the base uses.
type kustomization struct {
	APIVersion string   `json:"apiVersion"`
	Kind       string   `json:"kind"`
	Namespace  string   `json:"namespace"`
	Resources  []string `json:"resources"`
	Images     []struct {
		Name    string `json:"name"`
		NewTag  string `json:"newTag"`
		NewName string `json:"newName,omitempty"`
	} `json:"images"`
}

// loadManifests decodes the kustomize base strictly, as `kubectl apply -k`
// would read it.
func loadManifests(t *testing.T) (*objects, *kustomization) {
	t.Helper()
	dir := repoPath("deploy", "manifests")
	data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var k kustomization
	if err := yaml.UnmarshalStrict(data, &k); err != nil {
		t.Fatalf("kustomization.yaml: %v", err)
	}
	files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range files {
		if base := filepath.Base(f); base != "kustomization.yaml" && !slices.Contains(k.Resources, base) {
			t.Errorf("%s is not listed in kustomization.yaml resources", base)
		}
	}
	o := &objects{}
	for _, r := range k.Resources {
		data, err := os.ReadFile(filepath.Join(dir, r))
		if err != nil {
			t.Fatal(err)
		}
		if err := decodeStrict(r, data, o); err != nil {
			t.Fatal(err)
		}
	}
	return o, &k
}

func TestManifests(t *testing.T) {
	o, k := loadManifests(t)
	// MPS stays off here (no mps-host DaemonSet); the chart has it. No
	// ServiceMonitor: without prometheus-operator's CRDs it would fail the
	// whole `kubectl apply -k`; the servicemonitor component adds it.
	checkInstall(t, o, false, false)
	sm := loadServiceMonitorComponent(t)
	withSM := *o
	withSM.ServiceMonitors = sm.ServiceMonitors
	checkInstall(t, &withSM, true, false)

	// kustomize rewrites namespaces; the files say the same, so they also
	// work with a plain `kubectl apply -f`.
	for _, ns := range []string{o.DaemonSets[0].Namespace, o.Services[0].Namespace, o.ServiceAccounts[0].Namespace,
		o.ConfigMaps[0].Namespace, sm.ServiceMonitors[0].Metadata.Namespace, o.ClusterRoleBindings[0].Subjects[0].Namespace} {
		if ns != k.Namespace {
			t.Errorf("namespace %q, want the kustomization's %q", ns, k.Namespace)
		}
	}
	if len(o.Namespaces) != 1 || o.Namespaces[0].Name != k.Namespace ||
		o.Namespaces[0].Labels["pod-security.kubernetes.io/enforce"] != "privileged" {
		t.Errorf("Namespace %+v: want %s with the privileged Pod Security level", o.Namespaces, k.Namespace)
	}

	c := o.DaemonSets[0].Spec.Template.Spec.Containers[0]
	if !slices.ContainsFunc(k.Images, func(i struct {
		Name    string `json:"name"`
		NewTag  string `json:"newTag"`
		NewName string `json:"newName,omitempty"`
	}) bool {
		return i.Name == c.Image && i.NewTag != "" && i.NewTag != "latest"
	}) {
		t.Errorf("image %q is not pinned to a tag by kustomization images %+v", c.Image, k.Images)
	}

	// The base serves existing MIG instances (mig.access monitor in the chart):
	// SYS_ADMIN and nothing else.
	sc := c.SecurityContext
	if sc.Privileged != nil && *sc.Privileged {
		t.Error("the base DaemonSet is privileged; only MIG repartitioning needs that")
	}
	if sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
		!slices.Equal(sc.Capabilities.Add, []corev1.Capability{"SYS_ADMIN"}) {
		t.Errorf("securityContext = %+v, want no escalation, drop ALL, add SYS_ADMIN only", sc)
	}

	if len(o.ConfigMaps) != 1 {
		t.Fatalf("got %d ConfigMaps, want 1", len(o.ConfigMaps))
	}
	if got := configMapVolume(o.DaemonSets[0]); got != o.ConfigMaps[0].Name {
		t.Errorf("the DaemonSet mounts ConfigMap %q, the base ships %q", got, o.ConfigMaps[0].Name)
	}
	validateConfig(t, "manifests/configmap.yaml", []byte(o.ConfigMaps[0].Data["config.yaml"]), "sim:dgx-a100", "")
}

// loadServiceMonitorComponent decodes deploy/manifests/servicemonitor
// strictly: a kustomize Component holding the ServiceMonitor alone.
func loadServiceMonitorComponent(t *testing.T) *objects {
	t.Helper()
	dir := repoPath("deploy", "manifests", "servicemonitor")
	var k struct {
		APIVersion string   `json:"apiVersion"`
		Kind       string   `json:"kind"`
		Resources  []string `json:"resources"`
	}
	data, err := os.ReadFile(filepath.Join(dir, "kustomization.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.UnmarshalStrict(data, &k); err != nil || k.Kind != "Component" {
		t.Fatalf("servicemonitor/kustomization.yaml: kind %q, %v", k.Kind, err)
	}
	o := &objects{}
	for _, f := range k.Resources {
		data, err := os.ReadFile(filepath.Join(dir, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := decodeStrict(f, data, o); err != nil {
			t.Fatal(err)
		}
	}
	if len(o.ServiceMonitors) != 1 || len(o.DaemonSets)+len(o.Services)+len(o.ConfigMaps) != 0 {
		t.Fatalf("the servicemonitor component holds %d ServiceMonitors and other objects; want the ServiceMonitor alone", len(o.ServiceMonitors))
	}
	return o
}
