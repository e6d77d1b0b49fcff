package schedsim

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"

	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/dynamic-resource-allocation/resourceslice"
	"k8s.io/utils/ptr"
)

const claimDoc = `apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: one, namespace: ns}
spec:
  devices:
    requests:
    - name: gpu
      exactly: {deviceClassName: gpu.nvidia.com}
status:
  allocation: {devices: {results: [{request: gpu, driver: gpu.nvidia.com, pool: n, device: gpu-0}]}}
`

func TestRead(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		claims  []string // Claim.String() of each, in order
		classes int
		skipped int
		wantErr string
	}{
		{name: "empty", in: ""},
		{name: "one claim", in: claimDoc, claims: []string{"ResourceClaim ns/one"}},
		{
			name: "documents of every kind",
			in: claimDoc + `---
apiVersion: resource.k8s.io/v1beta2
kind: ResourceClaimTemplate
metadata: {name: tpl, namespace: ns}
spec:
  spec:
    devices:
      requests:
      - name: mig
        exactly:
          deviceClassName: mig.nvidia.com
          selectors: [{cel: {expression: "device.attributes['gpu.nvidia.com'].profile == '1g.10gb'"}}]
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: gpu.nvidia.com}
spec: {selectors: [{cel: {expression: "true"}}]}
---
---
apiVersion: v1
kind: Pod
metadata: {name: p}
`,
			claims: []string{"ResourceClaim ns/one", "ResourceClaimTemplate ns/tpl"}, classes: 1, skipped: 1,
		},
		{
			name: "kubectl's List, as JSON",
			in: `{"apiVersion": "v1", "kind": "List", "items": [
  {"apiVersion": "resource.k8s.io/v1", "kind": "DeviceClass", "metadata": {"name": "c"}, "spec": {}},
  {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", "metadata": {"name": "a", "namespace": "x"},
   "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "c"}}]}}},
  {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "m"}}]}`,
			claims: []string{"ResourceClaim x/a"}, classes: 1, skipped: 1,
		},
		{
			name: "the API server's typed List, whose items have no kind",
			in: `{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimList", "metadata": {"resourceVersion": "7"}, "items": [
  {"metadata": {"name": "a", "namespace": "x"}, "spec": {"devices": {"requests": [{"name": "r", "exactly": {"deviceClassName": "c"}}]}}},
  {"metadata": {"name": "b", "namespace": "x"}, "spec": {}}]}`,
			claims: []string{"ResourceClaim x/a", "ResourceClaim x/b"},
		},
		{
			name:    "v1alpha3 is refused by name",
			in:      strings.Replace(claimDoc, "resource.k8s.io/v1", "resource.k8s.io/v1alpha3", 1),
			wantErr: "test: document 1: ResourceClaim ns/one: apiVersion resource.k8s.io/v1alpha3 is not read",
		},
		{
			name: "the document that fails is named",
			in: claimDoc + `---
kind: DeviceClass
apiVersion: resource.k8s.io/v1
metadata: {}
`,
			wantErr: "test: document 2: DeviceClass: no metadata.name",
		},
		{
			name: "an object of a kind read, without apiVersion",
			in: `kind: ResourceClaim
metadata: {name: a}
`,
			wantErr: "ResourceClaim a: no apiVersion",
		},
		{
			name: "a plain List's item without apiVersion",
			in: `apiVersion: v1
kind: List
items:
- kind: ResourceClaim
  metadata: {name: a}
`,
			wantErr: "List item 0: ResourceClaim a: no apiVersion",
		},
		{
			name:    "not YAML",
			in:      "{{{",
			wantErr: "test: document 1:",
		},
		{
			name:    "a spec that cannot be read, in an item of a List",
			in:      `{"kind": "List", "items": [{"kind": "ResourceClaim", "apiVersion": "resource.k8s.io/v1", "metadata": {"name": "a"}, "spec": {"devices": 3}}]}`,
			wantErr: "List item 0: ResourceClaim a: spec:",
		},
		{
			name:    "Lists within Lists",
			in:      strings.Repeat(`{"kind": "List", "items": [`, 6) + strings.Repeat("]}", 6),
			wantErr: "Lists nested more than 4 deep",
		},
		{
			name: "another group's kind of the same name",
			in: `apiVersion: example.com/v1
kind: ResourceClaim
metadata: {name: x}
spec: {whatever: 1}
`,
			skipped: 1,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			objs, err := Read(strings.NewReader(tt.in), "test")
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, c := range objs.Claims {
				got = append(got, c.String())
				if c.Err != nil {
					t.Errorf("%s: %v", c, c.Err)
				}
			}
			if strings.Join(got, ",") != strings.Join(tt.claims, ",") || len(objs.Classes) != tt.classes || objs.Skipped != tt.skipped {
				t.Errorf("claims %q, %d classes, %d skipped; want %q, %d, %d", got, len(objs.Classes), objs.Skipped, tt.claims, tt.classes, tt.skipped)
			}
		})
	}
}

