package deploy

import (
	"reflect"
	"slices"
	"strings"
	"testing"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/api/resource"
)

// hostDirs are the host directories the agent needs, by the flag that names
// the path inside the container (the pod-resources socket lives in its dir).
var hostDirFlags = map[string]string{
	"/var/lib/kubelet/device-plugins": "--device-plugin-dir",
	"/var/lib/kubelet/pod-resources":  "--pod-resources-socket",
	"/var/lib/gpu-agent":              "--state-dir",
	"/run/gpu-agent/mps":              "--mps-root",
}

// daemonSetRunning is the DaemonSet whose container runs the gpu-agent
// subcommand sub (nil: none does).
func daemonSetRunning(o *objects, sub string) *appsv1.DaemonSet {
	for _, ds := range o.DaemonSets {
		if cs := ds.Spec.Template.Spec.Containers; len(cs) > 0 && len(cs[0].Args) > 0 && cs[0].Args[0] == sub {
			return ds
		}
	}
	return nil
}

// agentDaemonSet runs `gpu-agent run`; mpsDaemonSet `gpu-agent mps-host`.
func agentDaemonSet(o *objects) *appsv1.DaemonSet { return daemonSetRunning(o, "run") }
func mpsDaemonSet(o *objects) *appsv1.DaemonSet   { return daemonSetRunning(o, "mps-host") }

// checkInstall asserts what issue 9 asks of every install variant: the parts
// that must agree with each other (DaemonSets, Service, ServiceMonitor, RBAC).
// wantMPSHost: besides the agent's, the mps-host DaemonSet is installed.
func checkInstall(t *testing.T, o *objects, wantServiceMonitor, wantMPSHost bool) {
	t.Helper()
	want := 1
	if wantMPSHost {
		want = 2
	}
	if len(o.DaemonSets) != want {
		t.Fatalf("got %d DaemonSets, want %d (the agent's, and mps-host's: %v)", len(o.DaemonSets), want, wantMPSHost)
	}
	ds := agentDaemonSet(o)
	if ds == nil {
		t.Fatal("no DaemonSet runs gpu-agent run")
	}
	checkDaemonSet(t, ds)
	if wantMPSHost {
		m := mpsDaemonSet(o)
		if m == nil {
			t.Fatal("no DaemonSet runs gpu-agent mps-host")
		}
		checkMPSDaemonSet(t, m, ds)
	}
	if len(o.ServiceAccounts) != 1 || o.ServiceAccounts[0].Name != ds.Spec.Template.Spec.ServiceAccountName {
		t.Errorf("ServiceAccount %v does not match the DaemonSet's %q", o.ServiceAccounts, ds.Spec.Template.Spec.ServiceAccountName)
	}
	checkRBAC(t, o, ds.Spec.Template.Spec.ServiceAccountName, ds.Namespace)
	checkPolicies(t, o, ds.Spec.Template.Spec.ServiceAccountName, ds.Namespace)

	podLabels := ds.Spec.Template.Labels
	if len(o.Services) != 1 {
		t.Fatalf("got %d Services, want 1", len(o.Services))
	}
	svc := o.Services[0]
	if !selects(svc.Spec.Selector, podLabels) {
		t.Errorf("Service selector %v does not select the pods %v", svc.Spec.Selector, podLabels)
	}
	if m := mpsDaemonSet(o); m != nil && selects(svc.Spec.Selector, m.Spec.Template.Labels) {
		t.Errorf("Service selector %v also selects the mps-host pods %v", svc.Spec.Selector, m.Spec.Template.Labels)
	}
	if len(svc.Spec.Ports) != 1 || svc.Spec.Ports[0].Name != "metrics" || svc.Spec.Ports[0].Port != 9400 ||
		svc.Spec.Ports[0].TargetPort.String() != "metrics" {
		t.Errorf("Service ports = %+v, want metrics 9400 -> metrics", svc.Spec.Ports)
	}
	if !wantServiceMonitor {
		if len(o.ServiceMonitors) != 0 {
			t.Errorf("got %d ServiceMonitors, want none", len(o.ServiceMonitors))
		}
		return
	}
	if len(o.ServiceMonitors) != 1 {
		t.Fatalf("got %d ServiceMonitors, want 1", len(o.ServiceMonitors))
	}
	sm := o.ServiceMonitors[0]
	if !selects(sm.Spec.Selector.MatchLabels, svc.Labels) || sm.Metadata.Namespace != svc.Namespace {
		t.Errorf("ServiceMonitor selector %v (namespace %q) does not select the Service %v (%q)",
			sm.Spec.Selector.MatchLabels, sm.Metadata.Namespace, svc.Labels, svc.Namespace)
	}
	if len(sm.Spec.Endpoints) != 1 || sm.Spec.Endpoints[0].Port != "metrics" || sm.Spec.Endpoints[0].Path != "/metrics" {
		t.Errorf("ServiceMonitor endpoints = %+v, want port metrics, path /metrics", sm.Spec.Endpoints)
	}
}

