package deploy

import (
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"sort"
	"strings"
	"testing"

	cdv1 "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
	"github.com/gpu-agent/gpu-agent/computedomain/controller"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"
)

// loadComputeDomainsComponent decodes the computedomains component strictly,
// with the components it brings (dra).
func loadComputeDomainsComponent(t *testing.T) *objects {
	t.Helper()
	o := &objects{}
	var load func(dir string)
	load = func(dir string) {
		var k struct {
			APIVersion string   `json:"apiVersion"`
			Kind       string   `json:"kind"`
			Components []string `json:"components"`
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
			t.Fatalf("%s/kustomization.yaml: kind %q, %v", dir, k.Kind, err)
		}
		for _, c := range k.Components {
			load(filepath.Join(dir, c))
		}
		for _, f := range k.Resources {
			data, err := os.ReadFile(filepath.Join(dir, f))
			if err != nil {
				t.Fatal(err)
			}
			if err := decodeStrict(f, data, o); err != nil {
				t.Fatal(err)
			}
		}
	}
	load(repoPath("deploy", "manifests", "computedomains"))
	return o
}

// The compute domain install: off by default; on with computeDomains.enabled alone in the chart (which turns
// the agent's DRA on) and with the computedomains component alone in kustomize (which brings dra); the two
// give the same CRD, DeviceClasses, rules and controller.
func TestComputeDomainsInstall(t *testing.T) {
	off, err := renderChart(t, "")
	if err != nil {
		t.Fatal(err)
	}
	if len(off.CRDs)+len(off.Deployments) != 0 || hasRule(off.ClusterRoles, "computedomains") {
		t.Fatalf("compute domains are on by default: %d CRDs, %d Deployments", len(off.CRDs), len(off.Deployments))
	}
	chart, err := renderChart(t, "computeDomains: {enabled: true}\n")
	if err != nil {
		t.Fatal(err)
	}
	if flagValue(container(chart).Args, "--dra") == "" && !slices.Contains(container(chart).Args, "--dra") {
		t.Errorf("computeDomains.enabled alone does not turn the agent's DRA driver on: args %v", container(chart).Args)
	}
	comp := loadComputeDomainsComponent(t)
	if !hasRule(comp.ClusterRoles, "resourceslices") {
		t.Error("the computedomains component does not bring the dra component")
	}
	for name, o := range map[string]*objects{"manifests": comp, "chart": chart} {
		if len(o.CRDs) != 1 || len(o.Deployments) != 1 {
			t.Fatalf("%s: %d CRDs and %d Deployments, want one each", name, len(o.CRDs), len(o.Deployments))
		}
		checkCRD(t, name, o.CRDs[0])
		checkComputeDomainClasses(t, name, o)
		checkControllerRBAC(t, name, o)
		checkControllerDeployment(t, name, o)
	}
	// One schema: the chart's copy of the CRD is the manifests'.
	a, b := comp.CRDs[0].Spec, chart.CRDs[0].Spec
	if !reflect.DeepEqual(a, b) {
		t.Error("the chart's CRD (deploy/helm/gpu-agent/files/computedomains-crd.yaml) differs from deploy/manifests/computedomains/crd.yaml")
	}
	if chart.CRDs[0].Annotations["helm.sh/resource-policy"] != "keep" {
		t.Error("the chart's CRD is not kept on uninstall: every domain would be deleted with it")
	}

	noClasses, err := renderChart(t, "computeDomains: {enabled: true, deviceClasses: false}\n")
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range noClasses.DeviceClasses {
		if strings.HasPrefix(c.Name, "compute-domain") {
			t.Errorf("deviceClasses: false still installs %s", c.Name)
		}
	}
	one, err := renderChartIn(t, "computeDomains: {enabled: true, controller: {replicas: 1, priorityClassName: \"\"}}\n", "other-ns")
	if err != nil {
		t.Fatal(err)
	}
	d := one.Deployments[0]
	if *d.Spec.Replicas != 1 || d.Spec.Template.Spec.PriorityClassName != "" || d.Namespace != "other-ns" {
		t.Errorf("values not applied: replicas %d, priority class %q, namespace %s", *d.Spec.Replicas, d.Spec.Template.Spec.PriorityClassName, d.Namespace)
	}
}

