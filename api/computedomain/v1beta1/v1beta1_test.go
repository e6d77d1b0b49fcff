package v1beta1_test

import (
	"encoding/json"
	"reflect"
	"strings"
	"testing"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/yaml"

	cd "github.com/gpu-agent/gpu-agent/api/computedomain/v1beta1"
)

// A ComputeDomain written as NVIDIA's docs write one reads into the types
// field for field (our own manifest of the same shape).
const domainYAML = `
apiVersion: resource.nvidia.com/v1beta1
kind: ComputeDomain
metadata:
  name: train-a
  namespace: team-a
spec:
  numNodes: 2
  channel:
    resourceClaimTemplate:
      name: train-a-channel
status:
  status: Ready
  nodes:
  - name: node-1
    ipAddress: 10.0.0.11
    cliqueID: 3b2f1e0c-9d4a-4f7e-8b1c-2a5d6e7f8091.1
    index: 0
    status: Ready
`

func TestComputeDomainDecodes(t *testing.T) {
	var got cd.ComputeDomain
	if err := yaml.NewYAMLOrJSONDecoder(strings.NewReader(domainYAML), 4096).Decode(&got); err != nil {
		t.Fatal(err)
	}
	want := cd.ComputeDomain{
		TypeMeta:   metav1.TypeMeta{APIVersion: cd.APIVersion, Kind: cd.KindComputeDomain},
		ObjectMeta: metav1.ObjectMeta{Name: "train-a", Namespace: "team-a"},
		Spec: cd.ComputeDomainSpec{NumNodes: 2, Channel: &cd.ComputeDomainChannelSpec{
			ResourceClaimTemplate: cd.ComputeDomainResourceClaimTemplate{Name: "train-a-channel"}}},
		Status: cd.ComputeDomainStatus{Status: cd.StatusReady, Nodes: []cd.ComputeDomainNode{{
			Name: "node-1", IPAddress: "10.0.0.11", CliqueID: "3b2f1e0c-9d4a-4f7e-8b1c-2a5d6e7f8091.1", Index: 0, Status: cd.StatusReady}}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("decoded\n%+v\nwant\n%+v", got, want)
	}
	if err := got.Spec.Validate(); err != nil {
		t.Error(err)
	}
	got.Spec.Default()
	if got.Spec.Channel.AllocationMode != cd.AllocationModeSingle {
		t.Errorf("default allocation mode %q", got.Spec.Channel.AllocationMode)
	}
	// A deep copy shares nothing a change could reach through.
	c := got.DeepCopy()
	c.Spec.Channel.ResourceClaimTemplate.Name = "other"
	c.Status.Nodes[0].Name = "other"
	if got.Spec.Channel.ResourceClaimTemplate.Name != "train-a-channel" || got.Status.Nodes[0].Name != "node-1" {
		t.Error("DeepCopy shares the channel or nodes")
	}
	s := runtime.NewScheme()
	if err := cd.AddToScheme(s); err != nil {
		t.Fatal(err)
	}
	if gvks, _, err := s.ObjectKinds(&got); err != nil || gvks[0].Kind != cd.KindComputeDomain || gvks[0].GroupVersion() != cd.SchemeGroupVersion {
		t.Errorf("scheme kinds %v, %v", gvks, err)
	}
}

func TestValidateSpec(t *testing.T) {
	ch := func(name string, mode cd.AllocationMode) *cd.ComputeDomainChannelSpec {
		return &cd.ComputeDomainChannelSpec{ResourceClaimTemplate: cd.ComputeDomainResourceClaimTemplate{Name: name}, AllocationMode: mode}
	}
	tests := []struct {
		spec cd.ComputeDomainSpec
		want string
	}{
		{cd.ComputeDomainSpec{Channel: ch("a", "")}, ""},
		{cd.ComputeDomainSpec{NumNodes: 18, Channel: ch("a", cd.AllocationModeAll)}, ""},
		{cd.ComputeDomainSpec{NumNodes: -1, Channel: ch("a", "")}, "spec.numNodes -1: want 0 or more"},
		{cd.ComputeDomainSpec{}, "spec.channel: required"},
		{cd.ComputeDomainSpec{Channel: ch("", "")}, "spec.channel.resourceClaimTemplate.name: required"},
		{cd.ComputeDomainSpec{Channel: ch("Not_A_Name", "")}, `spec.channel.resourceClaimTemplate.name "Not_A_Name": a lowercase RFC 1123 subdomain`},
		{cd.ComputeDomainSpec{Channel: ch("a", "single")}, `spec.channel.allocationMode "single": want Single or All`},
	}
	for _, tt := range tests {
		err := tt.spec.Validate()
		if tt.want == "" && err != nil || tt.want != "" && (err == nil || !strings.Contains(err.Error(), tt.want)) {
			t.Errorf("Validate(%+v) = %v, want %q", tt.spec, err, tt.want)
		}
	}
}

func TestDecodeConfig(t *testing.T) {
	tests := []struct {
		name string
		raw  string
		want any
		err  string
	}{
		{"channel", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainID":"0c1d"}`,
			&cd.ComputeDomainChannelConfig{APIVersion: cd.APIVersion, Kind: cd.KindComputeDomainChannelConfig, DomainID: "0c1d", AllocationMode: cd.AllocationModeSingle}, ""},
		{"channel, all", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainID":"0c1d","allocationMode":"All"}`,
			&cd.ComputeDomainChannelConfig{APIVersion: cd.APIVersion, Kind: cd.KindComputeDomainChannelConfig, DomainID: "0c1d", AllocationMode: cd.AllocationModeAll}, ""},
		{"daemon", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainDaemonConfig","domainID":"0c1d"}`,
			&cd.ComputeDomainDaemonConfig{APIVersion: cd.APIVersion, Kind: cd.KindComputeDomainDaemonConfig, DomainID: "0c1d"}, ""},
		{"no domain", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainDaemonConfig"}`, nil, "kind ComputeDomainDaemonConfig: domainID: required"},
		{"unknown field", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainID":"x","channels":4}`, nil, `unknown field "channels"`},
		{"field of the other kind", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainDaemonConfig","domainID":"x","allocationMode":"All"}`, nil, `unknown field "allocationMode"`},
		{"duplicate field", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainID":"x","domainID":"y"}`, nil, `duplicate field "domainID"`},
		{"case differs", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainId":"x"}`, nil, `unknown field "domainId"`},
		{"bad mode", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainID":"x","allocationMode":"Some"}`, nil, `allocationMode "Some": want Single or All`},
		{"wrong type", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainID":7}`, nil, "domainID"},
		{"other version", `{"apiVersion":"resource.nvidia.com/v1","kind":"ComputeDomainChannelConfig","domainID":"x"}`, nil, `apiVersion "resource.nvidia.com/v1": want resource.nvidia.com/v1beta1`},
		{"GPU config", `{"apiVersion":"resource.nvidia.com/v1beta1","kind":"GpuConfig"}`, nil, `kind "GpuConfig": want ComputeDomainChannelConfig or ComputeDomainDaemonConfig`},
		{"not an object", `[]`, nil, "not a JSON object"},
		{"too large", `{"apiVersion":"` + strings.Repeat("x", cd.MaxConfigBytes) + `"}`, nil, "above the"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := cd.DecodeConfig([]byte(tt.raw))
			if tt.err != "" {
				if err == nil || !strings.Contains(err.Error(), tt.err) || got != nil {
					t.Fatalf("DecodeConfig = %+v, %v; want an error containing %q", got, err, tt.err)
				}
				return
			}
			if err != nil || !reflect.DeepEqual(got, tt.want) {
				t.Fatalf("DecodeConfig = %+v, %v; want %+v", got, err, tt.want)
			}
		})
	}
}

// FuzzDecodeConfig decodes any bytes as an opaque config. What it accepts
// has a domain, a defined allocation mode, and encodes to what decodes to
// the same config again.
func FuzzDecodeConfig(f *testing.F) {
	for _, s := range []string{
		`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainID":"a","allocationMode":"All"}`,
		`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainDaemonConfig","domainID":"b"}`,
		`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainID":"","allocationMode":"Single"}`,
		`{"kind":"ComputeDomainDaemonConfig","apiVersion":"resource.nvidia.com/v1beta1","domainID":"b","domainID":"c"}`,
		`{"apiVersion":"resource.nvidia.com/v1beta1","kind":"ComputeDomainChannelConfig","domainID":"a","allocationMode":null}`,
		`null`, `{}`,
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, raw []byte) {
		got, err := cd.DecodeConfig(raw)
		if err != nil {
			if got != nil || err.Error() == "" {
				t.Fatalf("DecodeConfig = %+v, %q", got, err)
			}
			return
		}
		switch c := got.(type) {
		case *cd.ComputeDomainChannelConfig:
			if c.DomainID == "" || c.AllocationMode != cd.AllocationModeSingle && c.AllocationMode != cd.AllocationModeAll {
				t.Fatalf("accepted %+v", c)
			}
		case *cd.ComputeDomainDaemonConfig:
			if c.DomainID == "" {
				t.Fatalf("accepted %+v", c)
			}
		default:
			t.Fatalf("DecodeConfig returned a %T", got)
		}
		data, err := json.Marshal(got)
		if err != nil {
			t.Fatal(err)
		}
		again, err := cd.DecodeConfig(data)
		if err != nil || !reflect.DeepEqual(again, got) {
			t.Fatalf("re-encoded %s decodes to %+v, %v; want %+v", data, again, err, got)
		}
	})
}
