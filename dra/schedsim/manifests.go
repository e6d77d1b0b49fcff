package schedsim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
)

// MaxManifestBytes is the most Read takes from one input: kubectl's YAML
// of tens of thousands of claims is well under it, and an input past it is
// refused whole rather than checked in part.
const MaxManifestBytes = 128 << 20

// Objects are the DeviceClasses and claims of a file of manifests.
type Objects struct {
	Classes []*resourceapi.DeviceClass
	Claims  []Claim
	// Skipped counts the objects of other kinds, which are not read.
	Skipped int
}

// Claim is a ResourceClaim, or a ResourceClaimTemplate as the claim it
// makes, with where it came from. Its status is not read: it is allocated
// anew.
type Claim struct {
	Kind, Namespace, Name string
	Claim                 *resourceapi.ResourceClaim
}

func (c Claim) String() string {
	if c.Namespace == "" {
		return c.Kind + " " + c.Name
	}
	return c.Kind + " " + c.Namespace + "/" + c.Name
}

// servedVersions are the resource.k8s.io versions whose DeviceClasses and
// claims Read takes: v1beta2's fields are v1's, under the same names, and
// v1beta1's too but for a request's own fields, which v1 moved under
// exactly (v1beta1Requests).
var servedVersions = []string{"resource.k8s.io/v1", "resource.k8s.io/v1beta2", "resource.k8s.io/v1beta1"}

// Read reads YAML or JSON documents from r: DeviceClasses, ResourceClaims
// and ResourceClaimTemplates, alone or in kubectl's List (what `kubectl get
// deviceclasses,resourceclaims,resourceclaimtemplates -A -o yaml` writes).
// Objects of other kinds are counted, not read. source names r in errors,
// which also name the document and the object.
func Read(r io.Reader, source string) (Objects, error) {
	var out Objects
	data, err := io.ReadAll(io.LimitReader(r, MaxManifestBytes+1))
	if err != nil {
		return out, fmt.Errorf("%s: %w", source, err)
	}
	if len(data) > MaxManifestBytes {
		return out, fmt.Errorf("%s: more than %d MiB of manifests; split it", source, MaxManifestBytes>>20)
	}
	dec := utilyaml.NewYAMLOrJSONDecoder(bytes.NewReader(data), 4096)
	for doc := 1; ; doc++ {
		var raw json.RawMessage
		err := dec.Decode(&raw)
		if errors.Is(err, io.EOF) {
			return out, nil
		}
		if err != nil {
			return out, fmt.Errorf("%s: document %d: %w", source, doc, err)
		}
		if len(bytes.TrimSpace(raw)) == 0 || bytes.Equal(bytes.TrimSpace(raw), []byte("null")) {
			continue
		}
		if err := out.add(raw, 0); err != nil {
			return out, fmt.Errorf("%s: document %d: %w", source, doc, err)
		}
	}
}

// maxListDepth bounds Lists within Lists, which kubectl never writes.
const maxListDepth = 4