func checkComputeDomainClasses(t *testing.T, name string, o *objects) {
	t.Helper()
	want := map[string]string{
		controller.DeviceClassDaemon:  "device.driver == 'compute-domain.nvidia.com' && device.attributes['compute-domain.nvidia.com'].type == 'daemon'",
		controller.DeviceClassChannel: "device.driver == 'compute-domain.nvidia.com' && device.attributes['compute-domain.nvidia.com'].type == 'channel' && device.attributes['compute-domain.nvidia.com'].id == 0",
	}
	for n, expr := range want {
		i := slices.IndexFunc(o.DeviceClasses, func(c *resourcev1.DeviceClass) bool { return c.Name == n })
		if i < 0 {
			t.Errorf("%s: no DeviceClass %s", name, n)
			continue
		}
		sel := o.DeviceClasses[i].Spec.Selectors
		if len(sel) != 1 || sel[0].CEL == nil || sel[0].CEL.Expression != expr {
			t.Errorf("%s: DeviceClass %s selects %+v, want %q", name, n, sel, expr)
		}
	}
}

// checkControllerRBAC: the controller's rules are exactly these, and the agent gets only reads of domains and
// patches of their status.
func checkControllerRBAC(t *testing.T, name string, o *objects) {
	t.Helper()
	ctl := roleBoundTo(o, "controller")
	want := map[string]string{
		"computedomains":         "list,update,watch",
		"computedomains/status":  "update",
		"resourceclaimtemplates": "create,delete,get,list,watch",
		"resourceclaims":         "list,watch",
		"resourceclaims/status":  "patch",
		"resourceclaims/driver":  "arbitrary-node:patch",
		"nodes":                  "list,watch",
	}
	got := map[string]string{}
	for _, r := range ctl.Rules {
		for _, res := range r.Resources {
			got[res] = ruleVerbs([]*rbacv1.ClusterRole{ctl}, res)
		}
		if slices.Contains(r.Resources, "resourceclaims/driver") && !slices.Equal(r.ResourceNames, []string{controller.DriverName}) {
			t.Errorf("%s: the controller may write status.devices of drivers %v, want only %s", name, r.ResourceNames, controller.DriverName)
		}
	}
	if !reflect.DeepEqual(got, want) {
		t.Errorf("%s: controller rules %v, want %v", name, got, want)
	}
	agent := ""
	for _, r := range o.ClusterRoles {
		if strings.HasSuffix(r.Name, "-computedomains") {
			agent = ruleVerbs([]*rbacv1.ClusterRole{r}, "computedomains") + " " + ruleVerbs([]*rbacv1.ClusterRole{r}, "computedomains/status")
		}
	}
	if agent != "get,list,watch patch" {
		t.Errorf("%s: the agent's compute domain rules %q, want reads and status patch", name, agent)
	}
	var lease []rbacv1.PolicyRule
	for _, r := range o.Roles {
		if strings.HasSuffix(r.Name, "-controller") {
			lease = r.Rules
		}
	}
	if len(lease) != 2 || lease[1].ResourceNames == nil {
		t.Errorf("%s: the controller's Role %+v: want create of leases and get/update of its own", name, lease)
	}
}

// roleBoundTo returns the ClusterRole bound to the service account whose name ends in -suffix.
func roleBoundTo(o *objects, suffix string) *rbacv1.ClusterRole {
	for _, b := range o.ClusterRoleBindings {
		for _, s := range b.Subjects {
			if strings.HasSuffix(s.Name, "-"+suffix) {
				for _, r := range o.ClusterRoles {
					if r.Name == b.RoleRef.Name {
						return r
					}
				}
			}
		}
	}
	return &rbacv1.ClusterRole{}
}