// A field the build does not know, misspelt or of a later Kubernetes, is
// read without it and said, with its path; the file's other objects are
// read as they are. Field names are case-sensitive, as the API server's.
func TestReadUnknownFields(t *testing.T) {
	in := `apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: typo, namespace: ns}
spec: {devices: {requests: [{name: gpu, exactly: {deviceClass: gpu.nvidia.com}}]}}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: capital, namespace: ns}
spec: {devices: {requests: [{name: gpu, exactly: {DeviceClassName: gpu.nvidia.com}}]}}
---
apiVersion: resource.k8s.io/v1
kind: DeviceClass
metadata: {name: later}
spec: {selectors: [], derivedAttributes: []}
---
apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata: {name: sepc, namespace: ns}
sepc: {devices: {requests: [{name: gpu, exactly: {deviceClassName: gpu.nvidia.com}}]}}
---
apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaim
metadata: {name: old, namespace: ns}
spec: {devices: {requests: [{name: gpu, deviceClassName: gpu.nvidia.com, selectors: [{cell: {}}]}]}}
---
` + claimDoc
	objs, err := Read(strings.NewReader(in), "test")
	if err != nil {
		t.Fatal(err)
	}
	want := map[string]string{
		"ResourceClaim ns/typo":    `unknown field "devices.requests[0].exactly.deviceClass"`,
		"ResourceClaim ns/capital": `unknown field "devices.requests[0].exactly.DeviceClassName"`,
		"ResourceClaim ns/sepc":    `unknown field "sepc"`,
		"ResourceClaim ns/old":     `spec: unknown field "devices.requests[0].selectors[0].cell"`,
		"ResourceClaim ns/one":     "",
	}
	if len(objs.Claims) != len(want) {
		t.Fatalf("%d claims, want %d", len(objs.Claims), len(want))
	}
	for _, c := range objs.Claims {
		if w := want[c.String()]; w == "" && c.Err != nil || w != "" && (c.Err == nil || !strings.Contains(c.Err.Error(), w)) {
			t.Errorf("%s: error %v, want %q", c, c.Err, w)
		}
	}
	if len(objs.Classes) != 1 || objs.Classes[0].Err == nil || !strings.Contains(objs.Classes[0].Err.Error(), `unknown field "derivedAttributes"`) {
		t.Errorf("classes %+v, want one whose error names derivedAttributes", objs.Classes)
	}
}

// A claim read is its spec only: the allocation in its status is not
// carried, so the check allocates it anew.
func TestReadDropsStatus(t *testing.T) {
	objs, err := Read(strings.NewReader(claimDoc), "test")
	if err != nil {
		t.Fatal(err)
	}
	c := objs.Claims[0].Claim
	if c.Status.Allocation != nil || c.Spec.Devices.Requests[0].Exactly.DeviceClassName != "gpu.nvidia.com" {
		t.Errorf("claim read as %+v", c)
	}
}

