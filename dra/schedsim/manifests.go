package schedsim

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"

	resourceapi "k8s.io/api/resource/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"
	sigsjson "sigs.k8s.io/json"
)

// MaxManifestBytes is the most Read takes from one input: kubectl's YAML
// of tens of thousands of claims is well under it, and an input past it is
// refused whole rather than checked in part.
const MaxManifestBytes = 128 << 20

// Objects are the DeviceClasses and claims of a file of manifests.
type Objects struct {
	Classes []Class
	Claims  []Claim
	// Skipped counts the objects of other kinds, which are not read.
	Skipped int
}

// Class is a DeviceClass as read. Err, when set, says which fields were not
// read, with their paths: unknown to this build (misspelt, or of a later
// Kubernetes) or given twice. A check that used the class would not be the
// API server's.
type Class struct {
	Class *resourceapi.DeviceClass
	Err   error
}

// Claim is a ResourceClaim, or a ResourceClaimTemplate as the claim it
// makes, of the given kind. Its status is not read: it is allocated anew.
// Err is as Class's.
type Claim struct {
	Kind  string
	Claim *resourceapi.ResourceClaim
	Err   error
}

func (c Claim) String() string { return named(c.Kind, c.Claim.Namespace, c.Claim.Name) }

// named is how messages name an object: kind, then namespace/name.
func named(kind, namespace, name string) string {
	if namespace == "" {
		return kind + " " + name
	}
	return kind + " " + namespace + "/" + name
}

// servedVersions are the resource.k8s.io versions whose DeviceClasses and
// claims Read takes: v1beta2's fields are v1's, under the same names, and
// v1beta1's too but for a request's own fields, which v1 moved under
// exactly (v1beta1Requests).
var servedVersions = []string{"resource.k8s.io/v1", "resource.k8s.io/v1beta2", "resource.k8s.io/v1beta1"}

// Served says whether Read takes DeviceClasses and claims of apiVersion.
func Served(apiVersion string) bool { return slices.Contains(servedVersions, apiVersion) }

// Read reads YAML or JSON documents from r: DeviceClasses, ResourceClaims
// and ResourceClaimTemplates, alone or in a List (what `kubectl get
// deviceclasses,resourceclaims,resourceclaimtemplates -A -o yaml` writes,
// or the API server's typed Lists). Objects of other kinds are counted, not
// read. source names r in errors, which also name the document and the
// object.
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
		if t := bytes.TrimSpace(raw); len(t) == 0 || bytes.Equal(t, []byte("null")) {
			continue
		}
		if err := out.add(raw, "", "", 0); err != nil {
			return out, fmt.Errorf("%s: document %d: %w", source, doc, err)
		}
	}
}

// maxListDepth bounds Lists within Lists, which kubectl never writes.
const maxListDepth = 4

// typedLists are the API server's Lists of the kinds Read takes, whose
// items carry no apiVersion or kind of their own.
var typedLists = map[string]string{
	"DeviceClassList":           "DeviceClass",
	"ResourceClaimList":         "ResourceClaim",
	"ResourceClaimTemplateList": "ResourceClaimTemplate",
}

