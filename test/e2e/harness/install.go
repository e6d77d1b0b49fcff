package harness

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"

	"helm.sh/helm/v3/pkg/chart/loader"
	"helm.sh/helm/v3/pkg/chartutil"
	"helm.sh/helm/v3/pkg/engine"
	"helm.sh/helm/v3/pkg/releaseutil"
	appsv1 "k8s.io/api/apps/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"k8s.io/client-go/discovery/cached/memory"
	"k8s.io/client-go/restmapper"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"
)

// The install path: what users run is `kubectl apply -k deploy/manifests` or `helm install`; here the same
// artefacts go through the same libraries (kustomize's krusty, which kubectl embeds; helm's chart loader and
// template engine), then a last kustomize layer (a post-renderer, for the chart) adapts the DaemonSet to this
// node, and the objects are applied server-side. The node layer changes only what this node cannot provide:
//   - hostNetwork: true, as the node has no CNI (see StartCluster), and so a free metrics port instead of 9400;
//   - KUBERNETES_SERVICE_HOST/PORT pointing at the API server on 127.0.0.1, as no kube-proxy routes the
//     "kubernetes" Service's ClusterIP; in-cluster clients (rest.InClusterConfig) then work as on a node;
//   - host paths: the pod-resources and plugins_registry directories are the kubelet's --root-dir's, and the
//     agent's state and MPS directories are the run's; the device plugin and DRA plugins directories stay
//     the real ones.

// NodeLayer is how an install on this Cluster differs from a real node's (see above).
type NodeLayer struct {
	MetricsPort int
	// HostDirs maps each host directory the DaemonSet mounts to the directory this run uses instead.
	HostDirs map[string]string
	APIHost  string
	APIPort  int
	// DevRoot, when set, is the agent's NVIDIA_DEV_ROOT: the stand-in device nodes of a containerd 2.x node.
	DevRoot string
	// ExtraArgs are added to the agent's args last (later flags win).
	ExtraArgs []string
}

// NodeLayer returns this Cluster's node layer, with a free metrics port.
func (c *Cluster) NodeLayer() (NodeLayer, error) {
	ports, err := freePorts(1)
	if err != nil {
		return NodeLayer{}, err
	}
	devRoot := ""
	if c.Env.cfg.Containerd2 != "" {
		devRoot = c.d.devRoot
	}
	for _, d := range []string{c.d.agentState, c.d.agentMPS, c.d.cdiSpecs} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return NodeLayer{}, err
		}
	}
	return NodeLayer{
		MetricsPort: ports[0],
		HostDirs: map[string]string{
			DevicePluginDir:                  DevicePluginDir,
			"/var/lib/kubelet/pod-resources": filepath.Dir(c.d.podResources),
			"/var/lib/gpu-agent":             c.d.agentState,
			"/run/gpu-agent/mps":             c.d.agentMPS,
			"/var/run/cdi":                   c.d.cdiSpecs,
			// DRA: the kubelet finds registration sockets in its --root-dir's plugins_registry, and dials
			// the DRA socket at the path the driver registers, which is the one inside its container: the
			// plugins directory stays the real one, like the device plugin directory.
			"/var/lib/kubelet/plugins_registry": filepath.Join(c.d.kubeletRoot, "plugins_registry"),
			DRAPluginsDir:                       DRAPluginsDir,
			// The holder tracker reads the host's /proc: the e2e node is this host.
			"/proc": "/proc",
		},
		APIHost: "127.0.0.1",
		APIPort: c.APIPort,
		DevRoot: devRoot,
	}, nil
}

// Kustomize builds the kustomization in dir as `kubectl apply -k dir` does (krusty, default options: load
// restricted to the kustomization's root, no plugins).
func Kustomize(dir string) ([]byte, error) {
	m, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(filesys.MakeFsOnDisk(), dir)
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	out, err := m.AsYaml()
	if err != nil {
		return nil, fmt.Errorf("kustomize build %s: %w", dir, err)
	}
	return out, nil
}

