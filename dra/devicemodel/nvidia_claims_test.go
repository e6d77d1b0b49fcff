package devicemodel_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	resourceapi "k8s.io/api/resource/v1"
	"k8s.io/apimachinery/pkg/types"
	"sigs.k8s.io/yaml"

	"github.com/gpu-agent/gpu-agent/dra/devicemodel"
	"github.com/gpu-agent/gpu-agent/dra/schedsim"
)

// nvidiaRepoEnv names a checkout of NVIDIA's DRA driver
// (github.com/kubernetes-sigs/dra-driver-nvidia-gpu). Its files are read from
// there and never copied into this repository, so the test is skipped
// without it.
const nvidiaRepoEnv = "NVIDIA_DRA_DRIVER_REPO"

// nvidiaSpecDirs are where NVIDIA's repository keeps the claims its users
// copy: the demos, the bats specs and the e2e templates.
var nvidiaSpecDirs = []string{
	"demo/specs/quickstart",
	"demo/specs/quickstart/v1",
	"demo/specs/quickstart/v1beta1",
	"demo/specs/extended-resources",
	"demo/specs/consumable-shares",
	"demo/specs/selectors",
	"demo/specs/mig+mps",
	"demo/specs/imex",
	"demo/specs/fabric-manager-partitioning",
	"tests/bats/specs",
	"test/e2e/framework/specs",
}

// nvidiaNodes are the nodes each claim is tried on: whole GPUs, static MIG,
// MIG devices made on demand, GPUs the node config shares 4 ways, and a
// GH200 (96GB), whose MIG profiles NVIDIA's extended-resources demo names.
var nvidiaNodes = []struct{ name, profile string }{
	{"a100", "dgx-a100"},
	{"a100-dyn", "dgx-a100 dynamic"},
	{"h100-mig", "dgx-h100-mig"},
	{"h100-dyn", "dgx-h100 dynamic"},
	{"a100-shared", "dgx-a100 shared"},
	{"gh200-dyn", "gh200 dynamic"},
}

// nvidiaNotAllocating are the claims that allocate on none of nvidiaNodes,
// by file and name, with why: what is not a gap of gpu-agent's.
var nvidiaNotAllocating = map[string]string{
	"gpu-test-vfiopci.yaml/single-gpu":                                     "vfio-pci passthrough (type 'vfio'): gpu-agent has no VFIO devices",
	"gpu-test-vfio-config.yaml/single-gpu":                                 "vfio-pci passthrough (type 'vfio'): gpu-agent has no VFIO devices",
	"imex-test1.yaml/deployment0-imex-channel":                             "IMEX channel (class imex.nvidia.com, a retired driver): not gpu-agent's",
	"imex-test1.yaml/deployment1-imex-channel":                             "IMEX channel (class imex.nvidia.com, a retired driver): not gpu-agent's",
	"imex-test1.yaml/deployment2-imex-channel":                             "IMEX channel (class imex.nvidia.com, a retired driver): not gpu-agent's",
	"imex-test1.yaml/deployment3-imex-channel":                             "IMEX channel (class imex.nvidia.com, a retired driver): not gpu-agent's",
	"channel-injection.yaml/imex-channel-injection":                        "ComputeDomain channel (compute-domain.nvidia.com): not gpu-agent's",
	"channel-injection-all.yaml/imex-channel-injection-all":                "ComputeDomain channels (compute-domain.nvidia.com): not gpu-agent's",
	"gpu-cel-nomatch.yaml/rct-cel-nomatch":                                 "written not to match (its test expects it unschedulable)",
	"error-handling.yaml.tmpl/h300-nonexistent-template":                   "written not to match: a product that does not exist",
	"gpu-test-vfio-config.yaml/single-gpu-full-vfioconfig":                 "vfio-pci passthrough (type 'vfio'): gpu-agent has no VFIO devices",
	"resourceClaimTemplates.yaml/fm-partition-2gpu":                        "Fabric Manager partition of VFIO GPUs (partition2 attribute): gpu-agent has neither",
	"rc-opaque-cfg-unknown-field.yaml.tmpl/batssuite-rc-bad-opaque-config": "ComputeDomain channel (compute-domain.nvidia.com): not gpu-agent's",
}

type nvidiaClaim struct {
	file    string
	claim   *resourceapi.ResourceClaim
	skipWhy string
}

// templateLine is a line that is only a Helm or Go template action.
var templateLine = regexp.MustCompile(`^\s*\{\{.*\}\}\s*$`)