// A v1beta1 claim or template reads as v1 writes it: a request's own fields
// under exactly, firstAvailable as it is, with the empty fields Go writes
// beside it (deviceClassName has no omitempty there) left out.
func TestReadV1beta1(t *testing.T) {
	in := `apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaimTemplate
metadata: {name: two, namespace: ns}
spec:
  spec:
    devices:
      requests:
      - name: gpus
        deviceClassName: gpu.nvidia.com
        allocationMode: ExactCount
        count: 2
        selectors: [{cel: {expression: "true"}}]
      - name: any
        deviceClassName: ""
        firstAvailable: [{name: mig, deviceClassName: mig.nvidia.com}]
      constraints: [{requests: [gpus], matchAttribute: gpu.nvidia.com/nvlinkClique}]
---
apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaim
metadata: {name: one, namespace: ns}
spec: {devices: {requests: [{name: gpu, deviceClassName: gpu.nvidia.com, firstAvailable: null}]}}
`
	objs, err := Read(strings.NewReader(in), "test")
	if err != nil {
		t.Fatal(err)
	}
	if len(objs.Claims) != 2 {
		t.Fatalf("%d claims, want 2", len(objs.Claims))
	}
	for _, c := range objs.Claims {
		if c.Err != nil {
			t.Errorf("%s: %v", c, c.Err)
		}
	}
	tpl, one := objs.Claims[0].Claim.Spec.Devices, objs.Claims[1].Claim.Spec.Devices
	if x := tpl.Requests[0].Exactly; x == nil || x.DeviceClassName != "gpu.nvidia.com" || x.Count != 2 || x.AllocationMode != "ExactCount" || len(x.Selectors) != 1 {
		t.Errorf("template's first request %+v", tpl.Requests[0])
	}
	if r := tpl.Requests[1]; r.Exactly != nil || len(r.FirstAvailable) != 1 || r.FirstAvailable[0].DeviceClassName != "mig.nvidia.com" {
		t.Errorf("template's second request %+v", r)
	}
	if len(tpl.Constraints) != 1 || string(*tpl.Constraints[0].MatchAttribute) != "gpu.nvidia.com/nvlinkClique" {
		t.Errorf("constraints %+v", tpl.Constraints)
	}
	if x := one.Requests[0].Exactly; x == nil || x.DeviceClassName != "gpu.nvidia.com" {
		t.Errorf("claim's request %+v", one.Requests[0])
	}
}

// zeros reads as n comment lines, made as they are read.
type zeros struct{ n int }

func (z *zeros) Read(p []byte) (int, error) {
	if z.n <= 0 {
		return 0, io.EOF
	}
	k := min(len(p), z.n)
	for i := range p[:k] {
		p[i] = "#\n"[i%2]
	}
	z.n -= k
	return k, nil
}

func TestReadRefusesHugeInput(t *testing.T) {
	if _, err := Read(&zeros{MaxManifestBytes + 2}, "big"); err == nil || !strings.Contains(err.Error(), "big: more than 128 MiB") {
		t.Fatalf("error %v, want the size named", err)
	}
}