// BuildManifests builds the kustomization overlay (its bases include deploy/manifests) with the node layer
// on top, written as a kustomization of its own under the run directory, and returns the objects to apply.
func (c *Cluster) BuildManifests(overlay string, layer NodeLayer) ([]*unstructured.Unstructured, error) {
	overlay, err := filepath.Abs(overlay)
	if err != nil {
		return nil, err
	}
	// The node layer's volume patch names volumes, so read them from the overlay's own DaemonSet first.
	base, err := Kustomize(overlay)
	if err != nil {
		return nil, err
	}
	objs, err := DecodeObjects(base)
	if err != nil {
		return nil, err
	}
	ds, err := AgentDaemonSet(objs)
	if err != nil {
		return nil, err
	}
	var volumes []map[string]any
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.HostPath == nil {
			continue
		}
		dir, ok := layer.HostDirs[v.HostPath.Path]
		if !ok {
			return nil, fmt.Errorf("%s: the DaemonSet mounts host path %s, which the e2e node does not map", overlay, v.HostPath.Path)
		}
		if dir != v.HostPath.Path {
			volumes = append(volumes, map[string]any{"name": v.Name, "hostPath": map[string]any{"path": dir}})
		}
	}
	dir := filepath.Join(c.d.run, "install", "manifests")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	rel, err := filepath.Rel(dir, overlay)
	if err != nil {
		return nil, err
	}
	// A later --listen wins (Go's flag package); the named port "metrics" (probes, Service) follows it.
	patch := []map[string]any{
		{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": fmt.Sprintf("--listen=:%d", layer.MetricsPort)},
		{"op": "test", "path": "/spec/template/spec/containers/0/ports/0/name", "value": "metrics"},
		{"op": "replace", "path": "/spec/template/spec/containers/0/ports/0/containerPort", "value": layer.MetricsPort},
	}
	// The MPS root at the same path inside and out, as on a real node: MPS clients (device plugin mounts, DRA
	// claim specs) bind the pipe directories at the paths the agent names.
	if dir, i := layer.HostDirs["/run/gpu-agent/mps"], mountIndex(ds, "/run/gpu-agent/mps"); dir != "" && i >= 0 {
		patch = append(patch,
			map[string]any{"op": "replace", "path": fmt.Sprintf("/spec/template/spec/containers/0/volumeMounts/%d/mountPath", i), "value": dir},
			map[string]any{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": "--mps-root=" + dir})
	}
	for _, a := range layer.ExtraArgs {
		patch = append(patch, map[string]any{"op": "add", "path": "/spec/template/spec/containers/0/args/-", "value": a})
	}
	k, err := nodeKustomization([]string{rel}, ds.Name, layer, volumes, patch)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), k, 0o644); err != nil {
		return nil, err
	}
	return c.buildChecked(dir, layer)
}

// RenderChart renders the chart as `helm template` (and `helm install`) does, for release name in
// namespace, with the values files merged in order (later wins) and the node layer's values on top (the
// chart's paths.* and metrics.port: what a user of such a node would set); it checks the chart's kubeVersion
// against the API server's, as `helm install` does. The rendered manifest then goes through the node layer as
// a kustomize post-renderer, and the objects to apply are returned.
func (c *Cluster) RenderChart(ctx context.Context, chartDir, name, namespace string, layer NodeLayer, valuesFiles ...string) ([]*unstructured.Unstructured, error) {
	sv, err := c.Client.Discovery().ServerVersion()
	if err != nil {
		return nil, fmt.Errorf("helm: server version: %w", err)
	}
	return c.renderChart(chartDir, name, namespace, sv.GitVersion, layer, valuesFiles...)
}

