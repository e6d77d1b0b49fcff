package schedsim

import (
	"bytes"
	"strings"
	"testing"
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
			name:    "v1alpha3 is refused by name",
			in:      strings.Replace(claimDoc, "resource.k8s.io/v1", "resource.k8s.io/v1alpha3", 1),
			wantErr: "test: document 1: ResourceClaim ns/one: apiVersion resource.k8s.io/v1alpha3 is not read",
		},
		{
			name:    "a v1beta1 request's misspelt field",
			in:      "apiVersion: resource.k8s.io/v1beta1\nkind: ResourceClaim\nmetadata: {name: a}\nspec: {devices: {requests: [{name: r, deviceClass: x}]}}\n",
			wantErr: `ResourceClaim a: spec: json: unknown field "deviceClass"`,
		},
		{
			name:    "a misspelt field is refused, not dropped",
			in:      strings.Replace(claimDoc, "deviceClassName", "deviceClass", 1),
			wantErr: `ResourceClaim ns/one: spec: json: unknown field "deviceClass"`,
		},
		{
			name:    "the document that fails is named",
			in:      claimDoc + "---\nkind: DeviceClass\napiVersion: resource.k8s.io/v1\nmetadata: {}\n",
			wantErr: "test: document 2: DeviceClass: no metadata.name",
		},
		{
			name:    "not YAML",
			in:      "{{{",
			wantErr: "test: document 1:",
		},
		{
			name:    "an item of a List",
			in:      `{"kind": "List", "items": [{"kind": "ResourceClaim", "apiVersion": "resource.k8s.io/v1", "metadata": {"name": "a"}, "spec": {"devices": 3}}]}`,
			wantErr: "List item 0: ResourceClaim a: spec:",
		},
		{
			name:    "Lists within Lists",
			in:      strings.Repeat(`{"kind": "List", "items": [`, 6) + strings.Repeat("]}", 6),
			wantErr: "Lists nested more than 4 deep",
		},
		{
			name:    "another group's kind of the same name",
			in:      "apiVersion: example.com/v1\nkind: ResourceClaim\nmetadata: {name: x}\nspec: {whatever: 1}\n",
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
			}
			if strings.Join(got, ",") != strings.Join(tt.claims, ",") || len(objs.Classes) != tt.classes || objs.Skipped != tt.skipped {
				t.Errorf("claims %q, %d classes, %d skipped; want %q, %d, %d", got, len(objs.Classes), objs.Skipped, tt.claims, tt.classes, tt.skipped)
			}
		})
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
// under exactly, firstAvailable as it is.
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
        firstAvailable: [{name: mig, deviceClassName: mig.nvidia.com}]
      constraints: [{requests: [gpus], matchAttribute: gpu.nvidia.com/nvlinkClique}]
---
apiVersion: resource.k8s.io/v1beta1
kind: ResourceClaim
metadata: {name: one, namespace: ns}
spec: {devices: {requests: [{name: gpu, deviceClassName: gpu.nvidia.com}]}}
`
	objs, err := Read(strings.NewReader(in), "test")
	if err != nil {
		t.Fatal(err)
	}
	if len(objs.Claims) != 2 {
		t.Fatalf("%d claims, want 2", len(objs.Claims))
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

func TestReadRefusesHugeInput(t *testing.T) {
	big := bytes.Repeat([]byte("#\n"), MaxManifestBytes/2+1)
	if _, err := Read(bytes.NewReader(big), "big"); err == nil || !strings.Contains(err.Error(), "big: more than 128 MiB") {
		t.Fatalf("error %v, want the size named", err)
	}
}

// FuzzRead: any input is read or refused with an error, never a panic, and
// every claim read has a spec the allocator can take.
func FuzzRead(f *testing.F) {
	f.Add(claimDoc)
	f.Add("apiVersion: resource.k8s.io/v1beta1\nkind: ResourceClaimTemplate\nmetadata: {name: t}\nspec: {spec: {devices: {requests: [{name: r, count: 2}, null]}}}\n")
	f.Add(`{"kind": "List", "items": [{"kind": "DeviceClass", "apiVersion": "resource.k8s.io/v1", "metadata": {"name": "c"}}]}`)
	f.Add("apiVersion: resource.k8s.io/v1\nkind: ResourceClaimTemplate\nmetadata: {name: t}\nspec: {spec: {devices: {requests: [{name: r}]}}}\n")
	f.Fuzz(func(t *testing.T, in string) {
		objs, err := Read(strings.NewReader(in), "fuzz")
		if err != nil {
			return
		}
		for _, c := range objs.Claims {
			if c.Claim == nil || c.Name == "" {
				t.Fatalf("claim %+v read without a name or a claim", c)
			}
			Default(c.Claim)
		}
	})
}