// templateValues fill in NVIDIA's templates as their tests do: a driver
// version the node's is newer than, a memory size and product its GPUs have,
// and the compute-domain channel class.
var templateValues = map[string]string{
	"{{ .Namespace }}":                 "default",
	"{{ .DriverVersion }}":             "535.0.0",
	"{{ .RequiredMemoryGi }}":          "16",
	"{{ .ProductPattern }}":            "a100",
	"{{ .Replicas }}":                  "2",
	"${TEST_K8S_RESOURCE_API_VERSION}": "v1",
	"${TEST_DEVCLASSNAME_CD_CHANNEL}":  "exactly: {deviceClassName: compute-domain-default-channel.nvidia.com}",
}

// untemplate makes NVIDIA's templated specs plain YAML: the API version and
// namespace fields are filled in, and lines that are only actions dropped.
func untemplate(b []byte) []byte {
	var out bytes.Buffer
	for _, line := range strings.Split(string(b), "\n") {
		if strings.HasPrefix(strings.TrimSpace(line), "apiVersion: {{") {
			line = "apiVersion: resource.k8s.io/v1"
		}
		if templateLine.MatchString(line) {
			continue
		}
		for from, to := range templateValues {
			line = strings.ReplaceAll(line, from, to)
		}
		out.WriteString(line + "\n")
	}
	return out.Bytes()
}

// readNVIDIA reads the DeviceClasses of NVIDIA's Helm chart and every spec
// file's classes and claims. A claim template becomes the claim it makes; a
// workload asking for an extended resource becomes the claim the scheduler
// makes for it (one request per resource, of the class that maps it).
func readNVIDIA(t *testing.T, repo string) (classes []*resourceapi.DeviceClass, claims []nvidiaClaim) {
	t.Helper()
	chart, _ := filepath.Glob(filepath.Join(repo, "deployments/helm/*/templates/deviceclass-*.yaml"))
	if len(chart) == 0 {
		t.Fatalf("%s: no deployments/helm/*/templates/deviceclass-*.yaml; is it NVIDIA's DRA driver?", repo)
	}
	var files []string
	for _, d := range nvidiaSpecDirs {
		m, _ := filepath.Glob(filepath.Join(repo, d, "*.yaml*"))
		files = append(files, m...)
	}
	type doc struct {
		file string
		b    []byte
	}
	var docs []doc
	for _, f := range append(chart, files...) {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		rel, _ := filepath.Rel(repo, f)
		for _, d := range regexp.MustCompile(`(?m)^---\s*$`).Split(string(untemplate(b)), -1) {
			docs = append(docs, doc{rel, []byte(d)})
		}
	}
	var workloads []doc
	for _, d := range docs {
		var meta struct {
			APIVersion string `json:"apiVersion"`
			Kind       string `json:"kind"`
			Metadata   struct {
				Name string `json:"name"`
			} `json:"metadata"`
		}
		if err := yaml.Unmarshal(d.b, &meta); err != nil {
			t.Errorf("%s: %v", d.file, err)
			continue
		}
		switch meta.Kind {
		case "DeviceClass":
			c := &resourceapi.DeviceClass{}
			if err := yaml.Unmarshal(d.b, c); err != nil {
				t.Errorf("%s: %v", d.file, err)
				continue
			}
			classes = append(classes, c)
		case "ResourceClaim", "ResourceClaimTemplate":
			if v := meta.APIVersion; !schedsim.Served(v) {
				// Read as v1 only to be listed: no Kubernetes we support
				// serves it.
				c := &resourceapi.ResourceClaim{}
				c.Name = meta.Metadata.Name
				claims = append(claims, nvidiaClaim{file: d.file, claim: c, skipWhy: v + ", which Kubernetes no longer serves"})
				continue
			}
			// As config validate --claims reads them: v1beta1 as the API
			// server would serve it at v1.
			objs, err := schedsim.Read(bytes.NewReader(d.b), d.file)
			if err == nil && (len(objs.Claims) != 1 || objs.Claims[0].Err != nil) {
				err = fmt.Errorf("read %+v, want one claim read whole", objs.Claims)
			}
			if err != nil {
				t.Errorf("%s: %v", d.file, err)
				continue
			}
			nc := nvidiaClaim{file: d.file, claim: objs.Claims[0].Claim}
			claims = append(claims, nc)
		case "Pod", "Deployment", "Job", "StatefulSet":
			workloads = append(workloads, d)
		}
	}
	byExtended := map[corev1.ResourceName]string{}
	for _, c := range classes {
		if c.Spec.ExtendedResourceName != nil {
			byExtended[corev1.ResourceName(*c.Spec.ExtendedResourceName)] = c.Name
		}
	}
	for _, d := range workloads {
		var w struct {
			Metadata struct {
				Name string `json:"name"`
			} `json:"metadata"`
			Spec struct {
				corev1.PodSpec `json:",inline"`
				Template       struct {
					Spec corev1.PodSpec `json:"spec"`
				} `json:"template"`
			} `json:"spec"`
		}
		if err := yaml.Unmarshal(d.b, &w); err != nil {
			t.Errorf("%s: %v", d.file, err)
			continue
		}
		ctrs := append(w.Spec.Containers, w.Spec.Template.Spec.Containers...)
		c := &resourceapi.ResourceClaim{}
		c.Name = w.Metadata.Name + "-extended-resources"
		for i, ctr := range ctrs {
			for _, name := range slices.Sorted(func(yield func(corev1.ResourceName) bool) {
				for n := range ctr.Resources.Limits {
					if !yield(n) {
						return
					}
				}
			}) {
				if !strings.Contains(string(name), "/") {
					continue
				}
				class, ok := byExtended[name]
				if !ok {
					t.Errorf("%s: %s asks for %s, which no DeviceClass maps", d.file, w.Metadata.Name, name)
					continue
				}
				q := ctr.Resources.Limits[name]
				c.Spec.Devices.Requests = append(c.Spec.Devices.Requests, resourceapi.DeviceRequest{
					Name: fmt.Sprintf("container-%d-request-%d", i, len(c.Spec.Devices.Requests)),
					Exactly: &resourceapi.ExactDeviceRequest{
						DeviceClassName: class, AllocationMode: resourceapi.DeviceAllocationModeExactCount, Count: q.Value(),
					},
				})
			}
		}
		if len(c.Spec.Devices.Requests) > 0 {
			claims = append(claims, nvidiaClaim{file: d.file, claim: c})
		}
	}
	return classes, claims
}