func (c *Cluster) renderChart(chartDir, name, namespace, serverVersion string, layer NodeLayer, valuesFiles ...string) ([]*unstructured.Unstructured, error) {
	chrt, err := loader.Load(chartDir)
	if err != nil {
		return nil, fmt.Errorf("helm: load %s: %w", chartDir, err)
	}
	vals := map[string]any{}
	for _, f := range valuesFiles {
		v, err := chartutil.ReadValuesFile(f)
		if err != nil {
			return nil, fmt.Errorf("helm: %w", err)
		}
		mergeValues(vals, v.AsMap())
	}
	mergeValues(vals, map[string]any{
		"metrics": map[string]any{"port": layer.MetricsPort},
		"paths": map[string]any{
			"devicePluginDir": layer.HostDirs[DevicePluginDir],
			"podResourcesDir": layer.HostDirs["/var/lib/kubelet/pod-resources"],
			"stateDir":        layer.HostDirs["/var/lib/gpu-agent"],
			"mpsRoot":         layer.HostDirs["/run/gpu-agent/mps"],
		},
		"cdi": map[string]any{"specDir": layer.HostDirs["/var/run/cdi"]},
	})
	kv, err := chartutil.ParseKubeVersion(serverVersion)
	if err != nil {
		return nil, fmt.Errorf("helm: server version %q: %w", serverVersion, err)
	}
	if kc := chrt.Metadata.KubeVersion; kc != "" && !chartutil.IsCompatibleRange(kc, kv.String()) {
		return nil, fmt.Errorf("helm: chart requires kubeVersion %s, the API server is %s", kc, kv)
	}
	caps := chartutil.DefaultCapabilities.Copy()
	caps.KubeVersion = *kv
	rv, err := chartutil.ToRenderValues(chrt, vals, chartutil.ReleaseOptions{
		Name: name, Namespace: namespace, Revision: 1, IsInstall: true,
	}, caps)
	if err != nil {
		return nil, fmt.Errorf("helm: values: %w", err)
	}
	files, err := engine.Render(chrt, rv)
	if err != nil {
		return nil, fmt.Errorf("helm: render: %w", err)
	}
	// As `helm template`: every template's documents, partials and NOTES.txt left out, empty documents dropped.
	var names []string
	for n := range files {
		if strings.HasSuffix(n, ".yaml") || strings.HasSuffix(n, ".yml") {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	var manifest bytes.Buffer
	for _, n := range names {
		docs := releaseutil.SplitManifests(files[n])
		keys := make([]string, 0, len(docs))
		for k := range docs {
			keys = append(keys, k)
		}
		sort.Sort(releaseutil.BySplitManifestsOrder(keys))
		for _, k := range keys {
			if strings.TrimSpace(docs[k]) == "" {
				continue
			}
			fmt.Fprintf(&manifest, "---\n# Source: %s\n%s\n", n, strings.TrimSpace(docs[k]))
		}
	}
	dir := filepath.Join(c.d.run, "install", "helm")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "rendered.yaml"), manifest.Bytes(), 0o644); err != nil {
		return nil, err
	}
	rendered, err := DecodeObjects(manifest.Bytes())
	if err != nil {
		return nil, fmt.Errorf("helm: rendered manifest: %w", err)
	}
	ds, err := AgentDaemonSet(rendered)
	if err != nil {
		return nil, fmt.Errorf("helm: %w", err)
	}
	k, err := nodeKustomization([]string{"rendered.yaml"}, ds.Name, layer, nil, nil)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "kustomization.yaml"), k, 0o644); err != nil {
		return nil, err
	}
	return c.buildChecked(dir, layer)
}

// mergeValues merges src into dst as helm merges values files: maps recursively, anything else replaced.
func mergeValues(dst, src map[string]any) {
	for k, v := range src {
		if sm, ok := v.(map[string]any); ok {
			if dm, ok := dst[k].(map[string]any); ok {
				mergeValues(dm, sm)
				continue
			}
		}
		dst[k] = v
	}
}

// SampleInterval is the agent's --sample-interval on e2e nodes.
const SampleInterval = 2 * time.Second

// nodeKustomization renders the node layer's kustomization over resources: every DaemonSet on the host
// network; and on the agent's DaemonSet (agent), a strategic merge patch (the API server's address, the
// volumes' host paths, if given) and, if given, a JSON patch.
func nodeKustomization(resources []string, agent string, layer NodeLayer, volumes []map[string]any, jsonPatch []map[string]any) ([]byte, error) {
	type obj = map[string]any
	smp := func(spec obj) (string, error) {
		b, err := yaml.Marshal(obj{
			"apiVersion": "apps/v1",
			"kind":       "DaemonSet",
			"metadata":   obj{"name": "any"}, // the patch's target selects
			"spec":       obj{"template": obj{"spec": spec}},
		})
		return string(b), err
	}
	hostNetwork, err := smp(obj{"hostNetwork": true})
	if err != nil {
		return nil, err
	}
	env := []obj{
		{"name": "KUBERNETES_SERVICE_HOST", "value": layer.APIHost},
		{"name": "KUBERNETES_SERVICE_PORT", "value": fmt.Sprint(layer.APIPort)},
		// A pass every 2 s, not the default 10: the tests that wait on /metrics or /holders wait for a
		// few passes, and a sim's pass costs little.
		{"name": "GPU_AGENT_SAMPLE_INTERVAL", "value": SampleInterval.String()},
	}
	if layer.DevRoot != "" {
		env = append(env, obj{"name": "NVIDIA_DEV_ROOT", "value": layer.DevRoot})
	}
	agentSpec := obj{
		// The container is matched by name; AgentDaemonSet checks it.
		"containers": []obj{{"name": agentContainer, "env": env}},
	}
	if len(volumes) > 0 {
		agentSpec["volumes"] = volumes
	}
	agentPatch, err := smp(agentSpec)
	if err != nil {
		return nil, err
	}
	all := obj{"group": "apps", "version": "v1", "kind": "DaemonSet"}
	// kustomize anchors the name: exactly the agent's DaemonSet.
	one := obj{"group": "apps", "version": "v1", "kind": "DaemonSet", "name": agent}
	patches := []obj{{"target": all, "patch": hostNetwork}, {"target": one, "patch": agentPatch}}
	if len(jsonPatch) > 0 {
		jp, err := yaml.Marshal(jsonPatch)
		if err != nil {
			return nil, err
		}
		patches = append(patches, obj{"target": one, "patch": string(jp)})
	}
	body, err := yaml.Marshal(obj{
		"apiVersion": "kustomize.config.k8s.io/v1beta1",
		"kind":       "Kustomization",
		"resources":  resources,
		"patches":    patches,
	})
	if err != nil {
		return nil, err
	}
	return append([]byte("# The e2e node layer (test/e2e/harness/install.go), generated for this run.\n"), body...), nil
}

