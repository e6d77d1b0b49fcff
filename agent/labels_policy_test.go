package agent

import (
	"errors"
	"io"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	utilyaml "k8s.io/apimachinery/pkg/util/yaml"

	"github.com/gpu-agent/gpu-agent/config"
	"github.com/gpu-agent/gpu-agent/gpu"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
	"github.com/gpu-agent/gpu-agent/mig"
)

// ownedLabelPattern reads the pattern of the labels gpu-agent owns from the ValidatingAdmissionPolicy that
// holds its service account to them (deploy/manifests/policy.yaml, variable ownedLabel: a CEL string
// literal, which CEL's matches() reads as an RE2 expression, as Go's regexp does).
func ownedLabelPattern(t *testing.T) *regexp.Regexp {
	t.Helper()
	path := filepath.Join("..", "deploy", "manifests", "policy.yaml")
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	dec := utilyaml.NewYAMLOrJSONDecoder(f, 4096)
	for {
		var p admissionregistrationv1.ValidatingAdmissionPolicy
		if err := dec.Decode(&p); errors.Is(err, io.EOF) {
			break
		} else if err != nil {
			t.Fatalf("%s: %v", path, err)
		}
		for _, v := range p.Spec.Variables {
			if v.Name != "ownedLabel" {
				continue
			}
			lit := strings.TrimSpace(v.Expression)
			if len(lit) < 2 || lit[0] != '\'' || lit[len(lit)-1] != '\'' || strings.ContainsAny(lit[1:len(lit)-1], `'\`) {
				t.Fatalf("%s: ownedLabel is %s, want a plain single-quoted CEL string", path, lit)
			}
			return regexp.MustCompile(lit[1 : len(lit)-1])
		}
	}
	t.Fatalf("%s: no policy has the variable ownedLabel", path)
	return nil
}

// TestNodeLabelsOwnedByPolicy: every label NodeLabels derives on the simulated nodes, under configs that give
// each kind (MIG strategies, sharing, mig.config.state), is one the admission policy lets the agent change; the
// labels that pick its config are not. A label added to NodeLabels must be added to the policy too.
func TestNodeLabelsOwnedByPolicy(t *testing.T) {
	owned := ownedLabelPattern(t)
	configs := []string{
		wholeGPUs,
		mixedNoMIG,
		"version: v1\nconfigs:\n  default:\n    mig:\n      strategy: single\n",
		sliced2,
		"version: v1\nconfigs:\n  default:\n    sharing:\n      mps:\n        resources:\n        - name: nvidia.com/gpu\n          replicas: 2\n",
	}
	states := [][]MIGState{nil, {{Phase: mig.PhaseApplied}}, {{Phase: mig.PhasePending}}}
	all := map[string]bool{}
	for _, p := range sim.Profiles() {
		inv, err := gpu.New(simNode(t, p.Name), gpu.Options{})
		if err != nil {
			t.Fatalf("%s: %v", p.Name, err)
		}
		for _, data := range configs {
			f, _, err := config.Parse([]byte(data))
			if err != nil {
				t.Fatal(err)
			}
			for _, st := range states {
				for k := range NodeLabels(inv, config.Selected{Name: "default", Config: f.Configs["default"]}, st) {
					all[k] = true
				}
			}
		}
	}
	// The cases above must keep giving every kind of label.
	for _, k := range []string{LabelMIGConfigState, LabelMIGStrategy, LabelReplicas, "nvidia.com/gpu.slices.gi",
		"nvidia.com/mig-1g.10gb.count", "nvidia.com/mig-1g.10gb.slices.ci", "nvidia.com/cuda.driver.rev", LabelClique} {
		if !all[k] {
			t.Errorf("no simulated node gave label %s (got %v)", k, slices.Sorted(maps.Keys(all)))
		}
	}
	for _, k := range slices.Sorted(maps.Keys(all)) {
		if !owned.MatchString(k) {
			t.Errorf("NodeLabels derives %s, which the admission policy's ownedLabel %s does not let the agent change", k, owned)
		}
	}
	for _, k := range []string{config.ConfigLabel, config.DevicePluginConfigLabel, config.MIGConfigLabel,
		"nvidia.com/gpu.deploy.driver", "kubernetes.io/hostname", "nvidia.com/gpu.present.x"} {
		if owned.MatchString(k) {
			t.Errorf("the admission policy lets the agent change %s, which it does not own", k)
		}
	}
}
