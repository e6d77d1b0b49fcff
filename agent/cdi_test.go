package agent

import (
	"encoding/json"
	"os"
	"slices"
	"testing"

	specs "tags.cncf.io/container-device-interface/specs-go"

	"github.com/gpu-agent/gpu-agent/cdi"
	"github.com/gpu-agent/gpu-agent/dra"
	"github.com/gpu-agent/gpu-agent/gpu/sim"
)

// withCDI gives the agent a CDI keeper writing under dir.
func withCDI(dir string) harnessOption {
	return func(h *harness) {
		w, err := cdi.NewWriter(dir)
		if err != nil {
			h.t.Fatal(err)
		}
		h.opts.CDI = &cdi.Keeper{W: w}
	}
}

// specNames reads the node's CDI spec and returns its device names; nil
// when there is no spec file.
func specNames(t *testing.T, dir string) []string {
	t.Helper()
	data, err := os.ReadFile(dir + "/" + cdi.NodeSpec + ".json")
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		t.Fatal(err)
	}
	var s specs.Spec
	if err := json.Unmarshal(data, &s); err != nil {
		t.Fatal(err)
	}
	if s.Kind != "nvidia.com/gpu" {
		t.Errorf("spec kind %q, want nvidia.com/gpu", s.Kind)
	}
	var names []string
	for _, d := range s.Devices {
		names = append(names, d.Name)
	}
	return names
}

func cdiConfig(strategy string) string {
	return "version: v1\nconfigs:\n  default:\n    devicePlugin:\n      deviceListStrategy: " + strategy + "\n"
}

// The spec exists while the config's device list strategy uses CDI, lists
// every GPU by UUID and index, follows the MIG layout, and goes when the
// strategy no longer uses CDI.
func TestCDISpecFollowsConfigAndLayout(t *testing.T) {
	dir := t.TempDir()
	node := simNode(t, "dgx-a100", sim.WithMIGEnabled())
	h := newHarness(t, node, withCDI(dir), withMIG())
	h.config(cdiConfig("envvar"))
	if names := specNames(t, dir); names != nil {
		t.Fatalf("envvar: spec with %v written, want none", names)
	}
	if st := h.a.Status().CDI; st == nil || st.Spec != "" || st.Error != "" {
		t.Errorf("envvar: /status cdi %+v, want no spec, no error", st)
	}

	h.config(cdiConfig("cdi-cri"))
	names := specNames(t, dir)
	inv, err := h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	if len(names) != 2*len(inv.GPUs)+1 || !slices.Contains(names, inv.GPUs[3].UUID) || !slices.Contains(names, "3") || !slices.Contains(names, "all") {
		t.Errorf("cdi-cri: spec names %v, want each GPU by UUID and index, and all", names)
	}
	if r := h.pub.last().Resources[ResourceGPU]; r == nil || !r.Delivery.CDIOnly() {
		t.Errorf("cdi-cri: the catalog does not deliver by CDI alone: %+v", r)
	}
	if st := h.a.Status().CDI; st == nil || st.Spec != dir+"/gpu-agent.json" || st.Devices != len(names) {
		t.Errorf("/status cdi %+v, want the spec path and %d devices", st, len(names))
	}

	h.config(mixedLayout(`{"3g.20gb": 2}`) + "    devicePlugin:\n      deviceListStrategy: cdi-cri\n")
	inv, err = h.opts.Observer.Inventory()
	if err != nil {
		t.Fatal(err)
	}
	names = specNames(t, dir)
	for _, m := range inv.GPUs[0].Instances {
		if !slices.Contains(names, m.UUID) {
			t.Errorf("MIG device %s missing from the spec %v", m.UUID, names)
		}
	}
	if !slices.Contains(names, "0:1") {
		t.Errorf("spec %v lacks the index name 0:1 of GPU 0's second MIG device", names)
	}

	h.config(cdiConfig("envvar"))
	if names := specNames(t, dir); names != nil {
		t.Errorf("back to envvar: spec %v still there", names)
	}
}

// A MIG device made on demand for a claim is in the spec before Prepare
// answers with its CDI name: the runtime resolves the name right after.
func TestCDISpecHasDynamicMIGBeforePrepareReturns(t *testing.T) {
	dir := t.TempDir()
	rec := &draRecorder{}
	h := newHarness(t, simNode(t, "dgx-h100", sim.WithMIGEnabled(), sim.WithImmediateMIGModeChange()), withDRA(rec), withMIG(), withCDI(dir))
	h.config(wholeGPUs)
	if names := specNames(t, dir); len(names) != 17 {
		t.Fatalf("DRA on: spec names %v, want 8 GPUs by UUID and index, and all", names)
	}
	got := h.prepare(claim("uid-1", "one", "gpu-2-mig-1g10gb-6"))["uid-1"]
	if got.Err != nil {
		t.Fatal(got.Err)
	}
	names := specNames(t, dir)
	for _, d := range got.Devices {
		for _, id := range d.CDIDevices {
			if !slices.Contains(names, id[len(cdi.Kind)+1:]) {
				t.Errorf("Prepare answered %s, which the spec %v does not define", id, names)
			}
		}
	}
	h.unprepare(dra.ClaimRef{UID: "uid-1", Namespace: "default", Name: "one"})
	if names := specNames(t, dir); slices.ContainsFunc(names, func(n string) bool { return n == "2:0" }) {
		t.Errorf("released MIG device still in the spec: %v", names)
	}
}