// buildChecked builds the node layer's kustomization and checks that the DaemonSet touches no host
// directory outside the run but the kubelet's device plugin directory.
func (c *Cluster) buildChecked(dir string, layer NodeLayer) ([]*unstructured.Unstructured, error) {
	out, err := Kustomize(dir)
	if err != nil {
		return nil, err
	}
	if err := os.WriteFile(filepath.Join(dir, "built.yaml"), out, 0o644); err != nil {
		return nil, err
	}
	objs, err := DecodeObjects(out)
	if err != nil {
		return nil, err
	}
	if _, err := AgentDaemonSet(objs); err != nil {
		return nil, err
	}
	dss, err := daemonSets(objs)
	if err != nil {
		return nil, err
	}
	for _, ds := range dss {
		for _, v := range ds.Spec.Template.Spec.Volumes {
			if v.HostPath == nil {
				continue
			}
			// The host's /proc is the holder tracker's, mounted read-only: it reads processes, nothing more.
			if p := v.HostPath.Path; p != DevicePluginDir && p != DRAPluginsDir && p != "/proc" && !strings.HasPrefix(p, c.d.run+"/") {
				return nil, fmt.Errorf("%s: DaemonSet %s: volume %s would mount the host's %s", dir, ds.Name, v.Name, p)
			}
		}
		if !ds.Spec.Template.Spec.HostNetwork {
			return nil, fmt.Errorf("%s: DaemonSet %s does not use the host network", dir, ds.Name)
		}
	}
	return objs, nil
}

// DecodeObjects reads a YAML stream of Kubernetes objects; empty documents are skipped.
func DecodeObjects(data []byte) ([]*unstructured.Unstructured, error) {
	var objs []*unstructured.Unstructured
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	for {
		var m map[string]any
		if err := dec.Decode(&m); err != nil {
			if errors.Is(err, io.EOF) {
				return objs, nil
			}
			return nil, err
		}
		if len(m) == 0 {
			continue
		}
		u := &unstructured.Unstructured{Object: m}
		if u.GetKind() == "" || u.GetAPIVersion() == "" || u.GetName() == "" {
			return nil, fmt.Errorf("object without kind, apiVersion or name: %v", m)
		}
		objs = append(objs, u)
	}
}

// mountIndex is the index of the agent container's volume mount at path, -1 if none.
func mountIndex(ds *appsv1.DaemonSet, path string) int {
	for i, m := range ds.Spec.Template.Spec.Containers[0].VolumeMounts {
		if m.MountPath == path {
			return i
		}
	}
	return -1
}

// agentContainer is the name of gpu-agent's container in the DaemonSet (deploy/manifests, the chart).
const agentContainer = "gpu-agent"

func daemonSets(objs []*unstructured.Unstructured) ([]*appsv1.DaemonSet, error) {
	var out []*appsv1.DaemonSet
	for _, o := range objs {
		if o.GetKind() != "DaemonSet" {
			continue
		}
		var ds appsv1.DaemonSet
		if err := runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &ds); err != nil {
			return nil, fmt.Errorf("DaemonSet %s: %w", o.GetName(), err)
		}
		out = append(out, &ds)
	}
	return out, nil
}

// AgentDaemonSet returns the DaemonSet among objs that runs the agent (`gpu-agent run`, in a container named
// gpu-agent); there must be exactly one, with that one container. (The chart's MPS host DaemonSet, when
// enabled, runs `gpu-agent mps-host`.)
func AgentDaemonSet(objs []*unstructured.Unstructured) (*appsv1.DaemonSet, error) {
	dss, err := daemonSets(objs)
	if err != nil {
		return nil, err
	}
	var found []*appsv1.DaemonSet
	for _, ds := range dss {
		cs := ds.Spec.Template.Spec.Containers
		if len(cs) > 0 && len(cs[0].Args) > 0 && cs[0].Args[0] == "run" {
			found = append(found, ds)
		}
	}
	if len(found) != 1 {
		return nil, fmt.Errorf("%d DaemonSets run `gpu-agent run`, want 1", len(found))
	}
	if cs := found[0].Spec.Template.Spec.Containers; len(cs) != 1 || cs[0].Name != agentContainer {
		return nil, fmt.Errorf("DaemonSet %s: want one container, %s", found[0].Name, agentContainer)
	}
	return found[0], nil
}