func TestValidate(t *testing.T) {
	exactly := func(class string, mode resourceapi.DeviceAllocationMode, count int64) *resourceapi.ExactDeviceRequest {
		return &resourceapi.ExactDeviceRequest{DeviceClassName: class, AllocationMode: mode, Count: count}
	}
	for _, tt := range []struct {
		name string
		reqs []resourceapi.DeviceRequest
		want string
	}{
		{"none", nil, ""},
		{"exact", []resourceapi.DeviceRequest{{Name: "a", Exactly: exactly("c", "", 0)}}, ""},
		{"all", []resourceapi.DeviceRequest{{Name: "a", Exactly: exactly("c", resourceapi.DeviceAllocationModeAll, 0)}}, ""},
		{"neither", []resourceapi.DeviceRequest{{Name: "a"}}, "request a: want exactly one of exactly and firstAvailable"},
		{"both", []resourceapi.DeviceRequest{{Name: "a", Exactly: exactly("c", "", 0), FirstAvailable: []resourceapi.DeviceSubRequest{{Name: "s", DeviceClassName: "c"}}}}, "want exactly one"},
		{"no name", []resourceapi.DeviceRequest{{Exactly: exactly("c", "", 0)}}, "request 0: no name"},
		{"twice", []resourceapi.DeviceRequest{{Name: "a", Exactly: exactly("c", "", 0)}, {Name: "a", Exactly: exactly("c", "", 0)}}, "request a: the name is given twice"},
		{"no class", []resourceapi.DeviceRequest{{Name: "a", Exactly: exactly("", "", 0)}}, "request a: no deviceClassName"},
		{"negative", []resourceapi.DeviceRequest{{Name: "a", Exactly: exactly("c", "", -1)}}, "request a: count -1, want at least 1"},
		{"more than a claim gets: the allocator says so", []resourceapi.DeviceRequest{{Name: "a", Exactly: exactly("c", "", 33)}}, ""},
		{"count with All", []resourceapi.DeviceRequest{{Name: "a", Exactly: exactly("c", resourceapi.DeviceAllocationModeAll, 2)}}, "count 2 with allocationMode All"},
		{"mode", []resourceapi.DeviceRequest{{Name: "a", Exactly: exactly("c", "Some", 1)}}, `allocationMode "Some"`},
		{"subrequest", []resourceapi.DeviceRequest{{Name: "a", FirstAvailable: []resourceapi.DeviceSubRequest{{Name: "s", DeviceClassName: "c", Count: -3}}}}, "request a/s: count -3"},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c := &resourceapi.ResourceClaim{Spec: resourceapi.ResourceClaimSpec{Devices: resourceapi.DeviceClaim{Requests: tt.reqs}}}
			Default(c)
			err := Validate(c)
			if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
				t.Errorf("Validate: %v, want %q", err, tt.want)
			}
		})
	}
}

// tinyNode is two devices of a driver "d", and the class "c" of them all.
func tinyNode() *Node {
	dev := func(name string, n int64) resourceapi.Device {
		return resourceapi.Device{Name: name, Attributes: map[resourceapi.QualifiedName]resourceapi.DeviceAttribute{
			"index": {IntValue: ptr.To(n)}, "type": {StringValue: ptr.To("gpu")},
		}}
	}
	res := resourceslice.DriverResources{Pools: map[string]resourceslice.Pool{
		"n": {Slices: []resourceslice.Slice{{Devices: []resourceapi.Device{dev("a", 0), dev("b", 1)}}}},
	}}
	class := &resourceapi.DeviceClass{}
	class.Name = "c"
	return New("n", "d", res, []*resourceapi.DeviceClass{class})
}

// FuzzRead: any input is read or refused with an error, never a panic, and
// every claim read that Validate passes is one the scheduler's allocator
// takes without a panic.
func FuzzRead(f *testing.F) {
	f.Add(claimDoc)
	f.Add(`{"kind": "List", "items": [{"kind": "DeviceClass", "apiVersion": "resource.k8s.io/v1", "metadata": {"name": "c"}}]}`)
	f.Add(`apiVersion: resource.k8s.io/v1
kind: ResourceClaimTemplate
metadata: {name: t}
spec: {spec: {devices: {requests: [{name: r, exactly: {deviceClassName: c, count: 2, selectors: [{cel: {expression: "device.attributes['d'].index > 0"}}]}}]}}}
`)
	f.Add(`apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaimTemplate
metadata: {name: t}
spec: {spec: {devices: {requests: [{name: r, deviceClassName: c, count: 2}, null]}}}
`)
	f.Add(`{"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimList", "items": [{"metadata": {"name": "a"}, "spec": {"devices": {"requests": [{"name": "r", "firstAvailable": [{"name": "s", "deviceClassName": "c", "allocationMode": "All"}]}]}}}]}`)
	f.Fuzz(func(t *testing.T, in string) {
		objs, err := Read(strings.NewReader(in), "fuzz")
		if err != nil {
			return
		}
		node := tinyNode()
		for _, c := range objs.Claims {
			if c.Claim == nil || c.Claim.Name == "" {
				t.Fatalf("claim %+v read without a name or a claim", c)
			}
			claim := c.Claim.DeepCopy()
			Default(claim)
			if Validate(claim) != nil {
				continue
			}
			if _, err := node.Allocate(context.Background(), claim); err != nil && !errors.Is(err, ErrUnsatisfiable) {
				continue // an error names the claim; a panic fails the fuzz
			}
			node.Release()
		}
	})
}
