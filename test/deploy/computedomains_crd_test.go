package deploy

import (
	"context"
	"strings"
	"testing"

	"k8s.io/apiextensions-apiserver/pkg/apis/apiextensions"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	crdvalidation "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/validation"
	structuralschema "k8s.io/apiextensions-apiserver/pkg/apiserver/schema"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/schema/defaulting"
	"k8s.io/apiextensions-apiserver/pkg/apiserver/validation"
	"sigs.k8s.io/yaml"
)

// TestComputeDomainCRDAsTheAPIServerSeesIt runs the CRD through the API server's own code: the validation a
// CRD create goes through (structural schema, list-map keys required, the CEL rule compiled, defaults valid),
// then, on ComputeDomains as NVIDIA's users write them, the schema's validation and defaulting.
func TestComputeDomainCRDAsTheAPIServerSeesIt(t *testing.T) {
	o := loadComputeDomainsComponent(t)
	apiextensionsv1.SetObjectDefaults_CustomResourceDefinition(o.CRDs[0])
	var crd apiextensions.CustomResourceDefinition
	if err := apiextensionsv1.Convert_v1_CustomResourceDefinition_To_apiextensions_CustomResourceDefinition(o.CRDs[0], &crd, nil); err != nil {
		t.Fatal(err)
	}
	if errs := crdvalidation.ValidateCustomResourceDefinition(context.Background(), &crd); len(errs) > 0 {
		t.Fatalf("the API server refuses the CRD: %v", errs.ToAggregate())
	}
	// The internal version keeps a schema all versions share at the top.
	var schema *apiextensions.JSONSchemaProps
	if v := crd.Spec.Versions[0].Schema; v != nil {
		schema = v.OpenAPIV3Schema
	} else if crd.Spec.Validation != nil {
		schema = crd.Spec.Validation.OpenAPIV3Schema
	}
	if schema == nil {
		t.Fatal("no schema")
	}
	structural, err := structuralschema.NewStructural(schema)
	if err != nil {
		t.Fatal(err)
	}
	validator, _, err := validation.NewSchemaValidator(schema)
	if err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, doc string
		// want: the error ("" none) and, for an accepted object, what defaulting fills in.
		want, defaulted string
	}{
		// The shape of NVIDIA's quickstart imex-test1 and channel-injection specs.
		{"NVIDIA's quickstart", `
spec:
  numNodes: 2
  channel:
    resourceClaimTemplate:
      name: imex-channel-0`, "", `"allocationMode":"Single"`},
		{"all channels, numNodes defaulted", `
spec:
  channel:
    allocationMode: All
    resourceClaimTemplate: {name: imex-channels}`, "", `"numNodes":0`},
		{"status as the controller writes it", `
spec: {numNodes: 1, channel: {resourceClaimTemplate: {name: t}}}
status:
  status: Ready
  nodes:
  - {name: n1, ipAddress: 10.0.0.1, cliqueID: 6d1a.1, index: 0, status: Ready}`, "", ""},
		{"a node entry as a node side applies it", `
spec: {channel: {resourceClaimTemplate: {name: t}}}
status: {nodes: [{name: n1, status: NotReady}]}`, "", `"status":"NotReady"`},
		{"unknown allocation mode", `
spec: {channel: {allocationMode: Many, resourceClaimTemplate: {name: t}}}`, "allocationMode", ""},
		{"negative numNodes", `
spec: {numNodes: -1, channel: {resourceClaimTemplate: {name: t}}}`, "numNodes", ""},
		{"no channel", `
spec: {numNodes: 1}`, "channel", ""},
		{"template name not a DNS subdomain", `
spec: {channel: {resourceClaimTemplate: {name: Not_A_Name}}}`, "name", ""},
		{"node entry without a name", `
spec: {channel: {resourceClaimTemplate: {name: t}}}
status: {nodes: [{ipAddress: 10.0.0.1}]}`, "name", ""},
		{"unknown node status", `
spec: {channel: {resourceClaimTemplate: {name: t}}}
status: {nodes: [{name: n1, status: Maybe}]}`, "status", ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			obj := map[string]any{}
			if err := yaml.Unmarshal([]byte("apiVersion: resource.nvidia.com/v1beta1\nkind: ComputeDomain\nmetadata: {name: d, namespace: ns}\n"+tc.doc), &obj); err != nil {
				t.Fatal(err)
			}
			defaulting.Default(obj, structural)
			res := validator.Validate(obj)
			var errs []string
			for _, e := range res.Errors {
				errs = append(errs, e.Error())
			}
			got := strings.Join(errs, "; ")
			switch {
			case tc.want == "" && got != "":
				t.Fatalf("refused: %s", got)
			case tc.want != "" && !strings.Contains(got, tc.want):
				t.Fatalf("errors %q, want one naming %s", got, tc.want)
			}
			if tc.defaulted != "" {
				data, _ := yaml.Marshal(obj)
				js, _ := yaml.YAMLToJSON(data)
				if !strings.Contains(string(js), tc.defaulted) {
					t.Errorf("defaulted object %s, want %s in it", js, tc.defaulted)
				}
			}
		})
	}
}