// add reads one object; apiVersion and kind are a typed List's, for items
// that have none.
func (o *Objects) add(raw json.RawMessage, apiVersion, kind string, depth int) error {
	var head struct {
		APIVersion string            `json:"apiVersion"`
		Kind       string            `json:"kind"`
		Metadata   metav1.ObjectMeta `json:"metadata"`
		Spec       json.RawMessage   `json:"spec"`
		Status     json.RawMessage   `json:"status"`
		Items      []json.RawMessage `json:"items"`
	}
	// Field names are case-sensitive, as the API server reads them; what
	// the object has beside these (a misspelt spec) is said with the spec's.
	strict, err := sigsjson.UnmarshalStrict(raw, &head)
	if err != nil {
		return fmt.Errorf("not a Kubernetes object: %w", err)
	}
	if head.APIVersion == "" {
		head.APIVersion = apiVersion
	}
	if head.Kind == "" {
		head.Kind = kind
	}
	what := named(head.Kind, head.Metadata.Namespace, head.Metadata.Name)
	if itemKind, typed := typedLists[head.Kind]; typed || head.Kind == "List" {
		if depth >= maxListDepth {
			return fmt.Errorf("%s: Lists nested more than %d deep", head.Kind, maxListDepth)
		}
		itemVersion := "" // a plain List's items name their own
		if typed {
			itemVersion = head.APIVersion
		}
		for i, item := range head.Items {
			if err := o.add(item, itemVersion, itemKind, depth+1); err != nil {
				return fmt.Errorf("%s item %d: %w", head.Kind, i, err)
			}
		}
		return nil
	}
	switch head.Kind {
	case "DeviceClass", "ResourceClaim", "ResourceClaimTemplate":
	case "":
		return errors.New("no kind")
	default:
		o.Skipped++
		return nil
	}
	switch {
	case head.APIVersion == "":
		return fmt.Errorf("%s: no apiVersion", what)
	case !strings.HasPrefix(head.APIVersion, "resource.k8s.io/"):
		o.Skipped++ // another group's kind of the same name
		return nil
	case !Served(head.APIVersion):
		return fmt.Errorf("%s: apiVersion %s is not read (only %s): get the object from an API server of Kubernetes 1.34 or later, whose kubectl get writes resource.k8s.io/v1", what, head.APIVersion, strings.Join(servedVersions, ", "))
	case head.Metadata.Name == "":
		return fmt.Errorf("%s: no metadata.name", head.Kind)
	}
	spec := head.Spec
	v1beta1 := head.APIVersion == "resource.k8s.io/v1beta1" && head.Kind != "DeviceClass"
	if v1beta1 && len(spec) > 0 {
		var err error
		if spec, err = v1beta1Requests(spec, head.Kind == "ResourceClaimTemplate"); err != nil {
			return fmt.Errorf("%s: spec: %w", what, err)
		}
	}
	switch head.Kind {
	case "DeviceClass":
		c := &resourceapi.DeviceClass{ObjectMeta: head.Metadata}
		notRead, err := readSpec(spec, &c.Spec, v1beta1, strict)
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		o.Classes = append(o.Classes, Class{Class: c, Err: notRead})
	case "ResourceClaim":
		c := &resourceapi.ResourceClaim{ObjectMeta: head.Metadata}
		notRead, err := readSpec(spec, &c.Spec, v1beta1, strict)
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		o.Claims = append(o.Claims, Claim{Kind: head.Kind, Claim: c, Err: notRead})
	case "ResourceClaimTemplate":
		var t resourceapi.ResourceClaimTemplateSpec
		notRead, err := readSpec(spec, &t, v1beta1, strict)
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		c := &resourceapi.ResourceClaim{Spec: t.Spec}
		c.Namespace, c.Name = head.Metadata.Namespace, head.Metadata.Name
		o.Claims = append(o.Claims, Claim{Kind: head.Kind, Claim: c, Err: notRead})
	}
	return nil
}

// readSpec decodes an object's spec into target, field names
// case-sensitive. err is a spec that cannot be read; notRead joins what was
// not read, the object's own (outside, from its head) and its spec's, each
// with its path (of the v1beta1 object as written, not as rewritten).
func readSpec(spec json.RawMessage, target any, v1beta1 bool, outside []error) (notRead, err error) {
	msgs := make([]string, 0, len(outside))
	for _, e := range outside {
		msgs = append(msgs, e.Error())
	}
	if len(spec) > 0 {
		inSpec, err := sigsjson.UnmarshalStrict(spec, target)
		if err != nil {
			return nil, fmt.Errorf("spec: %w", err)
		}
		for _, e := range inSpec {
			m := e.Error()
			if v1beta1 {
				// The request's fields are under exactly only as rewritten.
				m = strings.ReplaceAll(m, ".exactly.", ".")
			}
			msgs = append(msgs, "spec: "+m)
		}
	}
	if len(msgs) == 0 {
		return nil, nil
	}
	return errors.New(strings.Join(msgs, "; ")), nil
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
			return spec, nil // left for readSpec to refuse, naming the field
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
	for _, r := range requests {
		if r == nil || !absent(r["exactly"]) {
			continue
		}
		if !absent(r["firstAvailable"]) {
			// What Go writes for a v1beta1 request with subrequests: its own
			// fields empty (deviceClassName has no omitempty), not unknown.
			for _, f := range v1beta1Fields {
				if v, ok := r[f]; ok && (absent(v) || string(bytes.TrimSpace(v)) == `""`) {
					delete(r, f)
				}
			}
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

// absent: a field not given, null, or an empty list.
func absent(v json.RawMessage) bool {
	t := string(bytes.TrimSpace(v))
	return t == "" || t == "null" || t == "[]"
}
