package deploy

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	rbacv1 "k8s.io/api/rbac/v1"
	resourcev1 "k8s.io/api/resource/v1"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	"sigs.k8s.io/yaml"
)

// serviceMonitor is the part of prometheus-operator's ServiceMonitor that the
// manifests use; decoding strictly into it catches misspelt fields without the
// operator's large module.
type serviceMonitor struct {
	APIVersion string             `json:"apiVersion"`
	Kind       string             `json:"kind"`
	Metadata   metav1ObjectMeta   `json:"metadata"`
	Spec       serviceMonitorSpec `json:"spec"`
}

type metav1ObjectMeta struct {
	Name      string            `json:"name"`
	Namespace string            `json:"namespace,omitempty"`
	Labels    map[string]string `json:"labels,omitempty"`
}

type serviceMonitorSpec struct {
	Selector struct {
		MatchLabels map[string]string `json:"matchLabels"`
	} `json:"selector"`
	Endpoints []struct {
		Port        string `json:"port"`
		Path        string `json:"path"`
		Interval    string `json:"interval"`
		HonorLabels bool   `json:"honorLabels"`
	} `json:"endpoints"`
}

// objects are the decoded documents of a set of manifests, by kind.
type objects struct {
	Namespaces          []*corev1.Namespace
	ServiceAccounts     []*corev1.ServiceAccount
	ConfigMaps          []*corev1.ConfigMap
	Services            []*corev1.Service
	DaemonSets          []*appsv1.DaemonSet
	ClusterRoles        []*rbacv1.ClusterRole
	ClusterRoleBindings []*rbacv1.ClusterRoleBinding
	Roles               []*rbacv1.Role
	RoleBindings        []*rbacv1.RoleBinding
	ServiceMonitors     []*serviceMonitor
	DeviceClasses       []*resourcev1.DeviceClass
	Policies            []*admissionregistrationv1.ValidatingAdmissionPolicy
	PolicyBindings      []*admissionregistrationv1.ValidatingAdmissionPolicyBinding
	Deployments         []*appsv1.Deployment
	CRDs                []*apiextensionsv1.CustomResourceDefinition
}

// decodeStrict decodes every YAML document of data into its Kubernetes API type;
// an unknown field, a wrong type or an unknown kind is an error naming the
// document.
func decodeStrict(name string, data []byte, into *objects) error {
	r := utilyaml.NewYAMLReader(bufio.NewReader(bytes.NewReader(data)))
	for i := 0; ; i++ {
		doc, err := r.Read()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return fmt.Errorf("%s: document %d: %w", name, i, err)
		}
		if len(bytes.TrimSpace(stripComments(doc))) == 0 {
			continue
		}
		var tm struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
		}
		if err := yaml.Unmarshal(doc, &tm); err != nil {
			return fmt.Errorf("%s: document %d: %w", name, i, err)
		}
		var obj any
		switch tm.APIVersion + "/" + tm.Kind {
		case "v1/Namespace":
			o := &corev1.Namespace{}
			into.Namespaces, obj = append(into.Namespaces, o), o
		case "v1/ServiceAccount":
			o := &corev1.ServiceAccount{}
			into.ServiceAccounts, obj = append(into.ServiceAccounts, o), o
		case "v1/ConfigMap":
			o := &corev1.ConfigMap{}
			into.ConfigMaps, obj = append(into.ConfigMaps, o), o
		case "v1/Service":
			o := &corev1.Service{}
			into.Services, obj = append(into.Services, o), o
		case "apps/v1/Deployment":
			o := &appsv1.Deployment{}
			into.Deployments, obj = append(into.Deployments, o), o
		case "apiextensions.k8s.io/v1/CustomResourceDefinition":
			o := &apiextensionsv1.CustomResourceDefinition{}
			into.CRDs, obj = append(into.CRDs, o), o
		case "apps/v1/DaemonSet":
			o := &appsv1.DaemonSet{}
			into.DaemonSets, obj = append(into.DaemonSets, o), o
		case "rbac.authorization.k8s.io/v1/ClusterRole":
			o := &rbacv1.ClusterRole{}
			into.ClusterRoles, obj = append(into.ClusterRoles, o), o
		case "rbac.authorization.k8s.io/v1/ClusterRoleBinding":
			o := &rbacv1.ClusterRoleBinding{}
			into.ClusterRoleBindings, obj = append(into.ClusterRoleBindings, o), o
		case "rbac.authorization.k8s.io/v1/Role":
			o := &rbacv1.Role{}
			into.Roles, obj = append(into.Roles, o), o
		case "rbac.authorization.k8s.io/v1/RoleBinding":
			o := &rbacv1.RoleBinding{}
			into.RoleBindings, obj = append(into.RoleBindings, o), o
		case "resource.k8s.io/v1/DeviceClass":
			o := &resourcev1.DeviceClass{}
			into.DeviceClasses, obj = append(into.DeviceClasses, o), o
		case "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy":
			o := &admissionregistrationv1.ValidatingAdmissionPolicy{}
			into.Policies, obj = append(into.Policies, o), o
		case "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding":
			o := &admissionregistrationv1.ValidatingAdmissionPolicyBinding{}
			into.PolicyBindings, obj = append(into.PolicyBindings, o), o
		case "monitoring.coreos.com/v1/ServiceMonitor":
			o := &serviceMonitor{}
			into.ServiceMonitors, obj = append(into.ServiceMonitors, o), o
		default:
			return fmt.Errorf("%s: document %d: unexpected kind %s/%s", name, i, tm.APIVersion, tm.Kind)
		}
		if err := yaml.UnmarshalStrict(doc, obj); err != nil {
			return fmt.Errorf("%s: document %d (%s): %w", name, i, tm.Kind, err)
		}
	}
}

func stripComments(doc []byte) []byte {
	var out []byte
	for _, line := range strings.Split(string(doc), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "#") {
			continue
		}
		out = append(out, line...)
		out = append(out, '\n')
	}
	return out
}

func TestDecodeStrictRejects(t *testing.T) {
	tests := []struct {
		name, doc, want string
	}{
		{"unknown field", "apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\ndatta: {}\n", "unknown field"},
		{"misspelt nested field", "apiVersion: apps/v1\nkind: DaemonSet\nmetadata: {name: x}\nspec:\n  template:\n    spec:\n      nodeSelecter: {a: b}\n", "nodeSelecter"},
		{"wrong type", "apiVersion: v1\nkind: Service\nmetadata: {name: x}\nspec:\n  ports: [{port: nine}]\n", "port"},
		{"unknown kind", "apiVersion: v1\nkind: Pod\nmetadata: {name: x}\n", "unexpected kind"},
		{"policy field", "apiVersion: admissionregistration.k8s.io/v1\nkind: ValidatingAdmissionPolicy\nmetadata: {name: x}\nspec:\n  validations: [{expresion: 'true'}]\n", "expresion"},
		{"CRD schema field", "apiVersion: apiextensions.k8s.io/v1\nkind: CustomResourceDefinition\nmetadata: {name: x}\nspec:\n  versions: [{name: v1, schema: {openAPIV3Schema: {type: object, propertes: {}}}}]\n", "propertes"},
		{"service monitor field", "apiVersion: monitoring.coreos.com/v1\nkind: ServiceMonitor\nmetadata: {name: x}\nspec:\n  endpoint: []\n", "unknown field"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := decodeStrict(tt.name, []byte(tt.doc), &objects{})
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("decodeStrict = %v, want an error containing %q", err, tt.want)
			}
		})
	}
}