func selects(selector, labels map[string]string) bool {
	if len(selector) == 0 {
		return false
	}
	for k, v := range selector {
		if labels[k] != v {
			return false
		}
	}
	return true
}

func checkDaemonSet(t *testing.T, ds *appsv1.DaemonSet) {
	t.Helper()
	if !selects(ds.Spec.Selector.MatchLabels, ds.Spec.Template.Labels) {
		t.Errorf("selector %v does not select the template labels %v", ds.Spec.Selector.MatchLabels, ds.Spec.Template.Labels)
	}
	us := ds.Spec.UpdateStrategy
	if us.Type != appsv1.RollingUpdateDaemonSetStrategyType || us.RollingUpdate == nil ||
		us.RollingUpdate.MaxUnavailable == nil || us.RollingUpdate.MaxUnavailable.String() != "1" {
		t.Errorf("updateStrategy = %+v, want RollingUpdate with maxUnavailable 1", us)
	}
	ps := ds.Spec.Template.Spec
	if ps.PriorityClassName != "system-node-critical" {
		t.Errorf("priorityClassName = %q, want system-node-critical", ps.PriorityClassName)
	}
	if ps.NodeSelector["nvidia.com/gpu.present"] != "true" {
		t.Errorf("nodeSelector = %v, want nvidia.com/gpu.present=true", ps.NodeSelector)
	}
	if !slices.ContainsFunc(ps.Tolerations, func(tol corev1.Toleration) bool {
		return tol.Key == "nvidia.com/gpu" && tol.Operator == corev1.TolerationOpExists
	}) {
		t.Errorf("tolerations %+v do not tolerate nvidia.com/gpu taints", ps.Tolerations)
	}
	if ps.HostNetwork || ps.HostPID {
		t.Errorf("hostNetwork/hostPID set; the agent needs neither")
	}
	if len(ps.Containers) != 1 {
		t.Fatalf("got %d containers, want 1", len(ps.Containers))
	}
	c := ps.Containers[0]
	if len(c.Args) == 0 || c.Args[0] != "run" {
		t.Errorf("args = %v, want the run subcommand first", c.Args)
	}

	volumes := map[string]corev1.Volume{}
	for _, v := range ps.Volumes {
		volumes[v.Name] = v
	}
	mounted := map[string]corev1.VolumeMount{} // by host path
	var configMount *corev1.VolumeMount
	for _, m := range c.VolumeMounts {
		v, ok := volumes[m.Name]
		if !ok {
			t.Errorf("volumeMount %q has no volume", m.Name)
			continue
		}
		if m.SubPath != "" {
			t.Errorf("volumeMount %q uses subPath: a ConfigMap edit would never reach it", m.Name)
		}
		switch {
		case v.HostPath != nil:
			mounted[v.HostPath.Path] = m
		case v.ConfigMap != nil:
			configMount = &m
		}
	}
	for dir, flag := range hostDirFlags {
		m, ok := mounted[dir]
		if !ok {
			t.Errorf("host directory %s is not mounted", dir)
			continue
		}
		if !slices.ContainsFunc(c.Args, func(a string) bool { return strings.HasPrefix(a, flag+"="+m.MountPath) }) {
			t.Errorf("%s is mounted at %s but no %s flag points there (args %v)", dir, m.MountPath, flag, c.Args)
		}
	}
	if configMount == nil {
		t.Errorf("the config ConfigMap is not mounted")
	} else if !slices.ContainsFunc(c.Args, func(a string) bool {
		// One key of the mount, or the mount itself (every key).
		return strings.HasPrefix(a, "--config="+configMount.MountPath+"/") || a == "--config="+configMount.MountPath
	}) {
		t.Errorf("--config does not point into or at the ConfigMap mount %s (args %v)", configMount.MountPath, c.Args)
	}

	if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool {
		return e.Name == "NODE_NAME" && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil && e.ValueFrom.FieldRef.FieldPath == "spec.nodeName"
	}) {
		t.Errorf("NODE_NAME does not come from the downward API spec.nodeName (env %+v)", c.Env)
	}
	if len(c.Ports) != 1 || c.Ports[0].Name != "metrics" || c.Ports[0].ContainerPort != 9400 ||
		!slices.Contains(c.Args, "--listen=:9400") {
		t.Errorf("ports %+v / args %v: want the metrics port 9400 that --listen serves", c.Ports, c.Args)
	}
	for _, p := range []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{{"liveness", c.LivenessProbe, "/healthz"}, {"readiness", c.ReadinessProbe, "/readyz"}} {
		if p.probe == nil || p.probe.HTTPGet == nil || p.probe.HTTPGet.Path != p.path || p.probe.HTTPGet.Port.String() != "metrics" {
			t.Errorf("%s probe = %+v, want GET %s on the metrics port", p.name, p.probe, p.path)
		}
		// cmd/gpu-agent's TestHTTPProbesAnsweredThroughScrapeStorm holds
		// the agent to answering within this.
		if p.probe != nil && p.probe.TimeoutSeconds != 1 {
			t.Errorf("%s probe timeoutSeconds = %d, want 1", p.name, p.probe.TimeoutSeconds)
		}
	}
	for _, r := range []struct {
		what string
		list corev1.ResourceList
		want string
	}{{"memory request", c.Resources.Requests, "96Mi"}, {"memory limit", c.Resources.Limits, "128Mi"}} {
		got := r.list[corev1.ResourceMemory]
		if got.Cmp(resource.MustParse(r.want)) != 0 {
			t.Errorf("%s = %s, want %s", r.what, got.String(), r.want)
		}
	}
	sc := c.SecurityContext
	if sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != 0 {
		t.Errorf("securityContext %+v: want runAsUser 0 (the kubelet's directories are root-owned)", sc)
	}
}