func (o *Objects) add(raw json.RawMessage, depth int) error {
	var head struct {
		APIVersion string `json:"apiVersion"`
		Kind       string `json:"kind"`
		Metadata   struct {
			Namespace string `json:"namespace"`
			Name      string `json:"name"`
		} `json:"metadata"`
		Items []json.RawMessage `json:"items"`
	}
	if err := json.Unmarshal(raw, &head); err != nil {
		return fmt.Errorf("not a Kubernetes object: %w", err)
	}
	what := head.Kind + " " + head.Metadata.Name
	if head.Metadata.Namespace != "" {
		what = head.Kind + " " + head.Metadata.Namespace + "/" + head.Metadata.Name
	}
	switch head.Kind {
	case "List", "DeviceClassList", "ResourceClaimList", "ResourceClaimTemplateList":
		if depth >= maxListDepth {
			return fmt.Errorf("%s: Lists nested more than %d deep", head.Kind, maxListDepth)
		}
		for i, item := range head.Items {
			if err := o.add(item, depth+1); err != nil {
				return fmt.Errorf("%s item %d: %w", head.Kind, i, err)
			}
		}
		return nil
	case "DeviceClass", "ResourceClaim", "ResourceClaimTemplate":
	default:
		o.Skipped++
		return nil
	}
	if !strings.HasPrefix(head.APIVersion, "resource.k8s.io/") {
		o.Skipped++ // another group's kind of the same name
		return nil
	}
	if !served(head.APIVersion) {
		return fmt.Errorf("%s: apiVersion %s is not read (only %s): get the object from an API server of Kubernetes 1.34 or later, whose kubectl get writes resource.k8s.io/v1", what, head.APIVersion, strings.Join(servedVersions, ", "))
	}
	if head.Metadata.Name == "" {
		return fmt.Errorf("%s: no metadata.name", head.Kind)
	}
	var meta struct {
		Metadata metav1.ObjectMeta `json:"metadata"`
		Spec     json.RawMessage   `json:"spec"`
	}
	if err := json.Unmarshal(raw, &meta); err != nil {
		return fmt.Errorf("%s: %w", what, err)
	}
	if head.APIVersion == "resource.k8s.io/v1beta1" && head.Kind != "DeviceClass" && len(meta.Spec) > 0 {
		spec, err := v1beta1Requests(meta.Spec, head.Kind == "ResourceClaimTemplate")
		if err != nil {
			return fmt.Errorf("%s: spec: %w", what, err)
		}
		meta.Spec = spec
	}
	switch head.Kind {
	case "DeviceClass":
		c := &resourceapi.DeviceClass{ObjectMeta: meta.Metadata}
		if err := strictSpec(meta.Spec, &c.Spec); err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		o.Classes = append(o.Classes, c)
	case "ResourceClaim":
		c := &resourceapi.ResourceClaim{ObjectMeta: meta.Metadata}
		if err := strictSpec(meta.Spec, &c.Spec); err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		o.Claims = append(o.Claims, Claim{Kind: head.Kind, Namespace: c.Namespace, Name: c.Name, Claim: c})
	case "ResourceClaimTemplate":
		var spec resourceapi.ResourceClaimTemplateSpec
		if err := strictSpec(meta.Spec, &spec); err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		c := &resourceapi.ResourceClaim{Spec: spec.Spec}
		c.Namespace, c.Name = meta.Metadata.Namespace, meta.Metadata.Name
		o.Claims = append(o.Claims, Claim{Kind: head.Kind, Namespace: c.Namespace, Name: c.Name, Claim: c})
	}
	return nil
}

// v1beta1Fields are a v1beta1 request's fields that v1 holds under
// exactly; name and firstAvailable stay where they are.
var v1beta1Fields = []string{"deviceClassName", "selectors", "allocationMode", "count", "adminAccess", "tolerations", "capacity"}

// v1beta1Requests rewrites a v1beta1 claim's spec (template: a template's)
// as v1's: each request that names its devices itself gets them under
// exactly. Every other field has v1's name and shape already.
func v1beta1Requests(spec json.RawMessage, template bool) (json.RawMessage, error) {
	var top map[string]json.RawMessage
	if err := json.Unmarshal(spec, &top); err != nil {
		return nil, err
	}
	claim := top
	if template {
		claim = nil // Unmarshal would merge into top
		if err := json.Unmarshal(top["spec"], &claim); err != nil || claim == nil {
			return spec, nil // left for strictSpec to refuse, naming the field
		}
	}
	var devices map[string]json.RawMessage
	if err := json.Unmarshal(claim["devices"], &devices); err != nil || devices == nil {
		return spec, nil
	}
	var requests []map[string]json.RawMessage
	if err := json.Unmarshal(devices["requests"], &requests); err != nil {
		return spec, nil
	}
	for i, r := range requests {
		if r == nil || r["firstAvailable"] != nil || r["exactly"] != nil {
			continue
		}
		exactly := map[string]json.RawMessage{}
		for _, f := range v1beta1Fields {
			if v, ok := r[f]; ok {
				exactly[f] = v
				delete(r, f)
			}
		}
		b, err := json.Marshal(exactly)
		if err != nil {
			return nil, err
		}
		r["exactly"] = b
		requests[i] = r
	}
	var err error
	if devices["requests"], err = json.Marshal(requests); err != nil {
		return nil, err
	}
	if claim["devices"], err = json.Marshal(devices); err != nil {
		return nil, err
	}
	if template {
		if top["spec"], err = json.Marshal(claim); err != nil {
			return nil, err
		}
	}
	return json.Marshal(top)
}

func served(v string) bool {
	for _, s := range servedVersions {
		if v == s {
			return true
		}
	}
	return false
}

// strictSpec decodes an object's spec into v, refusing a field v has not:
// a misspelt selector, or a field of a later Kubernetes than this build's,
// would otherwise be dropped and the claim checked without it. Metadata and
// status are read leniently: the check uses neither.
func strictSpec(raw json.RawMessage, v any) error {
	if len(raw) == 0 {
		return nil
	}
	dec := json.NewDecoder(bytes.NewReader(raw))
	dec.DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		return fmt.Errorf("spec: %w", err)
	}
	return nil
}