func checkControllerDeployment(t *testing.T, name string, o *objects) {
	t.Helper()
	d := o.Deployments[0]
	spec := d.Spec.Template.Spec
	if !strings.HasSuffix(spec.ServiceAccountName, "-controller") || len(spec.Containers) != 1 {
		t.Fatalf("%s: Deployment %s: service account %q, %d containers", name, d.Name, spec.ServiceAccountName, len(spec.Containers))
	}
	c := spec.Containers[0]
	if len(c.Args) == 0 || c.Args[0] != "controller" {
		t.Errorf("%s: controller args %v", name, c.Args)
	}
	// Every flag it passes is one `gpu-agent controller` has.
	help, _ := exec.Command(agentBin, "controller", "-h").CombinedOutput()
	for _, a := range c.Args[1:] {
		flag, _, _ := strings.Cut(strings.TrimPrefix(a, "--"), "=")
		if !strings.Contains(string(help), "  --"+flag+" ") {
			t.Errorf("%s: the Deployment passes %s, which `gpu-agent controller` does not have", name, a)
		}
	}
	if lease := flagValue(c.Args, "--lease-name"); lease != d.Name {
		t.Errorf("%s: lease %q, the Role grants the Deployment's name %s", name, lease, d.Name)
	}
	for _, env := range []string{"POD_NAMESPACE", "POD_NAME"} {
		if !slices.ContainsFunc(c.Env, func(e corev1.EnvVar) bool { return e.Name == env && e.ValueFrom != nil && e.ValueFrom.FieldRef != nil }) {
			t.Errorf("%s: controller env has no %s from the downward API", name, env)
		}
	}
	sc := c.SecurityContext
	psc := spec.SecurityContext
	if sc == nil || psc == nil || psc.RunAsNonRoot == nil || !*psc.RunAsNonRoot || sc.AllowPrivilegeEscalation == nil || *sc.AllowPrivilegeEscalation ||
		sc.Privileged != nil && *sc.Privileged || sc.Capabilities == nil || !slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"}) ||
		spec.HostNetwork || len(spec.Volumes) != 0 {
		t.Errorf("%s: the controller has privileges it does not need: %+v %+v", name, psc, sc)
	}
	if c.LivenessProbe == nil || c.LivenessProbe.HTTPGet == nil || c.LivenessProbe.HTTPGet.Path != "/healthz" {
		t.Errorf("%s: liveness probe %+v", name, c.LivenessProbe)
	}
}