// applyOrder ranks kinds as helm's install order does, for the kinds an install here has: namespaces and
// CRDs first, then what pods need (service accounts, config, RBAC), then the workloads.
var applyOrder = []string{"Namespace", "CustomResourceDefinition", "PriorityClass", "ServiceAccount", "Secret",
	"ConfigMap", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Service", "DaemonSet", "Deployment"}

func applyRank(kind string) int {
	for i, k := range applyOrder {
		if k == kind {
			return i
		}
	}
	return len(applyOrder)
}

// Apply applies objs server-side (as `kubectl apply --server-side` does; field manager gpu-agent-e2e), in
// install order, waiting for each CustomResourceDefinition to be established before the objects after it.
func (c *Cluster) Apply(ctx context.Context, objs []*unstructured.Unstructured) error {
	sorted := append([]*unstructured.Unstructured(nil), objs...)
	sort.SliceStable(sorted, func(i, j int) bool { return applyRank(sorted[i].GetKind()) < applyRank(sorted[j].GetKind()) })
	mapper := restmapper.NewDeferredDiscoveryRESTMapper(memory.NewMemCacheClient(c.Client.Discovery()))
	defined := map[string]bool{} // group/kind of the CRDs applied so far
	for _, o := range sorted {
		gvk := o.GroupVersionKind()
		var m *meta.RESTMapping
		err := poll(ctx, 200*time.Millisecond, func() error {
			var err error
			m, err = mapper.RESTMapping(gvk.GroupKind(), gvk.Version)
			if meta.IsNoMatchError(err) && defined[gvk.GroupKind().String()] {
				mapper.Reset() // an established CRD reaches discovery a moment later
				return err
			}
			if err != nil {
				return stop(err)
			}
			return nil
		})
		if err != nil {
			return fmt.Errorf("apply %s %s: %w", gvk.Kind, o.GetName(), err)
		}
		ri := c.Dynamic.Resource(m.Resource)
		var applied *unstructured.Unstructured
		if m.Scope.Name() == "namespace" {
			if o.GetNamespace() == "" {
				return fmt.Errorf("apply %s %s: no namespace", gvk.Kind, o.GetName())
			}
			applied, err = ri.Namespace(o.GetNamespace()).Apply(ctx, o.GetName(), o, metav1.ApplyOptions{FieldManager: "gpu-agent-e2e", Force: true})
		} else {
			applied, err = ri.Apply(ctx, o.GetName(), o, metav1.ApplyOptions{FieldManager: "gpu-agent-e2e", Force: true})
		}
		if err != nil {
			return fmt.Errorf("apply %s %s/%s: %w", gvk.Kind, o.GetNamespace(), o.GetName(), err)
		}
		if gvk.Kind == "CustomResourceDefinition" {
			if err := c.waitEstablished(ctx, m.Resource, applied.GetName()); err != nil {
				return err
			}
			group, _, _ := unstructured.NestedString(o.Object, "spec", "group")
			kind, _, _ := unstructured.NestedString(o.Object, "spec", "names", "kind")
			defined[schema.GroupKind{Group: group, Kind: kind}.String()] = true
		}
	}
	return nil
}

func (c *Cluster) waitEstablished(ctx context.Context, gvr schema.GroupVersionResource, name string) error {
	err := poll(ctx, 100*time.Millisecond, func() error {
		crd, err := c.Dynamic.Resource(gvr).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		conds, _, _ := unstructured.NestedSlice(crd.Object, "status", "conditions")
		for _, cond := range conds {
			if m, ok := cond.(map[string]any); ok && m["type"] == "Established" && m["status"] == "True" {
				return nil
			}
		}
		return errors.New("not established")
	})
	if err != nil {
		return fmt.Errorf("CustomResourceDefinition %s: %w", name, err)
	}
	return nil
}

// ReadObjects reads a YAML file of objects (e.g. a CRD under testdata).
func ReadObjects(path string) ([]*unstructured.Unstructured, error) {
	b, err := os.ReadFile(path)
	if err != nil {
		return nil, err
	}
	objs, err := DecodeObjects(b)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return objs, nil
}