// checkRBAC asserts the ClusterRole and Role grant only what the agent uses
// (deploy/README.md justifies each verb), and the Role only on the
// ConfigMap the DaemonSet reads.
func checkRBAC(t *testing.T, o *objects, sa, ns string) {
	t.Helper()
	if len(o.ClusterRoles) != 1 || len(o.ClusterRoleBindings) != 1 || len(o.Roles) != 1 || len(o.RoleBindings) != 1 {
		t.Fatalf("got %d ClusterRoles, %d bindings, %d Roles, %d bindings; want 1 each",
			len(o.ClusterRoles), len(o.ClusterRoleBindings), len(o.Roles), len(o.RoleBindings))
	}
	// pods: read only, for the pod UIDs and container IDs of GPU processes
	// (never get one by name, never write).
	allowed := map[string][]string{"nodes": {"get", "list", "watch", "patch"}, "events": {"create", "patch"}, "pods": {"list", "watch"}}
	for _, r := range o.ClusterRoles[0].Rules {
		for _, res := range r.Resources {
			for _, verb := range r.Verbs {
				if !slices.Contains(allowed[res], verb) {
					t.Errorf("ClusterRole grants %s on %s; the agent only needs %v", verb, res, allowed)
				}
			}
		}
	}
	cm := ""
	if ds := agentDaemonSet(o); ds != nil {
		cm = configMapVolume(ds)
	}
	for _, r := range o.Roles[0].Rules {
		if !slices.Equal(r.Resources, []string{"configmaps"}) || !slices.Equal(r.ResourceNames, []string{cm}) {
			t.Errorf("Role rule %+v: want configmaps, only %q", r, cm)
		}
		for _, verb := range r.Verbs {
			if !slices.Contains([]string{"get", "list", "watch"}, verb) {
				t.Errorf("Role grants %s on ConfigMaps; the agent only reads", verb)
			}
		}
	}
	if o.Roles[0].Namespace != ns {
		t.Errorf("Role in namespace %q, want %q", o.Roles[0].Namespace, ns)
	}
	b := o.ClusterRoleBindings[0]
	if b.RoleRef.Kind != "ClusterRole" || b.RoleRef.Name != o.ClusterRoles[0].Name {
		t.Errorf("binding roleRef %+v, want ClusterRole %s", b.RoleRef, o.ClusterRoles[0].Name)
	}
	rb := o.RoleBindings[0]
	if rb.RoleRef.Kind != "Role" || rb.RoleRef.Name != o.Roles[0].Name {
		t.Errorf("role binding roleRef %+v, want Role %s", rb.RoleRef, o.Roles[0].Name)
	}
	for _, subjects := range [][]rbacv1.Subject{b.Subjects, rb.Subjects} {
		if !slices.ContainsFunc(subjects, func(s rbacv1.Subject) bool {
			return s.Kind == "ServiceAccount" && s.Name == sa && s.Namespace == ns
		}) {
			t.Errorf("binding subjects %+v do not include ServiceAccount %s/%s", subjects, ns, sa)
		}
	}
}