// checkCRD: NVIDIA's names, a status subresource, an immutable spec, and a schema whose fields are the Go
// types' (api/computedomain/v1beta1), with their enums and defaults.
func checkCRD(t *testing.T, name string, crd *apiextensionsv1.CustomResourceDefinition) {
	t.Helper()
	s := crd.Spec
	if crd.Name != "computedomains.resource.nvidia.com" || s.Group != cdv1.GroupName || s.Names.Kind != cdv1.KindComputeDomain ||
		s.Names.ListKind != cdv1.KindComputeDomainList || s.Names.Plural != controller.Resource.Resource || s.Scope != apiextensionsv1.NamespaceScoped {
		t.Fatalf("%s: CRD %s: names %+v, scope %s", name, crd.Name, s.Names, s.Scope)
	}
	if len(s.Versions) != 1 || s.Versions[0].Name != cdv1.Version || !s.Versions[0].Served || !s.Versions[0].Storage ||
		s.Versions[0].Subresources == nil || s.Versions[0].Subresources.Status == nil {
		t.Fatalf("%s: CRD versions %+v", name, s.Versions)
	}
	root := s.Versions[0].Schema.OpenAPIV3Schema
	spec, status := root.Properties["spec"], root.Properties["status"]
	if len(spec.XValidations) != 1 || spec.XValidations[0].Rule != "self == oldSelf" {
		t.Errorf("%s: spec validations %+v, want it immutable", name, spec.XValidations)
	}
	compareSchema(t, name+": spec", reflect.TypeFor[cdv1.ComputeDomainSpec](), spec)
	compareSchema(t, name+": status", reflect.TypeFor[cdv1.ComputeDomainStatus](), status)
	nodes := status.Properties["nodes"]
	if nodes.XListType == nil || *nodes.XListType != "map" || !slices.Equal(nodes.XListMapKeys, []string{"name"}) {
		t.Errorf("%s: status.nodes is not a map keyed by name: node sides could not apply their own entries", name)
	}
	enum := func(p apiextensionsv1.JSONSchemaProps) []string {
		var out []string
		for _, e := range p.Enum {
			out = append(out, strings.Trim(string(e.Raw), `"`))
		}
		sort.Strings(out)
		return out
	}
	for what, tc := range map[string]struct {
		p    apiextensionsv1.JSONSchemaProps
		want []string
		def  string
	}{
		"allocationMode": {spec.Properties["channel"].Properties["allocationMode"], []string{string(cdv1.AllocationModeAll), string(cdv1.AllocationModeSingle)}, `"Single"`},
		"status.status":  {status.Properties["status"], []string{string(cdv1.StatusNotReady), string(cdv1.StatusReady)}, `"NotReady"`},
		"node status":    {nodes.Items.Schema.Properties["status"], []string{string(cdv1.StatusNotReady), string(cdv1.StatusReady)}, ""},
		"numNodes":       {spec.Properties["numNodes"], nil, "0"},
	} {
		if got := enum(tc.p); !slices.Equal(got, tc.want) {
			t.Errorf("%s: %s enum %v, want %v", name, what, got, tc.want)
		}
		if got := ""; tc.p.Default != nil {
			got = string(tc.p.Default.Raw)
			if got != tc.def {
				t.Errorf("%s: %s default %s, want %s", name, what, got, tc.def)
			}
		} else if tc.def != "" {
			t.Errorf("%s: %s has no default, want %s", name, what, tc.def)
		}
	}
	if !slices.Equal(spec.Required, []string{"channel"}) {
		t.Errorf("%s: spec requires %v, want [channel]", name, spec.Required)
	}
}

// compareSchema checks that a schema object has exactly the Go struct's JSON fields, each of the right type,
// recursing into structs and slices of structs.
func compareSchema(t *testing.T, path string, typ reflect.Type, p apiextensionsv1.JSONSchemaProps) {
	t.Helper()
	for typ.Kind() == reflect.Pointer {
		typ = typ.Elem()
	}
	want := map[string]reflect.Type{}
	for f := range typ.Fields() {
		tag, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if tag != "" && tag != "-" {
			want[tag] = f.Type
		}
	}
	if p.Type != "object" {
		t.Errorf("%s: schema type %q, Go %s is a struct", path, p.Type, typ)
		return
	}
	for name := range p.Properties {
		if _, ok := want[name]; !ok {
			t.Errorf("%s.%s: in the schema, not in Go's %s", path, name, typ)
		}
	}
	for name, ft := range want {
		prop, ok := p.Properties[name]
		if !ok {
			t.Errorf("%s.%s: in Go's %s, not in the schema", path, name, typ)
			continue
		}
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		switch ft.Kind() {
		case reflect.String:
			if prop.Type != "string" {
				t.Errorf("%s.%s: schema %q, Go string", path, name, prop.Type)
			}
		case reflect.Int, reflect.Int32, reflect.Int64:
			if prop.Type != "integer" {
				t.Errorf("%s.%s: schema %q, Go integer", path, name, prop.Type)
			}
		case reflect.Struct:
			compareSchema(t, path+"."+name, ft, prop)
		case reflect.Slice:
			if prop.Type != "array" || prop.Items == nil || prop.Items.Schema == nil {
				t.Errorf("%s.%s: schema %q, Go slice", path, name, prop.Type)
				continue
			}
			compareSchema(t, path+"."+name+"[]", ft.Elem(), *prop.Items.Schema)
		default:
			t.Errorf("%s.%s: Go kind %s not compared", path, name, ft.Kind())
		}
	}
}