// TestNVIDIAClaims allocates every claim of NVIDIA's DRA driver's demos,
// tests and e2e specs, with its chart's DeviceClasses, against gpu-agent's
// slices on a few simulated nodes, and logs which allocate where. It fails
// when a claim allocates nowhere and is not among nvidiaNotAllocating.
//
//	NVIDIA_DRA_DRIVER_REPO=/path/to/dra-driver-nvidia-gpu go test -run TestNVIDIAClaims -v ./dra/devicemodel
func TestNVIDIAClaims(t *testing.T) {
	repo := os.Getenv(nvidiaRepoEnv)
	if repo == "" {
		t.Skip(nvidiaRepoEnv + " names no checkout of NVIDIA's DRA driver")
	}
	classes, claims := readNVIDIA(t, repo)
	for _, c := range classes {
		t.Logf("class %s: %v", c.Name, c.Spec.Selectors[0].CEL.Expression)
	}
	var yes, no, skipped int
	for i, nc := range claims {
		key := filepath.Base(nc.file) + "/" + nc.claim.Name
		if nc.skipWhy != "" {
			skipped++
			t.Logf("| %s %s | - | %s |", nc.file, nc.claim.Name, nc.skipWhy)
			continue
		}
		var on []string
		var why []string
		for _, node := range nvidiaNodes {
			profile, mode, _ := strings.Cut(node.profile, " ")
			_, pool := simPool(t, profile, mode == "dynamic")
			if mode == "shared" {
				for j := range pool.Devices {
					pool.Devices[j].Shares = 4
				}
			}
			n := schedsim.New("node-a", devicemodel.DriverName, devicemodel.Resources("node-a", pool, 1, devicemodel.Dropped{}), classes)
			c := nc.claim.DeepCopy()
			c.Namespace, c.UID = "default", types.UID(fmt.Sprintf("uid-%d", i))
			schedsim.Default(c)
			results, err := n.Allocate(context.Background(), c)
			switch {
			case errors.Is(err, schedsim.ErrUnsatisfiable):
				why = append(why, node.name+": unsatisfiable")
			case err != nil:
				why = append(why, node.name+": "+err.Error())
			default:
				var devs []string
				for _, r := range results[0].Devices.Results {
					devs = append(devs, r.Device)
				}
				on = append(on, node.name+" ("+strings.Join(devs, ",")+")")
			}
		}
		want, known := nvidiaNotAllocating[key]
		switch {
		case len(on) > 0:
			yes++
			t.Logf("| %s %s | yes | %s |", nc.file, nc.claim.Name, strings.Join(on, "; "))
			if known {
				t.Errorf("%s allocates now; drop it from nvidiaNotAllocating (%s)", key, want)
			}
		case known:
			no++
			t.Logf("| %s %s | no | %s; %s |", nc.file, nc.claim.Name, want, strings.Join(why, "; "))
		default:
			no++
			t.Errorf("| %s | no | %s |", key, strings.Join(why, "; "))
		}
	}
	t.Logf("%d claims: %d allocate, %d do not, %d of an API Kubernetes no longer serves", len(claims), yes, no, skipped)
}