// configMapVolume is the name of the ConfigMap the DaemonSet mounts.
func configMapVolume(ds *appsv1.DaemonSet) string {
	for _, v := range ds.Spec.Template.Spec.Volumes {
		if v.ConfigMap != nil {
			return v.ConfigMap.Name
		}
	}
	return ""
}

// checkMPSDaemonSet asserts what the mps-host DaemonSet needs to run the MPS
// daemons for the agent's clients on the same nodes, and that an upgrade
// never restarts it by itself.
func checkMPSDaemonSet(t *testing.T, m, agent *appsv1.DaemonSet) {
	t.Helper()
	if !selects(m.Spec.Selector.MatchLabels, m.Spec.Template.Labels) {
		t.Errorf("mps-host selector %v does not select its template labels %v", m.Spec.Selector.MatchLabels, m.Spec.Template.Labels)
	}
	// Overlapping DaemonSet selectors make both controllers fight over pods.
	if selects(m.Spec.Selector.MatchLabels, agent.Spec.Template.Labels) || selects(agent.Spec.Selector.MatchLabels, m.Spec.Template.Labels) {
		t.Errorf("selectors overlap: mps-host %v, agent %v", m.Spec.Selector.MatchLabels, agent.Spec.Selector.MatchLabels)
	}
	if m.Namespace != agent.Namespace || m.Name == agent.Name {
		t.Errorf("mps-host DaemonSet %s/%s beside the agent's %s/%s: want the same namespace, another name", m.Namespace, m.Name, agent.Namespace, agent.Name)
	}
	if m.Spec.UpdateStrategy.Type != appsv1.OnDeleteDaemonSetStrategyType {
		t.Errorf("mps-host updateStrategy = %+v, want OnDelete: a restart ends every MPS daemon and client", m.Spec.UpdateStrategy)
	}
	ps, as := m.Spec.Template.Spec, agent.Spec.Template.Spec
	// On every node the agent runs, and only there.
	if !reflect.DeepEqual(ps.NodeSelector, as.NodeSelector) || !reflect.DeepEqual(ps.Tolerations, as.Tolerations) ||
		!reflect.DeepEqual(ps.Affinity, as.Affinity) || ps.PriorityClassName != as.PriorityClassName ||
		!reflect.DeepEqual(ps.RuntimeClassName, as.RuntimeClassName) || !reflect.DeepEqual(ps.ImagePullSecrets, as.ImagePullSecrets) {
		t.Errorf("mps-host placement (nodeSelector %v, tolerations %v, affinity %v, priority %q) differs from the agent's (%v, %v, %v, %q)",
			ps.NodeSelector, ps.Tolerations, ps.Affinity, ps.PriorityClassName, as.NodeSelector, as.Tolerations, as.Affinity, as.PriorityClassName)
	}
	if !ps.HostIPC || ps.HostPID || ps.HostNetwork {
		t.Errorf("mps-host hostIPC %v, hostPID %v, hostNetwork %v: want host IPC (MPS clients share it) and nothing else",
			ps.HostIPC, ps.HostPID, ps.HostNetwork)
	}
	if ps.AutomountServiceAccountToken == nil || *ps.AutomountServiceAccountToken {
		t.Error("mps-host mounts a service account token; it never calls the API")
	}
	if len(ps.Containers) != 1 {
		t.Fatalf("mps-host: %d containers, want 1", len(ps.Containers))
	}
	c, ac := ps.Containers[0], as.Containers[0]
	if c.Image != ac.Image {
		t.Errorf("mps-host image %q, the agent's %q", c.Image, ac.Image)
	}
	if c.LivenessProbe != nil || c.ReadinessProbe != nil || c.StartupProbe != nil {
		t.Error("mps-host has a probe; a failed one would restart it and end every MPS client")
	}
	if l, ok := c.Resources.Limits[corev1.ResourceMemory]; ok {
		t.Errorf("mps-host memory limit %s: the MPS servers run in its cgroup, and an OOM kill ends every client", l.String())
	}

	volumes := map[string]corev1.Volume{}
	for _, v := range ps.Volumes {
		volumes[v.Name] = v
	}
	hostPathAt := func(c corev1.Container, vols map[string]corev1.Volume, mountPath string) string {
		for _, vm := range c.VolumeMounts {
			if v, ok := vols[vm.Name]; ok && vm.MountPath == mountPath && v.HostPath != nil {
				return v.HostPath.Path
			}
		}
		return ""
	}
	agentVolumes := map[string]corev1.Volume{}
	for _, v := range as.Volumes {
		agentVolumes[v.Name] = v
	}
	// Both see the same MPS root: desired.json, health.json, the pipes.
	root, agentRoot := flagValue(c.Args, "--mps-root"), flagValue(ac.Args, "--mps-root")
	if hp := hostPathAt(c, volumes, root); hp == "" || hp != hostPathAt(ac, agentVolumes, agentRoot) || root != agentRoot {
		t.Errorf("mps-host --mps-root %q (host %q) is not the agent's %q (host %q)", root, hp, agentRoot, hostPathAt(ac, agentVolumes, agentRoot))
	}
	// The daemons' /dev/shm is the directory the agent hands to clients.
	if hp, shm := hostPathAt(c, volumes, "/dev/shm"), flagValue(ac.Args, "--mps-shm-dir"); hp == "" || hp != shm {
		t.Errorf("mps-host /dev/shm is host %q, the agent hands clients %q", hp, shm)
	}
	if !slices.Contains(ac.Args, "--mps-host=true") {
		t.Errorf("agent args %v lack --mps-host=true: it would run daemons itself", ac.Args)
	}
	sc := c.SecurityContext
	if sc == nil || sc.RunAsUser == nil || *sc.RunAsUser != 0 {
		t.Errorf("mps-host securityContext %+v: want runAsUser 0", sc)
	}
}
